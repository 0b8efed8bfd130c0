"""Where a training step's GPU time goes: torch.profiler tables plus a breakdown by kind of work.

The breakdown sorts every device kernel the profiler saw into one category by its name (the
project's Triton kernels by function name, torch.compile's fused kernels by their ``triton_``
prefix, cuBLAS by its ``gemm`` / ``nvjet`` names, ...). cuBLAS kernels do not say whether a
``mm`` or a ``bmm`` launched them, so that split is read from the operator rows instead: the
self device time of ``aten::mm`` / ``aten::addmm`` (weight GEMMs) against ``aten::bmm`` /
``aten::baddbmm`` (block-diagonal multiplies and the Cayley–Neumann products).

    poetxq bench --recipe llama-1b:poetxq --steps 5 --profile prof_1b.txt
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

import torch

#: (category, regular expression on the kernel name); the first match wins
KERNEL_CATEGORIES: tuple[tuple[str, str], ...] = (
    (
        "cayley-neumann (triton)",
        r"_skew_pairs|_q2_aux|_sym_pairs|_fold_pairs|_cnp_|_skew_(fwd|bwd)",
    ),
    ("weight decode (triton)", r"_int8_slab|_4bit_slab|_4bit_pair_slab"),
    ("fused dequant-matmul (triton)", r"_int8_mm_|_4bit_mm_"),
    ("permute / block-diag (triton)", r"_to_feature_major|_to_row_major|_permute_last|_bd_perm"),
    ("compiled elementwise (torch.compile)", r"^triton_"),
    ("attention", r"flash|fmha|attention|sdpa|cudnn"),
    # torch's foreach kernels serve the optimizer and clip_grad_norm_ alike: one category
    ("optimizer and gradient clipping", r"multi_tensor|[Aa]dam|kOptimizer|optimizer|[Oo]ptim"),
    ("cuBLAS GEMM", r"gemm|nvjet|xmma|cutlass|sm90_|sm80_|cublas"),
    ("memcpy / memset", r"[Mm]emcpy|[Mm]emset"),
    (
        "aten elementwise / copy / reduce",
        r"elementwise|vectorized|unrolled|reduce|[Cc]at[A-Z_]|index|gather|scatter|copy|fill"
        r"|softmax|norm|where|arange|distribution",
    ),
)
#: device rows that are ranges, not kernels: record_function annotations the profiler also puts
#: on the GPU timeline (the optimizer's step spans its own kernels; counting it would count twice)
ANNOTATION = r"^(Optimizer\.\w+#|ProfilerStep#)"
#: operator rows whose self device time is cuBLAS work launched for a dense or batched GEMM
GEMM_OPS = {"aten::mm": "mm", "aten::addmm": "mm", "aten::bmm": "bmm", "aten::baddbmm": "bmm"}


def kernel_category(name: str) -> str:
    """The :data:`KERNEL_CATEGORIES` entry of a device kernel's name, ``"other"`` if none."""
    for category, pattern in KERNEL_CATEGORIES:
        if re.search(pattern, name):
            return category
    return "other"


def _is_device_row(row: Any) -> bool:
    device_type = getattr(row, "device_type", None)
    return device_type is not None and device_type != torch.autograd.DeviceType.CPU


def gpu_time_breakdown(rows: Iterable[Any], steps: int = 1) -> dict[str, float]:
    """Device time per step by category, in milliseconds.

    Args:
        rows: ``prof.key_averages()`` (or any rows with ``key`` (the name), ``device_type``
            and ``self_device_time_total`` in microseconds). Device rows (kernels, memcpy) are
            categorized by :func:`kernel_category`; of the CPU operator rows only the GEMM
            operators of :data:`GEMM_OPS` are read, for the ``"of which ..."`` split.
        steps: steps the profile covered; every figure is divided by it.

    Returns:
        ``{category: ms per step}`` sorted by time (largest first), then ``"total"`` (the sum
        of the device rows) and ``"of which mm (weight GEMMs)"`` / ``"of which bmm (block
        multiplies, CNP products)"`` where those operators ran. An operator's time also counts
        the helper kernels it launches (a split-K reduction, a memset), so the ``mm`` figure can
        exceed ``"cuBLAS GEMM"`` by a fraction of a millisecond.

    Raises:
        ValueError: ``steps < 1``.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    by_cat: dict[str, float] = {}
    split = {"mm": 0.0, "bmm": 0.0}
    for row in rows:
        us = float(getattr(row, "self_device_time_total", 0.0) or 0.0)
        if us <= 0:
            continue
        if _is_device_row(row):
            if re.match(ANNOTATION, row.key):
                continue
            cat = kernel_category(row.key)
            by_cat[cat] = by_cat.get(cat, 0.0) + us
        elif row.key in GEMM_OPS:
            split[GEMM_OPS[row.key]] += us
    out = {k: v / steps / 1e3 for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])}
    out["total"] = sum(by_cat.values()) / steps / 1e3
    if split["mm"]:
        out["of which mm (weight GEMMs)"] = split["mm"] / steps / 1e3
    if split["bmm"]:
        out["of which bmm (block multiplies, CNP products)"] = split["bmm"] / steps / 1e3
    return out


def format_breakdown(breakdown: dict[str, float]) -> str:
    """The breakdown as an aligned text table (ms per step and share of the total)."""
    total = breakdown.get("total") or 0.0
    width = max((len(k) for k in breakdown), default=8)
    lines = [f"{'GPU time per step':<{width}}  {'ms':>9}  {'share':>6}"]
    for key, ms in breakdown.items():
        share = f"{ms / total:6.1%}" if total and key != "total" else ""
        lines.append(f"{key:<{width}}  {ms:9.2f}  {share:>6}")
    return "\n".join(lines)


def profile_steps(
    step: Callable[[], None], device: torch.device, steps: int = 2, row_limit: int = 40
) -> tuple[str, dict[str, float]]:
    """Run ``step`` ``steps`` times under torch.profiler (CPU, and CUDA on a GPU).

    Returns:
        ``(text, breakdown)``: the breakdown table (:func:`gpu_time_breakdown`; empty on the
        CPU), then the top ``row_limit`` operators by self device time (GPU) and by self CPU
        time; ``breakdown`` is in ms per step.

    Raises:
        ValueError: ``steps < 1``.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    acts = [torch.profiler.ProfilerActivity.CPU]
    cuda = device.type == "cuda"
    if cuda:
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize(device)
    ka = prof.key_averages()
    parts = []
    breakdown: dict[str, float] = {}
    if cuda:
        breakdown = gpu_time_breakdown(ka, steps)
        parts += [format_breakdown(breakdown), ka.table(sort_by="self_device_time_total",
                                                        row_limit=row_limit)]  # fmt: skip
    parts.append(ka.table(sort_by="self_cpu_time_total", row_limit=row_limit))
    return "\n\n".join(parts) + "\n", breakdown
