"""Block-diagonal multiplies with the POET-X permutations fused into their loads and stores.

In a POET-X(Q) layer (:mod:`poetxq.layer`) every block-diagonal multiply sits next to a
permutation of the same activation: ``x' = x[..., Ψ_n]`` before ``BD(G_P)``, ``y = u[..., Ψ_mᵀ]``
after ``BD(G_R)``, and their mirrors in backward. torch runs each permutation as its own
``index_select`` pass over the activation (a sixth of a Llama-1B step on the H200,
``evals/results/profiles/profile_1b_poetxq_h200_b3977d8.txt``), plus pad/slice copies for
ragged dims. Here the permutation is an index on the way in or out of one Triton GEMM:

* :func:`block_diag_perm_matmul`: ``out[t, o(j)] = Σ_c x[t, i(k·b + c)] · G[k, d, c]`` with
  ``j = k·b + d``: ``i`` an optional gather of the input columns, ``o`` an optional scatter of the
  output columns, ``G`` optionally transposed per block. Ragged dims (``dim < nb·b``) read zeros
  past ``dim`` and never write there, so no padded copy exists.
* :func:`block_diag_perm_grad`: ``dG[k, d, c] = Σ_t a[t, ia(k·b + d)] · v[t, iv(k·b + c)]``, the
  block gradient with both operands gathered.

Both accumulate in fp32 (full fp32 products for fp32 operands, not tf32) and round once to the
output dtype. Oracle: :func:`quant_kernels.reference.permute_last` composed with
:func:`quant_kernels.reference.block_diag_matmul`.

Status: correct (CPU interpreter tests); not timed on a GPU yet, so :mod:`quant_kernels` does not
dispatch to it (``evals/bench_block_diag_perm.py`` is the benchmark that decides).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from quant_kernels.dequant_matmul import _dot  # fp32 accumulation; interpreter-safe 16-bit

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _bd_perm_kernel(
    x_ptr, g_ptr, out_ptr, in_perm_ptr, out_perm_ptr,
    T, dim, stride_x, stride_o, g_sk, g_sd, g_sc,
    B: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, BC: tl.constexpr,
    IN_PERM: tl.constexpr, OUT_PERM: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    pid_t, k, pid_d = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t = pid_t * BT + tl.arange(0, BT)
    d = pid_d * BD + tl.arange(0, BD)
    t_ok = t < T
    x_rows = x_ptr + t.to(tl.int64)[:, None] * stride_x
    acc = tl.zeros((BT, BD), dtype=tl.float32)
    for c0 in range(0, B, BC):
        c = c0 + tl.arange(0, BC)
        col = k * B + c
        c_ok = (c < B) & (col < dim)
        src = col
        if IN_PERM:
            src = tl.load(in_perm_ptr + col, mask=c_ok, other=0)
        a = tl.load(x_rows + src[None, :], mask=t_ok[:, None] & c_ok[None, :], other=0.0)
        g_tile = g_ptr + k * g_sk + d[None, :] * g_sd + c[:, None] * g_sc  # Gᵀ tile [BC, BD]
        w = tl.load(g_tile, mask=(c[:, None] < B) & (d[None, :] < B), other=0.0)
        acc = _dot(a, w, acc, UPCAST, IEEE)
    j = k * B + d
    j_ok = (d < B) & (j < dim)
    dst = j
    if OUT_PERM:
        dst = tl.load(out_perm_ptr + j, mask=j_ok, other=0)
    out = out_ptr + t.to(tl.int64)[:, None] * stride_o + dst[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & j_ok[None, :])


@triton.jit
def _bd_perm_grad_kernel(
    a_ptr, v_ptr, dg_ptr, a_perm_ptr, v_perm_ptr, T, dim, stride_a, stride_v,
    B: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, BC: tl.constexpr,
    A_PERM: tl.constexpr, V_PERM: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    k, pid_d, pid_c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    d = pid_d * BD + tl.arange(0, BD)
    c = pid_c * BC + tl.arange(0, BC)
    cola, colv = k * B + d, k * B + c
    d_ok = (d < B) & (cola < dim)
    c_ok = (c < B) & (colv < dim)
    src_a, src_v = cola, colv
    if A_PERM:
        src_a = tl.load(a_perm_ptr + cola, mask=d_ok, other=0)
    if V_PERM:
        src_v = tl.load(v_perm_ptr + colv, mask=c_ok, other=0)
    acc = tl.zeros((BD, BC), dtype=tl.float32)
    for t0 in range(0, T, BT):
        t = t0 + tl.arange(0, BT)
        t_ok = t < T
        a = tl.load(a_ptr + t.to(tl.int64)[None, :] * stride_a + src_a[:, None],
                    mask=d_ok[:, None] & t_ok[None, :], other=0.0)  # aᵀ tile [BD, BT]  # fmt: skip
        v = tl.load(v_ptr + t.to(tl.int64)[:, None] * stride_v + src_v[None, :],
                    mask=t_ok[:, None] & c_ok[None, :], other=0.0)  # [BT, BC]  # fmt: skip
        acc = _dot(a, v, acc, UPCAST, IEEE)
    out = dg_ptr + k * B * B + d[:, None] * B + c[None, :]
    tl.store(out, acc.to(dg_ptr.dtype.element_ty), mask=(d[:, None] < B) & (c[None, :] < B))


def _tiles(b: int) -> tuple[int, int, int]:
    """(BT, BD, BC): token rows, output columns and reduction columns per tile."""
    if _INTERPRET:
        return 16, 16, 16
    inner = 64 if b >= 64 else max(16, triton.next_power_of_2(b))
    return 64, min(128, max(16, triton.next_power_of_2(b))), inner


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _check_perm(perm: torch.Tensor | None, dim: int, name: str) -> None:
    if perm is not None and (perm.dim() != 1 or perm.numel() != dim):
        raise ValueError(f"{name} must be 1-D of length {dim}, got {tuple(perm.shape)}")


def block_diag_perm_matmul(
    x: torch.Tensor,
    g: torch.Tensor,
    *,
    in_perm: torch.Tensor | None = None,
    out_perm: torch.Tensor | None = None,
    transpose_g: bool = False,
) -> torch.Tensor:
    """``out[..., out_perm[j]] = (x[..., in_perm] @ BD(G)ᵀ)[..., j]`` in one kernel (no autograd).

    Args:
        x: ``[..., dim]`` (fp32/bf16/fp16) with ``nb = ⌈dim / b⌉`` blocks; past ``dim`` the padded
            input is zero.
        g: ``[nb, b, b]``, same dtype; ``transpose_g`` uses ``G[k]ᵀ`` for every block.
        in_perm: ``[dim]`` int gather index of the input columns (None: identity).
        out_perm: ``[dim]`` int scatter index of the output columns (None: identity):
            ``out[..., out_perm[j]] = r[..., j]``, i.e. ``out = r[..., argsort(out_perm)]``.

    Returns:
        ``[..., dim]`` in ``x.dtype``.

    Raises:
        ValueError: ``g`` has fewer blocks than ``dim`` needs, or a permutation has the wrong
            length.
    """
    nb, b, _ = g.shape
    dim = x.shape[-1]
    if nb * b < dim or (nb - 1) * b >= dim:
        raise ValueError(f"{nb} blocks of b={b} do not cover dim {dim} with one partial block")
    _check_perm(in_perm, dim, "in_perm")
    _check_perm(out_perm, dim, "out_perm")
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    T = x2.shape[0]
    if T == 0:
        return out.view(x.shape)
    BT, BD, BC = _tiles(b)
    sk, sd, sc = g.stride()
    if transpose_g:
        sd, sc = sc, sd
    dummy = torch.empty(1, dtype=torch.int64, device=x.device)
    grid = (triton.cdiv(T, BT), nb, triton.cdiv(b, BD))
    _bd_perm_kernel[grid](
        x2, g, out, in_perm if in_perm is not None else dummy,
        out_perm if out_perm is not None else dummy,
        T, dim, x2.stride(0), out.stride(0), sk, sd, sc,
        B=b, BT=BT, BD=BD, BC=BC, IN_PERM=in_perm is not None, OUT_PERM=out_perm is not None,
        UPCAST=_INTERPRET and x.dtype != torch.float32, IEEE=x.dtype == torch.float32,
    )  # fmt: skip
    return out.view(x.shape)


def block_diag_perm_grad(
    a: torch.Tensor,
    v: torch.Tensor,
    nb: int,
    b: int,
    *,
    a_perm: torch.Tensor | None = None,
    v_perm: torch.Tensor | None = None,
) -> torch.Tensor:
    """``dG[k, d, c] = Σ_t a'[t, k·b + d] · v'[t, k·b + c]`` with ``a' = a[..., a_perm]`` and
    ``v' = v[..., v_perm]`` zero-padded to ``nb·b`` columns (the gradient of ``v' @ BD(G)ᵀ``
    with respect to ``G`` when ``a'`` is the output gradient).

    Args:
        a, v: ``[..., dim]``, same leading shape and dtype.
        nb, b: the blocks.
        a_perm, v_perm: ``[dim]`` gather indices (None: identity).

    Returns:
        ``[nb, b, b]`` in ``a.dtype``.

    Raises:
        ValueError: mismatched shapes or permutation lengths.
    """
    dim = a.shape[-1]
    if v.shape != a.shape:
        raise ValueError(f"a {tuple(a.shape)} and v {tuple(v.shape)} must have the same shape")
    _check_perm(a_perm, dim, "a_perm")
    _check_perm(v_perm, dim, "v_perm")
    a2, v2 = _rows(a), _rows(v)
    dg = torch.empty(nb, b, b, dtype=a.dtype, device=a.device)
    BT, BD, BC = _tiles(b)
    BD = BC  # square output tiles
    dummy = torch.empty(1, dtype=torch.int64, device=a.device)
    grid = (nb, triton.cdiv(b, BD), triton.cdiv(b, BC))
    _bd_perm_grad_kernel[grid](
        a2, v2, dg, a_perm if a_perm is not None else dummy,
        v_perm if v_perm is not None else dummy, a2.shape[0], dim, a2.stride(0), v2.stride(0),
        B=b, BT=BT, BD=BD, BC=BC, A_PERM=a_perm is not None, V_PERM=v_perm is not None,
        UPCAST=_INTERPRET and a.dtype != torch.float32, IEEE=a.dtype == torch.float32,
    )  # fmt: skip
    return dg
