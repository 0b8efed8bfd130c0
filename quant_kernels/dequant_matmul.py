"""Fused int8 row-wise dequant-matmul (Triton): the frozen weight is never materialized.

Two GEMMs of a POET-XQ layer touch the frozen weight ``W ≈ CB · SCB[:, None] / 127``
(bitsandbytes ``Int8Params`` row-wise layout, ``CB`` int8 ``[N, K]``, ``SCB`` fp32 ``[N]``):

* forward  ``y[M, N]  = x[M, K] @ Wᵀ``  — ``CB`` tiles are converted to the activation dtype in
  registers, multiplied on the tensor cores with fp32 accumulation, and the per-row scale
  ``SCB[n] / 127`` is applied once in the epilogue (it is constant along the reduction);
* backward ``dx[M, K] = dy[M, N] @ W`` — the scale runs along the reduction dimension, so each
  ``CB`` tile is dequantized (``CB · SCB / 127`` in fp32, rounded to the activation dtype, exactly
  as the reference ``dequant_int8_rowwise(CB, SCB, dtype)`` does) before the tile product.

Layout of this file: private ``@triton.jit`` kernels → host launchers (shape checks, grid,
allocation) → nothing else; the POET-X layer reaches them through :mod:`quant_kernels`. The
plain-torch oracle is :func:`quant_kernels.reference.int8_rowwise_matmul` / ``_t``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def _configs() -> list[triton.Config]:
    cfgs = []
    for bm, bn, bk, warps, stages in (
        (128, 256, 64, 8, 3),
        (128, 256, 64, 8, 4),
        (128, 256, 128, 8, 3),
        (256, 128, 64, 8, 3),
        (256, 128, 128, 8, 3),
        (128, 128, 128, 8, 4),
        (128, 128, 64, 4, 4),
        (64, 128, 64, 4, 4),
        (64, 64, 64, 4, 3),  # small M (evaluation batches, short sequences)
    ):
        cfgs.append(
            triton.Config(
                {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8},
                num_warps=warps,
                num_stages=stages,
            )
        )
    return cfgs


def prune_configs(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """Triton ``early_config_prune`` of the dequant-matmul autotuners: the configs worth
    compiling for one call.

    Drops tiles more than one power of two taller than the ``M`` rows (a 256-row tile for a
    33-row evaluation batch only adds masked work), and for fp32 activations (``IEEE``) the tiles
    above 128 × 128 × 64, whose fp32 operands overflow shared memory or spill registers and take
    ptxas minutes to compile (a CUDA test at fp32 spent > 50 s there). Each new ``M`` re-runs the
    autotuner, so fewer configs also mean shorter pauses when the batch shape changes.

    Args:
        configs: the autotuner's configs (``BLOCK_M``, ``BLOCK_N``, ``BLOCK_K`` in ``kwargs``).
        named_args, kwargs: the launch arguments by name (``M`` and ``IEEE`` are read).

    Returns:
        The kept configs; never empty (the smallest tile when every config was dropped).
    """
    args = {**named_args, **kwargs}
    tallest = max(64, triton.next_power_of_2(int(args["M"])))
    fp32 = bool(args.get("IEEE", False))

    def fits(c: triton.Config) -> bool:
        bm, bn, bk = (c.kwargs[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
        return bm <= tallest and not (fp32 and (bm * bn > 128 * 128 or bk > 64))

    def size(c: triton.Config) -> int:
        return c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_K"]

    return [c for c in configs if fits(c)] or [min(configs, key=size)]


def _small_configs() -> list[triton.Config]:
    # the interpreter (CPU tests) runs one config; keep tiles small so masks are exercised
    return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2})]


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_CONFIGS = _small_configs() if _interpreting() else _configs()
_CONFIGS_4BIT = (
    _small_configs()
    if _interpreting()
    else [
        triton.Config(
            {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=w, num_stages=st
        )
        for bm, bn, w, st in ((128, 128, 8, 3), (128, 64, 4, 3), (64, 128, 4, 3), (64, 64, 4, 2))
    ]
)
_UPCAST = _interpreting()


@triton.jit
def _tile_ids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Grouped ("swizzled") program order so consecutive programs share operand tiles in L2."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_n
    first_m = (pid // group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % size_m
    pid_n = (pid % group) // size_m
    return pid_m, pid_n


@triton.jit
def _to(b, dtype: tl.constexpr, UPCAST: tl.constexpr):
    # int8 -> float is exact either way; the interpreter needs the fp32 hop (it bit-casts int8 to
    # 16-bit floats), the GPU converts directly.
    if UPCAST:
        return b.to(tl.float32).to(dtype)
    return b.to(dtype)


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    # Triton's CPU interpreter mis-multiplies 16-bit float tiles; there (tests only) the already
    # rounded bf16/fp16 operands are widened to fp32 first, which is exact. fp32 activations get
    # full fp32 products (IEEE), as torch's fp32 matmul does by default, instead of tf32.
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.autotune(
    configs=_CONFIGS, key=["M", "N", "K"], prune_configs_by={"early_config_prune": prune_configs}
)
@triton.jit
def _int8_mm_nt_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """y[M, N] = (x[M, K] @ CB[N, K]ᵀ) * SCB[N] / 127, fp32 accumulation."""
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :] * stride_wk  # [BN, BK], K-major
    # Computed transposed (yᵀ = W xᵀ) so the converted int8 tile is the MMA's register operand.
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(x_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(w_ptrs, mask=(offs_n[:, None] < N) & (offs_k[None, :] < k_left), other=0)
        acc = _dot(_to(b, a.dtype, UPCAST), tl.trans(a), acc, UPCAST, IEEE)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    scale = tl.load(s_ptr + offs_n, mask=offs_n < N, other=0.0) * (1.0 / 127.0)
    acc = tl.trans(acc * scale[:, None])
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn
    tl.store(
        y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N)
    )


@triton.autotune(
    configs=_CONFIGS, key=["M", "N", "K"], prune_configs_by={"early_config_prune": prune_configs}
)
@triton.jit
def _int8_mm_nn_kernel(
    g_ptr, w_ptr, s_ptr, out_ptr,
    M, N, K,
    stride_gm, stride_gk, stride_wk, stride_wn, stride_om, stride_on,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """out[M, N] = g[M, K] @ (CB[K, N] * SCB[K, None] / 127); here K is the weight's row count."""
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    g_ptrs = g_ptr + offs_m[:, None] * stride_gm + offs_k[None, :] * stride_gk
    w_ptrs = w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn
    # Measured on the H200 (evals/results): here the plain orientation beats the transposed one.
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(g_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(w_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0)
        s = tl.load(s_ptr + k * BLOCK_K + offs_k, mask=offs_k < k_left, other=0.0)
        b = (b.to(tl.float32) * (s * (1.0 / 127.0))[:, None]).to(a.dtype)
        acc = _dot(a, b, acc, UPCAST, IEEE)
        g_ptrs += BLOCK_K * stride_gk
        w_ptrs += BLOCK_K * stride_wk
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _decode_4bit(
    packed_ptr, absmax_ptr, qmap_ptr, rows, cols, n_cols, mask,
    BLOCKSIZE: tl.constexpr, DTYPE: tl.constexpr,
):  # fmt: skip
    """Dequantize W[rows, cols] from the bitsandbytes 4-bit layout (row-major flat index
    ``e = row·n_cols + col``; byte ``e // 2``, first element in the high nibble; block scale
    ``absmax[e // blocksize]``; code value ``quant_map[code]``), rounded to ``DTYPE``."""
    e = rows.to(tl.int64) * n_cols + cols
    byte = tl.load(packed_ptr + (e >> 1), mask=mask, other=0).to(tl.int32)
    code = tl.where((e & 1) == 0, byte >> 4, byte & 15)
    val = tl.load(qmap_ptr + code, mask=mask, other=0.0)
    scale = tl.load(absmax_ptr + e // BLOCKSIZE, mask=mask, other=0.0)
    return (val * scale).to(DTYPE)


@triton.autotune(
    configs=_CONFIGS_4BIT,
    key=["M", "N", "K"],
    prune_configs_by={"early_config_prune": prune_configs},
)
@triton.jit
def _4bit_mm_nt_kernel(
    x_ptr, packed_ptr, absmax_ptr, qmap_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_ym, stride_yn,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, BLOCKSIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """y[M, N] = x[M, K] @ deq(W)[N, K]ᵀ, W in bitsandbytes NF4/FP4 blockwise layout."""
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # yᵀ = W xᵀ: W is the register operand
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        cols = k * BLOCK_K + offs_k
        a = tl.load(x_ptrs, mask=(offs_m[:, None] < M) & (cols[None, :] < K), other=0.0)
        wmask = (offs_n[:, None] < N) & (cols[None, :] < K)
        w = _decode_4bit(packed_ptr, absmax_ptr, qmap_ptr, offs_n[:, None], cols[None, :], K,
                         wmask, BLOCKSIZE, a.dtype)  # fmt: skip
        acc = _dot(w, tl.trans(a), acc, UPCAST, IEEE)
        x_ptrs += BLOCK_K * stride_xk
    acc = tl.trans(acc)
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn
    tl.store(
        y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N)
    )


@triton.autotune(
    configs=_CONFIGS_4BIT,
    key=["M", "N", "K"],
    prune_configs_by={"early_config_prune": prune_configs},
)
@triton.jit
def _4bit_mm_nn_kernel(
    g_ptr, packed_ptr, absmax_ptr, qmap_ptr, out_ptr,
    M, N, K, W_COLS,
    stride_gm, stride_gk, stride_om, stride_on,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, BLOCKSIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """out[M, N] = g[M, K] @ deq(W)[K, N]; W has K rows and W_COLS (= N) columns."""
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    g_ptrs = g_ptr + offs_m[:, None] * stride_gm + offs_k[None, :] * stride_gk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        rows = k * BLOCK_K + offs_k
        a = tl.load(g_ptrs, mask=(offs_m[:, None] < M) & (rows[None, :] < K), other=0.0)
        wmask = (rows[:, None] < K) & (offs_n[None, :] < N)
        w = _decode_4bit(packed_ptr, absmax_ptr, qmap_ptr, rows[:, None], offs_n[None, :], W_COLS,
                         wmask, BLOCKSIZE, a.dtype)  # fmt: skip
        acc = _dot(a, w, acc, UPCAST, IEEE)
        g_ptrs += BLOCK_K * stride_gk
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(
        out_ptrs,
        acc.to(out_ptr.dtype.element_ty),
        mask=(offs_m[:, None] < M) & (offs_n[None, :] < N),
    )


def _grid(meta: dict, M: int, N: int) -> tuple[int]:
    return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)


def _check(cb: torch.Tensor, scb: torch.Tensor, act: torch.Tensor, dim: int, what: str) -> None:
    if cb.dtype != torch.int8 or cb.dim() != 2:
        raise ValueError(f"CB must be a 2-D int8 tensor, got {tuple(cb.shape)} {cb.dtype}")
    if scb.shape != (cb.shape[0],):
        raise ValueError(f"SCB must have shape ({cb.shape[0]},), got {tuple(scb.shape)}")
    if act.shape[-1] != cb.shape[dim]:
        raise ValueError(
            f"{what} has last dim {act.shape[-1]}; CB {tuple(cb.shape)} needs {cb.shape[dim]}"
        )
    if not act.is_floating_point():
        raise ValueError(f"{what} must be floating point, got {act.dtype}")


def int8_matmul(x: torch.Tensor, cb: torch.Tensor, scb: torch.Tensor) -> torch.Tensor:
    """``x @ (CB · SCB/127)ᵀ`` by the fused Triton kernel.

    Args:
        x: ``[..., K]`` bf16/fp16/fp32 (fp32 inputs use the tensor cores' tf32 mode).
        cb: int8 ``[N, K]`` (bitsandbytes ``CB``).
        scb: fp32 ``[N]`` row absmax (bitsandbytes ``SCB``).

    Returns:
        ``[..., N]`` in ``x.dtype``.

    Raises:
        ValueError: on mismatched shapes or dtypes.
    """
    _check(cb, scb, x, 1, "x")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    M, K = x2.shape
    N = cb.shape[0]
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    if M and N:
        _int8_mm_nt_kernel[lambda meta: _grid(meta, M, N)](
            x2, cb, scb.float(), y, M, N, K,
            x2.stride(0), x2.stride(1), cb.stride(0), cb.stride(1), y.stride(0), y.stride(1),
            UPCAST=_UPCAST, IEEE=x.dtype == torch.float32,
        )  # fmt: skip
    return y.view(*lead, N)


def int8_matmul_t(g: torch.Tensor, cb: torch.Tensor, scb: torch.Tensor) -> torch.Tensor:
    """``g @ (CB · SCB/127)`` by the fused Triton kernel (the dX GEMM of backward).

    Args:
        g: ``[..., N]`` bf16/fp16/fp32.
        cb: int8 ``[N, K]``; scb: fp32 ``[N]``.

    Returns:
        ``[..., K]`` in ``g.dtype``.

    Raises:
        ValueError: on mismatched shapes or dtypes.
    """
    _check(cb, scb, g, 0, "g")
    lead = g.shape[:-1]
    g2 = g.reshape(-1, g.shape[-1])
    M, R = g2.shape
    K = cb.shape[1]
    out = torch.empty(M, K, device=g.device, dtype=g.dtype)
    if M and K:
        _int8_mm_nn_kernel[lambda meta: _grid(meta, M, K)](
            g2, cb, scb.float(), out, M, K, R,
            g2.stride(0), g2.stride(1), cb.stride(0), cb.stride(1), out.stride(0), out.stride(1),
            UPCAST=_UPCAST, IEEE=g.dtype == torch.float32,
        )  # fmt: skip
    return out.view(*lead, K)


def _check_4bit(packed, absmax, quant_map, shape, act, dim, what, blocksize) -> None:
    n, k = shape
    if packed.dtype != torch.uint8 or packed.numel() != (n * k + 1) // 2:
        raise ValueError(
            f"packed must be uint8 with {(n * k + 1) // 2} bytes for shape {tuple(shape)}, "
            f"got {packed.dtype} with {packed.numel()}"
        )
    if absmax.numel() != -(-n * k // blocksize) or not absmax.is_floating_point():
        raise ValueError(
            f"absmax must be float with {-(-n * k // blocksize)} entries (blocksize {blocksize}); "
            "double-quantized absmax must be dequantized first"
        )
    if quant_map.numel() != 16:
        raise ValueError(f"quant_map must hold the 16 code values, got {quant_map.numel()}")
    if act.shape[-1] != shape[dim]:
        raise ValueError(
            f"{what} has last dim {act.shape[-1]}; W {tuple(shape)} needs {shape[dim]}"
        )


def blockwise_4bit_matmul(
    x: torch.Tensor,
    packed: torch.Tensor,
    absmax: torch.Tensor,
    quant_map: torch.Tensor,
    blocksize: int,
    shape: tuple[int, int],
) -> torch.Tensor:
    """``x @ deq(W)ᵀ`` for a bitsandbytes NF4/FP4 weight ``W [N, K]``, fused (Triton).

    Args:
        x: ``[..., K]`` bf16/fp16/fp32.
        packed: uint8 ``[ceil(N·K/2)]`` (any shape; bitsandbytes stores ``[N·K/2, 1]``).
        absmax: fp32 ``[ceil(N·K/blocksize)]`` (double-quantized absmax dequantized first).
        quant_map: fp32 ``[16]`` code values (NF4 or FP4).
        blocksize: elements per absmax block (bitsandbytes: 64).
        shape: ``(N, K)``.

    Returns:
        ``[..., N]`` in ``x.dtype``. Each weight element is ``quant_map[code]·absmax`` rounded to
        ``x.dtype`` (as the reference dequantizes), fp32 accumulation.

    Raises:
        ValueError: on mismatched shapes or dtypes.
    """
    _check_4bit(packed, absmax, quant_map, shape, x, 1, "x", blocksize)
    n, k = shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m and n:
        _4bit_mm_nt_kernel[lambda meta: _grid(meta, m, n)](
            x2, packed.reshape(-1), absmax.float().reshape(-1), quant_map.float(), y, m, n, k,
            x2.stride(0), x2.stride(1), y.stride(0), y.stride(1),
            UPCAST=_UPCAST, IEEE=x.dtype == torch.float32, BLOCKSIZE=blocksize,
        )  # fmt: skip
    return y.view(*lead, n)


def blockwise_4bit_matmul_t(
    g: torch.Tensor,
    packed: torch.Tensor,
    absmax: torch.Tensor,
    quant_map: torch.Tensor,
    blocksize: int,
    shape: tuple[int, int],
) -> torch.Tensor:
    """``g @ deq(W)`` for a bitsandbytes NF4/FP4 weight ``W [N, K]``: ``g [..., N]`` → ``[..., K]``.

    Same arguments and errors as :func:`blockwise_4bit_matmul`.
    """
    _check_4bit(packed, absmax, quant_map, shape, g, 0, "g", blocksize)
    n, k = shape
    lead = g.shape[:-1]
    g2 = g.reshape(-1, n)
    m = g2.shape[0]
    out = torch.empty(m, k, device=g.device, dtype=g.dtype)
    if m and k:
        _4bit_mm_nn_kernel[lambda meta: _grid(meta, m, k)](
            g2, packed.reshape(-1), absmax.float().reshape(-1), quant_map.float(), out, m, k, n, k,
            g2.stride(0), g2.stride(1), out.stride(0), out.stride(1),
            UPCAST=_UPCAST, IEEE=g.dtype == torch.float32, BLOCKSIZE=blocksize,
        )  # fmt: skip
    return out.view(*lead, k)
