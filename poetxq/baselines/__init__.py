"""The baselines' update rules, trained in the same loop as POET-XQ: GaLore, APOLLO, Q-GaLore,
Q-APOLLO (and AdamW, which is torch's).

Our own implementations of the papers' update rules (GaLore arXiv 2403.03507, Q-GaLore
arXiv 2407.08296, APOLLO arXiv 2412.05270), in two modules:

* :mod:`poetxq.baselines.qlinear` — group-wise asymmetric 8-bit weights and ``QuantLinear``.
* :mod:`poetxq.baselines.lowrank` — ``LowRankAdamW``: GaLore/APOLLO projections, Q-GaLore's INT4
  projectors, lazy refresh and 8-bit states, APOLLO's scaling and norm-growth limiter, and the
  in-place re-quantization of int8 weights.

They know nothing of recipes: a recipe's ``method`` becomes a prepared model and an optimizer in
:mod:`poetxq.training.baseline_methods`.
"""

from __future__ import annotations

from torch import nn

from poetxq.baselines.lowrank import (
    LowRankAdamW,
    apollo_projection_seed,
    clip_grad_norm_all,
    optimizer_state_bytes,
)
from poetxq.baselines.qlinear import (
    QuantLinear,
    dequantize_groupwise,
    quantize_groupwise,
    quantize_linears,
)

__all__ = [
    "LowRankAdamW",
    "QuantLinear",
    "apollo_projection_seed",
    "clip_grad_norm_all",
    "dequantize_groupwise",
    "optimizer_state_bytes",
    "quant_modules",
    "quantize_groupwise",
    "quantize_linears",
]


def quant_modules(model: nn.Module) -> list[QuantLinear]:
    """All :class:`QuantLinear` layers of ``model`` in module order."""
    return [m for m in model.modules() if isinstance(m, QuantLinear)]
