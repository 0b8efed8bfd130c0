"""Time the last-dim permutation (POET-X's Ψ gathers) at Llama activation shapes, bf16.

torch ``index_select`` (what the layer uses) against the Triton variants of
:mod:`quant_kernels.permute`, each checked equal to torch first; effective bandwidth counts one
read and one write of the tensor. Writes JSON.

    python evals/bench_permute.py --out $OUT/bench_permute_h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from _common import cuda_time_ms, git_commit

from quant_kernels.permute import VARIANTS, permute_last_nograd

SHAPES = [(2048, 4096), (2048, 14336), (8192, 2048), (8192, 5632), (8192, 14336), (8192, 13824)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_permute: error: needs a CUDA device", file=sys.stderr)
        return 1
    rows = []
    for t, d in SHAPES:
        x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
        perm = torch.randperm(d, device="cuda")
        ref = x.index_select(1, perm)
        row = {"shape": [t, d], "bytes_moved": 2 * x.numel() * x.element_size()}
        fns = {"torch_index_select": lambda x=x, perm=perm: x.index_select(1, perm)}
        for v in VARIANTS:
            fns[f"triton_{v}"] = lambda v=v, x=x, perm=perm: permute_last_nograd(x, perm, v)
        for name, fn in fns.items():
            try:
                if not torch.equal(fn(), ref):
                    row[name] = {"error": "differs from index_select"}
                    continue
                ms = cuda_time_ms(fn)
                row[name] = {"us": ms * 1e3, "tb_per_s": row["bytes_moved"] / (ms * 1e-3) / 1e12}
            except Exception as exc:  # a variant that does not compile is a result too
                row[name] = {"error": repr(exc)[:300]}
        base = row["torch_index_select"]["us"]
        for name in fns:
            if "us" in row[name]:
                row[name]["ratio_vs_torch"] = row[name]["us"] / base
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(),
           "torch": torch.__version__, "commit": git_commit(),
           "command": "python evals/bench_permute.py " + " ".join(argv or sys.argv[1:]),
           "results": rows}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
