"""Re-quantization drift at merges: how far does W0 wander when nothing is learned?

A POET-XQ merge dequantizes the stored weight, folds R and P in, draws new permutations and
re-quantizes. With R = P = I (Q = 0) the only change is the re-permute + re-quantize, so any
distance from the original weight is pure re-quantization error piling up. For each format
(int8 row-wise, NF4, FP4 with double quant) and rounding policy (nearest, stochastic) this script
builds a ``POETXLinear`` around a normalized-Gaussian ``W0`` and runs ``merge_then_reinitialize``
K times, recording ``‖W_K − W0‖_F / ‖W0‖_F`` of the effective (dequantized, original-coordinate)
weight after 0 (initial quantization), 1, 10 and 50 merges.

    python evals/requant_drift.py --out evals/results/requant_drift_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
from _common import git_commit

from poetxq.model.layer import POETXLinear, normalized_gaussian

FORMATS = {"int8": (8, "nf4"), "nf4": (4, "nf4"), "fp4": (4, "fp4")}
POLICIES = ("nearest", "stochastic")


def drift(
    fmt: str, policy: str, *, size: int, block_size: int, merges: int, checkpoints: list[int],
    seed: int,
) -> dict[str, float]:  # fmt: skip
    """Relative Frobenius distance from ``W0`` after each merge count in ``checkpoints``."""
    bits, quant_type = FORMATS[fmt]
    gen = torch.Generator().manual_seed(seed)
    w0 = normalized_gaussian(size, size, generator=gen)
    layer = POETXLinear(
        size, size, block_size=block_size, bits=bits, quant_type=quant_type, weight=w0,
        stochastic_requant=policy == "stochastic", generator=gen,
    )  # fmt: skip
    ref = w0.double()

    def rel() -> float:
        w = layer.effective_weight(torch.float64)
        return ((w - ref).norm() / ref.norm()).item()

    out = {"0": rel()}
    for k in range(1, merges + 1):
        layer.merge_then_reinitialize(gen)
        if k in checkpoints:
            out[str(k)] = rel()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--size", type=int, default=1024, help="m = n of the weight")
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--merges", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    checkpoints = sorted({1, 10, args.merges})
    results: dict[str, dict[str, dict[str, float]]] = {}
    start = time.perf_counter()
    for fmt in FORMATS:
        results[fmt] = {}
        for policy in POLICIES:
            r = drift(fmt, policy, size=args.size, block_size=args.block_size,
                      merges=args.merges, checkpoints=checkpoints, seed=args.seed)  # fmt: skip
            results[fmt][policy] = r
            cells = "  ".join(f"K={k}: {v:.4%}" for k, v in r.items())
            print(f"{fmt:5s} {policy:10s} {cells}", flush=True)
    doc = {
        "what": "relative Frobenius distance ||W_K - W0|| / ||W0|| of the dequantized effective "
        "weight after K identity merges (R = P = I: re-permute + re-quantize only); K = 0 is the "
        "initial quantization error",
        "weight": f"{args.size}x{args.size} normalized Gaussian (unit-norm rows), fp32",
        "formats": {
            "int8": "row-wise absmax (bitsandbytes Int8Params layout)",
            "nf4": "NF4 blockwise 64, double quant (bitsandbytes Params4bit layout)",
            "fp4": "FP4 blockwise 64, double quant (bitsandbytes Params4bit layout)",
        },
        "block_size": args.block_size,
        "seed": args.seed,
        "results": results,
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} CPU, {torch.get_num_threads()} torch threads, "
        f"torch {torch.__version__}",
        "commit": git_commit(),
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "seconds": round(time.perf_counter() - start, 1),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
