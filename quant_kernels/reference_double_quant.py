"""Plain-torch 8-bit blockwise quantization with bitsandbytes' signed dynamic map, and the double
quantization of 4-bit ``absmax`` built on it (bitsandbytes ``compress_statistics=True``).

Torch only (never imports poetxq). Used by :mod:`quant_kernels.reference_4bit` for the nested
statistics of the ``Params4bit`` layout (described there); the blockwise helpers
(:func:`_block_absmax`, :func:`_expand_blocks`) are shared with it.

* :func:`dynamic_map_8bit`: the 256 sorted fp32 values of ``create_dynamic_map()``.
* :func:`quantize_blockwise_8bit` / :func:`dequantize_blockwise_8bit`: per block of
  ``blocksize`` elements, ``x / absmax`` rounded to a code value. Nearest rounding follows
  bitsandbytes' CPU kernel (0.50) bit for bit: ``x * (1/absmax)``, snapped to a 65536-point grid,
  nearest code, ties to the lower code. ``round_up`` takes the smallest code ``>= x / absmax``.
* :func:`double_quantize_absmax` / :func:`double_dequantize_absmax`: ``offset = mean(absmax)``;
  ``absmax - offset`` quantized 8-bit blockwise with the dynamic map; dequantized
  ``nested_quant_map[q] * nested_absmax + offset``.
"""

from __future__ import annotations

import torch

__all__ = [
    "dequantize_blockwise_8bit",
    "double_dequantize_absmax",
    "double_quantize_absmax",
    "dynamic_map_8bit",
    "quantize_blockwise_8bit",
]


def dynamic_map_8bit(device: torch.device | str | None = None) -> torch.Tensor:
    """bitsandbytes' signed 8-bit dynamic map (``create_dynamic_map()``): fp32 ``[256]``, sorted.

    For exponent ``e = 0..6`` the map holds ``±10^(e-6) · mid`` for the ``2^e`` midpoints ``mid`` of
    ``linspace(0.1, 1, 2^e + 1)`` (computed in fp32), plus 0 and 1.
    """
    values: list[float] = [0.0, 1.0]
    for e in range(7):
        edges = torch.linspace(0.1, 1, 2**e + 1, dtype=torch.float32)
        mids = (edges[:-1] + edges[1:]) / 2.0
        scaled = (10.0 ** (e - 6)) * mids
        values += scaled.tolist() + (-scaled).tolist()
    return torch.tensor(sorted(values), dtype=torch.float32, device=device)


# ----------------------------------------------------------------------------------------------
# blockwise helpers (shared with reference_4bit)
# ----------------------------------------------------------------------------------------------


def _block_absmax(flat: torch.Tensor, blocksize: int) -> torch.Tensor:
    n = flat.numel()
    full = n - n % blocksize
    parts = [flat[:full].view(-1, blocksize).abs().amax(dim=1)]
    if full < n:
        parts.append(flat[full:].abs().amax().unsqueeze(0))
    return torch.cat(parts)


def _expand_blocks(values: torch.Tensor, n: int, blocksize: int) -> torch.Tensor:
    """Per-block values ``[nblocks]`` → per-element ``[n]``."""
    return values.repeat_interleave(blocksize)[:n]


# ----------------------------------------------------------------------------------------------
# 8-bit blockwise (dynamic map) and double quantization of absmax
# ----------------------------------------------------------------------------------------------


_LUT_SIZE = 65536


def _nearest_lut_8bit(code: torch.Tensor) -> torch.Tensor:
    """bitsandbytes' CPU lookup table: int64 ``[65536]``, entry ``i`` = index of the code value
    nearest ``-1 + 2i/65535`` (fp32), i.e. the number of code midpoints strictly below it."""
    mids = 0.5 * (code[:-1] + code[1:])
    grid = -1.0 + (2.0 * torch.arange(_LUT_SIZE, dtype=torch.float32, device=code.device)) / (
        _LUT_SIZE - 1
    )
    return torch.searchsorted(mids, grid, side="left")


def quantize_blockwise_8bit(
    values: torch.Tensor,
    code: torch.Tensor | None = None,
    blocksize: int = 256,
    *,
    round_up: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """8-bit blockwise quantization of an fp32 tensor with a sorted 256-value ``code``.

    Nearest rounding reproduces bitsandbytes' CPU kernel (0.50) bit for bit: ``v = x * (1/absmax)``
    (fp32) clamped to ``[-1, 1]`` is snapped to a 65536-point grid,
    ``i = trunc((v + 1) * 0.5 * 65535 + 0.5)``, and ``q = lut[i]`` where ``lut[i]`` is the code
    nearest to grid point ``i`` (:func:`_nearest_lut_8bit`) — so values within half a grid step
    (≈1.5e-5) of a code midpoint may round to the farther code, exactly as bitsandbytes does.
    A block of zeros gets absmax 0 and index 0.

    ``round_up=True`` instead takes the smallest code value ``>= x / absmax`` (so the dequantized
    value never falls below the input, up to fp32 rounding); used for stochastic double quant.

    Returns:
        ``(q, absmax)``: uint8 of ``values``' shape and fp32 ``[ceil(N/blocksize)]``.
    """
    code = dynamic_map_8bit(values.device) if code is None else code.float()
    flat = values.reshape(-1).float()
    n = flat.numel()
    absmax = _block_absmax(flat, blocksize)
    inv = _expand_blocks(torch.where(absmax > 0, 1.0 / absmax, 0.0), n, blocksize)
    zero = _expand_blocks(absmax == 0, n, blocksize)
    normed = (flat * inv).clamp_(-1, 1)
    if round_up:
        idx = torch.searchsorted(code, normed, right=False).clamp_(0, code.numel() - 1)
    else:
        grid = ((normed + 1.0) * 0.5 * (_LUT_SIZE - 1) + 0.5).long()  # trunc (non-negative)
        idx = _nearest_lut_8bit(code)[grid]
    idx = torch.where(zero, 0, idx)
    return idx.to(torch.uint8).view(values.shape), absmax


def dequantize_blockwise_8bit(
    q: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, blocksize: int = 256
) -> torch.Tensor:
    """``code[q] * absmax_block`` in fp32, shape of ``q``."""
    n = q.numel()
    vals = code.float()[q.reshape(-1).long()]
    return (vals * _expand_blocks(absmax.float(), n, blocksize)).view(q.shape)


def double_quantize_absmax(
    absmax: torch.Tensor, nested_blocksize: int = 256, *, round_up: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """bitsandbytes' double quantization of fp32 ``absmax`` ``[nb]``.

    Returns:
        ``(q_absmax uint8 [nb], nested_absmax fp32 [ceil(nb/nested_blocksize)],
        nested_quant_map fp32 [256], offset fp32 scalar)`` with ``offset = mean(absmax)``.
    """
    offset = absmax.float().mean()
    code = dynamic_map_8bit(absmax.device)
    q, nested = quantize_blockwise_8bit(
        absmax.float() - offset, code, nested_blocksize, round_up=round_up
    )
    return q, nested, code, offset


def double_dequantize_absmax(
    q_absmax: torch.Tensor,
    nested_absmax: torch.Tensor,
    nested_quant_map: torch.Tensor,
    offset: torch.Tensor | float,
    nested_blocksize: int = 256,
) -> torch.Tensor:
    """``nested_quant_map[q] * nested_absmax + offset`` → fp32 ``[nb]`` (bitsandbytes' order)."""
    deq = dequantize_blockwise_8bit(q_absmax, nested_absmax, nested_quant_map, nested_blocksize)
    return deq + torch.as_tensor(offset, dtype=torch.float32, device=deq.device)
