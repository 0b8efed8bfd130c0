"""Memory-saving training options: activation offload and the optimizer step inside backward.

Both trade a little speed for peak GPU memory at large models and small batches (Llama-8B/13B at
batch 1 × 2048 tokens), where the persistent state (low-bit W0, ``Q``, optimizer states) leaves
little room for the transients of a step:

* :func:`enable_activation_checkpointing` with ``offload=True`` (``train.offload_activations``):
  whole-layer checkpointing whose kept layer inputs (``L × tokens × d`` values) live in pinned
  host memory between forward and backward, through transformers' own
  ``activation_checkpointing_enable(offload=True)`` (torch's ``save_on_cpu`` around each layer's
  checkpoint). One device→host copy per layer in forward and one host→device copy in backward.
* :class:`OptimizerInBackward` (``train.optimizer_in_backward``): each parameter is updated by
  the run's optimizer as soon as its gradient is complete (a post-accumulate-grad hook) and its
  gradient is freed at once, so the gradients of the whole model are never alive together.
  Without a global gradient norm there is no gradient clipping, and there is one update per
  backward (no gradient accumulation); the recipe schema enforces both.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable

import torch
from torch import nn

_CKPT_KWARGS = {"use_reentrant": False}


def enable_activation_checkpointing(model: nn.Module, *, offload: bool = False) -> None:
    """Whole-decoder-layer activation checkpointing (non-reentrant) on a transformers model.

    Each decoder layer keeps only its input and recomputes the rest in backward. ``offload``
    keeps those inputs in pinned host memory instead of on the GPU (module docstring); for a
    model on the CPU, whose activations are in host memory already, it changes nothing.

    Raises:
        RuntimeError: ``offload`` with a transformers release whose
            ``activation_checkpointing_enable`` has no ``offload`` argument (one line: upgrade
            transformers or turn ``train.offload_activations`` off).
    """
    offload = offload and _on_accelerator(model)
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None and "offload" in inspect.signature(enable).parameters:
        enable(activation_checkpointing_kwargs=dict(_CKPT_KWARGS), offload=offload)
        return
    if offload:
        raise RuntimeError(
            "train.offload_activations needs transformers' activation_checkpointing_enable("
            "offload=...) (transformers 5.x); upgrade transformers or set "
            "train.offload_activations: false"
        )
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(_CKPT_KWARGS))


def _on_accelerator(model: nn.Module) -> bool:
    p = next(model.parameters(), None)
    return p is not None and p.device.type != "cpu"


class OptimizerInBackward:
    """Run ``optimizer``'s update for each parameter during backward, then free its gradient.

    A post-accumulate-grad hook on every trainable parameter (``Tensor.
    register_post_accumulate_grad_hook``, called once per backward when the parameter's
    ``.grad`` is complete) steps the optimizer on that parameter alone: every param group is
    emptied but the parameter's own, which holds just the parameter, for the duration of one
    ``optimizer.step()``. The optimizer object, its state (keyed by parameter, so
    ``state_dict``/checkpoints are unchanged), its param groups' learning rates (an LR scheduler
    keeps working) and its update rule (``torch.optim.AdamW``, bitsandbytes ``AdamW8bit``, ...)
    are the run's own; the result equals ``backward(); optimizer.step(); zero_grad()`` whenever
    the update of one parameter does not read another's gradient (true of Adam-type rules, not
    of a global gradient-norm clip).

    Use one backward per optimizer step (no gradient accumulation) and no gradient clipping.
    Call :meth:`remove` to detach the hooks.

    Args:
        optimizer: a ``torch.optim.Optimizer`` whose ``param_groups`` hold the parameters.
        params: the parameters to hook (default: every parameter of the optimizer).

    Raises:
        ValueError: a parameter in ``params`` is not in any of ``optimizer``'s param groups.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, params: Iterable[nn.Parameter] | None = None
    ) -> None:
        self.optimizer = optimizer
        self._group_of: dict[int, int] = {}
        for gi, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                self._group_of[id(p)] = gi
        hooked = (
            [p for g in optimizer.param_groups for p in g["params"]] if params is None else params
        )
        self._handles = []
        for p in hooked:
            if id(p) not in self._group_of:
                raise ValueError(
                    f"a parameter of shape {tuple(p.shape)} is not in the optimizer's param "
                    "groups; build OptimizerInBackward from the optimizer that trains it"
                )
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._step_one))
        #: parameters updated since the last :meth:`reset_count` (one per hooked parameter per
        #: backward): lets the caller check that a backward reached every parameter
        self.updated = 0

    def _step_one(self, p: torch.Tensor) -> None:
        groups = self.optimizer.param_groups
        saved = [g["params"] for g in groups]
        try:
            for g in groups:
                g["params"] = []
            groups[self._group_of[id(p)]]["params"] = [p]
            self.optimizer.step()
        finally:
            for g, ps in zip(groups, saved, strict=True):
                g["params"] = ps
        p.grad = None
        self.updated += 1

    def reset_count(self) -> int:
        """The number of parameter updates since the last call; resets it to 0."""
        n, self.updated = self.updated, 0
        return n

    def remove(self) -> None:
        """Detach the hooks (later backwards leave gradients in ``.grad`` again)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
