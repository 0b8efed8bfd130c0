"""``poetxq`` command line: train with POET-XQ, validate recipes, export, measure.

The entry point (:func:`main`, also ``python -m poetxq``) with its error and signal handling, and
the ``export`` and ``validate`` sub-commands; training's flags are
:mod:`poetxq.tools.cli_train_flags` and its run :mod:`poetxq.tools.cli_train`,
``estimate-memory`` / ``plan`` / ``bench`` / ``report`` are :mod:`poetxq.tools.cli_tools`,
``fpo-diagnose`` / ``fpo-adapt`` are :mod:`poetxq.tools.cli_adapt`. Most flags set a recipe
key (named in their help); ``--set section.key=value`` reaches any other key. Bad input exits
with status 2 and one ``poetxq: error: ...`` line, before anything is written to the run
directory.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from poetxq.tools.cli_common import (
    CommandParser,
    Terminated,
    check_kernels_env,
    disk_full,
    launcher_rank,
    raise_terminated,
)
from poetxq.tools.cli_train import run_train
from poetxq.tools.cli_train_flags import add_train_parsers
from poetxq.training.recipe import METHODS, POET_METHODS, RecipeError, run_label
from poetxq.training.recipe_files import load_recipe, parse_override, recipes_dir


def _version() -> str:
    """The installed distribution's version (pyproject.toml), or "unknown" outside an install."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("poetxq")
    except PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    """The ``poetxq`` parser: ``quantize-and-train``, ``train``, ``export``, ``validate``."""
    parser = CommandParser(
        prog="poetxq",
        description="Memory-efficient quantized LLM pretraining with POET-XQ: each linear weight "
        "is trained as R·W0·P with block-diagonal orthogonal R, P while W0 stays frozen in int8 "
        "(or NF4/FP4, or bf16); Q-GaLore, Q-APOLLO, GaLore, APOLLO and AdamW train in the same "
        "loop for comparison.",
    )
    parser.add_argument("--version", action="version", version=f"poetxq {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_train_parsers(sub)  # quantize-and-train, train
    p = sub.add_parser(
        "export",
        help="write a run as a Hugging Face model directory (bf16, bnb int8 or bnb 4-bit)",
        description="Write RUN_DIR as a directory that "
        "transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR) loads, with the tokenizer "
        "and every POET layer's R·W0·P folded into one weight. hf-bnb8 / hf-bnb4 of a run "
        "stored in that format first merge R and P into W0 exactly as a training merge does "
        "(one rounding, the run's requant policy; R = P = I after) and then write the stored "
        "codes themselves, permuted back: the export is the run's model after one more merge, "
        "within bf16 (about 0.5-0.7 % relative logits on a tiny test model; the 4-bit "
        "double-quant statistics are redone). Between merges R·W0·P is not on the int8/4-bit "
        "grid, so that merge moves logits by about 0.7 % (int8) or 10-12 % (NF4/FP4) from the "
        "unmerged run, as the run's next merge would. Other combinations, and hf-bf16, round "
        "R·W0·P once into the format. The merge happens in memory: RUN_DIR is only read, and "
        "OUT_DIR may not lie inside it. A baseline run (adamw, muon, galore, apollo, qgalore, "
        "qapollo) exports as hf-bf16, its int8 groups dequantized.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a finished run directory")
    p.add_argument("out_dir", metavar="OUT_DIR", help="output directory (absent or empty)")
    p.add_argument(
        "--format",
        required=True,
        choices=("hf-bf16", "hf-bnb8", "hf-bnb4"),
        help="hf-bf16: plain bf16; hf-bnb8: int8 Linear8bitLt; hf-bnb4: NF4/FP4 Linear4bit "
        "(quantization_config in config.json); the bnb formats merge R,P first (see above)",
    )
    p.add_argument("--quant-type", choices=("nf4", "fp4"), help="4-bit code (default: the run's)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUT_DIR when it holds a previous export (poetxq_export.json); "
                   "any other non-empty directory is refused")  # fmt: skip
    p = sub.add_parser("validate", help="check recipe YAML files against the schema",
                       description="Validate recipe files; prints one line per file.")  # fmt: skip
    p.add_argument("recipes", nargs="+", metavar="RECIPE",
                   help="a recipe YAML file or MODEL:METHOD (e.g. llama-1b:poetxq)")  # fmt: skip
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe key before validating, e.g. --set "
                   "train.fuse_elementwise=false (repeatable; applied to every file)")  # fmt: skip
    from poetxq.tools.cli_tools import add_tool_parsers  # estimate-memory, bench, report

    add_tool_parsers(sub)
    from poetxq.tools.cli_adapt import add_adapt_parsers  # fpo-diagnose, fpo-adapt

    add_adapt_parsers(sub)
    return parser


def _run_export(args: argparse.Namespace) -> int:
    from poetxq.tools.export import ExportError, export_run

    if args.quant_type is not None and args.format != "hf-bnb4":
        raise ExportError(f"--quant-type applies to --format hf-bnb4 only, not {args.format}")
    check_kernels_env()  # folding R, P into W0 runs the POET layers (kernel dispatch)
    export_run(args.run_dir, args.format, args.out_dir, overwrite=args.overwrite,
               quant_type=args.quant_type)  # fmt: skip
    return 0


def _run_validate(args: argparse.Namespace) -> int:
    """One line per file: ``ok (...)`` on stdout, or ``poetxq: error: ...`` on stderr; exit 2
    when any file is bad."""
    bad = 0
    for path in args.recipes:
        try:
            overrides = dict(parse_override(text) for text in args.overrides)
            recipe = load_recipe(path, overrides)
        except RecipeError as exc:
            print(f"poetxq: error: {exc}", file=sys.stderr)
            bad += 1
            continue
        if recipe.method in POET_METHODS:
            detail = f"bits={recipe.poet.bits}, b={recipe.poet.block_size}"
        elif recipe.method in ("adamw", "muon"):  # no projection: no rank
            detail = f"lr={recipe.optim.lr:g}"
        else:
            detail = f"rank={recipe.baseline.rank}"
        print(f"{path}: ok ({run_label(recipe)}: method={recipe.method}, {detail})")
        for note in recipe.notes:
            print(f"{path}: note: {note}")
        # the keys the files and overrides gave (pydantic's record), not the defaults
        if {"model", "name"}.isdisjoint(recipe.model_fields_set):  # e.g. a method file alone
            # the example names a method file of recipes/methods/: this file's, else its method's
            stem = Path(path).stem
            method = stem if (recipes_dir() / "methods" / f"{stem}.yaml").is_file() else None
            print(
                f"{path}: note: it names no model, so the embedded tiny model's defaults fill in; "
                f"give one with MODEL:METHOD (e.g. llama-60m:{method or recipe.method}) or a "
                "file whose base lists a model file"
            )
    return 2 if bad else 0


#: exit status of a command that a signal stopped -> that signal
_STOPPED_BY = {130: signal.SIGINT, 143: signal.SIGTERM}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``poetxq`` console script; returns the exit status.

    Ctrl-C anywhere (also while the heavy modules are imported) is one line and status 130. For
    ``train`` without a launcher a SIGTERM before the first step (the loop checkpoints on one
    after that) is one line and status 143.

    Called from Python with ``argv`` (a test, a sweep script), a Ctrl-C or SIGTERM that stopped
    the command is passed on once the command has stopped (its line printed, a stopped run's
    checkpoint written) and the caller's signal handlers are back in place: the caller gets the
    signal as if poetxq had not handled it (Ctrl-C: ``KeyboardInterrupt``; SIGTERM with the
    default handler: the process ends), so the calling program stops too instead of going on
    with its next command. Without ``argv`` (the ``poetxq`` script, ``python -m poetxq``, a
    launcher's workers) the status is the process's exit status.
    """
    status = _run_command(argv)
    sig = _STOPPED_BY.get(status)
    if argv is not None and sig is not None and _in_main_thread():
        signal.raise_signal(sig)  # to the caller's handler (KeyboardInterrupt for SIGINT)
    return status


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _run_command(argv: Sequence[str] | None) -> int:
    """:func:`main` up to its exit status: the command, with Ctrl-C and an early SIGTERM as one
    line each; the caller's SIGTERM handler is back when it returns."""
    args = list(sys.argv[1:] if argv is None else argv)
    training = bool(args) and args[0] in ("train", "quantize-and-train")
    previous = None
    # not under a launcher: torchrun sends SIGTERM to the other workers when one fails, and one
    # unwinding into a collective's barrier would wait there instead of ending at once
    single = launcher_rank()[1] == 1
    if training and single and _in_main_thread():
        previous = signal.signal(signal.SIGTERM, raise_terminated)
    # A background job of a non-interactive shell (`poetxq train ... &` in a script) starts with
    # SIGINT ignored. The training and adaptation loops take SIGINT over when they start, so
    # leaving it ignored until then would drop a `kill -INT` sent while the data is prepared and
    # train on: Ctrl-C means the same at every stage of every command.
    ignored_int = _in_main_thread() and signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    if ignored_int:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return _main(argv)
    except Terminated:
        print(
            "poetxq: stopped by SIGTERM before the first training step; nothing to resume: run "
            "the command again (with --resume auto and a --run-name it starts over)",
            file=sys.stderr,
        )
        return 143
    except KeyboardInterrupt as exc:  # DataPrepInterrupted carries its own line
        hint = ""
        if not str(exc) and training:
            hint = (
                " (aborted: checkpoints written before it, if any, are intact; continue or start "
                "over with --resume auto and the same --run-name)"
            )
        print(f"poetxq: {str(exc) or 'interrupted'}{hint}", file=sys.stderr)
        # SIGTERM while the data was prepared: the data step's own line, the signal's status
        return 143 if isinstance(exc.__context__, Terminated) else 130
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly, as a shell tool
        with contextlib.suppress(OSError):  # no flush of what is left into the closed pipe
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if ignored_int:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def _print_error(text: str, *, same_on_every_rank: bool = False) -> None:
    """``poetxq: error: TEXT`` on stderr. Under a launcher (``torchrun`` / ``accelerate``, more
    than one process) a recipe or flag error, which every process finds alike, is printed by
    process 0 only; any other error names its process."""
    rank, world = launcher_rank()
    if world > 1 and same_on_every_rank and rank != 0:
        return
    where = f" (process {rank} of {world})" if world > 1 and not same_on_every_rank else ""
    print(f"poetxq: error{where}: {text}", file=sys.stderr)


def _set_without_equals(argv: Sequence[str]) -> str | None:
    """The one-line error for ``--set KEY VALUE`` (a space where ``=`` belongs), which argparse
    would report as an unrecognized argument ``VALUE``; None when every ``--set`` has its ``=``."""
    for i, arg in enumerate(argv[:-1]):
        key = argv[i + 1]
        if arg == "--set" and "=" not in key and not key.startswith("-"):
            nxt = argv[i + 2] if i + 2 < len(argv) and not argv[i + 2].startswith("-") else None
            hint = f"--set {key}={nxt}" if nxt is not None else f"--set {key}=VALUE"
            return f"--set {key}: write KEY=VALUE with '=', e.g. {hint}"
    return None


#: options whose value may start with ``-`` and a digit (a negative size, a layer list "-1,3")
_NEGATIVE_VALUES = ("--gpu-mem", "--gpu-memory", "--layers")


def _negative_sizes_joined(argv: list[str]) -> list[str]:
    """``--gpu-mem -5GB`` as ``--gpu-mem=-5GB``, ``--layers -1,3`` as ``--layers=-1,3``: argparse
    takes a value that starts with ``-`` for an option and reports "expected one argument";
    joined, the option's own parser reads it (and names a problem)."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1] in _NEGATIVE_VALUES and arg.startswith("-") and arg[1:2].isdigit():
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def _unrecognized(parser: argparse.ArgumentParser, command: str, extra: list[str]) -> None:
    """Exit 2 with the command's own usage and one error line naming the unknown arguments,
    the closest option of that command for each mistyped flag, and ``poetxq COMMAND --help``
    (argparse alone reports them against the top-level usage)."""
    import difflib

    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    cmd_parser = sub.choices[command]
    if command == "validate" and any(a.split("=", 1)[0] == "--method" for a in extra):
        cmd_parser.error(_validate_method_hint())
    options = [o for a in cmd_parser._actions for o in a.option_strings]
    hints = []
    for arg in extra:
        flag = arg.split("=", 1)[0]
        if flag.startswith("--") and (close := difflib.get_close_matches(flag, options, n=1)):
            hints.append(f"{close[0]} for {flag}")
    hint = f" (did you mean {', '.join(hints)}?)" if hints else ""
    cmd_parser.error(
        f"unrecognized arguments: {' '.join(extra)}{hint}; see poetxq {command} --help"
    )


def _validate_method_hint() -> str:
    """What ``validate --method`` should be (validate has no such flag; the closest option,
    ``--set``, would be no answer): the method named in each RECIPE, or ``--set method=``."""
    files = sorted(p.stem for p in (recipes_dir() / "methods").glob("*.yaml"))
    return (
        "--method: validate has no such flag; name the method in each RECIPE as MODEL:METHOD "
        f"(METHOD one of {', '.join(files) or 'the files of recipes/methods/'}; e.g. "
        "llama-60m:adamw), or "
        f"override a recipe file's with --set method=NAME (NAME one of {', '.join(METHODS)})"
    )


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    argv = _negative_sizes_joined(list(sys.argv[1:] if argv is None else argv))
    if (bad := _set_without_equals(argv)) is not None:
        print(f"poetxq: error: {bad}", file=sys.stderr)
        return 2
    args, extra = parser.parse_known_args(argv)
    if extra:
        _unrecognized(parser, args.command, extra)
    from safetensors import SafetensorError

    from poetxq.adapt.fpo import FPOError
    from poetxq.data import DataError
    from poetxq.model.pretrained import PretrainedError
    from poetxq.tools.cli_tools import TOOL_ERRORS, run_tool
    from poetxq.tools.export import ExportError
    from poetxq.training.checkpoint import CheckpointError
    from poetxq.training.rundir import RunDirError
    from poetxq.training.train import DivergedError

    try:
        if args.command == "validate":
            return _run_validate(args)
        if args.command in ("estimate-memory", "plan", "bench", "report"):
            return run_tool(args)
        if args.command == "export":
            return _run_export(args)
        if args.command in ("fpo-diagnose", "fpo-adapt"):
            from poetxq.tools.cli_adapt import run_adapt

            return run_adapt(args)
        return run_train(args)
    except (
        RecipeError, DataError, RunDirError, CheckpointError, ExportError, PretrainedError,
        DivergedError, FPOError, *TOOL_ERRORS,
    ) as exc:  # fmt: skip
        _print_error(str(exc), same_on_every_rank=isinstance(exc, RecipeError))
        return 2
    except BrokenPipeError:
        raise  # main() ends quietly
    except (OSError, SafetensorError) as exc:
        if disk_full(exc):  # writing an export or a tool's output (train says its own line)
            _print_error(
                f"cannot write the output ({str(exc).splitlines()[0]}); free space or choose "
                "another output path"
            )
            return 2
        if isinstance(exc, PermissionError) and exc.filename:
            _print_error(
                f"cannot write or read {exc.filename} ({exc.strerror}); make its folder writable "
                "(chmod, chattr -i) or choose another output path"
            )
            return 2
        return _input_error(exc)
    except ValueError as exc:
        return _input_error(exc)


def _input_error(exc: Exception) -> int:
    """One line for a ``ValueError`` / ``OSError`` from input checks deeper down (batch vs data
    size, trackers, paths); status 2."""
    # an OSError made with a message only (no errno) is one of ours, already a sentence
    ours = isinstance(exc, OSError) and exc.errno is None and len(exc.args) == 1
    text = str(exc) if ours else f"{type(exc).__name__}: {exc}"
    _print_error(text.splitlines()[0] if text else text)
    return 2


if __name__ == "__main__":
    sys.exit(main())
