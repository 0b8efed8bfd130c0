"""Which kernel family serves a call: the ``POETXQ_KERNELS`` switch and Triton's presence.

Kept apart from :mod:`quant_kernels` so that its submodules can ask without a circular import.
"""

from __future__ import annotations

import importlib.util
import os

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None

#: values of ``POETXQ_KERNELS``
MODES = ("auto", "fused", "streamed", "torch")


def policy() -> str:
    """``POETXQ_KERNELS`` (default ``auto``).

    Raises:
        ValueError: it holds an unknown mode.
    """
    mode = os.environ.get("POETXQ_KERNELS", "auto")
    if mode not in MODES:
        raise ValueError(f"POETXQ_KERNELS={mode!r}; use one of {', '.join(MODES)}")
    return mode


def triton_enabled(t: torch.Tensor) -> bool:
    """Whether Triton kernels may serve ``t``: a CUDA tensor, Triton installed, and
    ``POETXQ_KERNELS`` not ``torch``."""
    return t.is_cuda and HAS_TRITON and policy() != "torch"
