"""Which layers FPO can adapt: per-layer cosine between pseudo-gradient and autograd gradient.

Paper: Patil, Dennis et al., arXiv 2608.14563 (FPO), layer-feasibility diagnostic. On a
calibration batch (16 sequences × 512 tokens there) the FPO pseudo-gradient of every layer's MLP
(:func:`poetxq.adapt.fpo.mlp_pseudo_grads`, at step 0: ``W3_init = W3``) is compared with the
true gradient of the mean next-token loss, by cosine, for ``down_proj`` (W3) alone and for the
whole MLP (W1, W2, W3 flattened together). The paper sees low, noisy cosines in early layers and
a plateau over the last quarter (0.47–0.59 whole-MLP on 3B–8B models); targets come from it.

Choices where the paper gives no rule (documented here and tested):

* **targets**: among the last ``ceil(quarter · n_layers)`` layers (at least one), those whose
  whole-MLP cosine is positive and at least ``level − tolerance`` (default 0.1), where ``level``
  is the median cosine of those layers *without the last one*: the last block's pseudo-gradient
  is exact by construction (cosine 1; nothing after it), so it would set a bar no other layer
  meets. The last layer itself is always kept. On SmolLM2-135M (30 layers; embedded corpus,
  16 × 512 tokens) the last quarter reads 0.32, 0.29, 0.39, 0.46, 0.55, 0.62, 0.61, 1.0: level
  0.46, targets 24–29.
* **starting learning rate**: from the per-layer ratio ``ρ_ℓ = ‖g̃ᵀ·h_mid‖_F / ‖W3‖_F`` (the
  paper's ``‖g̃ ⊗ h‖ / ‖W‖``), median over the targets. SGD with momentum ``μ`` reaches steps of
  ``lr·‖∇‖/(1−μ)``, so ``lr_sgd = step · (1 − μ) / ρ`` gives a relative step of ``step`` per
  update; AdamW's step is about ``lr`` per element whatever the gradient's size, so
  ``lr_adamw = step · rms(W3)`` (median over the targets). ``step`` defaults to 1e-3, a tenth of
  the 1 % clip. The sweep to run is ``lr × {1/5, 1, 5}``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from poetxq.adapt.fpo import (
    MLP_PROJS,
    ActivationCache,
    FPOError,
    layer_pseudo_grads,
    llama_parts,
)
from poetxq.adapt.signal import residual_signal


@dataclass
class LayerCosine:
    """One layer's row of the diagnostic."""

    layer: int
    cos_w3: float  # cosine(FPO ∇W3, autograd ∇W3)
    cos_mlp: float  # cosine over W1, W2, W3 flattened together
    ratio: float  # ‖g̃ᵀ·h_mid‖_F / ‖W3‖_F
    w3_rms: float  # ‖W3‖_F / sqrt(numel)


@dataclass
class Diagnosis:
    """What :func:`diagnose` returns (``asdict`` gives the JSON the CLI writes)."""

    layers: list[LayerCosine]
    targets: list[int]
    lr: dict[str, float]  # {"adamw": ..., "sgd": ...}
    sweep: dict[str, list[float]]  # lr × {1/5, 1, 5}
    loss: float  # mean cross-entropy of the calibration batch (nats)
    n_tokens: int
    rule: str  # the target rule, in words
    settings: dict[str, float | int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        """JSON-ready dict."""
        return asdict(self)


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    denom = float(a.norm() * b.norm())
    return float((a * b).sum()) / denom if denom > 0 else 0.0


def suggest_targets(cos_mlp: Sequence[float], *, quarter: float = 0.25,
                    tolerance: float = 0.1) -> list[int]:  # fmt: skip
    """Target layers from the per-layer whole-MLP cosines (rule in the module docstring).

    Args:
        cos_mlp: one cosine per layer, first layer first.
        quarter: fraction of the last layers to choose from (the paper's plateau: 0.25).
        tolerance: how far below the plateau's level a layer may be.

    Returns:
        Sorted layer indices (never empty).

    Raises:
        FPOError: no layers, or ``quarter`` outside ``(0, 1]``.
    """
    n = len(cos_mlp)
    if n == 0 or not 0 < quarter <= 1:
        raise FPOError(f"need at least one layer and 0 < quarter <= 1 (got {n}, {quarter})")
    last = range(n - max(1, math.ceil(quarter * n)), n)
    level = statistics.median([cos_mlp[i] for i in last[:-1]] or [cos_mlp[n - 1]])
    keep = {i for i in last if cos_mlp[i] > 0 and cos_mlp[i] >= level - tolerance}
    return sorted(keep | {n - 1})


def suggest_lr(ratios: Sequence[float], w3_rms: Sequence[float], *, step: float = 1e-3,
               momentum: float = 0.9) -> dict[str, float]:  # fmt: skip
    """Starting learning rates (rule in the module docstring) from the targets' ratios.

    Args:
        ratios: ``‖g̃ᵀ·h_mid‖_F / ‖W3‖_F`` of each target layer.
        w3_rms: ``rms(W3)`` of each target layer.
        step: wanted relative change of ``W`` per update.
        momentum: SGD's momentum.

    Returns:
        ``{"adamw": lr, "sgd": lr}``.

    Raises:
        FPOError: empty inputs or a zero ratio (no signal: the loss is flat there).
    """
    if not ratios or not w3_rms:
        raise FPOError("no target layer to take a learning rate from")
    ratio = statistics.median(ratios)
    if not ratio > 0:
        raise FPOError("the pseudo-gradient is zero on every target layer; no learning rate")
    return {"adamw": step * statistics.median(w3_rms), "sgd": step * (1 - momentum) / ratio}


def _mlp_weights(parts, i: int) -> list[nn.Parameter]:
    mlp = parts.layers[i].mlp
    return [getattr(mlp, name).weight for name in MLP_PROJS]


def diagnose(
    model: nn.Module,
    windows: torch.Tensor,
    *,
    micro_batch: int = 4,
    chunk_tokens: int = 2048,
    quarter: float = 0.25,
    tolerance: float = 0.1,
    step: float = 1e-3,
) -> Diagnosis:
    """Per-layer cosine of FPO's pseudo-gradient with autograd's, targets and a starting lr.

    One forward and backward per micro-batch gives the true gradients of every MLP (only MLP
    weights require grad meanwhile; ``requires_grad`` is restored after); the same forward's
    cached activations give the pseudo-gradients. Both are accumulated with weight
    ``tokens_mb / tokens_total``, so they are the gradients of the mean loss over the whole
    calibration batch.

    Args:
        model: a transformers Llama-family causal LM (its device and dtype are used).
        windows: calibration windows ``[N, L+1]`` int64 (inputs ``[:, :-1]``, labels ``[:, 1:]``).
        micro_batch: windows per forward/backward.
        chunk_tokens: positions per chunk of the output error.
        quarter, tolerance: the target rule (:func:`suggest_targets`).
        step: relative step for :func:`suggest_lr`.

    Returns:
        :class:`Diagnosis`.

    Raises:
        FPOError: an unsupported model, no window, or ``micro_batch < 1``.
    """
    parts = llama_parts(model)
    if windows.dim() != 2 or windows.shape[0] == 0 or windows.shape[1] < 2:
        raise FPOError("the calibration batch holds no window of at least 2 tokens")
    if micro_batch < 1:
        raise FPOError(f"micro_batch must be at least 1, got {micro_batch}")
    n_layers = len(parts.layers)
    everything = list(range(n_layers))
    device = parts.lm_weight.device
    total = windows[:, 1:].numel()
    saved = {p: p.requires_grad for p in model.parameters()}
    fpo: dict[tuple[int, str], torch.Tensor] = {}
    was_training = model.training
    model.eval()
    loss_sum = 0.0
    try:
        for p in model.parameters():
            p.requires_grad_(False)
            p.grad = None
        for i in everything:
            for w in _mlp_weights(parts, i):
                w.requires_grad_(True)
        for start in range(0, windows.shape[0], micro_batch):
            batch = windows[start : start + micro_batch].to(device)
            ids, labels = batch[:, :-1], batch[:, 1:]
            weight = labels.numel() / total
            with ActivationCache(parts, everything) as cache:
                hidden = parts.base(input_ids=ids, use_cache=False).last_hidden_state
            logits = hidden @ parts.lm_weight.T
            wide = torch.promote_types(logits.dtype, torch.float32)
            loss = F.cross_entropy(logits.to(wide).flatten(0, 1), labels.flatten())
            (loss * weight).backward()
            del logits, loss, hidden
            with torch.no_grad():
                assert cache.hidden is not None
                signal = residual_signal(cache.hidden, parts.norm, parts.lm_weight, labels,
                                         chunk_tokens=chunk_tokens)  # fmt: skip
                loss_sum += signal.loss * labels.numel()
                for i in everything:
                    w3 = parts.layers[i].mlp.down_proj.weight
                    per = layer_pseudo_grads(parts, cache, i, signal.g_tilde, w3)
                    for name, g in per.items():
                        acc = fpo.setdefault((i, name), torch.zeros_like(g))
                        acc.add_(g, alpha=weight)
            del cache, signal
        rows = []
        for i in everything:
            true = [w.grad.to(torch.float64) for w in _mlp_weights(parts, i)]
            ours = [fpo[i, name].to(torch.float64) for name in MLP_PROJS]
            w3 = parts.layers[i].mlp.down_proj.weight.detach().to(torch.float64)
            rows.append(LayerCosine(
                layer=i, cos_w3=_cos(ours[2], true[2]),
                cos_mlp=_cos(torch.cat([t.flatten() for t in ours]),
                             torch.cat([t.flatten() for t in true])),
                ratio=float(ours[2].norm() / w3.norm()),
                w3_rms=float(w3.norm() / math.sqrt(w3.numel())),
            ))  # fmt: skip
    finally:
        for p, flag in saved.items():
            p.requires_grad_(flag)
            p.grad = None
        model.train(was_training)
    targets = suggest_targets([r.cos_mlp for r in rows], quarter=quarter, tolerance=tolerance)
    lr = suggest_lr([rows[i].ratio for i in targets], [rows[i].w3_rms for i in targets], step=step)
    return Diagnosis(
        layers=rows, targets=targets, lr=lr,
        sweep={k: [v / 5, v, v * 5] for k, v in lr.items()},
        loss=loss_sum / total, n_tokens=total,
        rule=f"last {quarter:.0%} of layers with whole-MLP cosine > 0 and >= (their median "
        f"without the exact last layer) - {tolerance}; the last layer always",
        settings={"windows": int(windows.shape[0]), "seq_len": int(windows.shape[1] - 1),
                  "micro_batch": micro_batch, "quarter": quarter, "tolerance": tolerance,
                  "step": step},
    )  # fmt: skip
