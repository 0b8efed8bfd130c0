"""Plain-torch 4-bit NF4 / FP4 blockwise quantization in the bitsandbytes ``Params4bit`` layout.

Torch only (never imports poetxq). Round-to-nearest output is byte-identical to
``bitsandbytes.functional.quantize_4bit`` on the CPU (bitsandbytes 0.50), which is the oracle in
``tests/test_quant4bit.py``.

Layout (QLoRA, arXiv 2305.14314)
-----------------------------------------------
* The weight is flattened row-major and cut into blocks of ``blocksize`` (default 64) elements;
  the last block may be shorter. ``absmax`` fp32 ``[nblocks]`` holds ``max|block|``.
* Each element is scaled into ``[-1, 1]`` (``x * (1 / absmax)``; the short last block uses
  ``x / absmax``, as bitsandbytes does) and mapped to the nearest of the 16 code values
  (``quant_map``); a value exactly halfway between two codes goes to the lower one.
* Codes are packed two per byte, the first element in the HIGH nibble:
  ``packed[k] = code[2k] << 4 | code[2k+1]``; an odd element count is padded with a zero code.
  The packed data has shape ``[ceil(N/2), 1]``, uint8.
* Double quantization (bitsandbytes ``compress_statistics=True``): ``offset = mean(absmax)``;
  ``absmax - offset`` is quantized 8-bit blockwise (``nested_blocksize`` 256) with the signed
  dynamic map (``nested_quant_map``, 256 fp32 values), giving uint8 ``absmax`` and fp32
  ``nested_absmax``. Dequantized: ``absmax = nested_quant_map[q] * nested_absmax + offset``.
  The 8-bit rounding follows bitsandbytes' CPU kernel: ``x / nested_absmax``, nearest code,
  ties to the lower code. The 8-bit blockwise quantizer and the double quantization live in
  :mod:`quant_kernels.reference_double_quant`.

Code values
-----------
* NF4: 16 quantiles of N(0, 1) normalised to ``[-1, 1]``, sorted; code ``i`` is the ``i``-th.
* FP4 (1 sign, 2 exponent, 1 mantissa bit, bitsandbytes' bias): bit patterns ``0..7`` are
  ``0, 0.0625, 8, 12, 4, 6, 2, 3`` and ``8..15`` their negatives, all divided by 12. Patterns 0 and
  8 are both zero: nearest rounding maps ``x <= 0`` near zero to 0 and tiny ``x > 0`` to 8.

Stochastic rounding
-------------------
With ``stochastic=True`` each scaled value ``s`` between neighbouring code values ``lo <= s <= hi``
becomes ``hi`` with probability ``(s - lo) / (hi - lo)``, else ``lo``: ``E[code value] = s``, so
``E[dequant] = s * absmax`` (unbiased up to fp32 rounding of ``s``, and up to clipping where
``|x| > absmax``). With double quantization, :func:`quantize_4bit` rounds the nested statistics
*up* in this mode and scales by the dequantized absmax, so no element is clipped and the
4-bit rounding stays unbiased with respect to the absmax actually stored.
"""

from __future__ import annotations

import json
from typing import NamedTuple

import torch

# elements (de)quantized at a time, in whole blocks (:func:`_block_chunk`): the fp32 and int64
# temporaries of :func:`quantize_4bit_blockwise` (about 28 bytes per element) and
# :func:`dequantize_4bit_blockwise` stay at one chunk's size (117 MB), not the weight's
from quant_kernels.reference import QUANT_CHUNK_ELEMENTS
from quant_kernels.reference_double_quant import (
    _block_absmax,
    _expand_blocks,
    double_dequantize_absmax,
    double_quantize_absmax,
)

__all__ = [
    "FP4_CODE_VALUES",
    "NF4_CODE_VALUES",
    "QUANT_TYPES_4BIT",
    "Quantized4bit",
    "blockwise_4bit_matmul",
    "blockwise_4bit_matmul_t",
    "dequantize_4bit",
    "dequantize_4bit_blockwise",
    "get_4bit_code",
    "pack_4bit",
    "quant_state_from_tensor",
    "quant_state_to_tensor",
    "quantize_4bit",
    "quantize_4bit_blockwise",
    "unpack_4bit",
]

QUANT_TYPES_4BIT: tuple[str, ...] = ("nf4", "fp4")
BLOCKSIZES_4BIT: tuple[int, ...] = (32, 64, 128, 256, 512, 1024, 2048, 4096)

# NF4 (QLoRA): quantiles of N(0, 1), normalised to [-1, 1]; the values bitsandbytes ships.
NF4_CODE_VALUES: tuple[float, ...] = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)  # fmt: skip
# FP4 (e2m1, bitsandbytes' exponent bias) by bit pattern, before division by the max (12).
FP4_CODE_VALUES: tuple[float, ...] = (
    0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0,
    -0.0, -0.0625, -8.0, -12.0, -4.0, -6.0, -2.0, -3.0,
)  # fmt: skip


def _check_quant_type(quant_type: str) -> None:
    if quant_type not in QUANT_TYPES_4BIT:
        raise ValueError(f"unknown 4-bit quant_type {quant_type!r}; choose one of nf4, fp4")


_CODES: dict[tuple[str, torch.device], torch.Tensor] = {}


def get_4bit_code(quant_type: str, device: torch.device | str | None = None) -> torch.Tensor:
    """The 16 code values (``quant_map``) of ``quant_type``: fp32 ``[16]``, indexed by code.

    Built once per (type, device) and then returned from a cache, so that the GEMMs that ask for
    it on every call make no host-to-device copy (which would also break CUDA-graph capture).
    The result is shared: read it, do not modify it in place.

    Raises:
        ValueError: unknown ``quant_type``.
    """
    _check_quant_type(quant_type)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    code = _CODES.get((quant_type, dev))
    if code is None:
        values = NF4_CODE_VALUES if quant_type == "nf4" else FP4_CODE_VALUES
        code = torch.tensor(values, dtype=torch.float32, device=dev)
        code = _CODES[(quant_type, dev)] = code / code.abs().max()
    return code


def _sorted_code(quant_type: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sorted code values [16], code index of each sorted position [16])`` (stable order)."""
    code = get_4bit_code(quant_type, device)
    order = torch.argsort(code, stable=True)
    return code[order], order


# ----------------------------------------------------------------------------------------------
# packing
# ----------------------------------------------------------------------------------------------


def pack_4bit(codes: torch.Tensor, pad_code: int = 0) -> torch.Tensor:
    """Pack 4-bit codes ``[N]`` (any int dtype, values 0..15) → uint8 ``[ceil(N/2), 1]``.

    Element ``2k`` goes to the high nibble of byte ``k``, element ``2k+1`` to the low nibble; an
    odd ``N`` is padded with ``pad_code`` (bitsandbytes pads with the code of 0.0: NF4 7, FP4 0).
    """
    c = codes.reshape(-1).to(torch.uint8)
    if c.numel() % 2:
        c = torch.cat([c, c.new_full((1,), pad_code)])
    return ((c[0::2] << 4) | c[1::2]).unsqueeze(1)


def unpack_4bit(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_4bit`: uint8 ``[ceil(N/2), 1]`` → int64 codes ``[numel]``."""
    p = packed.reshape(-1)
    if p.dtype != torch.uint8:
        p = p.view(torch.uint8)
    out = torch.stack([p >> 4, p & 0xF], dim=1).reshape(-1)
    return out[:numel].long()


# ----------------------------------------------------------------------------------------------
# blockwise scaling helpers
# ----------------------------------------------------------------------------------------------


def _scale_to_unit(flat: torch.Tensor, absmax: torch.Tensor, blocksize: int) -> torch.Tensor:
    """``clamp(x / absmax_block, -1, 1)`` exactly as bitsandbytes' default 4-bit kernel rounds it.

    Full blocks multiply by the fp32 reciprocal of ``max(absmax, 1e-38)``; the short last block
    divides. All-zero blocks give 0.
    """
    n = flat.numel()
    full = n - n % blocksize
    nfull = full // blocksize
    am = absmax.clamp(min=1e-38)
    parts = [(flat[:full].view(nfull, blocksize) * (1.0 / am[:nfull]).unsqueeze(1)).reshape(-1)]
    if full < n:
        parts.append(flat[full:] / am[nfull])
    return torch.cat(parts).clamp_(-1, 1)


def _uniform(shape: torch.Size, like: torch.Tensor, generator: torch.Generator | None):
    device = generator.device if generator is not None else like.device
    return torch.rand(shape, generator=generator, device=device).to(like.device)


def _round_to_code(
    scaled: torch.Tensor,
    quant_type: str,
    *,
    stochastic: bool,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Scaled values in ``[-1, 1]`` → int64 code indices ``[N]`` (nearest or stochastic)."""
    sorted_vals, order = _sorted_code(quant_type, scaled.device)
    if not stochastic:
        bounds = (sorted_vals[:-1] + sorted_vals[1:]) / 2  # x == bound -> lower code
        pos = torch.bucketize(scaled, bounds)
        return order[pos]
    lo = (torch.searchsorted(sorted_vals, scaled, right=True) - 1).clamp_(0, 14)
    v_lo, v_hi = sorted_vals[lo], sorted_vals[lo + 1]
    width = v_hi - v_lo
    p_hi = torch.where(width > 0, (scaled - v_lo) / width.clamp(min=1e-30), 0.0)
    up = _uniform(scaled.shape, scaled, generator) < p_hi
    return order[lo + up.long()]


# ----------------------------------------------------------------------------------------------
# 4-bit blockwise quantize / dequantize
# ----------------------------------------------------------------------------------------------


def _block_chunk(blocksize: int) -> int:
    """Elements per chunk: whole blocks, at most :data:`QUANT_CHUNK_ELEMENTS` (at least one
    block); even, since every block size is, so a chunk starts on a whole byte of codes."""
    return blocksize * max(1, QUANT_CHUNK_ELEMENTS // blocksize)


def quantize_4bit_blockwise(
    weight: torch.Tensor,
    quant_type: str = "nf4",
    blocksize: int = 64,
    *,
    absmax: torch.Tensor | None = None,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``weight`` (any shape, any float dtype; computed in fp32) to packed 4-bit codes.

    Args:
        weight: float tensor with ``N`` elements, flattened row-major.
        quant_type: ``"nf4"`` or ``"fp4"``.
        blocksize: elements per absmax block (one of 32, 64, ..., 4096).
        absmax: fp32 ``[ceil(N/blocksize)]`` scales to use instead of the blocks' own ``max|x|``
            (e.g. double-dequantized statistics); elements beyond ``±absmax`` are clipped.
        stochastic: unbiased stochastic rounding between the two neighbouring codes.
        generator: RNG for stochastic rounding.

    Returns:
        ``(packed, absmax)``: uint8 ``[ceil(N/2), 1]`` and fp32 ``[ceil(N/blocksize)]``. With
        ``absmax=None`` and ``stochastic=False`` both equal bitsandbytes' ``quantize_4bit``.

    Raises:
        ValueError: bad ``quant_type``, ``blocksize``, dtype or ``absmax`` shape.
    """
    _check_quant_type(quant_type)
    if blocksize not in BLOCKSIZES_4BIT:
        raise ValueError(f"invalid blocksize {blocksize}; choose one of {BLOCKSIZES_4BIT}")
    if not weight.is_floating_point() or weight.numel() == 0:
        raise ValueError(f"expected a non-empty float tensor, got {weight.dtype} {weight.shape}")
    flat = weight.reshape(-1)
    n = flat.numel()
    nblocks = -(-n // blocksize)
    if absmax is not None and absmax.shape != (nblocks,):
        raise ValueError(f"absmax must have shape ({nblocks},), got {tuple(absmax.shape)}")
    pad = 7 if quant_type == "nf4" else 0  # nearest code of 0.0
    packed = torch.empty((n + 1) // 2, 1, dtype=torch.uint8, device=weight.device)
    scales = torch.empty(nblocks, dtype=torch.float32, device=weight.device)
    # whole blocks at a time, so the fp32 / int64 temporaries stay at one chunk's size whatever
    # the weight's (a 70B MLP weight would need about 28 bytes per element at once); each block
    # is scaled and rounded on its own, so the codes are those of one pass. Stochastic rounding
    # keeps one pass: its random stream is drawn over the whole tensor, as it always was
    step = n if stochastic else _block_chunk(blocksize)
    for start in range(0, n, step):
        part = flat[start : start + step].float()
        b0, b1 = start // blocksize, -(-(start + part.numel()) // blocksize)
        am = _block_absmax(part, blocksize) if absmax is None else absmax[b0:b1].float()
        scaled = _scale_to_unit(part, am, blocksize)
        codes = _round_to_code(scaled, quant_type, stochastic=stochastic, generator=generator)
        packed[start // 2 : start // 2 + (part.numel() + 1) // 2] = pack_4bit(codes, pad)
        scales[b0:b1] = am
    return packed, scales


def dequantize_4bit_blockwise(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    quant_type: str,
    blocksize: int,
    shape: tuple[int, ...] | torch.Size,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``quant_map[code] * absmax_block`` (fp32 product, then cast): ``shape`` in ``dtype``.

    Equals bitsandbytes' ``dequantize_4bit`` given the same (already double-dequantized) absmax.
    Works on whole blocks of at most :data:`QUANT_CHUNK_ELEMENTS` at a time into the output, so
    the int64 codes and fp32 products are one chunk's, not the weight's (in one pass they were
    three fp32 copies of it beside the output: 2.6 GiB for a Llama-70B MLP weight at a merge);
    every element is the same product, so the values are those of one pass.
    """
    n = 1
    for d in shape:
        n *= int(d)
    code = get_4bit_code(quant_type, packed.device)
    scale = absmax.float()
    flat = packed.reshape(-1)
    out = torch.empty(n, dtype=dtype, device=packed.device)
    step = _block_chunk(blocksize)
    for start in range(0, n, step):
        end = min(start + step, n)
        vals = code[unpack_4bit(flat[start // 2 : (end + 1) // 2], end - start)]
        block = scale[start // blocksize : -(-end // blocksize)]
        out[start:end] = vals * _expand_blocks(block, end - start, blocksize)
    return out.view(*shape)


# ----------------------------------------------------------------------------------------------
# the whole Params4bit state
# ----------------------------------------------------------------------------------------------


class Quantized4bit(NamedTuple):
    """A 4-bit weight in bitsandbytes ``Params4bit`` form.

    ``packed`` uint8 ``[ceil(N/2), 1]``; ``absmax`` fp32 ``[nb]`` or, with double quant, uint8
    ``[nb]``; ``quant_map`` fp32 ``[16]``; ``nested_absmax`` fp32 / ``nested_quant_map`` fp32
    ``[256]`` / ``nested_offset`` float, or None without double quant.
    """

    packed: torch.Tensor
    absmax: torch.Tensor
    quant_map: torch.Tensor
    quant_type: str
    blocksize: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    nested_absmax: torch.Tensor | None = None
    nested_quant_map: torch.Tensor | None = None
    nested_offset: float | None = None
    nested_blocksize: int = 256

    def dequantized_absmax(self) -> torch.Tensor:
        """fp32 ``[nb]`` block scales (double-dequantized when nested)."""
        if self.nested_absmax is None:
            return self.absmax.float()
        assert self.nested_quant_map is not None and self.nested_offset is not None
        return double_dequantize_absmax(
            self.absmax, self.nested_absmax, self.nested_quant_map, self.nested_offset,
            self.nested_blocksize,
        )  # fmt: skip


def quantize_4bit(
    weight: torch.Tensor,
    quant_type: str = "nf4",
    blocksize: int = 64,
    *,
    compress_statistics: bool = True,
    nested_blocksize: int = 256,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
) -> Quantized4bit:
    """Quantize ``weight`` to NF4/FP4 like ``bitsandbytes.functional.quantize_4bit``.

    Round-to-nearest (``stochastic=False``): byte-identical to bitsandbytes (packed data, absmax,
    nested statistics). Stochastic: see the module docstring (nested stats rounded up, codes
    rounded stochastically against the stored, dequantized absmax).

    Raises:
        ValueError: bad ``quant_type`` / ``blocksize`` / dtype.
    """
    shape = tuple(weight.shape)
    packed, absmax = quantize_4bit_blockwise(
        weight, quant_type, blocksize, stochastic=stochastic, generator=generator
    )
    code = get_4bit_code(quant_type, weight.device).clone()  # the result owns its quant_map
    if not compress_statistics:
        return Quantized4bit(packed, absmax, code, quant_type, blocksize, shape, weight.dtype)
    q_abs, nested, nested_code, offset = double_quantize_absmax(
        absmax, nested_blocksize, round_up=stochastic
    )
    if stochastic:  # re-round against the absmax actually stored (no clipping: stored >= true)
        stored = double_dequantize_absmax(q_abs, nested, nested_code, offset, nested_blocksize)
        packed, _ = quantize_4bit_blockwise(
            weight, quant_type, blocksize, absmax=stored, stochastic=True, generator=generator
        )
    return Quantized4bit(
        packed, q_abs, code, quant_type, blocksize, shape, weight.dtype,
        nested, nested_code, float(offset.item()), nested_blocksize,
    )  # fmt: skip


def dequantize_4bit(q: Quantized4bit, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Dense weight of ``q.shape`` in ``dtype`` (default ``q.dtype``)."""
    return dequantize_4bit_blockwise(
        q.packed, q.dequantized_absmax(), q.quant_type, q.blocksize, q.shape, dtype or q.dtype
    )


def blockwise_4bit_matmul(
    x: torch.Tensor,
    packed: torch.Tensor,
    absmax: torch.Tensor,
    quant_type: str,
    blocksize: int,
    shape: tuple[int, int],
) -> torch.Tensor:
    """``x @ W.T`` with ``W = dequant`` ``[m, n]``: ``x [..., n]`` → ``[..., m]`` in ``x.dtype``.

    ``absmax`` is fp32 (already double-dequantized). Reference for a fused dequant-matmul kernel.
    """
    return x @ dequantize_4bit_blockwise(packed, absmax, quant_type, blocksize, shape, x.dtype).t()


def blockwise_4bit_matmul_t(
    g: torch.Tensor,
    packed: torch.Tensor,
    absmax: torch.Tensor,
    quant_type: str,
    blocksize: int,
    shape: tuple[int, int],
) -> torch.Tensor:
    """``g @ W`` with ``W = dequant`` ``[m, n]``: ``g [..., m]`` → ``[..., n]`` (the dX GEMM)."""
    return g @ dequantize_4bit_blockwise(packed, absmax, quant_type, blocksize, shape, g.dtype)


# ----------------------------------------------------------------------------------------------
# bitsandbytes' packed quant_state (UTF-8 JSON in a uint8 tensor)
# ----------------------------------------------------------------------------------------------


def quant_state_to_tensor(meta: dict) -> torch.Tensor:
    """``json.dumps(meta)`` as UTF-8 bytes in a uint8 ``[len]`` tensor (bitsandbytes' packing)."""
    return torch.tensor(list(json.dumps(meta).encode("utf-8")), dtype=torch.uint8)


def quant_state_from_tensor(t: torch.Tensor) -> dict:
    """Inverse of :func:`quant_state_to_tensor`.

    Raises:
        ValueError: the tensor is not uint8 UTF-8 JSON of an object.
    """
    if t.dtype != torch.uint8 or t.dim() != 1:
        raise ValueError(f"quant_state must be a 1-D uint8 tensor, got {t.dtype} {tuple(t.shape)}")
    try:
        meta = json.loads(bytes(t.cpu().tolist()).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"quant_state is not UTF-8 JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"quant_state JSON must be an object, got {type(meta).__name__}")
    return meta
