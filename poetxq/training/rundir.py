"""A run directory: where it is (named, claimed, checked writable), who writes it (an exclusive
lock per training process), and the files a run writes there besides its metrics and checkpoints
(:mod:`poetxq.training.checkpoint`): ``model.safetensors``, ``config.json`` and ``tokenizer/``
(what :mod:`poetxq.tools.export` reads back)."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch
from torch import nn

from poetxq.paths import NAME_RULE, RUN_LOCK, name_problem, shown, unwritable_reason
from poetxq.training.checkpoint import CHECKPOINT_DIR, write_tensors
from poetxq.training.recipe import Recipe, run_label

#: files a run writes into its directory
RUN_OUTPUTS = ("recipe.yaml", "plan.json", "metrics.jsonl", "model.safetensors", "summary.json",
               "config.json")  # fmt: skip
#: the run plan's file beside recipe.yaml (:func:`write_plan`)
PLAN_FILE = "plan.json"


class RunDirError(ValueError):
    """The run directory cannot be used (exists and is not empty)."""


def check_run_name(run_name: str | None, recipe: Recipe | None = None) -> None:
    """The one check of a run's folder name, whatever gave it: ``--run-name`` (``run_name``), or
    without one the recipe's ``name`` that the automatic ``<name>-<method>-<timestamp>`` starts
    with (checked by the recipe's schema too, repeated here for a recipe built otherwise). The
    name must be one folder name (:func:`poetxq.paths.name_problem`). Nothing is created.

    Raises:
        RunDirError: one line naming the name, what is wrong with it and the fix.
    """
    if run_name is not None:
        if (problem := name_problem(run_name)) is not None:
            raise RunDirError(
                f"--run-name {shown(run_name)} {problem}; it must be a plain folder name "
                f"({NAME_RULE}); use --output-dir to choose where runs go"
            )
    elif recipe is not None and (problem := name_problem(recipe.name)) is not None:
        raise RunDirError(
            f"the recipe's name {shown(recipe.name)} {problem}; {NAME_RULE}: give the recipe "
            "a plain name (name: my-run) or a --run-name, and --output-dir for where runs go"
        )


def run_dir_inside(output_dir: str | Path, name: str) -> Path:
    """``<output_dir>/<name>``, refused unless it resolves to a folder inside ``output_dir``:
    where ``name`` exists there as a symbolic link, its target must lie inside ``output_dir``
    too (a link placed there could otherwise send a run's files anywhere). ``name`` has passed
    :func:`check_run_name`.

    Raises:
        RunDirError: the name resolves outside ``output_dir`` (or to it).
    """
    out = Path(output_dir)
    path = out / name
    real_out = Path(os.path.realpath(out))
    real = Path(os.path.realpath(path))
    if real == real_out or real_out not in real.parents:
        raise RunDirError(
            f"run directory '{path}' is a link to '{real}', not a folder inside --output-dir "
            f"'{out}'; "
            "remove the link or choose another --run-name"
        )
    return path


def resolve_run_dir(
    recipe: Recipe, run_name: str | None, *, overwrite: bool = False, claim: bool = False
) -> Path:
    """``<train.output_dir>/<run_name or <name>-<method>-timestamp>`` (:func:`run_label`).

    Nothing is created here, except with ``claim`` and no ``run_name``: then the automatic name
    is taken by creating its (empty) directory, and where another run holds it already (two
    runs of one recipe started within the same second) the first free of ``<name>-2``,
    ``<name>-3``, ... is created instead. The caller removes it again if the run fails before it
    writes anything (:func:`release_unused_run_dir`). Only one process may claim: under a
    launcher every process computes its own name, and only process 0 writes there.

    Raises:
        RunDirError: the directory exists and is not empty (and ``overwrite`` is False, or
            it holds no previous run: ``overwrite`` never mixes a run into other files),
            ``run_name`` (or, without one, the recipe's name) is not one plain folder name
            (:func:`check_run_name`), or the directory resolves outside ``train.output_dir``
            (:func:`run_dir_inside`).
    """
    check_run_name(run_name, recipe)
    name = run_name or f"{run_label(recipe)}-{time.strftime('%Y%m%d-%H%M%S')}"
    path = run_dir_inside(recipe.train.output_dir, name)
    if claim and run_name is None:
        check_writable(path, "choose a writable --output-dir")
        return _claim(path)
    for p in (path.parent, path):
        if p.exists() and not p.is_dir():
            raise RunDirError(f"'{p}' exists and is not a directory; choose another run location")
    if path.exists() and any(p.name != RUN_LOCK for p in path.iterdir()):
        if not overwrite:
            raise RunDirError(
                f"run directory '{path}' already exists and is not empty; "
                "choose another --run-name or pass --overwrite"
            )
        if not any((path / name).exists() for name in ("recipe.yaml", "metrics.jsonl",
                                                        CHECKPOINT_DIR)):  # fmt: skip
            raise RunDirError(
                f"'{path}' holds files but no previous run (no recipe.yaml, metrics.jsonl or "
                f"{CHECKPOINT_DIR}/); --overwrite replaces runs only: choose another --run-name "
                "or an empty folder"
            )
    check_writable(path, "choose a writable --output-dir")
    return path


def _claim(path: Path) -> Path:
    """Create ``path`` (or the first of ``path-2``, ``path-3``, ... that does not exist yet) and
    return it; creating is atomic, so two processes never take the same one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for n in range(1, 1000):
        candidate = path if n == 1 else path.with_name(f"{path.name}-{n}")
        try:
            candidate.mkdir()
        except FileExistsError:
            continue
        return candidate
    raise RunDirError(f"'{path}' and 998 numbered variants exist; give --run-name")


def release_unused_run_dir(path: Path, existed: Path) -> None:
    """Remove ``path`` if it is an empty directory (a claimed run directory, see
    :func:`resolve_run_dir`, of a run that failed before writing anything), and every folder
    above it that is empty now, up to ``existed`` (the closest folder that existed before the
    claim, :func:`poetxq.paths.nearest_existing`; kept); else nothing."""
    existed = existed.absolute()
    path = path.absolute()
    while path != existed and existed in path.parents:
        try:
            path.rmdir()  # only succeeds when empty
        except OSError:
            return
        path = path.parent


def check_writable(path: Path, fix: str) -> None:
    """Fail before any work when ``path`` (or, where it does not exist yet, the nearest folder
    above it that does) cannot be written: a read-only file system or no permission.

    Raises:
        RunDirError: one line naming the folder and ``fix``.
    """
    if (why := unwritable_reason(path)) is not None:
        raise RunDirError(f"cannot write '{path}': {why}; {fix}")


_HELD_LOCKS: dict[str, IO[str]] = {}


def lock_run_dir(run_dir: Path) -> None:
    """Hold an exclusive advisory lock (``flock``) on ``<run_dir>/.poetxq.lock`` for this process,
    so that a second ``poetxq train`` into the same directory (a repeated ``--run-name``,
    ``--overwrite`` or ``--resume``) stops before it deletes or appends anything. The lock goes
    with the process (also when it is killed); :func:`unlock_run_dir` drops it earlier. Taking it
    again in the holding process is a no-op. Where ``fcntl`` is missing (Windows) or the file
    system refuses ``flock`` (some network mounts) nothing is locked.

    Raises:
        RunDirError: another process holds the lock (its pid is named when it wrote one).
    """
    key = str(run_dir.resolve())
    if key in _HELD_LOCKS:
        return
    handle = _flock(run_dir, "a+", "wait for it to finish or choose another --run-name")
    if handle is None:  # no flock here: train unlocked
        return
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    _HELD_LOCKS[key] = handle


def _flock(run_dir: Path, mode: str, fix: str) -> IO[str] | None:
    """``run_dir``'s lock file opened with ``mode`` and locked exclusively without waiting:
    the open handle (closing it releases the lock), or None where ``fcntl`` is missing or the
    file system refuses ``flock`` (some network mounts).

    Raises:
        RunDirError: another process holds the lock (its pid named when it wrote one; ``fix``
            says what to do).
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not on Linux / macOS
        return None
    handle = (run_dir / RUN_LOCK).open(mode, encoding="utf-8")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        owner = handle.read().strip()
        handle.close()
        who = f" (pid {owner})" if owner.isdigit() else ""
        raise RunDirError(
            f"run directory '{run_dir}' is in use by another poetxq process{who}; {fix}"
        ) from None
    except OSError:
        handle.close()
        return None
    return handle


def check_not_in_use(run_dir: Path) -> None:
    """Refuse ``run_dir`` when another process holds its :func:`lock_run_dir` lock, without
    keeping it (``--resume RUN_DIR`` asks before it reads the run's recipe, so a live run is
    named as such rather than as a recipe mismatch). Nothing happens without a lock file, in
    the holding process, or where ``flock`` is unavailable.

    Raises:
        RunDirError: another process holds the lock.
    """
    if str(run_dir.resolve()) in _HELD_LOCKS or not (run_dir / RUN_LOCK).is_file():
        return
    handle = _flock(run_dir, "r", "wait for it to finish (or stop it) and resume then")
    if handle is not None:
        handle.close()  # the probe's lock goes with it


def unlock_run_dir(run_dir: Path) -> None:
    """Release :func:`lock_run_dir`'s lock of this process (no-op when not held)."""
    handle = _HELD_LOCKS.pop(str(run_dir.resolve()), None)
    if handle is not None:
        handle.close()  # closing the descriptor releases the flock


def _atomic_write_bytes(path: Path, write: Callable[[Path], None]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_plan(run_dir: Path, plan: Any) -> None:
    """Write ``plan`` (a :class:`poetxq.training.plan.RunPlan`) as ``<run_dir>/plan.json``
    beside ``recipe.yaml``: every decision the run took (memory plan, CUDA graph, gradient sync,
    precision, meta init, fusion, relayout, kernel policy, refusals and notes). A resumed
    session writes its own."""
    path = run_dir / PLAN_FILE
    _atomic_write_bytes(path, lambda tmp: tmp.write_text(plan.to_json(), encoding="utf-8"))


def save_checkpoint(model: torch.nn.Module, path: Path) -> None:
    """Write ``model.state_dict()`` to ``path`` as safetensors, atomically (temp + rename)."""
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    _atomic_write_bytes(path, lambda tmp: write_tensors(state, tmp))  # tied tensors as copies


def keep_metrics_until(path: Path, step: int) -> None:
    """Drop records after ``step`` (and a torn last line) from ``metrics.jsonl``, atomically."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # the line a killed process was writing
        if isinstance(record, dict) and record.get("step", step + 1) <= step:
            kept.append(line + "\n")
    _atomic_write_bytes(path, lambda tmp: tmp.write_text("".join(kept), encoding="utf-8"))


TOKENIZER_DIR = "tokenizer"  # inside a run directory
CONFIG_FILE = "config.json"  # the transformers model config, inside a run directory


# --------------------------------------------------------------------------------------------
# A run directory
# --------------------------------------------------------------------------------------------


def save_run_artifacts(run_dir: Path, model: nn.Module, tokenizer: Any | None, eos_id: int) -> None:
    """Write what export needs beside the checkpoint: ``config.json`` and ``tokenizer/``.

    Args:
        run_dir: the run directory (exists).
        model: the transformers model being trained (its ``.config`` is saved).
        tokenizer: a ``tokenizers.Tokenizer`` or a transformers tokenizer; ``None`` for token data
            made without one (synthetic benchmarks), which writes no ``tokenizer/``.
        eos_id: id of the end-of-text token (used as ``eos_token`` of a wrapped tokenizer).
    """
    model.config.save_pretrained(str(run_dir))
    if tokenizer is None:
        return
    target = run_dir / TOKENIZER_DIR
    tmp = run_dir / f".{TOKENIZER_DIR}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    as_hf_tokenizer(tokenizer, eos_id).save_pretrained(str(tmp))
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)


def as_hf_tokenizer(tokenizer: Any, eos_id: int) -> Any:
    """A transformers tokenizer for ``tokenizer`` (returned as is if it already is one).

    A ``tokenizers.Tokenizer`` is wrapped in ``PreTrainedTokenizerFast`` with its ``eos_id`` token
    as ``eos_token`` (and ``bos_token``/``unk_token`` unset), so ``AutoTokenizer`` reloads it.
    """
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

    if isinstance(tokenizer, PreTrainedTokenizerBase):
        return tokenizer
    eos = tokenizer.id_to_token(eos_id)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=eos)
