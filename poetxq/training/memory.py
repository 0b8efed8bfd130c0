"""Memory plans: one choice, ``train.memory``, instead of eight memory keys.

A plan is a set of the memory options of :mod:`poetxq.training.lowmem`,
:mod:`poetxq.training.offload` and :mod:`poetxq.training.loss`, ordered from fastest to smallest:

=========  ==============================================================================
plan       what it sets (only where the recipe does not set the key itself)
=========  ==============================================================================
fastest    nothing: the recipe as written (CUDA graph, fused elementwise kernels where they
           apply)
balanced   ``train.gradient_checkpointing``, ``train.loss_chunk_tokens: 1024``, 8-bit AdamW
           states (``optim.state_bits: 8``, POET methods)
lowest     the same with ``train.loss_chunk_tokens: 256``, plus
           ``train.offload_activations``, ``train.offload_optimizer`` (gradients and
           optimizer states in host memory; clipping and accumulation exact) and
           ``train.precision: bf16-true`` (POET methods and AdamW)
=========  ==============================================================================

Keys a plan does not apply to a method are left out (8-bit states are the POET methods' own; the
optimizer offload serves POET and AdamW in one process, and gives way to a recipe that sets
``train.optimizer_in_backward`` or ``train.cuda_graph: true`` itself).

``auto`` (the default) takes, on a GPU, the first plan whose peak predicted by
:func:`poetxq.training.estimate.estimate_memory` fits the memory free on the device when the run
starts (or the size planned for with ``--gpu-mem``) with :data:`HEADROOM` of it kept free — for
the CUDA context, the allocator's fragmentation and the estimator's error (1–3 % of measured
peaks) — and, for a plan that replays a CUDA graph, the graph pool's measured overhead
(:data:`poetxq.training.estimate.GRAPH_POOL_OVERHEAD`) on top; where none fits it takes
``lowest`` and says so. On a CPU ``auto`` is ``fastest``. A ``--model`` checkpoint is estimated
with its own shape (its ``config.json``); where there is no local one, ``auto`` is ``fastest``
(``--memory`` chooses there).
``balanced`` and ``lowest`` also turn on the allocator's expandable segments
(``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, which the trainer sets itself), as the
measured low-memory runs of docs/MEMORY.md had it.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError

from poetxq.training.cudagraph import graph_wanted
from poetxq.training.estimate import (
    GRAPH_POOL_OVERHEAD,
    EstimateError,
    MemoryEstimate,
    estimate_memory,
)
from poetxq.training.precision import run_precision
from poetxq.training.recipe import POET_METHODS, Recipe

#: the plans in the order ``auto`` tries them (fastest first)
PLANS: tuple[str, ...] = ("fastest", "balanced", "lowest")
#: share of the device memory ``auto`` keeps free of the predicted peak (module docstring)
HEADROOM = 0.10
#: the allocator setting of the balanced and lowest plans
EXPANDABLE = "expandable_segments:True"


def size_text(n_bytes: int) -> str:
    """A GPU's memory as the verdict lines print it: GiB to 0.1 (``80.0 GiB``), MiB below 1 GiB
    (``10 MiB``), so a small ``--gpu-mem`` never reads ``0.0 GiB``."""
    return f"{n_bytes / 2**30:.1f} GiB" if n_bytes >= 2**30 else f"{n_bytes / 2**20:.0f} MiB"


def fit_verdict(peak_bytes: int, gpu_mem_bytes: int, headroom: float = HEADROOM) -> str:
    """Whether a predicted peak fits a GPU's memory, in the words the reports print.

    Args:
        peak_bytes: the predicted peak, in bytes.
        gpu_mem_bytes: the GPU memory planned for, in bytes (``--gpu-mem`` or what is free).
        headroom: share of ``gpu_mem_bytes`` to keep free (default :data:`HEADROOM`, what
            ``train.memory: auto`` keeps free); 0 asks only whether the peak fits at all.

    Returns:
        ``"fits"`` where ``peak_bytes <= gpu_mem_bytes * (1 - headroom)``;
        ``"does not leave 10% free"`` (``headroom`` as a percentage) where the peak fits in
        ``gpu_mem_bytes`` but eats into the headroom; ``"does not fit"`` above
        ``gpu_mem_bytes``.
    """
    if peak_bytes <= gpu_mem_bytes * (1 - headroom):
        return "fits"
    if peak_bytes <= gpu_mem_bytes:
        return f"does not leave {headroom:.0%} free"
    return "does not fit"


_PLAN_KEYS: dict[str, dict[str, Any]] = {
    "fastest": {},
    "balanced": {
        "train.gradient_checkpointing": True,
        "train.loss_chunk_tokens": 1024,
        "optim.state_bits": 8,
    },
    "lowest": {
        "train.gradient_checkpointing": True,
        "train.offload_activations": True,
        "train.offload_optimizer": True,
        "train.loss_chunk_tokens": 256,
        "optim.state_bits": 8,
        "train.precision": "bf16-true",
    },
}
#: the keys a run of several processes cannot have (no all-reduce of their gradients)
ONE_PROCESS_KEYS = ("offload_optimizer", "optimizer_in_backward")
#: the methods a plan key applies to (others: every method)
_APPLIES: dict[str, tuple[str, ...]] = {
    "optim.state_bits": POET_METHODS,
    "train.precision": (*POET_METHODS, "adamw"),
    "train.offload_optimizer": ("poetxq", "poetx", "adamw"),
}


class MemoryPlanError(ValueError):
    """A memory plan that cannot be resolved (unknown name, or keys the recipe's own settings
    refuse)."""


@dataclass
class PlanChoice:
    """The memory plan a run takes (``summary.json`` ``memory_plan``; sizes in bytes).

    Attributes:
        name: ``fastest``, ``balanced`` or ``lowest``.
        chosen_by: ``auto`` (fitted to ``device_memory``), ``train.memory`` (named), or, for a
            ``--model`` checkpoint under ``auto``, the reason it stays ``fastest``.
        applied: the keys the plan set, dotted (``{"train.offload_optimizer": True, ...}``).
        kept: the plan's keys the recipe sets itself, with the recipe's value (explicit keys win).
        overridden: the keys of ``kept`` an override set (a command-line flag or ``--set``,
            :attr:`Recipe.overridden <poetxq.training.recipe.Recipe.overridden>`), not a recipe
            file.
        left_out: the plan's keys this run cannot take, with why (:func:`plan_left_out`, e.g.
            ``train.offload_optimizer`` with several processes).
        predicted_peak: the estimator's peak of the resolved recipe (None on a CPU).
        device_memory: the memory planned for: what the GPU has free when the run starts, or
            ``--gpu-mem`` (None on a CPU).
        memory_source: where ``device_memory`` comes from (``free on <GPU>`` or ``--gpu-mem``).
        allocator: the CUDA allocator setting the plan applies, or None.
        tried: with ``auto``, each plan tried before the choice and its predicted peak.
        graphed: the plans of ``tried`` that replay a CUDA graph (their limit leaves room for
            the graph's pool, :data:`~poetxq.training.estimate.GRAPH_POOL_OVERHEAD`).
    """

    name: str
    chosen_by: str
    applied: dict[str, Any] = field(default_factory=dict)
    kept: dict[str, Any] = field(default_factory=dict)
    overridden: list[str] = field(default_factory=list)
    left_out: dict[str, str] = field(default_factory=dict)
    predicted_peak: int | None = None
    device_memory: int | None = None
    memory_source: str | None = None
    allocator: str | None = None
    tried: dict[str, int] = field(default_factory=dict)
    graphed: tuple[str, ...] = ()

    def line(self) -> str:
        """The run's one line about its memory, e.g. ``memory plan: lowest (auto: ...)``."""
        text = f"memory plan: {self.name} ({self.chosen_by}"
        if self.tried:
            pool = f" + {GRAPH_POOL_OVERHEAD:.1%} CUDA graph pool"
            over = ", ".join(
                f"{k} {size_text(v)}{pool if k in self.graphed else ''}"
                for k, v in self.tried.items()
            )
            text += f"; {over} predicted, over the limit"
        text += ")"
        if self.predicted_peak is not None and self.device_memory is not None:
            text += (
                f", predicted peak {self.predicted_peak / 2**30:.2f} GiB of "
                f"{size_text(self.device_memory)}"
                + (f" ({self.memory_source})" if self.memory_source else "")
            )
            if fit_verdict(self.predicted_peak, self.device_memory) != "fits":
                # lowest only where it was not found larger already (a baseline's can be)
                lower = "" if "lowest" in (self.name, *self.tried) else "--memory lowest, "
                text += (
                    f" - does not leave {HEADROOM:.0%} free: expect out-of-memory; try {lower}a "
                    "smaller batch, a larger GPU or several (docs/MEMORY.md)"
                )
        over = {k: v for k, v in self.kept.items() if k in self.overridden}
        own = {k: v for k, v in self.kept.items() if k not in self.overridden}
        if over:
            text += "; kept as overridden (--set or a flag): "
            text += ", ".join(f"{k}={v}" for k, v in over.items())
        if own:
            text += "; kept from the recipe: " + ", ".join(f"{k}={v}" for k, v in own.items())
        if self.left_out:
            text += "; left out: " + ", ".join(f"{k} ({why})" for k, why in self.left_out.items())
        return text

    def to_dict(self) -> dict:
        """JSON-ready dict."""
        return asdict(self)


def plan_overrides(recipe: Recipe, plan: str, world: int = 1) -> tuple[dict, dict]:
    """The keys ``plan`` sets on ``recipe`` and the plan keys ``recipe`` sets itself.

    A key counts as set by the recipe when a recipe file or an override named it (pydantic's
    ``model_fields_set`` of its section); those keep their value (:class:`PlanChoice` tells the
    overrides apart, :attr:`Recipe.overridden <poetxq.training.recipe.Recipe.overridden>`).
    Keys that do not apply to the recipe's method are left out, and so is
    ``train.offload_optimizer`` with several processes (``world``), which it does not serve, and
    beside the recipe's own ``train.optimizer_in_backward`` or ``train.cuda_graph: true``
    (:func:`plan_left_out` says why).

    Returns:
        ``(applied, kept)``: dotted key -> value.

    Raises:
        MemoryPlanError: unknown ``plan``.
    """
    if plan not in _PLAN_KEYS:
        raise MemoryPlanError(f"unknown memory plan '{plan}'; choose auto or one of {PLANS}")
    applied: dict[str, Any] = {}
    kept: dict[str, Any] = {}
    for key, value in _PLAN_KEYS[plan].items():
        section, name = key.split(".")
        if recipe.method not in _APPLIES.get(key, (recipe.method,)):
            continue
        if key == "train.offload_optimizer" and _offload_gives_way(recipe, world):
            continue  # one process, eager steps; the recipe's own way of freeing gradients wins
        part = getattr(recipe, section)
        if name in part.model_fields_set:
            kept[key] = getattr(part, name)
        else:
            applied[key] = value
    return applied, kept


def _offload_gives_way(recipe: Recipe, world: int) -> str | None:
    """Why a plan's ``train.offload_optimizer`` is left out of ``recipe``'s run of ``world``
    processes (:class:`~poetxq.training.offload.HostOffload` serves one process with eager
    steps, and the recipe's own way of freeing gradients wins), or None where it applies."""
    if world > 1:
        return f"{world} processes; it serves one"
    if recipe.train.optimizer_in_backward:
        return "the recipe's train.optimizer_in_backward frees the gradients"
    if recipe.train.cuda_graph is True:
        return "the recipe's train.cuda_graph: true; it runs eager steps"
    return None


def plan_left_out(recipe: Recipe, plan: str, world: int = 1) -> dict[str, str]:
    """The keys of ``plan`` not set by the recipe itself that its run of ``world`` processes
    leaves out (:func:`plan_overrides`): those of other methods and those that give way: dotted
    key -> why, e.g. ``{"train.offload_optimizer": "2 processes; it serves one"}``,
    ``{"optim.state_bits": "poetxq, poetx only"}`` for a Q-GaLore run.

    Raises:
        MemoryPlanError: unknown ``plan``.
    """
    applied, kept = plan_overrides(recipe, plan, world)
    out: dict[str, str] = {}
    for key in _PLAN_KEYS[plan]:
        if key in applied or key in kept:
            continue
        section, name = key.split(".")
        if recipe.method not in _APPLIES.get(key, (recipe.method,)):
            if name not in getattr(recipe, section).model_fields_set:
                out[key] = f"{', '.join(_APPLIES[key])} only"
            continue
        why = _offload_gives_way(recipe, world) if key == "train.offload_optimizer" else None
        if why and name not in getattr(recipe, section).model_fields_set:
            out[key] = why
    return out


def apply_plan(recipe: Recipe, applied: dict[str, Any], plan: str) -> Recipe:
    """``recipe`` with the ``applied`` keys set and ``train.memory`` naming ``plan``: a copy
    validated again (the combination checks of :class:`~poetxq.training.recipe.Recipe` run on
    it) that keeps ``recipe``'s notes and overridden keys. ``recipe`` itself is left as it is."""
    if not applied:  # nothing to validate again: a copy (notes and all), renamed
        same = recipe.model_copy(deep=True)  # notes and overridden keys too
        same.train.memory = plan  # type: ignore[assignment]
        return same
    tree = recipe.model_dump(exclude_unset=True)
    for key, value in {**applied, "train.memory": plan}.items():
        section, name = key.split(".")
        tree.setdefault(section, {})[name] = value
    try:
        resolved = Recipe.model_validate(tree)
    except ValidationError as exc:
        why = exc.errors()[0]["msg"].removeprefix("Value error, ")
        raise MemoryPlanError(
            f"memory plan {plan} does not combine with this recipe: {why}; change that key or "
            "choose another plan (--memory)"
        ) from None
    for note in recipe.notes:
        resolved.add_note(note)
    resolved.mark_overridden(recipe.overridden)
    return resolved


#: the config.json fields of a Llama-family checkpoint the estimator reads
_SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers",
               "num_key_value_heads", "head_dim", "tie_word_embeddings")  # fmt: skip


def estimation_recipe(recipe: Recipe, *, check_positions: bool = False) -> Recipe | None:
    """The recipe the estimator reads for ``recipe``: itself, or for a ``--model`` checkpoint
    (``model.pretrained``) a copy whose model section and vocabulary are the checkpoint's, read
    from its ``config.json`` (JSON, no code; the copy keeps the recipe's name, a run name:
    ``estimate-memory``'s title names that file instead). None where that file is not
    a local one or lacks a field the recipe's model section needs (a hub id, a named base not
    converted yet).

    With ``check_positions`` (``poetxq estimate-memory``), a ``train.seq_len`` above the
    checkpoint's own ``max_position_embeddings`` is refused as ``poetxq train`` refuses it
    (:func:`poetxq.model.pretrained.check_seq_len`). Only here is that value known: the copy's
    model section has it raised to ``train.seq_len`` by the recipe's validator.

    Raises:
        EstimateError: with ``check_positions``, ``train.seq_len`` exceeds the checkpoint's
            ``max_position_embeddings``.
    """
    ref = recipe.model.pretrained
    if ref is None:
        return recipe
    path = Path(ref) / "config.json"
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
        # the keys set so far stay the only ones set: a plan still fills the others in
        tree = recipe.model_dump(mode="json", exclude_unset=True)
        model = tree.setdefault("model", {})
        model.update({k: cfg[k] for k in _SHAPE_KEYS if k in cfg}, pretrained=None)
        model["max_position_embeddings"] = cfg["max_position_embeddings"]
        tree.setdefault("data", {})["vocab_size"] = cfg["vocab_size"]
        shaped = Recipe.model_validate(tree)
    except (OSError, ValueError, KeyError, TypeError):  # ValidationError is a ValueError
        return None
    if check_positions:
        from types import SimpleNamespace

        from poetxq.model.pretrained import PretrainedError, check_seq_len

        own = SimpleNamespace(max_position_embeddings=cfg["max_position_embeddings"])
        try:
            check_seq_len(own, recipe.train.seq_len, ref)
        except PretrainedError as exc:
            raise EstimateError(str(exc)) from None
    return shaped


def plan_estimate(recipe: Recipe, vocab_size: int | None) -> MemoryEstimate:
    """The estimator's breakdown of ``recipe`` as a GPU run of it computes (its precision)."""
    return estimate_memory(
        recipe, vocab_size=vocab_size, precision=run_precision(recipe.train, "cuda")
    )


def plan_limit(recipe: Recipe, device_memory: int) -> int:
    """The largest predicted peak ``auto`` accepts for ``recipe`` (module docstring)."""
    room = device_memory * (1 - HEADROOM)
    return int(room / (1 + GRAPH_POOL_OVERHEAD)) if graph_wanted(recipe, "cuda") else int(room)


def resolve_memory_plan(
    recipe: Recipe,
    device: torch.device | str,
    *,
    gpu_mem: int | None = None,
    vocab_size: int | None = None,
    world: int | None = None,
) -> tuple[Recipe, PlanChoice]:
    """The recipe a run uses under its ``train.memory`` setting, and the choice made.

    Args:
        recipe: validated recipe (``train.memory``: ``auto`` or a plan name).
        device: where the run trains: on a CUDA device ``auto`` fits the plan to the memory
            free on it now (``torch.cuda.mem_get_info``: other processes' use counts), elsewhere
            ``auto`` is ``fastest``.
        gpu_mem: plan for this many bytes instead of the device's (a GPU one does not have).
        vocab_size: the tokenizer's vocabulary for the estimate (default ``data.vocab_size``).
        world: processes of the run (default ``$WORLD_SIZE`` or 1).

    Returns:
        ``(resolved recipe, PlanChoice)``; the resolved recipe's ``train.memory`` names the plan.

    Raises:
        MemoryPlanError: unknown plan name.
        pydantic.ValidationError: the plan's keys and the recipe's own do not combine (a plan
            gives way where it knows of a conflict, :func:`plan_overrides`).
    """
    world = int(os.environ.get("WORLD_SIZE", "1")) if world is None else world
    setting = recipe.train.memory
    on_gpu = torch.device(device).type == "cuda"
    source = "--gpu-mem" if gpu_mem is not None else None
    if gpu_mem is None and on_gpu:  # what is free now: other processes on the GPU count
        gpu_mem = torch.cuda.mem_get_info(torch.device(device))[0]
        source = f"free on {torch.cuda.get_device_name(torch.device(device))}"
    candidates = PLANS if setting == "auto" else (setting,)
    # the estimator reads the model section, which a --model checkpoint replaces by its own
    shaped = estimation_recipe(recipe)
    unknown_shape = shaped is None
    if shaped is not None and shaped is not recipe:
        vocab_size = None  # the checkpoint's vocabulary, not the tokenizer setting's
    if setting == "auto" and (gpu_mem is None or unknown_shape):
        candidates = ("fastest",)
    if unknown_shape:
        gpu_mem = None  # no prediction to compare with it
    seen: list[tuple[str, Recipe, dict, dict, int | None]] = []
    for name in candidates:
        applied, kept = plan_overrides(recipe, name, world)
        resolved = apply_plan(recipe, applied, name)
        peak = None
        if gpu_mem is not None and shaped is not None:
            # the same plan on the estimator's recipe (the checkpoint's shape for --model)
            on = resolved if shaped is recipe else apply_plan(shaped, applied, name)
            peak = plan_estimate(on, vocab_size).peak
        seen.append((name, resolved, applied, kept, peak))
        last = name == candidates[-1]
        if last and setting == "auto" and peak is not None and peak > plan_limit(resolved, gpu_mem):
            # none fits: the plan of the smallest peak (of equal ones the faster), not the last
            # (a baseline's lowest can predict more than its fastest)
            name, resolved, applied, kept, peak = min(seen, key=lambda c: c[4])
        if setting != "auto" or peak is None or last or peak <= plan_limit(resolved, gpu_mem):
            by = "auto" if setting == "auto" else "train.memory"
            # the plans passed over (before it, or all others where none fits)
            tried = {n: pk for n, _, _, _, pk in seen if n != name and pk is not None}
            if unknown_shape and setting == "auto":
                by = "auto: no local config.json to estimate the --model checkpoint by; --memory"
                by += " chooses"
            choice = PlanChoice(
                name=name,
                chosen_by=by,
                applied=applied,
                kept=kept,
                overridden=[k for k in kept if k in recipe.overridden],
                left_out=plan_left_out(recipe, name, world),
                predicted_peak=peak,
                device_memory=gpu_mem,
                memory_source=source if gpu_mem is not None else None,
                allocator=EXPANDABLE if name != "fastest" else None,
                tried=tried,
                graphed=tuple(n for n, r, *_ in seen if n in tried and graph_wanted(r, "cuda")),
            )
            return resolved, choice
    raise AssertionError("unreachable: the last candidate is always taken")


def apply_allocator(choice: PlanChoice) -> None:
    """Set ``choice``'s CUDA allocator setting for this process (segments allocated from now on;
    call before the model is built): in torch's allocator and in ``PYTORCH_CUDA_ALLOC_CONF``, which
    :func:`poetxq.model.relayout.relayout_wanted` reads. An ``expandable_segments`` setting the
    user made in the environment stays as it is. No effect without CUDA or without a setting."""
    from poetxq.model.relayout import alloc_conf

    if not choice.allocator or not torch.cuda.is_available():
        return
    if "expandable_segments" in alloc_conf():  # the user's own choice
        return
    current = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(x for x in (current, choice.allocator) if x)
    torch.cuda.memory._set_allocator_settings(choice.allocator)
