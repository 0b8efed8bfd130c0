"""The training sections of docs/RESULTS.md: runs of ``poetxq train`` and ``poetxq bench``.

The embedded default recipe's perplexities (``evals/vertical_slice.py``), the
``train.precision`` A/Bs at Llama-60M, the tokens/s tables and chart of ``evals/throughput.py``
files with their ratio lines and GPU-time breakdown, and the two-GPU section (DDP and
``train.grad_sync: step``, ``evals/multi_gpu.py``). Each builder returns the Markdown lines of
its table, or none when its results file is absent.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from results_files import current, load, peak_cell, provenance

LABELS = {
    "poetxq": "POET-XQ (int8 W0)",
    "poetx": "POET-X (bf16 W0)",
    "qgalore": "Q-GaLore",
    "qapollo": "Q-APOLLO",
    "adamw": "AdamW",
    "control": "control (R = P = I frozen)",
}


#: the embedded default recipe, 300 steps (``evals/vertical_slice.py``): CPU, H200, H200 ``fast``
VERTICAL_SLICES = (
    "vertical_slice_cpu.json",
    "vertical_slice_h200_8253a59.json",
    "vertical_slice_fast_h200_8253a59.json",
)
#: ``train.precision`` A/Bs at Llama-60M
PRECISION_RUNS = (
    "precision_60m_h200_c67f615.json",
    "precision_60m_seeds_h200_2dd220d.json",
    "precision_60m_1200_h200_2dd220d.json",
)


def _run_label(r: dict[str, Any]) -> str:
    variant = f", {r['variant']}" if r.get("variant") else ""
    return (
        LABELS.get(r["method"], r["method"])
        + variant
        + (", CUDA graph" if r.get("cuda_graph") else "")
        # a plan other than the recipe as written: auto chose it to fit this card's memory
        + (f", {plan} plan" if (plan := r.get("memory_plan", "fastest")) != "fastest" else "")
    )


def throughput_chart(img: Path, name: str | None = None) -> list[str]:
    """A bar chart of the tokens/s of every run (method, variant, CUDA graph) of one
    ``evals/throughput.py`` file (default: the current Llama-1B one), per sequence length."""
    d = load(name or current("throughput_1b"))
    if d is None:
        return []
    rows = [r for r in d["runs"] if "tokens_per_s" in r]
    seqs = sorted({r["seq_len"] for r in rows})
    labels = list(dict.fromkeys(_run_label(r) for r in rows))
    fig, ax = plt.subplots(figsize=(7.2, 4))
    width = 0.8 / len(seqs)
    for i, s in enumerate(seqs):
        by_label = {_run_label(r): r["tokens_per_s"] for r in rows if r["seq_len"] == s}
        vals = [by_label.get(lab, 0.0) for lab in labels]
        ax.barh([j + i * width for j in range(len(labels))], vals, width, label=f"seq {s}")
    ax.set_yticks([j + width * (len(seqs) - 1) / 2 for j in range(len(labels))], labels)
    ax.invert_yaxis()
    ax.set_xlabel("tokens/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(img / "throughput_1b.png", dpi=120)
    plt.close(fig)
    return ["![throughput](img/throughput_1b.png)", ""]


def ratio_key_label(key: str) -> str:
    """How a ratio line names a POET-XQ run key of ``throughput.py`` other than ``poetxq``:
    ``poetxq_graph`` -> ``in a CUDA graph``, ``poetxq_fast_graph`` -> ``fast in a CUDA graph``,
    ``poetxq4_graph`` -> ``4-bit in a CUDA graph``."""
    head, *rest = key.split("_")
    words = [] if head == "poetxq" else ["4-bit" if head == "poetxq4" else head]
    words += ["in a CUDA graph" if w == "graph" else w for w in rest]
    return " ".join(words)


def ratio_line(row: dict) -> str:
    """One (model, seq) row of ``throughput.py``'s ratios: POET-XQ over Q-GaLore and AdamW (the
    targets), then every other POET-XQ run key; a run without Q-GaLore gives its AdamW ratio."""
    parts = []
    if "poetxq_over_adamw" in row:
        head = f"POET-XQ / AdamW = {row['poetxq_over_adamw']:.2f} (target ≥ 0.9)"
        if "poetxq_over_qgalore" in row:
            head = f"POET-XQ / Q-GaLore = {row['poetxq_over_qgalore']:.2f} (target ≥ 1.3), " + head
        parts.append(head)
    others = sorted(
        (k.removesuffix("_over_adamw") for k in row if k.endswith("_over_adamw")),
        key=lambda k: (k != "poetxq_graph", k),  # the graph first, then the variants
    )
    for key in others:
        if key == "poetxq":
            continue
        graphed = row.get(f"{key}_over_adamw_graph")
        vs_graph = f", {graphed:.2f}× AdamW in a CUDA graph" if graphed is not None else ""
        if f"{key}_over_qgalore" in row:
            parts.append(
                f"POET-XQ {ratio_key_label(key)}: {row[f'{key}_over_qgalore']:.2f}× Q-GaLore, "
                f"{row[f'{key}_over_adamw']:.2f}× AdamW{vs_graph}"
            )
        else:
            parts.append(
                f"{ratio_key_label(key)} / AdamW = {row[f'{key}_over_adamw']:.2f}{vs_graph}"
            )
    model = f"{row['model']}, " if "model" in row else ""
    return f"- {model}seq {row['seq_len']}: " + "; ".join(parts)


def tokens_table(name: str, heading: str) -> list[str]:
    """Tokens/s per (seq, method) of one ``evals/throughput.py`` file, with its ratio lines
    (peak memory: :func:`peak_cell`)."""
    d = load(name)
    if d is None:
        return []
    lines = [
        heading,
        "",
        "| seq | method | tokens/s | step (s) | peak memory (GiB) | build (s) |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    several = len({r.get("model") for r in d["runs"]}) > 1  # name the model beside the seq
    for r in d["runs"]:
        if "tokens_per_s" not in r:
            continue
        seq = f"{r['model']} · {r['seq_len']}" if several else r["seq_len"]
        lines.append(
            f"| {seq} | {_run_label(r)} | {r['tokens_per_s']:,.0f} | "
            f"{r['step_time_s']:.3f} | {peak_cell(r, 1)} | "
            f"{r.get('build_s') or float('nan'):.1f} |"
        )
    lines.append("")
    for row in d["ratios"]:
        lines.append(ratio_line(row))
    note = [f"Note: {d['note']}", ""] if d.get("note") else []
    return [*lines, "", provenance(name, d), "", *note]


def gpu_time_table(name: str, heading: str) -> list[str]:
    """GPU time per step by kind of work (``gpu_time_ms`` of ``throughput.py --profile-dir``),
    one column per run."""
    d = load(name)
    if d is None:
        return []
    runs = [r for r in d["runs"] if r.get("gpu_time_ms")]
    keys = list(dict.fromkeys(k for r in runs for k in r["gpu_time_ms"]))
    keys = [k for k in keys if k != "total" and not k.startswith("of which")] + [
        k for k in keys if k == "total" or k.startswith("of which")
    ]
    lines = [
        heading,
        "",
        "| ms per step | " + " | ".join(_run_label(r) for r in runs) + " |",
        "|---|" + "---:|" * len(runs),
    ]
    for k in keys:
        cells = [f"{r['gpu_time_ms'][k]:.1f}" if k in r["gpu_time_ms"] else "–" for r in runs]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    lines.append(
        "| wall time of a step (not profiled) | "
        + " | ".join(f"{1e3 * r['step_time_s']:.1f}" for r in runs)
        + " |"
    )
    return [*lines, "", provenance(name, d), ""]


def vertical_slice(names: tuple[str, ...] = VERTICAL_SLICES) -> list[str]:
    """Final validation perplexity of the embedded default recipe (300 steps) per run of
    ``evals/vertical_slice.py``, one column per file."""
    files = [(n, d) for n in names if (d := load(n)) is not None]
    if not files:
        return []
    runs = list(dict.fromkeys(k for _, d in files for k in d["runs"]))
    lines = [
        "## The embedded default recipe (the quick start), 300 steps",
        "",
        "Validation perplexity at the end of `poetxq train` on the embedded corpus (4-layer "
        "Llama, d = 256, 2.5M tokens of English). *int8*: POET-XQ (the default); *bits16*: "
        "POET-X; *nf4*: `--bits 4`; *control*: `--freeze-orthogonal` (R = P = I, only "
        "embeddings, norms and lm_head train). The unigram baseline on the same tokens is "
        "574.2. On the CPU the last digits vary with the thread count.",
        "",
        "| run | " + " | ".join(f"file {i}" for i in range(1, len(files) + 1)) + " |",
        "|---|" + "---:|" * len(files),
    ]
    for run in runs:
        cells = []
        for _, d in files:
            r = d["runs"].get(run)
            cells.append(f"{r['final_val_ppl']:.2f}" if r and "final_val_ppl" in r else "–")
        lines.append(f"| {run} | " + " | ".join(cells) + " |")
    lines.append("")
    for i, (name, d) in enumerate(files, 1):
        machine = d.get("machine") or d.get("gpu", "?")
        lines.append(
            f"{i}. Source: `evals/results/{name}` ({machine}, {d.get('date', '?')}, "
            f"commit {str(d.get('commit', '?'))[:7]}): `{d.get('command', '?')}`."
        )
    return [*lines, ""]


def precision(names: tuple[str, ...] = PRECISION_RUNS) -> list[str]:
    """``train.precision`` bf16-true against auto (fp32 parameters under bf16 autocast) at
    Llama-60M: final validation perplexity and tokens/s of each run."""
    files = [(n, d) for n in names if (d := load(n)) is not None]
    if not files:
        return []
    lines = [
        "### `train.precision: bf16-true` against the default autocast, Llama-60M",
        "",
        "POET-XQ int8 on the offline corpus, 256 × 256 tokens per step; one run per row.",
        "",
        "| file | run | steps | final val ppl | tokens/s |",
        "|---|---|---:|---:|---:|",
    ]
    for i, (_, d) in enumerate(files, 1):
        for key, r in d["runs"].items():
            r = r.get("summary", r)  # the first A/B file nests each run's summary
            lines.append(
                f"| {i} | {key} | {r['steps']} | {r['final_val_ppl']:.2f} | "
                f"{r['tokens_per_s']:,.0f} |"
            )
    lines.append("")
    lines += [f"{i}. {provenance(n, d)}" for i, (n, d) in enumerate(files, 1)]
    return [*lines, ""]


def multi_gpu() -> list[str]:
    name = "multi_gpu_h200x2.json"
    d, sync = load(name), _multi_gpu_sync()
    if d is None:
        return ["## Two H200s", "", *sync] if sync else []
    eq, res, tp = d["equivalence"], d["resume"], d["throughput"]
    lines = ["### DDP: equivalence, resume and tokens/s", ""]
    for m, e in eq.items():
        lines.append(
            f"- {LABELS.get(m, m)}: 1 GPU × batch 8 against 2 GPUs × batch 4, fp32, "
            f"{e['steps']} steps: largest relative loss difference {e['max_rel_diff']:.1e}; "
            f"replicas identical: {e['replicas_identical']}"
        )
    lines.append(
        f"- Resume under DDP from step {res['resumed_at_step']}: bit-exact {res['bit_exact']}"
    )
    for m, t in tp.items():
        one, two = t["1gpu"]["tokens_per_s_median"], t["2gpu"]["tokens_per_s_median"]
        lines.append(
            f"- {LABELS.get(m, m)} Llama-1B, seq 256, 16 sequences per GPU: {one:,.0f} → "
            f"{two:,.0f} tokens/s ({t['scaling_2_over_1']:.2f}×)"
        )
    if d.get("skipped"):
        lines.append(f"- Not run (time budget): {', '.join(d['skipped'])}")
    lines += ["", provenance(name, d), ""]
    return ["## Two H200s", "", *sync, *lines]


def _sync_label(spec: str, summary: dict[str, Any]) -> str:
    """``"poetxq@step"`` and its 2-GPU run's summary -> "POET-XQ (int8 W0), grad_sync step,
    CUDA graph"."""
    method = spec.split("@")[0]
    graph = ", CUDA graph" if summary.get("cuda_graph") else ", eager"
    return f"{LABELS.get(method, method)}, grad_sync {summary.get('grad_sync', '?')}{graph}"


def _multi_gpu_sync(name: str | None = None) -> list[str]:
    """``train.grad_sync`` step (CUDA graph per GPU) against DDP on two GPUs (default: the
    current file)."""
    name = name or current("multi_gpu_step", "h200x2")
    d = load(name)
    if d is None:
        return []
    lines = [
        "### Gradient sync once per step (`train.grad_sync: step`) against DDP",
        "",
        "Llama-1B, seq 256, 16 sequences per GPU per step, bf16; tokens/s is the median of the "
        "logged windows after the first. One process has nothing to synchronise, so the 1-GPU "
        "runs of both POET rows replay a CUDA graph.",
        "",
        "| run (as on 2 GPUs) | 1 GPU | 2 GPUs | 2 ÷ 1 | peak GiB per GPU (2 GPUs) |",
        "|---|---:|---:|---:|---:|",
    ]
    for spec, r in d["throughput"].items():
        if not isinstance(r, dict) or "2gpu" not in r or "1gpu" not in r:
            continue
        one, two = r["1gpu"], r["2gpu"]
        lines.append(
            f"| {_sync_label(spec, two['summary'])} | {one['tokens_per_s_median']:,.0f} | "
            f"{two['tokens_per_s_median']:,.0f} | {r['scaling_2_over_1']:.2f} | "
            f"{max(two['peak_mem_gib_per_rank']):.1f} |"
        )
    lines.append("")
    for spec, e in d["equivalence"].items():
        two = e["runs"]["2gpu"]["summary"]
        lines.append(
            f"- {_sync_label(spec, two)}: 1 GPU × batch 8 against 2 GPUs × batch 4, fp32, "
            f"{e['steps']} steps, merges every 4: largest relative loss difference "
            f"{e['max_rel_diff']:.1e}; replicas identical: {e['replicas_identical']}"
        )
    runs = {k: e["runs"]["2gpu"]["losses"] for k, e in d["equivalence"].items()}
    if len(runs) == 2:
        (ka, a), (kb, b) = runs.items()
        rel = max(abs(a[k] - b[k]) / abs(a[k]) for k in a)
        lines.append(f"- {ka} against {kb} on 2 GPUs: largest relative loss difference {rel:.1e}")
    res = d.get("resume") or {}
    if "bit_exact" in res:
        lines.append(
            f"- Resume of {res.get('method', '?')} from step {res['resumed_at_step']}: "
            f"bit-exact {res['bit_exact']}"
        )
    return [*lines, "", provenance(name, d), ""]
