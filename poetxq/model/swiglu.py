"""The SwiGLU elementwise maps of the fused POET MLPs (:class:`poetxq.model.layer.POETXSwiGLUMLP`).

An MLP is given its :class:`SwiGLUMaps` when it is built (:data:`PLAIN`, the eager maps) and
passes them to its down projection on every call; :func:`poetxq.model.fuse.fuse_elementwise`
hands one model's MLPs the ``torch.compile``'d pair (:func:`compiled_maps`), leaving every other
model as it is.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``SiLU(gate) · up`` (same shapes and dtype as the inputs)."""
    return F.silu(gate) * up


def swiglu_grads(
    gate: torch.Tensor, up: torch.Tensor, dx: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(∂gate, ∂up)`` of ``x = SiLU(gate) · up`` given ``dx = ∂L/∂x``: ``SiLU'(gate)·dx·up``
    (torch's own SiLU backward, fp32 math for 16-bit inputs) and ``dx·SiLU(gate)``."""
    return torch.ops.aten.silu_backward(dx * up, gate), dx * F.silu(gate)


@dataclass(frozen=True)
class SwiGLUMaps:
    """The two elementwise maps a fused MLP's down projection runs.

    Attributes:
        forward: ``(gate, up) -> SiLU(gate) · up``, both ``[..., f]``, same dtype out.
        grads: ``(gate, up, dx) -> (∂gate, ∂up)``, all ``[..., f]``.
    """

    forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    grads: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


#: the eager maps (two kernels forward, five backward over ``[T, f]``)
PLAIN = SwiGLUMaps(swiglu, swiglu_grads)


@functools.cache
def compiled_maps(backend: str = "inductor") -> SwiGLUMaps:
    """The ``torch.compile``'d :data:`PLAIN` maps for ``backend`` (one fused kernel each),
    compiled once per backend so every fused model reuses the same compiled code.

    Args:
        backend: a ``torch.compile`` backend (``"inductor"``; tests use ``"aot_eager"``).
    """
    # dynamic=None: static first, a changed size recompiles once with that size symbolic
    return SwiGLUMaps(
        torch.compile(swiglu, backend=backend, dynamic=None),
        torch.compile(swiglu_grads, backend=backend, dynamic=None),
    )
