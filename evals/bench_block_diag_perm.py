"""Time the permutation-fused block-diagonal kernels against torch's gather + ``bmm``.

The POET-X(Q) layer's input side does ``x[..., Ψ] → BD(G)`` (forward), its output side
``BD(G) → [..., Ψᵀ]``, and backward forms the block gradient from a gathered operand. For each
at Llama-1B and -8B activation shapes (bf16, b = 256) this times torch (``index_select`` plus the
strided ``bmm`` of :mod:`quant_kernels.block_diag`) against :mod:`quant_kernels.block_diag_perm`,
after checking they agree. Writes JSON; the dispatch decision reads it.

    python evals/bench_block_diag_perm.py --out $OUT/bench_block_diag_perm_h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from _common import cuda_time_ms, git_commit

from quant_kernels.block_diag import block_diag_grad, block_diag_matmul_nograd
from quant_kernels.block_diag_perm import block_diag_perm_grad, block_diag_perm_matmul

# (tokens, dim): Llama-1B at 8,192 tokens per step, Llama-8B at one 2,048-token sequence
SHAPES = [(8192, 2048), (8192, 5632), (2048, 4096), (2048, 14336)]


def _case(t: int, d: int, b: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    g = (torch.randn(d // b, b, b, device="cuda", generator=gen) * b**-0.5).bfloat16()
    perm = torch.randperm(d, device="cuda", generator=gen)
    inv = torch.argsort(perm)
    nb = d // b
    pairs = {
        "input_side_forward": (
            lambda: block_diag_matmul_nograd(x.index_select(1, perm), g),
            lambda: block_diag_perm_matmul(x, g, in_perm=perm),
        ),
        "output_side_forward": (
            lambda: block_diag_matmul_nograd(x, g).index_select(1, inv),
            lambda: block_diag_perm_matmul(x, g, out_perm=perm),
        ),
        "block_grad_gathered": (
            lambda: block_diag_grad(x.index_select(1, perm), x, nb, b),
            lambda: block_diag_perm_grad(x, x, nb, b, a_perm=perm),
        ),
    }
    row: dict = {"tokens": t, "dim": d, "b": b}
    for name, (ref_fn, fused_fn) in pairs.items():
        try:
            ref, got = ref_fn().float(), fused_fn().float()
            err = ((got - ref).norm() / ref.norm()).item()
            t_ref, t_fused = cuda_time_ms(ref_fn), cuda_time_ms(fused_fn)
            row[name] = {"torch_ms": t_ref, "fused_ms": t_fused, "ratio": t_fused / t_ref,
                         "rel_err": err}  # fmt: skip
        except Exception as exc:  # a kernel that fails to compile is a result too
            row[name] = {"error": repr(exc)[:300]}
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--block-size", type=int, default=256)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_block_diag_perm: error: needs a CUDA device", file=sys.stderr)
        return 1
    report = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "commit": git_commit(),
              "command": "python evals/bench_block_diag_perm.py " + " ".join(argv or sys.argv[1:]),
              "results": []}  # fmt: skip
    for t, d in SHAPES:
        report["results"].append(_case(t, d, args.block_size))
        print(json.dumps(report["results"][-1]), flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
