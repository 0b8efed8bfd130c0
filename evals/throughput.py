"""Training throughput of the methods side by side: ``poetxq bench`` over models x seq x methods.

For each model (default Llama-1B and 3B), sequence length (default 256 and 1024) and method
(default poetxq int8, poetx, qgalore, qapollo, adamw) this runs :func:`poetxq.tools.bench.run_bench`
on random tokens with the recipe ``MODEL:METHOD`` at ``--tokens`` tokens per step (one
micro-batch of ``tokens / seq`` sequences, no accumulation): fp32 parameters under bf16
autocast, as ``poetxq train`` runs on a GPU (``--set train.precision=bf16-true``: bf16
parameters, for the methods that take it). It records tokens/s, MFU, peak memory and the
estimator's prediction per run, and the ratios the issue targets (poetxq >= 1.3x qgalore and
>= 0.9x adamw) per (model, seq), measured in the same process.

Usage (on the GPU host, a few minutes):
    python evals/throughput.py --out $OUT/throughput_h200.json
CPU smoke test of the script itself:
    python evals/throughput.py --device cpu --models llama-60m --seqs 32 --tokens 64 --steps 1 \
        --set model.num_hidden_layers=1 --out /tmp/throughput_smoke.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch
from _common import kernel_policy, provenance, write_json_atomic

from poetxq.tools.bench import BenchError, run_bench
from poetxq.tools.cli_tools import check_output_file
from poetxq.training.recipe import POET_METHODS, RecipeError, method_label, poet_variant
from poetxq.training.recipe_files import load_recipe, parse_override

VOCAB = 32000


def target_ratios(tps: dict[str, float]) -> dict[str, float | bool]:
    """The issue's ratios from tokens/s by run key (``poetxq``, ``poetxq_graph``,
    ``poetxq_fast``, ``qgalore``, ``adamw``, ``adamw_graph``...): ``<key>_over_qgalore``
    (target >= 1.3), ``<key>_over_adamw`` (>= 0.9) and, when AdamW also ran in a CUDA graph,
    ``<key>_over_adamw_graph`` for every POET-XQ run key (eager, in a CUDA graph, another
    variant), with ``meets_*`` flags for the plain eager ``poetxq`` run."""
    row: dict[str, float | bool] = {}
    for key in sorted(k for k in tps if k.startswith("poetxq")):
        for base, target in (("qgalore", 1.3), ("adamw", 0.9), ("adamw_graph", 0.9)):
            if base in tps:
                row[f"{key}_over_{base}"] = tps[key] / tps[base]
                if key == "poetxq":
                    row[f"meets_{base}_target"] = row[f"{key}_over_{base}"] >= target
    return row


def split_method(spec: str) -> tuple[str, str | None, str]:
    """``METHOD[+VARIANT]`` -> (recipe method file, POET variant or None, run key): ``poetxq+fast``
    is ``poetxq`` with ``poet.variant=fast``, keyed ``poetxq_fast``.

    Raises:
        ValueError: a variant other than ``fast``/``mem``.
    """
    method, plus, variant = spec.partition("+")
    if not plus:
        return method, None, method
    if variant not in ("fast", "mem"):
        raise ValueError(f"method {spec!r}: the variant after '+' is fast or mem")
    return method, variant, f"{method}_{variant}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--models", default="llama-1b,llama-3b")
    ap.add_argument("--seqs", default="256,1024")
    ap.add_argument("--methods", default="poetxq,poetx,qgalore,qapollo,adamw",
                    help="recipe method files; METHOD+fast or METHOD+mem runs a POET method with "
                    "that layer variant (run key METHOD_fast), e.g. poetxq+fast")  # fmt: skip
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per step (one micro-batch)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default=None)
    ap.add_argument("--graph-methods", default="", metavar="M1,M2",
                    help="also run these methods (POET ones or adamw) with "
                    "train.cuda_graph=true (forward and backward replayed from a CUDA graph; "
                    "CUDA only), recorded with cuda_graph true; POET-XQ's get their own ratios "
                    "(poetxq_graph_over_*), and against AdamW's graph run (*_over_adamw_graph). "
                    "The --methods runs are pinned to train.cuda_graph=false")  # fmt: skip
    ap.add_argument("--profile-dir", default=None, metavar="DIR",
                    help="profile two more steps per run into "
                    "DIR/profile_<model>_<seq>_<method>.txt (GPU time per kind of work; also in "
                    "the JSON as gpu_time_ms)")  # fmt: skip
    ap.add_argument("--kernel-flag", action="append", default=[], metavar="NAME=0|1",
                    help="set a quant_kernels.KernelPolicy field for every run (A/B timing of "
                    "one path), e.g. fused_input_cast=0")  # fmt: skip
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="recipe override for every run (smoke tests)")  # fmt: skip
    args = ap.parse_args(argv)
    try:
        kernels = kernel_policy(args.kernel_flag)
    except ValueError as exc:
        ap.error(str(exc))
    try:
        dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError as exc:
        ap.error(f"--device {args.device!r}: {str(exc).splitlines()[0]}")

    graph_methods = [m for m in args.graph_methods.split(",") if m]
    runs_of = [(m, False) for m in args.methods.split(",")] + [(m, True) for m in graph_methods]

    def recipe_for(model: str, spec: str, seq: int, graph: bool = False):
        method, variant, _ = split_method(spec)
        over = {"train.seq_len": seq, "train.batch_size": max(1, args.tokens // seq),
                "train.grad_accum": 1}  # fmt: skip
        for text in args.set:
            k, v = parse_override(text)
            over[k] = v
        if variant:
            over["poet.variant"] = variant
        over["train.cuda_graph"] = graph  # eager runs stay eager (the default is auto)
        recipe = load_recipe(f"{model}:{method}", over)
        if variant and recipe.method not in POET_METHODS:
            raise ValueError(f"method {spec!r}: only the POET methods have a variant; drop "
                             f"'+{variant}'")  # fmt: skip
        return recipe

    seqs = []
    try:  # every recipe once before any run: a bad model, method or --set stops here
        seqs = [int(s) for s in args.seqs.split(",")]
        for model in args.models.split(","):
            for seq in seqs:
                for method, graph in runs_of:
                    recipe_for(model, method, seq, graph)
    except (RecipeError, ValueError) as exc:
        ap.error(str(exc).splitlines()[0])
    if graph_methods and dev.type != "cuda":
        ap.error(f"--graph-methods needs a CUDA device (CUDA graphs), got {dev.type}; drop it")
    try:  # the JSON is written after the first (model, seq): find a bad path before any run
        check_output_file(Path(args.out), "--out", ValueError)
    except ValueError as exc:
        ap.error(str(exc))
    if args.profile_dir:
        try:  # a profile is written after each run: find a bad folder before the first
            check_output_file(Path(args.profile_dir) / "profile.txt", "--profile-dir", ValueError)
        except ValueError as exc:
            ap.error(str(exc))
    for seq in seqs:
        if args.tokens < seq:
            print(f"note: --tokens {args.tokens} < seq {seq}: one sequence ({seq} tokens) per step")
    runs, ratios = [], []

    def save():  # after every (model, seq): a run cut short keeps what finished
        precision = dict(parse_override(t) for t in args.set).get("train.precision", "auto")
        doc = {
            "what": "training tokens/s, MFU and peak memory per method on random tokens "
            "(poetxq bench), train.precision as given (auto: fp32 params + bf16 autocast on a "
            "GPU; bf16-true: bf16 params, no autocast); ratios measured side by side",
            "train_precision": precision,
            **provenance(torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", argv),
            "tokens_per_step": args.tokens,
            "kernel_policy": kernels.to_dict(),
            "ratios": ratios,
            "runs": runs,
        }
        return write_json_atomic(args.out, doc)

    for model in args.models.split(","):
        for seq in seqs:
            tps: dict[str, float] = {}
            for method, graph in runs_of:
                recipe = recipe_for(model, method, seq, graph)
                key = split_method(method)[2]
                variant = poet_variant(recipe)
                key += "_graph" if graph else ""
                try:
                    prof = (Path(args.profile_dir) / f"profile_{model}_{seq}_{key}.txt"
                            if args.profile_dir else None)  # fmt: skip
                    res = run_bench(recipe, args.steps, warmup=args.warmup, vocab_size=VOCAB,
                                    device=args.device, profile=prof, kernels=kernels,
                                    echo=lambda _s: None)  # fmt: skip
                except BenchError as exc:  # e.g. a device this torch cannot use
                    print(f"throughput: error: {exc}", file=sys.stderr)
                    return 2
                except torch.OutOfMemoryError as exc:
                    runs.append({"model": model, "seq_len": seq, "method": method_label(recipe),
                                 "variant": variant, "cuda_graph": graph,
                                 "error": str(exc).splitlines()[0]})  # fmt: skip
                    print(f"{model} seq {seq} {key}: out of memory", flush=True)
                    continue
                finally:
                    gc.collect()
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()
                print(res.summary_line(), flush=True)
                tps[key] = res.tokens_per_s
                runs.append({"model": model, "seq_len": seq, **asdict(res)})
            ratios.append({"model": model, "seq_len": seq, **target_ratios(tps)})
            print(json.dumps(ratios[-1]), flush=True)
            save()
    print(f"wrote {save()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
