"""The one-GPU sections of docs/RESULTS.md: Llama-8B / 13B memory, and the kernels.

The memory estimator against measured peaks (``evals/gpu_memory.py`` files: eager, with the
memory options, a CUDA graph's reserved peak, the fused-elementwise A/B), issue 3's kernel
targets of one run (``evals/kernel_targets.py``), the slab-streamed weight GEMMs against bf16
cuBLAS (``evals/bench_slab_decode.py``) and the Cayley–Neumann hybrid layout
(``evals/bench_cnp.py``). Each builder returns the Markdown lines of its table, or none when its
results file is absent.
"""

from __future__ import annotations

from results_files import current, load, provenance, setting_cells


def memory_estimate(name: str = "gpu_memory_h200.json") -> list[str]:
    """The estimator against the measured peak of one eager step at 8B / 13B."""
    d = load(name)
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
    return [*lines, "", provenance(name, d), ""]


def ab_table(name: str, title: str, label: str, column: str) -> list[str]:
    """Step time and peak memory of each row of an A/B file, ``label`` naming the variant."""
    d = load(name)
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
        ckpt, graph, peak = setting_cells(r)
        lines.append(
            f"| {r['model']} | {ckpt} | {graph} | {r[label]} | {r.get('call', 0)} | {peak} | "
            f"{r['step_time_s']:.3f} | {r['official_step_s']:.2f} | "
            f"{r['speedup_vs_official']:.2f} |"
        )
    return [*lines, "", provenance(name, d), "", f"Note: {d['note']}", ""]


def memory_lowmem() -> list[str]:
    name = "gpu_memory_lowmem_h200.json"
    d = load(name)
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


def memory_options_table(names: list[str], title: str) -> list[str]:
    """Llama-8B / 13B rows of several ``evals/gpu_memory.py`` files, with their memory options:
    a CUDA-graph row's peak is its reserved peak (:func:`peak_cell`), and the warm-up step's
    allocated peak (which holds the capture) is shown beside it where recorded."""
    files = [(n, d) for n in names if (d := load(n)) is not None]
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
            ckpt, graph, peak = setting_cells(r)
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
        lines.append(f"{i}. {provenance(name, d)}{note}")
    return [*lines, ""]


#: the streamed-GEMM run at the current decoder defaults: (key in the file, column heading)
SLAB_GEMM_COLUMNS = (
    ("int8 default 32MiB balanced", "int8"),
    ("nf4 picked 32MiB balanced", "NF4"),
    ("bnb", "bitsandbytes NF4"),
)


def kernel_targets_section(name: str | None = None, card: str = "") -> list[str]:
    """Issue 3's targets from one run (default: the current H200 one), each beside its floor
    (``evals/kernel_targets.py``); ``card`` ends the heading (``"on an H100"``)."""
    import kernel_targets

    name = name or current("kernel_targets")
    d = load(name)
    if d is None:
        return []
    d["targets"] = kernel_targets.targets(d)
    heading = f"## Kernel targets in one run {card}".strip()
    text = kernel_targets.render(d, f"evals/results/{name}", heading=heading, profile=False)
    return [*text.splitlines(), ""]


def slab_gemms(name: str = "slab_decode_h200_8b1763c.json") -> list[str]:
    """The weight GEMMs against bf16 cuBLAS in GPU time (``evals/bench_slab_decode.py``)."""
    d = load(name)
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
    return [*lines, "", provenance(name, d), ""]


def cnp_hybrid() -> list[str]:
    name = "cnp_hybrid_h200.json"
    d = load(name)
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
    return [*lines, "", provenance(name, d), ""]
