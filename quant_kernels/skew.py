"""Skew-symmetric blocks from packed upper triangles (Triton), forward and backward.

POET's Cayley–Neumann parameterization (arXiv 2506.08001) stores each ``b×b`` skew block ``Q`` as
its strict upper triangle ``U``, row-major (``torch.triu_indices(b, b, 1)`` order):
``packed [nb, b(b-1)/2]``. The reference :func:`quant_kernels.reference.skew_from_packed` builds
``Q = U − Uᵀ`` with an ``index_copy`` into a zero tensor and a transposed subtraction; on the H200
those scatter/gather kernels were a fifth of a POET-XQ layer's GPU time (``_scatter_gather_
elementwise_kernel`` in ``evals/results/gpu_suite_streamed_h200.json``). Here each output tile is
read straight from ``packed`` by index math,

    ``Q[i, j] = packed[idx(i, j)]`` (i < j),  ``−packed[idx(j, i)]`` (i > j),  ``0`` (i = j),
    ``idx(i, j) = i·b − i(i+1)/2 + (j − i − 1)``,

one pass that writes ``Q`` once, and the backward forms ``∂packed[idx(i, j)] = ∂Q[i, j] − ∂Q[j, i]``
(the strict upper triangle of ``∂Q − ∂Qᵀ``) in one pass over the upper tiles. Both are exact: the
same values and gradients as the reference, bit for bit (one subtraction per element, as autograd
of ``U − Uᵀ`` does).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_BLOCK = 16 if os.environ.get("TRITON_INTERPRET", "0") == "1" else 64


@triton.jit
def _skew_fwd_kernel(packed_ptr, q_ptr, b, npk, n_tiles, BLOCK: tl.constexpr):
    """One ``BLOCK×BLOCK`` tile of ``Q`` for block ``program_id(0)``."""
    blk = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1)
    i = (t // n_tiles) * BLOCK + tl.arange(0, BLOCK)[:, None]
    j = (t % n_tiles) * BLOCK + tl.arange(0, BLOCK)[None, :]
    inside = (i < b) & (j < b)
    lo, hi = tl.minimum(i, j), tl.maximum(i, j)
    idx = lo * b - lo * (lo + 1) // 2 + (hi - lo - 1)
    v = tl.load(packed_ptr + blk * npk + idx, mask=inside & (i != j), other=0.0).to(tl.float32)
    v = tl.where(i < j, v, tl.where(i > j, -v, 0.0))  # exact in fp32, exact back in the input dtype
    tl.store(q_ptr + blk * b * b + i * b + j, v.to(q_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _skew_bwd_kernel(dq_ptr, dpk_ptr, b, npk, n_tiles, BLOCK: tl.constexpr):
    """``∂packed`` entries of one tile of the strict upper triangle (tiles below it do nothing)."""
    blk = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1)
    i = (t // n_tiles) * BLOCK + tl.arange(0, BLOCK)[:, None]
    j = (t % n_tiles) * BLOCK + tl.arange(0, BLOCK)[None, :]
    upper = (i < j) & (j < b)
    base = dq_ptr + blk * b * b
    d = tl.load(base + i * b + j, mask=upper, other=0.0).to(tl.float32)
    d_t = tl.load(base + j * b + i, mask=upper, other=0.0).to(tl.float32)
    idx = i * b - i * (i + 1) // 2 + (j - i - 1)
    # one rounding of the exact difference to the gradient's dtype, as torch's subtraction does
    tl.store(dpk_ptr + blk * npk + idx, (d - d_t).to(dpk_ptr.dtype.element_ty), mask=upper)


def _grid(nb: int, b: int) -> tuple[tuple[int, int], int]:
    n_tiles = triton.cdiv(b, _BLOCK)
    return (nb, n_tiles * n_tiles), n_tiles


def skew_forward(packed: torch.Tensor, block_size: int) -> torch.Tensor:
    """``Q = U − Uᵀ`` ``[nb, b, b]`` from ``packed [nb, b(b-1)/2]`` (no autograd).

    Raises:
        ValueError: ``packed`` is not 2-D with ``b(b-1)/2`` columns.
    """
    b = block_size
    if packed.dim() != 2 or packed.shape[1] != b * (b - 1) // 2:
        raise ValueError(
            f"packed must be [nb, {b * (b - 1) // 2}] for b={b}, got {tuple(packed.shape)}"
        )
    packed = packed.contiguous()
    nb, npk = packed.shape
    q = packed.new_empty(nb, b, b)
    if nb:
        grid, n_tiles = _grid(nb, b)
        _skew_fwd_kernel[grid](packed, q, b, npk, n_tiles, BLOCK=_BLOCK)
    return q


def skew_backward(d_q: torch.Tensor) -> torch.Tensor:
    """``∂packed [nb, b(b-1)/2]`` from ``∂Q [nb, b, b]``: the strict upper triangle of
    ``∂Q − ∂Qᵀ``, row-major."""
    d_q = d_q.contiguous()
    nb, b, _ = d_q.shape
    npk = b * (b - 1) // 2
    d_packed = d_q.new_empty(nb, npk)
    if nb:
        grid, n_tiles = _grid(nb, b)
        _skew_bwd_kernel[grid](d_q, d_packed, b, npk, n_tiles, BLOCK=_BLOCK)
    return d_packed


class _SkewFromPacked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, packed: torch.Tensor, block_size: int) -> torch.Tensor:  # type: ignore[override]
        return skew_forward(packed, block_size)

    @staticmethod
    def backward(ctx, d_q: torch.Tensor):  # type: ignore[override]
        return skew_backward(d_q), None


def skew_from_packed_triton(packed: torch.Tensor, block_size: int) -> torch.Tensor:
    """Differentiable :func:`quant_kernels.reference.skew_from_packed` in two Triton kernels.

    Args:
        packed: ``[nb, b(b-1)/2]`` float (fp32/bf16/fp16), on CUDA (or the CPU under
            ``TRITON_INTERPRET=1``).
        block_size: ``b``.

    Returns:
        ``Q`` ``[nb, b, b]`` in ``packed.dtype``, ``Qᵀ = −Q``; the same values and gradient as
        the reference, bit for bit.

    Raises:
        ValueError: ``packed`` has the wrong width for ``b``.
    """
    if torch.is_grad_enabled() and packed.requires_grad:
        return _SkewFromPacked.apply(packed, block_size)
    return skew_forward(packed, block_size)
