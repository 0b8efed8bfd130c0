"""Plain-torch reference of the int8 × int8 weight GEMMs (the CPU path and the test oracle).

A POET-XQ layer's frozen weight is stored as int8 codes with one absmax per row (bitsandbytes
``Int8Params``: ``CB`` int8 ``[N, K]``, ``SCB`` fp32 ``[N]``, ``W ≈ CB · SCB[:, None] / 127``).
Instead of dequantizing ``W`` to the activation's dtype (:mod:`quant_kernels.reference`), the
int8 path quantizes the *activation* per token row and multiplies integer codes by integer codes:

* forward ``h = z @ Wᵀ``: ``z [M, K]`` → codes ``q_z`` and one fp32 scale per row
  (:func:`quantize_rows`), ``acc = q_z @ CBᵀ`` in int32 (:func:`int_matmul`), epilogue
  ``h = acc · s_z[:, None] · (SCB / 127)[None, :]`` in fp32, rounded once to the output dtype;
* dX ``dz = dh @ W``: the weight's row scale runs along the reduction, so it is folded into
  ``dh``'s columns first (``g = dh · (SCB / 127)[None, :]`` in fp32), ``g`` is quantized per row,
  ``acc = q_g @ CB`` (the same codes, read along their other axis: no second copy of ``W``), and
  ``dz = acc · s_g[:, None]``.

Per-row quantization (:func:`quantize_rows`), exactly as the Triton kernels of
:mod:`quant_kernels.int8_mma` do it, in fp32: ``amax = max |a_row|``, ``s = amax / 127`` and
``inv = 127 / amax`` (IEEE divisions; ``inv = 0`` for an all-zero row), ``q = round(a · inv)``
half to even (``nearest``) or ``floor(a · inv + u)``, ``u ~ U[0, 1)`` (``stochastic``:
``E[q] = a · inv``, unbiased), clamped to ``±127``. A row holding a NaN or an infinity gets a
non-finite scale, so its output row is non-finite too (the codes themselves are zeroed there).

Rounding of ``dh``: round-to-nearest is the default. Its error is at most half a step per element
(stochastic rounding: up to a whole step, twice the variance), and per-token absmax quantization
of the dX GEMM with round-to-nearest is what the int8-training work we know of uses
(SwitchBack-style linear layers); stochastic rounding is here so that the quality study can
measure whether the bias matters (``KernelPolicy.int8_dx_rounding``). ``docs/KERNELS.md`` says
which was measured.

:func:`int8_mma_error_bound` gives the worst-case deviation from the exact product of the stored
weight (derivation in its docstring); the tests hold both this module and the Triton kernels to it
against a float64 dense product.
"""

from __future__ import annotations

import torch

from quant_kernels.reference import int8_row_scale

__all__ = [
    "MAX_REDUCTION",
    "int8_mma_error_bound",
    "int8_mma_matmul",
    "int8_mma_matmul_t",
    "int_matmul",
    "quantize_rows",
]

#: the longest reduction whose int32 accumulator cannot overflow: ``K · 128² < 2³¹``
MAX_REDUCTION = (2**31 - 1) // (128 * 128)


def _rows2d(a: torch.Tensor, width: int, name: str) -> torch.Tensor:
    if not a.is_floating_point():
        raise ValueError(f"{name} must be floating point, got {a.dtype}")
    if a.dim() < 1 or a.shape[-1] != width:
        raise ValueError(f"{name} has shape {tuple(a.shape)}; its last dim must be {width}")
    return a.reshape(-1, width)


def _check_weight(cb: torch.Tensor, scb: torch.Tensor) -> None:
    if cb.dtype != torch.int8 or cb.dim() != 2:
        raise ValueError(f"CB must be a 2-D int8 tensor, got {tuple(cb.shape)} {cb.dtype}")
    if scb.shape != (cb.shape[0],):
        raise ValueError(f"SCB must have shape ({cb.shape[0]},), got {tuple(scb.shape)}")


def quantize_rows(
    a: torch.Tensor,
    *,
    col_scale: torch.Tensor | None = None,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row absmax int8 quantization of ``a`` (times ``col_scale`` along its columns).

    Args:
        a: ``[M, K]`` floating point (any strides; computed in fp32).
        col_scale: optional fp32 ``[K]``: quantize ``a · col_scale[None, :]`` (the dX GEMM folds
            the weight's ``SCB / 127`` in this way), the product formed in fp32.
        stochastic: ``floor(x + u)``, ``u ~ U[0, 1)`` (unbiased) instead of round-half-to-even.
        generator: RNG of the stochastic rounding (on ``a``'s device); default torch's global one.

    Returns:
        ``(q, s)``: ``q`` int8 ``[M, K]`` contiguous in ``[-127, 127]``, ``s`` fp32 ``[M]`` with
        ``a[m] · col_scale ≈ q[m] · s[m]`` (``s = max|row| / 127``; 0 for an all-zero row, NaN or
        inf for a row holding a non-finite value, whose codes are 0).

    Raises:
        ValueError: ``a`` is not 2-D floating point, or ``col_scale`` is not ``[K]``.
    """
    if a.dim() != 2 or not a.is_floating_point():
        raise ValueError(f"expected a 2-D float tensor, got {tuple(a.shape)} {a.dtype}")
    x = a.float()
    if col_scale is not None:
        if col_scale.shape != (a.shape[1],):
            raise ValueError(f"col_scale must have shape ({a.shape[1]},), got {col_scale.shape}")
        x = x * col_scale.float()[None, :]
    amax = x.abs().amax(dim=1) if x.shape[1] else x.new_zeros(x.shape[0])
    # a NaN anywhere in the row makes the scale NaN (amax propagates it; said explicitly here
    # because the kernels' max reduction does not)
    amax = torch.where(torch.isnan(x).any(dim=1), torch.full_like(amax, float("nan")), amax)
    s = amax / torch.full_like(amax, 127.0)
    ok = torch.isfinite(amax) & (amax > 0)
    inv = torch.where(ok, torch.full_like(amax, 127.0) / torch.where(ok, amax, 1.0), 0.0)
    scaled = x * inv[:, None]
    scaled = torch.where(torch.isnan(scaled), 0.0, scaled)  # inf · 0 in a non-finite row
    if stochastic:
        dev = generator.device if generator is not None else scaled.device
        noise = torch.rand(scaled.shape, generator=generator, device=dev).to(scaled.device)
        q = torch.floor(scaled + noise)
    else:
        q = torch.round(scaled)
    return q.clamp_(-127, 127).to(torch.int8), s


def int_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Exact ``a @ b`` of int8 matrices with int32 accumulation.

    ``torch._int_mm`` where it serves (every shape on the CPU; on CUDA ``M > 16`` and ``K``,
    ``N`` multiples of 8), else a float64 matmul, which is exact here: every partial sum is an
    integer below ``128² · K ≤ 2³¹ < 2⁵³``.

    Args:
        a: int8 ``[M, K]``; b: int8 ``[K, N]`` (any strides, e.g. ``CB.t()``).

    Returns:
        int32 ``[M, N]``.

    Raises:
        ValueError: not int8 2-D operands, mismatched inner dims, or ``K >``
            :data:`MAX_REDUCTION` (int32 could overflow).
    """
    if a.dtype != torch.int8 or b.dtype != torch.int8 or a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"expected 2-D int8 operands, got {a.dtype} {b.dtype}")
    m, k = a.shape
    if b.shape[0] != k:
        raise ValueError(f"inner dims differ: {tuple(a.shape)} @ {tuple(b.shape)}")
    if k > MAX_REDUCTION:
        raise ValueError(f"reduction of {k} > {MAX_REDUCTION} could overflow int32")
    n = b.shape[1]
    if m == 0 or n == 0 or k == 0:
        return torch.zeros(m, n, dtype=torch.int32, device=a.device)
    if a.device.type == "cpu":
        return torch._int_mm(a.contiguous(), b)
    if m > 16 and k % 8 == 0 and n % 8 == 0:
        try:  # cuBLASLt's int8 GEMM; a layout it refuses falls back to the exact float64 product
            return torch._int_mm(a.contiguous(), b)
        except RuntimeError:
            pass
    return (a.double() @ b.double()).to(torch.int32)


def int8_mma_matmul(
    x: torch.Tensor, cb: torch.Tensor, scb: torch.Tensor, *, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``x @ Wᵀ`` (``W = CB · SCB / 127``) with ``x`` quantized per token row: the forward GEMM.

    Args:
        x: ``[..., K]`` floating point.
        cb: int8 ``[N, K]``; scb: fp32 ``[N]`` (bitsandbytes ``CB`` / ``SCB``).
        out_dtype: default ``x.dtype``.

    Returns:
        ``[..., N]``: ``(q_x @ CBᵀ) · s_x[:, None] · (SCB / 127)[None, :]``, the product formed in
        fp32 (the int32 accumulator converted first) and rounded once to ``out_dtype``.

    Raises:
        ValueError: mismatched shapes or dtypes.
    """
    _check_weight(cb, scb)
    n, k = cb.shape
    x2 = _rows2d(x, k, "x")
    q, s = quantize_rows(x2)
    acc = int_matmul(q, cb.t())
    out = acc.float() * s[:, None] * int8_row_scale(scb)[None, :]
    return out.to(out_dtype or x.dtype).view(*x.shape[:-1], n)


def int8_mma_matmul_t(
    g: torch.Tensor,
    cb: torch.Tensor,
    scb: torch.Tensor,
    *,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``g @ W`` (``W = CB · SCB / 127``) with ``g · SCB / 127`` quantized per row: the dX GEMM.

    Args:
        g: ``[..., N]`` floating point (the output gradient).
        cb: int8 ``[N, K]``; scb: fp32 ``[N]``.
        stochastic, generator: rounding of the folded gradient (:func:`quantize_rows`).
        out_dtype: default ``g.dtype``.

    Returns:
        ``[..., K]``: ``(q_g @ CB) · s_g[:, None]`` in fp32, rounded once to ``out_dtype``.

    Raises:
        ValueError: mismatched shapes or dtypes.
    """
    _check_weight(cb, scb)
    n, k = cb.shape
    g2 = _rows2d(g, n, "g")
    q, s = quantize_rows(
        g2, col_scale=int8_row_scale(scb), stochastic=stochastic, generator=generator
    )
    out = int_matmul(q, cb).float() * s[:, None]
    return out.to(out_dtype or g.dtype).view(*g.shape[:-1], k)


def int8_mma_error_bound(
    a: torch.Tensor,
    cb: torch.Tensor,
    scb: torch.Tensor,
    *,
    weight_t: bool = False,
    stochastic: bool = False,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Worst-case ``|int8 path − exact|`` per output element, against the exact product of the
    *stored* weight ``W = CB · SCB / 127`` (float64), for :func:`int8_mma_matmul` (``a = x``) or
    with ``weight_t`` :func:`int8_mma_matmul_t` (``a = g``).

    Derivation (forward; ``W`` rows ``w_n``): the path computes ``Σ_k q[m,k] · s[m] · W[n,k]``
    exactly in integers, so its only activation error is ``x − q·s``, at most ``s[m]/2`` per
    element with round-to-nearest (``s[m]`` with stochastic rounding, and then unbiased), hence
    ``|Δh[m,n]| ≤ (s[m]/2) · Σ_k |W[n,k]|``. The fp32 epilogue adds at most three roundings
    (int32 → fp32 and two products) and ``SCB / 127`` its own fp32 one: ``≤ 5u₃₂ · |ĥ|`` with
    ``u₃₂ = 2⁻²⁴``; the output cast adds ``u_out · |ĥ|``; ``|ĥ| ≤ Σ_k |q·s| · |W|``. dX is the
    same with ``g' = g · SCB/127`` (its fp32 product adds ``u₃₂ · |g'|``, carried through
    ``|CB|``) quantized and ``CB`` as the weight: ``|Δdz[m,k]| ≤ (s[m]/2) · Σ_n |CB[n,k]| + …``.

    The bound is a worst case; the typical error is a sum of ``K`` independent rounding errors,
    ``≈ s/√12 · ‖w_n‖₂`` (round-to-nearest), a fraction of it that shrinks like ``1/√K``.

    Args:
        a: ``[M, K]`` (forward) or ``[M, N]`` (``weight_t``) floating point.
        cb, scb: the stored weight.
        weight_t: the dX GEMM's bound.
        stochastic: the bound of stochastic rounding (a whole step per element).
        out_dtype: the output's dtype (its rounding is part of the bound).

    Returns:
        float64 ``[M, N]`` (or ``[M, K]``).

    Raises:
        ValueError: mismatched shapes.
    """
    _check_weight(cb, scb)
    n, k = cb.shape
    a2 = _rows2d(a, n if weight_t else k, "a")
    ws = int8_row_scale(scb)
    if weight_t:
        q, s = quantize_rows(a2, col_scale=ws)
        mat = cb.double().abs()  # [N, K]: the reduction runs over N
        folded = a2.double().abs() * ws.double()[None, :]
        fold_err = torch.finfo(torch.float32).eps / 2 * (folded @ mat)
    else:
        q, s = quantize_rows(a2)
        mat = (cb.double() * ws.double()[:, None]).abs().t()  # [K, N]
        fold_err = torch.zeros((), dtype=torch.float64)
    step = s.double()[:, None] * (1.0 if stochastic else 0.5)
    quant = step * mat.sum(dim=0)[None, :]
    mag = (q.double().abs() * s.double()[:, None] + step) @ mat
    u32 = torch.finfo(torch.float32).eps / 2
    u_out = torch.finfo(out_dtype).eps / 2
    return quant + fold_err + (5 * u32 + u_out) * mag
