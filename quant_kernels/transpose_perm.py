"""Feature-axis permutations fused with a transpose: both sides of every copy coalesced.

torch permutes the feature axis of a row-major activation ``x [T, d]`` (``x[:, perm]``) at
3.5–8× the HBM read+write floor on the H200: each warp's loads land on random columns. The same
permutation on a *feature-major* activation ``[d, T]`` is a row gather, at 1.6–4.6× the floor
(``evals/results/bench_gather_h200.json``). These kernels move between the two layouts and
permute in the same pass, so that a POET-X(Q) layer could keep its activations feature-major
between its GEMMs (cuBLAS writes either layout at the same cost):

* :func:`permute_to_feature_major` — ``out[j, t] = x[t, perm[j]]``: ``(x[:, perm])ᵀ`` from a
  row-major ``x``. A tile of ``x`` is read along its rows (coalesced), transposed on chip and
  written to the rows ``inv_perm[c]`` of ``out``, each a contiguous run of tokens.
* :func:`permute_to_row_major` — ``out[t, j] = xt[perm[j], t]``: ``(xt[perm])ᵀ`` from a
  feature-major ``xt``. Gathered rows of ``xt`` are read as contiguous runs of tokens, transposed
  on chip and written along the rows of ``out``.

Both are exact copies (equal to torch's indexing). On the H200 they run at 2.2–3.1× the floor at
the large shapes (2.5× faster than ``index_select`` at 2048 × 14336 and 8192 × 5632), slower at
2048 × 4096. The layers' feature-major path uses them (``KernelPolicy.feature_major``, the
default on a GPU); ``evals/bench_gather.py`` times them alone.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
#: (tokens, features) per tile; 64 × 64 bf16 is 8 KiB, a common transpose tile
TILE = (16, 16) if _INTERPRET else (64, 64)


@triton.jit
def _to_feature_major_kernel(
    x_ptr, inv_ptr, out_ptr, rows, cols, stride_x, stride_o,
    BT: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    t_ok, c_ok = t < rows, c < cols
    v = tl.load(x_ptr + t.to(tl.int64)[:, None] * stride_x + c[None, :],
                mask=t_ok[:, None] & c_ok[None, :])  # [BT, BC], contiguous along c  # fmt: skip
    dst = tl.load(inv_ptr + c, mask=c_ok, other=0).to(tl.int64)  # column c goes to row inv[c]
    tl.store(out_ptr + dst[:, None] * stride_o + t[None, :],
             tl.trans(v).to(out_ptr.dtype.element_ty),
             mask=c_ok[:, None] & t_ok[None, :])  # fmt: skip


@triton.jit
def _to_row_major_kernel(
    xt_ptr, perm_ptr, out_ptr, rows, cols, stride_xt, stride_o,
    BT: tl.constexpr, BJ: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    j = tl.program_id(1) * BJ + tl.arange(0, BJ)
    t_ok, j_ok = t < rows, j < cols
    src = tl.load(perm_ptr + j, mask=j_ok, other=0).to(tl.int64)
    v = tl.load(xt_ptr + src[:, None] * stride_xt + t[None, :],
                mask=j_ok[:, None] & t_ok[None, :])  # [BJ, BT], contiguous along t  # fmt: skip
    tl.store(out_ptr + t.to(tl.int64)[:, None] * stride_o + j[None, :],
             tl.trans(v).to(out_ptr.dtype.element_ty),
             mask=t_ok[:, None] & j_ok[None, :])  # fmt: skip


def _check(a: torch.Tensor, perm: torch.Tensor, axis_len: int, what: str) -> None:
    if a.dim() != 2:
        raise ValueError(f"{what} must be 2-D, got shape {tuple(a.shape)}")
    if perm.dim() != 1 or perm.numel() != axis_len:
        raise ValueError(
            f"the permutation must be 1-D of length {axis_len} (the feature axis of {what}), "
            f"got {tuple(perm.shape)}"
        )


def _launch(
    kernel: Any, a: torch.Tensor, perm: torch.Tensor, tile: tuple[int, int], *,
    feature_major_in: bool, out_dtype: torch.dtype | None,
) -> torch.Tensor:  # fmt: skip
    """Run one of the two kernels over a ``(tokens, features)`` grid of tiles; the output is
    ``a``'s transpose in shape, contiguous, in ``out_dtype`` (default ``a``'s)."""
    if a.stride(-1) != 1:
        a = a.contiguous()
    rows, cols = (a.shape[1], a.shape[0]) if feature_major_in else (a.shape[0], a.shape[1])
    out = torch.empty(a.shape[1], a.shape[0], dtype=out_dtype or a.dtype, device=a.device)
    if rows and cols:
        grid = (triton.cdiv(rows, tile[0]), triton.cdiv(cols, tile[1]))
        kernel[grid](a, perm, out, rows, cols, a.stride(0), out.stride(0), tile[0], tile[1])
    return out


def permute_to_feature_major(
    x: torch.Tensor,
    inv_perm: torch.Tensor,
    tile: tuple[int, int] = TILE,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``(x[:, perm])ᵀ`` — ``out[j, t] = x[t, perm[j]]`` — given ``inv_perm = argsort(perm)``.

    Args:
        x: ``[T, d]`` row-major (unit stride along ``d``; else a contiguous copy is made), on CUDA
            or the CPU under ``TRITON_INTERPRET=1``.
        inv_perm: ``[d]`` integer inverse permutation on ``x``'s device (not checked to be one).
        tile: ``(tokens, features)`` per program, powers of two.
        out_dtype: the output's dtype (default ``x``'s): the cast is done in the same pass, as
            ``x.to(out_dtype)`` rounds (round to nearest even on a GPU).

    Returns:
        ``[d, T]`` contiguous, ``out_dtype``.

    Raises:
        ValueError: ``x`` is not 2-D or ``inv_perm`` is not ``[d]``.
    """
    _check(x, inv_perm, x.shape[-1] if x.dim() == 2 else -1, "x")
    return _launch(_to_feature_major_kernel, x, inv_perm, tile, feature_major_in=False,
                   out_dtype=out_dtype)  # fmt: skip


def permute_to_row_major(
    xt: torch.Tensor,
    perm: torch.Tensor,
    tile: tuple[int, int] = TILE,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``(xt[perm])ᵀ`` — ``out[t, j] = xt[perm[j], t]``: from feature-major back to row-major.

    Args:
        xt: ``[d, T]`` feature-major (unit stride along ``T``; else a contiguous copy is made).
        perm: ``[d]`` integer permutation on ``xt``'s device (not checked to be one).
        tile: ``(tokens, features)`` per program, powers of two.
        out_dtype: the output's dtype (default ``xt``'s), cast in the same pass.

    Returns:
        ``[T, d]`` contiguous, ``out_dtype``.

    Raises:
        ValueError: ``xt`` is not 2-D or ``perm`` is not ``[d]``.
    """
    _check(xt, perm, xt.shape[0] if xt.dim() == 2 else -1, "xt")
    return _launch(_to_row_major_kernel, xt, perm, tile, feature_major_in=True,
                   out_dtype=out_dtype)  # fmt: skip
