"""Blockwise 8-bit AdamW update in bitsandbytes' state format, with a table-driven code search.

bitsandbytes keeps Adam's two moments in 8 bits: per block of :data:`BLOCK` = 256 elements one
fp32 ``absmax`` and one byte per element, an index into a 256-entry ``quant_map`` (the signed
dynamic map for the first moment, the unsigned one for the second; Dettmers et al. 2022, "8-bit
Optimizers via Block-wise Quantization"). An update dequantizes both moments, applies AdamW, and
re-quantizes each moment to the *nearest* entry of its map after dividing by the block's new
``absmax``. bitsandbytes' Triton kernel (``bitsandbytes.backends.triton.kernels_optim``) finds
that entry with an 8-step binary search per element and state, 16 dependent table loads; on an
H200 it runs at ~6.7× its memory floor whatever its launch shape
(``evals/results/bench_optim8bit_sweep_h200_7570a65.json``).

:func:`adam8bit_update` computes the same update, in the same floating-point order, and finds the
same entry with three loads in a chain of three instead of ten: a lookup table indexed by the top
bits of the normalized value (sign, exponent and :data:`TABLE_MANTISSA_BITS` mantissa bits; each
such bucket of floats holds at most one entry of the map, checked when the table is built) gives
the number of entries below the bucket, one comparison with the next entry gives the search's
final interval, and the nearer of its two ends is the code, ties to the lower one as
bitsandbytes' kernel does. So the parameters, codes and ``absmax`` equal those of bitsandbytes'
Triton kernel bit for bit (tests under Triton's interpreter; on the H200,
``evals/results/bench_optim8bit_h200_ef47a77.json``); against its CUDA op they differ at
rounding level, as its Triton kernel does.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import triton
import triton.language as tl

__all__ = [
    "BLOCK",
    "TABLE_MANTISSA_BITS",
    "adam8bit_update",
    "adam8bit_update_device_scalars",
    "search_table",
]

#: elements per ``absmax`` block (bitsandbytes' blockwise optimizer states)
BLOCK = 256
#: mantissa bits of the normalized value that index :func:`search_table` (with sign and exponent)
TABLE_MANTISSA_BITS = 7
#: ``absmax`` blocks per program
_BLOCKS_PER_PROGRAM = 4

#: (data_ptr, version, device) of a map → (the map tensor, its table); holding the map keeps its
#: memory from being reused by another map while the entry exists
_tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def search_table(quant_map: torch.Tensor, mantissa_bits: int = TABLE_MANTISSA_BITS) -> torch.Tensor:
    """For every float32 bucket that shares sign, exponent and the top ``mantissa_bits`` mantissa
    bits (``2**(9 + mantissa_bits)`` buckets, indexed by ``bits >> (23 - mantissa_bits)``): how
    many entries of ``quant_map`` lie below the bucket's smallest value (at most 255).

    Args:
        quant_map: ``[256]`` fp32, strictly increasing (bitsandbytes' dynamic maps).
        mantissa_bits: 0–23.

    Returns:
        ``[2**(9 + mantissa_bits)]`` uint8 on ``quant_map``'s device (NaN / inf buckets: 0).

    Raises:
        ValueError: ``quant_map`` is not 256 increasing fp32 values, or some bucket holds two or
            more of them (then the lookup cannot stand in for the search; use more bits).
    """
    if quant_map.dtype != torch.float32 or quant_map.shape != (256,):
        raise ValueError(f"quant_map must be [256] float32, got {tuple(quant_map.shape)} "
                         f"{quant_map.dtype}")  # fmt: skip
    code = quant_map.detach().cpu()
    if not bool((code[1:] > code[:-1]).all()):
        raise ValueError("quant_map must be strictly increasing")
    shift = 23 - mantissa_bits
    keys = np.arange(1 << (9 + mantissa_bits), dtype=np.uint64)
    first = (keys << shift).astype(np.uint32)
    last = (first | np.uint32((1 << shift) - 1)).astype(np.uint32)
    first_v = torch.from_numpy(first.view(np.float32))
    last_v = torch.from_numpy(last.view(np.float32))
    negative = torch.from_numpy(keys >= (1 << (8 + mantissa_bits)))
    vmin = torch.where(negative, last_v, first_v)  # negative floats: larger bits, smaller value
    vmax = torch.where(negative, first_v, last_v)
    finite = torch.isfinite(vmin) & torch.isfinite(vmax)
    below = torch.searchsorted(code, torch.where(finite, vmin, 0.0).contiguous())
    inside = torch.searchsorted(code, torch.where(finite, vmax, 0.0).contiguous(), right=True)
    if bool(((inside - below) > 1)[finite].any()):
        raise ValueError(
            f"a bucket of {mantissa_bits} mantissa bits holds two or more quant_map entries; "
            "build the table with more mantissa bits"
        )
    return torch.where(finite, below, 0).clamp_(max=255).to(torch.uint8).to(quant_map.device)


def _table(quant_map: torch.Tensor) -> torch.Tensor:
    """:func:`search_table` of ``quant_map`` (``[256]`` fp32, contiguous: checked by the caller),
    built once per map tensor and version: bitsandbytes' optimizers keep their maps unchanged for
    their lifetime. A map changed in place through ``.data`` (which keeps its version) is not seen;
    inference tensors, which have no version, count as never changed."""
    try:
        version = quant_map._version
    except RuntimeError:  # an inference tensor: no version counter
        version = -1
    key = (quant_map.data_ptr(), version, quant_map.device)
    entry = _tables.get(key)
    if entry is None:
        entry = _tables[key] = (quant_map, search_table(quant_map))
    return entry[1]


def _check(p: torch.Tensor, g: torch.Tensor, states: tuple, maps: tuple, absmaxes: tuple) -> None:
    """The one-line ``ValueError`` of :func:`adam8bit_update` for a bad argument."""
    n, n_blocks = p.numel(), -(-p.numel() // BLOCK)
    named = {"g": g, "p": p, "state1": states[0], "state2": states[1], "quant_map1": maps[0],
             "quant_map2": maps[1], "absmax1": absmaxes[0], "absmax2": absmaxes[1]}  # fmt: skip
    if p.dtype not in _FLOATS or g.dtype not in _FLOATS:
        raise ValueError(f"p and g must be fp32, fp16 or bf16, got {p.dtype} / {g.dtype}")
    if g.numel() != n or states[0].numel() != n or states[1].numel() != n:
        raise ValueError(f"g, state1 and state2 must have p's {n} elements, got {g.numel()}, "
                         f"{states[0].numel()}, {states[1].numel()}")  # fmt: skip
    if absmaxes[0].numel() != n_blocks or absmaxes[1].numel() != n_blocks:
        raise ValueError(f"absmax1 / absmax2 must have {n_blocks} blocks, got "
                         f"{absmaxes[0].numel()} / {absmaxes[1].numel()}")  # fmt: skip
    if states[0].dtype != torch.uint8 or states[1].dtype != torch.uint8:
        raise ValueError(f"states must be uint8, got {states[0].dtype} / {states[1].dtype}")
    for name, t in (("quant_map1", maps[0]), ("quant_map2", maps[1]), ("absmax1", absmaxes[0]),
                    ("absmax2", absmaxes[1])):  # fmt: skip
        if t.dtype != torch.float32:
            raise ValueError(f"{name} must be float32, got {t.dtype}")
    for m in maps:
        if m.shape != (256,):
            raise ValueError(f"quant maps must be [256], got {tuple(m.shape)}")
    for name, t in named.items():
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (the kernel reads it as a flat array)")
        if t.device != p.device:
            raise ValueError(f"{name} is on {t.device}, p on {p.device}: put them on one device")
    if n >= 2**31:
        raise ValueError(f"at most 2**31 - 1 elements per call, got {n}; update in pieces")
    if p.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"adam8bit_update runs on CUDA tensors (on the CPU only under Triton's "
                         f"interpreter, TRITON_INTERPRET=1); p is on {p.device}")  # fmt: skip


@triton.jit
def _dequant(codes_ptr, map_ptr, absmax_ptr, offs, mask, BS: tl.constexpr):
    c = tl.load(codes_ptr + offs, mask=mask, other=0)
    v = tl.load(map_ptr + c, mask=mask, other=0.0)
    return v * tl.load(absmax_ptr + offs // BS, mask=mask, other=0.0)


@triton.jit
def _quantize_store(
    s, codes_ptr, map_ptr, table_ptr, absmax_ptr, offs, mask, block0, n_blocks,
    BLOCKS: tl.constexpr, BS: tl.constexpr, M: tl.constexpr,
):  # fmt: skip
    """Nearest ``map`` entry of ``s / absmax`` per element, ``absmax`` per ``BS`` block."""
    rows = tl.reshape(s, (BLOCKS, BS))
    absmax = tl.max(tl.abs(rows), axis=1)
    x = tl.clamp(rows / absmax[:, None], -1.0, 1.0)
    below = tl.load(table_ptr + (x.to(tl.uint32, bitcast=True) >> (23 - M))).to(tl.int32)
    pos = below + (x > tl.load(map_ptr + below)).to(tl.int32)  # entries below x
    lo = tl.maximum(pos - 1, 0)
    hi = tl.minimum(pos, 255)
    lo_d = tl.abs(x - tl.load(map_ptr + lo))
    hi_d = tl.abs(x - tl.load(map_ptr + hi))
    code = tl.where(lo_d <= hi_d, lo, hi).to(tl.uint8)
    tl.store(codes_ptr + offs, tl.reshape(code, (BLOCKS * BS,)), mask=mask)
    blocks = block0 + tl.arange(0, BLOCKS)
    tl.store(absmax_ptr + blocks, absmax, mask=blocks < n_blocks)


@triton.jit
def _adam8bit_kernel(
    p_ptr, g_ptr, s1_ptr, s2_ptr, absmax1_ptr, absmax2_ptr, map1_ptr, map2_ptr,
    table1_ptr, table2_ptr, n, n_blocks, lr, beta1_step, beta2_step, scalars_ptr,
    beta1: tl.constexpr, beta2: tl.constexpr, eps: tl.constexpr, weight_decay: tl.constexpr,
    gnorm_scale: tl.constexpr, BLOCKS: tl.constexpr, BS: tl.constexpr, M: tl.constexpr,
    SCALARS_ON_DEVICE: tl.constexpr,
):  # fmt: skip
    if SCALARS_ON_DEVICE:  # (lr, beta1**t, beta2**t) read at run time: a graph replay sees
        lr = tl.load(scalars_ptr)  # what the host wrote before it
        beta1_step = tl.load(scalars_ptr + 1)
        beta2_step = tl.load(scalars_ptr + 2)
    pid = tl.program_id(0)
    offs = pid * (BLOCKS * BS) + tl.arange(0, BLOCKS * BS)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) * gnorm_scale
    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s1 = _dequant(s1_ptr, map1_ptr, absmax1_ptr, offs, mask, BS)
    s2 = _dequant(s2_ptr, map2_ptr, absmax2_ptr, offs, mask, BS)
    s1 = s1 * beta1 + (1.0 - beta1) * g
    s2 = s2 * beta2 + (1.0 - beta2) * g * g
    correction1 = 1.0 - beta1_step
    correction2 = 1.0 - beta2_step
    if weight_decay > 0.0:
        p *= 1.0 - lr * weight_decay
    denom = tl.sqrt(s2) / tl.sqrt(correction2) + eps
    p -= (lr / correction1) * (s1 / denom)
    tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=mask)
    block0 = pid * BLOCKS
    _quantize_store(s1, s1_ptr, map1_ptr, table1_ptr, absmax1_ptr, offs, mask, block0, n_blocks,
                    BLOCKS, BS, M)  # fmt: skip
    _quantize_store(s2, s2_ptr, map2_ptr, table2_ptr, absmax2_ptr, offs, mask, block0, n_blocks,
                    BLOCKS, BS, M)  # fmt: skip


def adam8bit_update(
    g: torch.Tensor,
    p: torch.Tensor,
    state1: torch.Tensor,
    state2: torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    step: int,
    lr: float,
    quant_map1: torch.Tensor,
    quant_map2: torch.Tensor,
    absmax1: torch.Tensor,
    absmax2: torch.Tensor,
    weight_decay: float = 0.0,
    gnorm_scale: float = 1.0,
) -> None:
    """One AdamW step of ``p`` in place with blockwise 8-bit moments, as bitsandbytes'
    ``optimizer_update_8bit_blockwise("adam", ...)`` (its argument order, without the unused
    ``beta3`` / ``alpha`` / ``skip_zeros``): ``m ← β1·m + (1−β1)·g``, ``v ← β2·v + (1−β2)·g²``,
    ``p ← p·(1 − lr·wd) − lr/(1−β1ᵗ) · m / (√v / √(1−β2ᵗ) + eps)``, then ``m`` and ``v``
    re-quantized per :data:`BLOCK` elements (module docstring).

    Args:
        g, p: ``n`` elements, contiguous, fp32 / fp16 / bf16 (``g`` is scaled by
            ``gnorm_scale``).
        state1, state2: ``n`` contiguous uint8 codes into ``quant_map1`` / ``quant_map2``
            (``[256]`` contiguous fp32, increasing).
        absmax1, absmax2: ``ceil(n / 256)`` contiguous fp32, one per block (read, then
            rewritten).
        step: the step number ``t`` (1 for the first update).

    Runs on CUDA tensors (on CPU tensors only under Triton's interpreter, ``TRITON_INTERPRET=1``).
    The maps must not be changed in place through ``.data`` between calls (their search tables
    are cached per tensor and version).

    Raises:
        ValueError: mismatched sizes, dtypes or devices, a non-contiguous argument, ``2**31`` or
            more elements, ``step < 1``, a map whose entries are not increasing, or CPU tensors
            without the interpreter (one line naming the argument).
    """
    _check(p, g, (state1, state2), (quant_map1, quant_map2), (absmax1, absmax2))
    if step < 1:
        raise ValueError(f"step must be >= 1, got {step}")
    consts = (beta1, beta2, eps, weight_decay, gnorm_scale)
    maps, absmaxes = (quant_map1, quant_map2), (absmax1, absmax2)
    _launch(g, p, state1, state2, consts, (lr, beta1**step, beta2**step), None, maps, absmaxes)


def adam8bit_update_device_scalars(
    g: torch.Tensor,
    p: torch.Tensor,
    state1: torch.Tensor,
    state2: torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    scalars: torch.Tensor,
    quant_map1: torch.Tensor,
    quant_map2: torch.Tensor,
    absmax1: torch.Tensor,
    absmax2: torch.Tensor,
    weight_decay: float = 0.0,
    gnorm_scale: float = 1.0,
) -> None:
    """:func:`adam8bit_update` whose learning rate and step are read from device memory when the
    kernel runs, so that a CUDA graph that captured the call applies the values the host writes
    into ``scalars`` before each replay (:mod:`poetxq.training.graph_optim`).

    Args:
        scalars: ``[3]`` contiguous fp32 on ``p``'s device: ``(lr, beta1**t, beta2**t)`` for step
            ``t`` (computed in float64 on the host and rounded to fp32, which is what
            :func:`adam8bit_update` passes its kernel: the two give bit-identical results).
        The other arguments: as :func:`adam8bit_update`.

    Raises:
        ValueError: as :func:`adam8bit_update`, or ``scalars`` not ``[3]`` contiguous fp32 on
            ``p``'s device.
    """
    _check(p, g, (state1, state2), (quant_map1, quant_map2), (absmax1, absmax2))
    if (
        scalars.dtype != torch.float32
        or scalars.shape != (3,)
        or not scalars.is_contiguous()
        or scalars.device != p.device
    ):
        raise ValueError(f"scalars must be [3] contiguous float32 on {p.device} (lr, beta1**t, "
                         f"beta2**t), got {tuple(scalars.shape)} {scalars.dtype} on "
                         f"{scalars.device}")  # fmt: skip
    consts = (beta1, beta2, eps, weight_decay, gnorm_scale)
    maps, absmaxes = (quant_map1, quant_map2), (absmax1, absmax2)
    _launch(g, p, state1, state2, consts, (0.0, 0.0, 0.0), scalars, maps, absmaxes)


def _launch(
    g: torch.Tensor,
    p: torch.Tensor,
    state1: torch.Tensor,
    state2: torch.Tensor,
    consts: tuple[float, float, float, float, float],
    host_scalars: tuple[float, float, float],
    scalars: torch.Tensor | None,
    maps: tuple[torch.Tensor, torch.Tensor],
    absmaxes: tuple[torch.Tensor, torch.Tensor],
) -> None:
    """One :func:`_adam8bit_kernel` launch over ``p`` (arguments checked by the caller)."""
    n = p.numel()
    n_blocks = -(-n // BLOCK)
    if n == 0:
        return
    beta1, beta2, eps, weight_decay, gnorm_scale = consts
    grid = (triton.cdiv(n_blocks, _BLOCKS_PER_PROGRAM),)
    _adam8bit_kernel[grid](
        p, g, state1, state2, absmaxes[0], absmaxes[1], maps[0], maps[1],
        _table(maps[0]), _table(maps[1]), n, n_blocks, *host_scalars,
        p if scalars is None else scalars,  # unread without SCALARS_ON_DEVICE
        beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, gnorm_scale=gnorm_scale,
        BLOCKS=_BLOCKS_PER_PROGRAM, BS=BLOCK, M=TABLE_MANTISSA_BITS,
        SCALARS_ON_DEVICE=scalars is not None, num_warps=4,
    )  # fmt: skip
