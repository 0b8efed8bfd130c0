"""``poetxq quantize-and-train`` (alias ``train``): its flags, how they become recipe overrides,
the checks of flags that do not apply, and the run itself (:func:`run_train`: resume or a new run
directory, then :func:`poetxq.training.train.train`). :mod:`poetxq.tools.cli` adds the parser
(:func:`add_train_parsers`) and runs it."""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

from poetxq.paths import RUN_LOCK, nearest_existing
from poetxq.tools.cli_common import check_kernels_env, disk_full, launcher_rank, raise_terminated
from poetxq.training.recipe import POET_METHODS, RecipeError
from poetxq.training.recipe_files import load_recipe, merge_overrides

# flag dest -> recipe key
_FLAG_KEYS = {
    "method": "method",
    "bits": "poet.bits",
    "block_size": "poet.block_size",
    "merge_interval": "poet.merge_interval",
    "variant": "poet.variant",
    "requant": "poet.requant",
    "quant_type": "poet.quant_type",
    "max_steps": "train.max_steps",
    "batch_size": "train.batch_size",
    "grad_accum": "train.grad_accum",
    "seq_len": "train.seq_len",
    "eval_every": "train.eval_every",
    "seed": "train.seed",
    "save_every": "train.save_every",
    "keep_last": "train.keep_last",
    "output_dir": "train.output_dir",
    "lr": "optim.lr",
    "poet_lr": "optim.poet_lr",
    "data": "data.source",
    "text_field": "data.text_field",
    "tokenizer": "data.tokenizer",
    "vocab_size": "data.vocab_size",
    "model": "model.pretrained",
    "memory": "train.memory",
}

_TRAIN_EPILOG = """\
examples:
  poetxq quantize-and-train --bits 8                 # embedded default: tiny Llama, English text
  poetxq quantize-and-train --bits 16                # same run, unquantized POET-X
  poetxq quantize-and-train --data 'c4/c4-train.0000*-of-01024.json.gz' --max-steps 2000
  poetxq quantize-and-train --data hf:allenai/c4 --set data.hf_config=en \\
        --set data.hf_val_split=validation --set data.max_train_tokens=50000000
  poetxq quantize-and-train --recipe recipes/tiny/poetxq.yaml --set optim.warmup_steps=50

outputs go to <output-dir>/<run-name>/: metrics.jsonl, model.safetensors, recipe.yaml,
summary.json, checkpoints/step-N/ (full training state; --save-every, --keep-last).

resume after a crash or SIGTERM (exactly: same losses as an uninterrupted run):
  poetxq train --resume runs/tiny-poetxq-20261130-101500
  poetxq train --run-name long --save-every 100 --resume auto   # same line to start or continue
  (the run keeps its memory plan: the same --memory, or none)

memory plans (--memory; auto, the default, fits one to the GPU; docs/MEMORY.md):
  poetxq train --recipe llama-13b:poetxq --memory lowest     # clipping and accumulation kept
  poetxq train --recipe llama-8b:poetxq --gpu-mem 16GB       # plan for a 16 GiB GPU
  poetxq estimate-memory --recipe llama-70b:poetxq4           # each plan's predicted peak
  the fastest low-memory step without clipping or accumulation (the optimizer inside a CUDA
  graph's backward, POET methods): --set train.optimizer_in_backward=true --set optim.grad_clip=0
  --set train.grad_accum=1 --set optim.state_bits=8 --set train.cuda_graph=true

multi-GPU (--batch-size is per process; POET: a CUDA graph per GPU and one all-reduce per
step, train.grad_sync; the baselines: DDP):
  accelerate launch --multi_gpu --num_processes 2 -m poetxq train --recipe R.yaml
  torchrun --nproc_per_node 2 -m poetxq train --recipe R.yaml     # also on CPU (gloo)
"""


def _add_train_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("recipe")
    g.add_argument(
        "--recipe",
        metavar="PATH",
        help="recipe YAML, or MODEL:METHOD from recipes/ (e.g. llama-60m:poetxq); default: the "
        "embedded tiny recipe",
    )
    g.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any recipe key, e.g. --set optim.warmup_steps=50 (repeatable)",
    )
    g.add_argument(
        "--model",
        metavar="DIR_OR_HUB_ID",
        help="continue a pretrained transformers Llama-family checkpoint: its weights become W0 "
        "as they are, its config and tokenizer are used, the recipe's model section is ignored "
        "[model.pretrained]",
    )
    g = p.add_argument_group("method")
    g.add_argument(
        "--method",
        choices=("poetxq", "poetx", "adamw", "galore", "apollo", "qgalore", "qapollo"),
        help="poetxq (int8 W0), poetx (unquantized W0), or a baseline: adamw, galore, apollo, "
        "qgalore, qapollo (int8 weights); baseline settings under baseline.* [method, "
        "default poetxq]",
    )
    g = p.add_argument_group("POET-X(Q)")
    g.add_argument(
        "--bits",
        type=int,
        choices=(4, 8, 16),
        help="frozen W0 storage: 8 = int8 row-wise (POET-XQ), 4 = NF4/FP4 blockwise "
        "(bitsandbytes Params4bit layout), 16 = unquantized POET-X [poet.bits, default 8]",
    )
    g.add_argument(
        "--quant-type",
        choices=("nf4", "fp4"),
        help="4-bit code for --bits 4, blocksize 64, double quant on "
        "[poet.quant_type, default nf4; poet.double_quant]",
    )
    g.add_argument(
        "--block-size",
        type=int,
        metavar="b",
        help="orthogonal block size b [poet.block_size, default 64]",
    )
    g.add_argument(
        "--merge-interval",
        type=int,
        metavar="T",
        help="steps between merge-then-reinitialize [poet.merge_interval, default 100]",
    )
    g.add_argument(
        "--variant",
        choices=("fast", "mem"),
        help="fast keeps the GEMM output for backward; mem recomputes it and saves only "
        "the layer input [poet.variant, default mem]",
    )
    g.add_argument(
        "--requant",
        choices=("nearest", "stochastic"),
        help="rounding when W0 is re-quantized at a merge [poet.requant, default nearest]",
    )
    g.add_argument(
        "--freeze-orthogonal",
        action="store_true",
        help="control run: R = P = I frozen, only embeddings, norms and lm_head train "
        "(default: off) [poet.freeze_orthogonal]",
    )
    g = p.add_argument_group("optimization")
    g.add_argument("--max-steps", type=int, help="optimizer steps [train.max_steps, default 300]")
    g.add_argument(
        "--batch-size",
        type=int,
        help="sequences per micro-batch, per process [train.batch_size, default 8]",
    )
    g.add_argument(
        "--grad-accum", type=int, help="micro-batches per step [train.grad_accum, default 1]"
    )
    g.add_argument(
        "--seq-len",
        type=int,
        help="tokens per sequence [train.seq_len, default 128]; above the recipe's "
        "model.max_position_embeddings that is raised to it (printed as a note), above a --model "
        "checkpoint's an error (RoPE is not extended)",
    )
    g.add_argument(
        "--lr",
        type=float,
        help="lr of embeddings, lm_head, norms [optim.lr, default 5e-3; 1e-4 with --model]",
    )
    g.add_argument(
        "--poet-lr",
        type=float,
        help="poet_lr; Q params use poet_lr x optim.poet_lr_scale (default 0.5) "
        "[optim.poet_lr, default 4e-3; 1e-4 with --model: continued training, docs/EXPORT.md]",
    )
    g.add_argument("--seed", type=int, help="run seed [train.seed, default 0]")
    g = p.add_argument_group("memory")
    g.add_argument(
        "--memory",
        choices=("auto", "fastest", "balanced", "lowest"),
        help="memory plan [train.memory, default auto: on a GPU the fastest plan whose predicted "
        "peak fits its memory; fastest = the recipe as written, balanced = + activation "
        "checkpointing, chunked loss, 8-bit states, lowest = + activations, gradients and "
        "optimizer states in host memory and bf16 parameters; clipping and accumulation stay "
        "exact in every plan]. Memory keys the recipe sets itself win; `poetxq estimate-memory` "
        "lists the plans' peaks",
    )
    g.add_argument(
        "--gpu-mem",
        metavar="SIZE",
        help="plan for this much GPU memory instead of the device's (e.g. 16GB; GB and GiB both "
        "mean 2^30 bytes)",
    )
    g = p.add_argument_group("data")
    g.add_argument(
        "--data",
        metavar="SOURCE",
        help="'embedded' (default: Shakespeare + KJV Bible), 'pydoc' (Python's own "
        "documentation, 78 topics), a local file/dir/glob "
        "(.txt .jsonl .json .json.gz .parquet) or hf:<dataset> [data.source]; a non-hf "
        "source clears data.hf_config and data.hf_val_split",
    )
    g.add_argument(
        "--text-field", help="record field holding the text [data.text_field, default text]"
    )
    g.add_argument(
        "--tokenizer",
        help="'bpe' (train a byte-level BPE on the train split), 'gpt2', a "
        "tokenizer.json or a HF tokenizer dir [data.tokenizer, default bpe]",
    )
    g.add_argument(
        "--vocab-size", type=int, help="vocab for --tokenizer bpe [data.vocab_size, default 4096]"
    )
    g = p.add_argument_group("output")
    g.add_argument(
        "--output-dir", help="parent of run directories [train.output_dir, default runs]"
    )
    g.add_argument(
        "--run-name",
        help="run directory name (default: <model>-<method>-<timestamp>, e.g. tiny-poetxq-...)",
    )
    g.add_argument("--overwrite", action="store_true",
                   help="reuse the directory of an earlier run (it holds recipe.yaml, "
                   "metrics.jsonl or checkpoints/): its previous results and checkpoints are "
                   "deleted when the new run starts; a folder of other files is "
                   "refused")  # fmt: skip
    g.add_argument(
        "--eval-every", type=int,
        help="steps between validation; 0: only at the start and the end "
        "[train.eval_every, default 150]",
    )  # fmt: skip
    g.add_argument(
        "--log-with", metavar="TRACKER", help="also log to an accelerate tracker, e.g. tensorboard"
    )
    g.add_argument("--no-progress", action="store_true", help="no progress bars")
    g = p.add_argument_group("checkpoints and resume")
    g.add_argument(
        "--save-every",
        type=int,
        metavar="N",
        help="write a full training checkpoint (model incl. frozen low-bit weights, optimizer, "
        "scheduler, RNG, data position) to <run>/checkpoints/step-N/ every N steps; one is "
        "always written at the end and on SIGTERM/SIGINT [train.save_every, default 0 = only "
        "then]",
    )
    g.add_argument(
        "--keep-last",
        type=int,
        metavar="K",
        help="checkpoints kept; older ones are deleted once a newer one is complete "
        "[train.keep_last, default 2]",
    )
    g.add_argument(
        "--resume",
        metavar="RUN_DIR|auto",
        help="continue a run from its newest checkpoint, exactly (the losses of an unstopped "
        "run). RUN_DIR: that run, with RUN_DIR/recipe.yaml (or --recipe) and the flags given "
        "applied to it. auto: the run <output-dir>/<run-name> of the recipe and flags given "
        "(repeat the command line that started it), continued if it holds a checkpoint, else "
        "started. A run already finished is left as it is: one line, exit status 0. The "
        "recipe must match the checkpoint's except in settings that change no training state "
        "(save/log/eval, single memory options such as --set train.gradient_checkpointing=..., "
        "cuda_graph, grad_sync; a mismatch is one error naming the keys). The run keeps the "
        "memory plan it started with: leave --memory out (or give auto) or give that same plan; "
        "another plan is refused, and the plan is not fitted to the GPU again (--gpu-mem does not "
        "change it)",
    )


def add_train_parsers(sub: Any) -> None:
    """Add ``quantize-and-train`` and its alias ``train`` to the ``poetxq`` sub-parsers."""
    for name, help_ in (
        (
            "quantize-and-train",
            "train a Llama from a recipe: POET-XQ (int8 W0 by default; "
            "--bits 4 / 16) or a baseline (--method)",
        ),
        ("train", "alias of quantize-and-train"),
    ):
        desc = (
            f"{help_}. A flag sets the recipe key named in its help (default: the embedded "
            "tiny recipe's value, or --recipe's); --set section.key=value sets any key."
        )
        p = sub.add_parser(name, help=help_, description=desc, epilog=_TRAIN_EPILOG,
                           formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
        _add_train_args(p)


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The recipe overrides of a train command line
    (:func:`poetxq.training.recipe_files.merge_overrides`: a ``--set`` of a key a flag also sets,
    with another value, is refused)."""
    flags: dict[str, tuple[str, Any]] = {
        key: ("--" + dest.replace("_", "-"), getattr(args, dest))
        for dest, key in _FLAG_KEYS.items()
        if getattr(args, dest) is not None  # flags not given leave the recipe alone
    }
    if args.freeze_orthogonal:
        flags["poet.freeze_orthogonal"] = ("--freeze-orthogonal", True)
    implied: dict[str, Any] = {}
    if args.data is not None and not args.data.startswith("hf:"):
        # --data replaces the source: the recipe's hub settings do not apply to local text
        implied = {"data.hf_config": None, "data.hf_val_split": None}
    return {**implied, **merge_overrides(flags, args.overrides)}


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


#: flags that only mean something for the POET methods
_POET_FLAGS = ("bits", "block_size", "merge_interval", "variant", "requant", "quant_type",
               "poet_lr", "freeze_orthogonal")  # fmt: skip


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


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
    given = [d for d in _POET_FLAGS if getattr(args, d, None) not in (None, False)]
    if recipe.method not in POET_METHODS and given:
        raise RecipeError(
            f"{', '.join(map(_flag, given))} appl{'ies' if len(given) == 1 else 'y'} to the POET "
            f"methods (poetxq and poetx) only, not --method {recipe.method}; drop "
            f"{'it' if len(given) == 1 else 'them'} or use --method poetxq"
        )
    if recipe.method == "poetx" and args.bits not in (None, 16):
        raise RecipeError(
            f"--method poetx keeps W0 unquantized; for --bits {args.bits} use --method poetxq"
        )
    if args.quant_type is not None and recipe.poet.bits != 4:
        raise RecipeError(
            f"--quant-type applies to --bits 4 only (this run has bits {recipe.poet.bits})"
        )
    if args.requant is not None and recipe.poet.bits == 16:
        raise RecipeError("--requant applies to quantized W0 (--bits 8 or 4), not to --bits 16")
    if recipe.model.pretrained is not None and (args.tokenizer or args.vocab_size):
        raise RecipeError(
            "--model uses the checkpoint's own tokenizer; drop --tokenizer / --vocab-size"
        )
    if args.vocab_size is not None:
        from poetxq.data.prepare import is_token_corpus

        if is_token_corpus(recipe.data.source):  # its tokenizer fixes the vocabulary
            raise RecipeError(
                f"{recipe.data.source} is a pre-tokenized corpus with its own tokenizer and "
                f"vocabulary; drop --vocab-size {args.vocab_size} (data.vocab_size)"
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
_STARTUP_FILES = {"recipe.yaml", "config.json", "metrics.jsonl", "tokenizer", "checkpoints",
                  RUN_LOCK}  # fmt: skip


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
        check_writable,
        release_unused_run_dir,
        resolve_run_dir,
    )
    from poetxq.training.train import train

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
                args.resume, recipe_path=args.recipe, overrides=_overrides(args),
                run_name=args.run_name,
            )  # fmt: skip
        except RunFinished as done:  # a requeued job repeating its command line: not an error
            if launcher_rank()[0] == 0:  # once, not once per process
                print(done.line())
            return 0
        if run_dir is not None:  # a resumed run writes metrics and checkpoints into its folder
            check_writable(run_dir, "copy the run to a writable place and resume it there")
    else:
        recipe = load_recipe(args.recipe, _overrides(args))
        _absolute_paths(recipe)
        _note_method_switch(args, recipe)
    _check_flags(args, recipe)
    if recipe.model.pretrained is not None:  # fail before any work; a hub id becomes a local dir
        from poetxq.model.pretrained import check_pretrained_config, resolve_pretrained

        local = resolve_pretrained(recipe.model.pretrained)
        check_pretrained_config(local, recipe.train.seq_len, recipe.poet.block_size)
        if recipe.name == "tiny-poetxq":  # the default recipe's name: name runs after the model
            recipe.name = os.path.basename(os.path.normpath(str(local)))
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
        # Ctrl-C (an abort: the graceful stop returns) before the first checkpoint
        early = type(exc) is KeyboardInterrupt and _only_startup_files(run_dir)
        if early and created and launcher_rank()[1] == 1:
            shutil.rmtree(run_dir, ignore_errors=True)  # only what every start writes first
            release_unused_run_dir(run_dir.parent, existed)
        elif claim:
            release_unused_run_dir(run_dir, existed)  # the run failed before writing there
        if full is not None:
            raise RunDirError(full) from exc
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
