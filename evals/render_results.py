"""Render the committed GPU results (``evals/results/*.json``) into ``docs/RESULTS.md`` + PNGs.

Every number in the page is read from a results file, whose path, date, commit and GPU are printed
beside its table; nothing is typed in by hand. Re-run after committing new results::

    python evals/render_results.py            # writes docs/RESULTS.md and docs/img/*.png

It also renders the README's results table (between ``<!-- headline:begin -->`` and
``<!-- headline:end -->``): the rows of the files ``evals/headline.py`` regenerates, each number
linked to the current file of its stem; rows of other sources in that table are kept as they are.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import headline
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from poetxq.tools.cli_tools import check_output_file

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "evals" / "results"
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
README = REPO / "README.md"
HEADLINE_BEGIN, HEADLINE_END = "<!-- headline:begin -->", "<!-- headline:end -->"


def current(stem: str, machine: str = "h200") -> str:
    """The current results file of a stem that ``evals/headline.py`` writes
    (``<stem>_<machine>_<commit>.json``; its ``--adopt`` keeps one per stem in ``RESULTS``), or a
    name no file has when there is none (the sections that read it are then left out)."""
    return headline.current(stem, RESULTS, machine) or f"{stem}_{machine}_none.json"


def _load(name: str) -> dict[str, Any] | None:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.is_file() else None


def _provenance(name: str, d: dict[str, Any]) -> str:
    gpus = d.get("gpus")
    gpu = d.get("gpu") or (f"{len(gpus)}× {gpus[0]}" if gpus else d.get("device", "?"))
    commit = d.get("commit") or ", ".join(dict.fromkeys(c["commit"] for c in d.get("calls", [])))
    date = d.get("date") or d.get("calls", [{}])[0].get("date", "?")
    return f"Source: `evals/results/{name}` ({gpu}, {date}, commit {commit})."


def _throughput(img: Path, name: str | None = None) -> list[str]:
    """A bar chart of the tokens/s of every run (method, variant, CUDA graph) of one
    ``evals/throughput.py`` file (default: the current Llama-1B one), per sequence length."""
    d = _load(name or current("throughput_1b"))
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


def _memory(name: str = "gpu_memory_h200.json") -> list[str]:
    """The estimator against the measured peak of one eager step at 8B / 13B."""
    d = _load(name)
    if d is None:
        return []
    lines = [
        "### The estimate against the measured peak (eager, 32-bit Adam states)",
        "",
        "One full training step (forward, backward, clip, AdamW), bf16, batch 1 × 2,048 tokens, "
        "int8 `W0`, b = 256, measured before the later memory work (the current peaks are in the "
        "side-by-side tables above); the official code's peaks are the issue's quotes.",
        "",
        "| model | checkpointing | peak (GiB) | estimate (GiB) | official code (GiB) | "
        "target (GiB) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in d["results"]:
        lines.append(
            f"| {r['model']} | {'yes' if r['gradient_checkpointing'] else 'no'} | "
            f"{r['peak_memory_gib']:.2f} | {r['estimated_peak_gib']:.2f} | "
            f"{r['official_peak_gib']:.2f} | {r['target_peak_gib']} |"
        )
    return [*lines, "", _provenance(name, d), ""]


#: the streamed-GEMM run at the current decoder defaults: (key in the file, column heading)
SLAB_GEMM_COLUMNS = (
    ("int8 default 32MiB balanced", "int8"),
    ("nf4 picked 32MiB balanced", "NF4"),
    ("bnb", "bitsandbytes NF4"),
)


def _kernel_targets(name: str | None = None) -> list[str]:
    """Issue 3's targets from one run (default: the current one), each beside its floor
    (``evals/kernel_targets.py``)."""
    import kernel_targets

    name = name or current("kernel_targets")
    d = _load(name)
    if d is None:
        return []
    d["targets"] = kernel_targets.targets(d)
    text = kernel_targets.render(
        d, f"evals/results/{name}", heading="## Kernel targets in one run", profile=False
    )
    return [*text.splitlines(), ""]


def _slab_gemms(name: str = "slab_decode_h200_8b1763c.json") -> list[str]:
    """The weight GEMMs against bf16 cuBLAS in GPU time (``evals/bench_slab_decode.py``)."""
    d = _load(name)
    if d is None:
        return []
    lines = [
        "## Weight GEMMs in GPU time: slab-streamed int8 / NF4 against bf16 cuBLAS",
        "",
        "Each call replayed from a CUDA graph (a Triton launch outlasts a slab decode, so eager "
        "event times measure the host), median of 3 interleaved rounds; ratio to bf16 "
        f"`torch.matmul` with the weight already in bf16, same run. NF4: `{d['best_nf4']}` (the "
        "default since 73a3d2d); bitsandbytes: `matmul_4bit` forward, `dequantize_4bit` then a "
        "GEMM for dX (it holds the whole bf16 weight; ours a 32 MiB slab).",
        "",
        "| M × K × N | side | bf16 (ms) | "
        + " | ".join(head for _, head in SLAB_GEMM_COLUMNS)
        + " | int8 / NF4 decode (µs) |",
        "|---|---|---:|" + "---:|" * len(SLAB_GEMM_COLUMNS) + "---|",
    ]
    for r in d["gemm"]:
        for side in ("forward", "dX"):
            t = r[side]
            cells = []
            for key, _ in SLAB_GEMM_COLUMNS:
                hit = next((v for k, v in t.items() if k.startswith(key)), None)
                cells.append(f"{hit['ratio_vs_bf16']:.3f}" if hit else "n/a")
            dec = [t.get(f"{key} decode only", {}).get("ms") for key, _ in SLAB_GEMM_COLUMNS[:2]]
            dec_cell = " / ".join(f"{1e3 * v:.0f}" if v else "n/a" for v in dec)
            lines.append(
                f"| {r['M']} × {r['K']} × {r['N']} | {side} | {t['bf16_matmul']['ms']:.3f} | "
                + " | ".join(cells)
                + f" | {dec_cell} |"
            )
    return [*lines, "", _provenance(name, d), ""]


def _run_label(r: dict[str, Any]) -> str:
    variant = f", {r['variant']}" if r.get("variant") else ""
    return (
        LABELS.get(r["method"], r["method"])
        + variant
        + (", CUDA graph" if r.get("cuda_graph") else "")
    )


def _ratio_key_label(key: str) -> str:
    """How a ratio line names a POET-XQ run key of ``throughput.py`` other than ``poetxq``:
    ``poetxq_graph`` -> ``in a CUDA graph``, ``poetxq_fast_graph`` -> ``fast in a CUDA graph``,
    ``poetxq4_graph`` -> ``4-bit in a CUDA graph``."""
    head, *rest = key.split("_")
    words = [] if head == "poetxq" else ["4-bit" if head == "poetxq4" else head]
    words += ["in a CUDA graph" if w == "graph" else w for w in rest]
    return " ".join(words)


def _ratio_line(row: dict) -> str:
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
                f"POET-XQ {_ratio_key_label(key)}: {row[f'{key}_over_qgalore']:.2f}× Q-GaLore, "
                f"{row[f'{key}_over_adamw']:.2f}× AdamW{vs_graph}"
            )
        else:
            parts.append(
                f"{_ratio_key_label(key)} / AdamW = {row[f'{key}_over_adamw']:.2f}{vs_graph}"
            )
    model = f"{row['model']}, " if "model" in row else ""
    return f"- {model}seq {row['seq_len']}: " + "; ".join(parts)


def _tokens_table(name: str, heading: str) -> list[str]:
    """Tokens/s per (seq, method) of one ``evals/throughput.py`` file, with its ratio lines
    (peak memory: :func:`_peak_cell`)."""
    d = _load(name)
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
            f"{r['step_time_s']:.3f} | {_peak_cell(r, 1)} | "
            f"{r.get('build_s') or float('nan'):.1f} |"
        )
    lines.append("")
    for row in d["ratios"]:
        lines.append(_ratio_line(row))
    note = [f"Note: {d['note']}", ""] if d.get("note") else []
    return [*lines, "", _provenance(name, d), "", *note]


def _gpu_time_table(name: str, heading: str) -> list[str]:
    """GPU time per step by kind of work (``gpu_time_ms`` of ``throughput.py --profile-dir``),
    one column per run."""
    d = _load(name)
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
    return [*lines, "", _provenance(name, d), ""]


def _peak_cell(r: dict[str, Any], digits: int) -> str:
    """Peak memory in GiB of a run: allocated, or for a CUDA-graph run its reserved peak (the
    graph's activations live in its pool, which the allocated peak does not count; an upper
    bound), marked so."""
    graph = r.get("cuda_graph", False)
    peak = (r["peak_reserved_bytes"] if graph else r["peak_memory_bytes"]) / 2**30
    return f"{peak:.{digits}f}{' (reserved)' if graph else ''}"


def _setting_cells(r: dict[str, Any]) -> tuple[str, str, str]:
    """Checkpointing, CUDA-graph and peak-memory cells of an ``evals/gpu_memory.py`` row."""
    return (
        "yes" if r["gradient_checkpointing"] else "no",
        "yes" if r.get("cuda_graph", False) else "no",
        _peak_cell(r, 2),
    )


def _ab_table(name: str, title: str, label: str, column: str) -> list[str]:
    """Step time and peak memory of each row of an A/B file, ``label`` naming the variant."""
    d = _load(name)
    if d is None:
        return []
    lines = [
        title,
        "",
        f"| model | checkpointing | CUDA graph | {column} | call | peak (GiB) | step (s) | "
        "official step (s) | speed-up (target ≥ 1.5) |",
        "|---|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in d["results"]:
        ckpt, graph, peak = _setting_cells(r)
        lines.append(
            f"| {r['model']} | {ckpt} | {graph} | {r[label]} | {r.get('call', 0)} | {peak} | "
            f"{r['step_time_s']:.3f} | {r['official_step_s']:.2f} | "
            f"{r['speedup_vs_official']:.2f} |"
        )
    return [*lines, "", _provenance(name, d), "", f"Note: {d['note']}", ""]


def _memory_lowmem() -> list[str]:
    name = "gpu_memory_lowmem_h200.json"
    d = _load(name)
    if d is None:
        return []
    lines = [
        "### Llama-8B / 13B with the memory options (offload, optimizer in backward, chunked loss)",
        "",
        "Batch 1 × 2,048 tokens, POET-XQ int8, b = 256, mem variant, bf16, 8-bit Adam states. "
        "*offload*: `train.offload_activations`; *in backward*: `train.optimizer_in_backward` "
        "(no gradient clipping); *chunk*: `train.loss_chunk_tokens`.",
        "",
        "| model | checkpointing | offload | in backward | chunk | peak (GiB) | estimate (GiB) "
        "| official (GiB) | target (GiB) | step (s) | official step (s) | speed-up |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def yn(x: object) -> str:
        return "yes" if x else "no"

    for r in d["results"]:
        lines.append(
            f"| {r['model']} | {yn(r['gradient_checkpointing'])} | "
            f"{yn(r.get('offload_activations'))} | {yn(r.get('optimizer_in_backward'))} | "
            f"{r.get('loss_chunk_tokens') or '-'} | {r['peak_memory_gib']:.2f} | "
            f"{r['estimated_peak_gib']:.2f} | {r['official_peak_gib']:.2f} | "
            f"{r['target_peak_gib']} | {r['step_time_s']:.3f} | {r['official_step_s']:.2f} | "
            f"{r['speedup_vs_official']:.2f} |"
        )
    calls = "; ".join(f"call {i}: `{c['command']}` ({c['commit']}, {c['date']})"
                      for i, c in enumerate(d["calls"]))  # fmt: skip
    return [*lines, "", f"Source: `evals/results/{name}` ({d['gpu']}); {calls}.", "",
            f"Note: {d['note']}", ""]  # fmt: skip


def _memory_options_table(names: list[str], title: str) -> list[str]:
    """Llama-8B / 13B rows of several ``evals/gpu_memory.py`` files, with their memory options:
    a CUDA-graph row's peak is its reserved peak (:func:`_peak_cell`), and the warm-up step's
    allocated peak (which holds the capture) is shown beside it where recorded."""
    files = [(n, d) for n in names if (d := _load(n)) is not None]
    if not files:
        return []
    lines = [
        title,
        "",
        "Batch 1 × 2,048 tokens, POET-XQ int8, b = 256, mem variant, bf16, 8-bit Adam states. "
        "*chunk*: `train.loss_chunk_tokens`; *in backward*: `train.optimizer_in_backward` (no "
        "clipping); *offload*: `train.offload_activations`; *warm-up peak*: the allocated peak "
        "of the untimed first step, which includes a graph's capture.",
        "",
        "| file | model | checkpointing | CUDA graph | chunk | in backward | offload | peak (GiB) "
        "| warm-up peak (GiB) | estimate (GiB) | target (GiB) | step (s) | speed-up (≥ 1.5) |",
        "|---|---|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|",
    ]

    def yn(x: object) -> str:
        return "yes" if x else "no"

    for i, (_, d) in enumerate(files, 1):
        for r in d["results"]:
            ckpt, graph, peak = _setting_cells(r)
            warm = r.get("warmup_peak_bytes")
            lines.append(
                f"| {i} | {r['model']} | {ckpt} | {graph} | {r.get('loss_chunk_tokens') or '-'} "
                f"| {yn(r.get('optimizer_in_backward'))} | {yn(r.get('offload_activations'))} | "
                f"{peak} | {'–' if warm is None else f'{warm / 2**30:.2f}'} | "
                f"{r['estimated_peak_gib']:.2f} | {r['target_peak_gib']} | "
                f"{r['step_time_s']:.3f} | {r['speedup_vs_official']:.2f} |"
            )
    lines.append("")
    for i, (name, d) in enumerate(files, 1):
        note = f" {d['note']}" if d.get("note") else ""
        lines.append(f"{i}. {_provenance(name, d)}{note}")
    return [*lines, ""]


def _cnp_hybrid() -> list[str]:
    name = "cnp_hybrid_h200.json"
    d = _load(name)
    if d is None:
        return []
    lines = [
        f"## Cayley–Neumann blocks, hybrid layout: {d['num_blocks']:,} blocks of "
        f"b = {d['block_size']} (every block of Llama-8B)",
        "",
        "Milliseconds; the speed-up is the torch reference's time over the path's (target ≥ 3 "
        "for forward+backward). *packed*: an all-Triton layout, "
        "removed since (git history); *hybrid*: `quant_kernels.cnp_hybrid` (the default).",
        "",
        "| dtype | pass | reference | lean | packed | hybrid | reference / packed | "
        "reference / hybrid | hybrid peak extra (MiB) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for dt, r in d["results"].items():
        ms = r["ms"]
        for k in ("fwd", "fwd_bwd"):
            ref = ms["reference"][k]
            lines.append(
                f"| {dt} | {k} | {ref:.2f} | {ms['lean'][k]:.2f} | {ms['fused'][k]:.2f} | "
                f"{ms['fused_hybrid'][k]:.2f} | {ref / ms['fused'][k]:.2f} | "
                f"{ref / ms['fused_hybrid'][k]:.2f} | "
                f"{ms['fused_hybrid']['fwd_bwd_peak_extra_mib']:.0f} |"
            )
    return [*lines, "", _provenance(name, d), ""]


def _multi_gpu() -> list[str]:
    name = "multi_gpu_h200x2.json"
    d, sync = _load(name), _multi_gpu_sync()
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
    lines += ["", _provenance(name, d), ""]
    return ["## Two H200s", "", *sync, *lines]


def _vertical_slice(names: tuple[str, ...] = VERTICAL_SLICES) -> list[str]:
    """Final validation perplexity of the embedded default recipe (300 steps) per run of
    ``evals/vertical_slice.py``, one column per file."""
    files = [(n, d) for n in names if (d := _load(n)) is not None]
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


def _precision(names: tuple[str, ...] = PRECISION_RUNS) -> list[str]:
    """``train.precision`` bf16-true against auto (fp32 parameters under bf16 autocast) at
    Llama-60M: final validation perplexity and tokens/s of each run."""
    files = [(n, d) for n in names if (d := _load(n)) is not None]
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
    lines += [f"{i}. {_provenance(n, d)}" for i, (n, d) in enumerate(files, 1)]
    return [*lines, ""]


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
    d = _load(name)
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
    return [*lines, "", _provenance(name, d), ""]


#: the layer rows of the side-by-side run (``gpu_suite.py --parts overhead --official``)
SIDE_BY_SIDE_LAYERS = (
    ("nn_linear", "`nn.Linear` (cuBLAS, bf16 weight)"),
    ("bits8_mem", "ours: POET-XQ int8 `mem`"),
    ("bits8_fast", "ours: POET-XQ int8 `fast`"),
    ("bits4_mem", "ours: POET-XQ NF4 `mem`"),
    ("bits16_mem", "ours: POET-X bf16 `mem`"),
    ("bits16_fast", "ours: POET-X bf16 `fast`"),
    ("official_xq_mem", "official: POET-XQ (`QPOETLinear`, mem_efficient_mode)"),
    ("official_xq", "official: POET-XQ (`QPOETLinear`, its default)"),
    ("official_x_mem", "official: POET-X `mem` (`POETLinear`, mem_efficient_mode)"),
    ("official_x_fast", "official: POET-X `fast` (`POETLinear`, its default)"),
)
#: (ours, official) layer pairs compared in the side-by-side ratios
SIDE_BY_SIDE_PAIRS = (
    ("bits8_mem", "official_xq_mem", "POET-XQ int8 `mem`"),
    ("bits16_mem", "official_x_mem", "POET-X `mem`"),
    ("bits16_fast", "official_x_fast", "POET-X `fast`"),
)


def _side_by_side_layers(name: str) -> list[str]:
    """The layer table of a side-by-side run with the official code (GPU time from a CUDA-graph
    replay and peak extra memory of one forward+backward, per 8B MLP shape)."""
    d = _load(name)
    if d is None:
        return []
    shapes = d["layer_overhead_8b_mlp_bf16"]
    head = " | ".join(f"{s['shape'].replace('->', ' → ')}" for s in shapes)
    lines = [
        "### One layer forward+backward beside the official code (Llama-8B MLP shapes)",
        "",
        "Input [1, 2048, d], bf16, b = 256. GPU time: the forward+backward replayed from a CUDA "
        "graph (ms, and ÷ `nn.Linear` in the same run); peak extra: MiB allocated above what was "
        "allocated before the call (output, input gradient and transients; `nn.Linear`'s "
        "includes its weight gradient). The official code is github.com/Sphere-AI-Lab/poet's "
        "`poet_torch`, from a local copy (`evals/official_poet.py`), timed in the same rows.",
        "",
        f"| layer | GPU ms ({head}) | ÷ `nn.Linear` | peak extra MiB |",
        "|---|---:|---:|---:|",
    ]
    for key, label in SIDE_BY_SIDE_LAYERS:
        rows = [s.get(key) for s in shapes]
        if any(r is None or "gpu_ms_graph" not in r for r in rows):
            continue
        ms = " / ".join(f"{r['gpu_ms_graph']:.3f}" for r in rows)
        ratio = " / ".join(f"{r['gpu_ratio']:.2f}" if "gpu_ratio" in r else "1" for r in rows)
        peak = " / ".join(f"{r['peak_extra_mib']:.0f}" for r in rows)
        lines.append(f"| {label} | {ms} | {ratio} | {peak} |")
    lines.append("")
    for ours, theirs, label in SIDE_BY_SIDE_PAIRS:
        rows = [(s.get(ours), s.get(theirs)) for s in shapes]
        if all(a and b and "gpu_ms_graph" in a and "gpu_ms_graph" in b for a, b in rows):
            speed = " / ".join(f"{b['gpu_ms_graph'] / a['gpu_ms_graph']:.2f}×" for a, b in rows)
            lines.append(f"- {label}: ours is {speed} faster than the official layer in GPU time.")
    return [*lines, "", _provenance(name, d), ""]


def _side_by_side_steps(
    names: list[str],
    title: str = "Llama-8B / 13B training steps beside the official code",
    official_from: list[str] = (),
) -> list[str]:
    """Whole-step rows of ``evals/gpu_memory.py`` files: ours (eager, CUDA graph, memory
    options) beside the official code's step measured in the same call (``--official``); rows of
    files without it are compared with the official step of the same model and checkpointing
    from the files that have it, or from ``official_from`` (files of an earlier call, whose own
    rows are not repeated)."""
    docs = [(n, d) for n in names if (d := _load(n)) is not None]
    if not docs:
        return []
    sources = [(n, d) for n in official_from if (d := _load(n)) is not None]

    def same_setting(r: dict[str, Any]) -> tuple:
        return (r["model"], r["gradient_checkpointing"], r.get("batch_size", 1),
                r.get("seq_len", 2048))  # fmt: skip

    official: dict[tuple, dict[str, Any]] = {}
    for _, d in docs + sources:
        for r in d["results"]:
            if "official_measured" in r:
                official.setdefault(same_setting(r), r["official_measured"])  # the first file's
    lines = [
        f"### {title}",
        "",
        "Batch 1 × 2,048 tokens, int8 `W0`, b = 256, bf16, 8-bit optimizer states; one step = "
        "forward, backward, gradient clipping (none with the optimizer in backward) and the "
        "optimizer step. The official step (`evals/official_poet.py step`: `POETModel(QPOETConfig)`"
        " as its training script sets it up, `gradient_checkpointing_enable()` for the "
        "checkpointed rows) ran in the same device call as ours"
        + (
            " or, where the call did not run it, in the earlier call of the last source"
            if sources
            else ""
        )
        + ". Peak: allocated; for a CUDA graph the reserved peak (its pool is not in the "
        "allocated count).",
        "",
        "| model | checkpointing | ours | ours peak (GiB) | ours step (s) | official peak (GiB) | "
        "official step (s) | speed-up | targets (GiB; speed-up) |",
        "|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for _, d in docs:
        for r in d["results"]:
            off = official.get(same_setting(r))
            if off is None:
                continue
            setting = "CUDA graph" if r.get("cuda_graph") else "eager"
            extras = [
                label
                for key, label in (
                    ("loss_chunk_tokens", "chunked loss"),
                    ("optimizer_in_backward", "optimizer in backward"),
                    ("offload_activations", "offload"),
                )
                if r.get(key)
            ]
            # the policy a run recorded (kernel_policy), or before it the module flags
            triton_update = d.get("kernel_policy", {}).get(
                "triton_8bit_update",
                d.get("kernel_flags", {}).get("TRITON_8BIT_UPDATE_MEASURED_FASTER"),
            )
            if triton_update is False:
                extras.append("bitsandbytes' CUDA 8-bit update")
            elif triton_update:
                extras.append("Triton 8-bit update")
            if r.get("static_inputs"):  # a variant measured at 374b7c9, since dropped
                extras.append("layer inputs in static device buffers")
            if r.get("relayout"):  # poetxq.model.relayout after the optimizer's build
                extras.append("relaid out after the optimizer's build")
            elif r.get("compacted_after_build") or "--compact" in d.get("command", ""):
                extras.append("compacted build")
            if r.get("lm_head_by_slices", d.get("commit") in _SLICED_BEFORE_THE_FIELD):
                extras.append("LM-head gradient by slices")
            if r.get("alloc_conf"):
                extras.append(f"`PYTORCH_CUDA_ALLOC_CONF={r['alloc_conf']}`")
            setting = ", ".join([setting, *extras])
            ckpt, _, peak = _setting_cells(r)
            lines.append(
                f"| {r['model']} | {ckpt} | {setting} | "
                f"{peak} | {r['step_time_s']:.3f} | {off['peak_memory_gib']:.2f} | "
                f"{off['step_time_s']:.3f} | {off['step_time_s'] / r['step_time_s']:.2f}× | "
                f"≤ {r['target_peak_gib']}; ≥ 1.5× |"
            )
    lines.append("")
    lines += [_provenance(n, d) for n, d in docs + sources]
    return [*lines, ""]


#: commits whose gpu_memory rows sliced the LM-head gradient before the rows said so
_SLICED_BEFORE_THE_FIELD = ("3490c42", "10193c1")

SIDE_BY_SIDE_COMMIT = "d5a8a3e"
#: later calls without the official step in them, compared with the first call's official step
#: (stems: the current file of each)
LATER_STEPS = [
    "optim8bit_13b_ours",
    "gpu_memory_8b_graph_oib_off_split64",
    "gpu_memory_13b_default_sizes",
    "gpu_memory_13b_relayout_expandable",
    "gpu_memory_8b_relayout_expandable",
]


def side_by_side(commit: str | None = None) -> list[str]:
    """The side-by-side section: layers and whole steps, ours beside the official code; the
    files of one call (``commit``), or by default the current file of each stem."""

    def name(stem: str) -> str:
        return f"{stem}_h200_{commit}.json" if commit else current(stem)

    steps = [
        name(f"gpu_memory_{m}_{kind}")
        for m in ("8b", "13b")
        for kind in ("official", "graph", "oib", "oib_off")
    ]
    body = _side_by_side_layers(name("official_layers"))
    body += _side_by_side_steps(steps)
    body += _side_by_side_steps(
        [f"optim8bit_{run}_h200_2e10d2e.json" for run in ("13b_off", "13b_on", "13b_off2")],
        "Llama-13B without the chunked loss, beside the official step of a later call "
        "(bitsandbytes' 8-bit update as its CUDA op and as its Triton kernel)",
    )
    first_call = [name(f"gpu_memory_{m}_official") for m in ("8b", "13b")]
    body += _side_by_side_steps(
        [name(stem) for stem in LATER_STEPS],
        "Later calls against the first call's official step (our 8-bit update; the optimizer "
        "step inside the CUDA graph; every storage laid out afresh after the optimizer's build)",
        official_from=first_call,
    )
    return ["## Side by side with the official POET-X / POET-XQ code", "", *body] if body else []


def _link(text: str, name: str) -> str:
    return f"[{text}](evals/results/{name})"


def _official_step(row: dict[str, Any]) -> float | None:
    """The official step time beside ``row``: measured in its own call, else in the current
    ``gpu_memory_<size>_official`` file's row of the same model and setting."""
    if "official_measured" in row:
        return row["official_measured"]["step_time_s"]
    size = row["model"].removeprefix("llama-")
    d = _load(current(f"gpu_memory_{size}_official")) or {"results": []}
    key = ("gradient_checkpointing", "batch_size", "seq_len")
    for r in d["results"]:
        if "official_measured" in r and all(r.get(k) == row.get(k) for k in key):
            return r["official_measured"]["step_time_s"]
    return None


def _memory_cell(size: str, stem: str, ckpt: bool) -> tuple[str, float] | None:
    """``8B [22.58 GiB, 1.65×](file)`` of the current file of ``stem`` (its row of the given
    checkpointing; a CUDA graph's peak is its reserved one) and that row's target in GiB."""
    name = current(stem)
    d = _load(name)
    row = next((r for r in (d or {}).get("results", []) if r["gradient_checkpointing"] == ckpt),
               None)  # fmt: skip
    if row is None:
        return None
    peak = _peak_cell(row, 2).removesuffix(" (reserved)")
    off = _official_step(row)
    speed = f", {off / row['step_time_s']:.2f}×" if off else ""
    return f"{size.upper()} {_link(f'{peak} GiB{speed}', name)}", row["target_peak_gib"]


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


def _throughput_rows() -> list[str]:
    files = {size: current(f"throughput_{size}") for size in ("1b", "3b")}
    docs = {size: _load(name) for size, name in files.items()}
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
    d = _load(name)
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
    d = _load(name)
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(REPO / "docs" / "RESULTS.md"))
    ap.add_argument(
        "--side-by-side-out",
        default=str(RESULTS / f"official_side_by_side_h200_{SIDE_BY_SIDE_COMMIT}.md"),
        help="where the side-by-side tables (ours beside the official code) also go on their own",
    )
    ap.add_argument("--readme", default=str(README),
                    help="the README whose headline table to re-render ('': none)")  # fmt: skip
    args = ap.parse_args(argv)
    out, sbs_out = Path(args.out), Path(args.side_by_side_out)
    try:  # before any plot is drawn or folder made
        check_output_file(out, "--out", ValueError)
        check_output_file(sbs_out, "--side-by-side-out", ValueError)
    except ValueError as exc:
        ap.error(str(exc))
    sbs = side_by_side()
    if sbs:
        sbs_out.write_text("\n".join(["#" + sbs[0][2:], *sbs[1:]]).rstrip() + "\n")
        print(f"wrote {sbs_out}")
    img = out.parent / "img"
    img.mkdir(parents=True, exist_ok=True)
    sections = [
        _vertical_slice(),
        [
            "## Model quality",
            "",
            "POET-XQ against Q-GaLore, Q-APOLLO and AdamW, each tuned on the same budget, and "
            "parity with the official POET code: [QUALITY.md](QUALITY.md) (rendered by "
            "`python evals/quality.py report`).",
            "",
            *_precision(),
        ],
        [
            "## Training throughput at Llama-1B and 3B",
            "",
            "`poetxq bench` on random tokens through `evals/throughput.py`, 8,192 tokens per "
            "step, fp32 parameters under bf16 autocast unless a table says otherwise. The POET "
            "runs replay a CUDA graph (`train.cuda_graph: auto`), the baselines run eagerly with "
            "torch's fused AdamW; a CUDA-graph run's memory is its reserved peak. *fast* is "
            "`poet.variant=fast`; the recipes' default is `mem`.",
            "",
            *_throughput(img),
            *_tokens_table(current("throughput_1b"), "### Llama-1B, every method"),
            *_tokens_table(current("throughput_3b"), "### Llama-3B, every method"),
            *_gpu_time_table(
                "throughput_1b_profiled_h200_daf8277.json",
                "### Where the GPU time of a Llama-1B step goes (seq 256, torch.profiler)",
            ),
            *_tokens_table(
                "throughput_1b_nf4_h200_e853350.json", "### NF4 `W0` (`poetxq4`) at Llama-1B"
            ),
            *_tokens_table(
                "throughput_bf16true_h200_51324b4.json",
                "### `train.precision: bf16-true` (bf16 parameters, no autocast)",
            ),
            *_tokens_table(
                "throughput_1b_adamw_graph_h200_880ffdd.json",
                "### AdamW in a CUDA graph too (`train.cuda_graph: true`)",
            ),
        ],
        side_by_side(),
        [
            "## Llama-8B / 13B on one GPU: memory",
            "",
            *_memory(),
            *_memory_lowmem(),
            *_memory_options_table(
                [
                    "gpu_memory_graph_h200_90a76c3.json",
                    "gpu_memory_graph_ckpt_chunk_h200_90a76c3.json",
                ],
                "### A CUDA graph's reserved peak against the estimate",
            ),
            *_ab_table(
                "fuse_elementwise_h200.json",
                "### Fused RMSNorm and rotary (`train.fuse_elementwise`), A/B",
                "fuse_elementwise",
                "fused",
            ),
        ],
        _kernel_targets() + _slab_gemms() + _cnp_hybrid(),
        _multi_gpu(),
    ]
    lines = [
        "# Results",
        "",
        "Generated by `python evals/render_results.py` from the JSON files in `evals/results/`, "
        "which hold the current measurement of each thing (older ones are in git history). Each "
        "table names its file, machine, date and commit; ratios are measured side by side in one "
        "run. How to measure again: [BENCHMARKS.md](BENCHMARKS.md).",
        "",
    ]
    for sec in sections:
        lines += sec
    out.write_text("\n".join(lines).rstrip() + "\n", encoding="utf-8")
    print(f"wrote {out}")
    if args.readme:
        readme = Path(args.readme)
        text = readme.read_text(encoding="utf-8")
        try:
            new = render_readme(text)
        except ValueError as exc:
            print(f"{readme}: headline table left as it is ({exc})", file=sys.stderr)
            return 0
        if new != text:
            readme.write_text(new, encoding="utf-8")
            print(f"wrote {readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
