"""Benchmark + real-size check of the fused CNP (:mod:`quant_kernels.cnp_hybrid`) (GPU).

The stack: every orthogonal block of a Llama-8B POET-XQ model at ``b = 256`` — the shapes of
``recipes/models/llama-8b.yaml`` as :mod:`poetxq.training.estimate` reads them (32 layers;
q, k, v, o 4096→4096: the recipe has no GQA; gate, up 4096→14336; down 14336→4096); a linear
``m×n`` has ``⌈m/b⌉`` blocks in R and ``⌈n/b⌉`` in P, 11,008 blocks in all, evaluated as one
stack as
:mod:`poetxq.model.blockcache` does once per model forward. Packed entries ~ N(0, (0.2/√b)²), so
``‖Q‖₂ ≈ 0.4``.

For fp32 and bf16 ``packed``: the fused result against the torch reference (max abs
error of ``G`` and of ``d_packed``; relative errors vs a float64 evaluation on a subset of
blocks), then forward (no grad) and forward+backward times of
:func:`quant_kernels.reference.cayley_neumann` under plain autograd,
:func:`quant_kernels.cnp.cayley_neumann` on its torch path (``lean``: the policy's ``fused_cnp``
off) and
:func:`quant_kernels.cnp_hybrid.cayley_neumann_fused` (``fused_hybrid``; median of CUDA-event
timings after warm-up), the ratios, and the extra peak memory of one forward+backward. fp32
matmuls run without tf32 (torch's default) everywhere. About a minute on an H200. ``--sweep``
also times the forward+backward for other tilings (a minute or two more), to choose
:func:`quant_kernels.cnp_hybrid.default_q2_config`; ``--profile`` prints the kernel-level CUDA
times of the fused path.

Usage:  python evals/bench_cnp.py [--out FILE.json] [--block-size 256] [--dtypes fp32,bf16]
                                  [--sweep] [--profile] [--chunk-sweep]
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable

import torch
from _common import (
    cuda_graph_ms,
    cuda_peak_extra_mib,
    cuda_time_ms,
    provenance,
    write_json_atomic,
)

from poetxq.model.orthogonal import num_blocks
from poetxq.training.estimate_terms import projections
from poetxq.training.recipe_files import load_recipe
from quant_kernels import KernelPolicy, cnp, reference

#: the torch path of the CNP entry point on a GPU (its skew blocks still by Triton)
TORCH_CNP = KernelPolicy(fused_cnp=False)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SWEEP_HYBRID = {  # (BM, BK, num_warps, num_stages) of the hybrid's Q² kernel tried by --sweep
    torch.float32: [(32, 32, 4, 2), (32, 16, 4, 3), (64, 32, 8, 2)],
    torch.bfloat16: [(64, 64, 4, 3), (64, 32, 4, 4), (128, 64, 8, 3), (64, 64, 4, 2)],
}
CHECK_BLOCKS = 256  # blocks compared against float64
CHUNK_MIB = (2, 4, 8, 16, 32, 64, 128, 256)  # hybrid chunk sizes tried by --chunk-sweep


def chunk_sweep(packed: torch.Tensor, d_g: torch.Tensor, b: int, reps: int) -> dict:
    """Forward and forward+backward of the fused CNP at each chunk size of
    :data:`CHUNK_MIB` (MiB per ``[chunk, b, b]`` buffer), timed eagerly (CUDA events, host
    launches included) and replayed from a CUDA graph (GPU time, as a captured training step
    runs it), beside the torch reference timed both ways. Small chunks keep a chunk's
    intermediates in L2 at the cost of more launches."""
    from quant_kernels.cnp_hybrid import cnp_backward_hybrid, cnp_forward_hybrid

    leaf = packed.detach().requires_grad_(True)

    def ref_fwd_bwd():
        return torch.autograd.grad(reference.cayley_neumann(leaf, b, 3), leaf, d_g)

    def ref_fwd():
        with torch.no_grad():
            return reference.cayley_neumann(packed, b, 3)

    out: dict = {
        "reference": {
            "fwd_eager": cuda_time_ms(ref_fwd, iters=reps),
            "fwd_graph": cuda_graph_ms(ref_fwd, iters=reps),
            "fwd_bwd_eager": cuda_time_ms(ref_fwd_bwd, iters=reps),
            "fwd_bwd_graph": cuda_graph_ms(ref_fwd_bwd, iters=reps),
        }
    }
    torch.cuda.empty_cache()
    for mib in CHUNK_MIB:
        cb = mib * 2**20

        def fwd(cb=cb):
            return cnp_forward_hybrid(packed, b, chunk_bytes=cb)

        def fwd_bwd(cb=cb):
            return fwd(cb), cnp_backward_hybrid(packed, d_g, b, chunk_bytes=cb)

        row = {
            "blocks_per_chunk": max(1, cb // (b * b * packed.element_size())),
            "fwd_eager": cuda_time_ms(fwd, iters=reps),
            "fwd_graph": cuda_graph_ms(fwd, iters=reps),
            "fwd_bwd_eager": cuda_time_ms(fwd_bwd, iters=reps),
            "fwd_bwd_graph": cuda_graph_ms(fwd_bwd, iters=reps),
        }
        ref = out["reference"]
        row["ratio_ref_over_this"] = {k: ref[k] / row[k] for k in ref}
        out[f"{mib}MiB"] = row
        print(f"chunk {mib:4d} MiB: {row}", flush=True)
        torch.cuda.empty_cache()
    return out


def model_blocks(recipe_spec: str, block_size: int) -> tuple[int, list[dict]]:
    """``(total blocks, per-projection rows)`` of every orthogonal side of ``recipe_spec``'s
    model at block size ``block_size`` (only the recipe's POET target modules)."""
    recipe = load_recipe(recipe_spec)
    layers = recipe.model.num_hidden_layers
    rows, total = [], 0
    for name, m, n in projections(recipe):
        if name not in recipe.poet.target_modules:
            continue
        r_blocks, p_blocks = num_blocks(m, block_size), num_blocks(n, block_size)
        rows.append({"name": name, "out": m, "in": n, "R_blocks": r_blocks, "P_blocks": p_blocks})
        total += layers * (r_blocks + p_blocks)
    return total, rows


def _max_rel(a: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    diff = (a.double() - ref.double()).abs()
    return diff.max().item(), (diff.norm() / ref.double().norm()).item()


def bench_dtype(
    packed: torch.Tensor,
    d_g: torch.Tensor,
    b: int,
    warmup: int,
    reps: int,
    sweep: bool = False,
    profile: bool = False,
) -> dict:
    """Check and time the CNP paths on ``packed [nb, b(b-1)/2]`` with upstream ``d_g`` (with
    ``sweep``, the fused path under each configuration of :data:`SWEEP_HYBRID`; with
    ``profile``, one profiled forward+backward of it)."""
    from quant_kernels.cnp_hybrid import cayley_neumann_fused, default_q2_config

    def fused_hybrid(p: torch.Tensor, b_: int, k: int, config=None) -> torch.Tensor:
        return cayley_neumann_fused(p, b_, k, config=config)

    paths = {
        "reference": reference.cayley_neumann,
        "lean": functools.partial(cnp.cayley_neumann, kernels=TORCH_CNP),
        "fused_hybrid": fused_hybrid,
    }
    leaf = packed.detach().requires_grad_(True)

    def fwd_bwd(fn) -> Callable[[], object]:
        return lambda: torch.autograd.grad(fn(leaf, b, 3), leaf, d_g)

    def fwd(fn) -> Callable[[], object]:
        def run():
            with torch.no_grad():
                return fn(packed, b, 3)

        return run

    res: dict = {"fused_hybrid_config": list(default_q2_config(b, packed.dtype))}
    # correctness at full size: fused vs the torch reference in the same dtype
    g_ref = reference.cayley_neumann(leaf, b, 3)
    (dp_ref,) = torch.autograd.grad(g_ref, leaf, d_g)
    g_ref = g_ref.detach()
    fused_paths = [n for n in paths if n.startswith("fused")]
    for name in fused_paths:
        key = f"check_{name}_vs_reference"
        g_fused = paths[name](leaf, b, 3)
        (dp_fused,) = torch.autograd.grad(g_fused, leaf, d_g)
        fa, fr = _max_rel(g_fused.detach(), g_ref)
        ba, br = _max_rel(dp_fused, dp_ref)
        res[key] = {
            "fwd_max_abs_err": fa, "fwd_rel_err": fr, "bwd_max_abs_err": ba, "bwd_rel_err": br,
        }  # fmt: skip
        del g_fused, dp_fused
    del g_ref, dp_ref
    # both against float64 on a subset: who is closer to the exact polynomial?
    sub = packed[:CHECK_BLOCKS].double().requires_grad_(True)
    g64 = reference.cayley_neumann(sub, b, 3)
    (dp64,) = torch.autograd.grad(g64, sub, d_g[:CHECK_BLOCKS].double())
    check64 = {}
    for name in ("reference", *fused_paths):
        s = packed[:CHECK_BLOCKS].detach().requires_grad_(True)
        g = paths[name](s, b, 3)
        (dp,) = torch.autograd.grad(g, s, d_g[:CHECK_BLOCKS])
        check64[name] = {"fwd_rel_err": _max_rel(g, g64)[1], "bwd_rel_err": _max_rel(dp, dp64)[1]}
    res["check_vs_float64_subset"] = {"blocks": sub.shape[0], **check64}
    del sub, g64, dp64
    torch.cuda.empty_cache()

    ms: dict = {}
    for name, fn in paths.items():
        ms[name] = {
            "fwd": cuda_time_ms(fwd(fn), warmup=warmup, iters=reps),
            "fwd_bwd": cuda_time_ms(fwd_bwd(fn), warmup=warmup, iters=reps),
            "fwd_bwd_peak_extra_mib": cuda_peak_extra_mib(fwd_bwd(fn)),
        }
        torch.cuda.empty_cache()
    res["ms"] = ms
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        res["profile"] = {}
        for name in fused_paths:
            with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
                fwd_bwd(paths[name])()
                torch.cuda.synchronize()
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=12)
            res["profile"][name] = table
            print(f"--- {name}\n{table}", flush=True)
    res["ratio_fused_hybrid_vs_lean"] = {
        k: ms["fused_hybrid"][k] / ms["lean"][k] for k in ("fwd", "fwd_bwd")
    }
    for name in fused_paths:
        res[f"ratio_{name}_vs_reference"] = {
            k: ms[name][k] / ms["reference"][k] for k in ("fwd", "fwd_bwd")
        }
    if sweep:
        res["sweep_fwd_bwd_ms"] = {}
        tried = [(fused_hybrid, cfg, "hybrid_bm{}_bk{}_warps{}_stages{}".format(*cfg))
                 for cfg in SWEEP_HYBRID[packed.dtype]]  # fmt: skip
        for path, cfg, key in tried:
            fn = lambda p, b_, k, path=path, cfg=cfg: path(p, b_, k, config=cfg)  # noqa: E731
            try:
                t = cuda_time_ms(fwd_bwd(fn), warmup=warmup, iters=reps)
            except Exception as exc:  # a configuration that does not compile or fit: report it
                t = f"{type(exc).__name__}: {str(exc)[:200]}"
            res["sweep_fwd_bwd_ms"][key] = t
            torch.cuda.empty_cache()
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", help="results JSON")
    ap.add_argument("--recipe", default="llama-8b:poetxq", help="model whose blocks are stacked")
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--dtypes", default="fp32,bf16", help="comma list of fp32, bf16")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sweep", action="store_true", help="also time other fused configurations")
    ap.add_argument(
        "--profile", action="store_true",
        help="print the kernel-level CUDA times of one forward+backward of each fused path",
    )  # fmt: skip
    ap.add_argument(
        "--chunk-sweep", action="store_true",
        help="also time the fused CNP per chunk size, eager and from a CUDA graph",
    )  # fmt: skip
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_cnp: needs a CUDA GPU (none found); nothing measured", file=sys.stderr)
        return 1
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in DTYPES]
    if bad:
        ap.error(f"unknown dtype(s) {bad}; use {sorted(DTYPES)}")
    torch.backends.cuda.matmul.allow_tf32 = False
    b = args.block_size
    nb, rows = model_blocks(args.recipe, b)
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    packed32 = torch.randn(nb, b * (b - 1) // 2, device="cuda", generator=gen) * (0.2 / b**0.5)
    d_g32 = torch.randn(nb, b, b, device="cuda", generator=gen) / b**0.5
    doc = {
        **provenance(torch.cuda.get_device_name(), argv),
        "recipe": args.recipe, "block_size": b, "num_blocks": nb, "projections": rows,
        "warmup": args.warmup, "reps": args.reps, "allow_tf32": False, "results": {},
    }  # fmt: skip
    print(f"{args.recipe}: {nb} blocks of {b}x{b} on {doc['gpu']}", flush=True)
    for name in dtypes:
        dt = DTYPES[name]
        r = bench_dtype(
            packed32.to(dt), d_g32.to(dt), b, args.warmup, args.reps, args.sweep, args.profile
        )
        doc["results"][name] = r
        ms = r["ms"]
        for k in ("fwd", "fwd_bwd"):
            times = "  ".join(f"{p} {ms[p][k]:7.2f}" for p in ms)
            ratios = "  ".join(
                f"ref/{p} {ms['reference'][k] / ms[p][k]:.2f}x" for p in ms if p != "reference"
            )
            print(f"{name} {k:7s} ms: {times}   {ratios}", flush=True)
        for key in [k for k in r if k.startswith("check_") and "float64" not in k]:
            c = r[key]
            print(
                f"{name} {key}  fwd max abs {c['fwd_max_abs_err']:.2e} (rel "
                f"{c['fwd_rel_err']:.1e})  bwd max abs {c['bwd_max_abs_err']:.2e} (rel "
                f"{c['bwd_rel_err']:.1e})",
                flush=True,
            )
        peaks = "  ".join(f"{p} {ms[p]['fwd_bwd_peak_extra_mib']:.0f}" for p in ms)
        print(f"{name} peak extra MiB (fwd+bwd): {peaks}", flush=True)
        if args.chunk_sweep:
            r["chunk_sweep"] = chunk_sweep(packed32.to(dt), d_g32.to(dt), b, args.reps)
        if "sweep_fwd_bwd_ms" in r:
            print(f"{name} sweep   fused fwd_bwd ms by config: {r['sweep_fwd_bwd_ms']}", flush=True)
    if args.out:
        write_json_atomic(args.out, doc)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
