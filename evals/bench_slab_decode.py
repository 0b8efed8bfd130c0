"""Slab decoders of the streamed dequant-GEMM: tile sweep, GEMM ratios and where the time goes.

Every time here is GPU time: the calls are captured in a CUDA graph and the replay timed
(``_common.cuda_graph_ms``). A Triton launch costs 20–40 µs of Python, longer than a 32 MiB
decode, so a CUDA-event time around one eager call measures the host, not the kernel. Each
measurement is repeated over ``ROUNDS`` interleaved rounds (the H200's clocks move with power
draw) and the median kept.

Part 1 decodes a whole Llama-8B / 13B MLP weight (int8 row-wise; NF4 blocksize 64 with fp32
absmax) in 32 MiB slabs, as bands of rows (forward) and of columns (dX), for every candidate
``(BLOCK_R, BLOCK_C, num_warps)`` tile (NF4 also: absmax loaded per byte or per block), and
prints the rate against the decode's HBM traffic (codes read + 16-bit slab written). The fastest
setting per format, summed over shapes, is picked.

Part 2 times ``x @ deq(W)ᵀ`` and ``g @ deq(W)`` (M = 8192 and 2048) beside bf16 cuBLAS, and splits
the streamed call into its decodes alone and its slab GEMMs alone (on an already decoded slab),
for the default and the picked decoder, at 32 / 64 MiB slabs, with equal-sized bands
(``streamed._band``) and with the previous banding (full bands and a ragged last one).

Usage:  python evals/bench_slab_decode.py --out FILE.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import sys
from collections.abc import Iterator

import torch
from _common import cuda_graph_ms, cuda_time_ms, provenance, write_json_atomic

from quant_kernels import reference, streamed
from quant_kernels.streamed import (
    fourbit_decoder,
    int8_decoder,
    streamed_matmul_nn,
    streamed_matmul_nt,
)

WEIGHTS = [(14336, 4096), (4096, 14336), (13824, 5120), (5120, 13824)]  # (N out, K in)
# evals/results/slab_decode_sweep_h200_d59ade3.json has a wider sweep (int8 tiles within 10 % of
# each other; the 32-bit packed NF4 store and the select lookup slower), and
# the run at c30093d (its slab_decode_h200_c30093d.json is in git history) a 256-entry pair
# lookup (no faster)
INT8_TILES = [(32, 128, 4), (16, 256, 4), (64, 128, 8)]
FOURBIT_TILES = [(8, 512, 4), (4, 1024, 4), (16, 256, 4), (4, 512, 2), (8, 256, 2), (2, 1024, 2)]
FOURBIT_PER_BLOCK = (False, True)  # absmax loaded per byte / per block
SLAB = 32 * 2**20
ROUNDS = 3
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
    out["w_f32"] = w
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
        for t, pb in itertools.product(FOURBIT_TILES, FOURBIT_PER_BLOCK):
            decs[f"nf4 {t} {'block' if pb else 'byte'}"] = fourbit_decoder(
                packed, absmax, code, 64, k, tile=t, per_block=pb
            )
    return decs


def _median_ms(fns: dict[str, object]) -> dict[str, float]:
    """GPU ms of each zero-argument call, median over ROUNDS interleaved rounds."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    eager: set[str] = set()
    for _ in range(ROUNDS):
        for name, fn in fns.items():
            if name not in eager:
                try:
                    times[name].append(cuda_graph_ms(fn, iters=20))
                    continue
                except RuntimeError as exc:  # not capturable: CUDA-event time of eager calls
                    print(f"{name}: no CUDA graph ({str(exc).splitlines()[0][:80]}); eager time")
                    eager.add(name)
            times[name].append(cuda_time_ms(fn, iters=20))
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def _decode_all(dec, buf: torch.Tensor, n: int, k: int, band: int, rows: bool) -> None:
    """Decode the whole weight, one band of ``band`` rows (or columns) after another."""
    total = n if rows else k
    for o in range(0, total, band):
        cnt = min(band, total - o)
        dec(buf, o, cnt, 0, k) if rows else dec(buf, 0, n, o, cnt)


def decode_sweep() -> dict:
    """Part 1: GPU ms and GB/s of decoding one whole weight in 32 MiB slabs, per setting."""
    res: dict = {}
    for n, k in WEIGHTS:
        wt = _weights(n, k)
        rows = min(n, SLAB // (2 * k)) // 128 * 128
        cols = min(k, SLAB // (2 * n)) // 64 * 64
        buf = torch.empty(SLAB // 2, device="cuda", dtype=torch.bfloat16)
        entry: dict = {"N": n, "K": k, "rows_band": rows, "cols_band": cols}
        decs = _decoders(wt, k)
        fns: dict = {}
        for name, dec in decs.items():
            for band, cnt, along_rows in (("rows", rows, True), ("cols", cols, False)):
                fns[(name, band)] = functools.partial(_decode_all, dec, buf, n, k, cnt, along_rows)
        view = buf[: rows * k].view(rows, k)
        fns[("torch int8->bf16 copy", "rows")] = functools.partial(view.copy_, wt["cb"][:rows])
        ms = _median_ms(fns)
        ms[("torch int8->bf16 copy", "rows")] *= -(-n // rows)  # per whole weight
        for name in [*decs, "torch int8->bf16 copy"]:
            fmt_bytes = 0.5 if name.startswith("nf4") else 1.0
            traffic = n * k * (2 + fmt_bytes)  # 16-bit slab written + codes read
            r = {band: {"ms": ms[(name, band)], "gbps": traffic / ms[(name, band)] / 1e6}
                 for band in ("rows", "cols") if (name, band) in ms}  # fmt: skip
            if name.startswith("int8"):  # exact against the reference dequantizer
                got = decs[name](buf, 0, rows, 0, k)
                r["exact"] = bool(torch.equal(got, wt["w_bf16"][:rows]))
            print(f"{n}x{k} {name:40s} " + "  ".join(
                f"{band} {v['ms'] * 1e3:6.1f} µs {v['gbps']:6.0f} GB/s"
                for band, v in r.items() if isinstance(v, dict)), flush=True)  # fmt: skip
            entry[name] = r
        res[f"{n}x{k}"] = entry
    return res


def _best(sweep: dict, prefix: str) -> str | None:
    totals: dict[str, float] = {}
    for entry in sweep.values():
        for name, r in entry.items():
            if isinstance(r, dict) and name.startswith(prefix) and "cols" in r:
                totals[name] = totals.get(name, 0.0) + r["rows"]["ms"] + r["cols"]["ms"]
    return min(totals, key=totals.get) if totals else None


def _parse(name: str) -> dict:
    """'nf4 (8, 512, 4) block' → decoder keyword arguments."""
    tile = tuple(int(v) for v in name[name.index("(") + 1 : name.index(")")].split(","))
    kw: dict = {"tile": tile}
    rest = name[name.index(")") + 1 :].split()
    if rest:
        kw["per_block"] = rest[0] == "block"
    return kw


def _gemm_table(
    side: str,
    acts: list[torch.Tensor],
    w_bf: torch.Tensor,
    settings: dict,
    others: dict,
    slab_mibs: tuple[int, ...] = (32, 64),
    bandings: tuple[bool, ...] = (False, True),
) -> dict:
    """One side (``forward`` x @ Wᵀ or ``dX`` g @ W) of one shape: bf16 cuBLAS, ``others``
    (name → call on one activation, e.g. bitsandbytes' path), then every decoder setting × slab
    size (``slab_mibs``) × banding (``bandings``: equal-sized bands or not): the streamed call,
    its decodes alone and its slab GEMMs alone; each call made once per activation buffer (3)
    inside the timed graph."""
    n, k = w_bf.shape
    fwd = side == "forward"
    m = acts[0].shape[0]
    fns: dict = {"bf16_matmul": lambda: [a @ (w_bf.t() if fwd else w_bf) for a in acts]}
    for name, fn in others.items():
        fns[name] = functools.partial(lambda f: [f(a) for a in acts], fn)
    run = streamed_matmul_nt if fwd else streamed_matmul_nn
    for (name, dec), mib, balanced in itertools.product(settings.items(), slab_mibs, bandings):
        sb = mib * 2**20
        band = (streamed._band if balanced else _old_band)(
            n if fwd else k, k if fwd else n, 2, sb, 128 if fwd else 64
        )
        buf = torch.empty(band * (k if fwd else n), device="cuda", dtype=w_bf.dtype)
        out = torch.empty(m, n if fwd else k, device="cuda", dtype=w_bf.dtype)
        key = f"{name} {mib}MiB {'balanced' if balanced else 'ragged'}"

        def call(d=dec, sb=sb, balanced=balanced) -> None:
            with _banding(balanced):
                for a in acts:
                    run(a, d, n, k, slab_bytes=sb)

        def decodes(d=dec, band=band, buf=buf) -> None:
            for _ in acts:
                _decode_all(d, buf, n, k, band, fwd)

        def gemms(band=band, buf=buf, out=out) -> None:
            total = n if fwd else k
            for a in acts:
                for o in range(0, total, band):
                    c = min(band, total - o)
                    if fwd:
                        torch.mm(a, buf[: c * k].view(c, k).t(), out=out[:, o : o + c])
                    else:
                        torch.mm(a, buf[: n * c].view(n, c), out=out[:, o : o + c])

        fns[key], fns[key + " decode only"], fns[key + " gemms only"] = call, decodes, gemms
    ms = {name: t / len(acts) for name, t in _median_ms(fns).items()}
    t0 = ms["bf16_matmul"]
    return {name: {"ms": t, "ratio_vs_bf16": t / t0} for name, t in ms.items()}


def _bnb_nf4(w: torch.Tensor) -> dict:
    """bitsandbytes' own NF4 paths on the same weight (blocksize 64, no double quant, as the
    decoders above): ``matmul_4bit`` forward (``Linear4bit``'s), and its backward's dX, a full
    ``dequantize_4bit`` then a bf16 GEMM."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as F

    packed, st = F.quantize_4bit(w.to(torch.bfloat16), blocksize=64, quant_type="nf4")
    return {
        "forward": {"bnb_matmul_4bit": lambda x: bnb.matmul_4bit(x, packed.t(), quant_state=st)},
        "dX": {"bnb_dequantize_then_matmul": lambda g: g @ F.dequantize_4bit(packed, st)},
    }


def gemm_ratios(
    best_int8: str | None,
    best_nf4: str | None,
    shapes: list[tuple[int, int, int]] = GEMM_SHAPES,
    nf4: bool = True,
    **table_kw,
) -> list[dict]:
    """Part 2: streamed GEMMs against bf16 cuBLAS at ``shapes`` (M, K, N), the default decoders
    (NF4 too with ``nf4``, beside bitsandbytes) against the picked settings (none when
    ``best_*`` is None); ``table_kw`` go to :func:`_gemm_table` (slab sizes, bandings)."""
    out = []
    bf = torch.bfloat16
    for m, k, n in shapes:
        wt = _weights(n, k)
        cb, scb = wt["cb"], wt["scb"]
        settings = {"int8 default": int8_decoder(cb, scb)}
        if best_int8:
            settings["int8 picked"] = int8_decoder(cb, scb, **_parse(best_int8))
        others: dict = {"forward": {}, "dX": {}}
        if (nf4 or best_nf4) and "nf4" in wt:
            p, a, c = wt["nf4"]
            settings["nf4 default"] = fourbit_decoder(p, a, c, 64, k)
            if best_nf4:
                settings["nf4 picked"] = fourbit_decoder(p, a, c, 64, k, **_parse(best_nf4))
            others = _bnb_nf4(wt["w_f32"])
        row: dict = {"M": m, "K": k, "N": n}
        for side, width in (("forward", k), ("dX", n)):
            acts = [torch.randn(m, width, device="cuda", dtype=bf) for _ in range(3)]
            table = _gemm_table(side, acts, wt["w_bf16"], settings, others[side], **table_kw)
            print(f"M={m} K={k} N={n} {side}: bf16 {table['bf16_matmul']['ms']:.3f} ms", flush=True)
            for key, v in table.items():
                if key.startswith("bnb"):
                    print(f"  {key:30s} {v['ratio_vs_bf16']:.3f}×", flush=True)
                elif key.endswith("32MiB balanced") or key.endswith("32MiB ragged"):
                    dec_ms = table[key + " decode only"]["ms"]
                    gemm_ms = table[key + " gemms only"]["ms"]
                    print(f"  {key:30s} {v['ratio_vs_bf16']:.3f}×  (decodes {dec_ms:.3f} ms, "
                          f"slab GEMMs {gemm_ms:.3f} ms)", flush=True)  # fmt: skip
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
