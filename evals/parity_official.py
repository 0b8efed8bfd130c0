"""Parity with the official POET-XQ (issue 32, item 4): our trainer and the official code, same
data, seed and settings, validation loss at the same steps on the same windows.

(a) ours: :func:`poetxq.training.train.train` of the ``<model>:poetxq`` recipe on the study's token
corpus
    (``train`` split; validation on the ``tune`` split, as the quality study does).
(b) official: ``poet_torch.POETModel(QPOETConfig)`` around a transformers ``LlamaForCausalLM`` of
    the same shape, trained by :func:`evals.parity_train.train_official`, a loop written here
    after the official training script (``examples/torchrun_main.py --optimizer q_poet`` of
    github.com/Sphere-AI-Lab/poet): ``get_poet_optimizer`` (``POETAdamW``), the script's cosine
    schedule with warmup and a min lr ratio (:func:`evals.parity_settings.official_lr_factor`),
    gradient clipping with the official ``calc_poet_grad_clipping_value`` (0.1x -> 1x over 10
    steps after each merge), ``merge_if_needed`` after every optimizer step (merge every
    ``merge_interval`` steps; the optimizer resets Q's Adam moments on the same steps by itself).

Both draw the same micro-batches in the same order
(:class:`poetxq.training.distributed.ShardedBatches` with the trainer's seed, ``train.seed + 2``),
use the same loss (:func:`poetxq.training.evaluate .causal_lm_loss`: next-token cross-entropy over
the window, fp32) and the same evaluation (:func:`poetxq.training.evaluate.evaluate_perplexity` over
the same validation windows, same batch size). How each setting maps onto each side, and what cannot
be made equal, is written into the JSON (``mapping``, ``differences``). The rotation lr: both sides
train Q at ``--poet-lr`` × 0.5 (the official ``QPOETConfig.poet_scale`` default at @3a34bb6, read
from the loaded code; our ``optim.poet_lr_scale`` is set to it).

Precision (``--precision``, both sides): ``autocast`` (default, as the quality study runs ours):
fp32 parameters and moments, bf16 autocast; the official custom ops get autocast rules
(:data:`evals.parity_train.OFFICIAL_AUTOCAST`) because the official code itself only runs in
pure bf16 or fp32.
``bf16-true``: bf16 parameters, no autocast (the official script's ``--dtype bfloat16``; ours
``train.precision: bf16-true``). ``fp32``. The official model runs eagerly unless
``--official-compile`` (the script compiles it; the layer's own compiled forward under autocast
is untested). Each official run records a check of its Cayley-Neumann kernel
(:func:`evals.parity_train.cayley_check`).

Where the parts live: the settings and how they map onto each side in
``evals/parity_settings.py``, the two trainers in ``evals/parity_train.py``, the summary rule in
``evals/parity_summary.py``; this file runs the comparison (:func:`run_parity`) and the command
line.

The official code is never committed here: a copy of its ``poet_torch/`` lives in ``.official/``
(git-ignored; :mod:`evals.official_poet`). Make one from a clone or a bare mirror::

    mkdir -p .official && git --git-dir=POET.git archive HEAD poet_torch | tar -x -C .official
    git --git-dir=POET.git rev-parse HEAD > .official/COMMIT   # recorded in the JSON

Usage (on the GPU host; several seeds give the seed noise the curves are judged against; the
JSON is rewritten after each finished side, and ``--previous`` continues from an earlier call's
JSON, so seeds can be spread over calls of limited time)::

    python evals/parity_official.py --steps 400 --poet-lr 8e-3 --eval-every 50 \
        --seeds 0 1 --out evals/results/parity_official_60m_h200.json --official .official
    python evals/parity_official.py ... --seeds 2 --previous FIRST.json --out BOTH.json

A smoke test on the CPU (``TRITON_INTERPRET=1``, a tiny shape)::

    TRITON_INTERPRET=1 python evals/parity_official.py --steps 4 --merge-interval 2 \
        --eval-every 2 --batch-size 4 --seq-len 32 --block-size 16 --val-tokens 2048 \
        --set model.hidden_size=32 --set model.intermediate_size=64 \
        --set model.num_attention_heads=2 --set model.num_hidden_layers=1 --out /tmp/p.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "evals"))

import official_poet  # noqa: E402
from _common import provenance, write_json_atomic  # noqa: E402
from parity_settings import (  # noqa: E402
    DIFFERENCES,
    Settings,
    mapping,
    official_poet_scale,
    our_recipe,
)
from parity_summary import summarize  # noqa: E402
from parity_train import train_official, train_ours  # noqa: E402


class PreviousMismatch(ValueError):
    """The earlier results given to continue from compare something else."""


def official_commit_of(folder: Path) -> str:
    """``folder/COMMIT`` (written beside the copy, see the module docstring) or ``unknown``."""
    path = folder / "COMMIT"
    return path.read_text().strip() if path.is_file() else "unknown"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"cpu ({platform.machine()})"


def run_parity(
    s: Settings,
    poet: ModuleType,
    data: Any,
    *,
    device: torch.device,
    work: Path,
    official_commit: str = "unknown",
    compile_official: bool = False,
    echo: Callable[[str], None] = print,
    on_update: Callable[[dict[str, Any]], None] | None = None,
    previous: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Train both sides for every seed of ``s`` (ours first) and return the document: settings,
    mapping, differences, per-seed curves and :func:`summarize`. ``on_update`` gets the document
    after every finished side (the CLI writes it, so a stopped run keeps what was done).
    ``previous``: the document of an earlier call with the same settings (seeds aside): its
    finished seeds are kept and not run again (seeds spread over several calls of limited time).

    Raises:
        PreviousMismatch: ``previous`` was made with other settings, data or official code.
    """
    scale = official_poet_scale(poet)
    official_poet.one_config_under_interpreter(poet)
    doc: dict[str, Any] = {
        "what": "validation loss of our POET-XQ and the official POET-XQ (poet_torch "
        "POETModel(QPOETConfig)), same data, seed, settings, batches and validation windows",
        "official_code": {"repo": "github.com/Sphere-AI-Lab/poet", "commit": official_commit},
        "settings": {
            **{k: v for k, v in asdict(s).items() if k != "seeds"},
            "seeds": list(s.seeds),
            "warmup_steps": s.warmup_steps,
            "model_shape": our_recipe(s, 0, scale).model.model_dump(mode="json"),
            "tokens_per_step": s.batch_size * s.grad_accum * s.seq_len,
            "vocab_size": data.vocab_size,
            "train_windows": int(data.train.shape[0]),
            "val_windows": int(data.val.shape[0]),
            "val_tokens_scored": int(data.val[:, 1:].numel()),
            "data": data.source_description,
        },
        "mapping": mapping(s, scale, official_commit),
        "differences": DIFFERENCES,
        "runs": [],
    }
    if previous is not None:
        kept = _finished_runs(previous, doc)
        doc["runs"] = kept
        done = [r["seed"] for r in kept]
        doc["settings"]["seeds"] = done + [x for x in s.seeds if x not in done]
        echo(f"kept the finished seeds {done} of the earlier results")
    for seed in s.seeds:
        if any(r["seed"] == seed for r in doc["runs"]):
            continue
        run: dict[str, Any] = {"seed": seed, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                    time.gmtime())}  # fmt: skip
        doc["runs"].append(run)
        echo(f"seed {seed}: ours")
        run["ours"] = train_ours(s, seed, data, scale, work, echo)
        if on_update:
            on_update(doc)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        echo(f"seed {seed}: official")
        run["official"] = train_official(poet, s, seed, data, device, echo,
                                         compile_model=compile_official)  # fmt: skip
        doc["summary"] = summarize(doc["runs"])
        if on_update:
            on_update(doc)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    doc["summary"] = summarize(doc["runs"])
    return doc


def _finished_runs(previous: dict[str, Any], doc: dict[str, Any]) -> list[dict[str, Any]]:
    """``previous``'s runs with both sides done, after checking that it compares the same thing
    as ``doc`` (settings but the seeds, official commit)."""
    a = {k: v for k, v in previous.get("settings", {}).items() if k != "seeds"}
    b = {k: v for k, v in doc["settings"].items() if k != "seeds"}
    differ = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    if previous.get("official_code") != doc["official_code"]:
        differ.append("official_code")
    if differ:
        raise PreviousMismatch(f"--previous results were made with other settings: {differ}")
    return [r for r in previous.get("runs", []) if "ours" in r and "official" in r]


def load_data(corpus_dir: Path, s: Settings) -> Any:
    """The study's token corpus: ``train`` windows for training, ``tune`` for validation
    (``s.val_tokens`` of it, evenly spread), windows of ``seq_len + 1`` tokens."""
    from poetxq.data.corpus import TokenCorpus, token_data

    corpus = TokenCorpus.open(corpus_dir)
    return token_data(corpus, s.seq_len, heldout="tune", max_val_tokens=s.val_tokens)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument(
        "--poet-lr",
        type=float,
        default=8e-3,
        help="rotation lr before the POET scale (both sides: x0.5 at @3a34bb6)",
    )
    ap.add_argument("--lr", type=float, default=1e-2, help="embeddings, lm_head, norms")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--model", default="llama-60m", help="recipes/models name")
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--merge-interval", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--precision", default="autocast", choices=["autocast", "bf16-true", "fp32"])
    ap.add_argument("--val-tokens", type=int, default=1_048_576)
    ap.add_argument("--corpus", default=str(REPO / "data" / "quality-corpus"))
    ap.add_argument(
        "--official",
        default=None,
        help="folder holding poet_torch/ (default $POETXQ_OFFICIAL_DIR or .official/)",
    )
    ap.add_argument(
        "--official-compile",
        action="store_true",
        help="torch.compile the official model as its script does (default: eager)",
    )
    ap.add_argument("--work-dir", default=None, help="our run directories (default: a temp dir)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="model.KEY=VALUE",
        help="model shape override (repeatable; smoke tests on a small model)",
    )
    ap.add_argument(
        "--previous",
        default=None,
        help="results JSON of an earlier call with the "
        "same settings: its finished seeds are kept and not run again",
    )
    ap.add_argument("--out", required=True, help="JSON file to write")
    args = ap.parse_args(argv)  # fmt: skip
    overrides: dict[str, Any] = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key.startswith("model."):
            ap.error(f"--set {item!r}: only model.KEY=VALUE (the shape both sides build)")
        overrides[key] = yaml.safe_load(value)
    previous = None
    if args.previous:
        try:
            previous = json.loads(Path(args.previous).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            ap.error(f"--previous {args.previous}: {exc}")
    try:
        poet = official_poet.load(args.official)
    except official_poet.OfficialNotFound as exc:
        print(f"parity_official: error: {exc}", file=sys.stderr)
        return 2
    s = Settings(
        steps=args.steps, poet_lr=args.poet_lr, lr=args.lr, eval_every=args.eval_every,
        seeds=args.seeds, model=args.model, block_size=args.block_size,
        merge_interval=args.merge_interval, batch_size=args.batch_size,
        grad_accum=args.grad_accum, seq_len=args.seq_len, precision=args.precision,
        val_tokens=args.val_tokens, model_overrides=overrides,
    )  # fmt: skip
    device = torch.device(args.device)
    data = load_data(Path(args.corpus), s)
    head = provenance(device_name(device), argv)
    out = Path(args.out)
    commit = official_commit_of(official_poet.official_dir(args.official))

    def echo(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    def write(doc: dict[str, Any]) -> None:
        write_json_atomic(out, {**head, **doc})

    with contextlib.ExitStack() as stack:
        work = Path(args.work_dir) if args.work_dir else Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="parity-")))  # fmt: skip
        try:
            doc = run_parity(s, poet, data, device=device, work=work, official_commit=commit,
                             compile_official=args.official_compile, echo=echo,
                             on_update=write, previous=previous)  # fmt: skip
        except PreviousMismatch as exc:
            print(f"parity_official: error: {exc}", file=sys.stderr)
            return 2
    write(doc)
    summ = doc["summary"]
    for row in summ["steps"]:
        se = "" if row["se"] is None else f" (SE {row['se']:.4f}, agree {row['agree']})"
        echo(f"step {row['step']}: ours {row['ours']:.4f}, official {row['official']:.4f}, "
             f"diff {row['difference']:+.4f}{se}")  # fmt: skip
    print(out)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
