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
