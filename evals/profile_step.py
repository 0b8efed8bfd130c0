"""Profile training steps of one method on random tokens (torch.profiler), to find overheads.

Prints the top operators by self CPU time and by self device time, and the mean step time, for a
Llama of the given shape (default: 60M, recipes/models/llama-60m.yaml) built exactly as the
trainer builds it.

    python evals/profile_step.py --method poetxq --batch-size 128 --seq-len 256 --out prof.txt
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from evals.compare_methods import MODELS  # noqa: E402
from poetxq.bench import build_model_and_optimizer  # noqa: E402
from poetxq.evaluate import causal_lm_loss  # noqa: E402
from poetxq.recipe import load_recipe  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", default="poetxq")
    ap.add_argument("--model", choices=sorted(MODELS), default="60m")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--vocab-size", type=int, default=32000)
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=None, help="write the tables to this text file")
    args = ap.parse_args(argv)

    overrides = {f"model.{k}": v for k, v in MODELS[args.model].items()}
    overrides.update({"method": args.method, "poet.block_size": args.block_size})
    recipe = load_recipe(REPO / "recipes" / "tiny" / f"{args.method}.yaml", overrides)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, opt = build_model_and_optimizer(recipe, args.vocab_size, dev)
    batch = torch.randint(0, args.vocab_size, (args.batch_size, args.seq_len + 1), device=dev)
    amp = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda")

    def step() -> None:
        with amp:
            loss = causal_lm_loss(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    step_ms = (time.perf_counter() - t0) / args.steps * 1e3
    acts = [torch.profiler.ProfilerActivity.CPU]
    if dev.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(2):
            step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
    ka = prof.key_averages()
    text = [
        f"method {args.method}, model {args.model}, batch {args.batch_size}x{args.seq_len}, "
        f"{dev}: {step_ms:.1f} ms/step, "
        f"{args.batch_size * args.seq_len / step_ms * 1e3:,.0f} tok/s",
        ka.table(sort_by="self_cpu_time_total", row_limit=25),
    ]
    if dev.type == "cuda":
        text.append(ka.table(sort_by="self_cuda_time_total", row_limit=25))
    out = "\n".join(text)
    if args.out:
        Path(args.out).write_text(out + "\n")
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
