"""Issue 3's kernel targets in one GPU run, each beside the floor of its pass structure.

One process measures, side by side:

1. correctness at real sizes: POET-XQ int8 / NF4 and POET-X bf16 layers (4096 → 14336 and back)
   against a dense float64 ``x @ (R·W0·P)ᵀ`` (``gpu_suite.correctness``);
2. the weight GEMMs ``x @ deq(Wq)ᵀ`` and ``dy @ deq(Wq)`` at M = 8,192 for the Llama-8B and
   13B MLP shapes, int8 and NF4 slab-streamed (the layer's path) against bf16 cuBLAS and
   bitsandbytes' ``matmul_4bit`` (``bench_slab_decode.gemm_ratios``, GPU time from CUDA-graph
   replays);
3. the Cayley–Neumann blocks of Llama-8B at b = 256, bf16, forward+backward, the fused hybrid
   path against the torch reference (``bench_cnp.bench_dtype``);
4. one layer forward+backward at the Llama-8B MLP shapes, input [1, 2048, d], bf16, against
   ``nn.Linear``, with its peak extra memory, and the official POET code's layers in the same
   rows when a local copy is given (``gpu_suite.layer_overhead``), plus the top CUDA kernels of
   the int8 ``mem`` layer (``gpu_suite.layer_profile``).

It then puts each target of issue 3 in a row (``targets``): the measurement, the threshold,
whether it is met, and the floor that the path's pass structure allows on this GPU, computed
from the shape (FLOPs at the bf16 dense peak, bytes at the HBM bandwidth; see
:func:`floors`). ``--render FILE.json`` writes that table as Markdown (no GPU needed).

Usage (GPU host):  python evals/kernel_targets.py --out $OUT/kernel_targets.json [--official DIR]
Render (any host): python evals/kernel_targets.py --render FILE.json --md FILE.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

#: H200 (and H100 SXM) dense bf16 peak and HBM bandwidth, the rooflines of the floors
PEAK_FLOPS = 989.4e12
HBM_BYTES_PER_S = 4.8e12
TOKENS = 2048  # the layer targets' input [1, 2048, d]
B = 256  # block size of every target
LAYER_SHAPES = ((4096, 14336), (14336, 4096))  # Llama-8B MLP (in, out)
GEMM_SHAPES = [(8192, 4096, 14336), (8192, 14336, 4096), (8192, 5120, 13824), (8192, 13824, 5120)]
#: bitsandbytes' NF4 paths as bench_slab_decode names them: Linear4bit's forward, and its dX
BNB_PATHS = {
    "bnb_matmul_4bit": "`matmul_4bit`",
    "bnb_dequantize_then_matmul": "`dequantize_4bit` + GEMM",
}
INT8_KEY, NF4_KEY = "int8 default 32MiB balanced", "nf4 default 32MiB balanced"
MIB = 2**20


def _ms(flops: float = 0.0, nbytes: float = 0.0) -> float:
    """Roofline time in ms of work with ``flops`` FLOPs and ``nbytes`` bytes of HBM traffic."""
    return 1e3 * max(flops / PEAK_FLOPS, nbytes / HBM_BYTES_PER_S)


def gemm_floor(m: int, k: int, n: int, bf16_ms: float, code_bytes_per_weight: float) -> dict:
    """Floors of a slab-streamed dequant GEMM ``[m, k] × [k, n]`` against the bf16 GEMM that
    took ``bf16_ms``: the GEMM's FLOP floor at peak, and the decode's extra HBM traffic (codes
    read and a bf16 slab written, ``code_bytes_per_weight + 2`` bytes per weight; the GEMM then
    reads the slab as the bf16 GEMM reads its weight) at HBM rate, also as a share of
    ``bf16_ms``: what decoding adds unless it overlaps the GEMMs or the slab GEMMs run faster
    than the whole one."""
    decode = _ms(nbytes=(code_bytes_per_weight + 2) * n * k)
    return {
        "bf16_ms": bf16_ms,
        "gemm_flop_floor_ms": _ms(flops=2 * m * k * n),
        "decode_floor_ms": decode,
        "decode_share": decode / bf16_ms,
    }


def cnp_floor(nb: int, b: int, reference_ms: float, measured_ms: float) -> dict:
    """Floors of the Cayley–Neumann forward+backward over ``nb`` blocks of ``b × b`` in bf16.

    Every ``b × b × b`` product (2b³ FLOPs) reads two ``[nb, b, b]`` operands and writes one:
    87 FLOP per byte at b = 256, under the H200's ridge point, so a product that goes through
    HBM is bound by its bytes. ``pass_ms`` is one read or write of a ``[nb, b, b]`` bf16 tensor;
    ``measured_passes`` the measured time in such passes. A kernel that keeps each block's
    intermediates on chip would move only ``packed`` (read in forward and backward), ``G``,
    ``∂G`` and ``∂packed``, and still run the five products of :mod:`quant_kernels.cnp_hybrid`
    (forward ``Q²``, ``S·B``; backward ``S·M``, ``M·Bᵀ``, ``D·Q``): ``fused_floor_ms``."""
    dense = 2 * nb * b * b
    packed = nb * b * (b - 1)
    pass_ms = _ms(nbytes=dense)
    product_flops = 5 * 2 * b**3 * nb
    return {
        "pass_ms": pass_ms,
        "measured_passes": measured_ms / pass_ms,
        "needed_ms": reference_ms / 3,
        "needed_passes": reference_ms / 3 / pass_ms,
        "product_flop_floor_ms": _ms(flops=product_flops),
        "fused_floor_ms": _ms(product_flops, 3 * packed + 2 * dense),
    }


def layer_floor(n: int, m: int, linear_ms: float, b: int = B, t: int = TOKENS) -> dict:
    """Floor of the int8 ``mem`` layer's forward+backward at input ``[t, n]``, output ``[t, m]``.

    The ``mem`` layer runs the three weight GEMMs ``nn.Linear`` runs (forward, the recompute of
    ``W0·P·x`` in place of the weight gradient, dX), counted at ``nn.Linear``'s measured time,
    plus work ``nn.Linear`` has not, each at its roofline: seven block-diagonal passes at ``b``
    (input side: forward, recompute, ``∂P``, dX; output side: forward, ``∂R``, the rotated
    output gradient), each reading and writing a ``[t, d]`` bf16 tensor; two int8 slab decodes
    (1 byte read and 2 written per weight; the GEMM then reads the slab as ``nn.Linear`` reads its
    bf16 weight); five permute-transposes (``x`` in, ``y`` out; backward ``x``, ``dy`` in,
    ``dx`` out); the Cayley–Neumann forward+backward of its ``⌈n/b⌉ + ⌈m/b⌉`` blocks at the
    floor of a kernel that keeps them on chip (:func:`cnp_floor`)."""
    blocks = 4 * _ms(2 * t * n * b, 4 * t * n) + 3 * _ms(2 * t * m * b, 4 * t * m)
    decodes = 2 * _ms(nbytes=3 * n * m)
    perms = _ms(nbytes=4 * t * (3 * n + 2 * m))
    cnp = cnp_floor(-(-n // b) - (-m // b), b, 1.0, 1.0)["fused_floor_ms"]
    extra = blocks + decodes + perms + cnp
    return {
        "block_passes_ms": blocks,
        "decodes_ms": decodes,
        "permute_transposes_ms": perms,
        "cnp_ms": cnp,
        "ratio_floor": (linear_ms + extra) / linear_ms,
    }


def peak_floor_mib(n: int, m: int, t: int = TOKENS) -> dict:
    """Bytes (MiB) the ``mem`` layer's forward+backward must hold at once in bf16: the output
    ``[t, m]``, the input gradient ``[t, n]``, the rotated output gradient ``[t, m]`` (the dX
    GEMM's input) and the recomputed ``W0·P·x`` ``[t, m]`` (for ``∂R``); and the weight's bf16
    size, the target."""
    act = 2 * t * (3 * m + n) / MIB
    return {"activations_mib": act, "weight_bf16_mib": 2 * n * m / MIB}


def targets(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per target of issue 3 from a run's measurements (``doc``)."""
    rows: list[dict[str, Any]] = []

    def add(what: str, value: float, op: str, threshold: float, floor: dict, **extra) -> None:
        met = value <= threshold if op == "<=" else value >= threshold
        rows.append(
            {
                "target": what,
                "measured": value,
                "op": op,
                "threshold": threshold,
                "met": met,
                "floor": floor,
                **extra,
            }
        )

    for g in doc.get("gemm", []):
        m, k, n = g["M"], g["K"], g["N"]
        for side in ("forward", "dX"):
            t = g[side]
            bf = t["bf16_matmul"]["ms"]
            shape = f"{m}×{k}×{n} {side}"
            if INT8_KEY in t:
                add(
                    f"int8 weight GEMM ÷ bf16, {shape}",
                    t[INT8_KEY]["ratio_vs_bf16"],
                    "<=",
                    1.05,
                    gemm_floor(m, k, n, bf, 1.0),
                )
            if NF4_KEY in t:
                # the target compares with bitsandbytes' Linear4bit forward (matmul_4bit); its
                # dX (dequantize_4bit, then a GEMM) is shown beside ours but not judged
                bnb_key = next((kk for kk in t if kk.startswith("bnb")), None)
                bnb = t[bnb_key]["ratio_vs_bf16"] if bnb_key else None
                add(
                    f"NF4 weight GEMM ÷ bf16, {shape}",
                    t[NF4_KEY]["ratio_vs_bf16"],
                    "<=",
                    1.10,
                    gemm_floor(m, k, n, bf, 0.5 + 4 / 64),
                    bnb_ratio=bnb,
                    bnb_path=bnb_key,
                    faster_than_bnb=None if bnb is None else t[NF4_KEY]["ratio_vs_bf16"] < bnb,
                )
                if side == "forward":
                    rows[-1]["met"] = rows[-1]["met"] and rows[-1]["faster_than_bnb"] is not False
    cnp = doc.get("cnp")
    if cnp:
        ms = cnp["ms"]
        ref, hyb = ms["reference"]["fwd_bwd"], ms["fused_hybrid"]["fwd_bwd"]
        add(
            f"CNP fwd+bwd speed-up over the torch reference, {doc['cnp_blocks']:,} blocks of "
            f"b = {B} (Llama-8B), bf16",
            ref / hyb,
            ">=",
            3.0,
            cnp_floor(doc["cnp_blocks"], B, ref, hyb),
            reference_ms=ref,
            fused_ms=hyb,
        )
    for lay in doc.get("layers", []):
        n, m = (int(s) for s in lay["shape"].split("->"))
        base = lay["nn_linear"]
        lin = base.get("gpu_ms_graph")
        mem, fast = lay.get("bits8_mem", {}), lay.get("bits16_fast", {})
        official = {k: v.get("gpu_ratio") for k, v in lay.items() if k.startswith("official_")}
        if lin and "gpu_ratio" in mem:
            add(
                f"POET-XQ int8 mem layer fwd+bwd ÷ nn.Linear, {n}→{m}",
                mem["gpu_ratio"],
                "<=",
                1.15,
                layer_floor(n, m, lin),
                nn_linear_ms=lin,
                official_ratios=official,
            )
        if lin and "gpu_ratio" in fast:
            add(
                f"POET-X bf16 fast layer fwd+bwd ÷ nn.Linear, {n}→{m}",
                fast["gpu_ratio"],
                "<=",
                0.9,
                {},
                nn_linear_ms=lin,
            )
        if "peak_extra_mib" in mem:
            pf = peak_floor_mib(n, m)
            add(
                f"POET-XQ int8 mem layer peak extra memory (MiB), {n}→{m}",
                mem["peak_extra_mib"],
                "<=",
                pf["weight_bf16_mib"],
                pf,
                nn_linear_peak_extra_mib=base.get("peak_extra_mib"),
                official_peak_extra_mib={
                    k: v.get("peak_extra_mib") for k, v in lay.items() if k.startswith("official_")
                },
            )
    return rows


def _floor_text(row: dict[str, Any]) -> str:
    f = row["floor"]
    if "decode_share" in f:
        return (
            f"bf16 GEMM {f['bf16_ms']:.3f} ms, {f['gemm_flop_floor_ms'] / f['bf16_ms']:.0%} of "
            f"peak; the decode's traffic {f['decode_floor_ms']:.3f} ms at HBM rate "
            f"({f['decode_share']:.1%} of it)"
        )
    if "measured_passes" in f:
        return (
            f"one pass over [nb, b, b] bf16 = {f['pass_ms']:.2f} ms; measured "
            f"{f['measured_passes']:.1f} passes, 3× needs ≤ {f['needed_passes']:.1f} "
            f"({f['needed_ms']:.2f} ms); a kernel keeping blocks on chip ≥ "
            f"{f['fused_floor_ms']:.2f} ms (products ≥ {f['product_flop_floor_ms']:.2f})"
        )
    if "ratio_floor" in f:
        return (
            f"3 GEMMs at nn.Linear's time + block passes {f['block_passes_ms']:.3f} + decodes "
            f"{f['decodes_ms']:.3f} + permute-transposes {f['permute_transposes_ms']:.3f} + CNP "
            f"{f['cnp_ms']:.3f} ms at their rooflines ≥ {f['ratio_floor']:.2f}×"
        )
    if "activations_mib" in f:
        return (
            f"y, dx, the rotated dy and the recomputed W0·P·x held at once: "
            f"{f['activations_mib']:.0f} MiB; nn.Linear {row['nn_linear_peak_extra_mib']:.0f}"
        )
    return ""


def render(
    doc: dict[str, Any],
    source: str,
    heading: str = "# Issue 3 kernel targets, one run",
    profile: bool = True,
) -> str:
    """Markdown of a run's target rows, its provenance and (``profile``) the int8 layer's
    kernel profile, under ``heading``."""
    lines = [
        heading,
        "",
        f"{doc['gpu']}, {doc['date']}, commit {doc['commit']}, torch {doc['torch']}. Command: "
        f"`{doc['command']}`. Source: `{source}`.",
        "",
        "GPU time from CUDA-graph replays (the CNP rows: CUDA events around eager calls). The "
        f"floors take {PEAK_FLOPS / 1e12:.1f} TFLOP/s (dense bf16) and "
        f"{HBM_BYTES_PER_S / 1e12:.1f} TB/s (HBM) as the rooflines "
        "(`evals/kernel_targets.py`, `floors`).",
        "",
        "| target | measured | threshold | met | floor of this pass structure |",
        "|---|---:|---:|---|---|",
    ]
    for r in doc["targets"]:
        met = "yes" if r["met"] else "**no**"
        extra = ""
        if r.get("bnb_ratio") is not None:
            path = BNB_PATHS.get(r.get("bnb_path"), r.get("bnb_path"))
            extra = f" (bitsandbytes {path} {r['bnb_ratio']:.3f})"
        lines.append(
            f"| {r['target']} | {r['measured']:.3f}{extra} | {r['op']} "
            f"{r['threshold']:.2f} | {met} | {_floor_text(r)} |"
        )
    checks = doc.get("correctness", [])
    if checks:
        lines += ["", "Correctness at real sizes (relative error against float64):", ""]
        for c in checks:
            errs = "; ".join(
                f"{k}: y {v['y_rel_err']:.1e}, dX {v['dx_rel_err']:.1e}"
                for k, v in c.items()
                if isinstance(v, dict)
            )
            label = c["shape"].replace("->", " → ")
            lines.append(f"- {label}, bits {c.get('bits')}: {errs or c.get('error')}")
    official = [r for r in doc["targets"] if r.get("official_ratios")]
    if official:
        lines += ["", "The official POET code's layers in the same rows (÷ `nn.Linear`):", ""]
        for r in official:
            ratios = ", ".join(f"{k[9:]} {v:.2f}" for k, v in r["official_ratios"].items() if v)
            lines.append(f"- {r['target'].split(', ')[-1]}: {ratios}")
    if profile and doc.get("layer_profile"):
        lines += [
            "",
            "Top CUDA kernels of one int8 `mem` layer forward+backward, 4096 → 14336:",
            "",
            "```",
            doc["layer_profile"].rstrip(),
            "```",
        ]
    return "\n".join(lines) + "\n"


def measure(official: str | None) -> dict[str, Any]:
    """Run the four measurements on the GPU; returns the results document (with ``targets``)."""
    import bench_cnp
    import bench_slab_decode
    import gpu_suite
    import official_poet
    import torch
    from _common import provenance

    doc: dict[str, Any] = provenance(torch.cuda.get_device_name())
    gen = torch.Generator().manual_seed(0)
    doc["correctness"] = []
    for n, m, bits in ((4096, 14336, 8), (14336, 4096, 8), (4096, 14336, 4), (14336, 4096, 16)):
        try:
            doc["correctness"].append(gpu_suite.correctness(n, m, B, bits, gen))
        except Exception as exc:  # record and go on: the timings still count
            doc["correctness"].append({"shape": f"{n}->{m}", "bits": bits, "error": repr(exc)})
    print(json.dumps(doc["correctness"], indent=1), flush=True)
    doc["gemm"] = bench_slab_decode.gemm_ratios(
        None, None, shapes=GEMM_SHAPES, slab_mibs=(32,), bandings=(True,)
    )
    torch.backends.cuda.matmul.allow_tf32 = False
    nb, _ = bench_cnp.model_blocks("llama-8b:poetxq", B)
    g = torch.Generator(device="cuda").manual_seed(0)
    packed = torch.randn(nb, B * (B - 1) // 2, device="cuda", generator=g) * (0.2 / B**0.5)
    d_g = torch.randn(nb, B, B, device="cuda", generator=g) / B**0.5
    doc["cnp_blocks"] = nb
    doc["cnp"] = bench_cnp.bench_dtype(packed.bfloat16(), d_g.bfloat16(), B, warmup=3, reps=10)
    del packed, d_g
    torch.cuda.empty_cache()
    poet = official_poet.try_load(official)
    doc["official_code"] = poet is not None
    doc["layers"] = [gpu_suite.layer_overhead(n, m, B, poet) for n, m in LAYER_SHAPES]
    doc["layer_profile"] = gpu_suite.layer_profile(4096, 14336, B)
    doc["targets"] = targets(doc)
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", help="results JSON to write (measures; needs a CUDA GPU)")
    ap.add_argument(
        "--official",
        default=None,
        help="folder holding the official poet_torch/ to "
        "time beside ours (default $POETXQ_OFFICIAL_DIR or .official/; left out when "
        "absent)",
    )
    ap.add_argument("--render", help="a results JSON of this script to render as Markdown")
    ap.add_argument("--md", help="with --render: the Markdown file to write (default: stdout)")
    args = ap.parse_args(argv)
    if bool(args.out) == bool(args.render):
        ap.error("give exactly one of --out (measure) and --render (Markdown from a results JSON)")
    if args.render:
        path = Path(args.render)
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            ap.error(f"--render {path}: cannot read a results JSON ({exc})")
        doc["targets"] = targets(doc)  # the floors as this version computes them
        text = render(doc, str(path))
        if args.md:
            Path(args.md).write_text(text)
            print(f"wrote {args.md}")
        else:
            print(text, end="")
        return 0
    import torch
    from _common import write_json_atomic

    if not torch.cuda.is_available():
        print("kernel_targets: needs a CUDA GPU (none found); nothing measured", file=sys.stderr)
        return 1
    doc = measure(args.official)
    write_json_atomic(args.out, doc)
    print(render(doc, args.out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
