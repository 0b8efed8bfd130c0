"""The estimator's terms: bytes of each kind of tensor a step holds (a frozen store, one
orthogonal side, a low-rank optimizer state) and which kernel path a layer takes under the run's
:class:`~quant_kernels.policy.KernelPolicy` (the same policy object the layer is built with), so
:func:`poetxq.training.estimate.estimate_memory` counts what the run will really keep."""

from __future__ import annotations

import math
from typing import Literal

from poetxq.training.recipe import Recipe
from quant_kernels.policy import KernelPolicy

#  how a run holds its parameters and computes, named as
# :data:`poetxq.training.precision.RunPrecision`
#: (``train.precision: auto`` runs ``autocast`` on a GPU and ``fp32`` on the CPU; ``bf16-true``
#: is every parameter in bf16 without autocast)
Precision = Literal["autocast", "bf16-true", "fp32"]
PRECISIONS: tuple[Precision, ...] = ("autocast", "bf16-true", "fp32")
STATE_BLOCK = 256  # bitsandbytes' block for 8-bit optimizer states
NF4_BLOCK = 64
NESTED_BLOCK = 256


def gpu_kernel_path(kernels: KernelPolicy, switch: str, precision: Precision) -> bool:
    """Whether the run this estimate describes takes the GPU-only path ``switch`` (a
    :class:`~quant_kernels.policy.KernelPolicy` field): never for ``fp32`` (CPU training: CPU
    tensors take the torch path) nor without Triton (``POETXQ_KERNELS=torch``). The precision
    stands for the device: ``autocast`` / ``bf16-true`` estimates describe a GPU run (a CPU run
    in bf16 takes no such path and keeps a little more; a GPU run in fp32 takes them and keeps a
    little less)."""
    return precision != "fp32" and kernels.on_gpu(switch)


def lean_fast_swiglu(kernels: KernelPolicy, precision: Precision) -> bool:
    """Whether the run takes the lean ``fast`` SwiGLU down projection (``lean_fast_swiglu``,
    which runs inside the fast variant's feature-major path, behind its own switch)."""
    return gpu_kernel_path(kernels, "lean_fast_swiglu", precision) and gpu_kernel_path(
        kernels, "fast_feature_major", precision
    )


def fused_input_cast(kernels: KernelPolicy, precision: Precision) -> bool:
    """Whether the run passes fp32 inputs uncast into feature-major ``mem`` POET layers
    (``fused_input_cast``, taken only where the layer is feature-major): only under autocast,
    where the inputs are fp32 and the compute bf16."""
    return (
        precision == "autocast"
        and gpu_kernel_path(kernels, "fused_input_cast", precision)
        and gpu_kernel_path(kernels, "feature_major", precision)
    )


#: projections of a decoder layer that read one shared input (the attention norm's, the MLP
#: norm's output)
_SHARED_INPUT_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def fused_cast_saving(recipe: Recipe, targets: set[str], bits: int, b: int) -> int:
    """Bytes per token and decoder layer that ``mem`` layers save less under bf16 autocast when
    they take their fp32 input uncast (:func:`fused_input_cast`): each feature-major projection
    of a group keeps the group's one fp32 input (``4d``, shared) instead of its own bf16 copy
    (``2d``). q/k/v: ``6d → 4d``; gate/up: ``4d → 4d``. Negative for a group with one such
    projection. Feature-major: in ``targets``, no ragged side (any store: the 4-bit one's
    input-order wrapper gathers feature-major rows)."""
    d = recipe.model.hidden_size
    dims = {name: (m, n) for name, m, n in projections(recipe)}
    saving = 0
    for group in _SHARED_INPUT_GROUPS:
        fm = [
            g for g in group
            if g in targets and dims[g][0] % b == 0 and dims[g][1] % b == 0
        ]  # fmt: skip
        if fm:
            saving += 2 * d * len(fm) - 4 * d
    return saving


def projections(recipe: Recipe) -> list[tuple[str, int, int]]:
    """``(name, out m, in n)`` of one decoder layer's projections (transformers' Llama: q_proj
    has ``num_attention_heads * head_dim`` rows, k_proj / v_proj ``num_key_value_heads *
    head_dim``; ``head_dim`` is ``model.head_dim`` or ``hidden_size / num_attention_heads``)."""
    mc = recipe.model
    d, f, h = mc.hidden_size, mc.intermediate_size, mc.num_attention_heads
    hd = mc.head_width
    kv = (mc.num_key_value_heads or h) * hd
    return [("q_proj", h * hd, d), ("k_proj", kv, d), ("v_proj", kv, d), ("o_proj", d, h * hd),
            ("gate_proj", f, d), ("up_proj", f, d), ("down_proj", d, f)]  # fmt: skip


def frozen_store_bytes(
    m: int, n: int, bits: int, *, double_quant: bool = True, elt: int = 4
) -> int:
    """Bytes of one POET frozen store ``[m, n]`` (:mod:`poetxq.model.quant` buffers).

    Args:
        m, n: out / in features.
        bits: 8 (int8 row-wise), 4 (NF4/FP4 blockwise), 16 (dense in a dtype of ``elt`` bytes).
        double_quant: 4-bit absmax quantized again.
        elt: bytes per element of a dense store.
    """
    if bits == 8:
        return m * n + 4 * m + 1  # CB int8, SCB fp32, weight_format uint8
    if bits == 4:
        blocks = math.ceil(m * n / NF4_BLOCK)
        out = math.ceil(m * n / 2) + 16 * 4  # packed codes, quant_map
        if double_quant:
            out += blocks + 4 * math.ceil(blocks / NESTED_BLOCK) + 256 * 4 + 4
        else:
            out += 4 * blocks
        return out
    return m * n * elt


def side_blocks(dim: int, b: int) -> tuple[int, int, bool]:
    """``(blocks, packed entries per block, ragged)`` of one orthogonal side."""
    nb = math.ceil(dim / b)
    return nb, b * (b - 1) // 2, dim % b != 0


def trained_entries(dim: int, b: int, structure: str = "block") -> int:
    """Entries of ``Q`` that train on one side (:meth:`OrthogonalSide.num_trainable`): every block's
    ``b(b−1)/2``, a ragged last block's ``r(r−1)/2`` (``r`` real coordinates), or with
    ``structure="full"`` (POET-FS) one block's."""
    nb, per, ragged = side_blocks(dim, b)
    if structure == "full":
        return per
    r = dim - (nb - 1) * b
    return (nb - 1) * per + r * (r - 1) // 2 if ragged else nb * per


def lowrank_state_bytes(m: int, n: int, recipe: Recipe) -> int:
    """Bytes LowRankAdamW keeps for one ``[m, n]`` low-rank weight after its first step."""
    from poetxq.training.baseline_methods import resolved_settings

    s = resolved_settings(recipe.method, recipe.baseline)
    r = min(s["rank"], m, n)
    right = m >= n
    low = m * r if right else r * n
    if s["state_bits"] == 8:
        moments = 2 * (low + 4 * math.ceil(low / STATE_BLOCK))
    else:
        moments = 2 * 4 * low
    proj_numel = r * n if right else m * r
    if s["method"] == "apollo":
        return moments + 4 * proj_numel + 4  # projector fp32, prev_norm fp32 scalar
    if s["proj_bits"] == 4:
        groups = math.ceil(proj_numel / s["proj_group_size"])
        proj = math.ceil(proj_numel / 2) + 2 * 4 * groups
    else:
        proj = 4 * proj_numel
    lazy = 4 * (n if right else m) if s["lazy"] else 0
    return moments + proj + lazy
