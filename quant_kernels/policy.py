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
    "KERNEL_MODES",
    "STREAMED_MIN_M",
    "TRITON_DTYPES",
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

    Raises:
        ValueError: ``weight_gemm`` is not one of :data:`WEIGHT_GEMMS`, or a switch is not a
            bool.
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

    def __post_init__(self) -> None:
        if self.weight_gemm not in WEIGHT_GEMMS:
            raise ValueError(
                f"weight_gemm={self.weight_gemm!r}; use one of {', '.join(WEIGHT_GEMMS)}"
            )
        for f in dataclasses.fields(self):
            if f.name != "weight_gemm" and type(getattr(self, f.name)) is not bool:
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
        ``NAME`` a field, ``VALUE`` ``0``/``1`` for a switch or a :data:`WEIGHT_GEMMS` value.

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
                ok = value in (WEIGHT_GEMMS if name == "weight_gemm" else ("0", "1"))
            if not ok:
                raise ValueError(
                    f"kernel setting {spec!r}: use NAME=0 or NAME=1 with NAME one of "
                    f"{', '.join(n for n in names if n != 'weight_gemm')}, or weight_gemm="
                    f"{'|'.join(WEIGHT_GEMMS)}"
                )
            changes[name] = value if name == "weight_gemm" else value == "1"
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
