"""``train.precision`` resolved for a device: how a run holds its parameters and computes.

* ``autocast``: fp32 parameters (and fp32 optimizer arithmetic), bf16 compute under
  ``torch.autocast`` (accelerate's ``mixed_precision="bf16"``). ``train.precision: auto`` on a
  GPU, or ``bf16``.
* ``bf16-true``: every floating-point *parameter* in bf16 and no autocast (the name Lightning
  uses for the same thing). Buffers keep their dtype, so the quantization formats do too
  (int8 ``SCB`` and 4-bit ``absmax`` stay fp32, as bitsandbytes stores them). This is the
  setting of the official POET-X(Q) code and of ``evals/gpu_memory.py``: at Llama-13B with
  checkpointing it saves 1.54 GiB of ``Q``/embedding parameters and the fp32 layer inputs
  (``estimate-memory`` books both). Caveat: an update smaller than half a bf16 step of its
  parameter is lost (1/256 of the value: a norm weight near 1.0 ignores steps below 0.004);
  POET's ``Q`` start from 0 at every merge, so they are the least exposed.
* ``fp32``: everything fp32 (``auto`` on the CPU).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn

RunPrecision = Literal["autocast", "bf16-true", "fp32"]


def run_precision(train: Any, device: torch.device | str) -> RunPrecision:
    """``train.precision`` (``auto`` / ``bf16`` or ``autocast`` / ``bf16-true`` / ``fp32``) as
    the run uses it on ``device``: ``auto`` is ``autocast`` on CUDA and ``fp32`` elsewhere,
    ``bf16`` (or its other name ``autocast``) is ``autocast`` everywhere (CPU autocast too)."""
    setting = train.precision
    if setting == "auto":
        return "autocast" if torch.device(device).type == "cuda" else "fp32"
    return {"bf16": "autocast", "autocast": "autocast", "bf16-true": "bf16-true",
            "fp32": "fp32"}[setting]  # fmt: skip


def native_bf16() -> bool | None:
    """Whether this CPU computes bf16 natively (the ``avx512_bf16`` or ``amx_bf16`` flag of
    ``/proc/cpuinfo``); None where that cannot be told (not Linux, no such file)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            flags = set(f.read().split())
    except OSError:
        return None
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def cpu_note(train: Any, device: torch.device | str) -> str | None:
    """The warning line for a run in bf16 (autocast or ``bf16-true``) on a CPU, where bf16
    arithmetic is slower than fp32: about 2x where the CPU computes bf16 natively (measured on
    an AVX512-BF16 Xeon: 1.9x for ``bf16-true``, 2.5x for autocast, tiny recipe) and far more
    (~40x reported) where it does not; None elsewhere."""
    if torch.device(device).type == "cuda" or run_precision(train, device) == "fp32":
        return None
    native = native_bf16()
    this = {True: "; this CPU does", False: "; this CPU does not", None: ""}[native]
    return (
        f"warning: train.precision {train.precision} on the CPU runs slower than fp32: about 2x "
        f"on a CPU that computes bf16 natively (AVX512-BF16, AMX) and up to ~40x on one that "
        f"does not{this}; it is meant for the GPU: for a CPU run set train.precision auto "
        "(fp32 there) or fp32"
    )


def cast_parameters(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> int:
    """Give every floating-point parameter of ``model`` the dtype ``dtype``, in place
    (``p.data``: the ``Parameter`` objects stay; tied parameters are cast once).

    Buffers are left alone (quantization scales, permutations, rotary tables). Call it before
    the optimizer is built (its states take the parameters' dtype).

    Returns:
        int: the number of parameters cast.
    """
    from poetxq.model.surgery import cast_floating

    return cast_floating(model.parameters(), dtype)
