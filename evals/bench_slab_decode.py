"""Slab decoders of the streamed dequant-GEMM: tile sweep, then the GEMM ratios they give (GPU).

Part 1 times one 32 MiB slab decode (int8 row-wise; NF4 blocksize 64 with fp32 absmax) at the
Llama-8B / 13B MLP weights, as a band of rows (forward) and as a band of columns (dX), for every
candidate ``(BLOCK_R, BLOCK_C, num_warps)`` tile (and, for NF4, the gather / select code lookup
and the interleaved / packed 32-bit store). It prints the rate against the HBM traffic of the
decode (bytes read + bytes written) and picks the fastest setting per format, summed over shapes.

Part 2 times ``x @ deq(W)ᵀ`` and ``g @ deq(W)`` (M = 8192 and 2048) side by side with bf16 cuBLAS:
the current defaults, the picked tile, and both with equal-sized bands (``streamed._band``) or
with the previous banding (full bands and a ragged last one), at 16 / 32 / 64 MiB slabs.

Usage:  python evals/bench_slab_decode.py --out FILE.json
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import sys
from collections.abc import Iterator

import torch
from _common import cuda_time_ms, provenance, write_json_atomic

from quant_kernels import reference, streamed
from quant_kernels.streamed import (
    fourbit_decoder,
    int8_decoder,
    streamed_matmul_nn,
    streamed_matmul_nt,
)

WEIGHTS = [(14336, 4096), (4096, 14336), (13824, 5120), (5120, 13824)]  # (N out, K in)
INT8_TILES = [(32, 128, 4), (16, 256, 4), (8, 512, 4), (16, 512, 8), (32, 256, 8), (4, 1024, 4),
              (8, 1024, 8), (64, 128, 8), (32, 512, 8), (16, 1024, 8)]  # fmt: skip
FOURBIT_TILES = [(32, 128, 4), (16, 256, 4), (8, 512, 4), (16, 512, 8), (32, 256, 8),
                 (8, 1024, 8), (4, 1024, 4)]  # fmt: skip
SLAB = 32 * 2**20
GEMM_SHAPES = [(8192, 4096, 14336), (8192, 14336, 4096), (8192, 5120, 13824),
               (8192, 13824, 5120), (2048, 4096, 14336), (2048, 14336, 4096)]  # fmt: skip


def _old_band(total: int, other: int, elem: int, slab_bytes: int, align: int) -> int:
    """The banding before equal-sized bands: full slabs, then whatever is left."""
    per = max(slab_bytes // max(other * elem, 1), align) // align * align
    return min(per, total)


@contextlib.contextmanager
def _banding(balanced: bool) -> Iterator[None]:
    saved = streamed._band
    if not balanced:
        streamed._band = _old_band
    try:
        yield
    finally:
        streamed._band = saved


def _weights(n: int, k: int) -> dict:
    w = torch.randn(n, k, device="cuda") / k**0.5
    cb, scb = reference.quantize_int8_rowwise(w)
    out = {"w_bf16": reference.dequant_int8_rowwise(cb, scb, torch.bfloat16), "cb": cb, "scb": scb}
    try:
        import bitsandbytes.functional as F

        packed, st = F.quantize_4bit(w, blocksize=64, quant_type="nf4")
        out["nf4"] = (packed, st.absmax.float(), st.code.float())
    except Exception as exc:  # bitsandbytes' CUDA build missing: int8 only
        out["nf4_error"] = f"{type(exc).__name__}: {exc}"
    return out


def _decoders(wt: dict, k: int) -> dict[str, object]:
    """name → decoder, every candidate setting."""
    decs: dict[str, object] = {}
    for t in INT8_TILES:
        decs[f"int8 {t}"] = int8_decoder(wt["cb"], wt["scb"], tile=t)
    if "nf4" in wt:
        packed, absmax, code = wt["nf4"]
        for t, lut, pack in itertools.product(FOURBIT_TILES, ("gather", "select"), (False, True)):
            decs[f"nf4 {t} {lut} {'pack32' if pack else 'join'}"] = fourbit_decoder(
                packed, absmax, code, 64, k, lut=lut, tile=t, pack32=pack
            )
    return decs


def decode_sweep() -> dict:
    """Part 1: ms and GB/s of one 32 MiB slab decode per setting, rows and columns bands."""
    res: dict = {}
    for n, k in WEIGHTS:
        wt = _weights(n, k)
        rows = min(n, SLAB // (2 * k)) // 128 * 128
        cols = min(k, SLAB // (2 * n)) // 64 * 64
        buf = torch.empty(SLAB // 2, device="cuda", dtype=torch.bfloat16)
        ref_rows = wt["w_bf16"][:rows]
        entry: dict = {"N": n, "K": k, "rows_band": rows, "cols_band": cols}
        for name, dec in _decoders(wt, k).items():
            fmt_bytes = 1.0 if name.startswith("int8") else 0.5
            r = {}
            for band, args, count in (("rows", (0, rows, 0, k), rows * k),
                                      ("cols", (0, n, 0, cols), n * cols)):  # fmt: skip
                ms = cuda_time_ms(lambda d=dec, a=args: d(buf, *a), warmup=5, iters=30)  # noqa: B023
                traffic = count * (2 + fmt_bytes)  # bytes written + bytes of codes read
                r[band] = {"ms": ms, "gbps": traffic / ms / 1e6}
            if name.startswith("int8"):  # exact against the reference dequantizer
                r["exact"] = bool(torch.equal(dec(buf, 0, rows, 0, k), ref_rows))
            print(f"{n}x{k} {name:40s} rows {r['rows']['gbps']:7.0f} GB/s  "
                  f"cols {r['cols']['gbps']:7.0f} GB/s", flush=True)  # fmt: skip
            entry[name] = r
        res[f"{n}x{k}"] = entry
    return res


def _best(sweep: dict, prefix: str) -> str | None:
    totals: dict[str, float] = {}
    for entry in sweep.values():
        for name, r in entry.items():
            if isinstance(r, dict) and name.startswith(prefix):
                totals[name] = totals.get(name, 0.0) + r["rows"]["ms"] + r["cols"]["ms"]
    return min(totals, key=totals.get) if totals else None


def _parse(name: str) -> dict:
    """'nf4 (8, 512, 4) select pack32' → decoder keyword arguments."""
    tile = tuple(int(v) for v in name[name.index("(") + 1 : name.index(")")].split(","))
    kw: dict = {"tile": tile}
    rest = name[name.index(")") + 1 :].split()
    if rest:
        kw["lut"], kw["pack32"] = rest[0], rest[1] == "pack32"
    return kw


def _gemm_table(side: str, acts: list[torch.Tensor], w_bf: torch.Tensor, settings: dict) -> dict:
    """One side (``forward`` x @ Wᵀ or ``dX`` g @ W) of one shape: bf16 cuBLAS, then every
    decoder setting × slab size × banding, timed with the activations rotated over 3 buffers."""
    n, k = w_bf.shape
    it = itertools.cycle(acts)
    fwd = side == "forward"
    t0 = cuda_time_ms(lambda: next(it) @ (w_bf.t() if fwd else w_bf))
    table: dict = {"bf16_matmul_ms": t0}
    run = streamed_matmul_nt if fwd else streamed_matmul_nn
    for (name, dec), mib, balanced in itertools.product(
        settings.items(), (16, 32, 64), (False, True)
    ):
        sb = mib * 2**20
        with _banding(balanced):
            ms = cuda_time_ms(lambda d=dec, sb=sb: run(next(it), d, n, k, slab_bytes=sb))
        key = f"{name} {mib}MiB {'balanced' if balanced else 'ragged'}"
        table[key] = {"ms": ms, "ratio_vs_bf16": ms / t0}
    return table


def gemm_ratios(best_int8: str, best_nf4: str | None) -> list[dict]:
    """Part 2: streamed GEMMs against bf16 cuBLAS, defaults against the picked settings."""
    out = []
    bf = torch.bfloat16
    for m, k, n in GEMM_SHAPES:
        wt = _weights(n, k)
        cb, scb = wt["cb"], wt["scb"]
        settings = {
            "int8 default": int8_decoder(cb, scb),
            "int8 picked": int8_decoder(cb, scb, **_parse(best_int8)),
        }
        if best_nf4 and "nf4" in wt:
            p, a, c = wt["nf4"]
            settings["nf4 default"] = fourbit_decoder(p, a, c, 64, k)
            settings["nf4 picked"] = fourbit_decoder(p, a, c, 64, k, **_parse(best_nf4))
        row: dict = {"M": m, "K": k, "N": n}
        for side, width in (("forward", k), ("dX", n)):
            acts = [torch.randn(m, width, device="cuda", dtype=bf) for _ in range(3)]
            table = _gemm_table(side, acts, wt["w_bf16"], settings)
            best = min((v["ratio_vs_bf16"], kk) for kk, v in table.items() if isinstance(v, dict))
            print(f"M={m} K={k} N={n} {side:7s} bf16 {table['bf16_matmul_ms']:.3f} ms, "
                  f"best {best[1]} {best[0]:.3f}×", flush=True)  # fmt: skip
            row[side] = table
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", required=True, help="results JSON")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_slab_decode: needs a CUDA GPU", file=sys.stderr)
        return 1
    doc = provenance(torch.cuda.get_device_name(), argv)
    doc["decode"] = decode_sweep()
    doc["best_int8"], doc["best_nf4"] = _best(doc["decode"], "int8"), _best(doc["decode"], "nf4")
    print(f"picked: {doc['best_int8']} | {doc['best_nf4']}", flush=True)
    doc["gemm"] = gemm_ratios(doc["best_int8"], doc["best_nf4"])
    write_json_atomic(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
