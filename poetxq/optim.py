"""Optimizer, schedule and merge bookkeeping for POET-X(Q) training (POET, arXiv 2506.08001).

* AdamW with three param groups: the packed skew parameters ``Q`` (lr = ``poet_lr × scale``,
  no weight decay); other ≥ 2-D params (embeddings, ``lm_head``) at the base lr with weight decay;
  1-D params (norms, biases) at the base lr without decay.
* Cosine schedule with linear warmup and a floor of ``min_lr_ratio``.
* Merge-then-reinitialize of every layer, followed by a reset of the Adam moments of ``Q``.
* Gradient clipping whose threshold is re-warmed from 0.1× to 1× over a few steps after a merge.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch import nn

from poetxq.recipe import OptimConfig
from poetxq.surgery import poet_layers


def orthogonal_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The ``Q`` parameters of every POET-X(Q) layer in ``model``."""
    return [p for layer in poet_layers(model) for p in layer.orthogonal_parameters()]


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW over ``model``'s trainable params with POET param groups (module docstring).

    Group names (``group["name"]``): ``"poet"``, ``"decay"``, ``"no_decay"``; empty groups are
    dropped. Each group's ``initial_lr`` is set for the scheduler. ``cfg.state_bits == 8`` uses
    bitsandbytes' ``AdamW8bit`` (blockwise-quantized moments, Dettmers et al. 2022, for tensors of
    at least 4096 elements; smaller ones keep fp32 moments; its ``step`` without a device sync
    per parameter, :func:`adamw8bit_class`) instead of ``torch.optim.AdamW``.
    """
    q_ids = {id(p) for p in orthogonal_parameters(model)}
    q, decay, no_decay = [], [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if id(p) in q_ids:
            q.append(p)
        elif p.dim() >= 2:
            decay.append(p)
        else:
            no_decay.append(p)
    groups = [
        {"name": "poet", "params": q, "lr": cfg.poet_lr * cfg.poet_lr_scale, "weight_decay": 0.0},
        {"name": "decay", "params": decay, "lr": cfg.lr, "weight_decay": cfg.weight_decay},
        {"name": "no_decay", "params": no_decay, "lr": cfg.lr, "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    for g in groups:
        g["initial_lr"] = g["lr"]
    if cfg.state_bits == 8:
        return adamw8bit_class()(groups, betas=cfg.betas, eps=cfg.eps)
    return torch.optim.AdamW(groups, betas=cfg.betas, eps=cfg.eps)


def is_bnb_8bit(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is a non-paged bitsandbytes 8-bit optimizer whose per-parameter
    update :func:`bnb_update_one` can call (a paged one needs the synchronization of its own
    ``step``)."""
    return not getattr(optimizer, "is_paged", False) and all(
        hasattr(optimizer, a) for a in ("update_step", "init_state", "prefetch_state")
    )


@torch.no_grad()
def bnb_update_one(
    optimizer: torch.optim.Optimizer, group_index: int, param_index: int, p: torch.Tensor
) -> None:
    """One parameter's update by a bitsandbytes 8-bit optimizer: the body of the loop in
    bitsandbytes' ``Optimizer8bit.step`` (state created on first use, then ``update_step``),
    without the device synchronization that loop adds after every parameter. Kernels are queued
    on the current stream in order, so nothing reads a parameter before its update is done."""
    opt: Any = optimizer
    if not opt.initialized:
        opt.check_overrides()
        opt.to_gpu()
        opt.initialized = True
    group = opt.param_groups[group_index]
    if len(opt.state[p]) == 0:
        opt.init_state(group, p, group_index, param_index)
    opt.prefetch_state(p)
    opt.update_step(group, p, group_index, param_index)


@functools.cache
def adamw8bit_class() -> type:
    """bitsandbytes' ``AdamW8bit`` with a ``step`` that does not synchronize the device after
    every parameter (:func:`bnb_update_one`); same update, state and ``state_dict``.

    bitsandbytes' own ``step`` waits for each parameter's kernel before launching the next, so a
    step over the ~500 tensors of a Llama-8B POET model costs one host round trip per tensor.
    """
    import bitsandbytes as bnb

    class AdamW8bit(bnb.optim.AdamW8bit):
        __doc__ = adamw8bit_class.__doc__

        @torch.no_grad()
        def step(self, closure=None):  # type: ignore[override]
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            for gi, group in enumerate(self.param_groups):
                for pi, p in enumerate(group["params"]):
                    if p.grad is not None:
                        bnb_update_one(self, gi, pi, p)
            return loss

    AdamW8bit.__qualname__ = "AdamW8bit"  # not adamw8bit_class.<locals>.AdamW8bit
    return AdamW8bit


def cosine_lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """LR multiplier at ``step`` (0-based): linear warmup to 1, cosine decay to ``min_ratio``.

    ``step < warmup`` → ``(step + 1) / warmup``; afterwards
    ``min_ratio + (1 - min_ratio) · ½(1 + cos(π · progress))`` with ``progress`` from 0 to 1 at
    ``total``.
    """
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR applying :func:`cosine_lr_factor` to every group."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: cosine_lr_factor(s, cfg.warmup_steps, total_steps, cfg.min_lr_ratio),
    )


def reset_orthogonal_state(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> None:
    """Zero the Adam moments (``exp_avg``, ``exp_avg_sq``) and step count of ``params`` (for
    bitsandbytes' 8-bit optimizers: drop their state, which the next step re-creates at zero).

    After a merge, ``Q`` restarts at 0 in new coordinates, so its old moments are meaningless; with
    the step count reset, bias correction makes the next update a fresh Adam start.
    """
    for p in params:
        state = optimizer.state.get(p)
        if not state:
            continue
        if "state1" in state:  # bitsandbytes 8-bit: drop it; the next step starts it afresh
            del optimizer.state[p]
            continue
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            if key in state:
                state[key].zero_()
        if "step" in state:
            step = state["step"]
            if torch.is_tensor(step):
                step.zero_()
            else:
                state["step"] = 0


@torch.no_grad()
def merge_and_reset(
    model: nn.Module, optimizer: torch.optim.Optimizer, generator: torch.Generator | None = None
) -> int:
    """Merge-then-reinitialize every POET-X(Q) layer and reset ``Q``'s Adam moments.

    Returns:
        The number of layers merged.
    """
    layers = poet_layers(model)
    for layer in layers:
        layer.merge_then_reinitialize(generator)
    reset_orthogonal_state(optimizer, orthogonal_parameters(model))
    return len(layers)


def clip_threshold(max_norm: float, steps_since_merge: int | None, rewarm_steps: int) -> float:
    """Grad-clip threshold: ``max_norm``, re-warmed linearly from 0.1× after a merge.

    ``steps_since_merge`` is 0 on the first step after a merge (None: no merge yet).
    """
    if steps_since_merge is None or rewarm_steps <= 0 or steps_since_merge >= rewarm_steps:
        return max_norm
    return max_norm * (0.1 + 0.9 * steps_since_merge / rewarm_steps)
