"""Benchmark + real-size check of the fused int8 and NF4 dequant-matmuls vs bf16 cuBLAS (GPU).

For each (M, K, N): bf16 ``x @ Wᵀ`` (cuBLAS, weight in bf16), our fused int8 kernel, and the
torch dequantize-then-matmul path; and for the backward-input GEMM ``dy @ W`` the same three.
Ratios are measured side by side in one process (median of CUDA-event timings, inputs rotated
over several buffers so L2 does not hold them). Correctness: relative error vs an fp32 product.

Usage:  python evals/bench_dequant_matmul.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from _common import cuda_time_ms

from quant_kernels import reference
from quant_kernels.dequant_matmul import (
    blockwise_4bit_matmul,
    blockwise_4bit_matmul_t,
    int8_matmul,
    int8_matmul_t,
)

SHAPES = [  # (M tokens, K in, N out)
    (8192, 4096, 14336),  # Llama-8B gate/up
    (8192, 14336, 4096),  # Llama-8B down
    (8192, 5120, 13824),  # Llama-13B gate/up
    (8192, 13824, 5120),  # Llama-13B down
    (2048, 4096, 14336),
]


def _rotating(make, n: int = 3):
    bufs = [make() for _ in range(n)]
    state = {"i": 0}

    def nxt():
        state["i"] = (state["i"] + 1) % n
        return bufs[state["i"]]

    return nxt


def bench_shape(m: int, k: int, n: int) -> dict:
    dev, bf = "cuda", torch.bfloat16
    w = torch.randn(n, k, device=dev) / k**0.5
    cb, scb = reference.quantize_int8_rowwise(w)
    w_bf = reference.dequant_int8_rowwise(cb, scb, bf)
    xs = _rotating(lambda: torch.randn(m, k, device=dev, dtype=bf))
    gs = _rotating(lambda: torch.randn(m, n, device=dev, dtype=bf))
    res: dict = {"M": m, "K": k, "N": n}
    fwd = {
        "bf16_matmul": lambda: xs() @ w_bf.t(),
        "int8_fused": lambda: int8_matmul(xs(), cb, scb),
        "int8_torch_dequant_then_matmul": lambda: reference.int8_rowwise_matmul(xs(), cb, scb),
    }
    bwd = {
        "bf16_matmul": lambda: gs() @ w_bf,
        "int8_fused": lambda: int8_matmul_t(gs(), cb, scb),
        "int8_torch_dequant_then_matmul": lambda: reference.int8_rowwise_matmul_t(gs(), cb, scb),
    }
    for name, table in (("forward", fwd), ("backward_input", bwd)):
        times = {k_: cuda_time_ms(f) for k_, f in table.items()}
        base = times["bf16_matmul"]
        flops = 2 * m * k * n
        res[name] = {
            k_: {"ms": t, "ratio_vs_bf16": t / base, "tflops": flops / t / 1e9}
            for k_, t in times.items()
        }
    try:
        _bench_nf4(res, w, xs, gs)
    except Exception as exc:  # bitsandbytes missing/broken on the host: report, keep going
        res["nf4_error"] = f"{type(exc).__name__}: {exc}"
    x, g = xs(), gs()
    y_ref = x.float() @ w_bf.float().t()
    dx_ref = g.float() @ w_bf.float()
    res["forward"]["rel_err_vs_fp32"] = (
        (int8_matmul(x, cb, scb).float() - y_ref).norm() / y_ref.norm()
    ).item()
    res["backward_input"]["rel_err_vs_fp32"] = (
        (int8_matmul_t(g, cb, scb).float() - dx_ref).norm() / dx_ref.norm()
    ).item()
    return res


def _bench_nf4(res: dict, w: torch.Tensor, xs, gs) -> None:
    """NF4 (blocksize 64, double quant) fused kernel vs bf16 and bitsandbytes' own 4-bit matmul."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnbf

    n, k = w.shape
    w16 = w.to(torch.bfloat16)
    packed, state = bnbf.quantize_4bit(
        w16, blocksize=64, quant_type="nf4", compress_statistics=True
    )
    w_deq = bnbf.dequantize_4bit(packed, state).to(torch.bfloat16)

    def absmax() -> torch.Tensor:  # double-quantized statistics -> fp32 (n·k/64 values)
        return bnbf.dequantize_blockwise(state.absmax, state.state2).float() + state.offset

    code = state.code.float()
    fwd = {
        "bf16_matmul": lambda: xs() @ w_deq.t(),
        "nf4_fused": lambda: blockwise_4bit_matmul(xs(), packed, absmax(), code, 64, (n, k)),
        "bnb_matmul_4bit": lambda: bnb.matmul_4bit(xs(), packed.t(), quant_state=state),
    }
    bwd = {
        "bf16_matmul": lambda: gs() @ w_deq,
        "nf4_fused": lambda: blockwise_4bit_matmul_t(gs(), packed, absmax(), code, 64, (n, k)),
    }
    for name, table in (("nf4_forward", fwd), ("nf4_backward_input", bwd)):
        times = {k_: cuda_time_ms(f) for k_, f in table.items()}
        res[name] = {
            k_: {"ms": t, "ratio_vs_bf16": t / times["bf16_matmul"]} for k_, t in times.items()
        }
    x, g = xs(), gs()
    y_ref = x.float() @ w_deq.float().t()
    dx_ref = g.float() @ w_deq.float()
    y = blockwise_4bit_matmul(x, packed, absmax(), code, 64, (n, k)).float()
    dx = blockwise_4bit_matmul_t(g, packed, absmax(), code, 64, (n, k)).float()
    res["nf4_forward"]["rel_err_vs_fp32"] = ((y - y_ref).norm() / y_ref.norm()).item()
    res["nf4_backward_input"]["rel_err_vs_fp32"] = ((dx - dx_ref).norm() / dx_ref.norm()).item()


def run_all() -> list[dict]:
    out = []
    for m, k, n in SHAPES:
        r = bench_shape(m, k, n)
        out.append(r)
        f, b = r["forward"], r["backward_input"]
        print(
            f"M={m:5d} K={k:5d} N={n:5d}  fwd int8/bf16 {f['int8_fused']['ratio_vs_bf16']:.3f} "
            f"(torch deq {f['int8_torch_dequant_then_matmul']['ratio_vs_bf16']:.2f}, "
            f"bf16 {f['bf16_matmul']['ms']:.3f} ms)  dX int8/bf16 "
            f"{b['int8_fused']['ratio_vs_bf16']:.3f}  err {f['rel_err_vs_fp32']:.1e}/"
            f"{b['rel_err_vs_fp32']:.1e}",
            flush=True,
        )
        if "nf4_forward" in r and "nf4_backward_input" in r:
            nf, nb = r["nf4_forward"], r["nf4_backward_input"]
            print(
                f"{'':22s}  nf4 fwd/bf16 {nf['nf4_fused']['ratio_vs_bf16']:.3f} (bnb "
                f"{nf['bnb_matmul_4bit']['ratio_vs_bf16']:.2f})  "
                f"dX {nb['nf4_fused']['ratio_vs_bf16']:.3f}"
                f"  err {nf['rel_err_vs_fp32']:.1e}/{nb['rel_err_vs_fp32']:.1e}",
                flush=True,
            )
        else:
            print(f"{'':22s}  nf4: {r.get('nf4_error')}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 1
    res = run_all()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "results": res}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
