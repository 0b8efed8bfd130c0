"""Which kernel serves each call: one immutable :class:`KernelPolicy`.

A POET-X(Q) layer is given its policy once, when it is built (``POETXLinear(kernels=...)``,
``poetxq.model.surgery.convert_to_poetx(kernels=...)``), and hands that same object to every kernel
call of its forward and, through the autograd context, of its backward; the memory
estimator (``poetxq.training.estimate``) and the flat 8-bit optimizer read the same object.
Nothing is switched at run time: a benchmark that compares two paths builds (or re-points) a
layer with another policy.

The default, :class:`KernelPolicy()`, is the fastest path measured on the H200 for every choice
(``docs/KERNELS.md`` gives the numbers and result files). The environment variable
``POETXQ_KERNELS`` (``auto``, ``fused``, ``streamed`` or ``torch``) is read in one place,
:func:`default_policy`, by whatever builds a layer, an estimate or an optimizer without an
explicit policy. Every path needs a CUDA tensor and Triton (``interpret_on_cpu`` lets the tests
run the Triton kernels on CPU tensors under ``TRITON_INTERPRET=1``); elsewhere the plain-torch
references of :mod:`quant_kernels.reference` serve, as they do under ``triton=False``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "AUTO",
    "ENV_VAR",
    "HAS_TRITON",
    "INT8_DX_ROUNDINGS",
    "INT8_MMA_AUTO",
    "INT8_MMA_MIN_M",
    "KERNEL_MODES",
    "STREAMED_MIN_M",
    "TRITON_DTYPES",
    "W0_GEMMS",
    "WEIGHT_GEMMS",
    "KernelPolicy",
    "default_policy",
    "slab_bytes_for",
]

HAS_TRITON = importlib.util.find_spec("triton") is not None

#: the environment variable :func:`default_policy` reads
ENV_VAR = "POETXQ_KERNELS"
#: the values ``POETXQ_KERNELS`` may take (unset: ``auto``)
KERNEL_MODES = ("auto", "fused", "streamed", "torch")
#: the values of :attr:`KernelPolicy.weight_gemm`
WEIGHT_GEMMS = ("auto", "fused", "streamed", "torch")
#: the values of :attr:`KernelPolicy.w0_gemm` (the recipe's ``poet.gemm``)
W0_GEMMS = ("auto", "bf16", "int8")
#: the values of :attr:`KernelPolicy.int8_dx_rounding`
INT8_DX_ROUNDINGS = ("nearest", "stochastic")
#: whether ``w0_gemm="auto"`` takes the int8 tensor cores at all. Off: the int8 path changes the
#: numerics (the activations are quantized) and neither its GPU speed nor its training quality
#: has been measured yet (``docs/KERNELS.md``); ``evals/bench_int8_gemm.py`` and the quality
#: study's A/B decide whether this turns on
INT8_MMA_AUTO = False
#: token rows from which ``auto`` would take the int8 tensor cores (under :data:`INT8_MMA_AUTO`;
#: not yet tuned: below it the activation quantization is a larger share of the GEMM)
INT8_MMA_MIN_M = 512
#: activation dtypes the Triton kernels take
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: token rows from which an int8 weight GEMM takes the slab-streamed path under ``auto``
STREAMED_MIN_M = 512


def slab_bytes_for(rows: int) -> int:
    """Decoded-slab size for a streamed weight GEMM with ``rows`` token rows (bytes).

    Measured on the H200 at the 8B/13B MLP shapes: 64 MiB slabs win at 2,048 tokens (int8 forward
    1.33–1.40× vs 1.42–1.55× with 32 MiB), 32 and 64 MiB tie at 8,192 tokens; 32 MiB is taken
    there to keep the transient smaller. Both stay below the 112–135 MiB bf16 weight.
    """
    return (64 if rows <= 4096 else 32) * 2**20


def _rows(t: torch.Tensor) -> int:
    return t.numel() // max(t.shape[-1], 1)


@dataclass(frozen=True)
class KernelPolicy:
    """The kernel choices of one layer (and of the estimate or optimizer that describes it).

    Each field names one choice; ``True`` (and ``weight_gemm="auto"``) is the measured default
    on CUDA. ``docs/KERNELS.md`` says what each path is and what it was measured against.

    Attributes:
        triton: use Triton kernels at all (``False``: the plain-torch references everywhere,
            ``POETXQ_KERNELS=torch``).
        weight_gemm: the int8 weight GEMMs: ``auto`` (slab-streamed from
            :data:`STREAMED_MIN_M` token rows, the fused dequant-matmul below), ``fused``,
            ``streamed`` or ``torch`` (dequantize the whole weight, then ``matmul``). 4-bit
            weights are always streamed (their only Triton path) unless ``torch``.
        fused_cnp: the fused Cayley–Neumann kernels (``k = 3``) for fp32/bf16/fp16 ``Q``.
        feature_major: ``mem`` layers run feature-major between their two permutations.
        fast_feature_major: so does the ``fast`` variant's training forward.
        one_decode_backward: a streamed feature-major ``mem`` backward decodes each slab once
            for both of its weight GEMMs.
        fused_input_cast: a feature-major layer casts a wider input inside its first
            permutation (and returns ``dx`` in the input's dtype).
        lean_fast_swiglu: a ``fast`` feature-major down projection under SwiGLU keeps only
            ``gate``, ``up`` and its GEMM output.
        triton_8bit_update: the flat 8-bit AdamW step runs
            :func:`quant_kernels.adam8bit.adam8bit_update` instead of bitsandbytes' CUDA op.
        interpret_on_cpu: let the Triton paths serve CPU tensors too (only under
            ``TRITON_INTERPRET=1``: the tests).
        w0_gemm: the GEMMs against an int8 ``W0`` (the recipe's ``poet.gemm``): ``bf16``
            (dequantize ``W0`` to the activation's dtype: the :attr:`weight_gemm` paths),
            ``int8`` (quantize the activation per token and multiply int8 by int8:
            :mod:`quant_kernels.int8_mma` on a GPU, :mod:`quant_kernels.reference_int8_mma`
            on the CPU), or ``auto`` (``bf16`` for now: :data:`INT8_MMA_AUTO`). 4-bit and
            unquantized weights always take their dequant path.
        int8_dx_rounding: how the int8 path rounds the dX GEMM's ``dh``: ``nearest`` or
            ``stochastic`` (unbiased; torch's global RNG seeds it).

    Raises:
        ValueError: a choice (``weight_gemm``, ``w0_gemm``, ``int8_dx_rounding``) takes a value
            not in its list, or a switch is not a bool.
    """

    triton: bool = True
    weight_gemm: str = "auto"
    fused_cnp: bool = True
    feature_major: bool = True
    fast_feature_major: bool = True
    one_decode_backward: bool = True
    fused_input_cast: bool = True
    lean_fast_swiglu: bool = True
    triton_8bit_update: bool = True
    interpret_on_cpu: bool = False
    w0_gemm: str = "auto"
    int8_dx_rounding: str = "nearest"

    def __post_init__(self) -> None:
        for name, allowed in _CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r}; use one of {', '.join(allowed)}")
        for f in dataclasses.fields(self):
            if f.name not in _CHOICES and type(getattr(self, f.name)) is not bool:
                raise ValueError(f"{f.name} must be True or False, got {getattr(self, f.name)!r}")

    # -- construction -----------------------------------------------------------------------

    @classmethod
    def from_mode(cls, mode: str) -> KernelPolicy:
        """The policy of a ``POETXQ_KERNELS`` mode: ``auto`` (the default), ``fused`` (int8
        weight GEMMs always fused), ``streamed`` (always slab-streamed) or ``torch`` (no Triton).

        Raises:
            ValueError: an unknown mode (the message names the allowed ones).
        """
        if mode not in KERNEL_MODES:
            raise ValueError(
                f"{ENV_VAR}={mode!r}; use one of {', '.join(KERNEL_MODES)} (or unset it for auto)"
            )
        if mode == "torch":
            return cls(triton=False)
        return cls(weight_gemm=mode)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> KernelPolicy:
        """:meth:`from_mode` of ``POETXQ_KERNELS`` in ``environ`` (default ``os.environ``;
        unset: ``auto``).

        Raises:
            ValueError: as :meth:`from_mode`.
        """
        env = os.environ if environ is None else environ
        return cls.from_mode(env.get(ENV_VAR, "auto"))

    def with_overrides(self, specs: list[str]) -> KernelPolicy:
        """This policy with ``NAME=VALUE`` settings applied (a benchmark's A/B switch):
        ``NAME`` a field, ``VALUE`` ``0``/``1`` for a switch or one of a choice's values
        (:data:`WEIGHT_GEMMS`, :data:`W0_GEMMS`, :data:`INT8_DX_ROUNDINGS`).

        Raises:
            ValueError: a spec is not ``NAME=VALUE``, names no field, or has a bad value (the
                message lists the fields).
        """
        names = [f.name for f in dataclasses.fields(self)]
        changes: dict[str, Any] = {}
        for spec in specs:
            name, eq, value = spec.partition("=")
            ok = eq and name in names
            if ok:
                ok = value in _CHOICES.get(name, ("0", "1"))
            if not ok:
                choices = ", ".join(f"{n}={'|'.join(v)}" for n, v in _CHOICES.items())
                raise ValueError(
                    f"kernel setting {spec!r}: use NAME=0 or NAME=1 with NAME one of "
                    f"{', '.join(n for n in names if n not in _CHOICES)}, or {choices}"
                )
            changes[name] = value if name in _CHOICES else value == "1"
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Every field by name (what a benchmark records beside its numbers)."""
        return dataclasses.asdict(self)

    # -- per-call decisions -----------------------------------------------------------------

    def uses_triton(self, t: torch.Tensor) -> bool:
        """Whether Triton kernels may serve ``t``: :attr:`triton`, Triton installed, and a CUDA
        tensor (or :attr:`interpret_on_cpu`)."""
        return self.triton and HAS_TRITON and (t.is_cuda or self.interpret_on_cpu)

    def weight_gemm_path(self, act: torch.Tensor, *, bits: int = 8) -> str:
        """``"torch"``, ``"fused"`` or ``"streamed"``: the path of a weight GEMM whose
        activation operand is ``act`` (``bits`` of the stored weight: 8 or 4)."""
        if not self.uses_triton(act) or self.weight_gemm == "torch":
            return "torch"
        if bits == 4 or self.weight_gemm == "streamed":
            return "streamed"  # the only Triton path of a 4-bit weight
        if self.weight_gemm == "fused":
            return "fused"
        return "streamed" if _rows(act) >= STREAMED_MIN_M else "fused"

    def int8_mma_path(self, act: torch.Tensor) -> str | None:
        """How an int8 ``W0``'s GEMM with the activation ``act`` multiplies: ``None`` (the
        dequant paths of :meth:`weight_gemm_path`), ``"triton"`` (the int8 tensor-core kernels)
        or ``"torch"`` (their plain-torch reference: the CPU, or no Triton).

        ``int8`` always takes the int8 path (Triton where :meth:`uses_triton` and the dtype
        allow, else the reference); ``auto`` takes the kernels only under
        :data:`INT8_MMA_AUTO`, on a CUDA card of compute capability ≥ 8.0 (int8 ``tl.dot``)
        from :data:`INT8_MMA_MIN_M` token rows; ``bf16`` never."""
        if self.w0_gemm == "bf16":
            return None
        triton_ok = self.uses_triton(act) and act.dtype in TRITON_DTYPES
        if self.w0_gemm == "int8":
            return "triton" if triton_ok else "torch"
        auto = INT8_MMA_AUTO and triton_ok and act.is_cuda and _rows(act) >= INT8_MMA_MIN_M
        return "triton" if auto and _int8_tensor_cores(act) else None

    def fused_cnp_for(self, packed: torch.Tensor, terms: int) -> bool:
        """Whether the fused CNP serves packed ``Q`` (already in its compute dtype): ``k = 3``,
        a Triton dtype, :attr:`fused_cnp` and :meth:`uses_triton`."""
        return (
            self.fused_cnp
            and terms == 3
            and packed.dtype in TRITON_DTYPES
            and self.uses_triton(packed)
        )

    def feature_major_for(
        self, x: torch.Tensor, *, fast: bool = False, dtype: torch.dtype | None = None
    ) -> bool:
        """Whether a layer may run feature-major for the input ``x`` (the ``mem`` variant, or
        with ``fast`` the ``fast`` variant's training forward) once it is in ``dtype`` (default
        ``x.dtype``); the layer also needs non-ragged sides."""
        on = self.fast_feature_major if fast else self.feature_major
        return on and (dtype or x.dtype) in TRITON_DTYPES and self.uses_triton(x)

    def fused_input_cast_for(self, x: torch.Tensor, compute_dtype: torch.dtype) -> bool:
        """Whether a feature-major layer takes ``x`` uncast: ``x`` is not yet in
        ``compute_dtype``, both are Triton dtypes, and :attr:`fused_input_cast`."""
        return (
            self.fused_input_cast
            and x.dtype != compute_dtype
            and x.dtype in TRITON_DTYPES
            and compute_dtype in TRITON_DTYPES
            and self.uses_triton(x)
        )

    def lean_fast_swiglu_for(self, x: torch.Tensor) -> bool:
        """Whether a ``fast`` down projection takes the lean SwiGLU path for its input ``x``
        (the layer also needs its feature-major path)."""
        return self.lean_fast_swiglu and x.dtype in TRITON_DTYPES and self.uses_triton(x)

    def triton_8bit_update_for(self, t: torch.Tensor) -> bool:
        """Whether the flat 8-bit AdamW update of ``t`` runs the Triton kernel."""
        return self.triton_8bit_update and self.uses_triton(t)

    # -- what a GPU run takes (the estimator, which has no tensors) --------------------------

    def on_gpu(self, switch: str) -> bool:
        """Whether a GPU run with this policy takes the opt-in path ``switch`` (a field name):
        the switch and :attr:`triton`."""
        return self.triton and bool(getattr(self, switch))


#: the string-valued fields and their allowed values (every other field is a bool switch)
_CHOICES = {
    "weight_gemm": WEIGHT_GEMMS,
    "w0_gemm": W0_GEMMS,
    "int8_dx_rounding": INT8_DX_ROUNDINGS,
}


def _int8_tensor_cores(act: torch.Tensor) -> bool:
    """Whether ``act``'s CUDA device runs int8 ``tl.dot`` on tensor cores (sm80 and newer)."""
    return torch.cuda.get_device_capability(act.device) >= (8, 0)


#: the measured default on CUDA (what the kernel entry points use when given no policy)
AUTO = KernelPolicy()


def default_policy() -> KernelPolicy:
    """The policy of a layer, estimate or optimizer built without one:
    :meth:`KernelPolicy.from_env` (``POETXQ_KERNELS``, unset: :data:`AUTO`).

    Raises:
        ValueError: ``POETXQ_KERNELS`` holds an unknown mode (the message names the allowed
            ones; ``poetxq`` checks it at startup).
    """
    return KernelPolicy.from_env()
