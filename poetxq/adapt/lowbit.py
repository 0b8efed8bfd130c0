"""FPO on a low-bit base: every non-target linear frozen in our bnb-compatible formats.

FPO (Patil, Dennis et al., arXiv 2608.14563) needs only forward passes through the layers it does
not adapt, so those can stay int8 (bitsandbytes ``Int8Params`` layout) or NF4/FP4
(``Params4bit`` layout) in :class:`poetxq.model.layer.FrozenLinear`, the frozen low-bit linear
the POET layer's GEMM is made of too: their weight formats' GEMMs (:mod:`quant_kernels.formats`)
run Triton on a GPU and the plain-torch references elsewhere. The target MLP projections stay
dense, with the fp32 masters of :class:`poetxq.adapt.fpo.FPOAdapter`.

Scope (a choice, stated): the decoder blocks' attention and MLP projections are quantized; the
embedding and the LM head stay dense (the LM head's weight is also ``W_lm`` of the output signal,
and tied to the embedding in SmolLM2-class models). :func:`densify` turns the frozen layers back
into ``nn.Linear`` holding the dequantized weights, so the adapted model saves as a plain
transformers checkpoint that computes what was adapted.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from poetxq.adapt.fpo import MLP_PROJS, llama_parts
from poetxq.model.layer import FrozenLinear
from poetxq.model.quant import make_frozen_weight

__all__ = ["FrozenLinear", "densify", "freeze_low_bit"]


def freeze_low_bit(
    model: nn.Module,
    targets: Sequence[int],
    bits: int,
    *,
    quant_type: str = "nf4",
    blocksize: int = 64,
) -> int:
    """Replace every decoder-block linear except the target MLP projections by a
    :class:`FrozenLinear` in ``bits`` (8: int8 row-wise; 4: ``quant_type`` NF4/FP4, blockwise).

    Args:
        model: a transformers Llama-family causal LM (:func:`poetxq.adapt.fpo.llama_parts`).
        targets: layer indices whose ``gate_proj`` / ``up_proj`` / ``down_proj`` stay dense
            (already normalised: ``0 ≤ i < n_layers``).
        bits: 8 or 4.
        quant_type, blocksize: the 4-bit code and block size.

    Returns:
        The number of linears replaced.

    Raises:
        ValueError: ``bits`` other than 8 or 4, a biased linear, or what
            :func:`poetxq.model.quant.make_frozen_weight` raises.
    """
    if bits not in (8, 4):
        raise ValueError(f"freeze_low_bit takes bits 8 or 4, not {bits}")
    parts = llama_parts(model)
    keep = {(i, name) for i in targets for name in MLP_PROJS}
    replaced = 0
    for i, layer in enumerate(parts.layers):
        for owner_name, owner in (("self_attn", layer.self_attn), ("mlp", layer.mlp)):
            for name, child in list(owner.named_children()):
                if not isinstance(child, nn.Linear) or (owner_name == "mlp" and (i, name) in keep):
                    continue
                if child.bias is not None:
                    raise ValueError(f"layer {i} {owner_name}.{name} has a bias; not supported")
                store = make_frozen_weight(child.weight.detach(), bits, quant_type=quant_type,
                                           blocksize=blocksize)  # fmt: skip
                setattr(owner, name, FrozenLinear(store).to(child.weight.device))
                replaced += 1
    return replaced


@torch.no_grad()
def densify(model: nn.Module, dtype: torch.dtype | None = None) -> int:
    """Replace every :class:`FrozenLinear` by an ``nn.Linear`` with its dequantized weight.

    Args:
        model: a model :func:`freeze_low_bit` changed.
        dtype: weight dtype of the new linears (default: the model's ``config.dtype`` or fp32).

    Returns:
        The number of linears replaced.
    """
    dtype = dtype or getattr(model.config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    found = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, FrozenLinear)]
    for name, mod in found:
        parent = model.get_submodule(name.rsplit(".", 1)[0])
        weight = mod.store.dequantize(dtype)
        linear = nn.Linear(mod.in_features, mod.out_features, bias=False, device=weight.device,
                           dtype=dtype)  # fmt: skip
        linear.weight.copy_(weight)
        linear.weight.requires_grad_(False)
        setattr(parent, name.rsplit(".", 1)[1], linear)
    return len(found)
