"""Lay a built model's device tensors out afresh, end to end, so freed tensors leave no holes.

Building a POET-X(Q) model allocates its frozen ``W0`` and its trainable ``Q`` tensors layer by
layer, interleaved; flattening the optimizer's groups (:class:`poetxq.model.flat.FlatParams`) then
copies every ``Q`` into one buffer and frees the originals. Each freed ``Q`` leaves a hole of a
few MiB between two ``W0`` blocks. With ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``
those holes stay reserved (no later tensor of the step fits in them, and ``empty_cache`` can
only unmap whole free pages): 1.01e9 bytes at Llama-13B, b = 256
(``evals/results/gpu_memory_13b_expandable_sizes_h200_e0551b7.json``, ``segments_after_build``).

:func:`relayout` copies every distinct storage behind the given tensors to the host, lets the
device ones go, and copies them back one after another, so they are allocated in order with
nothing freed in between. Tensors keep their identity (``Parameter`` objects, the optimizer's
references, ``FlatParams.flat``), shapes, strides, offsets and values; tensors that shared a
storage share the new one, so flattened parameters stay views of their buffer.

``poetxq train`` does it for POET methods on CUDA when the allocator runs with expandable
segments and the optimizer has flattened groups (:func:`relayout_wanted`). Under the allocator's
defaults each freed ``Q``'s segment is handed back whole, so there is nothing to gain. Without
flattened groups (``train.offload_optimizer``, the lowest memory plan) no ``Q`` is freed, and the
relayout would only copy the full weights through host memory (64 GiB for Llama-70B int8) for
little: with the lowest plan on an H100 it lowered the run's reserved peak (build and steps) by
0.10 GiB at Llama-8B and not at all at 13B, where the build's peak is the larger
(``evals/memory_plans.py`` with and without ``--no-relayout`` at ac7034e; the files are in git
history up to 264500c, docs/MEMORY.md).
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class RelayoutReport:
    """What :func:`relayout` moved.

    Attributes:
        storages: distinct storages copied out and back.
        bytes: their total size in bytes.
        seconds: wall time of the round trip (device synchronized).
        left_on_device: bytes the device's allocator still held allocated while every moved
            storage was on the host (tensors reachable only from elsewhere, which keep their
            place and may still split the new layout); 0 off CUDA.
    """

    storages: int
    bytes: int
    seconds: float
    left_on_device: int


#: the environment variables torch's caching allocator reads its settings from (old, new name)
ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def alloc_conf() -> str:
    """The allocator settings of this process: ``PYTORCH_CUDA_ALLOC_CONF`` and
    ``PYTORCH_ALLOC_CONF`` joined by ``,`` (empty ones left out; "" when neither is set)."""
    return ",".join(v for v in (os.environ.get(k, "") for k in ALLOC_CONF_VARS) if v)


def expandable_segments() -> bool:
    """Whether the allocator settings (:func:`alloc_conf`) turn on ``expandable_segments``;
    the last setting of the key wins, as in torch's own parser."""
    on = False
    for item in alloc_conf().split(","):
        key, _, value = item.partition(":")
        if key.strip() == "expandable_segments":
            on = value.strip().lower() == "true"
    return on


def relayout_wanted(
    device: torch.device | str, optimizer: torch.optim.Optimizer | None = None
) -> bool:
    """Whether :func:`relayout` pays for a model built on ``device`` whose trainable parameters
    ``optimizer`` holds: a CUDA device whose allocator uses expandable segments
    (:func:`expandable_segments`) and an optimizer with flattened groups (``flat_groups``, whose
    building freed every ``Q``; module docstring)."""
    flat = bool(getattr(optimizer, "flat_groups", ()))
    return torch.device(device).type == "cuda" and expandable_segments() and flat


def relayout_planned(device: torch.device | str, allocator: str | None = None) -> bool:
    """Whether a run on ``device`` will lay its memory out afresh (:func:`relayout_wanted`,
    given an optimizer with flattened groups) once a memory plan's ``allocator`` setting is
    applied (:func:`poetxq.training.memory.apply_allocator`: an ``expandable_segments`` the
    user set in the environment wins; otherwise the plan's setting is added)."""
    if torch.device(device).type != "cuda":
        return False
    if "expandable_segments" in alloc_conf() or not allocator:
        return expandable_segments()
    return "expandable_segments:true" in allocator.replace(" ", "").lower()


def model_tensors(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> list[torch.Tensor]:
    """Every tensor of a built model a relayout must move: parameters, their gradients, buffers,
    and the flat buffers of an optimizer's flattened groups (``optimizer.flat_groups``).

    Args:
        model: the module.
        optimizer: its optimizer, or None. Its state tensors are not included (call
            :func:`relayout` before the first step, when there are none).

    Returns:
        list[torch.Tensor]: in module order, without repeats.
    """
    out: list[torch.Tensor] = []
    seen: set[int] = set()

    def add(t: torch.Tensor | None) -> None:
        if t is not None and id(t) not in seen:
            seen.add(id(t))
            out.append(t)

    for group in getattr(optimizer, "flat_groups", ()):
        add(group.flat)  # first: the buffer the parameters are views of
    for p in model.parameters():
        add(p)
        add(p.grad)
    for b in model.buffers():
        add(b)
    return out


def _view(storage: torch.UntypedStorage, like: torch.Tensor) -> torch.Tensor:
    """A tensor over ``storage`` with ``like``'s dtype, offset, shape and strides."""
    t = torch.empty(0, dtype=like.dtype, device=storage.device)
    return t.set_(storage, like.storage_offset(), like.shape, like.stride())


def relayout(tensors: Iterable[torch.Tensor], device: torch.device | str) -> RelayoutReport:
    """Copy the storages of ``tensors`` that live on ``device`` to the host and back, in order.

    Each tensor is re-pointed in place (``tensor.data = ...``), so every holder of the tensor
    object sees the new storage. Tensors elsewhere than ``device`` are left alone. Call it
    before the first training step: autograd graphs, optimizer states and other views taken
    from these tensors earlier keep the old storages alive (and in the old place).

    Args:
        tensors: the tensors to move (:func:`model_tensors`); repeats are ignored.
        device: the device whose tensors are laid out afresh (CUDA in use; a CPU device works
            the same way, which is how the tests check it).

    Returns:
        :class:`RelayoutReport`.

    Raises:
        RuntimeError: out of host or device memory during the copies; every tensor then still
            points at a valid copy of its values, but some of them on the host.
    """
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    t0 = time.perf_counter()
    # by storage; no name here may keep a device storage alive past the copies to the host
    groups: dict[int, list[torch.Tensor]] = {}
    seen: set[int] = set()
    for t in tensors:
        if t.device != dev or id(t) in seen or t.untyped_storage().nbytes() == 0:
            continue
        seen.add(id(t))
        groups.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    moved: list[tuple[torch.UntypedStorage, list[torch.Tensor]]] = []
    total = 0
    for ts in groups.values():
        host = torch.empty(ts[0].untyped_storage().nbytes(), dtype=torch.uint8).untyped_storage()
        host.copy_(ts[0].untyped_storage())
        for t in ts:
            t.data = _view(host, t)
        moved.append((host, ts))
        total += host.nbytes()
    groups.clear()  # every tensor points at the host now: the device storages are free
    gc.collect()
    left = 0
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        left = torch.cuda.memory_allocated(dev)
    for host, ts in moved:
        new = torch.empty(host.nbytes(), dtype=torch.uint8, device=dev).untyped_storage()
        new.copy_(host)
        for t in ts:
            t.data = _view(new, t)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return RelayoutReport(len(moved), total, time.perf_counter() - t0, left)


def relayout_if_wanted(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device | str,
    say: Callable[[str], None] = print,
) -> RelayoutReport | None:
    """:func:`relayout` of ``model`` and ``optimizer``'s tensors when :func:`relayout_wanted`
    says so (one line to ``say``), else nothing. Returns the report or None."""
    if not relayout_wanted(device, optimizer):
        return None
    moved = relayout(model_tensors(model, optimizer), device)
    say(
        f"device memory laid out afresh (expandable segments): {moved.bytes / 2**30:.2f} GiB "
        f"in {moved.seconds:.1f} s"
    )
    return moved
