"""Compile the int8 MMA kernels for a Hopper target without a GPU and print, as JSON, which PTX
instructions each one uses (run by test_int8_mma_codegen.py in a process without
``TRITON_INTERPRET``). The signatures are what a launch at the Llama shapes specializes to:
16-divisible pointers, sizes and leading strides, unit strides as constants."""

import json
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from quant_kernels import int8_mma

PATTERN = r"\b(cp\.async\.[\w.]+|wgmma\.mma_async[\w.]*|mma\.sync[\w.]*)"


def _compile(fn, sig: dict, consts: dict, cap: int, **opts) -> list[str]:
    names = list(sig)
    div = [n for n, t in sig.items() if t != "constexpr" and n not in ("seed_ptr",)]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", cap, 64), options=opts)
    return sorted(set(re.findall(PATTERN, k.asm["ptx"])))


def main() -> None:
    cap = int(sys.argv[1])
    blocks = {"BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr",
              "GROUP_M": "constexpr"}  # fmt: skip
    base = {"q_ptr": "*i8", "cb_ptr": "*i8", "s_ptr": "*fp32"}
    nt = {**base, "ws_ptr": "*fp32", "out_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32",
          "stride_cn": "i32", "stride_ck": "constexpr", "stride_om": "i32",
          "stride_on": "constexpr", **blocks}  # fmt: skip
    nn = {**base, "out_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32", "stride_ck": "i32",
          "stride_cn": "constexpr", "stride_om": "i32", "stride_on": "constexpr",
          **blocks}  # fmt: skip
    cfg = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 128, "GROUP_M": 8}
    out = {
        "forward": _compile(int8_mma._mma_nt_kernel.fn, nt, {**cfg, "stride_ck": 1, "stride_on": 1},
                            cap, num_warps=8, num_stages=3),
        "dx": _compile(int8_mma._mma_nn_kernel.fn, nn, {**cfg, "stride_cn": 1, "stride_on": 1},
                       cap, num_warps=8, num_stages=3),
    }  # fmt: skip
    q = {"x_ptr": "*bf16", "cs_ptr": "*fp32", "q_ptr": "*i8", "s_ptr": "*fp32", "seed_ptr": "*i64",
         "M": "i32", "K": "i32", "stride_xm": "i32", "stride_xk": "constexpr",
         "HAS_COL_SCALE": "constexpr", "STOCHASTIC": "constexpr", "BLOCK_M": "constexpr",
         "BLOCK_K": "constexpr"}  # fmt: skip
    for stochastic in (False, True):
        consts = {"stride_xk": 1, "HAS_COL_SCALE": True, "STOCHASTIC": stochastic,
                  "BLOCK_M": 4, "BLOCK_K": 1024}  # fmt: skip
        _compile(int8_mma._quantize_rows_kernel, q, consts, cap, num_warps=4,
                 enable_fp_fusion=False)  # fmt: skip
    out["quantize"] = "compiled"
    print(json.dumps(out))


if __name__ == "__main__":
    main()
