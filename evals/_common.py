"""Helpers shared by the eval scripts (run as ``python evals/<script>.py``)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable


def git_commit() -> str:
    """``$POETXQ_COMMIT`` when set (GPU hosts get a copy of the tree whose .git may be stale or
    missing), else HEAD's hash, else ``unknown``."""
    if os.environ.get("POETXQ_COMMIT"):
        return os.environ["POETXQ_COMMIT"]
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cuda_time_ms(fn: Callable[[], object], warmup: int = 10, iters: int = 50) -> float:
    """Median CUDA-event time of ``fn()`` in milliseconds, after ``warmup`` calls."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]
