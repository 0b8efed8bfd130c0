"""Which kernel family serves a call: the ``POETXQ_KERNELS`` switch and Triton's presence.

Kept apart from :mod:`quant_kernels` so that its submodules can ask without a circular import.
"""

from __future__ import annotations

import importlib.util
import os

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None

#: the values ``POETXQ_KERNELS`` may take (unset: ``auto``)
KERNEL_MODES = ("auto", "fused", "streamed", "torch")


def kernel_mode() -> str:
    """The ``POETXQ_KERNELS`` mode (``auto`` when unset); the CLI calls it at startup so a bad
    value is refused before any work.

    Raises:
        ValueError: ``POETXQ_KERNELS`` is not one of :data:`KERNEL_MODES` (the message names them).
    """
    mode = os.environ.get("POETXQ_KERNELS", "auto")
    if mode not in KERNEL_MODES:
        raise ValueError(
            f"POETXQ_KERNELS={mode!r}; use one of {', '.join(KERNEL_MODES)} (or unset it for auto)"
        )
    return mode


def triton_enabled(t: torch.Tensor) -> bool:
    """Whether Triton kernels may serve ``t``: a CUDA tensor, Triton installed, and
    ``POETXQ_KERNELS`` not ``torch``."""
    return t.is_cuda and HAS_TRITON and kernel_mode() != "torch"


def opt_in_kernel(t: torch.Tensor, measured_faster: bool) -> bool:
    """Whether an opt-in Triton kernel serves ``t``: :func:`triton_enabled` and either its
    ``*_MEASURED_FASTER`` flag (``measured_faster``) or ``POETXQ_KERNELS=fused``."""
    return triton_enabled(t) and (measured_faster or kernel_mode() == "fused")
