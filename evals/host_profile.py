"""Where an eager training step spends its host (Python) time: ``poetxq bench`` under cProfile.

An eager POET step on a GPU is bound by the host when its Python issues kernels more slowly
than the GPU runs them (e.g. Llama-1B at 8,192 tokens: 0.30 s eager against 0.21 s replayed
from a CUDA graph). This runs :func:`poetxq.tools.bench.run_bench` for ``RECIPE`` (the trainer's
step: checkpointing, chunked loss, optimizer in backward as the recipe says) under cProfile and
writes the functions with the most own (``tottime``) and cumulative (``cumtime``) host time, with
the bench's one-line summary on top. Profiling starts when the bench reports its first step done
(after the model build, the compiles and the first step) and covers the remaining steps.

Usage (on the GPU host):
    python evals/host_profile.py llama-1b:poetxq --out $OUT/host_1b.txt
    python evals/host_profile.py llama-8b:poetxq --set train.gradient_checkpointing=true \\
        --set data.batch_size=1 --set data.seq_len=2048 --out $OUT/host_8b_ckpt.txt
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys

from poetxq.tools.bench import BenchError, run_bench
from poetxq.training.recipe import RecipeError
from poetxq.training.recipe_files import load_recipe, parse_override


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("recipe", help="recipe spec, e.g. llama-1b:poetxq or a YAML path")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="recipe override (repeatable)")  # fmt: skip
    ap.add_argument("--steps", type=int, default=10,
                    help="timed steps (>= 2; all but the first are profiled)")  # fmt: skip
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rows", type=int, default=50, help="functions listed per table")
    ap.add_argument("--out", required=True, help="text file to write")
    args = ap.parse_args(argv)
    if args.steps < 2:
        ap.error("--steps must be >= 2: the first timed step is not profiled")
    try:
        over = dict(parse_override(t) for t in args.set)
        over.setdefault("train.cuda_graph", False)
        recipe = load_recipe(args.recipe, over)
    except RecipeError as exc:
        print(f"host_profile: {exc}", file=sys.stderr)
        return 2
    prof = cProfile.Profile()

    def echo(line: str) -> None:
        print(line, flush=True)
        if line.startswith("bench: step 1/"):  # built, compiled, one step done: profile the rest
            prof.enable()

    try:
        result = run_bench(recipe, args.steps, warmup=args.warmup, echo=echo)
    except BenchError as exc:
        print(f"host_profile: {exc}", file=sys.stderr)
        return 2
    finally:
        prof.disable()
    parts = [result.summary_line()]
    for key in ("tottime", "cumtime"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(args.rows)
        parts.append(f"--- cProfile by {key}\n{buf.getvalue()}")
    text = "\n".join(parts)
    with open(args.out, "w") as f:
        f.write(text + "\n")
    print(text[:4000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
