"""The run plan: every run-level decision a recipe gets on a device, resolved once.

A recipe says what the user asked for; several of its keys are settings whose value on a run
depends on the device, the number of processes and the GPU's memory (``train.memory: auto``,
``train.cuda_graph: auto``, ``train.grad_sync: auto``, ``train.fuse_elementwise: auto``,
``train.precision: auto``) or on the environment (``POETXQ_META_INIT``, ``POETXQ_KERNELS``,
``PYTORCH_CUDA_ALLOC_CONF``). :func:`resolve_plan` decides all of them once, with the deciding
functions where each rule is documented and measured, and returns a frozen :class:`RunPlan`:

=================  ===========================================================================
field              decided by
=================  ===========================================================================
``recipe``         :func:`poetxq.training.memory.resolve_memory_plan` (the recipe that runs)
``memory``         the same (:class:`~poetxq.training.memory.PlanChoice`)
``cuda_graph``     :func:`poetxq.training.cudagraph.graph_wanted`
``grad_sync``      :func:`poetxq.training.cudagraph.grad_sync_mode`
``precision``      :func:`poetxq.training.precision.run_precision`
``meta_init``      :func:`poetxq.training.build.use_meta_init`
``fuse``           :func:`poetxq.model.fuse.fuse_wanted`
``relayout``       :func:`poetxq.model.relayout.relayout_planned`
``kernels``        :func:`quant_kernels.policy.default_policy` (or the caller's policy)
``refusals``       what this launch cannot run, one line each with the fix
``notes``          the lines the run prints about its plan
=================  ===========================================================================

The trainer (:mod:`poetxq.training.train`) and ``poetxq bench`` read the plan instead of the
recipe's switches; the run directory keeps it as ``plan.json`` beside ``recipe.yaml``; ``poetxq
plan`` prints the plan a recipe would get on this machine or a GPU of a given size.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from poetxq.model.fuse import fuse_wanted
from poetxq.model.relayout import relayout_planned
from poetxq.training.build import use_meta_init
from poetxq.training.cudagraph import grad_sync_mode, graph_hint, graph_wanted
from poetxq.training.memory import ONE_PROCESS_KEYS, PlanChoice, resolve_memory_plan
from poetxq.training.precision import RunPrecision, cpu_note, run_precision
from poetxq.training.recipe import POET_METHODS, Recipe
from quant_kernels.policy import KernelPolicy, default_policy


@dataclass(frozen=True)
class RunPlan:
    """What a run of a recipe does on a device, decided once by :func:`resolve_plan`.

    Attributes:
        recipe: the recipe that runs: the one given with the memory plan's keys applied
            (``train.memory`` names the plan; ``recipe.yaml`` records it).
        device: the device type planned for (``cuda`` or ``cpu``).
        world_size: processes of the run.
        memory: the memory plan chosen, and why (:class:`~poetxq.training.memory.PlanChoice`).
        cuda_graph: the micro-steps replay a CUDA graph (``train.cuda_graph`` resolved; a failed
            capture under ``auto`` still falls back to eager steps at run time).
        grad_sync: ``none`` (one process), ``ddp`` or ``step`` (``train.grad_sync`` resolved).
        precision: ``autocast``, ``bf16-true`` or ``fp32`` (``train.precision`` resolved).
        meta_init: the model is built on the meta device and materialized on ``device``.
        fuse: RMSNorm, rotary and SwiGLU compiled into fused kernels
            (``train.fuse_elementwise`` resolved).
        relayout: the model's and optimizer's device memory is laid out afresh after the build
            (expandable segments and flattened optimizer groups).
        kernels: the kernel policy of the POET layers, their optimizer and the estimate.
        refusals: what this launch cannot run, one line each naming the fix (the trainer raises
            the first; empty when the plan runs).
        notes: the lines the run prints about its plan (memory plan, CPU bf16 warning, CUDA
            graph hint, gradient sync), in order.
    """

    recipe: Recipe
    device: str
    world_size: int
    memory: PlanChoice
    cuda_graph: bool
    grad_sync: str
    precision: RunPrecision
    meta_init: bool
    fuse: bool
    relayout: bool
    kernels: KernelPolicy
    refusals: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """The plan as a JSON-ready dict (``plan.json``): every decision, the memory plan's
        record, the kernel policy and the recipe's own notes; the recipe itself is
        ``recipe.yaml``."""
        return {
            "recipe": self.recipe.name,
            "method": self.recipe.method,
            "device": self.device,
            "world_size": self.world_size,
            "memory_plan": self.memory.to_dict(),
            "cuda_graph": self.cuda_graph,
            "grad_sync": self.grad_sync,
            "precision": self.precision,
            "meta_init": self.meta_init,
            "fuse_elementwise": self.fuse,
            "relayout": self.relayout,
            "kernels": self.kernels.to_dict(),
            "refusals": list(self.refusals),
            "notes": list(self.notes),
            "recipe_notes": self.recipe.notes,
        }

    def to_json(self) -> str:
        """:meth:`to_dict` as indented JSON text (a trailing newline)."""
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def lines(self) -> list[str]:
        """The plan in a few human-readable lines (``poetxq plan``)."""
        m, tc = self.memory, self.recipe.train

        def said(value: Any) -> str:  # as a recipe file spells it
            return str(value).lower() if isinstance(value, bool) else str(value)

        out = [
            f"plan of {self.recipe.name} ({self.recipe.method}) on {self.device}"
            + (f" x {self.world_size} processes" if self.world_size > 1 else ""),
            m.line(),
            f"cuda graph: {'on' if self.cuda_graph else 'off'} (train.cuda_graph "
            f"{said(tc.cuda_graph)})",
            f"grad sync: {self.grad_sync} (train.grad_sync {tc.grad_sync})",
            f"precision: {self.precision} (train.precision {tc.precision})",
            f"fused elementwise kernels: {'on' if self.fuse else 'off'} "
            f"(train.fuse_elementwise {said(tc.fuse_elementwise)})",
            f"meta init: {'on' if self.meta_init else 'off'}; relayout: "
            f"{'on' if self.relayout else 'off'}",
            "kernels: " + ", ".join(f"{k}={v}" for k, v in self.kernels.to_dict().items()),
        ]
        out += [f"refused: {r}" for r in self.refusals]
        out += [n for n in self.notes if n != m.line() and not n.startswith("grad sync:")]
        out += [f"note: {n}" for n in self.recipe.notes]
        return out


def _refusals(recipe: Recipe, cuda: bool, graph: bool, sync: str, world: int) -> list[str]:
    """What a launch of ``world`` processes cannot run (the schema checks what the recipe alone
    decides; these depend on the device and the processes), one line each with the fix."""
    tc = recipe.train
    out = []
    if tc.cuda_graph is True:
        if not cuda:  # the method is checked by the recipe schema
            out.append("train.cuda_graph needs a CUDA device; set train.cuda_graph: false")
        if world > 1 and tc.grad_sync == "ddp":
            out.append(
                "train.cuda_graph with train.grad_sync: ddp cannot work (DDP all-reduces "
                "inside backward, outside the graph); set train.grad_sync: step (or auto)"
            )
    for key in ONE_PROCESS_KEYS:  # no all-reduce of their gradients
        if world > 1 and getattr(tc, key):
            out.append(f"train.{key} runs in one process only; set train.{key}: false")
    if sync == "ddp" and tc.loss_chunk_tokens:  # it calls the bare model, past DDP's hooks
        out.append(
            "train.loss_chunk_tokens cannot run under DDP; set train.grad_sync: step (or "
            "auto), or train.loss_chunk_tokens: 0"
        )
    return out


def _sync_line(sync: str, world: int) -> str:
    how = (
        "DistributedDataParallel, all-reduce during backward"
        if sync == "ddp"
        else "one all-reduce of every gradient per step, after the micro-steps"
    )
    return f"grad sync: {sync} across {world} processes ({how}; train.grad_sync)"


def resolve_plan(
    recipe: Recipe,
    device: torch.device | str,
    world_size: int | None = None,
    gpu_memory_limit: int | None = None,
    *,
    vocab_size: int | None = None,
    kernels: KernelPolicy | None = None,
) -> RunPlan:
    """The :class:`RunPlan` of ``recipe`` on ``device`` with ``world_size`` processes.

    Args:
        recipe: a validated recipe (as written: the memory plan is applied here).
        device: where the run trains. On a CUDA device ``train.memory: auto`` fits the plan to
            the memory free there unless ``gpu_memory_limit`` is given; ``"cuda"`` with a
            ``gpu_memory_limit`` plans for a GPU this machine need not have.
        world_size: processes of the run (default ``$WORLD_SIZE`` or 1).
        gpu_memory_limit: bytes of GPU memory ``train.memory: auto`` plans for.
        vocab_size: the tokenizer's vocabulary for the memory estimate (default
            ``data.vocab_size``).
        kernels: the kernel policy (default :func:`quant_kernels.policy.default_policy`,
            ``POETXQ_KERNELS``).

    Returns:
        The plan; nothing in the process is changed (the trainer applies the memory plan's
        allocator setting itself, :func:`poetxq.training.memory.apply_allocator`).

    Raises:
        poetxq.training.memory.MemoryPlanError: the memory plan does not combine with the
            recipe.
        ValueError: ``POETXQ_META_INIT`` or ``POETXQ_KERNELS`` hold an unknown value.
    """
    world = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    resolved, choice = resolve_memory_plan(
        recipe, dev, gpu_mem=gpu_memory_limit, vocab_size=vocab_size, world=world
    )
    tc = resolved.train
    graph = graph_wanted(resolved, dev, world)
    sync = grad_sync_mode(tc, graph, world)
    precision = run_precision(tc, dev)
    notes: list[str] = []
    if cuda or choice.name != "fastest" or gpu_memory_limit is not None:  # CPU auto: no change
        notes.append(choice.line())
    if note := cpu_note(tc, dev):
        notes.append(note)
    if hint := graph_hint(resolved, dev, world):
        notes.append(hint)
    if sync != "none":
        notes.append(_sync_line(sync, world))
    return RunPlan(
        recipe=resolved,
        device=dev.type,
        world_size=world,
        memory=choice,
        cuda_graph=graph,
        grad_sync=sync,
        precision=precision,
        meta_init=use_meta_init(resolved, dev),
        fuse=fuse_wanted(tc, dev, graph),
        relayout=(
            resolved.method in POET_METHODS
            and not tc.offload_optimizer  # its optimizer has no flattened groups
            and relayout_planned(dev, choice.allocator)
        ),
        kernels=_kernels(resolved, kernels),
        refusals=tuple(_refusals(resolved, cuda, graph, sync, world)),
        notes=tuple(notes),
    )


def _kernels(recipe: Recipe, kernels: KernelPolicy | None) -> KernelPolicy:
    """The layers' policy: the caller's (default :func:`default_policy`) with the recipe's
    ``poet.gemm`` where it names one (as :func:`poetxq.model.surgery.convert_to_poetx` applies)."""
    policy = default_policy() if kernels is None else kernels
    if recipe.method in POET_METHODS and recipe.poet.gemm != "auto":
        policy = dataclasses.replace(policy, w0_gemm=recipe.poet.gemm)
    return policy
