"""The 8-bit blockwise AdamW update: bitsandbytes' CUDA op, its Triton kernel, and ours.

bitsandbytes ships two implementations of the same update and state format (blockwise dynamic
8-bit states, 256 elements per absmax block): the CUDA op ``optimizer_update_8bit_blockwise``
(``kOptimizerStatic8bit2StateBlockwise``) and, for XPU, a Triton kernel
(``bitsandbytes.backends.triton.kernels_optim.optimizer_update_8bit_blockwise_impl``) that also
compiles for CUDA. In a Llama-13B POET-XQ step the CUDA op took 24.4 ms for ~0.83 G parameters
(``evals/results/profiles/profile_llama-13b_no_ckpt_graph_h200_e1e525d.txt``), about 14x its memory
floor. This script times both, and ``quant_kernels.adam8bit`` (the same update with a table
lookup instead of the binary search), on one flat run of ``--numel`` parameters (one launch
each, CUDA events), and checks that they agree: the same start, ``--steps`` updates with the same
gradients, then the largest parameter difference against the largest update, the share of state
codes that differ (and by how many codes), and whether ours is bit-identical to bitsandbytes'
Triton kernel.

Usage (on the GPU host):  python evals/bench_optim8bit.py --out $OUT/bench_optim8bit.json
"""

from __future__ import annotations

import argparse
import sys

import torch
from _common import cuda_time_ms, provenance, write_json_atomic

BLOCK = 256


def _ours(name, g, p, s1, s2, b1, b2, b3, alpha, eps, step, lr, q1, q2, a1, a2, wd, gs, skip):
    """:func:`quant_kernels.adam8bit.adam8bit_update` behind bitsandbytes' argument list."""
    from quant_kernels.adam8bit import adam8bit_update

    adam8bit_update(g, p, s1, s2, b1, b2, eps, step, lr, q1, q2, a1, a2, wd, gs)


def _impls() -> dict:
    from bitsandbytes.backends.triton import kernels_optim

    return {
        "bnb_cuda": torch.ops.bitsandbytes.optimizer_update_8bit_blockwise.default,
        "bnb_triton": kernels_optim.optimizer_update_8bit_blockwise_impl,
        "ours_table": _ours,
    }


def _state(n: int, dtype: torch.dtype, dev: str, seed: int) -> dict:
    gen = torch.Generator(device=dev).manual_seed(seed)
    nb = -(-n // BLOCK)
    return {
        "p": torch.randn(n, device=dev, generator=gen).to(dtype),
        "s1": torch.zeros(n, device=dev, dtype=torch.uint8),
        "s2": torch.zeros(n, device=dev, dtype=torch.uint8),
        "a1": torch.zeros(nb, device=dev),
        "a2": torch.zeros(nb, device=dev),
    }


def _step(fn, st: dict, g: torch.Tensor, step: int, qmaps) -> None:
    fn("adam", g, st["p"], st["s1"], st["s2"], 0.9, 0.999, 0.0, 0.0, 1e-8, step, 1e-3,
       qmaps[0], qmaps[1], st["a1"], st["a2"], 0.01, 1.0, False)  # fmt: skip


def compare(n: int, dtype: torch.dtype, steps: int, dev: str = "cuda") -> dict:
    """Agreement of the two implementations after ``steps`` updates from the same start."""
    import bitsandbytes.functional as F

    qmaps = (F.create_dynamic_map(signed=True).to(dev), F.create_dynamic_map(signed=False).to(dev))
    impls = _impls()
    start = _state(n, dtype, dev, 0)
    states = {k: {a: t.clone() for a, t in start.items()} for k in impls}
    gen = torch.Generator(device=dev).manual_seed(1)
    for step in range(1, steps + 1):
        g = torch.randn(n, device=dev, generator=gen).to(dtype)
        for name, fn in impls.items():
            _step(fn, states[name], g, step, qmaps)
    moved = (states["bnb_cuda"]["p"].float() - start["p"].float()).abs().max().item()
    out = {"numel": n, "dtype": str(dtype).removeprefix("torch."), "steps": steps,
           "max_update": moved}  # fmt: skip
    for x, y in (("bnb_triton", "bnb_cuda"), ("ours_table", "bnb_triton")):
        a, b = states[x], states[y]
        row = {"p_max_abs_diff": (a["p"].float() - b["p"].float()).abs().max().item(),
               "p_differs_share": (a["p"] != b["p"]).float().mean().item()}  # fmt: skip
        for s in ("s1", "s2"):
            diff = (a[s].int() - b[s].int()).abs()
            row[f"{s}_differs_share"] = (diff > 0).float().mean().item()
            row[f"{s}_max_code_diff"] = diff.max().item()
        for s in ("a1", "a2"):
            rel = (a[s] - b[s]).abs() / b[s].abs().clamp_min(1e-30)
            row[f"{s}_max_rel_diff"] = rel.max().item()
        row["bit_identical"] = all(torch.equal(a[k], b[k]) for k in a)
        out[f"{x}_vs_{y}"] = row
    return out


def timing(n: int, dtype: torch.dtype, dev: str = "cuda") -> dict:
    """Milliseconds per update of ``n`` parameters, each implementation (one launch)."""
    import bitsandbytes.functional as F

    qmaps = (F.create_dynamic_map(signed=True).to(dev), F.create_dynamic_map(signed=False).to(dev))
    st = _state(n, dtype, dev, 0)
    g = torch.randn(n, device=dev).to(dtype)
    ms = {name: cuda_time_ms(lambda fn=fn: _step(fn, st, g, 10, qmaps), warmup=3, iters=10)
          for name, fn in _impls().items()}  # fmt: skip
    # bytes moved at the floor: read p, g, both states; write p and both states
    floor_bytes = n * (3 * dtype.itemsize + 4)
    return {"numel": n, "dtype": str(dtype).removeprefix("torch."), "ms": ms,
            "triton_speedup": ms["bnb_cuda"] / ms["bnb_triton"],
            "ours_speedup_vs_cuda": ms["bnb_cuda"] / ms["ours_table"],
            "floor_ms_at_4.8TBps": floor_bytes / 4.8e12 * 1e3}  # fmt: skip


def sweep(n: int, dtype: torch.dtype, dev: str = "cuda") -> list[dict]:
    """bitsandbytes' Triton kernel launched directly with more 256-element blocks per program
    (``N_PER_TH``; its own wrapper uses 1 with 2 warps) and other warp counts: ms per update of
    ``n`` parameters (rounded down to a multiple of 16 blocks, so every program is full)."""
    import bitsandbytes.functional as F
    from bitsandbytes.backends.triton import kernels_optim as ko

    n -= n % (BLOCK * 16)
    qmaps = (F.create_dynamic_map(signed=True).to(dev), F.create_dynamic_map(signed=False).to(dev))
    st = _state(n, dtype, dev, 0)
    g = torch.randn(n, device=dev).to(dtype)
    kernel = ko._optimizer_update_2state_8bit_blockwise_triton_kernel
    rows = []
    for per in (1, 2, 4, 8, 16):
        for warps in (1, 2, 4, 8):
            if warps * 32 > per * BLOCK:
                continue

            def call(per=per, warps=warps):
                kernel[(n // (BLOCK * per),)](
                    st["p"], g, st["s1"], st["s2"], 0.9, 0.999, 0.0, 0.0, 1e-8, 10,
                    0.9**10, 0.999**10, 1e-3, qmaps[0], qmaps[1], st["a1"], st["a2"], 0.01, 1.0,
                    n, BLOCK_SIZE_N=BLOCK, N_PER_TH=per, OPTIMIZER_ID=3, num_warps=warps,
                )  # fmt: skip

            rows.append({"n_per_th": per, "num_warps": warps,
                         "ms": cuda_time_ms(call, warmup=3, iters=10)})  # fmt: skip
            print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--numel", type=int, default=827_000_000 + 100,
                    help="parameters in the timed run (default: a Llama-13B POET-XQ model's "
                    "trainable count, with a ragged last block)")  # fmt: skip
    ap.add_argument("--steps", type=int, default=5, help="updates in the agreement check")
    ap.add_argument("--sweep", action="store_true",
                    help="also time bitsandbytes' Triton kernel per blocks-per-program and "
                    "warps")  # fmt: skip
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_optim8bit: error: needs a CUDA device", file=sys.stderr)
        return 2
    doc = {
        "what": "bitsandbytes' 8-bit blockwise AdamW update, CUDA op against its Triton kernel",
        **provenance(torch.cuda.get_device_name(), argv),
        "timing": [timing(args.numel, dt) for dt in (torch.bfloat16, torch.float32)],
        "agreement": [
            compare(n, dt, args.steps)
            for n in (1 << 20, (1 << 20) + 100)
            for dt in (torch.bfloat16, torch.float32)
        ],
    }
    if args.sweep:
        doc["sweep_bf16"] = sweep(args.numel, torch.bfloat16)
    for row in doc["timing"] + doc["agreement"]:
        print(row, flush=True)
    print(f"wrote {write_json_atomic(args.out, doc)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
