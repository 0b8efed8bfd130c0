"""The ``estimate-memory``, ``plan``, ``bench`` and ``report`` sub-commands of ``poetxq``.

Kept apart from :mod:`poetxq.tools.cli` (training flags) so each tool's flags live next to its
runner. :mod:`poetxq.tools.cli` adds these parsers and runs them; this module never imports it (the
checks both use live in :mod:`poetxq.tools.cli_common`; ``evals/`` scripts import
``check_output_file`` from here). Errors are raised as the tools' own ``ValueError`` subclasses
(:data:`TOOL_ERRORS`); ``poetxq.tools.cli.main`` prints them as one ``poetxq: error: ...`` line and
exits with status 2.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any

from poetxq.text import count
from poetxq.tools.bench import BenchError
from poetxq.tools.cli_common import check_kernels_env, check_output_file
from poetxq.tools.report import DEFAULT_REPORT_DIR, ReportError
from poetxq.training.estimate import EstimateError
from poetxq.training.memory import MemoryPlanError

TOOL_ERRORS: tuple[type[Exception], ...] = (
    EstimateError, BenchError, ReportError, MemoryPlanError,
)  # fmt: skip


def _recipe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--recipe", metavar="RECIPE",
        help="recipe YAML or MODEL:METHOD from recipes/ (e.g. llama-8b:poetxq); default: the "
        "embedded tiny recipe, as poetxq train",
    )  # fmt: skip
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe key (repeatable)")  # fmt: skip
    p.add_argument(
        "--batch-size",
        type=int,
        help="sequences per micro-batch [train.batch_size; default: the recipe's]",
    )
    p.add_argument(
        "--seq-len", type=int, help="tokens per sequence [train.seq_len; default: the recipe's]"
    )
    p.add_argument(
        "--gradient-checkpointing", action="store_true",
        help="whole-layer activation checkpointing [train.gradient_checkpointing]",
    )  # fmt: skip
    p.add_argument("--vocab-size", type=int, help="tokenizer vocabulary [data.vocab_size]")
    p.add_argument(
        "--memory", choices=("auto", "fastest", "balanced", "lowest"),
        help="memory plan [train.memory, default auto] (see poetxq train --help)",
    )  # fmt: skip


def _check_precision_applies(recipe: Any, precision: str) -> None:
    """Refuse ``--precision`` where ``train`` would refuse ``train.precision`` for the recipe's
    method (the recipe's own validation, so the rule has one home).

    Raises:
        EstimateError: the message ``train`` gives.
    """
    from pydantic import ValidationError

    tree = recipe.model_dump()
    tree["train"]["precision"] = precision
    try:
        type(recipe).model_validate(tree)
    except ValidationError as exc:  # pydantic wraps the validators' ValueErrors
        msg = str(exc.errors()[0]["msg"]).removeprefix("Value error, ")
        raise EstimateError(f"--precision {precision}: {msg}") from None


def four_bit_hint(recipe: Any, gpu_mem: int, vocab_size: int | None) -> str | None:
    """Where an int8 POET-XQ recipe does not fit ``gpu_mem`` bytes: one line naming the plan
    the same recipe with NF4 ``W0`` (``poet.bits=4``, the ``MODEL:poetxq4`` recipes) would take
    and its predicted peak, when one fits; else None."""
    from poetxq.training.memory_table import plan_table

    if recipe.method != "poetxq" or recipe.poet.bits != 8:
        return None
    poet = recipe.poet.model_copy(update={"bits": 4, "quant_type": "nf4", "double_quant": True})
    rows = plan_table(recipe.model_copy(update={"poet": poet}), gpu_mem=gpu_mem,
                      vocab_size=vocab_size)  # fmt: skip
    fit = next((r for r in rows if r["fits"]), None)
    if fit is None:
        return None
    return (
        f"with NF4 W0 it fits: plan {fit['plan']}, predicted peak {fit['peak'] / 2**30:.2f} GiB "
        "(--set poet.bits=4, or the MODEL:poetxq4 recipe)"
    )


def _check_model_dir(recipe: Any) -> None:
    """``estimate-memory --model DIR`` (``model.pretrained``): the checks ``poetxq train`` makes
    before any work (:func:`poetxq.model.pretrained.resolve_pretrained`, then
    :func:`~poetxq.model.pretrained.check_pretrained_config` with the run's ``train.seq_len`` and
    ``poet.block_size``), so a checkpoint train refuses (a ``model_type`` outside the Llama
    family, a quantized one, a poetxq run directory) is refused here with train's message. Only
    a local directory holding ``config.json`` is checked: anything else is left to the
    estimator's own messages (the estimate reads a local ``config.json``; a named base or hub
    id would be converted or downloaded first).

    Raises:
        PretrainedError: train's one-line message.
    """
    from poetxq.model.pretrained import check_pretrained_config, resolve_pretrained

    ref = recipe.model.pretrained
    if not (Path(ref) / "config.json").is_file():
        return
    local = resolve_pretrained(ref)
    check_pretrained_config(local, recipe.train.seq_len, recipe.poet.block_size)


def _estimate_precision(text: str) -> str:
    """``estimate-memory --precision``: a run precision
    (:data:`poetxq.training.estimate_terms.PRECISIONS`). ``bf16`` is refused by name: as
    ``train.precision`` it means autocast, elsewhere it is often read as everything-bf16."""
    from poetxq.training.estimate_terms import PRECISIONS

    if text == "bf16":
        raise argparse.ArgumentTypeError(
            "'bf16' is ambiguous: use autocast (fp32 parameters, bf16 compute; what "
            "train.precision: bf16 runs) or bf16-true (every parameter bf16)"
        )
    if text not in PRECISIONS:
        raise argparse.ArgumentTypeError(f"'{text}': choose from {', '.join(PRECISIONS)}")
    return text


def _add_plan_parser(sub: Any) -> None:
    """``poetxq plan``: the run plan (:mod:`poetxq.training.plan`) a recipe gets."""
    p = sub.add_parser(
        "plan", help="the run plan a recipe would get here or on a GPU of a given size",
        description="Print the run plan of a recipe (poetxq.training.plan.RunPlan): every "
        "run-level decision poetxq train would take before building anything - the memory plan "
        "(train.memory), CUDA graph (train.cuda_graph), gradient sync across processes "
        "(train.grad_sync), precision (train.precision), meta init, fused elementwise kernels "
        "(train.fuse_elementwise), relayout, the kernel policy (POETXQ_KERNELS), and what the "
        "launch would refuse, with the fix. Nothing is built, no data is read; a run writes the "
        "same plan to plan.json in its run directory.",
        epilog="examples: poetxq plan --recipe llama-1b:poetxq --gpu-memory 80GiB "
        "--world-size 2; poetxq plan --recipe my.yaml --json plan.json. Exit status 1 when "
        "the plan has a refusal (poetxq train would stop there), 2 for bad input.",
    )  # fmt: skip
    _recipe_args(p)
    p.add_argument(
        "--gpu-memory", "--gpu-mem", dest="gpu_mem", metavar="SIZE",
        help="plan for a GPU of this much memory (e.g. 80GiB; GB is read as GiB, as "
        "estimate-memory reads it) instead of this machine's device: implies --device cuda",
    )  # fmt: skip
    p.add_argument(
        "--world-size", type=int, default=1, metavar="N",
        help="processes of the run (torchrun / accelerate launch; default 1)",
    )  # fmt: skip
    p.add_argument(
        "--device", choices=("cuda", "cpu"),
        help="default: cuda with --gpu-memory or where a CUDA device is visible, else cpu",
    )  # fmt: skip
    p.add_argument("--json", metavar="PATH", help="also write the plan as JSON (plan.json's form)")


def _run_plan(args: argparse.Namespace, recipe: Any) -> int:
    """``poetxq plan``: print the plan's lines (and write ``--json``); 1 where it refuses."""
    import torch

    from poetxq.tools.bench import write_text
    from poetxq.tools.estimate_report import parse_bytes
    from poetxq.training.plan import resolve_plan

    check_kernels_env()
    if args.world_size < 1:
        raise EstimateError(f"--world-size must be at least 1, got {args.world_size}")
    gpu = parse_bytes(args.gpu_mem) if args.gpu_mem is not None else None
    device = args.device or ("cuda" if gpu is not None or torch.cuda.is_available() else "cpu")
    if device == "cuda" and gpu is None and not torch.cuda.is_available():
        raise EstimateError(
            "--device cuda without a CUDA device here: give the GPU's size with --gpu-memory "
            "(e.g. 80GiB)"
        )
    if args.json:
        check_output_file(Path(args.json), "--json", EstimateError)
    plan = resolve_plan(
        recipe, device, args.world_size, gpu, vocab_size=args.vocab_size
    )  # fmt: skip
    if args.json:
        write_text(plan.to_json(), Path(args.json))
    print("\n".join(plan.lines()))
    return 1 if plan.refusals else 0


def add_tool_parsers(sub: Any) -> None:
    """Add ``estimate-memory``, ``plan``, ``bench`` and ``report`` to the ``poetxq``
    sub-parsers."""
    p = sub.add_parser(
        "estimate-memory", help="analytic memory breakdown of a recipe's training step",
        description="Predict the peak GPU memory of one training step of a recipe (frozen "
        "weights, parameters, gradients, optimizer states, activations, logits, workspace) "
        "and whether it fits.",
        epilog="the memory options count as set: --set train.offload_activations=true, "
        "train.optimizer_in_backward=true, train.loss_chunk_tokens=N (see poetxq train --help)",
    )  # fmt: skip
    _recipe_args(p)
    p.add_argument(
        "--model", metavar="DIR",
        help="estimate a local transformers Llama-family checkpoint, as poetxq train --model "
        "trains it: the shape and vocabulary of DIR/config.json, the rest from the recipe "
        "[model.pretrained]",
    )  # fmt: skip
    p.add_argument(
        "--gpu-mem", metavar="SIZE",
        help="GPU memory to check against, e.g. 80GB or 141GiB. GB and GiB are both read as GiB "
        "(2^30 bytes), as nvidia-smi and torch report it (MB/MiB: 2^20, TB/TiB: 2^40); a bare "
        "number is bytes (at least 1 MiB). Exit status 1 when no memory plan fits it (or the one "
        "--memory names does not). Without it "
        "the plans are listed with no fit verdict and train.memory auto is the recipe as written",
    )  # fmt: skip
    p.add_argument("--precision", type=_estimate_precision, default=None,
                   metavar="{autocast,bf16-true,fp32}",
                   help="autocast: fp32 parameters + bf16 compute (train.precision auto or bf16 "
                   "on a GPU); bf16-true: every parameter bf16, no autocast (train.precision: "
                   "bf16-true); fp32: everything fp32 (the CPU). Default: what the recipe's "
                   "train.precision runs on a GPU")  # fmt: skip
    p.add_argument(
        "--processes", type=int, metavar="N",
        help="also give the per-GPU peak of N data-parallel processes (torchrun / accelerate "
        "launch; each holds the whole model), and what sharding the frozen W0 over them would "
        "leave (not implemented in poetxq)",
    )  # fmt: skip
    p.add_argument("--json", metavar="PATH", help="also write the breakdown as JSON")
    _add_plan_parser(sub)

    p = sub.add_parser(
        "bench", help="tokens/s, MFU and peak memory of a recipe on random tokens",
        description="Time training steps of a recipe on random tokens (no dataset): prints one "
        "summary line and writes JSON.",
        epilog="the recipe's memory options apply (--set train.gradient_checkpointing=true, "
        "train.offload_activations=true, train.optimizer_in_backward=true, "
        "train.loss_chunk_tokens=N) and are recorded in the JSON",
    )  # fmt: skip
    _recipe_args(p)
    p.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (default 1)")
    p.add_argument("--grad-accum", type=int, help="micro-batches per step [train.grad_accum]")
    p.add_argument(
        "--peak-tflops", type=float,
        help="accelerator peak for MFU (default: by GPU name, H100/H200 989.4)",
    )  # fmt: skip
    p.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when available")
    p.add_argument(
        "--gpu-mem", metavar="SIZE",
        help="plan the memory (train.memory: auto) for this much GPU memory instead of the "
        "device's, e.g. 16GB",
    )  # fmt: skip
    p.add_argument("--out", metavar="JSON", help="write the result here")
    p.add_argument(
        "--profile", metavar="TXT",
        help="after the timed steps, profile two more (torch.profiler) and write the top "
        "operators and the GPU time per kind of work (GEMMs, block multiplies, Cayley-Neumann, "
        "weight decode, ...) to this file",
    )  # fmt: skip

    p = sub.add_parser(
        "report", help="Markdown + PNG comparison of runs",
        description="Build report.md (results table) and loss / val-ppl / throughput / "
        "peak-memory plots from run directories; runs of the same model side by side. A run "
        "without summary.json (interrupted) is read from its metrics.jsonl and marked so.",
    )  # fmt: skip
    p.add_argument("runs", nargs="+", metavar="RUN_DIR",
                   help="run directories of poetxq train (finished or interrupted)")  # fmt: skip
    p.add_argument(
        "-o", "--out", default=DEFAULT_REPORT_DIR, metavar="DIR",
        help=f"output directory (default: {DEFAULT_REPORT_DIR}/ in the current directory); its "
        "report.md and plots are replaced, a file or a run directory there is refused",
    )  # fmt: skip


def _load(args: argparse.Namespace):  # -> Recipe
    from poetxq.training.recipe_files import load_recipe, merge_overrides

    flags: dict[str, tuple[str, Any]] = {}
    for dest, key in (("batch_size", "train.batch_size"), ("seq_len", "train.seq_len"),
                      ("grad_accum", "train.grad_accum")):  # fmt: skip
        if getattr(args, dest, None) is not None:
            flags[key] = ("--" + dest.replace("_", "-"), getattr(args, dest))
    if args.gradient_checkpointing:
        flags["train.gradient_checkpointing"] = ("--gradient-checkpointing", True)
    if args.memory is not None:
        flags["train.memory"] = ("--memory", args.memory)
    if getattr(args, "model", None) is not None:
        flags["model.pretrained"] = ("--model", args.model)
    return load_recipe(args.recipe, merge_overrides(flags, args.overrides))


def run_tool(args: argparse.Namespace) -> int:
    """Run the parsed ``estimate-memory`` / ``plan`` / ``bench`` / ``report`` command; returns
    exit status."""
    if args.command == "report":
        from poetxq.tools.report import build_report

        path = build_report(args.runs, args.out, echo=print)
        n = len({Path(p).resolve() for p in args.runs})  # a run given twice is reported once
        print(f"report: {path} ({count(n, 'run')})")
        return 0
    from poetxq.tools.bench import write_json

    recipe = _load(args)
    if args.command == "plan":
        return _run_plan(args, recipe)
    if args.command == "estimate-memory":
        from poetxq.data.config import MIN_VOCAB_SIZE
        from poetxq.tools.estimate_report import (
            format_estimate,
            format_misfit,
            format_other_variant,
            format_per_process,
            format_plans,
            other_variant,
            parse_bytes,
        )
        from poetxq.training.estimate import estimate_memory
        from poetxq.training.memory import estimation_recipe, resolve_memory_plan
        from poetxq.training.memory_table import per_process_peaks, plan_table
        from poetxq.training.precision import run_precision

        gpu = parse_bytes(args.gpu_mem) if args.gpu_mem is not None else None
        if args.json:
            check_output_file(Path(args.json), "--json", EstimateError)
        # the recipe a GPU run would train: train.memory resolved (auto: fitted to --gpu-mem)
        if args.processes is not None and args.processes < 1:
            raise EstimateError(f"--processes must be at least 1, got {args.processes}")
        if args.vocab_size is not None and args.vocab_size < MIN_VOCAB_SIZE:  # train's minimum
            raise EstimateError(
                f"--vocab-size must be at least {MIN_VOCAB_SIZE} (data.vocab_size's minimum), "
                f"got {args.vocab_size}"
            )
        ref = recipe.model.pretrained
        if ref is not None:  # train's checks first: what train --model refuses is refused here
            _check_model_dir(recipe)
        # check_positions: a --seq-len above the checkpoint's max_position_embeddings is refused
        shaped = estimation_recipe(recipe, check_positions=True) if ref is not None else None
        if ref is not None and shaped is None:  # before any other line
            where = Path(ref) / "config.json"
            why = (
                f"'{ref}' does not exist" if not Path(ref).exists() else
                f"'{ref}' is a file, not a checkpoint directory" if Path(ref).is_file() else
                f"'{ref}' holds no config.json" if not where.is_file() else
                f"{where} is not a Llama-family config (JSON with hidden_size, intermediate_size, "
                "num_attention_heads, num_hidden_layers, vocab_size, max_position_embeddings)"
            )  # fmt: skip
            raise EstimateError(f"model.pretrained: {why}; pass a checkpoint directory")
        written = recipe  # the plans' table starts from the recipe as written
        recipe, choice = resolve_memory_plan(recipe, "cpu", gpu_mem=gpu, vocab_size=args.vocab_size)
        if choice.name != "fastest" or gpu is not None:
            print(choice.line())
        runs = run_precision(recipe.train, "cuda")
        precision = args.precision or runs
        if precision == "bf16-true" and runs != "bf16-true":  # train's own check of the method
            _check_precision_applies(recipe, precision)
        if precision != runs:
            planned = written.train.precision != recipe.train.precision  # set by the memory plan
            print(
                f"note: --precision {precision} estimates another setting than the recipe's "
                f"train.precision {recipe.train.precision}"
                + (f" (the {choice.name} memory plan's)" if planned else "")
                + f" runs on a GPU ({runs})"
            )
        vocab = args.vocab_size
        title = None  # what the estimate's title names: the recipe, or the checkpoint's config
        if recipe.model.pretrained is not None:  # a --model checkpoint: its own shape
            shaped = estimation_recipe(recipe)
            assert shaped is not None  # checked above
            title = str(Path(recipe.model.pretrained) / "config.json")
            print(
                f"note: the shape and vocabulary of {title}, the other settings of "
                f"recipe {recipe.name}"
            )
            recipe, written, vocab = shaped, estimation_recipe(written) or shaped, None
        est = estimate_memory(recipe, vocab_size=vocab, precision=precision)
        if title is not None:
            est.recipe = title
        alt = other_variant(recipe, vocab_size=vocab, precision=precision)
        plans = plan_table(written, gpu_mem=gpu, vocab_size=vocab)
        shared = None
        if args.processes is not None:
            shared = per_process_peaks(written, args.processes, gpu_mem=gpu, vocab_size=vocab)
        if args.json:  # first: a reader that closes the pipe early (| head) cannot lose it
            extra = {"other_variant": {"variant": alt[0], "peak": alt[1]}} if alt else {}
            extra.update({"per_process": shared} if shared else {})
            write_json({**est.to_dict(), **extra, "plans": plans}, Path(args.json))
        print(format_estimate(est, gpu))
        if alt:
            print(format_other_variant(*alt, gpu))
        print(format_plans(plans, gpu, max(est.peak_terms, key=lambda t: t[1]), recipe.method))
        if shared:
            print(format_per_process(shared, gpu))
        named = choice.name if choice.chosen_by == "train.memory" else None  # --memory NAME
        if gpu is None:
            return 0
        from poetxq.training.memory import fit_verdict

        # a verdict, not bad input (2): 1 where the run as asked for would not fit
        misfit = format_misfit(plans, gpu, named)
        if misfit is not None:
            print(misfit)
            no_plan = not any(r["fits"] for r in plans)  # not a --memory NAME that misses
            if no_plan and (hint := four_bit_hint(written, gpu, vocab)) is not None:
                print(hint)
        # the per-GPU peak of N processes, and the estimate of another --precision, as shown
        per_gpu = shared is not None and fit_verdict(shared["data_parallel"], gpu) != "fits"
        other = precision != runs and fit_verdict(est.peak, gpu, headroom=0) != "fits"
        return 1 if misfit is not None or per_gpu or other else 0
    from poetxq.tools.bench import bench_to_dict, run_bench

    check_kernels_env()
    if args.out:  # the benchmark can take minutes: do not find out only when writing
        check_output_file(Path(args.out), "--out", BenchError)
    if args.profile:
        check_output_file(Path(args.profile), "--profile", BenchError)
        if args.out and Path(args.profile).resolve() == Path(args.out).resolve():
            raise BenchError(f"--profile and --out are the same file '{args.out}'; give two paths")

    import torch

    from poetxq.tools.estimate_report import parse_bytes

    if args.device is None and not torch.cuda.is_available():  # a GPU command, run here
        print("note: no CUDA device: timing on the CPU (pass --device cpu to say so)")
    result = run_bench(
        recipe, args.steps, warmup=args.warmup, vocab_size=args.vocab_size,
        peak_tflops=args.peak_tflops, device=args.device,
        gpu_mem=parse_bytes(args.gpu_mem) if args.gpu_mem is not None else None,
        command="poetxq " + shlex.join(sys.argv[1:]),
        profile=Path(args.profile) if args.profile else None, echo=print,
    )  # fmt: skip
    print(result.summary_line())
    if args.out:
        write_json(bench_to_dict(result), Path(args.out))
    return 0
