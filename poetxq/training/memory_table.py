"""What-if tables of the memory plans for ``poetxq estimate-memory``: every plan of a recipe with
its predicted peak and host traffic (:func:`plan_table`), and the per-GPU peak of several
data-parallel processes (:func:`per_process_peaks`).

:mod:`poetxq.training.memory` resolves the one plan a run trains with; this module only reports,
with the same resolution and the same fit rule, so the table and a run never disagree.
"""

from __future__ import annotations

from typing import Any

from poetxq.training.cudagraph import grad_sync_mode
from poetxq.training.memory import (
    ONE_PROCESS_KEYS,
    PLANS,
    apply_plan,
    plan_estimate,
    plan_limit,
    plan_overrides,
    resolve_memory_plan,
)
from poetxq.training.recipe import Recipe


def plan_table(
    recipe: Recipe, *, gpu_mem: int | None = None, vocab_size: int | None = None
) -> list[dict[str, Any]]:
    """Every plan of ``recipe`` with its predicted peak, host memory and host traffic per step
    (``poetxq estimate-memory``): one dict per plan, sizes in bytes, ``fits`` against
    ``gpu_mem`` with ``auto``'s rule (None without ``gpu_mem``)."""
    rows = []
    for name in PLANS:
        applied, _ = plan_overrides(recipe, name)
        resolved = apply_plan(recipe, applied, name)
        est = plan_estimate(resolved, vocab_size)
        tc = resolved.train
        # optimizer offload: every gradient to the host per micro-batch (and back from the
        # second on), then every gradient and state to the GPU and every state back per step
        traffic = 0
        if tc.offload_optimizer:
            grads, states = est.gradients, est.host_optimizer - est.gradients
            traffic = grads * (2 * tc.grad_accum - 1) + grads + 2 * states
        if tc.offload_activations and tc.gradient_checkpointing:
            traffic += 2 * tc.grad_accum * (est.host_offloaded - est.host_optimizer)
        rows.append({
            "plan": name, "peak": est.peak, "host": est.host_offloaded,
            "host_traffic_per_step": traffic,
            "recompute": tc.gradient_checkpointing, "cuda_graph": est.cuda_graph,
            "fits": None if gpu_mem is None else est.peak <= plan_limit(resolved, gpu_mem),
            "applied": applied,
        })  # fmt: skip
    return rows


def per_process_peaks(
    recipe: Recipe,
    processes: int,
    *,
    gpu_mem: int | None = None,
    vocab_size: int | None = None,
) -> dict[str, Any]:
    """Predicted per-GPU peak of ``recipe`` trained by ``processes`` data-parallel processes
    (``poetxq estimate-memory --processes N``), sizes in bytes.

    ``data_parallel``: every process holds the whole model (:mod:`poetxq.training.distributed`),
    so it is the one-process estimate of the plan resolved for ``processes`` (no optimizer
    offload there: ``left_out`` says so), plus DDP's bucketed copy of every gradient where the
    gradients are all-reduced inside backward (``grad_sync`` ``ddp``). A recipe that sets
    ``train.offload_optimizer`` or ``train.optimizer_in_backward`` itself is estimated without
    them for several processes, whose run ``poetxq train`` refuses with them
    (``one_process_only`` names them). ``w0_sharded``: what sharding the frozen ``W0`` over the
    processes would leave (``W0 / N`` plus one gathered decoder layer); a what-if, poetxq does
    not shard ``W0``.

    Returns:
        ``processes``, ``plan``, ``grad_sync``, ``data_parallel``, ``w0_sharded`` (bytes),
        ``left_out`` (dotted key -> why, :func:`plan_left_out`) and ``one_process_only``
        (dotted keys).

    Raises:
        ValueError: ``processes < 1``.
    """
    if processes < 1:
        raise ValueError(f"--processes must be at least 1, got {processes}")
    resolved, choice = resolve_memory_plan(
        recipe, "cpu", gpu_mem=gpu_mem, vocab_size=vocab_size, world=processes
    )
    single = [k for k in ONE_PROCESS_KEYS if processes > 1 and getattr(resolved.train, k)]
    if single:  # the run would be refused with them (poetxq.training.train): estimated without
        train = resolved.train.model_copy(update=dict.fromkeys(single, False))
        resolved = resolved.model_copy(update={"train": train})
    est = plan_estimate(resolved, vocab_size)
    sync = grad_sync_mode(resolved.train, est.cuda_graph, processes)
    ddp = est.peak + (est.gradients if sync == "ddp" else 0)
    layer_w0 = est.frozen_weights // resolved.model.num_hidden_layers
    sharded = ddp - est.frozen_weights + -(-est.frozen_weights // processes) + layer_w0
    return {
        "processes": processes, "plan": choice.name, "grad_sync": sync,
        "data_parallel": ddp, "w0_sharded": sharded if processes > 1 else ddp,
        "left_out": choice.left_out, "one_process_only": [f"train.{k}" for k in single],
    }  # fmt: skip
