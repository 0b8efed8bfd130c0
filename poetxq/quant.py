"""Frozen-weight stores for POET-X(Q) layers: where ``W'`` lives and how GEMMs reach it.

A POET-X layer never trains its stored weight ``W'`` (= ``Ψ_m · W0 · Ψ_nᵀ``); it only needs two
GEMMs against it — ``z @ W'ᵀ`` (forward) and ``g @ W'`` (the dX GEMM of backward) — plus a full
dequantize/re-store at each merge. Each store below provides exactly that, so the layer is agnostic
to the storage format.

* :class:`Int8RowwiseWeight` — bitsandbytes ``Int8Params`` / ``Linear8bitLt`` row-wise layout
  (LLM.int8(), arXiv 2208.07339): buffers ``weight`` (= ``CB``, int8 ``[m, n]``), ``SCB``
  (fp32 ``[m]``, row absmax) and ``weight_format`` (uint8 scalar, 0 = row-major), the same
  state-dict keys bitsandbytes uses. No floating-point copy is kept; GEMMs dequantize on the fly.
* :class:`DenseWeight` — unquantized ``W'`` (bf16/fp32/fp64), i.e. plain POET-X.
"""

from __future__ import annotations

import abc

import torch
from torch import nn

import quant_kernels

INT8_ROW_FORMAT = 0  # bitsandbytes ``weight_format`` code for row-major int8

SUPPORTED_BITS = (8, 16)


class FrozenWeight(nn.Module, abc.ABC):
    """Interface of a frozen ``[m, n]`` weight store (``m`` = out features, ``n`` = in features)."""

    out_features: int
    in_features: int

    @abc.abstractmethod
    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ Wᵀ``: ``[..., n]`` → ``[..., m]`` in ``x.dtype``."""

    @abc.abstractmethod
    def matmul_t(self, g: torch.Tensor) -> torch.Tensor:
        """``g @ W``: ``[..., m]`` → ``[..., n]`` in ``g.dtype``."""

    @abc.abstractmethod
    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The stored weight as a dense ``[m, n]`` tensor in ``dtype`` (a new tensor)."""

    @abc.abstractmethod
    def store(self, weight: torch.Tensor, *, generator: torch.Generator | None = None) -> None:
        """Replace the stored weight with ``weight`` ``[m, n]`` (re-quantizing if low-bit)."""

    def nbytes(self) -> int:
        """Bytes held by the store (weights plus quantization statistics)."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        return f"out_features={self.out_features}, in_features={self.in_features}"


class Int8RowwiseWeight(FrozenWeight):
    """int8 row-wise absmax store in the bitsandbytes ``Int8Params`` layout.

    Buffers (state-dict keys as bitsandbytes ``Linear8bitLt``): ``weight`` int8 ``[m, n]`` (CB),
    ``SCB`` fp32 ``[m]``, ``weight_format`` uint8 scalar (0 = row). ``W ≈ CB · SCB / 127``.

    Args:
        weight: initial float weight ``[m, n]``; quantized immediately, not kept.
        stochastic: round stochastically when (re-)quantizing (unbiased), else to nearest.
    """

    def __init__(self, weight: torch.Tensor, *, stochastic: bool = False) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.stochastic = stochastic
        cb, scb = quant_kernels.quantize_int8_rowwise(weight)
        self.register_buffer("weight", cb)
        self.register_buffer("SCB", scb)
        self.register_buffer("weight_format", torch.tensor(INT8_ROW_FORMAT, dtype=torch.uint8))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return quant_kernels.int8_rowwise_matmul(x, self.weight, self.SCB)

    def matmul_t(self, g: torch.Tensor) -> torch.Tensor:
        return quant_kernels.int8_rowwise_matmul_t(g, self.weight, self.SCB)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return quant_kernels.dequant_int8_rowwise(self.weight, self.SCB, dtype)

    @torch.no_grad()
    def store(self, weight: torch.Tensor, *, generator: torch.Generator | None = None) -> None:
        cb, scb = quant_kernels.quantize_int8_rowwise(
            weight, stochastic=self.stochastic, generator=generator
        )
        self.weight.copy_(cb)
        self.SCB.copy_(scb)


class DenseWeight(FrozenWeight):
    """Unquantized frozen store (plain POET-X): buffer ``weight`` ``[m, n]`` in its own dtype."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight.detach().clone())

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.to(x.dtype).t()

    def matmul_t(self, g: torch.Tensor) -> torch.Tensor:
        return g @ self.weight.to(g.dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.weight.to(dtype, copy=True)

    @torch.no_grad()
    def store(self, weight: torch.Tensor, *, generator: torch.Generator | None = None) -> None:
        self.weight.copy_(weight)


def make_frozen_weight(
    weight: torch.Tensor, bits: int, *, stochastic: bool = False
) -> FrozenWeight:
    """Build the frozen store for ``bits`` (8 → int8 row-wise, 16 → dense in ``weight.dtype``).

    Raises:
        ValueError: for unsupported ``bits``.
    """
    if bits == 8:
        return Int8RowwiseWeight(weight, stochastic=stochastic)
    if bits == 16:
        return DenseWeight(weight)
    raise ValueError(f"unsupported bits={bits}; choose one of {SUPPORTED_BITS}")
