"""Continued training of a pretrained model: which learning rates keep it intact.

Continues a converted SmolLM2-135M (``--model``; a transformers directory) with POET-XQ for a
few steps at each ``optim.lr`` x ``optim.poet_lr`` pair, plus the embedded default recipe's
pretraining rates, and records the validation perplexity at every evaluation. Every run uses the
same data, seed and validation batches, so the curves differ only by their rates. By default the
warmup is short and the rates then stay at their peak (``optim.min_lr_ratio=1``): a stricter test
than a cosine that decays within the few steps measured.

The criterion (docs/EXPORT.md, "Continuing a pretrained model"): the validation perplexity never
rises above its step-0 value by more than ``--tolerance`` (relative) and is below it at the end.

The results JSON starts with the provenance header (date, device, torch, commit, command) and
holds each setting under ``runs``: its rates, the perplexity at each evaluated step, the largest
relative rise over step 0, the final relative change and whether the criterion holds.

Usage (CPU, about 3 minutes per setting on one core)::

    python evals/continued_training_sweep.py --model /tmp/smollm2-135m \\
        --out evals/results/continued_training_smollm2_cpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _common import provenance, write_json_atomic

from poetxq.tools.cli import main as poetxq_main

#: the embedded default recipe's (pretraining) rates, the setting that destroys the model
PRETRAINING = (5e-3, 4e-3)


def eval_curve(run_dir: Path) -> dict[int, float]:
    """Validation perplexity by step, from a run's ``metrics.jsonl``."""
    curve: dict[int, float] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "val_ppl" in row:
            curve[int(row["step"])] = float(row["val_ppl"])
    return curve


def judge(curve: dict[int, float], tolerance: float) -> dict[str, Any]:
    """The criterion on one curve: largest rise over step 0, final change, and whether it holds.

    Args:
        curve: step -> validation perplexity, step 0 included.
        tolerance: the relative rise over step 0 counted as noise.

    Returns:
        ``max_rise`` (relative, >= 0), ``final_change`` (relative; negative = better) and
        ``keeps_model`` (never above step 0 by more than ``tolerance``, below it at the end).
    """
    first = curve[0]
    later = [curve[s] for s in sorted(curve) if s > 0]
    max_rise = max(0.0, max(later) / first - 1.0)
    final_change = later[-1] / first - 1.0
    return {
        "max_rise": round(max_rise, 5),
        "final_change": round(final_change, 5),
        "keeps_model": max_rise <= tolerance and final_change < 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the sweep and write the results JSON; prints one line per setting."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", required=True, help="transformers checkpoint dir (or named base)")
    ap.add_argument("--out", required=True, help="results JSON")
    ap.add_argument("--lrs", default="1e-4,1e-5,1e-3", help="optim.lr values, comma-separated")
    ap.add_argument("--poet-lrs", default="1e-4,1e-5,1e-3", help="optim.poet_lr values")
    ap.add_argument("--no-pretraining", action="store_true", help="skip the pretraining rates")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--eval-batches", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--data", default="embedded")
    ap.add_argument("--bits", default="8")
    ap.add_argument("--tolerance", type=float, default=0.01, help="relative rise counted as noise")
    ap.add_argument(
        "--set",
        action="append",
        default=["optim.warmup_steps=5", "optim.min_lr_ratio=1.0"],
        help="extra recipe overrides for every run (default: a 5-step warmup, then constant)",
    )
    args = ap.parse_args(argv)
    pairs = [(float(a), float(b)) for a in args.lrs.split(",") for b in args.poet_lrs.split(",")]
    if not args.no_pretraining:  # first: the reference the others are judged against
        pairs.insert(0, PRETRAINING)
    common = [
        "--model", args.model, "--bits", args.bits, "--data", args.data,
        "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
        "--max-steps", str(args.steps), "--eval-every", str(args.eval_every),
        "--set", f"train.eval_max_batches={args.eval_batches}", "--no-progress",
    ]  # fmt: skip
    for text in args.set:
        common += ["--set", text]
    doc: dict[str, Any] = {
        **provenance("cpu" if not torch.cuda.is_available() else torch.cuda.get_device_name(),
                     argv),
        "model": args.model,
        "train_args": " ".join(common),
        "tolerance": args.tolerance,
        "runs": {},
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for lr, poet_lr in pairs:
            name = f"lr{lr:g}_poet{poet_lr:g}"
            start = time.perf_counter()
            code = poetxq_main(
                ["train", "--output-dir", tmp, "--run-name", name, "--lr", f"{lr:g}",
                 "--poet-lr", f"{poet_lr:g}", *common]
            )  # fmt: skip
            row: dict[str, Any] = {"lr": lr, "poet_lr": poet_lr}
            if code:
                row["exit_code"] = code
            else:
                curve = eval_curve(Path(tmp) / name)
                row["val_ppl"] = {str(s): round(p, 3) for s, p in sorted(curve.items())}
                row.update(judge(curve, args.tolerance))
            row["wall_s"] = round(time.perf_counter() - start, 1)
            doc["runs"][name] = row
            write_json_atomic(args.out, doc)
            print(f"{name:22s} {json.dumps(row)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
