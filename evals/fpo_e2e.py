"""FPO end to end on CPU on a model of ours, beside SFT-partial and full fine-tuning (issue 29).

1. Pretrain a small Llama of ours with ``poetxq train`` (POET-XQ, the embedded tiny recipe with
   6 layers instead of 4) on the embedded English corpus (Shakespeare + KJV Bible).
2. Export it as a transformers directory (``poetxq export RUN --format hf-bf16``).
3. Diagnose it once on the new domain (``poetxq fpo-diagnose``: target layers, starting lr).
4. Adapt it to another offline domain, Python's pydoc topics (``--data pydoc``), with
   ``poetxq fpo-adapt --method fpo | sft-partial | full`` at the same steps, batch, seed, layers
   and learning rate, tracking the original domain (``--ood-data embedded``: the pretraining
   corpus's validation split, the same documents the pretraining run validated on); and with
   POET-XQ continued training (``poetxq train --model``, its own defaults for a pretrained model)
   for the same steps and batch, evaluated on the same windows (:func:`continued`).
5. Write one JSON: per method in-domain and original-domain perplexity before and after, the
   relative change of the latter against the tolerance stated below, tokens/s of the update
   steps, peak RSS of the process, steps and the exact commands.

The tolerance and the learning-rate rule are constants of this file, fixed before the first run
and not tuned on its results.

    python evals/fpo_e2e.py --out evals/results/fpo_e2e_cpu.json
    python evals/fpo_e2e.py --smoke --out /tmp/fpo_e2e_smoke.json   # tiny, a few steps
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from _common import provenance, write_json_atomic

# Stated before running: after adaptation the original domain's validation perplexity may be at
# most 5 % above the base model's (relative change of the perplexity, not of the loss).
OOD_TOLERANCE = 0.05

LR_RULE = (
    "one learning rate for all three methods: the AdamW lr that `poetxq fpo-diagnose` suggests "
    "for the base model on the in-domain data (1e-3 x median rms(W3) of its target layers, a "
    "relative step of 0.1 % per update); FPO and SFT-partial adapt the diagnosis' target MLPs, "
    "full fine-tuning every parameter, all with AdamW (weight decay 0.01) on fp32 masters and "
    "the 1 % relative update clip"
)

METHODS: tuple[str, ...] = ("fpo", "sft-partial", "full")


@dataclass(frozen=True)
class Config:
    """Sizes of one end-to-end run (:data:`FULL` or :data:`SMOKE`)."""

    pretrain_set: tuple[str, ...]  # --set overrides of the embedded tiny recipe
    pretrain_steps: int
    pretrain_seq_len: int
    seq_len: int  # adaptation and evaluation windows
    windows: int  # calibration windows of the diagnosis
    steps: int  # adaptation steps, every method
    batch_size: int
    eval_batches: int
    data: str = "pydoc"
    ood_data: str = "embedded"
    seed: int = 0


FULL = Config(
    pretrain_set=("model.num_hidden_layers=6",),
    pretrain_steps=240,
    pretrain_seq_len=128,
    seq_len=128,
    windows=16,
    steps=60,
    batch_size=8,
    eval_batches=16,
)

SMOKE = Config(
    pretrain_set=(
        "model.hidden_size=64",
        "model.intermediate_size=128",
        "model.num_attention_heads=2",
        "model.num_hidden_layers=2",
        "optim.warmup_steps=1",
    ),
    pretrain_steps=3,
    pretrain_seq_len=32,
    seq_len=32,
    windows=4,
    steps=2,
    batch_size=2,
    eval_batches=2,
)


@dataclass
class Ran:
    """One finished command: its line, exit status, wall time and peak resident memory."""

    command: str
    rc: int
    wall_s: float
    peak_rss_bytes: int


def run(args: list[str], log: Path) -> Ran:
    """Run ``python -m poetxq ARGS`` with stdout and stderr to ``log``; wait for it with
    ``os.wait4`` so the peak RSS is that process's own (``ru_maxrss``, KiB on Linux). The study
    is a CPU study: the command sees no GPU, also on a GPU host (``poetxq train`` would take it).

    Raises:
        RuntimeError: the command failed (the message ends with its log's last lines).
    """
    line = "poetxq " + shlex.join(args)
    print(f"$ {line}", flush=True)
    t0 = time.perf_counter()
    with log.open("w", encoding="utf-8") as f:
        proc = subprocess.Popen([sys.executable, "-m", "poetxq", *args], stdout=f,
                                stderr=subprocess.STDOUT,
                                env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})  # fmt: skip
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    ran = Ran(line, proc.returncode, time.perf_counter() - t0, usage.ru_maxrss * 1024)
    if ran.rc != 0:
        tail = "\n".join(log.read_text(encoding="utf-8").splitlines()[-15:])
        raise RuntimeError(f"{line} exited {ran.rc}:\n{tail}")
    return ran


def relative_change(before: float, after: float) -> float:
    """``after / before − 1`` (0.05: 5 % higher)."""
    return after / before - 1.0


def within_tolerance(before: float, after: float, tolerance: float = OOD_TOLERANCE) -> bool:
    """Whether ``after`` is at most ``tolerance`` (relative) above ``before`` and finite."""
    return math.isfinite(after) and relative_change(before, after) <= tolerance


def pretrain(cfg: Config, work: Path) -> tuple[Path, Ran, dict[str, Any]]:
    """Train the base model of ours; returns its run directory, the command and its summary."""
    args = ["train", "--data", "embedded", "--max-steps", str(cfg.pretrain_steps),
            "--seq-len", str(cfg.pretrain_seq_len), "--seed", str(cfg.seed),
            "--output-dir", str(work), "--run-name", "base", "--overwrite", "--no-progress",
            "--eval-every", "0"]  # fmt: skip
    for kv in cfg.pretrain_set:
        args += ["--set", kv]
    ran = run(args, work / "pretrain.log")
    run_dir = work / "base"
    summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    return run_dir, ran, summary


def _adapt_args(cfg: Config) -> list[str]:
    """The data, window and seed flags every fpo-* command shares."""
    return ["--data", cfg.data, "--seq-len", str(cfg.seq_len), "--windows", str(cfg.windows),
            "--seed", str(cfg.seed), "--device", "cpu"]  # fmt: skip


def adapt(method: str, model: Path, layers: list[int], lr: float, lr_scale: float, cfg: Config,
          work: Path) -> dict[str, Any]:  # fmt: skip
    """One ``poetxq fpo-adapt --method METHOD`` run; returns its row of the table."""
    out = work / f"adapt-{method}-x{lr_scale:g}"
    args = ["fpo-adapt", str(model), *_adapt_args(cfg), "--ood-data", cfg.ood_data,
            "--method", method, "--layers", ",".join(map(str, layers)), "--lr", f"{lr:.6g}",
            "--optimizer", "adamw", "--steps", str(cfg.steps),
            "--batch-size", str(cfg.batch_size), "--eval-batches", str(cfg.eval_batches),
            "--eval-every", "0", "--save-every", "0", "--log-every", "10",
            "--out", str(out)]  # fmt: skip
    ran = run(args, out.parent / f"{out.name}.log")
    s = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    first, last = s["first"], s["last"]
    return {
        "method": method,
        "steps": s["steps"],
        "layers": s["layers"],
        "lr": s["lr"],
        "lr_scale": lr_scale,
        "adapted_params": s["target_params"],
        "in_domain_ppl_before": first["val_ppl"],
        "in_domain_ppl_after": last["val_ppl"],
        "ood_ppl_before": first["ood_ppl"],
        "ood_ppl_after": last["ood_ppl"],
        "ood_rel_change": relative_change(first["ood_ppl"], last["ood_ppl"]),
        "ood_within_tolerance": within_tolerance(first["ood_ppl"], last["ood_ppl"]),
        "in_domain_rel_change": relative_change(first["val_ppl"], last["val_ppl"]),
        "tokens_per_s": s["tokens_per_s"],
        "tokens": s["tokens_this_session"],
        "peak_rss_bytes": ran.peak_rss_bytes,
        "wall_s": ran.wall_s,
        "command": ran.command,
    }


def continued(model: Path, base: dict[str, Any], cfg: Config, work: Path) -> dict[str, Any]:
    """POET-XQ continued training of the base (``poetxq train --model``: W0 int8, the defaults
    it takes for a pretrained model) on the in-domain data for the same steps, batch and
    sequence length, then exported (``hf-bf16``) and evaluated as the other rows are: its
    perplexities after are ``fpo-adapt``'s step-0 evaluation of the exported model (the same
    windows and evaluator; that run's single update is discarded). ``base``: a row of
    :func:`adapt`, whose "before" values every method shares."""
    args = ["train", "--model", str(model), "--data", cfg.data, "--seq-len", str(cfg.seq_len),
            "--batch-size", str(cfg.batch_size), "--set", "train.grad_accum=1",
            "--max-steps", str(cfg.steps), "--seed", str(cfg.seed), "--output-dir", str(work),
            "--run-name", "continued", "--overwrite", "--no-progress",
            "--eval-every", "0"]  # fmt: skip
    ran = run(args, work / "continued.log")
    run_dir, hf, out = work / "continued", work / "continued-hf", work / "eval-continued"
    s = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    optim = _recipe_optim(run_dir)
    run(["export", str(run_dir), "--format", "hf-bf16", str(hf), "--overwrite"],
        work / "continued-export.log")  # fmt: skip
    run(["fpo-adapt", str(hf), *_adapt_args(cfg), "--ood-data", cfg.ood_data, "--method", "fpo",
         "--layers", "-1", "--lr", "1e-12", "--steps", "1", "--batch-size", str(cfg.batch_size),
         "--eval-batches", str(cfg.eval_batches), "--eval-every", "0", "--save-every", "0",
         "--out", str(out)], work / "eval-continued.log")  # fmt: skip
    after = json.loads((out / "summary.json").read_text(encoding="utf-8"))["first"]
    before_in, before_ood = base["in_domain_ppl_before"], base["ood_ppl_before"]
    return {
        "method": "poetxq-continued",
        "steps": s["steps"],
        "lr": optim["lr"],
        "poet_lr": optim["poet_lr"],
        "warmup_steps": optim["warmup_steps"],
        "lr_scale": None,
        "in_domain_ppl_before": before_in,
        "in_domain_ppl_after": after["val_ppl"],
        "ood_ppl_before": before_ood,
        "ood_ppl_after": after["ood_ppl"],
        "ood_rel_change": relative_change(before_ood, after["ood_ppl"]),
        "ood_within_tolerance": within_tolerance(before_ood, after["ood_ppl"]),
        "in_domain_rel_change": relative_change(before_in, after["val_ppl"]),
        "tokens_per_s": s["tokens_per_s"],
        "tokens": s["tokens"],
        "peak_rss_bytes": ran.peak_rss_bytes,
        "wall_s": ran.wall_s,
        "command": ran.command,
    }


def _recipe_optim(run_dir: Path) -> dict[str, Any]:
    """The ``optim`` section of a run's ``recipe.yaml`` (safe loader)."""
    import yaml

    return yaml.safe_load((run_dir / "recipe.yaml").read_text(encoding="utf-8"))["optim"]


def render_table(doc: dict[str, Any]) -> str:
    """The one markdown table of a results document (docs/FPO.md shows it)."""
    tol = doc["ood_tolerance"]
    lines = [
        "| method | lr (× diagnosed) | in-domain ppl before → after | original-domain ppl "
        f"before → after (Δ, within {tol:.0%}?) | tokens/s | peak RSS |",
        "|---|---|---|---|---|---|",
    ]
    for r in [*doc["methods"], *([doc["continued"]] if doc.get("continued") else [])]:
        ok = "yes" if r["ood_within_tolerance"] else "**no**"
        scale = r.get("lr_scale", 1.0)
        rate = f"× {scale:g}" if scale is not None else "its --model default"
        lines.append(
            f"| {r['method']} | {r['lr']:.3g} ({rate}) "
            f"| {r['in_domain_ppl_before']:.2f} → {r['in_domain_ppl_after']:.2f} "
            f"| {r['ood_ppl_before']:.2f} → {r['ood_ppl_after']:.2f} "
            f"({r['ood_rel_change']:+.1%}, {ok}) | {r['tokens_per_s']:,.0f} "
            f"| {r['peak_rss_bytes'] / 2**20:,.0f} MiB |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Pretrain, export, diagnose, adapt three ways; write ``--out``. Returns 0."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="results JSON")
    p.add_argument("--smoke", action="store_true", help="a 2-layer d=64 model, a few steps")
    p.add_argument("--work", help="keep the runs here (default: a temporary folder, removed)")
    p.add_argument("--lr-scales", type=float, nargs="+", default=[1.0], metavar="S",
                   help="run the three methods at each multiple S of the diagnosed lr "
                   "(default 1): where the original domain's tolerance is met")  # fmt: skip
    args = p.parse_args(argv)
    if any(not (0 < x < 100) for x in args.lr_scales):
        p.error(f"--lr-scales must lie in (0, 100), got {args.lr_scales}")
    cfg = SMOKE if args.smoke else FULL
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fpo_e2e-") as tmp:
        work = Path(args.work or tmp).resolve()
        work.mkdir(parents=True, exist_ok=True)
        run_dir, pre, pre_summary = pretrain(cfg, work)
        hf = work / "hf"
        exp = run(["export", str(run_dir), "--format", "hf-bf16", str(hf), "--overwrite"],
                  work / "export.log")  # fmt: skip
        diag_json = work / "diagnose.json"
        diag = run(["fpo-diagnose", str(hf), *_adapt_args(cfg), "--out", str(diag_json)],
                   work / "diagnose.log")  # fmt: skip
        report = json.loads(diag_json.read_text(encoding="utf-8"))
        layers, lr = report["targets"], report["lr"]["adamw"]
        rows = [adapt(m, hf, layers, lr * x, x, cfg, work)
                for x in args.lr_scales for m in METHODS]  # fmt: skip
        cont = continued(hf, rows[0], cfg, work)
    doc = {
        **provenance("cpu", argv),
        "device": f"cpu ({os.cpu_count()} cores visible, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')})",
        "what": "FPO vs SFT-partial vs full fine-tuning of a POET-XQ model of ours pretrained on "
        "the embedded corpus (Shakespeare + KJV), adapted to pydoc topics; the original "
        "domain is the embedded corpus's validation split",
        "smoke": args.smoke,
        "ood_tolerance": OOD_TOLERANCE,
        "ood_tolerance_rule": f"original-domain val ppl after / before - 1 <= {OOD_TOLERANCE} "
        "(stated in the script before the first run)",
        "lr_rule": LR_RULE,
        "config": asdict(cfg),
        "pretrain": {
            "command": pre.command,
            "wall_s": pre.wall_s,
            "val_ppl": pre_summary.get("final_val_ppl"),
            "summary": pre_summary,
        },
        "export": {"command": exp.command, "wall_s": exp.wall_s},
        "diagnose": {
            "command": diag.command,
            "targets": layers,
            "lr": report["lr"],
            "layers": report["layers"],
        },
        "methods": rows,
        "continued": cont,
        "total_wall_s": time.perf_counter() - t0,
        "note": "CPU cores shared with another job: tokens/s compares the methods within this "
        "run only; peak RSS is the whole fpo-adapt process (Python, torch, data, model)",
    }
    write_json_atomic(args.out, doc)
    print(render_table(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
