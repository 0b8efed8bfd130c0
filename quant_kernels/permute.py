"""Permute the last dimension, ``out[..., j] = x[..., perm[j]]`` (Triton), with its backward.

A POET-X(Q) layer permutes its activations five times per training step (``Ψ_n`` on the input,
``Ψ_mᵀ`` on the output, and their transposes in backward; :mod:`poetxq.layer`). torch does it with
``index_select`` along the last dim, which runs as the generic ``_scatter_gather_elementwise``
kernel: on the H200 a fifth of a POET-XQ layer's GPU time and about 17 % of a Llama-1B/8B
training step (``evals/results/profiles/profile_1b_poetxq_h200_b3977d8.txt``), at 3.5–8× the HBM
read+write floor (``evals/results/bench_gather_h200.json``).

One program owns ``BLOCK_T`` whole rows and walks their columns in chunks with gathered loads
and contiguous stores; the result is an exact copy (equal to ``index_select``), and the backward of
a permutation is the inverse permutation (no scatter-add). Measured *slower* than torch on the
H200: 115.6 µs against 84 µs per call in the 4096 → 14336 layer's profile
(``evals/results/gpu_suite_permute_h200.json``; 296 against 195 µs at 2048 × 14336 alone,
``bench_gather_h200.json``), so :func:`quant_kernels.permute_last` uses it
only under ``POETXQ_KERNELS=fused`` (:data:`quant_kernels.TRITON_PERMUTE_MEASURED_FASTER` is
False). A variant that permuted whole rows on chip with ``tl.gather`` did not finish compiling and
running its first shape within 150 s on the H200 and was dropped. Fusing the permutation into
the block-diagonal multiply's loads and stores was slower still
(``bench_block_diag_perm_h200.json``); :mod:`quant_kernels.transpose_perm` (permute while
changing layout) is the faster route.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from quant_kernels.reference import PermuteLast

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
        _permute_last_kernel[(triton.cdiv(rows, _BLOCK_T),)](
            x2, perm, out, rows, d, x2.stride(0), BLOCK_T=_BLOCK_T, BLOCK_J=_BLOCK_J
        )
    return out.view(x.shape)


def permute_last_triton(
    x: torch.Tensor, perm: torch.Tensor, inv_perm: torch.Tensor | None = None
) -> torch.Tensor:
    """Differentiable ``x[..., perm]``; ``inv_perm = argsort(perm)`` (computed in the backward
    when not given) serves the backward (``dx = dy[..., inv_perm]``). Shapes, devices and
    errors as :func:`permute_last_nograd`."""
    if torch.is_grad_enabled() and x.requires_grad:
        return PermuteLast.apply(x, perm, inv_perm, permute_last_nograd)
    return permute_last_nograd(x, perm)
