"""int8 × int8 weight GEMMs on the tensor cores (Triton): the frozen int8 ``W0`` is never decoded.

The same products as the plain-torch oracle :mod:`quant_kernels.reference_int8_mma` (its module
docstring gives the format and the rounding), in three kernels:

* :func:`quantize_rows`: per-row absmax int8 quantization of an activation of any strides
  (a feature-major ``zᵀ`` is read as the ``[T, K]`` view ``zt.t()``), optionally of its product
  with a column scale (the dX GEMM's ``SCB / 127``), by round-half-to-even or by stochastic
  rounding from a seed drawn on the device (no host sync: meant to be capturable in a CUDA graph,
  not yet tested under capture);
* forward ``h = z @ Wᵀ``: ``tl.dot`` of int8 tiles of the codes ``q_z [M, K]`` and ``CB [N, K]``
  (both K-major) into int32, then ``acc · s_z[m] · (SCB[n] / 127)`` in fp32, stored in the
  output dtype, row- or feature-major;
* dX ``dz = dh @ W``: ``tl.dot`` of ``q_g [M, N]`` and ``CB [N, K]`` read along its rows (the
  same codes, no transposed copy), then ``acc · s_g[m]``.

Integer accumulation is exact, so the kernels agree with the oracle bit for bit on the codes and
the int32 sums; the fp32 epilogue does the same operations in the same order (the round-to-nearest
quantizer uses the ``x + 1.5·2²³ − 1.5·2²³`` rounding, which is IEEE round-half-to-even in fp32
for ``|x| < 2²²``, and IEEE divisions). Stochastic rounding draws its noise from Triton's Philox
(``tl.rand``), so it agrees with the oracle in distribution only. Rows and columns that are not a
multiple of the tiles are masked.

Layout of this file: private ``@triton.jit`` kernels → host launchers (checks, grid, allocation).
Which path runs when: :meth:`quant_kernels.policy.KernelPolicy.int8_mma_path`.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from quant_kernels.dequant_matmul import _tile_ids, prune_configs
from quant_kernels.reference import int8_row_scale
from quant_kernels.reference_int8_mma import MAX_REDUCTION

__all__ = ["int8_mma_matmul", "int8_mma_matmul_t", "quantize_rows"]

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_RNE = tl.constexpr(12582912.0)  # 1.5 · 2²³: (x + c) − c rounds an fp32 |x| < 2²² half to even
_FLT_MAX = tl.constexpr(3.4028234663852886e38)


def _configs() -> list[triton.Config]:
    if _INTERPRET:  # one small config so that the CPU tests exercise the edge masks
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "GROUP_M": 2})]
    cfgs = []
    for bm, bn, bk, warps, stages in (
        (128, 256, 128, 8, 3),
        (256, 128, 128, 8, 3),
        (128, 256, 64, 8, 4),
        (128, 128, 128, 8, 4),
        (128, 128, 128, 4, 4),
        (128, 128, 64, 4, 4),
        (64, 128, 128, 4, 4),
        (64, 64, 128, 4, 3),  # small M
    ):
        cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}
        cfgs.append(triton.Config(cfg, num_warps=warps, num_stages=stages))
    return cfgs


_CONFIGS = _configs()


@triton.jit
def _quantize_rows_kernel(
    x_ptr, cs_ptr, q_ptr, s_ptr, seed_ptr,
    M, K, stride_xm, stride_xk,
    HAS_COL_SCALE: tl.constexpr, STOCHASTIC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """q[m, :] = round(x[m, :] · cs · 127 / amax_m) (int8, contiguous [M, K]), s[m] = amax_m / 127.

    Two passes over the row block: its absmax (and NaN count), then the codes."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    base = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    amax = tl.zeros([BLOCK_M], dtype=tl.float32)
    nans = tl.zeros([BLOCK_M], dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        mask = rmask[:, None] & (cols[None, :] < K)
        x = tl.load(base + cols[None, :] * stride_xk, mask=mask, other=0.0).to(tl.float32)
        if HAS_COL_SCALE:
            x = x * tl.load(cs_ptr + cols, mask=cols < K, other=0.0)[None, :]
        amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
        nans += tl.sum((x != x).to(tl.int32), axis=1)
    # the max reduction may drop NaNs: a row holding one gets a NaN scale (and zero codes)
    ok = (amax > 0.0) & (amax <= _FLT_MAX) & (nans == 0)
    c127 = tl.full([BLOCK_M], 127.0, tl.float32)
    inv = tl.where(ok, tl.math.div_rn(c127, tl.where(ok, amax, 1.0)), 0.0)
    s = tl.math.div_rn(amax, c127)
    s = tl.where(nans > 0, float("nan"), s)
    tl.store(s_ptr + rows, s, mask=rmask)
    if STOCHASTIC:
        seed = tl.load(seed_ptr)
    out = q_ptr + rows.to(tl.int64)[:, None] * K
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        mask = rmask[:, None] & (cols[None, :] < K)
        x = tl.load(base + cols[None, :] * stride_xk, mask=mask, other=0.0).to(tl.float32)
        if HAS_COL_SCALE:
            x = x * tl.load(cs_ptr + cols, mask=cols < K, other=0.0)[None, :]
        scaled = x * inv[:, None]
        scaled = tl.where(scaled == scaled, scaled, 0.0)  # inf · 0 in a non-finite row
        if STOCHASTIC:
            u = tl.rand(seed, rows[:, None] * K + cols[None, :])
            q = tl.floor(scaled + u)
        else:
            q = (scaled + _RNE) - _RNE
        q = tl.minimum(tl.maximum(q, -127.0), 127.0)
        tl.store(out + cols[None, :], q.to(tl.int8), mask=mask)


@triton.autotune(
    configs=_CONFIGS, key=["M", "N", "K"], prune_configs_by={"early_config_prune": prune_configs}
)
@triton.jit
def _mma_nt_kernel(
    q_ptr, cb_ptr, s_ptr, ws_ptr, out_ptr,
    M, N, K,
    stride_cn, stride_ck, stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """out[M, N] = (q[M, K] @ CB[N, K]ᵀ in int32) · s[M] · ws[N], fp32 epilogue."""
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    q_ptrs = q_ptr + offs_m.to(tl.int64)[:, None] * K + offs_k[None, :]
    w_ptrs = cb_ptr + offs_n.to(tl.int64)[:, None] * stride_cn + offs_k[None, :] * stride_ck
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(q_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0)
        b = tl.load(w_ptrs, mask=(offs_n[:, None] < N) & (offs_k[None, :] < k_left), other=0)
        acc = tl.dot(a, tl.trans(b), acc, out_dtype=tl.int32)
        q_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_ck
    s = tl.load(s_ptr + offs_m, mask=offs_m < M, other=0.0)
    ws = tl.load(ws_ptr + offs_n, mask=offs_n < N, other=0.0)
    out = acc.to(tl.float32) * s[:, None] * ws[None, :]
    o_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.autotune(
    configs=_CONFIGS, key=["M", "N", "K"], prune_configs_by={"early_config_prune": prune_configs}
)
@triton.jit
def _mma_nn_kernel(
    q_ptr, cb_ptr, s_ptr, out_ptr,
    M, N, K,
    stride_ck, stride_cn, stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """out[M, N] = (q[M, K] @ CB[K, N] in int32) · s[M]; here K is the weight's row count and
    ``CB`` is read along its rows (``stride_cn`` = 1 for the stored layout)."""
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    q_ptrs = q_ptr + offs_m.to(tl.int64)[:, None] * K + offs_k[None, :]
    w_ptrs = cb_ptr + offs_k.to(tl.int64)[:, None] * stride_ck + offs_n[None, :] * stride_cn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(q_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0)
        b = tl.load(w_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0)
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)
        q_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_ck
    s = tl.load(s_ptr + offs_m, mask=offs_m < M, other=0.0)
    out = acc.to(tl.float32) * s[:, None]
    o_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)


# -- host launchers ----------------------------------------------------------------------------


def _quant_tile(row_contiguous: bool) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_K, num_warps)`` of :func:`quantize_rows`: wide along a contiguous row,
    tall when the tokens are the contiguous axis (a feature-major activation)."""
    if _INTERPRET:
        return 4, 32, 1
    return (4, 1024, 4) if row_contiguous else (64, 64, 4)


def quantize_rows(
    a: torch.Tensor,
    *,
    col_scale: torch.Tensor | None = None,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row absmax int8 quantization by the Triton kernel: the codes and scales of
    :func:`quant_kernels.reference_int8_mma.quantize_rows` (bit for bit with round-to-nearest).

    Args:
        a: ``[M, K]`` fp32/bf16/fp16, any strides (``zt.t()`` for a feature-major ``zt``).
        col_scale: optional fp32 ``[K]``: quantize ``a · col_scale[None, :]``.
        stochastic: stochastic rounding (Philox noise, seeded from ``generator``'s next draw or
            torch's global RNG on ``a``'s device, with no host sync; the noise is indexed by the
            element's int32 offset ``m·K + k``, so it repeats beyond 2³¹ elements).
        generator: RNG of the seed.

    Returns:
        ``(q, s)``: int8 ``[M, K]`` contiguous, fp32 ``[M]``.

    Raises:
        ValueError: ``a`` is not 2-D floating point or ``col_scale`` is not ``[K]``.
    """
    if a.dim() != 2 or not a.is_floating_point():
        raise ValueError(f"expected a 2-D float tensor, got {tuple(a.shape)} {a.dtype}")
    m, k = a.shape
    if col_scale is not None and col_scale.shape != (k,):
        raise ValueError(f"col_scale must have shape ({k},), got {tuple(col_scale.shape)}")
    q = torch.empty(m, k, dtype=torch.int8, device=a.device)
    s = torch.empty(m, dtype=torch.float32, device=a.device)
    if m == 0:
        return q, s
    if stochastic:
        dev = generator.device if generator is not None else a.device
        seed = torch.randint(0, 2**31 - 1, (1,), generator=generator, device=dev).to(a.device)
    else:
        seed = s  # unread
    cs = col_scale.float().contiguous() if col_scale is not None else s
    bm, bk, warps = _quant_tile(a.stride(1) == 1)
    _quantize_rows_kernel[(triton.cdiv(m, bm),)](
        a, cs, q, s, seed, m, k, a.stride(0), a.stride(1),
        HAS_COL_SCALE=col_scale is not None, STOCHASTIC=stochastic,
        BLOCK_M=bm, BLOCK_K=bk, num_warps=warps, enable_fp_fusion=False,
    )  # fmt: skip
    return q, s


def _check(cb: torch.Tensor, scb: torch.Tensor, act: torch.Tensor, dim: int, what: str) -> None:
    if cb.dtype != torch.int8 or cb.dim() != 2:
        raise ValueError(f"CB must be a 2-D int8 tensor, got {tuple(cb.shape)} {cb.dtype}")
    if scb.shape != (cb.shape[0],):
        raise ValueError(f"SCB must have shape ({cb.shape[0]},), got {tuple(scb.shape)}")
    if act.dim() < 1 or act.shape[-1] != cb.shape[dim]:
        raise ValueError(
            f"{what} has shape {tuple(act.shape)}; its last dim must be {cb.shape[dim]} "
            f"(CB {tuple(cb.shape)})"
        )
    if not act.is_floating_point():
        raise ValueError(f"{what} must be floating point, got {act.dtype}")
    if cb.shape[dim] > MAX_REDUCTION:
        raise ValueError(f"CB {tuple(cb.shape)}: a reduction > {MAX_REDUCTION} overflows int32")


def _grid(meta: dict, m: int, n: int) -> tuple[int]:
    return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)


def _out(m: int, n: int, like: torch.Tensor, dtype: torch.dtype, feature_major: bool):
    """An ``[m, n]`` output for the kernel (or, ``feature_major``, the ``[m, n]`` view of a
    contiguous ``[n, m]``) and that contiguous tensor. Under the interpreter, which truncates
    fp32 to 16-bit floats instead of rounding them, the kernel writes fp32 and
    :func:`_finish` rounds on the host."""
    kernel_dtype = torch.float32 if _INTERPRET else dtype
    shape = (n, m) if feature_major else (m, n)
    full = torch.empty(shape, device=like.device, dtype=kernel_dtype)
    return (full.t() if feature_major else full), full


def _finish(full: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return full.to(dtype)  # a no-op but under the interpreter


def int8_mma_matmul(
    x: torch.Tensor,
    cb: torch.Tensor,
    scb: torch.Tensor,
    *,
    out_dtype: torch.dtype | None = None,
    feature_major_out: bool = False,
) -> torch.Tensor:
    """``x @ (CB · SCB/127)ᵀ`` on the int8 tensor cores, ``x`` quantized per row
    (:func:`quantize_rows`): :func:`quant_kernels.reference_int8_mma.int8_mma_matmul`.

    Args:
        x: ``[..., K]`` fp32/bf16/fp16, any strides when 2-D (``zt.t()`` for a feature-major
            activation ``zt [K, T]``).
        cb: int8 ``[N, K]``; scb: fp32 ``[N]`` (bitsandbytes ``CB`` / ``SCB``).
        out_dtype: default ``x.dtype``.
        feature_major_out: return ``[N, M]`` contiguous (``(x @ Wᵀ)ᵀ``, written so directly);
            ``x`` must then be 2-D.

    Returns:
        ``[..., N]`` (or ``[N, M]``) in ``out_dtype``.

    Raises:
        ValueError: mismatched shapes or dtypes, or a reduction that could overflow int32.
    """
    _check(cb, scb, x, 1, "x")
    if feature_major_out and x.dim() != 2:
        raise ValueError(f"feature_major_out needs a 2-D x, got {tuple(x.shape)}")
    n, k = cb.shape
    x2 = x if x.dim() == 2 else x.reshape(-1, k)
    m = x2.shape[0]
    out, full = _out(m, n, x, out_dtype or x.dtype, feature_major_out)
    if m and n:
        q, s = quantize_rows(x2)
        ws = int8_row_scale(scb)
        _mma_nt_kernel[lambda meta: _grid(meta, m, n)](
            q, cb, s, ws, out, m, n, k,
            cb.stride(0), cb.stride(1), out.stride(0), out.stride(1),
        )  # fmt: skip
    full = _finish(full, out_dtype or x.dtype)
    return full if feature_major_out else full.view(*x.shape[:-1], n)


def int8_mma_matmul_t(
    g: torch.Tensor,
    cb: torch.Tensor,
    scb: torch.Tensor,
    *,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
    out_dtype: torch.dtype | None = None,
    feature_major_out: bool = False,
) -> torch.Tensor:
    """``g @ (CB · SCB/127)`` on the int8 tensor cores (the dX GEMM), ``g · SCB/127`` quantized
    per row: :func:`quant_kernels.reference_int8_mma.int8_mma_matmul_t`.

    Args:
        g: ``[..., N]`` fp32/bf16/fp16, any strides when 2-D.
        cb: int8 ``[N, K]``; scb: fp32 ``[N]``.
        stochastic, generator: rounding of the folded gradient (:func:`quantize_rows`).
        out_dtype: default ``g.dtype``.
        feature_major_out: return ``[K, M]`` contiguous; ``g`` must then be 2-D.

    Returns:
        ``[..., K]`` (or ``[K, M]``) in ``out_dtype``.

    Raises:
        ValueError: mismatched shapes or dtypes, or a reduction that could overflow int32.
    """
    _check(cb, scb, g, 0, "g")
    if feature_major_out and g.dim() != 2:
        raise ValueError(f"feature_major_out needs a 2-D g, got {tuple(g.shape)}")
    n, k = cb.shape
    g2 = g if g.dim() == 2 else g.reshape(-1, n)
    m = g2.shape[0]
    out, full = _out(m, k, g, out_dtype or g.dtype, feature_major_out)
    if m and k:
        ws = int8_row_scale(scb)
        q, s = quantize_rows(g2, col_scale=ws, stochastic=stochastic, generator=generator)
        _mma_nn_kernel[lambda meta: _grid(meta, m, k)](
            q, cb, s, out, m, k, n,
            cb.stride(0), cb.stride(1), out.stride(0), out.stride(1),
        )  # fmt: skip
    full = _finish(full, out_dtype or g.dtype)
    return full if feature_major_out else full.view(*g.shape[:-1], k)
