"""The side-by-side section of docs/RESULTS.md: ours beside the official POET-X / POET-XQ code.

One layer's forward+backward against the official layers (``gpu_suite.py --parts overhead
--official``) and whole Llama-8B / 13B training steps against the official step measured in the
same device call, or in an earlier one (``evals/gpu_memory.py --official``). :func:`side_by_side`
builds the section, which ``evals/render_results.py`` also writes on its own, to the file named
after :data:`SIDE_BY_SIDE_COMMIT`.
"""

from __future__ import annotations

from typing import Any

from results_files import current, load, provenance, setting_cells

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
    d = load(name)
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
    return [*lines, "", provenance(name, d), ""]


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
    docs = [(n, d) for n in names if (d := load(n)) is not None]
    if not docs:
        return []
    sources = [(n, d) for n in official_from if (d := load(n)) is not None]

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
            ckpt, _, peak = setting_cells(r)
            lines.append(
                f"| {r['model']} | {ckpt} | {setting} | "
                f"{peak} | {r['step_time_s']:.3f} | {off['peak_memory_gib']:.2f} | "
                f"{off['step_time_s']:.3f} | {off['step_time_s'] / r['step_time_s']:.2f}× | "
                f"≤ {r['target_peak_gib']}; ≥ 1.5× |"
            )
    lines.append("")
    lines += [provenance(n, d) for n, d in docs + sources]
    return [*lines, ""]


#: commits whose gpu_memory rows sliced the LM-head gradient before the rows said so
_SLICED_BEFORE_THE_FIELD = ("3490c42", "10193c1")

#: the call of the side-by-side file that render_results also writes (its --side-by-side-out)
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


def side_by_side_on(machine: str, card: str) -> list[str]:
    """The whole-step rows of ``evals/headline.py`` part 2 run on another card (``machine``, e.g.
    ``h100``): the current file of each part-2 stem, each call's official step beside ours."""
    import headline

    stems = [s.stem for s in headline.STEPS if s.part == "2"]
    return _side_by_side_steps(
        [current(stem, machine) for stem in stems],
        f"The same steps on {card} (`evals/headline.py --part 2`)",
    )
