"""The host a test runs as: its child processes' environment, and a CPU-only view of a GPU host.

Most tests state what a run does on a CPU (CI's machine: fp32, no peak GPU memory, bit-exact
resume). On a GPU host `poetxq train` and the other commands take the GPU, so those tests pin
themselves to the CPU with :func:`cpu_host` (in-process) or ``CUDA_VISIBLE_DEVICES=""`` (child
processes); the GPU's own behaviour has its own tests.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment with the repository first on ``PYTHONPATH`` (the paths already
    there kept after it: a GPU host's carried wheels live on it), ``OMP_NUM_THREADS=1`` and
    ``extra`` on top."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **extra}


@contextlib.contextmanager
def cpu_host() -> Iterator[None]:
    """Within it ``torch.cuda.is_available()`` is False, so the trainer, export and FPO choose the
    CPU as on a host without a GPU (a no-op on one).

    accelerate keeps one ``PartialState`` per process, and its device is the one the first run
    found (the GPU, after a GPU test in the same worker); the trainer's ``Accelerator(cpu=True)``
    would then still hand out ``cuda``. The state is dropped on the way in and out, so the runs
    inside see the CPU and the GPU tests after them see the GPU again."""
    from accelerate.state import AcceleratorState

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: False)
        AcceleratorState._reset_state(reset_partial_state=True)
        _forget_device_checks()
        try:
            yield
        finally:
            AcceleratorState._reset_state(reset_partial_state=True)
            _forget_device_checks()


def _forget_device_checks() -> None:
    """Drop torch's cached "can Triton run on a device here" answer (``has_triton``, cached for
    the process): asked inside :func:`cpu_host` it is False, and every later ``torch.compile``
    of CUDA code in the same worker would stop with ``TritonMissing``."""
    from torch.utils import _triton

    _triton.has_triton.cache_clear()
