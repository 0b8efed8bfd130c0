"""One batched Cayley–Neumann evaluation per model forward, instead of one per layer side.

A POET-X(Q) model has two orthogonal sides per converted linear layer (168 layers × 2 sides in a
Llama-1B). Computing each side's blocks ``G = CNP(Q)`` inside its own layer costs a dozen small
kernels per side in forward and as many in backward; at small token counts per step those kernel
launches, not the GPU, bound the step time. :class:`BlockCache` instead concatenates the packed
``Q`` of every side that shares ``(b, k, dtype, device)``, runs the CNP once on the whole stack
when the model's forward starts (a forward pre-hook), and hands each layer its slice through
``torch.split`` (whose backward is one ``cat``, so gradients flow back to every ``Q`` in one
node). The result equals the per-layer computation exactly: the CNP is a per-block map.

The cache lives for one model forward: a forward hook clears it, and each entry also checks the
``Q`` version counter, so a direct layer call (tests, merges) or an optimizer step in between
never sees stale blocks — such calls compute their blocks themselves. Under activation
checkpointing the cache stays empty: each checkpointed layer computes its own blocks, so only one
layer's blocks are alive at a time (holding every layer's blocks from forward to backward would
cost more memory than checkpointing saves there).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import quant_kernels
from poetxq.orthogonal import OrthogonalSide


class _Group:
    """Sides sharing ``(b, k, dtype, device)``; their blocks are computed as one stack."""

    def __init__(self, sides: list[OrthogonalSide]) -> None:
        self.sides = sides
        self.sizes = [s.nb for s in sides]
        self.block_size = sides[0].block_size
        self.terms = sides[0].neumann_terms
        self.g: torch.Tensor | None = None
        self.versions: list[int] = []
        self.pieces: dict[torch.dtype, tuple[torch.Tensor, ...]] = {}

    def refresh(self) -> None:
        qs = [s.Q if s.mask is None else s.Q * s.mask for s in self.sides]
        q = qs[0] if len(qs) == 1 else torch.cat(qs)
        self.g = quant_kernels.cayley_neumann_lean(q, self.block_size, self.terms)
        self.versions = [s.Q._version for s in self.sides]
        self.pieces = {}

    def clear(self) -> None:
        self.g, self.versions, self.pieces = None, [], {}

    def blocks(self, side: OrthogonalSide, dtype: torch.dtype) -> torch.Tensor | None:
        """``side``'s blocks ``[nb, b, b]`` in ``dtype``, or None when not cached / stale."""
        if self.g is None:
            return None
        i = side.block_cache_index  # an attribute, not an id() map: survives copy.deepcopy
        if side.Q._version != self.versions[i]:
            return None
        if dtype not in self.pieces:
            self.pieces[dtype] = torch.split(self.g.to(dtype), self.sizes)
        return self.pieces[dtype][i]


def _checkpointing(model: nn.Module) -> bool:
    """Whether transformers' activation checkpointing is on for ``model``."""
    flag = getattr(model, "is_activation_checkpointing", None)  # transformers >= 5.2x
    if flag is None:
        flag = getattr(model, "is_gradient_checkpointing", False)
    return bool(flag)


class BlockCache:
    """Batched CNP for every :class:`OrthogonalSide` under ``model`` (see the module docstring).

    Args:
        model: a model containing POET-X(Q) layers; the cache registers a forward pre-hook
            (compute) and a forward hook (clear) on it. Call :meth:`remove` to detach.
    """

    def __init__(self, model: nn.Module) -> None:
        groups: dict[tuple[Any, ...], list[OrthogonalSide]] = {}
        for mod in model.modules():
            if isinstance(mod, OrthogonalSide):
                key = (mod.block_size, mod.neumann_terms, mod.Q.dtype, mod.Q.device)
                groups.setdefault(key, []).append(mod)
        self.groups = [_Group(sides) for sides in groups.values()]
        for group in self.groups:
            for i, side in enumerate(group.sides):
                side.block_cache, side.block_cache_index = group, i
        self._handles = [
            model.register_forward_pre_hook(self._before),
            model.register_forward_hook(self._after),
        ]

    def _before(self, module: nn.Module, _args: Any) -> None:
        ckpt = _checkpointing(module)
        for group in self.groups:
            for side in group.sides:  # a checkpointed layer frees its CNP intermediates itself
                side.lean_cnp = not ckpt
            if ckpt:
                group.clear()  # each checkpointed layer computes (and recomputes) its own
            else:
                group.refresh()

    def _after(self, _module: nn.Module, _args: Any, _out: Any) -> None:
        for group in self.groups:
            group.clear()

    def remove(self) -> None:
        """Detach the hooks and forget the cached blocks."""
        for h in self._handles:
            h.remove()
        for group in self.groups:
            group.clear()
            for side in group.sides:
                side.block_cache = None


def attach_block_cache(model: nn.Module) -> BlockCache | None:
    """Attach a :class:`BlockCache` to ``model``; None when it has no orthogonal sides."""
    if not any(isinstance(m, OrthogonalSide) for m in model.modules()):
        return None
    return BlockCache(model)
