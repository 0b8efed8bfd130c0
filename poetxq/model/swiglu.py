"""The SwiGLU elementwise maps of the fused POET MLPs (:class:`poetxq.model.layer.POETXSwiGLUMLP`).

The layers look the maps up in :data:`SWIGLU_OPS` at call time, so
:func:`poetxq.model.fuse.fuse_elementwise` can swap in ``torch.compile``'d versions for every model
at once (and put the plain ones back).
"""

from __future__ import annotations

from typing import Any

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


#: the SwiGLU elementwise maps used by the fused MLPs; :func:`poetxq.model.fuse.fuse_elementwise`
#: swaps in ``torch.compile``'d versions (one kernel each instead of two and five)
SWIGLU_OPS: dict[str, Any] = {"forward": swiglu, "grads": swiglu_grads}
