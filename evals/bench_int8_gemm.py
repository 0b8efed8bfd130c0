"""Benchmark + real-size check of the int8 × int8 weight GEMMs against bf16 cuBLAS (GPU).

For each (M tokens, K in, N out) at 8,192 tokens × the Llama-8B / 13B MLP shapes, side by side in
one process (median CUDA-event time, inputs rotated over three buffers so L2 does not hold them):

* forward ``x @ Wᵀ``: cuBLAS bf16 with a bf16 weight (``bf16_cublas``, the yardstick of every
  ratio); today's int8 path, dequantizing ``W0`` inside the GEMM (``int8_dequant``:
  ``Int8Rowwise.matmul`` under the default policy); the int8 × int8 path
  (``int8_mma``: :func:`quant_kernels.int8_mma.int8_mma_matmul`, the activation's quantization
  included) and its feature-major form as the ``mem`` layer calls it (``int8_mma_fm``);
  its parts alone: the quantizer (``quantize_only``) and cuBLAS' own int8 GEMM on already
  quantized codes (``torch_int_mm_codes_only``: a floor for the MMA, no epilogue);
* dX ``g @ W``: the same, with ``int8_mma_stochastic`` (stochastic rounding of ``g``).

Correctness at the real size, on the first ``--check-rows`` token rows: the kernels against the
plain-torch oracle (:mod:`quant_kernels.reference_int8_mma`, exact int32 products by
``torch._int_mm``) and every path against a float64 product of the stored weight, with the
derived bound :func:`~quant_kernels.reference_int8_mma.int8_mma_error_bound` (the fraction of
elements inside it must be 1).

Usage (on the GPU host):
    python evals/bench_int8_gemm.py --out evals/results/bench_int8_gemm_<gpu>_<commit>.json
    [--tokens 8192] [--shapes 8b,13b] [--check-rows 256]
"""

from __future__ import annotations

import argparse
import sys

import torch
from _common import cuda_peak_extra_mib, cuda_time_ms, provenance, write_json_atomic

from quant_kernels import int8_mma, reference
from quant_kernels import reference_int8_mma as oracle
from quant_kernels.formats import Int8Rowwise
from quant_kernels.policy import AUTO

#: (K in, N out) of the MLP projections: gate/up, then down
SHAPES = {"8b": [(4096, 14336), (14336, 4096)], "13b": [(5120, 13824), (13824, 5120)]}


def _rotating(make, n: int = 3):
    bufs = [make() for _ in range(n)]
    state = {"i": 0}

    def nxt():
        state["i"] = (state["i"] + 1) % n
        return bufs[state["i"]]

    return nxt


def _measure(table: dict, flops: int) -> dict:
    """Time each entry (name → zero-argument call); ratios to ``bf16_cublas`` and its speedup."""
    res = {}
    for name, fn in table.items():
        try:
            ms = cuda_time_ms(fn)
            peak = cuda_peak_extra_mib(fn, minus_result=True)
        except Exception as exc:  # one failing path must not lose the others' numbers
            res[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            continue
        res[name] = {"ms": ms, "tflops": flops / ms / 1e9, "peak_extra_mib": peak}
    base = res["bf16_cublas"]["ms"]
    for r in res.values():
        if "ms" in r:
            r["time_ratio_vs_bf16"] = r["ms"] / base
            r["speedup_vs_bf16"] = base / r["ms"]
    return res


def _errors(got: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor | None) -> dict:
    err = (got.double() - exact).abs()
    row = {"rel_err_vs_fp64": (err.norm() / exact.norm()).item()}
    if bound is not None:
        row["within_bound_fraction"] = (err <= bound).double().mean().item()
        row["max_err_over_bound"] = (err / bound).max().item()
    return row


def check_shape(cb, scb, x: torch.Tensor, g: torch.Tensor, rows: int) -> dict:
    """The real-size correctness rows of one shape (the first ``rows`` tokens)."""
    x, g = x[:rows], g[:rows]
    fmt = Int8Rowwise(cb, scb)
    w = cb.double() * (scb.double() / 127)[:, None]
    exact_y, exact_dx = x.double() @ w.t(), g.double() @ w
    out: dict = {"rows": rows}
    y = int8_mma.int8_mma_matmul(x, cb, scb)
    y_ref = oracle.int8_mma_matmul(x, cb, scb)
    dx = int8_mma.int8_mma_matmul_t(g, cb, scb)
    dx_ref = oracle.int8_mma_matmul_t(g, cb, scb)
    bound_y = oracle.int8_mma_error_bound(x, cb, scb, out_dtype=x.dtype)
    bound_dx = oracle.int8_mma_error_bound(g, cb, scb, weight_t=True, out_dtype=g.dtype)
    out["forward"] = {
        "int8_mma": _errors(y, exact_y, bound_y),
        "int8_mma_max_abs_diff_vs_oracle": (y.float() - y_ref.float()).abs().max().item(),
        "int8_mma_equal_to_oracle": bool(torch.equal(y, y_ref)),
        "int8_dequant": _errors(fmt.matmul(x, kernels=AUTO), exact_y, None),
    }
    out["dx"] = {
        "int8_mma": _errors(dx, exact_dx, bound_dx),
        "int8_mma_max_abs_diff_vs_oracle": (dx.float() - dx_ref.float()).abs().max().item(),
        "int8_mma_equal_to_oracle": bool(torch.equal(dx, dx_ref)),
        "int8_dequant": _errors(fmt.matmul_t(g, kernels=AUTO), exact_dx, None),
    }
    q, s = int8_mma.quantize_rows(x)
    q0, s0 = oracle.quantize_rows(x)
    out["quantizer_codes_equal"] = bool(torch.equal(q, q0) and torch.equal(s, s0))
    return out


def bench_shape(m: int, k: int, n: int, check_rows: int) -> dict:
    dev, bf = "cuda", torch.bfloat16
    w = torch.randn(n, k, device=dev) / k**0.5
    cb, scb = reference.quantize_int8_rowwise(w)
    del w
    w_bf = reference.dequant_int8_rowwise(cb, scb, bf)
    fmt = Int8Rowwise(cb, scb)
    ws = reference.int8_row_scale(scb)
    xs = _rotating(lambda: torch.randn(m, k, device=dev, dtype=bf))
    gs = _rotating(lambda: torch.randn(m, n, device=dev, dtype=bf))
    zts = _rotating(lambda: torch.randn(k, m, device=dev, dtype=bf))  # feature-major [K, T]
    dhts = _rotating(lambda: torch.randn(n, m, device=dev, dtype=bf))
    qx, _ = int8_mma.quantize_rows(xs())
    qg, _ = int8_mma.quantize_rows(gs(), col_scale=ws)
    fwd = {
        "bf16_cublas": lambda: xs() @ w_bf.t(),
        "int8_dequant": lambda: fmt.matmul(xs(), kernels=AUTO),
        "int8_mma": lambda: int8_mma.int8_mma_matmul(xs(), cb, scb),
        "int8_dequant_fm": lambda: fmt.matmul_fm(zts(), kernels=AUTO),
        "int8_mma_fm": lambda: int8_mma.int8_mma_matmul(zts().t(), cb, scb, feature_major_out=True),
        "quantize_only": lambda: int8_mma.quantize_rows(xs()),
        "torch_int_mm_codes_only": lambda: torch._int_mm(qx, cb.t()),
    }
    bwd = {
        "bf16_cublas": lambda: gs() @ w_bf,
        "int8_dequant": lambda: fmt.matmul_t(gs(), kernels=AUTO),
        "int8_mma": lambda: int8_mma.int8_mma_matmul_t(gs(), cb, scb),
        "int8_mma_stochastic": lambda: int8_mma.int8_mma_matmul_t(gs(), cb, scb, stochastic=True),
        "int8_dequant_fm": lambda: fmt.matmul_t_fm(dhts(), kernels=AUTO),
        "int8_mma_fm": lambda: int8_mma.int8_mma_matmul_t(
            dhts().t(), cb, scb, feature_major_out=True
        ),
        "quantize_only": lambda: int8_mma.quantize_rows(gs(), col_scale=ws),
        "torch_int_mm_codes_only": lambda: torch._int_mm(qg, cb),
    }
    flops = 2 * m * k * n
    res: dict = {"M": m, "K": k, "N": n}
    for key, table in (("forward", fwd), ("dx", bwd)):
        try:
            res[key] = _measure(table, flops)
        except Exception as exc:  # the yardstick itself failed
            res[key] = {"error": f"{type(exc).__name__}: {exc}"}
    try:
        res["check"] = check_shape(cb, scb, xs(), gs(), check_rows)
    except Exception as exc:
        res["check"] = {"error": f"{type(exc).__name__}: {exc}"}
    return res


def _line(label: str, table: dict) -> str:
    if "error" in table:
        return f"  {label:7s} ERROR {table['error']}"
    parts = [f"{name} {r['speedup_vs_bf16']:.2f}x" if "ms" in r else f"{name} ERROR"
             for name, r in table.items() if name != "bf16_cublas"]  # fmt: skip
    return f"  {label:7s} bf16 {table['bf16_cublas']['ms']:.3f} ms | speedup: " + ", ".join(parts)


def run_all(tokens: int = 8192, shapes: tuple[str, ...] = ("8b", "13b"),
            check_rows: int = 256) -> list[dict]:  # fmt: skip
    """Every shape of ``shapes`` at ``tokens`` token rows; prints one block per shape."""
    out = []
    for name in shapes:
        for k, n in SHAPES[name]:
            r = bench_shape(tokens, k, n, check_rows)
            r["model"] = name
            out.append(r)
            print(f"{name} M={tokens} K={k} N={n} (speedup = bf16 cuBLAS time / path time)",
                  flush=True)  # fmt: skip
            for key in ("forward", "dx"):
                print(_line(key, r[key]), flush=True)
            print(f"  check   {r['check']}", flush=True)
            torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", help="results JSON")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--shapes", default="8b,13b", help=f"comma-separated subset of {list(SHAPES)}")
    ap.add_argument("--check-rows", type=int, default=256,
                    help="token rows of the real-size correctness check")  # fmt: skip
    args = ap.parse_args(argv)
    shapes = tuple(s for s in args.shapes.split(",") if s)
    if not set(shapes) <= set(SHAPES):
        ap.error(f"--shapes: choose from {list(SHAPES)}")
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 1
    gpu = torch.cuda.get_device_name()
    res = run_all(args.tokens, shapes, args.check_rows)
    if args.out:
        doc = {**provenance(gpu, argv), "capability": list(torch.cuda.get_device_capability()),
               "kernel_policy": AUTO.to_dict(), "results": res}  # fmt: skip
        write_json_atomic(args.out, doc)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
