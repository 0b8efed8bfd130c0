"""Reading and selecting the committed results files (``evals/results/*.json``) for the pages.

Where the results live (:data:`RESULTS`), which file of a stem is the current one
(:func:`current`), reading one (:func:`load`, ``None`` when it is absent), the provenance line
printed under each table (:func:`provenance`), and the peak-memory and setting cells that the
throughput, memory and side-by-side tables share (:func:`peak_cell`, :func:`setting_cells`).
The section builders (``results_training``, ``results_memory``, ``results_side_by_side``,
``readme_table``) read every file through this module; ``evals/render_results.py`` puts the
page together.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import headline

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "evals" / "results"


def current(stem: str, machine: str = "h200") -> str:
    """The current results file of a stem that ``evals/headline.py`` writes
    (``<stem>_<machine>_<commit>.json``; its ``--adopt`` keeps one per stem in ``RESULTS``), or a
    name no file has when there is none (the sections that read it are then left out)."""
    return headline.current(stem, RESULTS, machine) or f"{stem}_{machine}_none.json"


def load(name: str) -> dict[str, Any] | None:
    """The parsed results file ``name`` of ``RESULTS``, or ``None`` when there is no such file."""
    path = RESULTS / name
    return json.loads(path.read_text()) if path.is_file() else None


def provenance(name: str, d: dict[str, Any]) -> str:
    """The ``Source: ...`` line under a table: the file ``name`` (parsed: ``d``), its GPU, date
    and commit (of each call, for a file of several)."""
    gpus = d.get("gpus")
    gpu = d.get("gpu") or (f"{len(gpus)}× {gpus[0]}" if gpus else d.get("device", "?"))
    commit = d.get("commit") or ", ".join(dict.fromkeys(c["commit"] for c in d.get("calls", [])))
    date = d.get("date") or d.get("calls", [{}])[0].get("date", "?")
    return f"Source: `evals/results/{name}` ({gpu}, {date}, commit {commit})."


def peak_cell(r: dict[str, Any], digits: int) -> str:
    """Peak memory in GiB of a run: allocated, or for a CUDA-graph run its reserved peak (the
    graph's activations live in its pool, which the allocated peak does not count; an upper
    bound), marked so."""
    graph = r.get("cuda_graph", False)
    peak = (r["peak_reserved_bytes"] if graph else r["peak_memory_bytes"]) / 2**30
    return f"{peak:.{digits}f}{' (reserved)' if graph else ''}"


def setting_cells(r: dict[str, Any]) -> tuple[str, str, str]:
    """Checkpointing, CUDA-graph and peak-memory cells of an ``evals/gpu_memory.py`` row."""
    return (
        "yes" if r["gradient_checkpointing"] else "no",
        "yes" if r.get("cuda_graph", False) else "no",
        peak_cell(r, 2),
    )
