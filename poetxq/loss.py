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

import torch
from torch import nn


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
        ctx.compute = compute
        return total / n

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_out: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        hidden, weight, labels, lse = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_h or need_w):
            return None, None, None, None
        compute, chunk, n = ctx.compute, ctx.chunk_tokens, hidden.shape[0]
        # fp32 accumulation for an fp32 weight even when the GEMMs run in bf16
        acc = torch.float32 if weight.dtype == torch.float32 else weight.dtype
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        scale = grad_out.float() / n
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(compute)
            for s in range(0, n, chunk):
                e = min(s + chunk, n)
                h = hidden[s:e].to(compute)
                p = (h @ w.T).float().sub_(lse[s:e, None]).exp_()  # softmax, fp32 [c, V]
                p[torch.arange(e - s, device=p.device), labels[s:e]] -= 1.0
                g = p.mul_(scale).to(compute)  # d loss / d logits
                if grad_h is not None:
                    grad_h[s:e] = g @ w
                if grad_w is not None:
                    if acc == compute:
                        grad_w.addmm_(g.T, h)
                    else:  # the compute dtype differs from the accumulator's (autocast: bf16
                        # logits of an fp32 weight): the GEMM in the compute dtype, as
                        # autocast's own backward does, summed into the fp32 accumulator
                        grad_w += g.T @ h
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None


def causal_lm_loss_chunked(
    model: nn.Module, windows: torch.Tensor, chunk_tokens: int
) -> torch.Tensor:
    """:func:`poetxq.evaluate.causal_lm_loss` through :class:`ChunkedLinearCrossEntropy`.

    Mean next-token cross-entropy (nats, fp32 scalar) of ``windows`` ``[B, L+1]`` (int64):
    inputs ``windows[:, :-1]``, labels ``windows[:, 1:]``. Runs the decoder ``model.model`` and
    applies ``model.lm_head.weight`` chunk by chunk, never holding the ``[B·L, V]`` logits.

    Args:
        model: a bare causal LM such as ``LlamaForCausalLM``: ``model.model(input_ids=...,
            use_cache=False)`` (no key/value cache, see :func:`poetxq.evaluate.causal_lm_loss`)
            returns ``.last_hidden_state`` ``[B, L, d]``, ``model.lm_head`` a bias-free linear.
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
    return ChunkedLinearCrossEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]), head.weight, labels, chunk_tokens
    )


def training_loss(model: nn.Module, windows: torch.Tensor, chunk_tokens: int = 0) -> torch.Tensor:
    """The training loss of ``windows`` ``[B, L+1]``: :func:`causal_lm_loss_chunked` when
    ``chunk_tokens`` > 0 (``train.loss_chunk_tokens``; ``model`` must be the bare causal LM),
    else :func:`poetxq.evaluate.causal_lm_loss` (a causal LM whose forward takes ``input_ids``
    and ``use_cache`` and returns ``.logits``, as transformers' do). Mean nats,
    fp32 scalar; errors as those functions raise them."""
    if chunk_tokens:
        return causal_lm_loss_chunked(model, windows, chunk_tokens)
    from poetxq.evaluate import causal_lm_loss

    return causal_lm_loss(model, windows)
