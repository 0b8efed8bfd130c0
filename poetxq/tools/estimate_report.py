"""``poetxq estimate-memory``'s text: memory sizes read from the command line
(:func:`parse_bytes`), the breakdown table with its fits / does-not-fit verdict
(:func:`format_estimate`), and the other POET layer variant's peak beside it."""

from __future__ import annotations

import re
from typing import Any

from poetxq.training.estimate import (
    CUDA_BLOCK,
    GRAPH_POOL_OVERHEAD,
    EstimateError,
    MemoryEstimate,
    estimate_memory,
)
from poetxq.training.recipe import POET_METHODS, Recipe


def parse_bytes(text: str) -> int:
    """``"80GB"`` / ``"80GiB"`` / ``"141 GiB"`` / ``"500MB"`` / ``"1e9"`` → bytes.

    GB and GiB are both read as 2**30 (as ``nvidia-smi`` and torch report), MB as 2**20; a bare
    number is bytes. Any size below 2**20 is an error (``80`` or ``80kB`` is surely a slip).

    Raises:
        EstimateError: the text is not a size.
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt]i?b?)?\s*", text.lower())
    if not m and text.strip().startswith("-"):
        raise EstimateError(f"memory size '{text}' must be positive; write e.g. 80GB")
    if not m:
        raise EstimateError(f"cannot read memory size '{text}'; write e.g. 80GB, 141GiB or 500MB")
    if m.group(2) is None and float(m.group(1)) < 2**20:  # "80": surely not 80 bytes of GPU
        example = f"{m.group(1)}GB" if float(m.group(1)) > 0 else "80GB"
        raise EstimateError(
            f"memory size '{text}' has no unit; write e.g. {example} (a bare number is "
            "bytes and must be at least 1 MiB)"
        )
    scale = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}.get((m.group(2) or " ")[0], 1)
    size = int(float(m.group(1)) * scale)
    if size <= 0:
        raise EstimateError(f"memory size '{text}' must be positive; write e.g. 80GB")
    if size < 2**20:  # "80kB": a unit slip, not a GPU
        raise EstimateError(f"memory size '{text}' is below 1 MiB; write e.g. 80GB")
    return size


def _size(x: int) -> str:
    """A GPU's memory in the verdict lines (:func:`poetxq.training.memory.size_text`)."""
    from poetxq.training.memory import size_text

    return size_text(x)


def _gib(x: int) -> str:
    return f"{x / 2**30:9.3f} GiB"


def other_variant(recipe: Recipe, **kwargs: Any) -> tuple[str, int] | None:
    """For a POET recipe, the other layer variant (``mem`` <-> ``fast``) and its predicted peak
    in bytes, so a user can see what the faster ``fast`` variant would need; None for the
    baselines. ``kwargs`` are :func:`estimate_memory`'s (vocab size, batch, seq, precision)."""
    if recipe.method not in POET_METHODS:
        return None
    other = "fast" if recipe.poet.variant == "mem" else "mem"
    alt = recipe.model_copy(update={"poet": recipe.poet.model_copy(update={"variant": other})})
    return other, estimate_memory(alt, **kwargs).peak


def format_other_variant(other: str, peak: int, gpu_mem: int | None = None) -> str:
    """The line :func:`format_estimate`'s table ends with for a POET recipe (see
    :func:`other_variant`), with fits / does not fit against ``gpu_mem`` bytes."""
    why = (
        "keeps each layer's GEMM output: one weight GEMM less per layer and step"
        if other == "fast"
        else "recomputes each layer's GEMM output in backward: less memory, slower"
    )
    fits = ""
    if gpu_mem is not None:
        from poetxq.training.memory import fit_verdict

        fits = f"{fit_verdict(peak, gpu_mem, headroom=0)} in {_size(gpu_mem)}; "
    return f"  {f'peak with poet.variant={other}':<31s}{_gib(peak)}  {fits}{why}"


def format_estimate(est: MemoryEstimate, gpu_mem: int | None = None) -> str:
    """A plain-text table of the breakdown and, with ``gpu_mem`` (bytes), fits / does not fit."""
    ckpt = "on" if est.gradient_checkpointing else "off"
    rows = [
        ("frozen / quantized weights", est.frozen_weights, f"{est.num_frozen:,} weights"),
        ("buffers (permutations, masks)", est.buffers, ""),
        ("trainable parameters", est.trainable_params, f"{est.num_trainable:,} parameters"),
        (
            (
                "gradients",
                est.in_backward_gradients,
                "alive at once, "
                + ("then to the host" if est.offload_optimizer else "optimizer in backward")
                + f" (all: {est.gradients / 2**30:.3f} GiB)",
            )
            if est.optimizer_in_backward or est.offload_optimizer
            else (
                "gradients",
                est.gradients,
                "static in the CUDA graph: all present from the start of backward"
                if est.cuda_graph
                else "all present at the optimizer step",
            )
        ),
        ("optimizer states", 0, f"in host memory (all: {est.optimizer_states / 2**30:.3f} GiB)")
        if est.offload_optimizer
        else ("optimizer states", est.optimizer_states, ""),
        ("activations", est.activations, f"checkpointing {ckpt}"),
        (
            "logits / loss",
            est.logits,
            f"[{est.batch_size * est.seq_len}, {est.vocab_size}]"
            + (f" in chunks of {est.loss_chunk_tokens} tokens" if est.loss_chunk_tokens else ""),
        ),
        ("workspace", est.workspace, "largest layer's transients"),
        ("optimizer temporaries", est.offload_transient, "one parameter's gradient and states")
        if est.offload_optimizer
        else ("optimizer temporaries", est.in_backward_transient, "per parameter, inside backward")
        if est.optimizer_in_backward
        else ("optimizer temporaries", est.optimizer_transient, "during optimizer.step"),
    ]
    if est.offload_optimizer:  # what HostOffload keeps on the GPU besides those
        acc = (
            "the largest gradient's accumulator (micro-batches 2+)"
            if est.offload_accumulator
            else "no accumulator (one micro-batch)"
        )
        norms = est.offload_norms // CUDA_BLOCK
        rows.append(("offload accumulator + norms", est.offload_accumulator + est.offload_norms,
                     f"{acc}; {norms:,} gradient norms"))  # fmt: skip
    if est.merge_workspace:
        rows.append(("merge workspace", est.merge_workspace,
                     "largest layer's fp32 R·W0·P, between steps"))  # fmt: skip
    if est.host_offloaded:
        what = ["checkpointed inputs"] if est.host_offloaded > est.host_optimizer else []
        what += ["gradients, optimizer states"] if est.host_optimizer else []
        rows.append(("offloaded to host (not GPU)", est.host_offloaded, " + ".join(what)))
    accum = f" x {est.grad_accum} micro-batches per step" if est.grad_accum > 1 else ""
    head = (
        f"memory estimate: {est.recipe} ({est.method}), batch {est.batch_size} x seq "
        f"{est.seq_len}{accum}, vocab {est.vocab_size:,}, {est.precision}"
    )
    lines = [head, "-" * len(head)]
    lines += [f"  {name:<31s}{_gib(v)}  {note}".rstrip() for name, v, note in rows]
    lines.append(f"  {'predicted peak':<31s}{_gib(est.peak)}  at the {est.peak_phase}")
    # the rows above are each term's largest size over the step: say what the peak adds up
    terms = " + ".join(f"{name} {b / 2**30:.3f}" for name, b in est.peak_terms)
    lines.append(f"  {'':<31s}= {terms} GiB")
    if gpu_mem is not None:  # fits at all (the plans' table below applies auto's headroom)
        from poetxq.training.memory import fit_verdict

        verdict = fit_verdict(est.peak, gpu_mem, headroom=0)
        lines.append(f"  {verdict} in {_size(gpu_mem)} ({est.peak / gpu_mem:.0%} used)")
        if est.cuda_graph:
            high = int(est.peak * (1 + GRAPH_POOL_OVERHEAD))
            verdict = fit_verdict(high, gpu_mem, headroom=0)
            lines.append(
                f"  with the graph pool's measured overhead (reserved up to "
                f"+{GRAPH_POOL_OVERHEAD:.0%}): {high / 2**30:.3f} GiB, {verdict}"
            )
    lines += [f"  note: {n}" for n in est.notes]
    return "\n".join(lines)


#: plans whose peaks differ by less than this share of the largest get format_plans' note
SAME_PEAK = 0.02


def format_plans(
    rows: list[dict[str, Any]],
    gpu_mem: int | None = None,
    largest: tuple[str, int] | None = None,
    method: str | None = None,
) -> str:
    """The memory plans of :func:`poetxq.training.memory_table.plan_table` as text: predicted peak,
    what each costs (recomputation, a CUDA graph's pool, host memory and traffic per step) and,
    with ``gpu_mem``, whether ``train.memory: auto`` would count it as fitting. Where the plans'
    peaks differ by under :data:`SAME_PEAK`, a note names ``largest`` (the peak's largest term,
    name and bytes), which no plan moves for ``method``."""
    from poetxq.training.memory import HEADROOM

    head = "memory plans (train.memory / --memory; auto takes the first that fits"
    head += f" with {HEADROOM:.0%} of the GPU kept free)" if gpu_mem else ")"
    lines = [head]
    for row in rows:
        cost = ["CUDA graph"] if row["cuda_graph"] else []
        cost += ["recomputes each layer"] if row["recompute"] else []
        if row["host"]:
            cost.append(f"host {row['host'] / 2**30:.2f} GiB")
        if row["host_traffic_per_step"]:
            cost.append(f"{row['host_traffic_per_step'] / 2**30:.2f} GiB host traffic per step")
        fits = "" if row["fits"] is None else ("fits  " if row["fits"] else "too big")
        lines.append(
            f"  {row['plan']:<9s}{_gib(row['peak'])}  {fits:<7s}  {', '.join(cost) or '-'}"
        )
    peaks = [row["peak"] for row in rows]
    if largest is not None and len(peaks) > 1 and max(peaks) - min(peaks) < SAME_PEAK * max(peaks):
        lines.append(
            f"  note: the plans change this peak by under {SAME_PEAK:.0%}: its largest term, "
            f"{largest[0]} {largest[1] / 2**30:.2f} GiB, stays on the GPU in every plan"
            + (f" for {method}" if method else "")
        )
    return "\n".join(lines)


def format_misfit(rows: list[dict[str, Any]], gpu_mem: int, named: str | None = None) -> str | None:
    """``estimate-memory --gpu-mem``'s last line where the run would not fit (the command then
    exits 1), judged on :func:`poetxq.training.memory_table.plan_table`'s rows by ``train.memory:
    auto``'s rule: no plan fits ``gpu_mem`` bytes, or the plan ``named`` by ``--memory`` does
    not (the line names the plan ``auto`` would take). None where the run fits."""
    from poetxq.training.memory import HEADROOM

    limit = f"{_size(gpu_mem)} with {HEADROOM:.0%} of it kept free"
    fitting = [r["plan"] for r in rows if r["fits"]]
    if not fitting:
        low = min(rows, key=lambda row: row["peak"])
        return (
            f"does not fit: no memory plan fits {limit} (smallest predicted peak: {low['plan']}, "
            f"{low['peak'] / 2**30:.2f} GiB); try a smaller batch or sequence, a larger GPU or "
            "several (docs/MEMORY.md)"
        )
    row = next((r for r in rows if r["plan"] == named), None)
    if row is None or row["fits"]:
        return None
    return (
        f"does not fit: the {named} plan predicts {row['peak'] / 2**30:.2f} GiB, over {limit}; "
        f"--memory {fitting[0]} fits (auto takes it)"
    )


def format_per_process(shared: dict[str, Any], gpu_mem: int | None = None) -> str:
    """``estimate-memory --processes N``'s lines for
    :func:`poetxq.training.memory_table.per_process_peaks`: first, where several processes take
    something away from the one-process estimate (its ``left_out`` and ``one_process_only``),
    one line that says so; then the per-GPU peak and what sharding ``W0`` would leave."""
    n, parts = shared["processes"], []
    if shared["left_out"]:
        keys = ", ".join(shared["left_out"])
        parts.append(f"plan {shared['plan']} leaves out {keys} (it serves one process)")
    if shared["one_process_only"]:
        keys = ", ".join(shared["one_process_only"])
        parts.append(f"{keys} runs in one process only (poetxq train refuses it)")
    lines = []
    if parts:
        lines.append(
            f"note: with {n} processes {'; '.join(parts)}: each GPU keeps its gradients and "
            "optimizer states, counted in the per-GPU peak below"
        )
    lines.append(
        f"per GPU with {n} data-parallel processes: {shared['data_parallel'] / 2**30:.2f} GiB "
        f"(plan {shared['plan']}, gradient sync {shared['grad_sync']}); with W0 sharded over "
        f"them (not implemented): {shared['w0_sharded'] / 2**30:.2f} GiB"
    )
    if gpu_mem:  # the same rule as train.memory: auto, per GPU
        from poetxq.training.memory import fit_verdict

        verdict = fit_verdict(shared["data_parallel"], gpu_mem)
        used = shared["data_parallel"] / gpu_mem
        lines.append(f"  per GPU: {verdict} in {_size(gpu_mem)} ({used:.0%} used)")
    return "\n".join(lines)
