"""The kernel entry points the POET-X(Q) layer calls, each dispatching by a :class:`KernelPolicy`.

Every function takes the caller's policy as ``kernels`` (default :data:`~quant_kernels.policy.AUTO`,
the measured default) and picks the path it names for the tensors at hand; CPU tensors (outside
the Triton interpreter) and ``triton=False`` take the plain-torch references of
:mod:`quant_kernels.reference` / :mod:`quant_kernels.reference_4bit`, which are also the test
oracles. Which path runs when, and the H200 timings behind each choice: ``docs/KERNELS.md``.
Triton modules are imported on first use, so this module imports only torch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from quant_kernels import reference, reference_4bit
from quant_kernels.policy import AUTO, KernelPolicy, _rows, slab_bytes_for

__all__ = [
    "blockwise_4bit_backward_fm",
    "blockwise_4bit_matmul",
    "blockwise_4bit_matmul_fm",
    "blockwise_4bit_matmul_t",
    "blockwise_4bit_matmul_t_fm",
    "int8_rowwise_backward_fm",
    "int8_rowwise_matmul",
    "int8_rowwise_matmul_fm",
    "int8_rowwise_matmul_t",
    "int8_rowwise_matmul_t_fm",
    "permute_last",
    "permute_to_feature_major",
    "permute_to_row_major",
]


# ----------------------------------------------------------------------------------------------
# int8 row-wise weights (bitsandbytes Int8Params layout): W = CB · SCB/127, CB int8 [N, K]
# ----------------------------------------------------------------------------------------------


def int8_rowwise_matmul(
    x: torch.Tensor, cb: torch.Tensor, scb: torch.Tensor, *, kernels: KernelPolicy = AUTO
) -> torch.Tensor:
    """``x @ Wᵀ`` with ``W = CB · SCB/127`` (``x [..., K]``, ``CB`` int8 ``[N, K]``) → ``[..., N]``:
    slab-streamed, fused or the reference as ``kernels.weight_gemm_path`` says."""
    path = kernels.weight_gemm_path(x)
    if path == "streamed":
        from quant_kernels.streamed import int8_decoder, streamed_matmul_nt

        return streamed_matmul_nt(
            x, int8_decoder(cb, scb), *cb.shape, slab_bytes=slab_bytes_for(_rows(x))
        )
    if path == "fused":
        from quant_kernels.dequant_matmul import int8_matmul

        return int8_matmul(x, cb, scb)
    return reference.int8_rowwise_matmul(x, cb, scb)


def int8_rowwise_matmul_t(
    g: torch.Tensor, cb: torch.Tensor, scb: torch.Tensor, *, kernels: KernelPolicy = AUTO
) -> torch.Tensor:
    """``g @ W`` with ``W = CB · SCB/127`` (``g [..., N]``) → ``[..., K]`` (the dX GEMM)."""
    path = kernels.weight_gemm_path(g)
    if path == "streamed":
        from quant_kernels.streamed import int8_decoder, streamed_matmul_nn

        return streamed_matmul_nn(
            g, int8_decoder(cb, scb), *cb.shape, slab_bytes=slab_bytes_for(_rows(g))
        )
    if path == "fused":
        from quant_kernels.dequant_matmul import int8_matmul_t

        return int8_matmul_t(g, cb, scb)
    return reference.int8_rowwise_matmul_t(g, cb, scb)


def int8_rowwise_matmul_fm(
    zt: torch.Tensor, cb: torch.Tensor, scb: torch.Tensor, *, kernels: KernelPolicy = AUTO
) -> torch.Tensor:
    """``W @ zt`` = ``(z @ Wᵀ)ᵀ`` for a feature-major activation ``zt [K, T]`` → ``[N, T]``
    contiguous: the forward GEMM of a layer that keeps its activations feature-major
    (``docs/KERNELS.md``, Layer layout). Streamed, or the row-major kernel and a transpose,
    or the reference."""
    path = kernels.weight_gemm_path(zt.t())
    if path == "streamed":
        from quant_kernels.streamed import int8_decoder, streamed_matmul_fm

        return streamed_matmul_fm(
            zt, int8_decoder(cb, scb), *cb.shape, slab_bytes=slab_bytes_for(zt.shape[1])
        )
    if path == "fused":
        return int8_rowwise_matmul(zt.t(), cb, scb, kernels=kernels).t().contiguous()
    return reference.dequant_int8_rowwise(cb, scb, zt.dtype) @ zt


def int8_rowwise_matmul_t_fm(
    dht: torch.Tensor, cb: torch.Tensor, scb: torch.Tensor, *, kernels: KernelPolicy = AUTO
) -> torch.Tensor:
    """``Wᵀ @ dht`` = ``(dh @ W)ᵀ`` for ``dht [N, T]`` → ``[K, T]`` contiguous: the dX GEMM,
    feature-major (see :func:`int8_rowwise_matmul_fm`)."""
    path = kernels.weight_gemm_path(dht.t())
    if path == "streamed":
        from quant_kernels.streamed import int8_decoder, streamed_matmul_t_fm

        return streamed_matmul_t_fm(
            dht, int8_decoder(cb, scb), *cb.shape, slab_bytes=slab_bytes_for(dht.shape[1])
        )
    if path == "fused":
        return int8_rowwise_matmul_t(dht.t(), cb, scb, kernels=kernels).t().contiguous()
    return reference.dequant_int8_rowwise(cb, scb, dht.dtype).t() @ dht


def int8_rowwise_backward_fm(
    zt: torch.Tensor,
    dht: torch.Tensor,
    cb: torch.Tensor,
    scb: torch.Tensor,
    row_align: int,
    on_rows: Callable[[int, torch.Tensor], None],
    *,
    kernels: KernelPolicy = AUTO,
) -> torch.Tensor:
    """The two weight GEMMs of a feature-major ``mem`` backward with ``W = CB · SCB/127``
    (``CB [N, K]``): the recompute ``W @ zt`` (``zt [K, T]``), handed to ``on_rows(row0, rows)``
    in bands of whole ``row_align``-row groups (possibly one band of all ``N`` rows), and the
    returned dX GEMM ``Wᵀ @ dht`` (``dht [N, T]``) → ``[K, T]`` contiguous.

    On the slab-streamed path with ``kernels.one_decode_backward``, one decode of each slab
    serves both (:func:`quant_kernels.streamed.streamed_backward_fm`); otherwise
    :func:`int8_rowwise_matmul_fm` then :func:`int8_rowwise_matmul_t_fm`.
    """
    if kernels.one_decode_backward and kernels.weight_gemm_path(zt.t()) == "streamed":
        from quant_kernels.streamed import int8_decoder, streamed_backward_fm

        return streamed_backward_fm(
            zt, dht, int8_decoder(cb, scb), *cb.shape, row_align=row_align, on_rows=on_rows,
            slab_bytes=slab_bytes_for(zt.shape[1]),
        )  # fmt: skip
    on_rows(0, int8_rowwise_matmul_fm(zt, cb, scb, kernels=kernels))
    return int8_rowwise_matmul_t_fm(dht, cb, scb, kernels=kernels)


# ----------------------------------------------------------------------------------------------
# 4-bit NF4 / FP4 blockwise weights (bitsandbytes Params4bit layout), W [N, K]
# ----------------------------------------------------------------------------------------------

#: ``(packed, absmax, quant_type, blocksize, (N, K))`` of a 4-bit weight, ``absmax`` fp32
FourBitArgs = tuple[torch.Tensor, torch.Tensor, str, int, tuple[int, int]]


def _fourbit_decoder(args: FourBitArgs, device: torch.device) -> Callable[..., torch.Tensor]:
    """The slab decoder of a bitsandbytes NF4/FP4 weight ``[N, K]``."""
    from quant_kernels.streamed import fourbit_decoder

    packed, absmax, quant_type, blocksize, shape = args
    code = reference_4bit.get_4bit_code(quant_type, device)
    return fourbit_decoder(packed, absmax, code, blocksize, shape[1])


def blockwise_4bit_matmul(
    x: torch.Tensor,
    packed: torch.Tensor,
    absmax: torch.Tensor,
    quant_type: str,
    blocksize: int,
    shape: tuple[int, int],
    *,
    kernels: KernelPolicy = AUTO,
) -> torch.Tensor:
    """``x @ Wᵀ`` for a bitsandbytes NF4/FP4 blockwise weight ``W [N, K]`` → ``[..., N]``
    (``absmax`` fp32: double-quantized statistics dequantized first); slab-streamed on a GPU."""
    args = (packed, absmax, quant_type, blocksize, shape)
    if kernels.weight_gemm_path(x, bits=4) == "streamed":
        from quant_kernels.streamed import streamed_matmul_nt

        dec = _fourbit_decoder(args, x.device)
        return streamed_matmul_nt(x, dec, *shape, slab_bytes=slab_bytes_for(_rows(x)))
    return reference_4bit.blockwise_4bit_matmul(x, *args)


def blockwise_4bit_matmul_t(
    g: torch.Tensor,
    packed: torch.Tensor,
    absmax: torch.Tensor,
    quant_type: str,
    blocksize: int,
    shape: tuple[int, int],
    *,
    kernels: KernelPolicy = AUTO,
) -> torch.Tensor:
    """``g @ W`` for a bitsandbytes NF4/FP4 weight ``W [N, K]`` (``g [..., N]``) → ``[..., K]``."""
    args = (packed, absmax, quant_type, blocksize, shape)
    if kernels.weight_gemm_path(g, bits=4) == "streamed":
        from quant_kernels.streamed import streamed_matmul_nn

        dec = _fourbit_decoder(args, g.device)
        return streamed_matmul_nn(g, dec, *shape, slab_bytes=slab_bytes_for(_rows(g)))
    return reference_4bit.blockwise_4bit_matmul_t(g, *args)


def _blockwise_4bit_fm(
    a: torch.Tensor, weight_t: bool, args: FourBitArgs, kernels: KernelPolicy
) -> torch.Tensor:
    """``W @ a`` (``a [K, T]``) or, with ``weight_t``, ``Wᵀ @ a`` (``a [N, T]``) for the 4-bit
    weight ``args``, feature-major out."""
    shape = args[4]
    if kernels.weight_gemm_path(a.t(), bits=4) == "streamed":
        from quant_kernels import streamed

        run = streamed.streamed_matmul_t_fm if weight_t else streamed.streamed_matmul_fm
        dec = _fourbit_decoder(args, a.device)
        return run(a, dec, *shape, slab_bytes=slab_bytes_for(a.shape[1]))
    row_major = blockwise_4bit_matmul_t if weight_t else blockwise_4bit_matmul
    return row_major(a.t(), *args, kernels=kernels).t().contiguous()


def blockwise_4bit_matmul_fm(
    zt: torch.Tensor,
    packed: torch.Tensor,
    absmax: torch.Tensor,
    quant_type: str,
    blocksize: int,
    shape: tuple[int, int],
    *,
    kernels: KernelPolicy = AUTO,
) -> torch.Tensor:
    """``W @ zt`` for a feature-major ``zt [K, T]`` and an NF4/FP4 weight ``W [N, K]`` →
    ``[N, T]`` contiguous (:func:`int8_rowwise_matmul_fm`'s 4-bit twin). Streamed on a GPU;
    elsewhere :func:`blockwise_4bit_matmul` and a transpose copy."""
    return _blockwise_4bit_fm(zt, False, (packed, absmax, quant_type, blocksize, shape), kernels)


def blockwise_4bit_matmul_t_fm(
    dht: torch.Tensor,
    packed: torch.Tensor,
    absmax: torch.Tensor,
    quant_type: str,
    blocksize: int,
    shape: tuple[int, int],
    *,
    kernels: KernelPolicy = AUTO,
) -> torch.Tensor:
    """``Wᵀ @ dht`` for ``dht [N, T]`` → ``[K, T]`` contiguous: the 4-bit dX GEMM,
    feature-major (see :func:`blockwise_4bit_matmul_fm`)."""
    return _blockwise_4bit_fm(dht, True, (packed, absmax, quant_type, blocksize, shape), kernels)


def blockwise_4bit_backward_fm(
    zt: torch.Tensor,
    dht: torch.Tensor,
    packed: torch.Tensor,
    absmax: torch.Tensor,
    quant_type: str,
    blocksize: int,
    shape: tuple[int, int],
    row_align: int,
    on_rows: Callable[[int, torch.Tensor], None],
    *,
    kernels: KernelPolicy = AUTO,
) -> torch.Tensor:
    """:func:`int8_rowwise_backward_fm` for an NF4/FP4 weight ``W [N, K]``: the recompute
    ``W @ zt`` handed to ``on_rows`` in bands of whole ``row_align``-row groups, and the
    returned dX GEMM ``Wᵀ @ dht`` → ``[K, T]``; one decode of each slab for both on the streamed
    path with ``kernels.one_decode_backward``."""
    args = (packed, absmax, quant_type, blocksize, shape)
    if kernels.one_decode_backward and kernels.weight_gemm_path(zt.t(), bits=4) == "streamed":
        from quant_kernels.streamed import streamed_backward_fm

        return streamed_backward_fm(
            zt, dht, _fourbit_decoder(args, zt.device), *shape, row_align=row_align,
            on_rows=on_rows, slab_bytes=slab_bytes_for(zt.shape[1]),
        )  # fmt: skip
    on_rows(0, blockwise_4bit_matmul_fm(zt, *args, kernels=kernels))
    return blockwise_4bit_matmul_t_fm(dht, *args, kernels=kernels)


# ----------------------------------------------------------------------------------------------
# permutations
# ----------------------------------------------------------------------------------------------


def permute_last(
    x: torch.Tensor, perm: torch.Tensor, inv_perm: torch.Tensor | None = None
) -> torch.Tensor:
    """``x[..., perm]`` for ``x [..., d]`` and a permutation ``perm [d]`` (int64, ``x``'s device):
    :func:`quant_kernels.reference.permute_last` (torch ``index_select``, whose backward gathers
    by ``inv_perm``). Differentiable w.r.t. ``x``.
    """
    return reference.permute_last(x, perm, inv_perm)


def permute_to_feature_major(
    x: torch.Tensor, inv_perm: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """:func:`quant_kernels.transpose_perm.permute_to_feature_major` (Triton, imported on first
    use): the layers call it only on their feature-major path."""
    from quant_kernels import transpose_perm

    return transpose_perm.permute_to_feature_major(x, inv_perm, out_dtype=out_dtype)


def permute_to_row_major(
    xt: torch.Tensor, perm: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """:func:`quant_kernels.transpose_perm.permute_to_row_major` (Triton, imported on first
    use)."""
    from quant_kernels import transpose_perm

    return transpose_perm.permute_to_row_major(xt, perm, out_dtype=out_dtype)
