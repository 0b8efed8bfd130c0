"""Helpers shared by the eval scripts (run as ``python evals/<script>.py``)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from quant_kernels.policy import KernelPolicy


def git_commit() -> str:
    """``$POETXQ_COMMIT`` when set (GPU hosts get a copy of the tree whose .git may be stale or
    missing), else a snapshot's ``.commit``, else HEAD's hash, else ``unknown``
    (:func:`poetxq.tools.bench.git_commit`)."""
    from poetxq.tools.bench import git_commit as commit

    return commit() or "unknown"


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


def cuda_graph_ms(fn: Callable[[], object], iters: int = 50) -> float:
    """GPU time of ``fn()`` without host launch gaps, in milliseconds: ``fn`` is warmed up on a
    side stream, captured once as a CUDA graph, and the replay timed (median CUDA-event time).
    Times a kernel shorter than its host launch (e.g. a Triton launch, ~20–40 µs of Python)
    as the GPU runs it inside a graph or behind longer kernels."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    ms = cuda_time_ms(graph.replay, iters=iters)
    del graph
    return ms


def cuda_peak_extra_mib(fn: Callable[[], object], *, minus_result: bool = False) -> float:
    """MiB that one ``fn()`` call allocates on the GPU above what was allocated before it (its
    transients and its result; ``minus_result``: the returned tensor's bytes are not counted)."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    if minus_result and isinstance(out, torch.Tensor):
        extra -= out.numel() * out.element_size()
    del out
    return extra / 2**20


def provenance(device_name: str, argv: list[str] | None = None) -> dict[str, Any]:
    """The header every results JSON starts with: date (UTC), GPU or ``cpu``, torch, commit and
    the command line that produced it."""
    import torch

    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "gpu": device_name,
        "torch": torch.__version__,
        "commit": git_commit(),
        "command": "python " + " ".join([sys.argv[0], *(argv or sys.argv[1:])]),
    }


def write_json_atomic(path: str | Path, doc: dict[str, Any]) -> Path:
    """Write ``doc`` as indented JSON to ``path`` atomically
    (:func:`poetxq.tools.bench.write_json`)."""
    from poetxq.tools.bench import write_json

    write_json(doc, Path(path))
    return Path(path)


def kernel_policy(specs: list[str]) -> KernelPolicy:
    """The measured default :class:`~quant_kernels.policy.KernelPolicy` with ``NAME=0|1``
    overrides (``--kernel-flag``, repeatable: an A/B run of one path); the benchmark passes it to
    what it builds and records ``to_dict()`` beside its numbers.

    Raises:
        ValueError: a spec is not ``NAME=VALUE`` or names no policy field (the message lists
            them).
    """
    from quant_kernels.policy import AUTO

    return AUTO.with_overrides(specs)
