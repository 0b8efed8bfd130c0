"""Benchmark + real-size check of the int8 and NF4 dequant-matmuls vs bf16 cuBLAS (GPU).

For each (M, K, N): bf16 ``x @ Wᵀ`` (cuBLAS, weight in bf16), our fused int8 kernel, and the
torch dequantize-then-matmul path; and for the backward-input GEMM ``dy @ W`` the same three.
Ratios are measured side by side in one process (median of CUDA-event timings, inputs rotated
over several buffers so L2 does not hold them). Correctness: relative error vs an fp32 product.

The streamed path (:mod:`quant_kernels.streamed`) is timed at several slab sizes, and every path's
peak transient memory is recorded beside its time (the weight's bf16 size is the yardstick).

Usage:  python evals/bench_dequant_matmul.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from _common import cuda_peak_extra_mib, cuda_time_ms

from quant_kernels import reference
from quant_kernels.dequant_matmul import int8_matmul, int8_matmul_t
from quant_kernels.streamed import (
    fourbit_decoder,
    int8_decoder,
    streamed_matmul_nn,
    streamed_matmul_nt,
)

SHAPES = [  # (M tokens, K in, N out)
    (8192, 4096, 14336),  # Llama-8B gate/up
    (8192, 14336, 4096),  # Llama-8B down
    (8192, 5120, 13824),  # Llama-13B gate/up
    (8192, 13824, 5120),  # Llama-13B down
    (2048, 4096, 14336),  # one 8B sequence of 2048 tokens
    (2048, 14336, 4096),
    (512, 4096, 14336),  # where the int8 dispatch switches from fused to streamed
]
SLABS_MIB = (16, 32, 64)  # slab sizes of the streamed path compared side by side


def _rotating(make, n: int = 3):
    bufs = [make() for _ in range(n)]
    state = {"i": 0}

    def nxt():
        state["i"] = (state["i"] + 1) % n
        return bufs[state["i"]]

    return nxt


def _measure(table: dict, flops: int) -> dict:
    """Time every entry of ``table`` (name → zero-argument call) side by side; ratios vs bf16."""
    res = {}
    for name, fn in table.items():
        t = cuda_time_ms(fn)
        peak = cuda_peak_extra_mib(fn, minus_result=True)  # transients only, not the output
        res[name] = {"ms": t, "tflops": flops / t / 1e9, "peak_extra_mib": peak}
    base = res["bf16_matmul"]["ms"]
    for r in res.values():
        r["ratio_vs_bf16"] = r["ms"] / base
    return res


def bench_shape(m: int, k: int, n: int) -> dict:
    dev, bf = "cuda", torch.bfloat16
    w = torch.randn(n, k, device=dev) / k**0.5
    cb, scb = reference.quantize_int8_rowwise(w)
    w_bf = reference.dequant_int8_rowwise(cb, scb, bf)
    xs = _rotating(lambda: torch.randn(m, k, device=dev, dtype=bf))
    gs = _rotating(lambda: torch.randn(m, n, device=dev, dtype=bf))
    res: dict = {"M": m, "K": k, "N": n, "weight_bf16_mib": n * k * 2 / 2**20}
    dec = int8_decoder(cb, scb)
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
    for mib in SLABS_MIB:
        sb = mib * 2**20
        name = f"int8_streamed_{mib}MiB"
        fwd[name] = lambda sb=sb: streamed_matmul_nt(xs(), dec, n, k, slab_bytes=sb)
        bwd[name] = lambda sb=sb: streamed_matmul_nn(gs(), dec, n, k, slab_bytes=sb)
    flops = 2 * m * k * n
    res["forward"] = _measure(fwd, flops)
    res["backward_input"] = _measure(bwd, flops)
    try:
        _bench_nf4(res, w, xs, gs, flops)
    except Exception as exc:  # bitsandbytes missing/broken on the host: report, keep going
        res["nf4_error"] = f"{type(exc).__name__}: {exc}"
    x, g = xs(), gs()
    y_ref = x.float() @ w_bf.float().t()
    dx_ref = g.float() @ w_bf.float()
    for key, y in (("int8_fused", int8_matmul(x, cb, scb)),
                   ("int8_streamed", streamed_matmul_nt(x, dec, n, k))):  # fmt: skip
        err = ((y.float() - y_ref).norm() / y_ref.norm()).item()
        res["forward"][f"rel_err_vs_fp32_{key}"] = err
    for key, dx in (("int8_fused", int8_matmul_t(g, cb, scb)),
                    ("int8_streamed", streamed_matmul_nn(g, dec, n, k))):  # fmt: skip
        res["backward_input"][f"rel_err_vs_fp32_{key}"] = (
            (dx.float() - dx_ref).norm() / dx_ref.norm()
        ).item()
    return res


def _bench_nf4(res: dict, w: torch.Tensor, xs, gs, flops: int) -> None:
    """NF4 (blocksize 64, double quant): fused and streamed paths vs bf16 and bnb's 4-bit matmul."""
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
    sb = 32 * 2**20

    def streamed_nt():
        return streamed_matmul_nt(xs(), fourbit_decoder(packed, absmax(), code, 64, k), n, k,
                                  slab_bytes=sb)  # fmt: skip

    def streamed_nn():
        return streamed_matmul_nn(gs(), fourbit_decoder(packed, absmax(), code, 64, k), n, k,
                                  slab_bytes=sb)  # fmt: skip

    def select_nt():  # code values by a select tree instead of a gather load
        dec = fourbit_decoder(packed, absmax(), code, 64, k, lut="select")
        return streamed_matmul_nt(xs(), dec, n, k, slab_bytes=sb)

    def select_nn():
        dec = fourbit_decoder(packed, absmax(), code, 64, k, lut="select")
        return streamed_matmul_nn(gs(), dec, n, k, slab_bytes=sb)

    fwd = {
        "bf16_matmul": lambda: xs() @ w_deq.t(),
        "nf4_streamed_32MiB": streamed_nt,
        "nf4_streamed_select_32MiB": select_nt,
        "bnb_matmul_4bit": lambda: bnb.matmul_4bit(xs(), packed.t(), quant_state=state),
    }
    bwd = {
        "bf16_matmul": lambda: gs() @ w_deq,
        "nf4_streamed_32MiB": streamed_nn,
        "nf4_streamed_select_32MiB": select_nn,
    }
    res["nf4_forward"] = _measure(fwd, flops)
    res["nf4_backward_input"] = _measure(bwd, flops)
    x, g = xs(), gs()
    y_ref = x.float() @ w_deq.float().t()
    dx_ref = g.float() @ w_deq.float()
    dec = fourbit_decoder(packed, absmax(), code, 64, k)
    y = streamed_matmul_nt(x, dec, n, k).float()
    dx = streamed_matmul_nn(g, dec, n, k).float()
    res["nf4_forward"]["rel_err_vs_fp32_streamed"] = ((y - y_ref).norm() / y_ref.norm()).item()
    dec_sel = fourbit_decoder(packed, absmax(), code, 64, k, lut="select")
    y_sel = streamed_matmul_nt(x, dec_sel, n, k).float()
    res["nf4_forward"]["rel_err_vs_fp32_streamed_select"] = (
        (y_sel - y_ref).norm() / y_ref.norm()
    ).item()
    res["nf4_backward_input"]["rel_err_vs_fp32_streamed"] = (
        (dx - dx_ref).norm() / dx_ref.norm()
    ).item()


def _line(label: str, table: dict) -> str:
    parts = [f"{name} {r['ratio_vs_bf16']:.3f}" for name, r in table.items()
             if isinstance(r, dict) and name != "bf16_matmul"]  # fmt: skip
    return f"  {label:9s} bf16 {table['bf16_matmul']['ms']:.3f} ms | " + ", ".join(parts)


def run_all() -> list[dict]:
    out = []
    for m, k, n in SHAPES:
        r = bench_shape(m, k, n)
        out.append(r)
        print(f"M={m} K={k} N={n} (ratios vs bf16 cuBLAS)", flush=True)
        for key in ("forward", "backward_input", "nf4_forward", "nf4_backward_input"):
            if key in r:
                print(_line(key.replace("backward_input", "dX"), r[key]), flush=True)
        if "nf4_error" in r:
            print(f"  nf4: {r['nf4_error']}", flush=True)
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
