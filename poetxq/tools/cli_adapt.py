"""The ``fpo-diagnose`` sub-command of ``poetxq`` (forward-only MLP adaptation, FPO).

``poetxq fpo-diagnose MODEL --data D`` loads a transformers Llama-family directory, tokenizes
``D`` with the model's own tokenizer, takes a calibration batch of training windows and runs
:func:`poetxq.adapt.diagnose.diagnose`: the per-layer cosine between FPO's pseudo-gradient and the
autograd gradient (``down_proj`` and the whole MLP), the suggested target layers and starting
learning rates. Errors are :class:`poetxq.adapt.fpo.FPOError` (a ``ValueError``);
``poetxq.tools.cli.main`` prints them as one ``poetxq: error: ...`` line with status 2.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch

from poetxq.adapt.fpo import FPOError
from poetxq.tools.cli_common import check_output_file

ADAPT_COMMANDS: tuple[str, ...] = ("fpo-diagnose",)


def add_adapt_parsers(sub: Any) -> None:
    """Add ``fpo-diagnose`` to the ``poetxq`` sub-parsers."""
    p = sub.add_parser(
        "fpo-diagnose", help="which layers forward-only MLP adaptation (FPO) can train",
        description="Per-layer cosine between the FPO pseudo-gradient (output error through "
        "the LM head and final RMSNorm, no back-propagation through the layers; arXiv "
        "2608.14563) and the true autograd gradient, for down_proj and the whole MLP, on a "
        "calibration batch of MODEL's tokenization of --data. Prints the table, the suggested "
        "target layers (the last quarter's plateau) and starting learning rates.",
    )  # fmt: skip
    p.add_argument(
        "model",
        metavar="MODEL",
        help="a transformers Llama-family directory (save_pretrained / poetxq export)",
    )
    p.add_argument(
        "--data",
        required=True,
        metavar="D",
        help="text source as for poetxq train: embedded, pydoc, a local path, hf:NAME",
    )
    p.add_argument(
        "--windows", type=int, default=16, help="calibration sequences (default 16, as the paper)"
    )
    p.add_argument(
        "--seq-len",
        type=int,
        default=512,
        help="tokens per calibration sequence (default 512, as the paper)",
    )
    p.add_argument(
        "--micro-batch",
        type=int,
        default=4,
        help="sequences per forward/backward (memory only; default 4)",
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
    p.add_argument("--seed", type=int, default=0, help="which training windows (default 0)")
    p.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when available")
    p.add_argument("--out", metavar="JSON", help="write the diagnosis as JSON")
    p.add_argument("--plot", metavar="PNG", help="plot the cosine curves")  # fmt: skip


def _calibration(model_dir: str, args: argparse.Namespace, config: Any) -> torch.Tensor:
    """``args.windows`` training windows of ``args.seq_len + 1`` tokens of ``--data``."""
    from poetxq.data import DataConfig, prepare_data
    from poetxq.model.pretrained import check_seq_len

    if args.windows < 1 or args.seq_len < 1 or args.micro_batch < 1:
        raise FPOError("--windows, --seq-len and --micro-batch must be at least 1")
    check_seq_len(config, args.seq_len, model_dir)
    data = prepare_data(DataConfig(source=args.data, tokenizer=model_dir), args.seq_len,
                        progress=False)  # fmt: skip
    if data.vocab_size > config.vocab_size:
        raise FPOError(
            f"the tokenizer of '{model_dir}' has {data.vocab_size} ids but the model embeds "
            f"{config.vocab_size}; its tokenizer and weights do not belong together"
        )
    n = data.train.shape[0]
    if n == 0:
        raise FPOError(f"--data {args.data} holds no training window of {args.seq_len + 1} tokens")
    if n < args.windows:
        print(f"note: --data holds {n} training windows; using all, not {args.windows}")
    pick = torch.randperm(n, generator=torch.Generator().manual_seed(args.seed))[: args.windows]
    return data.train[pick.sort().values]


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


def run_adapt(args: argparse.Namespace) -> int:
    """Run the parsed ``fpo-diagnose`` command; returns the exit status."""
    from poetxq.adapt.diagnose import diagnose
    from poetxq.model.pretrained import check_pretrained_config, load_pretrained, resolve_pretrained
    from poetxq.tools.bench import write_json

    for flag, value in (("--out", args.out), ("--plot", args.plot)):
        if value:
            check_output_file(Path(value), flag, FPOError)
    model_dir = resolve_pretrained(args.model)
    config = check_pretrained_config(model_dir)
    windows = _calibration(model_dir, args, config)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = load_pretrained(model_dir).to(device)
    diag = diagnose(model, windows, micro_batch=args.micro_batch, quarter=args.quarter,
                    tolerance=args.tolerance)  # fmt: skip
    report = {"model": model_dir, "data": args.data, **diag.to_dict()}
    if args.out:
        write_json(report, Path(args.out))
    if args.plot:
        _plot(report, Path(args.plot))
    print(f"{'layer':>5}  {'cos_w3':>7}  {'cos_mlp':>7}  {'|g~h|/|W3|':>10}")
    for r in diag.layers:
        mark = "  <- target" if r.layer in diag.targets else ""
        print(f"{r.layer:>5}  {r.cos_w3:>7.3f}  {r.cos_mlp:>7.3f}  {r.ratio:>10.3g}{mark}")
    print(f"calibration: {diag.n_tokens} tokens, loss {diag.loss:.4f}")
    print(f"targets: {','.join(map(str, diag.targets))} ({diag.rule})")
    for name, lr in diag.lr.items():
        sweep = ", ".join(f"{v:.3g}" for v in diag.sweep[name])
        print(f"lr {name}: {lr:.3g} (sweep {sweep})")
    return 0
