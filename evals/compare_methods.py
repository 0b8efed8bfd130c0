"""Side-by-side pretraining comparison of POET-XQ and the baselines on one model and corpus.

Every method trains the same Llama (default: 60M, the shape of recipes/models/llama-60m.yaml) on
the same token stream (one tokenization, one seeded document-level train / validation split) for
the same number of tokens, and is scored on the same held-out validation windows. Per method the
script records final validation perplexity, tokens/s (training time incl. periodic evaluation),
peak GPU memory (``torch.cuda.max_memory_allocated``) and the validation curve, and rewrites
``--out`` after each method so a run cut short keeps what finished.

Hyperparameters per method follow the authors' 60M scripts (named beside each value below); the
other settings come from ``recipes/tiny/<method>.yaml``. ``control`` is POET-XQ with the
orthogonal factors frozen at identity (only embeddings, norms and lm_head train).

Examples::

    python evals/prepare_offline_corpus.py --out data/offline-corpus
    python evals/compare_methods.py --data data/offline-corpus --tokens 50e6 \\
        --methods poetxq poetx qgalore qapollo adamw control --out results.json
    python evals/compare_methods.py --probe 20 --out probe.json   # tokens/s only
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from evals._common import git_commit, write_json_atomic  # noqa: E402
from poetxq.data import prepare_data  # noqa: E402
from poetxq.recipe import load_recipe  # noqa: E402
from poetxq.train import DivergedError, train  # noqa: E402

#: Llama shapes (as recipes/models/*.yaml)
MODELS: dict[str, dict[str, int]] = {
    "60m": dict(
        hidden_size=512, intermediate_size=1280, num_attention_heads=8, num_hidden_layers=8
    ),
    "130m": dict(
        hidden_size=768, intermediate_size=2048, num_attention_heads=12, num_hidden_layers=12
    ),
    "1b": dict(
        hidden_size=2048, intermediate_size=5632, num_attention_heads=32, num_hidden_layers=24
    ),
}

_POET = {  # Sphere-AI-Lab/poet scripts/benchmark_c4_poet/pretrain_poet_60m.sh
    "optim.lr": 0.01,
    "optim.poet_lr": 0.002,
    "optim.min_lr_ratio": 0.01,
    "optim.grad_clip": 0.1,
    "optim.warmup_steps": 0,
    "poet.merge_interval": 200,  # --poet_reset_gap 200
    "poet.block_size": 256,  # --poet_block_size 256
}

#: per-method recipe file and overrides (sources in the comments)
METHODS: dict[str, tuple[str, dict[str, Any]]] = {
    "poetxq": ("poetxq", {**_POET, "poet.bits": 8}),
    "poetx": ("poetx", dict(_POET)),
    "control": ("poetxq", {**_POET, "poet.bits": 8, "poet.freeze_orthogonal": True}),
    # GaLore scripts/benchmark_c4/llama_60m.sh (AdamW lr 1e-3, warmup 10 %)
    "adamw": ("adamw", {"optim.lr": 1e-3}),
    # Q-GaLore scripts/pretrain_c4/llama_60m.sh: lr 0.015, rank 128, gap 200, scale 0.25
    "qgalore": ("qgalore", {"optim.lr": 0.015, "baseline.rank": 128}),
    # APOLLO scripts/pretrain_c4/llama_60m_apollo.sh: lr 0.01, rank 128 (= hidden / 4), scale 1
    "qapollo": ("qapollo", {"optim.lr": 0.01, "baseline.rank": 128}),
    "galore": ("galore", {"optim.lr": 0.01, "baseline.rank": 128}),
    "apollo": ("apollo", {"optim.lr": 0.01, "baseline.rank": 128}),
}

WARMUP_FRACTION = 0.1  # the GaLore/APOLLO scripts warm up for 1000 of 10000 steps


def build_recipe(method: str, args: argparse.Namespace, steps: int):
    """The recipe of ``method`` at the shared model / data / batch settings."""
    file, extra = METHODS[method]
    overrides: dict[str, Any] = {f"model.{k}": v for k, v in MODELS[args.model].items()}
    overrides.update({
        "name": f"compare-{args.model}-{method}",
        "model.max_position_embeddings": args.seq_len,
        "train.max_steps": steps,
        "train.batch_size": args.batch_size,
        "train.seq_len": args.seq_len,
        "train.eval_every": max(1, steps // args.evals),
        "train.log_every": max(1, min(50, steps // 20)),
        "train.save_checkpoint": False,
        "train.seed": args.seed,
        "optim.warmup_steps": int(WARMUP_FRACTION * steps),
        "data.source": args.data,
        "data.vocab_size": args.vocab_size,
        "data.max_val_tokens": args.max_val_tokens,
    })  # fmt: skip
    overrides.update(extra)
    overrides.update(getattr(args, "extra", {}))
    return load_recipe(REPO / "recipes" / "tiny" / f"{file}.yaml", overrides)


def _parse_sets(items: list[str]) -> dict[str, Any]:
    """``["optim.poet_lr=4e-3", ...]`` → ``{"optim.poet_lr": 0.004}`` (values parsed as YAML).

    Raises:
        ValueError: an item without ``=`` or with an empty key.
    """
    import yaml

    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set {item!r}: expected KEY=VALUE, e.g. optim.poet_lr=4e-3")
        out[key.strip()] = yaml.safe_load(value)  # "4e-3" stays a string; the schema coerces it
    return out


def _val_curve(run_dir: Path) -> list[dict[str, float]]:
    curve = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "val_ppl" in rec:
            curve.append({"step": rec["step"], "val_ppl": rec["val_ppl"]})
    return curve


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default="data/offline-corpus", help="corpus (a poetxq data source)")
    ap.add_argument("--model", choices=sorted(MODELS), default="60m")
    ap.add_argument("--methods", nargs="+", choices=sorted(METHODS), default=list(METHODS))
    ap.add_argument("--tokens", type=float, default=50e6, help="training tokens per method")
    ap.add_argument("--batch-size", type=int, default=128, help="sequences per step")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--vocab-size", type=int, default=32000, help="byte-level BPE vocabulary")
    ap.add_argument("--max-val-tokens", type=int, default=1 << 20)
    ap.add_argument("--evals", type=int, default=5, help="validation points during training")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--probe", type=int, default=0, help="only time N steps per method")
    ap.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="recipe override applied to every method after its own (e.g. optim.poet_lr=4e-3; "
        "VALUE is read as YAML); for hyperparameter sweeps",
    )  # fmt: skip
    ap.add_argument("--out", required=True, help="results JSON (rewritten after each method)")
    args = ap.parse_args(argv)
    try:
        args.extra = _parse_sets(args.set)
    except ValueError as exc:
        ap.error(str(exc))

    tokens_per_step = args.batch_size * args.seq_len
    steps = args.probe or math.ceil(args.tokens / tokens_per_step)
    probe_recipe = build_recipe(args.methods[0], args, steps)
    t0 = time.perf_counter()
    data = prepare_data(probe_recipe.data, args.seq_len, progress=False)
    prep_s = time.perf_counter() - t0
    result: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "command": "python " + " ".join(sys.argv),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.machine(),
        "torch": torch.__version__,
        "model": args.model,
        "model_shape": MODELS[args.model],
        "data": data.source_description,
        "vocab_size": data.vocab_size,
        "train_tokens_available": data.train_tokens,
        "val_tokens": data.val_tokens,
        "data_prep_s": prep_s,
        "steps": steps,
        "tokens_per_step": tokens_per_step,
        "train_tokens": steps * tokens_per_step,
        "epochs": steps * tokens_per_step / max(data.train_tokens, 1),
        "probe": bool(args.probe),
        "runs": {},
    }
    print(
        f"data: {data.source_description}; {data.train_tokens:,} train / {data.val_tokens:,} val "
        f"tokens, vocab {data.vocab_size}; {steps} steps x {tokens_per_step} tokens "
        f"({result['epochs']:.2f} epochs) per method",
        flush=True,
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for method in args.methods:
        recipe = build_recipe(method, args, steps)
        if args.probe:
            recipe.train.eval_every = steps + 1
            recipe.train.eval_max_batches = 1
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        with tempfile.TemporaryDirectory() as tmp:
            run_dir = Path(tmp) / method
            try:
                res = train(recipe, run_dir, progress=False, data=data, echo=lambda s: None)
            except DivergedError as exc:  # record it and go on with the other methods
                overrides = {**METHODS[method][1], **args.extra}
                curve = _val_curve(run_dir)
                result["runs"][method] = {
                    "recipe_overrides": overrides,
                    "error": str(exc),
                    "val_curve": curve,
                }
                print(f"{method:8s} {exc}", flush=True)
                write_json_atomic(out, result)
                continue
            curve = _val_curve(run_dir)
        peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
        result["runs"][method] = {
            "recipe_overrides": {**METHODS[method][1], **args.extra},
            "lr": recipe.optim.lr,
            "final_val_ppl": res.final_val_ppl,
            "final_train_loss": res.final_train_loss,
            "tokens_per_s": res.tokens_per_s,
            "train_seconds": res.train_seconds,
            "peak_memory_gib": peak,
            "merges": res.merges,
            "val_curve": curve,
        }
        print(
            f"{method:8s} val ppl {res.final_val_ppl:9.2f}  {res.tokens_per_s:>11,.0f} tok/s  "
            f"peak {peak if peak is None else round(peak, 2)} GiB  {res.train_seconds:.0f} s",
            flush=True,
        )
        write_json_atomic(out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
