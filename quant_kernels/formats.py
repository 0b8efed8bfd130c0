"""Weight formats: one object per frozen-``W`` storage format, owning the GEMMs run against it.

A POET-X(Q) layer multiplies by its frozen weight ``W [N, K]`` in five ways: ``x @ Wᵀ`` (the
forward), ``g @ W`` (the dX GEMM), both again with the activations feature-major (``W @ zᵀ``,
``Wᵀ @ dhᵀ``), and the feature-major ``mem`` backward that runs the recompute and the dX GEMM
together. :class:`WeightFormat` writes those five once, choosing the path the caller's
:class:`~quant_kernels.policy.KernelPolicy` names for the activation at hand
(:meth:`~quant_kernels.policy.KernelPolicy.weight_gemm_path`):

* ``streamed``: :mod:`quant_kernels.streamed` decodes a band of ``W`` into a 16-bit slab and
  cuBLAS multiplies it; a format only says how to decode itself (:meth:`WeightFormat._decoder`);
* ``fused``: the int8 dequant-matmul kernels of :mod:`quant_kernels.dequant_matmul` (int8 only);
* ``torch``: the plain-torch references of :mod:`quant_kernels.reference` /
  :mod:`quant_kernels.reference_4bit`, which are the CPU path and the test oracle;
* ``mma`` / ``mma_torch`` (int8 only, when the policy's ``w0_gemm`` asks for it:
  :meth:`~quant_kernels.policy.KernelPolicy.int8_mma_path`): the activation is quantized per
  token and multiplied int8 by int8, by :mod:`quant_kernels.int8_mma` on the tensor cores or by
  its reference :mod:`quant_kernels.reference_int8_mma`.

A format object holds the stored tensors it was built from (no copy) and is cheap to build: a
store builds one per GEMM call, so a ``load_state_dict`` or ``.to()`` of the store is always
seen. Which path runs when, and the timings behind it: ``docs/KERNELS.md``.
"""

from __future__ import annotations

import abc
from collections.abc import Callable

import torch

from quant_kernels import reference, reference_4bit, reference_int8_mma
from quant_kernels.policy import AUTO, KernelPolicy, _rows, slab_bytes_for

__all__ = ["Blockwise4bit", "Dense", "Int8Rowwise", "WeightFormat"]

#: the paths of the int8 x int8 GEMMs (:meth:`WeightFormat._mma`)
_MMA = ("mma", "mma_torch")

#: a slab decoder of :mod:`quant_kernels.streamed`: ``(buf, row0, rows, col0, cols) -> slab``
Decoder = Callable[[torch.Tensor, int, int, int, int], torch.Tensor]


class WeightFormat(abc.ABC):
    """A frozen weight ``W [N, K]`` in one storage format and its five GEMMs.

    Subclasses give :attr:`bits`, :attr:`shape`, the plain-torch products
    (:meth:`_reference`, optionally :meth:`_reference_fm`), and where they have Triton paths
    the slab decoder (:meth:`_decoder`) and the fused kernels (:meth:`_fused`).
    """

    #: bits per stored weight (8, 4, or 16 for an unquantized one): the policy's path choice
    bits: int
    #: ``(N, K)``: out features, in features
    shape: tuple[int, int]

    # -- what a format provides ------------------------------------------------------------

    def _path(self, act: torch.Tensor, kernels: KernelPolicy) -> str:
        """``"torch"``, ``"fused"`` or ``"streamed"`` for a GEMM whose activation is ``act``
        (int8 weights also ``"mma"`` / ``"mma_torch"``)."""
        return kernels.weight_gemm_path(act, bits=self.bits)

    @abc.abstractmethod
    def _reference(self, a: torch.Tensor, *, weight_t: bool) -> torch.Tensor:
        """Plain torch ``a @ Wᵀ`` (``a [..., K]``), or with ``weight_t`` ``a @ W``
        (``a [..., N]``), in ``a.dtype``."""

    def _reference_fm(self, a: torch.Tensor, *, weight_t: bool) -> torch.Tensor:
        """Plain torch ``W @ a`` (``a [K, T]``), or with ``weight_t`` ``Wᵀ @ a``
        (``a [N, T]``), contiguous (default: the row-major product and a transpose copy)."""
        return self._reference(a.t(), weight_t=weight_t).t().contiguous()

    def _decoder(self, device: torch.device) -> Decoder:
        """The slab decoder of the streamed path (formats without one never take it)."""
        raise NotImplementedError(f"{type(self).__name__} has no slab-streamed path")

    def _fused(self, a: torch.Tensor, *, weight_t: bool) -> torch.Tensor:
        """The fused dequant-matmul of :meth:`_reference` (formats without one never take it)."""
        raise NotImplementedError(f"{type(self).__name__} has no fused dequant-matmul")

    def _mma(
        self, a: torch.Tensor, *, weight_t: bool, path: str, kernels: KernelPolicy,
        feature_major_out: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        """The int8 × int8 product of :meth:`_reference` (``path`` ``"mma"``: Triton,
        ``"mma_torch"``: the reference); with ``feature_major_out`` (``a`` 2-D) its transpose,
        contiguous. Formats without one never take it."""
        raise NotImplementedError(f"{type(self).__name__} has no int8 x int8 path")

    # -- the five GEMMs ----------------------------------------------------------------------

    def matmul(self, x: torch.Tensor, *, kernels: KernelPolicy = AUTO) -> torch.Tensor:
        """``x @ Wᵀ``: ``x [..., K]`` → ``[..., N]`` in ``x.dtype`` (the forward GEMM)."""
        path = self._path(x, kernels)
        if path == "streamed":
            from quant_kernels.streamed import streamed_matmul_nt

            dec = self._decoder(x.device)
            return streamed_matmul_nt(x, dec, *self.shape, slab_bytes=slab_bytes_for(_rows(x)))
        if path == "fused":
            return self._fused(x, weight_t=False)
        if path in _MMA:
            return self._mma(x, weight_t=False, path=path, kernels=kernels)
        return self._reference(x, weight_t=False)

    def matmul_t(self, g: torch.Tensor, *, kernels: KernelPolicy = AUTO) -> torch.Tensor:
        """``g @ W``: ``g [..., N]`` → ``[..., K]`` in ``g.dtype`` (the dX GEMM)."""
        path = self._path(g, kernels)
        if path == "streamed":
            from quant_kernels.streamed import streamed_matmul_nn

            dec = self._decoder(g.device)
            return streamed_matmul_nn(g, dec, *self.shape, slab_bytes=slab_bytes_for(_rows(g)))
        if path == "fused":
            return self._fused(g, weight_t=True)
        if path in _MMA:
            return self._mma(g, weight_t=True, path=path, kernels=kernels)
        return self._reference(g, weight_t=True)

    def matmul_fm(self, zt: torch.Tensor, *, kernels: KernelPolicy = AUTO) -> torch.Tensor:
        """``W @ zt`` = ``(z @ Wᵀ)ᵀ`` for a feature-major activation ``zt [K, T]`` →
        ``[N, T]`` contiguous, ``zt.dtype`` (the forward GEMM of a feature-major layer)."""
        path = self._path(zt.t(), kernels)
        if path == "streamed":
            from quant_kernels.streamed import streamed_matmul_fm

            dec = self._decoder(zt.device)
            return streamed_matmul_fm(zt, dec, *self.shape, slab_bytes=slab_bytes_for(zt.shape[1]))
        if path == "fused":
            return self._fused(zt.t(), weight_t=False).t().contiguous()
        if path in _MMA:
            mma = self._mma
            return mma(zt.t(), weight_t=False, path=path, kernels=kernels, feature_major_out=True)
        return self._reference_fm(zt, weight_t=False)

    def matmul_t_fm(self, dht: torch.Tensor, *, kernels: KernelPolicy = AUTO) -> torch.Tensor:
        """``Wᵀ @ dht`` = ``(dh @ W)ᵀ`` for ``dht [N, T]`` → ``[K, T]`` contiguous (the dX GEMM,
        feature-major)."""
        path = self._path(dht.t(), kernels)
        if path == "streamed":
            from quant_kernels.streamed import streamed_matmul_t_fm

            dec = self._decoder(dht.device)
            slab = slab_bytes_for(dht.shape[1])
            return streamed_matmul_t_fm(dht, dec, *self.shape, slab_bytes=slab)
        if path == "fused":
            return self._fused(dht.t(), weight_t=True).t().contiguous()
        if path in _MMA:
            mma = self._mma
            return mma(dht.t(), weight_t=True, path=path, kernels=kernels, feature_major_out=True)
        return self._reference_fm(dht, weight_t=True)

    def backward_fm(
        self,
        zt: torch.Tensor,
        dht: torch.Tensor,
        row_align: int,
        on_rows: Callable[[int, torch.Tensor], None],
        *,
        kernels: KernelPolicy = AUTO,
    ) -> torch.Tensor:
        """The two weight GEMMs of a feature-major ``mem`` backward: the recompute ``W @ zt``
        (``zt [K, T]``), handed to ``on_rows(row0, rows)`` in bands of whole ``row_align``-row
        groups (possibly one band of all ``N`` rows), and the returned dX GEMM ``Wᵀ @ dht``
        (``dht [N, T]``) → ``[K, T]`` contiguous.

        On the streamed path with ``kernels.one_decode_backward`` one decode of each slab
        serves both (:func:`quant_kernels.streamed.streamed_backward_fm`); otherwise
        :meth:`matmul_fm`, then :meth:`matmul_t_fm`.

        Raises:
            ValueError: (streamed) mismatched shapes or ``row_align < 1``.
        """
        if kernels.one_decode_backward and self._path(zt.t(), kernels) == "streamed":
            from quant_kernels.streamed import streamed_backward_fm

            return streamed_backward_fm(
                zt, dht, self._decoder(zt.device), *self.shape, row_align=row_align,
                on_rows=on_rows, slab_bytes=slab_bytes_for(zt.shape[1]),
            )  # fmt: skip
        on_rows(0, self.matmul_fm(zt, kernels=kernels))
        return self.matmul_t_fm(dht, kernels=kernels)


class Int8Rowwise(WeightFormat):
    """int8 row-wise absmax weights (bitsandbytes ``Int8Params`` layout):
    ``W = CB · SCB/127``.

    Args:
        cb: int8 ``[N, K]`` codes.
        scb: fp32 ``[N]`` row absmax.
    """

    bits = 8

    def __init__(self, cb: torch.Tensor, scb: torch.Tensor) -> None:
        self.cb, self.scb = cb, scb
        self.shape = (cb.shape[0], cb.shape[1])

    def _reference(self, a: torch.Tensor, *, weight_t: bool) -> torch.Tensor:
        if weight_t:
            return reference.int8_rowwise_matmul_t(a, self.cb, self.scb)
        return reference.int8_rowwise_matmul(a, self.cb, self.scb)

    def _reference_fm(self, a: torch.Tensor, *, weight_t: bool) -> torch.Tensor:
        w = reference.dequant_int8_rowwise(self.cb, self.scb, a.dtype)
        return (w.t() if weight_t else w) @ a

    def _path(self, act: torch.Tensor, kernels: KernelPolicy) -> str:
        mma = kernels.int8_mma_path(act)
        if mma is not None:
            return "mma" if mma == "triton" else "mma_torch"
        return kernels.weight_gemm_path(act, bits=self.bits)

    def _mma(
        self, a: torch.Tensor, *, weight_t: bool, path: str, kernels: KernelPolicy,
        feature_major_out: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        if path == "mma":
            from quant_kernels import int8_mma

            if weight_t:
                return int8_mma.int8_mma_matmul_t(
                    a, self.cb, self.scb, stochastic=kernels.int8_dx_rounding == "stochastic",
                    feature_major_out=feature_major_out,
                )  # fmt: skip
            return int8_mma.int8_mma_matmul(
                a, self.cb, self.scb, feature_major_out=feature_major_out
            )
        if weight_t:
            out = reference_int8_mma.int8_mma_matmul_t(
                a, self.cb, self.scb, stochastic=kernels.int8_dx_rounding == "stochastic"
            )
        else:
            out = reference_int8_mma.int8_mma_matmul(a, self.cb, self.scb)
        return out.t().contiguous() if feature_major_out else out

    def _decoder(self, device: torch.device) -> Decoder:
        from quant_kernels.streamed import int8_decoder

        return int8_decoder(self.cb, self.scb)

    def _fused(self, a: torch.Tensor, *, weight_t: bool) -> torch.Tensor:
        from quant_kernels import dequant_matmul

        run = dequant_matmul.int8_matmul_t if weight_t else dequant_matmul.int8_matmul
        return run(a, self.cb, self.scb)


class Blockwise4bit(WeightFormat):
    """NF4/FP4 blockwise weights (bitsandbytes ``Params4bit`` layout); the slab-streamed path
    is their only Triton one (``docs/KERNELS.md``).

    Args:
        packed: uint8 ``[ceil(N·K/2), 1]``, two codes per byte (first in the high nibble).
        absmax: fp32 ``[ceil(N·K/blocksize)]`` block scales (double quant already undone).
        quant_type: ``"nf4"`` or ``"fp4"``.
        blocksize: elements per absmax block.
        shape: ``(N, K)``.
    """

    bits = 4

    def __init__(
        self,
        packed: torch.Tensor,
        absmax: torch.Tensor,
        quant_type: str,
        blocksize: int,
        shape: tuple[int, int],
    ) -> None:
        self.packed, self.absmax = packed, absmax
        self.quant_type, self.blocksize, self.shape = quant_type, blocksize, shape

    def _args(self) -> tuple[torch.Tensor, torch.Tensor, str, int, tuple[int, int]]:
        return self.packed, self.absmax, self.quant_type, self.blocksize, self.shape

    def _reference(self, a: torch.Tensor, *, weight_t: bool) -> torch.Tensor:
        if weight_t:
            return reference_4bit.blockwise_4bit_matmul_t(a, *self._args())
        return reference_4bit.blockwise_4bit_matmul(a, *self._args())

    def _decoder(self, device: torch.device) -> Decoder:
        from quant_kernels.streamed import fourbit_decoder

        code = reference_4bit.get_4bit_code(self.quant_type, device)
        return fourbit_decoder(self.packed, self.absmax, code, self.blocksize, self.shape[1])


class Dense(WeightFormat):
    """An unquantized weight ``[N, K]`` (plain POET-X): plain torch products, cast to the
    activation's dtype, whatever the policy.

    Args:
        weight: ``[N, K]`` floating point.
    """

    bits = 16

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self.shape = (weight.shape[0], weight.shape[1])

    def _path(self, act: torch.Tensor, kernels: KernelPolicy) -> str:
        return "torch"

    def _reference(self, a: torch.Tensor, *, weight_t: bool) -> torch.Tensor:
        w = self.weight.to(a.dtype)
        return a @ w if weight_t else a @ w.t()

    def _reference_fm(self, a: torch.Tensor, *, weight_t: bool) -> torch.Tensor:
        w = self.weight.to(a.dtype)
        return (w.t() if weight_t else w) @ a
