"""A recipe's baseline method (AdamW, Muon, GaLore, APOLLO, Q-GaLore, Q-APOLLO) as a prepared
model and an optimizer: :func:`prepare_baseline` (swap the targets for int8 ``QuantLinear`` where
the method quantizes), :func:`build_baseline_optimizer` and :func:`summarize_baseline`.

The update rules themselves are :mod:`poetxq.baselines`. Embeddings, ``lm_head`` and norms always
train with plain AdamW at ``optim.lr``, as in the authors' scripts; the ``baseline.target_modules``
projections (the hidden matrices) train with the method's rule at ``optim.matrix_lr`` (default
``optim.lr``): AdamW's, Muon's, or the low-rank (and, for ``qgalore``/``qapollo``, int8) update.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from poetxq.baselines import LowRankAdamW, quant_modules, quantize_linears
from poetxq.baselines.muon import MUON_MOMENTUM, MuonAdamW
from poetxq.training.optim import adamw
from poetxq.training.recipe import BaselineConfig, OptimConfig

BASELINE_METHODS = ("adamw", "muon", "galore", "apollo", "qgalore", "qapollo")
_QUANTIZED = ("qgalore", "qapollo")


@dataclass
class BaselineReport:
    """What :func:`prepare_baseline` did: the method, its target layers and weight format."""

    method: str
    targets: list[str] = field(default_factory=list)
    weight_group_size: int | None = None  # None: float weights


def resolved_settings(method: str, cfg: BaselineConfig) -> dict:
    """The low-rank group keys of ``method`` with the method defaults filled in.

    galore/apollo are the unquantized references: fp32 projector and moments, no lazy refresh.

    Raises:
        ValueError: ``method`` is not a low-rank method.
    """
    if method not in ("galore", "apollo", "qgalore", "qapollo"):
        raise ValueError(f"{method!r} is not a low-rank method")
    galore = method in ("galore", "qgalore")
    scale = cfg.scale if cfg.scale is not None else (0.25 if galore else 1.0)
    return {
        "method": "galore" if galore else "apollo",
        "rank": cfg.rank,
        "update_proj_gap": cfg.update_proj_gap,
        "scale": scale,
        "scale_type": cfg.scale_type,
        "norm_growth_limit": cfg.norm_growth_limit,
        "proj_bits": cfg.proj_bits if method == "qgalore" else 32,
        "proj_group_size": cfg.proj_group_size,
        "state_bits": cfg.state_bits if method == "qgalore" else 32,
        "lazy": cfg.lazy_update if method == "qgalore" else False,
        "cos_threshold": cfg.cos_threshold,
        "gamma_proj": cfg.gamma_proj,
        "queue_size": cfg.queue_size,
        "seed": cfg.seed,
    }


def prepare_baseline(model: nn.Module, method: str, cfg: BaselineConfig) -> BaselineReport:
    """Get ``model`` ready for ``method``: swap the targets for ``QuantLinear`` if quantized.

    The model keeps its transformers initialisation (normal, std ``initializer_range``), as in
    the authors' scripts; int8 weights are its round-to-nearest quantization.

    Raises:
        ValueError: unknown method or no target module.
    """
    if method not in BASELINE_METHODS:
        raise ValueError(f"unknown baseline method {method!r}; choose one of {BASELINE_METHODS}")
    report = BaselineReport(method)
    if method in _QUANTIZED:
        g = cfg.weight_group_size or (256 if method == "qgalore" else 128)
        report.targets = quantize_linears(
            model, cfg.target_modules, group_size=g, stochastic_round=cfg.stochastic_round
        )
        report.weight_group_size = g
    else:
        report.targets = [
            name
            for name, mod in model.named_modules()
            if isinstance(mod, nn.Linear) and name.rsplit(".", 1)[-1] in cfg.target_modules
        ]
        if not report.targets:
            raise ValueError(f"no nn.Linear named one of {cfg.target_modules} found in the model")
    return report


#: the name of the hidden matrices' param group, by method (``lowrank`` for the others)
MATRIX_GROUP = {"adamw": "matrices", "muon": "muon"}
MATRIX_GROUPS = (*MATRIX_GROUP.values(), "lowrank")


def build_baseline_optimizer(
    model: nn.Module, report: BaselineReport, cfg: BaselineConfig, optim: OptimConfig
) -> torch.optim.Optimizer:
    """The optimizer of ``report.method`` over ``model`` (prepared by :func:`prepare_baseline`).

    Param groups (``group["name"]``; empty ones dropped), each with ``initial_lr`` set for the
    scheduler:

    * the targets' weights (the hidden matrices) at ``optim.matrix_lr`` (``optim.lr`` when
      unset) with ``optim.weight_decay``: ``matrices`` (``adamw``), ``muon`` (``muon``) or
      ``lowrank`` (the GaLore / APOLLO family, whose update is further scaled by its
      ``scale``);
    * ``decay``: the other ≥ 2-D weights (embeddings, ``lm_head``) at ``optim.lr`` with
      ``optim.weight_decay``;
    * ``no_decay``: 1-D parameters (norms) at ``optim.lr``, no weight decay.

    ``adamw``: ``torch.optim.AdamW``; ``muon``: :class:`~poetxq.baselines.muon.MuonAdamW` (Muon
    on ``muon``, AdamW on the rest); others: :class:`LowRankAdamW`.
    """
    targets = {id(model.get_submodule(n).weight) for n in report.targets}
    matrices, decay, no_decay = [], [], []
    for p in model.parameters():
        if id(p) in targets:
            matrices.append(p)
        elif not p.requires_grad:
            continue
        elif p.dim() >= 2:
            decay.append(p)
        else:
            no_decay.append(p)
    wd = optim.weight_decay
    matrix_lr = optim.matrix_lr if optim.matrix_lr is not None else optim.lr
    name = MATRIX_GROUP.get(report.method, "lowrank")
    first = {"name": name, "params": matrices, "lr": matrix_lr, "weight_decay": wd}
    if name == "lowrank":
        first.update(resolved_settings(report.method, cfg))
    groups = [
        first,
        {"name": "decay", "params": decay, "lr": optim.lr, "weight_decay": wd},
        {"name": "no_decay", "params": no_decay, "lr": optim.lr, "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    for g in groups:
        g["initial_lr"] = g["lr"]
    if report.method == "adamw":
        return adamw(groups, betas=optim.betas, eps=optim.eps)
    if report.method == "muon":
        for g in groups:
            g["algorithm"] = "muon" if g["name"] == "muon" else "adamw"
        return MuonAdamW(groups, betas=optim.betas, eps=optim.eps)
    return LowRankAdamW(groups, betas=optim.betas, eps=optim.eps,
                        quant_modules=quant_modules(model), rounding_seed=cfg.seed)  # fmt: skip


def summarize_baseline(model: nn.Module, report: BaselineReport, cfg: BaselineConfig) -> str:
    """Multi-line summary: method, target layers, weight format, trainable parameters.

    Trainable means updated by the optimizer every step, as for the POET methods
    (:func:`poetxq.model.surgery.summarize`): for Q-GaLore / Q-APOLLO the int8 weights count, as
    the float weights of GaLore / APOLLO do, although they are ``requires_grad=False`` codes
    (:class:`~poetxq.baselines.qlinear.QuantLinear`: the optimizer dequantizes, updates and
    re-quantizes them in place); the line names the two kinds.
    """
    qs = quant_modules(model)
    lines = [f"baseline {report.method}: {len(report.targets)} target linear layers"]
    if report.method == "muon":
        lines.append(
            f"  Muon (torch.optim.Muon, Nesterov momentum {MUON_MOMENTUM}, 5 Newton-Schulz "
            "steps, update RMS matched to AdamW's) on the targets; AdamW on the rest"
        )
    elif report.method != "adamw":
        s = resolved_settings(report.method, cfg)
        lines.append(
            f"  {s['method']} rank {s['rank']}, update_proj_gap {s['update_proj_gap']}, "
            f"scale {s['scale']}"
            + (f", scale_type {s['scale_type']}" if s["method"] == "apollo" else "")
            + (", INT4 projector" if s["proj_bits"] == 4 else "")
            + (", 8-bit Adam states" if s["state_bits"] == 8 else "")
            + (", lazy subspace refresh" if s["lazy"] else "")
        )
        dims = [
            min(m.out_features, m.in_features) for m in map(model.get_submodule, report.targets)
        ]
        full = [d for d in dims if s["rank"] >= d]
        if full:  # LowRankAdamW projects at min(rank, m, n): those layers get no low rank
            lines.append(
                f"  note: rank {s['rank']} is at least min(out, in) = {min(full)}"
                + (f"-{max(full)}" if max(full) != min(full) else "")
                + f" of {len(full)} of {len(dims)} target layers: they train at full rank "
                "(nothing projected away); set baseline.rank below "
                f"{min(dims)} for a low-rank run"
            )
    if qs:
        n = sum(q.weight.numel() for q in qs)
        b = sum(q.nbytes() for q in qs)
        rnd = "stochastic" if cfg.stochastic_round else "nearest"
        lines.append(
            f"  int8 weights (group {report.weight_group_size}, asymmetric, {rnd} rounding): "
            f"{n:,} weights in {b / 2**20:.2f} MiB ({b / max(n, 1):.3f} bytes/weight)"
        )
    floats = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if qs:
        n = sum(q.weight.numel() for q in qs)
        lines.append(
            f"  trainable: {n + floats:,} parameters = {n:,} int8 weights (updated in place by "
            f"{report.method} every step: dequantized, updated, re-quantized; no autograd "
            f"gradient) + {floats:,} float (the unquantized rest: embeddings, lm_head, norms)"
        )
    else:
        lines.append(f"  trainable: {floats:,} float parameters")
    return "\n".join(lines)
