"""``poetxq quantize-and-train`` (alias ``train``): the checks of flags that do not apply, and the
run itself (:func:`run_train`: resume or a new run directory, then
:func:`poetxq.training.train.train`). The flags and their recipe keys are
:mod:`poetxq.tools.cli_train_flags`; :mod:`poetxq.tools.cli` adds the parser and runs it."""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

from poetxq.paths import RUN_LOCK, nearest_existing, safe_name
from poetxq.tools.cli_common import (
    Terminated,
    check_kernels_env,
    disk_full,
    launcher_rank,
    raise_terminated,
)
from poetxq.tools.cli_train_flags import POET_FLAGS, flag_labels, flag_name, train_overrides
from poetxq.training.recipe import POET_METHODS, RecipeError
from poetxq.training.recipe_files import load_recipe


def _check_tracker(name: str | None) -> None:
    """Fail early (before any work) when the asked-for tracker is not one accelerate knows
    (``accelerate.utils.LoggerType``) or its package is missing."""
    if name is None:
        return
    from accelerate.utils import LoggerType

    known = [t.value for t in LoggerType]
    if name not in known:
        raise RecipeError(f"--log-with {name}: not an accelerate tracker; choose one of {known}")
    packages = {"tensorboard": ("tensorboard", "tensorboardX"), "wandb": ("wandb",)}
    if name in packages and not any(importlib.util.find_spec(p) for p in packages[name]):
        extra = (
            ' (or pip install -e ".[tensorboard]" in a checkout)' if name == "tensorboard" else ""
        )
        raise RecipeError(
            f"--log-with {name} needs the '{packages[name][0]}' package: "
            f"pip install {packages[name][0]}{extra}"
        )


def _note_method_switch(args: argparse.Namespace, recipe: Any) -> None:
    """A method set on the command line (``--method M`` or ``--set method=M``) for a recipe
    written for another method keeps that recipe's optimizer and baseline settings: say so in a
    note (printed by the trainer) naming the recipe with M's own settings, as the baselines'
    authors tuned them."""
    own = load_recipe(args.recipe).method
    method = recipe.method
    if own == method:
        return
    how = f"--method {method}" if args.method is not None else f"--set method={method}"
    tiny = Path(__file__).resolve().parents[2] / "recipes" / "tiny" / f"{method}.yaml"
    where = f"; recipes/tiny/{method}.yaml has {method}'s own" if tiny.is_file() else ""
    recipe.add_note(
        f"{how} replaces the method of a {own} recipe and keeps its optimizer "
        f"and baseline settings (optim.lr {recipe.optim.lr:g}, optim.grad_clip "
        f"{recipe.optim.grad_clip:g}){where}"
    )


def _check_flags(args: argparse.Namespace, recipe: Any) -> None:
    """Flags that do not apply to the resolved recipe are an error, not silently ignored.

    Raises:
        RecipeError: one line naming the flag, why it does not apply and what to do instead.
    """
    given = [d for d in POET_FLAGS if getattr(args, d, None) not in (None, False)]
    if recipe.method not in POET_METHODS and given:
        raise RecipeError(
            f"{', '.join(map(flag_name, given))} appl{'ies' if len(given) == 1 else 'y'} to the "
            f"POET methods (poetxq and poetx) only, not --method {recipe.method}; drop "
            f"{'it' if len(given) == 1 else 'them'} or use --method poetxq"
        )
    if recipe.method == "poetx" and args.bits not in (None, 16):
        raise RecipeError(
            f"--method poetx keeps W0 unquantized; for --bits {args.bits} use --method poetxq"
        )
    # poet.quant_type / poet.requant against poet.bits: the recipe schema's rule
    # (poetxq.model.config.POETConfig), the same error for a flag and a recipe file
    if recipe.model.pretrained is not None and args.vocab_size:
        raise RecipeError(
            "--model takes its vocabulary from the checkpoint's tokenizer; drop --vocab-size"
        )
    if recipe.model.pretrained is not None and (args.tokenizer or "").strip() == "bpe":
        raise RecipeError(
            "--model trains the checkpoint's embeddings, which a freshly trained --tokenizer bpe "
            "does not match; drop --tokenizer (the checkpoint's own) or pass the checkpoint's "
            "tokenizer (a Hugging Face tokenizer directory or a tokenizer.json)"
        )
    if args.vocab_size is not None or args.tokenizer is not None:
        from poetxq.data.prepare import is_token_corpus

        if is_token_corpus(recipe.data.source):  # its tokenizer fixes the vocabulary
            # (a --tokenizer other than the default bpe is refused by the data layer, which
            # cannot tell an explicit bpe from the default)
            flag = (f"--vocab-size {args.vocab_size} (data.vocab_size)" if args.vocab_size
                    is not None else f"--tokenizer {args.tokenizer} (data.tokenizer)")  # fmt: skip
            raise RecipeError(
                f"{recipe.data.source} is a pre-tokenized corpus with its own tokenizer and "
                f"vocabulary; drop {flag}"
            )


def _absolute_paths(recipe: Any) -> None:
    """Local data and model paths as absolute paths, so the saved recipe (and ``--resume``)
    works from any directory."""
    src = recipe.data.source
    if src not in ("embedded", "pydoc") and not src.startswith("hf:"):
        recipe.data.source = os.path.abspath(os.path.expanduser(src))
    pre = recipe.model.pretrained
    if pre is not None and os.path.exists(os.path.expanduser(pre)):
        recipe.model.pretrained = os.path.abspath(os.path.expanduser(pre))
        if recipe.data.tokenizer == pre:
            recipe.data.tokenizer = recipe.model.pretrained


#: what a run writes before its first checkpoint (train.py); nothing there is worth keeping
_STARTUP_FILES = {"recipe.yaml", "plan.json", "config.json", "metrics.jsonl", "tokenizer",
                  "checkpoints", RUN_LOCK}  # fmt: skip


def _only_startup_files(run_dir: Path) -> bool:
    """Whether ``run_dir`` exists and holds nothing but an aborted start's files (and no
    checkpoint: ``checkpoints/`` is empty or absent)."""
    if not run_dir.is_dir():
        return False
    names = {p.name for p in run_dir.iterdir()}
    ckpts = run_dir / "checkpoints"
    return names <= _STARTUP_FILES and not (ckpts.is_dir() and any(ckpts.iterdir()))


def run_train(args: argparse.Namespace) -> int:
    from poetxq.training.rundir import (
        RunDirError,
        check_not_in_use,
        check_run_name,
        check_writable,
        release_unused_run_dir,
        resolve_run_dir,
    )
    from poetxq.training.train import train

    check_run_name(args.run_name)  # before any path is made of it
    check_kernels_env()
    _check_tracker(args.log_with)
    gpu_mem = None
    if args.gpu_mem is not None:  # a bad size fails before any work
        from poetxq.tools.estimate_report import parse_bytes

        gpu_mem = parse_bytes(args.gpu_mem)
    if args.resume and args.overwrite:
        raise RecipeError("--resume continues a run and --overwrite would erase it; drop one")
    if args.resume and args.resume != "auto" and (args.run_name or args.output_dir):
        raise RecipeError(
            "--resume RUN_DIR continues that directory; drop --run-name / --output-dir "
            "(they go with --resume auto)"
        )
    ckpt = run_dir = None
    claim = False  # whether this process created an automatically named run directory
    if args.resume:
        from poetxq.training.resume import RunFinished, plan_resume

        if args.resume != "auto" and Path(args.resume).is_dir():  # a live run, not a mismatch
            check_not_in_use(Path(args.resume))
        try:
            recipe, run_dir, ckpt = plan_resume(
                args.resume, recipe_path=args.recipe, overrides=train_overrides(args),
                run_name=args.run_name,
            )  # fmt: skip
        except RunFinished as done:  # a requeued job repeating its command line: not an error
            if launcher_rank()[0] == 0:  # once, not once per process
                print(done.line())
            return 0
        if run_dir is not None:  # a resumed run writes metrics and checkpoints into its folder
            check_writable(run_dir, "copy the run to a writable place and resume it there")
    else:
        recipe = load_recipe(args.recipe, train_overrides(args), flag_labels(args))
        _absolute_paths(recipe)
        _note_method_switch(args, recipe)
    _check_flags(args, recipe)
    if recipe.model.pretrained is not None:  # fail before any work; a hub id becomes a local dir
        from poetxq.model.pretrained import check_pretrained_config, resolve_pretrained

        local = resolve_pretrained(recipe.model.pretrained)
        check_pretrained_config(local, recipe.train.seq_len, recipe.poet.block_size)
        if recipe.name == "tiny-poetxq":  # the default recipe's name: name runs after the model
            recipe.name = safe_name(os.path.basename(os.path.normpath(str(local))))
        if recipe.data.tokenizer == recipe.model.pretrained:
            recipe.data.tokenizer = local
    created = False  # whether this start made the run directory (to take it back on an abort)
    if run_dir is None:
        # --resume auto with no checkpoint yet: a start stopped before its first checkpoint left
        # only what every run writes first; starting over loses nothing
        restart = args.resume == "auto" and _only_startup_files(
            Path(recipe.train.output_dir) / args.run_name
        )
        # an automatic name is taken now (created), so two runs of one recipe started within
        # the same second get two directories; under a launcher process 0 alone writes there
        claim = args.run_name is None and launcher_rank()[1] == 1
        existed = nearest_existing(Path(recipe.train.output_dir))
        named = Path(recipe.train.output_dir) / args.run_name if args.run_name else None
        created = claim or (named is not None and not named.exists())
        run_dir = resolve_run_dir(
            recipe, args.run_name, overwrite=args.overwrite or restart, claim=claim
        )
    try:
        result = train(
            recipe, run_dir, log_with=args.log_with, progress=not args.no_progress,
            resume_from=ckpt, gpu_mem=gpu_mem,
        )  # fmt: skip
    except BaseException as exc:
        # a full disk: say whether a checkpoint is there to resume from (before the release)
        full = _disk_full_line(exc, run_dir) if disk_full(exc) else None
        # Ctrl-C (an abort: the graceful stop returns) or a SIGTERM before the loop takes it
        # over (Terminated), before the first checkpoint
        early = type(exc) in (KeyboardInterrupt, Terminated) and _only_startup_files(run_dir)
        if early and created and launcher_rank()[1] == 1:
            shutil.rmtree(run_dir, ignore_errors=True)  # only what every start writes first
            release_unused_run_dir(run_dir.parent, existed)
        elif claim:
            release_unused_run_dir(run_dir, existed)  # the run failed before writing there
        if full is not None:
            raise RunDirError(full) from exc
        if early and isinstance(exc, Terminated):
            raise  # main's SIGTERM line (exit 143), what every start wrote removed above
        if early:
            again = "run the same command again" if created else (
                "start it over with --resume auto (or --overwrite)")  # fmt: skip
            raise KeyboardInterrupt(
                f"interrupted before the first checkpoint; nothing to resume: {again}"
            ) from exc
        raise
    if signal.getsignal(signal.SIGTERM) is raise_terminated:  # outputs written: the default
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # action again (main restores its own)
    if result.interrupted:  # a checkpoint was saved; exit like the signal would
        if launcher_rank()[0] == 0:  # once, not once per DDP process
            print(
                f"poetxq: stopped by {result.stop_signal} after step {result.steps}; continue "
                f"with: {_resume_command(run_dir)}",
                file=sys.stderr,
            )
        return 130 if result.stop_signal == "SIGINT" else 143
    return 0


def _resume_command(run_dir: Path) -> str:
    """The command that continues ``run_dir`` from its newest checkpoint (under a launcher: the
    same launcher, with as many processes)."""
    world = launcher_rank()[1]
    if world > 1:
        return (
            f"the same launcher with {world} processes, e.g. torchrun --nproc_per_node {world} "
            f"-m poetxq train --resume {run_dir.resolve()}"
        )
    return f"poetxq train --resume {run_dir.resolve()}"


def _disk_full_line(exc: BaseException, run_dir: Path) -> str:
    """The one line for a training run that filled the disk: how to go on depends on whether
    a complete checkpoint is there (checkpoints are written to a temporary folder and renamed,
    so the ones already there are whole)."""
    from poetxq.training.checkpoint import latest_checkpoint

    what = f"cannot write the run's files ({str(exc).splitlines()[0]}); free space or choose "
    if latest_checkpoint(run_dir) is not None:
        return (
            f"{what}another --output-dir; the checkpoints already written are intact: after "
            f"freeing space, continue with: {_resume_command(run_dir)}"
        )
    return (
        f"{what}another --output-dir, then run the command again (no checkpoint was written, "
        "so there is nothing to resume)"
    )
