"""The README's results table, between ``<!-- headline:begin -->`` and ``<!-- headline:end -->``.

:func:`headline_rows` renders one row per entry of :data:`HEADLINE_LABELS` from the current
files of the stems that ``evals/headline.py`` regenerates (tokens/s ratios, the 2-GPU scaling,
Llama-8B / 13B peaks and speed-ups, the kernel targets), each number linked to its file;
:func:`render_readme` puts them into the README's table, keeping the rows of other sources as
they are.
"""

from __future__ import annotations

from typing import Any

from results_files import current, load, peak_cell

HEADLINE_BEGIN, HEADLINE_END = "<!-- headline:begin -->", "<!-- headline:end -->"
#: the README rows rendered from the files evals/headline.py regenerates, by their first cell
HEADLINE_LABELS = {
    "adamw": "tokens/s ÷ AdamW, Llama-1B / 3B, 8,192 tokens per step, POET-XQ int8 in a CUDA "
    "graph (seq 256 / 1024)",
    "qgalore": "the same ÷ Q-GaLore",
    "multi_gpu": "Llama-1B tokens/s, 2 H200s ÷ 1",
    "no_ckpt": "Llama-8B / 13B, batch 1 × 2048, no checkpointing: peak and speed-up over the "
    "official step measured beside ours",
    "ckpt": "the same with checkpointing, in one run each",
    "layer": "one layer forward+backward ÷ `nn.Linear`, 8B MLP shapes, GPU time",
    "layer_peak": "peak extra memory of that int8 `mem` layer",
    "gemm": "weight GEMM ÷ bf16 cuBLAS, 8,192 tokens, 8B / 13B MLP shapes, forward and dX",
    "cnp": "Cayley–Neumann forward+backward, every b = 256 block of 8B, ÷ torch",
}


def _link(text: str, name: str) -> str:
    return f"[{text}](evals/results/{name})"


def _official_step(row: dict[str, Any]) -> float | None:
    """The official step time beside ``row``: measured in its own call, else in the current
    ``gpu_memory_<size>_official`` file's row of the same model and setting."""
    if "official_measured" in row:
        return row["official_measured"]["step_time_s"]
    size = row["model"].removeprefix("llama-")
    d = load(current(f"gpu_memory_{size}_official")) or {"results": []}
    key = ("gradient_checkpointing", "batch_size", "seq_len")
    for r in d["results"]:
        if "official_measured" in r and all(r.get(k) == row.get(k) for k in key):
            return r["official_measured"]["step_time_s"]
    return None


def _memory_cell(size: str, stem: str, ckpt: bool) -> tuple[str, float] | None:
    """``8B [22.58 GiB, 1.65×](file)`` of the current file of ``stem`` (its row of the given
    checkpointing; a CUDA graph's peak is its reserved one) and that row's target in GiB."""
    name = current(stem)
    d = load(name)
    row = next((r for r in (d or {}).get("results", []) if r["gradient_checkpointing"] == ckpt),
               None)  # fmt: skip
    if row is None:
        return None
    peak = peak_cell(row, 2).removesuffix(" (reserved)")
    off = _official_step(row)
    speed = f", {off / row['step_time_s']:.2f}×" if off else ""
    return f"{size.upper()} {_link(f'{peak} GiB{speed}', name)}", row["target_peak_gib"]


def _throughput_rows() -> list[str]:
    files = {size: current(f"throughput_{size}") for size in ("1b", "3b")}
    docs = {size: load(name) for size, name in files.items()}
    if any(d is None for d in docs.values()):
        return []

    def cells(base: str, key: str) -> str:
        out = []
        for size, d in docs.items():
            by_seq = {r["seq_len"]: r for r in d["ratios"]}
            vals = " / ".join(f"{by_seq[s][f'{key}_over_{base}']:.2f}" for s in (256, 1024))
            out.append(f"{size.upper()} {_link(vals, files[size])}")
        return ", ".join(out)

    rows = []
    for base, target in (("adamw", "≥ 0.9"), ("qgalore", "≥ 1.3")):
        mem, fast = cells(base, "poetxq_graph"), cells(base, "poetxq_fast_graph")
        default = " (the default)" if base == "adamw" else ""
        rows.append(f"| {HEADLINE_LABELS[base]} | `mem`{default} {mem}; `fast` {fast} | "
                    f"{target} |")  # fmt: skip
    return rows


def _multi_gpu_row() -> list[str]:
    name = current("multi_gpu_step", "h200x2")
    d = load(name)
    if d is None:
        return []
    step, ddp = (f"{d['throughput'][k]['scaling_2_over_1']:.2f}" for k in ("poetxq@step", "adamw"))
    return [
        f"| {HEADLINE_LABELS['multi_gpu']} | POET-XQ {_link(step, name)}, AdamW (DDP) "
        f"{_link(ddp, name)} | – |"
    ]


def _memory_rows() -> list[str]:
    rows = []
    for key, ckpt, stems in (
        ("no_ckpt", False, ("gpu_memory_8b_graph", "optim8bit_13b_ours")),
        ("ckpt", True, ("gpu_memory_8b_relayout_expandable", "gpu_memory_13b_relayout_expandable")),
    ):
        got = [_memory_cell(size, stem, ckpt) for size, stem in zip(("8b", "13b"), stems)]
        if any(g is None for g in got):
            continue
        targets = " / ".join(f"≤ {t}" for _, t in got)
        rows.append(f"| {HEADLINE_LABELS[key]} | {'; '.join(c for c, _ in got)} | "
                    f"{targets} GiB, ≥ 1.5× |")  # fmt: skip
    return rows


def _kernel_rows() -> list[str]:
    import kernel_targets

    name = current("kernel_targets")
    d = load(name)
    if d is None:
        return []
    t = {row["target"]: row for row in kernel_targets.targets(d)}
    shapes = ("4096→14336", "14336→4096")

    def pick(prefix: str) -> list[dict[str, Any]]:
        return [t[f"{prefix}, {s}"] for s in shapes]

    xq = pick("POET-XQ int8 mem layer fwd+bwd ÷ nn.Linear")
    fast = pick("POET-X bf16 fast layer fwd+bwd ÷ nn.Linear")
    peak = pick("POET-XQ int8 mem layer peak extra memory (MiB)")

    def pair(rows: list[dict[str, Any]], fmt: str = ".2f", get: Any = None) -> str:
        return " / ".join(format(get(r) if get else r["measured"], fmt) for r in rows)

    official = ""
    if all("official_xq_mem" in r.get("official_ratios", {}) for r in xq):
        vals = pair(xq, get=lambda r: r["official_ratios"]["official_xq_mem"])
        official = f" (official {_link(vals, name)})"
    gemms = {b: [r for k, r in t.items() if k.startswith(f"{b} weight GEMM ÷ bf16")]
             for b in ("int8", "NF4")}  # fmt: skip
    ranges = {
        b: _link(f"{min(r['measured'] for r in rs):.3f}–{max(r['measured'] for r in rs):.3f}", name)
        for b, rs in gemms.items()
    }
    cnp = next(r for k, r in t.items() if k.startswith("CNP fwd+bwd speed-up"))
    cnp_cell = _link(f"{cnp['measured']:.2f}×", name)
    return [
        f"| {HEADLINE_LABELS['layer']} | POET-XQ int8 `mem` {_link(pair(xq), name)}{official}; "
        f"POET-X bf16 `fast` {_link(pair(fast), name)} | ≤ {xq[0]['threshold']:.2f}; "
        f"≤ {fast[0]['threshold']:g} |",
        f"| {HEADLINE_LABELS['layer_peak']} | {_link(pair(peak, '.0f') + ' MiB', name)} "
        f"(`nn.Linear` {pair(peak, '.0f', lambda r: r['nn_linear_peak_extra_mib'])}) | "
        f"< {peak[0]['threshold']:.0f} MiB |",
        f"| {HEADLINE_LABELS['gemm']} | int8 {ranges['int8']}; NF4 {ranges['NF4']} | "
        f"≤ {gemms['int8'][0]['threshold']:.2f}; ≤ {gemms['NF4'][0]['threshold']:.2f} |",
        f"| {HEADLINE_LABELS['cnp']} | {cnp_cell} | ≥ {cnp['threshold']:g}× |",
    ]


def headline_rows() -> list[str]:
    """The README's results rows from the current files of ``evals/headline.py``'s stems."""
    return [*_throughput_rows(), *_multi_gpu_row(), *_memory_rows(), *_kernel_rows()]


def render_readme(text: str) -> str:
    """``text`` (the README) with its results table re-rendered between the headline markers:
    the header, the rows whose first cell is not one of :data:`HEADLINE_LABELS` kept as they
    are, then :func:`headline_rows`.

    Raises:
        ValueError: the markers are missing or out of order.
    """
    lines = text.split("\n")
    try:
        begin, end = lines.index(HEADLINE_BEGIN), lines.index(HEADLINE_END)
    except ValueError:
        raise ValueError(f"no {HEADLINE_BEGIN} ... {HEADLINE_END} block") from None
    if end < begin:
        raise ValueError(f"{HEADLINE_END} comes before {HEADLINE_BEGIN}")
    generated = set(HEADLINE_LABELS.values())
    kept = [
        ln
        for ln in lines[begin + 1 : end]
        if ln.startswith("| ")
        and not ln.startswith("| measurement |")
        and ln.split(" | ")[0].removeprefix("| ") not in generated
    ]
    block = ["| measurement | result | target |", "|---|---|---|", *kept, *headline_rows()]
    return "\n".join([*lines[: begin + 1], *block, *lines[end:]])
