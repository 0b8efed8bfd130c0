"""Chunked linear + cross-entropy: the LM-head loss without materialising the ``[T, V]`` logits.

``F.cross_entropy(lm_head(h).float(), y)`` keeps the logits, their fp32 copy, the log-softmax and
their gradients alive around the start of backward: ~12 bytes per logit, 0.73 GiB for 2048
tokens and a 32k vocabulary. :class:`ChunkedLinearCrossEntropy` computes the loss over chunks of
``chunk_tokens`` rows, saves only the per-token log-sum-exp (fp32 ``[N]``), and recomputes each
chunk's logits in backward to form the gradients; at most one chunk's logits exist at a time.

Under autocast (the trainer's bf16 mixed precision) the logits are computed in the autocast dtype
from the (fp32) weight, as ``nn.Linear`` would, so the loss equals the unchunked one.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn
from torch.utils.weak import WeakTensorKeyDictionary

#: bytes of one slice of the LM-head gradient when an update takes it slice by slice
SLICE_BYTES = 32 * 2**20


class RowUpdate(Protocol):
    """Takes the LM-head weight's gradient a slice of rows at a time and applies the optimizer
    step to those rows at once (:class:`poetxq.training.graph_optim.GraphedInBackward`)."""

    #: a slice's first row must be a multiple of this (the optimizer's state blocks)
    row_align: int

    def __call__(self, weight: torch.Tensor, start: int, end: int, grad: torch.Tensor) -> None:
        """Update ``weight[start:end]`` with ``grad`` (``[end − start, d]``, the weight's
        dtype: the whole step's gradient of those rows)."""


#: weight → the update that takes its gradient by rows (see :func:`register_row_update`); keyed
#: by identity (a plain WeakKeyDictionary would compare tensors elementwise)
_ROW_UPDATES = WeakTensorKeyDictionary()


def register_row_update(weight: torch.Tensor, update: RowUpdate | None) -> None:
    """Have :class:`ChunkedLinearCrossEntropy` hand ``weight``'s gradient to ``update`` slice by
    slice of rows (``None``: remove). Then no ``[V, d]`` gradient is ever made: the backward
    returns no gradient for ``weight`` and calls ``update`` with about :data:`SLICE_BYTES` of
    rows at a time, each slice complete (summed over every token). Used by the optimizer step
    inside a CUDA graph's backward, where the LM head's whole gradient (0.31 GiB at Llama-13B)
    would be the largest tensor alive when the backward starts."""
    if update is None:
        _ROW_UPDATES.pop(weight, None)
    else:
        _ROW_UPDATES[weight] = update


def _check_chunk_tokens(chunk_tokens: object) -> None:
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be a positive int, got {chunk_tokens!r}")


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``hidden @ weight.T`` against ``labels``, chunk by chunk.

    ``ChunkedLinearCrossEntropy.apply(hidden, weight, labels, chunk_tokens)``:

    Args:
        hidden: ``[N, d]`` float activations (the decoder's last hidden state, flattened).
        weight: ``[V, d]`` float LM-head weight (no bias).
        labels: ``[N]`` int64 target ids in ``[0, V)`` (no ignore index: every token counts;
            not range-checked, which would cost a device sync).
        chunk_tokens: rows per chunk (positive int); the last chunk may be shorter. The extra
            memory is a few ``[chunk_tokens, V]`` temporaries (~12 bytes per element).

    Returns:
        The mean over the N tokens of the cross-entropy in nats, an fp32 scalar.

    The logits are computed in the compute dtype — the autocast dtype when autocast is enabled
    on ``hidden``'s device, else ``promote_types(hidden.dtype, weight.dtype)`` — then upcast to
    fp32 for the log-sum-exp. Gradients come back in ``hidden``'s and ``weight``'s dtypes; the
    weight gradient is accumulated over chunks in fp32 for an fp32 weight (each chunk's GEMM in
    the compute dtype, as autocast's own backward would), in the weight's dtype otherwise.

    When an update was registered for ``weight`` (:func:`register_row_update`), the backward
    returns no weight gradient: after ``hidden``'s gradient it recomputes the logits once more,
    a slice of vocabulary rows at a time (all tokens, in chunks no larger than
    ``chunk_tokens × V`` logits), and hands each slice's gradient to the update. ``by_rows``
    (default ``True``) ``False`` ignores the registry: for a weight that gets gradient from
    elsewhere too (an LM head tied to the input embeddings), whose update must see the sum.

    Raises:
        ValueError: ``chunk_tokens`` is not a positive int, shapes disagree, or ``N == 0``.
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        chunk_tokens: int,
        by_rows: bool = True,
    ) -> torch.Tensor:
        _check_chunk_tokens(chunk_tokens)
        n = hidden.shape[0]
        if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
            raise ValueError(
                f"need hidden [N, d] and weight [V, d], got {tuple(hidden.shape)} and "
                f"{tuple(weight.shape)}"
            )
        if labels.shape != (n,) or n == 0:
            raise ValueError(f"need labels [N] with N = {n} > 0, got {tuple(labels.shape)}")
        device_type = hidden.device.type
        if torch.is_autocast_enabled(device_type):
            compute = torch.get_autocast_dtype(device_type)
        else:
            compute = torch.promote_types(hidden.dtype, weight.dtype)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        with torch.autocast(device_type, enabled=False):
            w = weight.to(compute)
            for s in range(0, n, chunk_tokens):
                e = min(s + chunk_tokens, n)
                logits = (hidden[s:e].to(compute) @ w.T).float()
                lse[s:e] = torch.logsumexp(logits, dim=1)
                target = logits.gather(1, labels[s:e, None]).squeeze(1)
                total += (lse[s:e] - target).sum()
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.chunk_tokens = chunk_tokens
        ctx.by_rows = by_rows
        ctx.compute = compute
        return total / n

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_out: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None]:
        hidden, weight, labels, lse = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_h or need_w):
            return None, None, None, None, None
        compute, chunk, n = ctx.compute, ctx.chunk_tokens, hidden.shape[0]
        # fp32 accumulation for an fp32 weight even when the GEMMs run in bf16
        acc = torch.float32 if weight.dtype == torch.float32 else weight.dtype
        row_update = _ROW_UPDATES.get(weight) if need_w and ctx.by_rows else None
        grad_h = torch.empty_like(hidden) if need_h else None
        full_w = need_w and row_update is None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if full_w else None
        scale = grad_out.float() / n
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(compute)
            for s in range(0, n, chunk) if grad_h is not None or grad_w is not None else ():
                e = min(s + chunk, n)
                h = hidden[s:e].to(compute)
                g = _dlogits(h, w, lse[s:e], labels[s:e], 0, scale)
                if grad_h is not None:
                    grad_h[s:e] = g @ w
                if grad_w is not None:
                    _add_weight_grad(grad_w, g, h)
            if row_update is not None:  # after grad_h, which reads every row before updates
                _rows_to_update(hidden, w, labels, lse, scale, chunk, acc, weight, row_update)
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None


def _dlogits(
    h: torch.Tensor,
    w_rows: torch.Tensor,
    lse: torch.Tensor,
    labels: torch.Tensor,
    v0: int,
    scale: torch.Tensor,
) -> torch.Tensor:
    """d loss / d logits of the tokens ``h`` ``[c, d]`` for the vocabulary rows ``w_rows``
    (``[r, d]``, from row ``v0``): ``(softmax − onehot) · scale`` in ``w_rows``' dtype, the
    softmax from the saved log-sum-exp (fp32 ``[c]``); a label outside the rows subtracts
    nothing (a masked add: no host sync)."""
    p = (h @ w_rows.T).float().sub_(lse[:, None]).exp_()  # fp32 [c, r]
    y = labels - v0
    inside = (y >= 0) & (y < p.shape[1])
    p.scatter_add_(1, y.clamp(0, p.shape[1] - 1)[:, None], -inside.to(p.dtype)[:, None])
    return p.mul_(scale).to(w_rows.dtype)


def _add_weight_grad(acc: torch.Tensor, g: torch.Tensor, h: torch.Tensor) -> None:
    """``acc += gᵀ·h``. When the compute dtype differs from the accumulator's (autocast: bf16
    logits of an fp32 weight) the GEMM runs in the compute dtype, as autocast's own backward
    does, and is summed into the fp32 accumulator."""
    if acc.dtype == g.dtype:
        acc.addmm_(g.T, h)
    else:
        acc += g.T @ h


def _rows_to_update(
    hidden: torch.Tensor,
    w: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    scale: torch.Tensor,
    chunk: int,
    acc: torch.dtype,
    weight: torch.Tensor,
    update: RowUpdate,
) -> None:
    """The weight gradient of :class:`ChunkedLinearCrossEntropy` by slices of rows, each passed
    to ``update`` when complete (``w``: the weight in the compute dtype; the rest as there)."""
    n, (vocab, d) = hidden.shape[0], weight.shape
    align = max(1, int(update.row_align))
    rows = max(align, SLICE_BYTES // (d * torch.empty((), dtype=acc).element_size()))
    rows = min(vocab, rows // align * align)
    # tokens per pass: logits no larger than the forward's chunk_tokens x V
    tokens = min(n, max(chunk, chunk * vocab // rows))
    for v0 in range(0, vocab, rows):
        v1 = min(v0 + rows, vocab)
        g_rows = torch.zeros(v1 - v0, d, dtype=acc, device=weight.device)
        w_rows = w[v0:v1]
        for s in range(0, n, tokens):
            e = min(s + tokens, n)
            h = hidden[s:e].to(w.dtype)
            _add_weight_grad(g_rows, _dlogits(h, w_rows, lse[s:e], labels[s:e], v0, scale), h)
        update(weight, v0, v1, g_rows.to(weight.dtype))


def causal_lm_loss_chunked(
    model: nn.Module, windows: torch.Tensor, chunk_tokens: int
) -> torch.Tensor:
    """:func:`poetxq.training.evaluate.causal_lm_loss` through :class:`ChunkedLinearCrossEntropy`.

    Mean next-token cross-entropy (nats, fp32 scalar) of ``windows`` ``[B, L+1]`` (int64):
    inputs ``windows[:, :-1]``, labels ``windows[:, 1:]``. Runs the decoder ``model.model`` and
    applies ``model.lm_head.weight`` chunk by chunk, never holding the ``[B·L, V]`` logits.

    Args:
        model: a bare causal LM such as ``LlamaForCausalLM``: ``model.model(input_ids=...,
            use_cache=False)`` (no key/value cache, see
            :func:`poetxq.training.evaluate.causal_lm_loss`) returns ``.last_hidden_state`` ``[B, L,
            d]``, ``model.lm_head`` a bias-free linear.
        windows: ``[B, L+1]`` int64 token ids.
        chunk_tokens: tokens per chunk (positive int).

    Raises:
        ValueError: ``model`` lacks ``.model``/``.lm_head`` (e.g. a DDP wrapper), the head has a
            bias, or ``chunk_tokens`` is not a positive int.
    """
    _check_chunk_tokens(chunk_tokens)
    decoder, head = getattr(model, "model", None), getattr(model, "lm_head", None)
    if decoder is None or not isinstance(getattr(head, "weight", None), torch.Tensor):
        raise ValueError(
            f"causal_lm_loss_chunked needs a bare causal LM with .model and .lm_head, got "
            f"{type(model).__name__}; pass the unwrapped model (accelerator.unwrap_model), but a "
            "forward that bypasses a DDP wrapper skips its gradient all-reduce, so under DDP use "
            "causal_lm_loss"
        )
    if getattr(head, "bias", None) is not None:
        raise ValueError(
            "causal_lm_loss_chunked supports a bias-free lm_head only; use causal_lm_loss"
        )
    hidden = decoder(input_ids=windows[:, :-1], use_cache=False).last_hidden_state
    labels = windows[:, 1:].reshape(-1)
    inputs = getattr(model, "get_input_embeddings", None)
    embed = getattr(inputs(), "weight", None) if callable(inputs) else None
    return ChunkedLinearCrossEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]), head.weight, labels, chunk_tokens,
        embed is not head.weight,  # tied: the update must see the embedding's gradient too
    )  # fmt: skip


def training_loss(model: nn.Module, windows: torch.Tensor, chunk_tokens: int = 0) -> torch.Tensor:
    """The training loss of ``windows`` ``[B, L+1]``: :func:`causal_lm_loss_chunked` when
    ``chunk_tokens`` > 0 (``train.loss_chunk_tokens``; ``model`` must be the bare causal LM),
    else :func:`poetxq.training.evaluate.causal_lm_loss` (a causal LM whose forward takes
    ``input_ids`` and ``use_cache`` and returns ``.logits``, as transformers' do). Mean nats,
    fp32 scalar; errors as those functions raise them."""
    if chunk_tokens:
        return causal_lm_loss_chunked(model, windows, chunk_tokens)
    from poetxq.training.evaluate import causal_lm_loss

    return causal_lm_loss(model, windows)
