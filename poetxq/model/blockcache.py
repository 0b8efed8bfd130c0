"""One batched Cayley–Neumann evaluation per model forward, instead of one per layer side.

A POET-X(Q) model has two orthogonal sides per converted linear layer (168 layers × 2 sides in a
Llama-1B). Computing each side's blocks ``G = CNP(Q)`` inside its own layer costs a dozen small
kernels per side in forward and as many in backward; at small token counts per step those kernel
launches, not the GPU, bound the step time. :class:`BlockCache` instead concatenates the packed
``Q`` of every side that shares ``(b, k, dtype, device)`` and kernel policy, runs the CNP once on
the whole stack when the model's forward starts (a forward pre-hook), and hands each layer its
slice through ``torch.split`` (whose backward is one ``cat``, so gradients flow back to every
``Q`` in one node). The result equals the per-layer computation exactly: the CNP is a per-block map.

The cache lives for one model forward: a forward hook clears it, and each entry also checks the
``Q`` version counter, so a direct layer call (tests, merges) or an optimizer step in between
never sees stale blocks — such calls compute their blocks themselves.

Under activation checkpointing, holding every layer's blocks from forward to backward would cost
more memory than checkpointing saves (1.4 GiB of bf16 blocks at Llama-8B, b = 256). There the
sides are grouped per checkpointed layer (transformers' ``GradientCheckpointingLayer``) instead,
and each group is *lazy*: the first side of a layer that asks computes the blocks of all the
layer's sides in one CNP, inside the checkpointed forward (so the checkpoint frees and recomputes
them with the rest of the layer), and the group forgets them once every side has been served.
That is one CNP per decoder layer instead of one per side (14 in a Llama layer); on the H200 the
per-side CNPs' kernel launches were most of the CPU time of a checkpointed Llama-8B step
(``evals/results/profiles/``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import quant_kernels
from poetxq.model.flat import adjacent_span
from poetxq.model.orthogonal import OrthogonalSide


class _Group:
    """Sides sharing ``(b, k, dtype, device, kernel policy)``; their blocks are computed as one
    stack.

    ``lazy``: computed on the first :meth:`blocks` request (not by :meth:`refresh` from a hook)
    and forgotten once every side has been served (the per-layer groups under checkpointing).
    """

    def __init__(self, sides: list[OrthogonalSide], *, lazy: bool = False) -> None:
        self.sides = sides
        #: lazy groups of *other* layers, forgotten when this one computes (at most one layer's
        #: blocks are held even if a checkpoint's recomputation stopped before the last side)
        self.peers: list[_Group] = []
        self.sizes = [s.nb for s in sides]
        self.block_size = sides[0].block_size
        self.terms = sides[0].neumann_terms
        self.kernels = sides[0].kernels
        self.lazy = lazy
        self.g: torch.Tensor | None = None
        self.versions: list[int] = []
        self.pieces: dict[torch.dtype, tuple[torch.Tensor, ...]] = {}
        self.unserved: set[int] = set()

    def refresh(self) -> None:
        for other in self.peers:
            other.clear()
        q = _stack_q(self.sides)
        self.g = quant_kernels.cayley_neumann(q, self.block_size, self.terms, kernels=self.kernels)
        self.versions = [s.Q._version for s in self.sides]
        self.pieces = {}
        self.unserved = set(range(len(self.sides)))

    def clear(self) -> None:
        self.g, self.versions, self.pieces, self.unserved = None, [], {}, set()

    def blocks(self, side: OrthogonalSide, dtype: torch.dtype) -> torch.Tensor | None:
        """``side``'s blocks ``[nb, b, b]`` in ``dtype``, or None when not cached / stale."""
        i = side.block_cache_index  # an attribute, not an id() map: survives copy.deepcopy
        fresh = self.g is not None and side.Q._version == self.versions[i]
        if not fresh:
            if not self.lazy:
                return None
            self.refresh()
        if dtype not in self.pieces:
            self.pieces[dtype] = torch.split(self.g.to(dtype), self.sizes)
        piece = self.pieces[dtype][i]
        if self.lazy:
            self.unserved.discard(i)
            if not self.unserved:  # the layer's last side: its checkpoint owns the blocks now
                self.clear()
        return piece


class _AdjacentRows(torch.autograd.Function):
    """``torch.cat(qs)`` for ``[n_i, c]`` tensors that already lie end to end in one storage
    (a flattened optimizer group, :class:`poetxq.model.flat.FlatParams`): a view instead of a copy;
    the backward hands each ``Q`` its rows of the gradient (views, which autograd keeps as the
    ``.grad`` tensors, so those lie end to end too)."""

    @staticmethod
    def forward(ctx: Any, *qs: torch.Tensor) -> torch.Tensor:
        ctx.rows = [q.shape[0] for q in qs]
        first = qs[0]
        cols = first.shape[1]
        return first.as_strided((sum(ctx.rows), cols), (cols, 1), first.storage_offset())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(grad.split(ctx.rows))


def _stack_q(sides: list[OrthogonalSide]) -> torch.Tensor:
    """The sides' packed ``Q`` (masked where ragged) stacked ``[sum nb, b(b-1)/2]``."""
    qs = [s.Q if s.mask is None else s.Q * s.mask for s in sides]
    if len(qs) == 1:
        return qs[0]
    if (
        not torch.compiler.is_compiling()  # storage pointers cannot be traced: cat, same values
        and all(s.mask is None for s in sides)
        and adjacent_span(qs) is not None
    ):
        return _AdjacentRows.apply(*qs)
    return torch.cat(qs)


def _checkpoint_units(model: nn.Module) -> list[nn.Module]:
    """The modules transformers checkpoints as a whole (decoder layers), outermost first."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # pragma: no cover - transformers without it: no per-layer groups
        return []
    units: list[nn.Module] = []
    inside: set[nn.Module] = set()  # modules() is pre-order: a unit comes before its children
    for mod in model.modules():
        if mod not in inside and isinstance(mod, GradientCheckpointingLayer):
            units.append(mod)
            inside.update(mod.modules())
    return units


def _by_key(sides: list[OrthogonalSide]) -> list[list[OrthogonalSide]]:
    """``sides`` split by ``(b, k, dtype, device, kernel policy)``, the sides one CNP call can
    serve."""
    by_key: dict[tuple[Any, ...], list[OrthogonalSide]] = {}
    for side in sides:
        key = (side.block_size, side.neumann_terms, side.Q.dtype, side.Q.device, side.kernels)
        by_key.setdefault(key, []).append(side)
    return list(by_key.values())


def q_parameters_in_cnp_order(model: nn.Module) -> list[nn.Parameter]:
    """Every side's ``Q`` under ``model``, in the order :class:`BlockCache` stacks them (by
    ``(b, k, dtype, device, kernel policy)`` group, then module order)."""
    sides = [m for m in model.modules() if isinstance(m, OrthogonalSide)]
    return [s.Q for group in _by_key(sides) for s in group]


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
            (compute) and a forward hook (clear) on it, or on its ``base_model`` (the decoder)
            when that holds every side. Call :meth:`remove` to detach.
    """

    def __init__(self, model: nn.Module) -> None:
        sides = [m for m in model.modules() if isinstance(m, OrthogonalSide)]
        #: one eager group per key over the whole model (no checkpointing)
        self.groups = [_Group(g) for g in _by_key(sides)]
        #: lazy groups per checkpointed layer (checkpointing); sides outside any such layer
        #: compute their own blocks then
        per_unit = [
            [_Group(g, lazy=True) for g in _by_key(inside)]
            for unit in _checkpoint_units(model)
            if (inside := [m for m in unit.modules() if isinstance(m, OrthogonalSide)])
        ]
        self.layer_groups: list[_Group] = [g for mine in per_unit for g in mine]
        for mine in per_unit:  # a layer's own groups never clear each other
            others = [g for g in self.layer_groups if g not in mine]
            for group in mine:
                group.peers = others
        self._checkpointing: bool | None = None
        self._assign(checkpointing=False)
        # hooked on the decoder (transformers' base_model, e.g. LlamaModel) when it holds every
        # side: the top model's forward runs it, and so does a loss that calls the decoder
        # alone (poetxq.training.loss.causal_lm_loss_chunked)
        base = getattr(model, "base_model", model)
        if not isinstance(base, nn.Module) or sum(
            isinstance(m, OrthogonalSide) for m in base.modules()
        ) != len(sides):
            base = model
        self._handles = [
            base.register_forward_pre_hook(self._before),
            base.register_forward_hook(self._after),
        ]

    def _assign(self, *, checkpointing: bool) -> None:
        """Point every side at its group for this mode."""
        if checkpointing == self._checkpointing:
            return
        self._checkpointing = checkpointing
        for group in self.groups:
            for i, side in enumerate(group.sides):
                side.block_cache = None if checkpointing else group
                side.block_cache_index = -1 if checkpointing else i
        if checkpointing:
            for group in self.layer_groups:
                for i, side in enumerate(group.sides):
                    side.block_cache, side.block_cache_index = group, i

    def _before(self, module: nn.Module, _args: Any) -> None:
        ckpt = _checkpointing(module)
        self._assign(checkpointing=ckpt)
        for group in self.layer_groups:
            group.clear()
        for group in self.groups:
            if ckpt:
                group.clear()
            else:
                group.refresh()

    def _after(self, _module: nn.Module, _args: Any, _out: Any) -> None:
        for group in self.groups:
            group.clear()

    def remove(self) -> None:
        """Detach the hooks and forget the cached blocks."""
        for h in self._handles:
            h.remove()
        for group in self.groups + self.layer_groups:
            group.clear()
            for side in group.sides:
                side.block_cache = None


def attach_block_cache(model: nn.Module) -> BlockCache | None:
    """Attach a :class:`BlockCache` to ``model``; None when it has no orthogonal sides."""
    if not any(isinstance(m, OrthogonalSide) for m in model.modules()):
        return None
    return BlockCache(model)
