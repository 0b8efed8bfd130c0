"""Time ways to permute the last axis of a bf16 activation, ``x[..., perm]``, on the GPU.

The POET-X(Q) layer permutes its input and output along the feature axis (five gathers per layer
per step, ~20 % of a Llama-1B step's GPU time; ``evals/results/profiles/``). This compares torch's
routes against the bandwidth floor (read + write of ``x``): ``index_select`` (what the layer uses),
advanced indexing, ``torch.gather``, int32 indices, and — for the
layout question (``docs/KERNELS.md``, Layer layout) — a row gather of the transposed
activation, alone and with the transpose, and the permute-and-transpose kernels of
:mod:`quant_kernels.transpose_perm` at three tile shapes. Each result is checked against
``index_select``.

    python evals/bench_gather.py --out $OUT/bench_gather_h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

import torch
from _common import cuda_time_ms, provenance, write_json_atomic

# (tokens, dim): Llama-1B at 8,192 and 32,768 tokens per micro-batch, Llama-8B at 2,048
SHAPES = [(8192, 2048), (8192, 5632), (32768, 2048), (2048, 4096), (2048, 14336)]
HBM_TB_S = 4.8  # H200 HBM3e peak


def _routes(x: torch.Tensor, perm: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    perm32 = perm.to(torch.int32)
    idx = perm.expand(x.shape[0], -1)
    xt = x.t().contiguous()  # [d, T]: the activation stored feature-major
    routes: dict[str, Callable[[], torch.Tensor]] = {
        "index_select": lambda: x.index_select(1, perm),
        "index_select_int32": lambda: x.index_select(1, perm32),
        "advanced_indexing": lambda: x[:, perm],
        "torch_gather": lambda: torch.gather(x, 1, idx),
        "rows_of_transposed": lambda: xt.index_select(0, perm),  # result [d, T]
        "transpose_then_rows": lambda: x.t().contiguous().index_select(0, perm),
    }
    try:
        from quant_kernels.transpose_perm import permute_to_feature_major, permute_to_row_major
    except ImportError:  # no Triton: only the torch routes
        return routes
    inv = torch.argsort(perm)
    for tile in ((64, 64), (32, 128), (128, 32)):
        name = f"{tile[0]}x{tile[1]}"
        # the input side: permuted and turned feature-major in one pass, result [d, T]
        routes[f"triton_to_feature_major_{name}"] = lambda tile=tile: permute_to_feature_major(
            x, inv, tile
        )
        # the output side: from a feature-major activation back to row-major, permuted
        routes[f"triton_to_row_major_{name}"] = lambda tile=tile: permute_to_row_major(
            xt, perm, tile
        )
    return routes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gather: error: needs a CUDA device", file=sys.stderr)
        return 2
    rows = []
    for t, d in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        perm = torch.randperm(d, device="cuda", generator=gen)
        want = x.index_select(1, perm)
        floor_ms = 2 * x.numel() * x.element_size() / (HBM_TB_S * 1e12) * 1e3
        row: dict = {"tokens": t, "dim": d, "floor_ms": floor_ms}
        for name, fn in _routes(x, perm).items():
            try:
                got = fn()
                same = torch.equal(got.t() if got.shape != want.shape else got, want)
                ms = cuda_time_ms(fn)
                row[name] = {"ms": ms, "x_floor": ms / floor_ms, "equal": same}
            except Exception as exc:  # a route that fails is a result too
                row[name] = {"error": repr(exc)[:200]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    doc = {
        "what": "x[..., perm] on bf16 [tokens, dim]: torch routes, the Triton row gather, a "
        "feature-major row gather and the permute-and-transpose kernels, against the HBM "
        "read+write floor",
        **provenance(torch.cuda.get_device_name(), argv),
        "results": rows,
    }
    print(f"wrote {write_json_atomic(args.out, doc)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
