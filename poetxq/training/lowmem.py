"""Memory-saving training options: activation offload and the optimizer step inside backward.

Both trade speed for peak GPU memory at large models and small batches (Llama-8B/13B at batch
1 × 2048 tokens), where the persistent state (low-bit W0, ``Q``, optimizer states) leaves little
room for the transients of a step. On the H200, the two with the chunked loss of
:mod:`poetxq.training.loss` took the checkpointed Llama-8B step from 11.41 to 10.50 GiB and from
0.56 to 0.75 s (``evals/results/gpu_memory_lowmem_h200.json``).

* :func:`enable_activation_checkpointing` with ``offload=True`` (``train.offload_activations``):
  whole-layer checkpointing whose kept layer inputs (``L × tokens × d`` values) live in pinned
  host memory between forward and backward (torch's ``save_on_cpu`` around each layer's
  checkpoint, as transformers' own ``offload`` option of recent releases does). One
  device→host copy per layer in forward and one host→device copy in backward.
* :class:`OptimizerInBackward` (``train.optimizer_in_backward``): each parameter is updated by
  the run's optimizer as soon as its gradient is complete (a post-accumulate-grad hook) and its
  gradient is freed at once. Under checkpointing at most one decoder layer's gradients are alive;
  without it, the ``Q`` gradients of every layer arrive together at the end of backward (one
  batched Cayley–Neumann node, :mod:`poetxq.model.blockcache`) and are freed one by one.
  Without a global gradient norm there is no gradient clipping, and there is one update per
  backward (no gradient accumulation); the recipe schema enforces both.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import save_on_cpu
from torch.utils.checkpoint import checkpoint

from poetxq.training.optim import update_one

_CKPT_KWARGS = {"use_reentrant": False}


def enable_activation_checkpointing(
    model: nn.Module, *, offload: bool = False, graph_safe: bool = False
) -> None:
    """Whole-decoder-layer activation checkpointing (non-reentrant) on a transformers model.

    Each decoder layer keeps only its input and recomputes the rest in backward. ``offload``
    keeps those inputs in pinned host memory instead of on the GPU (module docstring): each
    layer's checkpoint runs inside torch's ``save_on_cpu``, whose copies are asynchronous on the
    compute stream. For a model on the CPU, whose activations are in host memory already,
    ``offload`` changes nothing; where the model is is read once, here (move it first).

    ``graph_safe`` (with ``offload``; for a step replayed from a CUDA graph): the host copies go
    to pinned buffers of each layer's own, made on the first forward and reused by every later
    one (:class:`HostSlots`), instead of pinned memory allocated per tensor and step, which a
    graph capture cannot do. One device→host copy per kept tensor in forward, one host→device
    copy in backward, both recorded in the graph.
    """
    enable = getattr(model, "activation_checkpointing_enable", None)
    if (
        enable is not None
        and "activation_checkpointing_kwargs" in inspect.signature(enable).parameters
    ):  # recent transformers (where gradient_checkpointing_enable is deprecated)
        enable(activation_checkpointing_kwargs=dict(_CKPT_KWARGS))
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(_CKPT_KWARGS))
    if not (offload and _on_accelerator(model)):
        return
    for module in model.modules():  # where transformers put its checkpoint function
        if getattr(module, "_gradient_checkpointing_func", None) is not None:
            module._gradient_checkpointing_func = (
                functools.partial(_slotted_checkpoint, HostSlots(), **_CKPT_KWARGS)
                if graph_safe
                else functools.partial(_offloaded_checkpoint, **_CKPT_KWARGS)
            )


class HostSlots:
    """Saved-tensor hooks that keep one checkpointed layer's saved tensors in host buffers of
    its own (pinned where CUDA is), reused from step to step (``graph_safe`` offload of
    :func:`enable_activation_checkpointing`).

    The ``i``-th tensor saved during a forward goes to buffer ``i`` (made on first use, and again
    if its shape or dtype changes); unpacking copies it back to the tensor's device. A buffer is
    overwritten by the next forward of the layer: one forward, then its backward, as a training
    step runs and a CUDA graph replays; copies are ordered on the current stream.
    """

    def __init__(self) -> None:
        self.slots: list[torch.Tensor] = []
        self.count = 0  # tensors saved so far in the current forward

    def start(self) -> None:
        """A new forward of the layer: its first saved tensor goes to buffer 0 again."""
        self.count = 0

    def pack(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.device]:
        """Copy ``t`` into the next buffer; the handle is ``(buffer, t's device)``."""
        i, self.count = self.count, self.count + 1
        if i == len(self.slots):
            self.slots.append(self._new(t))
        elif self.slots[i].shape != t.shape or self.slots[i].dtype != t.dtype:
            self.slots[i] = self._new(t)
        self.slots[i].copy_(t, non_blocking=True)
        return self.slots[i], t.device

    @staticmethod
    def unpack(packed: tuple[torch.Tensor, torch.device]) -> torch.Tensor:
        """The saved tensor, copied back to its device."""
        slot, device = packed
        return slot.to(device, non_blocking=True)

    @staticmethod
    def _new(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())


def _slotted_checkpoint(slots: HostSlots, function: Callable, *args: Any, **kwargs: Any) -> Any:
    """``torch.utils.checkpoint.checkpoint`` whose kept tensors wait in ``slots``' buffers."""
    slots.start()
    with torch.autograd.graph.saved_tensors_hooks(slots.pack, slots.unpack):
        return checkpoint(function, *args, **kwargs)


def _offloaded_checkpoint(function: Callable, *args: Any, **kwargs: Any) -> Any:
    """``torch.utils.checkpoint.checkpoint`` whose kept inputs wait in (pinned) host memory."""
    with save_on_cpu(pin_memory=torch.cuda.is_available()):
        return checkpoint(function, *args, **kwargs)


def _on_accelerator(model: nn.Module) -> bool:
    p = next(model.parameters(), None)
    return p is not None and p.device.type != "cpu"


class OptimizerInBackward:
    """Run ``optimizer``'s update for each parameter during backward, then free its gradient.

    A post-accumulate-grad hook on every trainable parameter (``Tensor.
    register_post_accumulate_grad_hook``, called once per backward when the parameter's
    ``.grad`` is complete) updates that parameter alone: every param group is emptied but the
    parameter's own, which holds just the parameter, for one ``optimizer.step()``; for
    bitsandbytes' 8-bit optimizers, their per-parameter update is called directly, without the
    device synchronization their ``step`` adds after each parameter.

    The optimizer object stays the run's own: its state (keyed by parameter, so ``state_dict``
    and checkpoints are unchanged), its groups' learning rates (an LR scheduler keeps working)
    and its update rule (``torch.optim.AdamW``, bitsandbytes ``AdamW8bit``, ...). The result
    equals ``backward(); optimizer.step(); zero_grad()`` whenever the update of one parameter
    does not read another's gradient: true of Adam-type rules, not of a global-norm clip.

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
        self._where: dict[int, tuple[int, int]] = {}  # id(param) -> (group index, index in it)
        for gi, group in enumerate(optimizer.param_groups):
            for pi, p in enumerate(group["params"]):
                self._where[id(p)] = (gi, pi)
        hooked = (
            [p for g in optimizer.param_groups for p in g["params"]] if params is None else params
        )
        self._handles = []
        for p in hooked:
            if id(p) not in self._where:
                raise ValueError(
                    f"a parameter of shape {tuple(p.shape)} is not in the optimizer's param "
                    "groups; build OptimizerInBackward from the optimizer that trains it"
                )
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._step_one))
        #: parameters updated since the last :meth:`reset_count` (one per hooked parameter per
        #: backward): lets the caller check that a backward reached every parameter
        self.updated = 0

    @torch.no_grad()
    def _step_one(self, p: torch.Tensor) -> None:
        gi, pi = self._where[id(p)]
        update_one(self.optimizer, gi, pi, p)
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
