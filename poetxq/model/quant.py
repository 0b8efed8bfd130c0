"""Frozen-weight stores for POET-X(Q) layers: where ``W'`` lives and how GEMMs reach it.

A POET-X layer never trains its stored weight ``W'`` (= ``Ψ_m · W0 · Ψ_nᵀ``); it only needs
GEMMs against it — ``z @ W'ᵀ`` (forward) and ``g @ W'`` (the dX GEMM of backward), row- or
feature-major — plus a full dequantize/re-store at each merge. Each store below holds one
format's buffers and hands its GEMMs to that format's :class:`quant_kernels.WeightFormat`
(:meth:`FrozenWeight.gemms`), so the layer is agnostic to the storage format.

* :class:`Int8RowwiseWeight` — bitsandbytes ``Int8Params`` / ``Linear8bitLt`` row-wise layout
  (LLM.int8(), arXiv 2208.07339): buffers ``weight`` (= ``CB``, int8 ``[m, n]``), ``SCB``
  (fp32 ``[m]``, row absmax) and ``weight_format`` (uint8 scalar, 0 = row-major), the same
  state-dict keys bitsandbytes uses. No floating-point copy is kept; GEMMs dequantize on the fly.
* :class:`Blockwise4bitWeight` — bitsandbytes ``Params4bit`` / ``Linear4bit`` NF4/FP4 blockwise
  layout (QLoRA, arXiv 2305.14314): packed uint8 ``weight`` ``[m·n/2, 1]`` plus ``absmax``,
  ``quant_map`` and (double quant) ``nested_absmax`` / ``nested_quant_map``; its state dict uses
  bitsandbytes' keys (``weight``, ``weight.absmax``, ..., ``weight.quant_state.bitsandbytes__nf4``).
* :class:`DenseWeight` — unquantized ``W'`` (bf16/fp32/fp64), i.e. plain POET-X.
"""

from __future__ import annotations

import abc
from typing import Any

import torch
from torch import nn

import quant_kernels
from quant_kernels import reference_4bit as q4
from quant_kernels.reference_double_quant import double_dequantize_absmax

INT8_ROW_FORMAT = 0  # bitsandbytes ``weight_format`` code for row-major int8

SUPPORTED_BITS = (4, 8, 16)
QUANT_TYPES_4BIT = q4.QUANT_TYPES_4BIT  # ("nf4", "fp4")


class FrozenWeight(nn.Module, abc.ABC):
    """Interface of a frozen ``[m, n]`` weight store (``m`` = out features, ``n`` = in features):
    the buffers of one bitsandbytes-compatible format, their (re-)quantization and state dict.
    Its GEMMs are the weight format's (:meth:`gemms`)."""

    out_features: int
    in_features: int

    @abc.abstractmethod
    def gemms(self) -> quant_kernels.WeightFormat:
        """The weight format over the current buffers (:mod:`quant_kernels.formats`), whose
        five GEMMs multiply by the stored weight; cheap, built per GEMM call so a
        ``load_state_dict`` or ``.to()`` of the store is always seen."""

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

    def gemms(self) -> quant_kernels.Int8Rowwise:
        return quant_kernels.Int8Rowwise(self.weight, self.SCB)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return quant_kernels.dequant_int8_rowwise(self.weight, self.SCB, dtype)

    @torch.no_grad()
    def store(self, weight: torch.Tensor, *, generator: torch.Generator | None = None) -> None:
        cb, scb = quant_kernels.quantize_int8_rowwise(
            weight, stochastic=self.stochastic, generator=generator
        )
        self.weight.copy_(cb)
        self.SCB.copy_(scb)


class Blockwise4bitWeight(FrozenWeight):
    """NF4/FP4 blockwise store in the bitsandbytes ``Params4bit`` layout.

    Buffers: ``weight`` uint8 ``[ceil(m·n/2), 1]`` (two codes per byte, first in the high nibble);
    ``absmax`` fp32 ``[nb]`` (``nb = ceil(m·n/blocksize)``) or, with double quant, uint8 ``[nb]``;
    ``quant_map`` fp32 ``[16]``; with double quant also ``nested_absmax`` fp32
    ``[ceil(nb/256)]``, ``nested_quant_map`` fp32 ``[256]`` and ``nested_offset`` (fp32 scalar).

    State-dict keys are bitsandbytes ``Linear4bit``'s: ``weight``, ``weight.absmax``,
    ``weight.quant_map``, [``weight.nested_absmax``, ``weight.nested_quant_map``] and
    ``weight.quant_state.bitsandbytes__<quant_type>`` (uint8 UTF-8 JSON: quant_type, blocksize,
    dtype, shape, and nested_blocksize / nested_dtype / nested_offset with double quant).
    Loading a state dict whose quant_state is missing, corrupt or describes another format fails
    with one clear message and leaves the store unchanged.

    Args:
        weight: float ``[m, n]``; quantized immediately, not kept.
        quant_type: ``"nf4"`` or ``"fp4"``.
        blocksize: elements per absmax block (bitsandbytes' 32..4096; default 64).
        double_quant: quantize ``absmax`` again (bitsandbytes ``compress_statistics``).
        stochastic: unbiased stochastic rounding when (re-)quantizing (nearest otherwise, which
            is byte-identical to ``bitsandbytes.functional.quantize_4bit``).

    Raises:
        ValueError: unknown ``quant_type``, bad ``blocksize`` or a non-2-D weight.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        *,
        quant_type: str = "nf4",
        blocksize: int = 64,
        double_quant: bool = True,
        stochastic: bool = False,
    ) -> None:
        super().__init__()
        if weight.dim() != 2:
            raise ValueError(f"expected a 2-D weight, got shape {tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        self.quant_type, self.blocksize = quant_type, blocksize
        self.double_quant, self.stochastic = double_quant, stochastic
        self.nested_blocksize = 256
        self.dtype = weight.dtype
        q = self._quantize(weight, generator=None, stochastic=False)
        self.register_buffer("weight", q.packed)
        self.register_buffer("absmax", q.absmax)
        self.register_buffer("quant_map", q.quant_map)
        if double_quant:
            assert q.nested_absmax is not None and q.nested_offset is not None
            self.register_buffer("nested_absmax", q.nested_absmax)
            self.register_buffer("nested_quant_map", q.nested_quant_map)
            # on the weight's device: read by every GEMM (a host scalar would be copied to the
            # device on each call, which CUDA-graph capture refuses)
            self.register_buffer(
                "nested_offset", torch.tensor(q.nested_offset, device=weight.device)
            )

    @property
    def quant_state_key(self) -> str:
        return f"quant_state.bitsandbytes__{self.quant_type}"

    def _quantize(
        self, weight: torch.Tensor, *, generator: torch.Generator | None, stochastic: bool
    ) -> q4.Quantized4bit:
        return q4.quantize_4bit(
            weight, self.quant_type, self.blocksize, compress_statistics=self.double_quant,
            nested_blocksize=self.nested_blocksize, stochastic=stochastic, generator=generator,
        )  # fmt: skip

    def dequantized_absmax(self) -> torch.Tensor:
        """fp32 ``[nb]`` block scales (double-dequantized with double quant)."""
        if not self.double_quant:
            return self.absmax.float()
        return double_dequantize_absmax(
            self.absmax, self.nested_absmax, self.nested_quant_map, self.nested_offset,
            self.nested_blocksize,
        )  # fmt: skip

    def gemms(self) -> quant_kernels.Blockwise4bit:
        return quant_kernels.Blockwise4bit(
            self.weight, self.dequantized_absmax(), self.quant_type, self.blocksize,
            (self.out_features, self.in_features),
        )  # fmt: skip

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return q4.dequantize_4bit_blockwise(
            self.weight, self.dequantized_absmax(), self.quant_type, self.blocksize,
            (self.out_features, self.in_features), dtype,
        )  # fmt: skip

    @torch.no_grad()
    def store(self, weight: torch.Tensor, *, generator: torch.Generator | None = None) -> None:
        q = self._quantize(weight, generator=generator, stochastic=self.stochastic)
        self.weight.copy_(q.packed)
        self.absmax.copy_(q.absmax)
        if self.double_quant:
            self.nested_absmax.copy_(q.nested_absmax)
            self.nested_offset.fill_(q.nested_offset)

    # -- bitsandbytes Linear4bit state-dict keys -------------------------------------------------

    def quant_state_dict(self) -> dict[str, Any]:
        """The JSON part of bitsandbytes' packed quant_state (``QuantState.as_dict``)."""
        meta: dict[str, Any] = {
            "quant_type": self.quant_type,
            "blocksize": self.blocksize,
            "dtype": str(self.dtype).removeprefix("torch."),
            "shape": [self.out_features, self.in_features],
        }
        if self.double_quant:
            meta.update(
                nested_blocksize=self.nested_blocksize,
                nested_dtype="float32",
                nested_offset=float(self.nested_offset.item()),
            )
        return meta

    def _tensor_keys(self) -> list[str]:
        keys = ["absmax", "quant_map"]
        return keys + (["nested_absmax", "nested_quant_map"] if self.double_quant else [])

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # type: ignore[override]
        def put(key: str, t: torch.Tensor) -> None:
            destination[prefix + key] = t if keep_vars else t.detach()

        put("weight", self.weight)
        for key in self._tensor_keys():
            put(f"weight.{key}", getattr(self, key))
        put(f"weight.{self.quant_state_key}", q4.quant_state_to_tensor(self.quant_state_dict()))

    def _load_from_state_dict(  # type: ignore[override]
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        expected = ["weight", *(f"weight.{k}" for k in self._tensor_keys())]
        qs_key = f"weight.{self.quant_state_key}"
        mine = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
        missing = [k for k in [*expected, qs_key] if k not in mine]
        if missing:
            other_qs = [k for k in mine if k.startswith("weight.quant_state.")]
            hint = f" (found {other_qs[0]!r}: a different quant_type)" if other_qs else ""
            missing_keys.extend(prefix + k for k in missing)
            error_msgs.append(
                f"{prefix}weight: 4-bit checkpoint entry incomplete, missing "
                f"{', '.join(missing)}{hint}"
            )
            return
        unexpected_keys.extend(prefix + k for k in mine if k not in (*expected, qs_key))
        try:
            meta = q4.quant_state_from_tensor(mine[qs_key])
        except ValueError as exc:
            error_msgs.append(f"{prefix}{qs_key}: corrupt quant_state: {exc}")
            return
        want = self.quant_state_dict()
        for field in ("quant_type", "blocksize", "shape", "nested_blocksize"):
            if meta.get(field) != want.get(field):
                error_msgs.append(
                    f"{prefix}{qs_key}: {field} is {meta.get(field)!r}, this layer needs "
                    f"{want.get(field)!r}"
                )
                return
        if self.double_quant and not isinstance(meta.get("nested_offset"), (int, float)):
            error_msgs.append(f"{prefix}{qs_key}: corrupt quant_state: no numeric nested_offset")
            return
        for key in expected:
            cur = self.weight if key == "weight" else getattr(self, key.split(".", 1)[1])
            new = mine[key]
            if new.shape != cur.shape or new.dtype != cur.dtype:
                error_msgs.append(
                    f"{prefix}{key}: got {new.dtype} {tuple(new.shape)}, expected "
                    f"{cur.dtype} {tuple(cur.shape)}"
                )
                return
        with torch.no_grad():
            for key in expected:
                cur = self.weight if key == "weight" else getattr(self, key.split(".", 1)[1])
                cur.copy_(mine[key])
            if self.double_quant:
                self.nested_offset.fill_(float(meta["nested_offset"]))

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, quant_type={self.quant_type}, blocksize={self.blocksize}, "
            f"double_quant={self.double_quant}"
        )


class DenseWeight(FrozenWeight):
    """Unquantized frozen store (plain POET-X): buffer ``weight`` ``[m, n]`` in its own dtype."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight.detach().clone())

    def gemms(self) -> quant_kernels.Dense:
        return quant_kernels.Dense(self.weight)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.weight.to(dtype, copy=True)

    @torch.no_grad()
    def store(self, weight: torch.Tensor, *, generator: torch.Generator | None = None) -> None:
        self.weight.copy_(weight)


def make_frozen_weight(
    weight: torch.Tensor,
    bits: int,
    *,
    stochastic: bool = False,
    quant_type: str = "nf4",
    blocksize: int = 64,
    double_quant: bool = True,
) -> FrozenWeight:
    """Build the frozen store for ``bits``.

    4 → NF4/FP4 blockwise (``quant_type``, ``blocksize``, ``double_quant``; bitsandbytes
    ``Params4bit`` layout), 8 → int8 row-wise, 16 → dense in ``weight.dtype``.

    Raises:
        ValueError: for unsupported ``bits`` or an unknown 4-bit ``quant_type``.
    """
    if bits == 4:
        if quant_type not in QUANT_TYPES_4BIT:
            raise ValueError(
                f"unknown quant_type {quant_type!r} for bits=4; choose one of {QUANT_TYPES_4BIT}"
            )
        return Blockwise4bitWeight(
            weight, quant_type=quant_type, blocksize=blocksize, double_quant=double_quant,
            stochastic=stochastic,
        )  # fmt: skip
    if bits == 8:
        return Int8RowwiseWeight(weight, stochastic=stochastic)
    if bits == 16:
        return DenseWeight(weight)
    raise ValueError(f"unsupported bits={bits}; choose one of {SUPPORTED_BITS}")
