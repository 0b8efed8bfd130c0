"""Permute the last dimension, ``out[..., j] = x[..., perm[j]]`` (Triton), with its backward.

A POET-X(Q) layer permutes its activations five times per training step (``Ψ_n`` on the input,
``Ψ_mᵀ`` on the output, and their transposes in backward; :mod:`poetxq.layer`). torch does it with
``index_select`` along the last dim, which runs as the generic ``_scatter_gather_elementwise``
kernel: on the H200 a fifth of a POET-XQ layer's GPU time and about 17 % of a Llama-1B/8B
training step (``evals/results/profiles/profile_1b_poetxq_h200_b3977d8.txt``), at roughly 0.7 TB/s.

Two Triton variants, both exact copies (the result equals ``index_select``; the backward of a
permutation is the inverse permutation, no scatter-add):

* ``"rows"``: one program owns ``BLOCK_T`` whole rows and walks their columns in chunks with
  gathered global loads and contiguous stores. Measured *slower* than torch on the H200
  (115.6 µs against 84 µs per 2,048 × 14,336 bf16 permutation, ``gpu_suite_permute_h200.json``).
* ``"smem"``: the program loads its rows contiguously (coalesced) into one register tile padded to
  a power of two (≤ 16,384 columns) and permutes them on chip with ``tl.gather``, then stores
  contiguously: DRAM sees one coalesced read and one coalesced write.

:func:`quant_kernels.permute_last` uses them only where ``evals/bench_permute.py`` measured them
faster (:data:`quant_kernels.TRITON_PERMUTE_MEASURED_FASTER`) or under ``POETXQ_KERNELS=fused``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_BLOCK_T, _BLOCK_J = (2, 32) if _INTERPRET else (4, 1024)
#: widest row the on-chip ("smem") variant holds (padded to a power of two)
SMEM_MAX_COLS = 16384
VARIANTS = ("rows", "smem")


@triton.jit
def _permute_last_kernel(
    x_ptr, perm_ptr, out_ptr, rows, cols, stride_x,
    BLOCK_T: tl.constexpr, BLOCK_J: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = t < rows
    src_rows = x_ptr + t.to(tl.int64)[:, None] * stride_x
    dst_rows = out_ptr + t.to(tl.int64)[:, None] * cols
    for j0 in range(0, cols, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        col_ok = j < cols
        src = tl.load(perm_ptr + j, mask=col_ok, other=0)
        mask = row_ok[:, None] & col_ok[None, :]
        v = tl.load(src_rows + src[None, :], mask=mask)
        tl.store(dst_rows + j[None, :], v, mask=mask)


@triton.jit
def _permute_last_smem_kernel(
    x_ptr, perm_ptr, out_ptr, rows, cols, stride_x,
    BLOCK_T: tl.constexpr, D: tl.constexpr, BLOCK_J: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = t < rows
    c = tl.arange(0, D)
    src_ptr = x_ptr + t.to(tl.int64)[:, None] * stride_x + c[None, :]
    src = tl.load(src_ptr, mask=row_ok[:, None] & (c[None, :] < cols), other=0)
    dst_rows = out_ptr + t.to(tl.int64)[:, None] * cols
    for j0 in range(0, cols, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        col_ok = j < cols
        p = tl.load(perm_ptr + j, mask=col_ok, other=0).to(tl.int32)
        v = tl.gather(src, tl.broadcast_to(p[None, :], (BLOCK_T, BLOCK_J)), axis=1)
        tl.store(dst_rows + j[None, :], v, mask=row_ok[:, None] & col_ok[None, :])


def permute_last_nograd(x: torch.Tensor, perm: torch.Tensor, variant: str = "smem") -> torch.Tensor:
    """``x[..., perm]`` by a Triton kernel (no autograd); ``variant`` ``"smem"`` (rows up to
    :data:`SMEM_MAX_COLS`, else ``"rows"``) or ``"rows"`` (module docstring).

    Args:
        x: ``[..., d]`` on CUDA (or the CPU under ``TRITON_INTERPRET=1``); rows may be strided,
            the last dim must have unit stride (else a contiguous copy is made).
        perm: ``[d]`` integer permutation of ``range(d)`` on ``x``'s device (not checked).

    Returns:
        ``[..., d]`` contiguous, same dtype.

    Raises:
        ValueError: ``perm`` is not 1-D of length ``x.shape[-1]``, or an unknown ``variant``.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    d = x.shape[-1]
    if perm.dim() != 1 or perm.numel() != d:
        raise ValueError(f"perm must be 1-D of length {d} (x's last dim), got {tuple(perm.shape)}")
    x2 = x.reshape(-1, d)
    if d and x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    rows = x2.shape[0]
    if rows and d:
        width = triton.next_power_of_2(d)
        if variant == "smem" and width <= SMEM_MAX_COLS:
            block_t = 1 if width > 4096 else 2
            block_j = min(width, 32 if _INTERPRET else 2048)
            _permute_last_smem_kernel[(triton.cdiv(rows, block_t),)](
                x2, perm, out, rows, d, x2.stride(0), BLOCK_T=block_t, D=width, BLOCK_J=block_j,
                num_warps=8,
            )  # fmt: skip
        else:
            _permute_last_kernel[(triton.cdiv(rows, _BLOCK_T),)](
                x2, perm, out, rows, d, x2.stride(0), BLOCK_T=_BLOCK_T, BLOCK_J=_BLOCK_J
            )
    return out.view(x.shape)


class _PermuteLast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, perm: torch.Tensor, inv_perm: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(inv_perm)
        return permute_last_nograd(x, perm)

    @staticmethod
    def backward(ctx, d_out: torch.Tensor):  # type: ignore[override]
        (inv_perm,) = ctx.saved_tensors
        return permute_last_nograd(d_out, inv_perm), None, None


def permute_last_triton(
    x: torch.Tensor, perm: torch.Tensor, inv_perm: torch.Tensor
) -> torch.Tensor:
    """Differentiable ``x[..., perm]``; ``inv_perm = argsort(perm)`` serves the backward
    (``dx = dy[..., inv_perm]``). Shapes, devices and errors as :func:`permute_last_nograd`."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _PermuteLast.apply(x, perm, inv_perm)
    return permute_last_nograd(x, perm)
