"""Permute the last dimension, ``out[..., j] = x[..., perm[j]]`` (Triton), with its backward.

A POET-X(Q) layer permutes its activations five times per training step (``Ψ_n`` on the input,
``Ψ_mᵀ`` on the output, and their transposes in backward; :mod:`poetxq.layer`). torch does it with
``index_select`` along the last dim, which runs as the generic ``_scatter_gather_elementwise``
kernel: on the H200 a fifth of a POET-XQ layer's GPU time and about 17 % of a Llama-1B/8B
training step (``evals/results/profiles/profile_1b_poetxq_h200_b3977d8.txt``), at roughly 0.7 TB/s.

Here one program owns ``BLOCK_T`` whole rows and walks their columns in chunks: the gathered
reads stay inside those rows (a few tens of KiB, served from L1 after the first touch) and every
write is contiguous. The values are copied, so the result equals ``index_select`` exactly; the
backward of a permutation is the inverse permutation (no scatter-add).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_BLOCK_T, _BLOCK_J = (2, 32) if _INTERPRET else (4, 1024)


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


def permute_last_nograd(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """``x[..., perm]`` by the Triton kernel (no autograd).

    Args:
        x: ``[..., d]`` on CUDA (or the CPU under ``TRITON_INTERPRET=1``); rows may be strided,
            the last dim must have unit stride (else a contiguous copy is made).
        perm: ``[d]`` integer permutation of ``range(d)`` on ``x``'s device (not checked).

    Returns:
        ``[..., d]`` contiguous, same dtype.

    Raises:
        ValueError: ``perm`` is not 1-D of length ``x.shape[-1]``.
    """
    d = x.shape[-1]
    if perm.dim() != 1 or perm.numel() != d:
        raise ValueError(f"perm must be 1-D of length {d} (x's last dim), got {tuple(perm.shape)}")
    x2 = x.reshape(-1, d)
    if d and x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    rows = x2.shape[0]
    if rows and d:
        grid = (triton.cdiv(rows, _BLOCK_T),)
        _permute_last_kernel[grid](
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
