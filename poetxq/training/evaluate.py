"""Validation perplexity of a causal LM over packed token windows."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def causal_lm_loss(model: nn.Module, windows: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (nats, fp32 scalar) of ``windows`` ``[B, L+1]`` (int64).

    Inputs are ``windows[:, :-1]``, labels ``windows[:, 1:]``. ``model`` is a causal LM whose
    forward takes ``input_ids`` and ``use_cache`` and returns ``.logits`` ``[B, L, V]`` (a
    transformers model, or a wrapper of one such as DDP's); it is called with
    ``use_cache=False``: a transformers causal LM would otherwise build a key/value cache, one
    copy of every layer's keys and values (``torch.cat`` into an empty cache), that nothing reads.
    """
    logits = model(input_ids=windows[:, :-1], use_cache=False).logits
    return F.cross_entropy(logits.float().flatten(0, 1), windows[:, 1:].flatten())


@torch.no_grad()
def evaluate_perplexity(
    model: nn.Module,
    val: torch.Tensor,
    *,
    batch_size: int,
    device: torch.device | str,
    max_batches: int | None = None,
) -> tuple[float, float]:
    """Token-weighted mean loss and perplexity ``exp(loss)`` over ``val`` ``[N, L+1]``.

    Args:
        model: causal LM as :func:`causal_lm_loss` takes it.
        val: packed validation windows (int64).
        batch_size: windows per forward.
        device: where to run.
        max_batches: evaluate only the first ``max_batches`` batches (None: all).

    Returns:
        ``(mean_loss_nats, perplexity)``.

    Raises:
        ValueError: if ``val`` holds no window.
    """
    if val.shape[0] == 0:
        raise ValueError(
            "the validation split holds no full window; lower train.seq_len or add data"
        )
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i, start in enumerate(range(0, val.shape[0], batch_size)):
        if max_batches is not None and i >= max_batches:
            break
        batch = val[start : start + batch_size].to(device)
        n_tok = batch[:, 1:].numel()
        total += causal_lm_loss(model, batch).item() * n_tok
        count += n_tok
    model.train(was_training)
    loss = total / count
    return loss, math.exp(min(loss, 80.0))
