"""The FPO output signal: output error, residual-stream signal, final-RMSNorm VJP.

FPO (Patil, Dennis et al., arXiv 2608.14563) replaces back-propagation through the layer stack
by one signal computed at the output: the output error ``e = softmax(z) − onehot(y)`` of the
next-token loss, projected back through the LM head (``g = e · W_lm``, the exact gradient at the
head's input) and through the final RMSNorm by its closed-form vector–Jacobian product, which
gives ``g̃``, the gradient at the residual stream entering the final norm. For Llama-family models
(no norm after the MLP) ``g̃`` is the same for every target layer.

Scale: the loss is the mean cross-entropy over the labelled tokens (as
:func:`poetxq.training.evaluate.causal_lm_loss` and transformers compute it), so ``g̃`` carries the
factor ``1 / n_tokens`` and the pseudo-gradients built from it have autograd's scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

#: label value that marks a position without a target (transformers' convention)
IGNORE_INDEX = -100


def output_error(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> tuple[torch.Tensor, int]:
    """The unnormalised output error ``e = softmax(z) − onehot(y)`` (paper §method, eq. for e).

    Checks the labels and counts the labelled positions (one host synchronization on a GPU);
    :func:`residual_signal` checks its labels once and uses the unchecked arithmetic per chunk.

    Args:
        logits: ``z`` ``[B, L, V]`` (any float dtype; computed in at least fp32).
        labels: ``y`` ``[B, L]`` int64, the next token of each position (already shifted);
            ``ignore_index`` marks positions without a target.
        ignore_index: label of an ignored position; its row of ``e`` is zero.

    Returns:
        ``(e, n)``: ``e`` ``[B, L, V]`` in ``promote(logits.dtype, fp32)``, and ``n`` the number of
        labelled positions. ``e / n`` is the gradient of the mean cross-entropy w.r.t. ``z``.

    Raises:
        ValueError: shapes that do not match, or a label outside ``[0, V)`` other than
            ``ignore_index``.
    """
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(
            f"logits [B, L, V] and labels [B, L] expected, got {tuple(logits.shape)} and "
            f"{tuple(labels.shape)}"
        )
    target, valid, n = _checked_labels(labels, logits.shape[-1], ignore_index)
    return _output_error_unchecked(logits, target, valid), n


def _checked_labels(
    labels: torch.Tensor, vocab: int, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(target, valid, n)``: the labels with ignored positions at 0, the labelled-position
    mask and their count; checked and counted in one host transfer.

    Raises:
        ValueError: a label outside ``[0, vocab)`` other than ``ignore_index``.
    """
    valid = labels != ignore_index
    target = torch.where(valid, labels, 0)
    outside = ((target < 0) | (target >= vocab)).any()
    n_outside, n = torch.stack([outside.to(torch.int64), valid.sum()]).tolist()
    if n_outside:
        raise ValueError(f"a label lies outside [0, {vocab}) and is not {ignore_index}")
    return target, valid, n


def _output_error_unchecked(
    logits: torch.Tensor, target: torch.Tensor, valid: torch.Tensor
) -> torch.Tensor:
    """:func:`output_error`'s ``e`` without the checks: no host synchronization.

    Args:
        logits: ``[..., V]`` (any float dtype; computed in at least fp32).
        target: ``[...]`` int64, the label where ``valid``, else 0 (not checked: the caller's;
            an index outside ``[0, V)`` fails in ``scatter_add_``, or on a GPU asserts in the
            kernel).
        valid: ``[...]`` bool, the labelled positions; the other rows of ``e`` are zero.

    Returns:
        ``e`` ``[..., V]`` in ``promote(logits.dtype, fp32)``.
    """
    dtype = torch.promote_types(logits.dtype, torch.float32)
    e = torch.softmax(logits.to(dtype), dim=-1)
    e.scatter_add_(-1, target.unsqueeze(-1), torch.full_like(e[..., :1], -1.0))
    e.mul_(valid.unsqueeze(-1).to(dtype))
    return e


def rmsnorm_vjp(
    x: torch.Tensor, weight: torch.Tensor, eps: float, grad_out: torch.Tensor
) -> torch.Tensor:
    """Closed-form vector–Jacobian product of ``y = γ ⊙ x / sqrt(mean(x²) + ε)``.

    With ``r = (mean(x²) + ε)^(−1/2)`` and ``u = grad_out ⊙ γ`` (per row of ``D`` features):
    ``dL/dx = r·u − r³ · x · (u·x) / D``. No autograd: safe under ``torch.no_grad``.

    Args:
        x: the norm's input ``[..., D]``.
        weight: ``γ`` ``[D]``.
        eps: ``ε`` (``variance_epsilon`` of a transformers RMSNorm).
        grad_out: ``dL/dy`` ``[..., D]``.

    Returns:
        ``dL/dx`` ``[..., D]`` in ``promote(x.dtype, grad_out.dtype, fp32)``.

    Raises:
        ValueError: ``x`` and ``grad_out`` of different shapes, or ``weight`` not ``[D]``.
    """
    if x.shape != grad_out.shape or weight.shape != x.shape[-1:]:
        raise ValueError(
            f"x {tuple(x.shape)}, grad_out {tuple(grad_out.shape)} and weight "
            f"{tuple(weight.shape)} do not match"
        )
    dtype = torch.promote_types(torch.promote_types(x.dtype, grad_out.dtype), torch.float32)
    x = x.to(dtype)
    u = grad_out.to(dtype) * weight.to(dtype)
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    ux = (u * x).mean(-1, keepdim=True)
    return r * u - r.pow(3) * x * ux


def norm_eps(norm: nn.Module) -> float:
    """``ε`` of a transformers RMSNorm (``variance_epsilon``, or ``eps``).

    Raises:
        ValueError: the module has neither attribute (not an RMSNorm this code knows).
    """
    for name in ("variance_epsilon", "eps"):
        value = getattr(norm, name, None)
        if isinstance(value, float):
            return value
    raise ValueError(f"{type(norm).__name__} is not an RMSNorm with variance_epsilon or eps")


def norm_gain(norm: nn.Module) -> torch.Tensor:
    """``γ`` of a transformers RMSNorm ``y = γ ⊙ x / sqrt(mean(x²) + ε)``, ``[D]``.

    Llama, Qwen, Mistral and OLMo-2 store ``γ`` as ``weight``; Gemma's RMSNorm stores the offset
    from one and computes ``x̂ · (1 + weight)`` (transformers ``Gemma3RMSNorm``), so its ``γ`` is
    ``1 + weight``. Recognised by the class name (``Gemma…RMSNorm``); returned in the weight's
    dtype, on its device.

    Raises:
        ValueError: the module has no ``weight`` of one dimension.
    """
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        raise ValueError(f"{type(norm).__name__} has no [D] weight: not an RMSNorm this code knows")
    name = type(norm).__name__
    return weight + 1 if name.startswith("Gemma") and name.endswith("RMSNorm") else weight


@dataclass
class OutputSignal:
    """What :func:`residual_signal` returns."""

    loss: float  # mean cross-entropy (nats) over the labelled positions
    g_tilde: torch.Tensor  # [B, L, D]: d(mean loss)/d(final norm input), fp32 or wider
    n_tokens: int  # labelled positions


def residual_signal(
    hidden: torch.Tensor,
    norm: nn.Module,
    lm_weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_tokens: int = 2048,
    ignore_index: int = IGNORE_INDEX,
) -> OutputSignal:
    """Loss and ``g̃``: the output error taken back through the LM head and the final RMSNorm.

    Per chunk of ``chunk_tokens`` positions (so the ``[B, L, V]`` error is never whole): the
    norm's output ``n = norm.forward(hidden)`` (the module's own arithmetic, so its rounding is
    the model's; its hooks are not run),
    ``z = n · W_lmᵀ``, ``e`` (:func:`output_error`'s arithmetic), ``g = e · W_lm`` and
    ``g̃ = rmsnorm_vjp(hidden, γ, ε, g) / n_tokens`` (``γ``: :func:`norm_gain`). Runs under
    ``torch.no_grad``.

    Host synchronizations (on a GPU): two, whatever the number of chunks — the labels are
    checked and counted once before the chunks (one transfer), and the loss, summed per chunk
    into a float64 device scalar, is read once at the end.

    Args:
        hidden: the final norm's input ``[B, L, D]`` (the residual stream after the last block).
        norm: the model's final RMSNorm (``model.model.norm``).
        lm_weight: ``W_lm`` ``[V, D]`` (the LM head's weight; the embedding when tied). A head
            with a bias is not supported by the caller.
        labels: ``[B, L]`` int64 next-token targets, ``ignore_index`` where none.
        chunk_tokens: positions per chunk (memory: ``chunk_tokens × V`` floats).
        ignore_index: label of an ignored position.

    Returns:
        :class:`OutputSignal` with ``g̃`` ``[B, L, D]`` in ``promote(hidden.dtype, fp32)``.

    Raises:
        ValueError: labels not ``[B, L]``, a label outside ``[0, V)`` other than
            ``ignore_index``, or no labelled position.
    """
    b, l, d = hidden.shape
    if labels.shape != (b, l):
        raise ValueError(f"labels {tuple(labels.shape)} do not match hidden {tuple(hidden.shape)}")
    dtype = torch.promote_types(hidden.dtype, torch.float32)
    gemm = hidden.dtype  # the head's two matmuls run in the model's precision, as autograd's do
    eps, gain = norm_eps(norm), norm_gain(norm)
    flat_h, flat_y = hidden.reshape(-1, d), labels.reshape(-1)
    vocab = lm_weight.shape[0]
    with torch.no_grad():
        # the labels' check and count for every chunk at once: one host transfer
        target, valid, n_total = _checked_labels(flat_y, vocab, ignore_index)
        if n_total == 0:
            raise ValueError("no labelled position: every label is the ignore index")
        g_tilde = torch.empty(b * l, d, dtype=dtype, device=hidden.device)
        # the chunk sums (in dtype) accumulate in float64, one addition per chunk
        loss_sum = torch.zeros((), dtype=torch.float64, device=hidden.device)
        w = lm_weight.to(gemm)
        for start in range(0, b * l, chunk_tokens):
            h = flat_h[start : start + chunk_tokens]
            t = target[start : start + chunk_tokens]
            ok = valid[start : start + chunk_tokens]
            z = (norm.forward(h).to(gemm) @ w.T).to(dtype)  # forward: no module hooks
            e = _output_error_unchecked(z, t, ok)
            zy = z.gather(-1, t.unsqueeze(-1)).squeeze(-1)
            loss_sum += ((torch.logsumexp(z, -1) - zy) * ok).sum().to(torch.float64)
            g = (e.to(gemm) @ w).to(dtype)
            g_tilde[start : start + len(h)] = rmsnorm_vjp(h, gain, eps, g)
    g_tilde /= n_total
    return OutputSignal(float(loss_sum) / n_total, g_tilde.reshape(b, l, d), n_total)
