"""What ``--resume RUN_DIR|auto`` continues (:func:`plan_resume`): the run directory, its newest
checkpoint (:mod:`poetxq.training.checkpoint`) and the recipe to continue with, which may differ
from the checkpoint's only in :data:`RESUMABLE_KEYS` (settings that change no training state)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from poetxq.training.checkpoint import (
    CHECKPOINT_DIR,
    CheckpointError,
    latest_checkpoint,
    read_checkpoint,
)
from poetxq.training.memory import apply_plan, plan_overrides
from poetxq.training.recipe import Recipe, RecipeError
from poetxq.training.recipe_files import load_recipe


class RunFinished(Exception):
    """``--resume`` found its run already finished: its last checkpoint at ``train.max_steps``
    and its final ``model.safetensors`` written. Not an error (a requeued job repeats the command
    line that started it): the caller says so in one line (:meth:`line`) and exits 0."""

    def __init__(self, run_dir: Path, step: int, max_steps: int) -> None:
        super().__init__(f"run '{run_dir}' already finished at step {step} of {max_steps}")
        self.run_dir, self.step, self.max_steps = run_dir, step, max_steps

    def line(self) -> str:
        """The one line for the user: the run, its last step and where its results are."""
        summary = self.run_dir / "summary.json"
        try:
            ppl = json.loads(summary.read_text(encoding="utf-8")).get("final_val_ppl")
            results = f"its summary: {summary}" + (
                f" (final val ppl {ppl:.2f})" if isinstance(ppl, (int, float)) else ""
            )
        except (OSError, ValueError):  # stopped between model.safetensors and summary.json
            results = f"its final model: {self.run_dir / 'model.safetensors'} (no summary.json)"
        return (
            f"run '{self.run_dir}' already finished at step {self.step} of {self.max_steps} "
            f"(train.max_steps): nothing to do, nothing written; {results}. To train further, "
            "start a new run"
        )


#: recipe keys that may differ between a run and its resumption (they change no training state)
RESUMABLE_KEYS = frozenset(
    {
        "name",
        "train.save_every",
        "train.keep_last",
        "train.log_every",
        "train.eval_every",
        "train.eval_max_batches",
        "train.output_dir",
        "train.save_checkpoint",
        "data.cache_dir",
        # how memory is spent, not what is computed (equal losses: tests/test_lowmem.py)
        "train.gradient_checkpointing",
        "train.offload_activations",
        "train.optimizer_in_backward",
        "train.offload_optimizer",  # exact: equal losses, tests/test_offload.py
        "train.loss_chunk_tokens",
        # the same math in fused kernels (poetxq.model.fuse; bf16 rounding may differ in the last
        # bit)
        "train.fuse_elementwise",
        # the same kernels replayed from a CUDA graph (equal losses: cuda_graph_auto_h200.json)
        "train.cuda_graph",
        # the same average of the replicas' gradients, all-reduced during backward or after it
        # (equal losses: tests/test_distributed.py)
        "train.grad_sync",
        # what happens after the last step only (one more merge), not the state before it
        "poet.merge_at_end",
    }
)


def recipe_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Dotted keys (outside :data:`RESUMABLE_KEYS`) whose values differ, as ``key: a -> b``.

    Both arguments are ``Recipe.model_dump(mode="json")`` trees.
    """

    def flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in tree.items():
            if isinstance(v, dict):
                out.update(flat(v, f"{prefix}{k}."))
            else:
                out[f"{prefix}{k}"] = v
        return out

    a, b = flat(saved), flat(current)
    return [
        f"{k}: {a.get(k)!r} -> {b.get(k)!r}"
        for k in sorted(set(a) | set(b))
        if k not in RESUMABLE_KEYS and a.get(k) != b.get(k)
    ]


def plan_resume(
    resume: str,
    *,
    recipe_path: str | None,
    overrides: dict[str, Any],
    run_name: str | None,
) -> tuple[Recipe, Path | None, Path | None]:
    """Work out what ``--resume RUN_DIR|auto`` continues.

    * ``RUN_DIR``: the run in that directory, from its newest checkpoint. The recipe is
      ``recipe_path`` if given, else ``RUN_DIR/recipe.yaml`` (else the checkpoint's own), with
      ``overrides`` applied; an edit there outside :data:`RESUMABLE_KEYS` is refused.
    * ``auto``: the run ``<train.output_dir>/<run_name>`` of the given recipe if it holds a
      checkpoint; otherwise ``(recipe, None, None)``: start it fresh.

    Returns:
        ``(recipe, run_dir, checkpoint_dir)``; ``run_dir`` and ``checkpoint_dir`` are None for a
        fresh start under ``auto``.

    Raises:
        RunFinished: the run is finished (its last checkpoint at ``max_steps`` and its
            ``model.safetensors`` written), under ``auto`` and ``RUN_DIR`` alike: nothing to do
            (not an error; the recipe was checked against the checkpoint's first, so a changed
            ``train.max_steps`` is a mismatch, not "finished").
        poetxq.training.rundir.RunDirError: under ``auto``, a ``run_name`` that is not one
            folder name or that resolves outside ``train.output_dir``.
        CheckpointError: missing run directory or checkpoint, ``auto`` without ``run_name``, a
            corrupted checkpoint, or a recipe that differs from the
            checkpoint's in a key outside :data:`RESUMABLE_KEYS` (one line, naming the keys).
        poetxq.training.recipe.RecipeError: a bad recipe file or override.
    """
    own = None  # RUN_DIR/recipe.yaml when the recipe comes from there
    if resume == "auto":
        if not run_name:
            raise CheckpointError(
                "--resume auto needs --run-name NAME (the run to continue, or to start when it "
                "has no checkpoint yet)"
            )
        from poetxq.training.rundir import check_run_name, run_dir_inside

        check_run_name(run_name)
        recipe = load_recipe(recipe_path, overrides)
        run_dir = run_dir_inside(recipe.train.output_dir, run_name)
        ckpt = latest_checkpoint(run_dir)
        if ckpt is None:
            return recipe, None, None
    else:
        run_dir = Path(resume)
        if not run_dir.is_dir():
            what = "is not a directory" if run_dir.exists() else "does not exist"
            raise CheckpointError(
                f"--resume: run directory '{resume}' {what}; give the directory of an "
                "earlier run (it holds checkpoints/) or use --resume auto --run-name NAME"
            )
        ckpt = latest_checkpoint(run_dir)
        if ckpt is None and run_dir.parent.name == CHECKPOINT_DIR:  # a checkpoint, not a run
            raise CheckpointError(
                f"--resume: '{resume}' is one checkpoint of a run; pass the run directory "
                f"'{run_dir.parent.parent}' (its latest checkpoint is used)"
            )
        if ckpt is None:
            raise CheckpointError(
                f"--resume: '{resume}' holds no checkpoint (checkpoints/step-*); the run saved "
                "none (train with --save-every N; '--resume auto --run-name NAME' starts or "
                "continues a run by name) or this is not a run directory"
            )
        read_checkpoint(ckpt)  # fail on corruption before loading the recipe from it
        # the run's own recipe is the run directory's recipe.yaml (a user may edit the keys
        # that may change between sessions there), else the checkpoint's
        if recipe_path is None and (run_dir / "recipe.yaml").is_file():
            own = run_dir / "recipe.yaml"
        if own is not None:
            try:  # the file alone first: its own error names the checkpoint's copy
                load_recipe(own)
            except RecipeError as exc:
                raise RecipeError(
                    f"{exc} (the run's recipe; fix it, or move it away to resume with the "
                    f"checkpoint's copy, {ckpt / 'recipe.yaml'})"
                ) from None
        recipe = load_recipe(recipe_path or own or ckpt / "recipe.yaml", overrides)
        # the run stays where it is, whatever output_dir the recipe names
    meta = read_checkpoint(ckpt)
    saved = load_recipe(ckpt / "recipe.yaml")
    if recipe.train.memory in ("auto", saved.train.memory) and saved.train.memory != "auto":
        # the run chose its plan when it started (recipe.yaml holds the keys): the same plan,
        # named again or left at auto, is resolved on this recipe as it was then (not fitted
        # to this GPU again)
        applied, _ = plan_overrides(recipe, saved.train.memory)
        recipe = apply_plan(recipe, applied, saved.train.memory)
    diff = recipe_differences(saved.model_dump(mode="json"), recipe.model_dump(mode="json"))
    if recipe.train.optimizer_in_backward and not recipe.optim.grad_clip and saved.optim.grad_clip:
        # turning the optimizer into backward on needs clipping off (no global norm exists
        # then): the one change of the update rule a resume allows, said in a note
        diff = [d for d in diff if not d.startswith("optim.grad_clip:")]
        recipe.add_note(
            f"gradient clipping (optim.grad_clip {saved.optim.grad_clip}) is off from step "
            f"{meta['step'] + 1} on: train.optimizer_in_backward updates each parameter before "
            "a global gradient norm exists"
        )
    if diff:
        what = (
            "the recipe"
            if own is None
            else f"'{own}'" + (" with the flags given" if overrides else "")
        )
        raise CheckpointError(
            f"--resume: {what} differs from the checkpoint's ({ckpt.name}) in "
            f"{'; '.join(diff)}; resume with the run's own recipe (only save/log/eval, "
            "memory-option (not the memory plan), fuse_elementwise, cuda_graph, grad_sync and "
            "merge_at_end settings may change) or "
            "start a new run"
        )
    if meta["step"] >= recipe.train.max_steps:
        if (run_dir / "model.safetensors").is_file():
            raise RunFinished(run_dir, meta["step"], recipe.train.max_steps)
        # stopped after its last checkpoint, before the final model was written (killed, or a
        # full disk): the session evaluates and writes the final model and summary, no step
        recipe.add_note(
            f"run '{run_dir}' reached step {meta['step']} of {recipe.train.max_steps} but has "
            "no final model.safetensors: it is evaluated and written now, without training"
        )
    return recipe, run_dir, ckpt
