"""Optimizer, schedule and merge bookkeeping for POET-X(Q) training (POET, arXiv 2506.08001).

* AdamW with three param groups: the packed skew parameters ``Q`` (lr = ``poet_lr × scale``,
  no weight decay, betas ``poet_betas`` when set); other ≥ 2-D params (embeddings, ``lm_head``)
  at the base lr with weight decay;
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

from poetxq.model.blockcache import q_parameters_in_cnp_order
from poetxq.model.surgery import poet_layers
from poetxq.training.recipe import OptimConfig
from quant_kernels.policy import KernelPolicy, default_policy


def orthogonal_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The ``Q`` parameters of every POET-X(Q) layer in ``model``."""
    return [p for layer in poet_layers(model) for p in layer.orthogonal_parameters()]


def build_optimizer(
    model: nn.Module,
    cfg: OptimConfig,
    *,
    flatten: bool = True,
    kernels: KernelPolicy | None = None,
) -> torch.optim.Optimizer:
    """AdamW over ``model``'s trainable params with POET param groups (module docstring).

    Group names (``group["name"]``): ``"poet"``, ``"decay"``, ``"no_decay"``; empty groups are
    dropped. Each group's ``initial_lr`` is set for the scheduler. ``cfg.state_bits == 8`` uses
    bitsandbytes' ``AdamW8bit`` (blockwise-quantized moments, Dettmers et al. 2022, for tensors of
    at least 4096 elements; smaller ones keep fp32 moments; its ``step`` without a device sync
    per parameter, :func:`adamw8bit_class`) instead of ``torch.optim.AdamW``; with ``flatten``
    the ``poet`` and ``no_decay`` groups' tensors are then re-homed into one buffer per group
    (:class:`poetxq.model.flat.FlatParams`: same values, one update launch per group; do it after
    the model is on its device). ``kernels`` decides whether the flat 8-bit step runs the Triton
    update (``triton_8bit_update``); default: the policy of ``model``'s POET-X(Q) layers (the
    first one's), else :func:`quant_kernels.policy.default_policy`.
    """
    if kernels is None:
        layers = poet_layers(model)
        kernels = layers[0].kernels if layers else default_policy()
    q_ids = {id(p) for p in orthogonal_parameters(model)}
    # Q in the order the batched CNP stacks them (poetxq.model.blockcache), so that a flattened
    # group hands the CNP one view instead of a concatenation
    q = [p for p in q_parameters_in_cnp_order(model) if id(p) in q_ids and p.requires_grad]
    decay, no_decay = [], []
    for p in model.parameters():
        if not p.requires_grad or id(p) in q_ids:
            continue
        if p.dim() >= 2:
            decay.append(p)
        else:
            no_decay.append(p)
    poet = {"name": "poet", "params": q, "lr": cfg.poet_lr * cfg.poet_lr_scale, "weight_decay": 0.0}
    if cfg.poet_betas is not None:
        poet["betas"] = tuple(cfg.poet_betas)
    groups = [
        poet,
        {"name": "decay", "params": decay, "lr": cfg.lr, "weight_decay": cfg.weight_decay},
        {"name": "no_decay", "params": no_decay, "lr": cfg.lr, "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    for g in groups:
        g["initial_lr"] = g["lr"]
    if cfg.state_bits == 8:
        opt = adamw8bit_class()(groups, betas=cfg.betas, eps=cfg.eps, kernels=kernels)
        for i, g in enumerate(groups):  # Q and the norms: hundreds of tensors, one launch each
            params = g["params"]
            one_kind = len({(p.dtype, p.device) for p in params}) == 1
            if flatten and g["name"] in ("poet", "no_decay") and len(params) > 1 and one_kind:
                opt.flatten_group(i)
        return opt
    return adamw(groups, betas=cfg.betas, eps=cfg.eps)


def adamw(groups: list[dict], betas: tuple[float, float], eps: float) -> torch.optim.AdamW:
    """torch's AdamW over ``groups``, with its fused CUDA kernels (``fused=True``: one launch
    per dtype for all tensors) when every parameter is a floating-point CUDA tensor, and the
    default (``foreach``) implementation otherwise. Same update, same state layout; on an H200
    the foreach step of Llama-1B's 1.36 B fp32 parameters spent ~26 ms of GPU time, ~3× its
    memory-traffic floor, and the fused one ~11 ms."""
    groups = [{**g, "params": list(g["params"])} for g in groups]  # a generator is read once
    params = [p for g in groups for p in g["params"]]
    fused = bool(params) and all(p.is_cuda and p.is_floating_point() for p in params)
    return torch.optim.AdamW(groups, betas=betas, eps=eps, fused=True if fused else None)


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
    bnb_ensure_state(opt, group_index, param_index, p)
    opt.prefetch_state(p)
    opt.update_step(opt.param_groups[group_index], p, group_index, param_index)


@torch.no_grad()
def update_one(
    optimizer: torch.optim.Optimizer, group_index: int, param_index: int, p: torch.Tensor
) -> None:
    """Update the single parameter ``p`` (``optimizer.param_groups[group_index]["params"]
    [param_index]``) from its ``.grad`` with ``optimizer``'s own rule, leaving every other
    parameter as it is: :func:`bnb_update_one` for a (non-paged) bitsandbytes 8-bit optimizer;
    otherwise one ``optimizer.step()`` with every param group emptied but ``p``'s, which holds
    ``p`` alone (the groups are restored afterwards, also on error). Exact for update rules in
    which one parameter's update reads no other's gradient (Adam-type rules)."""
    if is_bnb_8bit(optimizer):
        bnb_update_one(optimizer, group_index, param_index, p)
        return
    groups = optimizer.param_groups
    saved = [g["params"] for g in groups]
    try:
        for g in groups:
            g["params"] = []
        groups[group_index]["params"] = [p]
        optimizer.step()
    finally:
        for g, ps in zip(groups, saved, strict=True):
            g["params"] = ps


def bnb_ensure_state(
    optimizer: torch.optim.Optimizer, group_index: int, param_index: int, p: torch.Tensor
) -> None:
    """Create ``p``'s state in a bitsandbytes 8-bit optimizer if it has none, as its ``step``
    does on first use (moments at zero, ``step`` 0; 8-bit codes for tensors of at least
    ``min_8bit_size`` elements, fp32 below)."""
    opt: Any = optimizer
    if not opt.initialized:
        opt.check_overrides()
        opt.to_gpu()
        opt.initialized = True
    if len(opt.state[p]) == 0:
        opt.init_state(opt.param_groups[group_index], p, group_index, param_index)


@functools.cache
def adamw8bit_class() -> type:
    """bitsandbytes' ``AdamW8bit`` with a ``step`` that does not synchronize the device after
    every parameter (:func:`bnb_update_one`) and that updates a flattened group in one launch;
    same update rule, state format and ``state_dict``.

    bitsandbytes' own ``step`` waits for each parameter's kernel before launching the next, so a
    step over the ~600 tensors of a Llama-13B POET model costs one host round trip per tensor;
    without the waits it still costs one launch (~40 µs on an H200) per tensor.
    ``flatten_group(i)`` re-homes group ``i``'s parameters into one buffer
    (:class:`poetxq.model.flat.FlatParams`, each tensor at a multiple of 256 elements, bitsandbytes'
    state block) and keeps their 8-bit states as views of equally flat state buffers; ``step``
    then calls bitsandbytes' blockwise update once per run of tensors whose gradients lie end to
    end in memory (one run for all ``Q`` of a model without activation checkpointing, one per
    layer with it). Because every tensor starts on a block boundary, each call quantizes exactly
    the blocks the per-tensor calls would, and the result is the same (bit-identical on the CPU:
    test). On a GPU the flat runs go through :func:`quant_kernels.adam8bit.adam8bit_update`
    (``kernels.triton_8bit_update``, a :class:`~quant_kernels.policy.KernelPolicy` given to the
    constructor; default :func:`~quant_kernels.policy.default_policy`): the same rule and state
    format, 3×
    faster than bitsandbytes' CUDA op, equal to it up to the rounding of a few state codes. The
    per-tensor path (bitsandbytes' op) is taken instead, for that step, when a parameter of the
    group has no gradient, a state is not 8-bit, the steps of the group's tensors differ, or a
    parameter's storage was replaced.
    """
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnbF

    from poetxq.model.flat import BNB_STATE_BLOCK, FlatParams

    class AdamW8bit(bnb.optim.AdamW8bit):
        __doc__ = adamw8bit_class.__doc__

        def __init__(self, *args: Any, kernels: KernelPolicy | None = None, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.kernels = default_policy() if kernels is None else kernels
            self._flat: dict[int, FlatParams] = {}
            self._flat_state: dict[int, dict[str, Any]] = {}

        def flatten_group(self, index: int) -> FlatParams:
            """Re-home ``param_groups[index]``'s parameters into one buffer (values unchanged).

            Raises:
                ValueError: the group's parameters differ in dtype or device.
            """
            flat = FlatParams(self.param_groups[index]["params"])
            self._flat[index] = flat
            self._flat_state.pop(index, None)
            return flat

        @property
        def flat_groups(self) -> list[FlatParams]:
            """The flattened groups (:meth:`flatten_group`), for callers that lay out gradients
            to match (:class:`poetxq.training.cudagraph.GraphedMicroStep`)."""
            return list(self._flat.values())

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            super().load_state_dict(state_dict)
            self._flat_state.clear()  # the loaded states are new tensors: re-gathered next step

        def _gather_state(self, gi: int, flat: FlatParams) -> dict[str, Any] | None:
            """Group ``gi``'s 8-bit states as views of flat buffers laid out like ``flat``
            (existing states copied in, missing ones zero as bitsandbytes starts them), or None
            when the group cannot be updated as one."""
            params, group = flat.params, self.param_groups[gi]
            cached = self._flat_state.get(gi)
            if cached is not None and all(
                (s := self.state[p]).get("state1") is v and s["step"] == cached["step"]
                for p, v in zip(params, cached["views"])
            ):  # unchanged since the last flat step (no load, reset or per-tensor step)
                return cached
            if not self.initialized:
                self.check_overrides()
                self.to_gpu()
                self.initialized = True
            config = self.get_config(gi, 0, group)
            if (
                config["optim_bits"] != 8
                or config["max_unorm"] > 0.0
                or any((gi, pi) in self.mng.index2config for pi in range(len(params)))
                or any(p.numel() < config["min_8bit_size"] for p in params)
            ):
                return None
            old = [self.state[p] if len(self.state.get(p, ())) else None for p in params]
            steps = {0 if s is None else s["step"] for s in old}
            if len(steps) != 1 or any(s and s["state1"].dtype != torch.uint8 for s in old):
                self._flat_state.pop(gi, None)
                return None
            step = steps.pop()
            if "dynamic" not in self.name2qmap:
                self.fill_qmap()
            dev = flat.flat.device
            qmap1 = self.name2qmap["dynamic"] = self.name2qmap["dynamic"].to(dev)
            qmap2 = self.name2qmap["udynamic"] = self.name2qmap["udynamic"].to(dev)
            n, bs = flat.numel, BNB_STATE_BLOCK
            buf = {
                "state1": torch.zeros(n, dtype=torch.uint8, device=dev),
                "state2": torch.zeros(n, dtype=torch.uint8, device=dev),
                "absmax1": torch.zeros(n // bs, dtype=torch.float32, device=dev),
                "absmax2": torch.zeros(n // bs, dtype=torch.float32, device=dev),
            }
            views = []
            for i, (p, o, s) in enumerate(zip(params, flat.offsets, old, strict=True)):
                blocks = slice(o // bs, o // bs + -(-p.numel() // bs))
                new = {
                    "step": step,
                    "state1": flat.slot(buf["state1"], i),
                    "state2": flat.slot(buf["state2"], i),
                    "qmap1": qmap1,
                    "qmap2": qmap2,
                    "absmax1": buf["absmax1"][blocks],
                    "absmax2": buf["absmax2"][blocks],
                }
                if s is not None:
                    for key in ("state1", "state2", "absmax1", "absmax2"):
                        new[key].copy_(s[key].reshape(new[key].shape))
                self.state[p] = new
                views.append(new["state1"])
            cached = {"views": views, "step": step, **buf}
            self._flat_state[gi] = cached
            return cached

        def _flat_step(self, gi: int, flat: FlatParams) -> bool:
            """Group ``gi`` updated with one bitsandbytes call per run of gradients that lie
            end to end (:meth:`FlatParams.grad_runs`); False: use the per-tensor path."""
            if not flat.intact():
                return False
            runs = flat.grad_runs()
            if runs is None:
                return all(p.grad is None for p in flat.params)  # nothing to do, or fall back
            st = self._gather_state(gi, flat)
            if st is None:
                return False
            group = self.param_groups[gi]
            config = self.get_config(gi, 0, group)
            st["step"] += 1
            betas = config["betas"]
            bs = BNB_STATE_BLOCK  # every parameter starts on a state block: runs share none
            maps = (self.name2qmap["dynamic"], self.name2qmap["udynamic"])
            ours = (self.optimizer_name == "adam" and not config["skip_zeros"]
                    and self.kernels.triton_8bit_update_for(flat.flat))  # fmt: skip
            if ours:
                from quant_kernels.adam8bit import adam8bit_update  # Triton: a GPU here
            for first, _, grad in runs:
                lo = flat.offsets[first]
                hi = lo + grad.numel()
                blocks = slice(lo // bs, -(-hi // bs))
                args = (grad, flat.flat[lo:hi], st["state1"][lo:hi], st["state2"][lo:hi])
                absmax = (st["absmax1"][blocks], st["absmax2"][blocks])
                if ours:
                    adam8bit_update(
                        *args, betas[0], betas[1], config["eps"], st["step"], config["lr"],
                        *maps, *absmax, config["weight_decay"],
                    )  # fmt: skip
                    continue
                bnbF.optimizer_update_8bit_blockwise(
                    self.optimizer_name, *args,
                    betas[0], betas[1], betas[2] if len(betas) >= 3 else 0.0,
                    config.get("alpha", 0.0), config["eps"], st["step"], config["lr"],
                    *maps, *absmax, config["weight_decay"],
                    gnorm_scale=1.0, skip_zeros=config["skip_zeros"],
                )  # fmt: skip
            for p in flat.params:
                self.state[p]["step"] = st["step"]
            # the kernel wrote through the buffer: tell autograd and poetxq.model.blockcache that
            # each parameter changed (their version counters are their own)
            torch.autograd.graph.increment_version(flat.params)
            return True

        @torch.no_grad()
        def step(self, closure=None):  # type: ignore[override]
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            for gi, group in enumerate(self.param_groups):
                flat = self._flat.get(gi)
                if flat is not None and self._flat_step(gi, flat):
                    continue
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
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    generator: torch.Generator | None = None,
    *,
    requant_errors: list[float] | None = None,
) -> int:
    """Merge-then-reinitialize every POET-X(Q) layer and reset ``Q``'s Adam moments.

    ``requant_errors``: a list that gets each layer's re-quantization error appended
    (:meth:`poetxq.model.layer.POETXLinear.merge_then_reinitialize` with ``measure``).

    Returns:
        The number of layers merged.
    """
    layers = poet_layers(model)
    for layer in layers:
        err = layer.merge_then_reinitialize(generator, measure=requant_errors is not None)
        if requant_errors is not None and err is not None:
            requant_errors.append(err)
    reset_orthogonal_state(optimizer, orthogonal_parameters(model))
    return len(layers)


def clip_threshold(max_norm: float, steps_since_merge: int | None, rewarm_steps: int) -> float:
    """Grad-clip threshold: ``max_norm``, re-warmed linearly from 0.1× after a merge.

    ``steps_since_merge`` is 0 on the first step after a merge (None: no merge yet).
    """
    if steps_since_merge is None or rewarm_steps <= 0 or steps_since_merge >= rewarm_steps:
        return max_norm
    return max_norm * (0.1 + 0.9 * steps_since_merge / rewarm_steps)
