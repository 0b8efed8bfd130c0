"""All GPU checks and benchmarks of the project in one run; writes JSON to ``--out-dir``.

1. Correctness at real sizes: POET-XQ (int8, NF4) and POET-X (unquantized) layers, mem and fast
   variants, at Llama-8B/350M MLP shapes; output and input gradient against a dense float64
   ``x @ (R·W0·P)ᵀ`` built on the GPU from the same blocks and permutations, in fp32 and under
   bf16 autocast; in fp32 the block gradients against the torch path.
2. The int8 / NF4 weight GEMMs (fused, slab-streamed, torch, bnb) vs bf16 cuBLAS at the 8B/13B
   MLP shapes (``evals/bench_dequant_matmul.py``); ``int8_gemm``: the int8 × int8 GEMMs
   (activation quantization included) against bf16 cuBLAS and the dequant path, with their
   real-size check (``evals/bench_int8_gemm.py``).
3. Layer forward+backward time at the Llama-8B MLP shapes, input [1, 2048, d], bf16, against
   ``nn.Linear`` (cuBLAS), ratios measured side by side; peak extra memory per layer (int8
   ``W0`` also on the int8 tensor cores: ``*_int8_mma``).
4. Profile: the top CUDA kernels of one POET-XQ int8 mem layer forward+backward (4096 → 14336).
   ``overhead``: where that layer's wall time goes — host time to issue one forward+backward,
   GPU time (the same forward+backward replayed from a CUDA graph), the eager wall time, peak
   extra memory, the top host-side ops, and the host cost of one launch (torch op, cuBLAS,
   Triton kernel); with a local copy of the official POET code (``--official``,
   ``evals/official_poet.py``) its POET-XQ / POET-X layers are timed in the same rows.
5. The kernel unit tests (``tests/quant_kernels``) on CUDA at their own sizes, compiled for the
   GPU instead of the CPU interpreter: pytest's summary line goes into the JSON.
   ``training_tests``: the same for the tests of the training paths a GPU changes
   (:data:`TRAINING_TEST_FILES`: CUDA graphs, the optimizer inside them, the memory options, the
   flat 8-bit optimizer); their GPU-only cases run only here.
6. End-to-end: the embedded default recipe (int8, bits 16, frozen-orthogonal control) trained on
   the GPU in bf16 with no flags (``evals/vertical_slice.py``; ``--skip-train`` leaves it out).

Usage (on the GPU host):  python evals/gpu_suite.py --out-dir $OUT [--parts dequant,layer]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import official_poet
import torch
from _common import cuda_graph_ms, cuda_peak_extra_mib, cuda_time_ms, git_commit

from poetxq.model.layer import POETXLinear
from quant_kernels.policy import AUTO, KernelPolicy

RUNS = ["int8", "bits16", "control", "nf4"]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def _dense_side(side, dtype=torch.float64) -> torch.Tensor:
    return side.dense(dtype)


def _random_layer(
    n: int, m: int, b: int, bits: int, gen: torch.Generator, variant: str, dev: str,
    kernels: KernelPolicy = AUTO,
) -> tuple[POETXLinear, torch.Tensor]:  # fmt: skip
    """A POET-X(Q) layer with small random ``Q`` on both sides, and its dense float64
    ``R·W0·P`` ``[m, n]`` (``stored_w0`` undoes the store's own layout: 4-bit stores keep the
    columns in input order, int8 permutes both sides)."""
    layer = POETXLinear(n, m, block_size=b, bits=bits, variant=variant, generator=gen, device=dev,
                        kernels=kernels)  # fmt: skip
    with torch.no_grad():
        for side in (layer.P, layer.R):
            side.Q.copy_(0.01 * torch.randn(side.Q.shape, generator=gen).to(dev))
    return layer, _dense_side(layer.R) @ layer.stored_w0(torch.float64) @ _dense_side(layer.P)


def correctness(
    n: int,
    m: int,
    b: int,
    bits: int,
    gen: torch.Generator,
    dev: str = "cuda",
    tokens: int = 2048,
    variant: str = "mem",
    kernels: KernelPolicy = AUTO,
) -> dict:
    """Output and dX of a POET-X(Q) layer under ``kernels`` vs a dense float64
    ``x @ (R·W0·P)ᵀ``; in fp32 also its block gradients (``Q_P``, ``Q_R``) vs the same layer on
    the torch path (``KernelPolicy(triton=False)``: reference ops, no Triton)."""
    layer, w_dense = _random_layer(n, m, b, bits, gen, variant, dev, kernels)
    x = torch.randn(tokens, n, device=dev)
    dy = torch.randn(tokens, m, device=dev)
    y_ref = x.double() @ w_dense.t()
    dx_ref = dy.double() @ w_dense
    out: dict = {"shape": f"{n}->{m}", "b": b, "bits": bits, "variant": variant}
    # (key, input dtype, autocast): fp32; bf16 input under autocast; fp32 input under autocast,
    # as the norm outputs arrive in training (KernelPolicy.fused_input_cast's case)
    for key, dtype, amp in (("fp32", torch.float32, False),
                            ("bf16_autocast", torch.bfloat16, True),
                            ("bf16_autocast_fp32_input", torch.float32, True)):  # fmt: skip
        xx = x.detach().to(dtype).requires_grad_()
        layer.zero_grad(set_to_none=True)
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=amp):
            y = layer(xx)
        y.backward(dy.to(y.dtype))
        out[key] = {"y_rel_err": _rel(y, y_ref), "dx_rel_err": _rel(xx.grad, dx_ref)}
        if not amp:
            grads = [layer.P.Q.grad.clone(), layer.R.Q.grad.clone()]
            layer.zero_grad(set_to_none=True)
            layer.use_kernels(KernelPolicy(triton=False))
            layer(x.detach().clone().requires_grad_()).backward(dy)
            layer.use_kernels(kernels)
            for name, got, side in (("dq_p", grads[0], layer.P), ("dq_r", grads[1], layer.R)):
                out[key][f"{name}_rel_err_vs_torch_path"] = _rel(got, side.Q.grad)
    del w_dense
    if dev == "cuda":
        torch.cuda.empty_cache()
    return out


def swiglu_correctness(
    f: int, d: int, b: int, bits: int, gen: torch.Generator, variant: str, dev: str = "cuda",
    tokens: int = 2048, kernels: KernelPolicy = AUTO,
) -> dict:  # fmt: skip
    """A down projection under SwiGLU (``POETXLinear.forward_swiglu``, the path of
    ``POETXSwiGLUMLP``) in fp32 under ``kernels``: output and the gradients of ``gate`` and
    ``up`` against float64 autograd of ``(SiLU(gate) · up) @ (R·W0·P)ᵀ``."""
    layer, w_dense = _random_layer(f, d, b, bits, gen, variant, dev, kernels)
    gate, up = (torch.randn(tokens, f, device=dev) for _ in range(2))
    dy = torch.randn(tokens, d, device=dev)
    g64, u64 = (t.double().requires_grad_() for t in (gate, up))
    y_ref = (torch.nn.functional.silu(g64) * u64) @ w_dense.t()
    y_ref.backward(dy.double())
    g32, u32 = (t.clone().requires_grad_() for t in (gate, up))
    y = layer.forward_swiglu(g32, u32)
    y.backward(dy)
    out = {"shape": f"{f}->{d}", "b": b, "bits": bits, "variant": variant,
           "y_rel_err": _rel(y, y_ref), "d_gate_rel_err": _rel(g32.grad, g64.grad),
           "d_up_rel_err": _rel(u32.grad, u64.grad)}  # fmt: skip
    del w_dense
    torch.cuda.empty_cache()
    return out


def layer_speed(n: int, m: int, b: int) -> dict:
    dev = "cuda"
    x = torch.randn(1, 2048, n, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(1, 2048, m, device=dev, dtype=torch.bfloat16)
    res: dict = {"shape": f"{n}->{m}", "b": b}
    lin = torch.nn.Linear(n, m, bias=False, device=dev, dtype=torch.bfloat16)

    def run(mod):
        def fn():
            x.grad = None
            mod(x).backward(dy)

        return fn

    base_ms = cuda_time_ms(run(lin))
    res["nn_linear_ms"] = base_ms
    res["nn_linear_peak_extra_mib"] = cuda_peak_extra_mib(run(lin))
    label = {8: "q_int8", 4: "q_nf4", 16: "_bf16"}

    def time_layer(name: str, bits: int, variant: str, kernels: KernelPolicy = AUTO) -> None:
        try:
            layer = POETXLinear(n, m, block_size=b, bits=bits, variant=variant, device=dev,
                                dtype=torch.bfloat16, kernels=kernels)  # fmt: skip
            fn = run(layer)
            ms = cuda_time_ms(fn)
            res[name] = {"ms": ms, "ratio_vs_nn_linear": ms / base_ms,
                         "peak_extra_mib": cuda_peak_extra_mib(fn)}  # fmt: skip
            del layer, fn
        except Exception as exc:  # record and go on: one broken variant must not hide the rest
            res[name] = {"error": f"{type(exc).__name__}: {exc}"}
        torch.cuda.empty_cache()

    for bits in (8, 4, 16):
        for variant in ("fast", "mem"):
            time_layer(f"poetx{label[bits]}_{variant}", bits, variant)
    # the mem variants again on the other paths, side by side with the default path above
    for suffix, kernels in OTHER_LAYER_PATHS:
        for bits in (8, 16):
            time_layer(f"poetx{label[bits]}_mem_{suffix}", bits, "mem", kernels)
    for variant in ("fast", "mem"):  # the int8 W0 on the int8 tensor cores (poet.gemm: int8)
        time_layer(f"poetxq_int8_{variant}_int8_mma", 8, variant, INT8_MMA)
    return res


def _host_issue_ms(fn: Callable[[], object], iters: int = 30) -> float:
    """Median host time to *issue* ``fn()`` (no synchronisation inside the timed region), ms."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    times.sort()
    return times[len(times) // 2]


def _launch_us() -> dict:
    """Host microseconds per launch of a tiny torch op, cuBLAS GEMM, ``bmm`` and Triton kernel."""
    from quant_kernels.streamed import int8_decoder

    dev = "cuda"
    a = torch.randn(64, 64, device=dev, dtype=torch.bfloat16)
    cb = torch.randint(-127, 128, (64, 64), device=dev, dtype=torch.int8)
    scb = torch.rand(64, device=dev) + 1
    buf = torch.empty(64 * 64, device=dev, dtype=torch.bfloat16)
    dec = int8_decoder(cb, scb)
    ops = {
        "torch_add": lambda: a + a,
        "torch_mm": lambda: a @ a,
        "torch_bmm": lambda: torch.bmm(a.view(4, 16, 64), a.view(4, 64, 16)),
        "index_select": lambda: a.index_select(1, torch.arange(64, device=dev)),
        "triton_int8_slab": lambda: dec(buf, 0, 64, 0, 64),
    }
    out = {}
    for name, op in ops.items():
        for _ in range(20):
            op()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(500):
            op()
        out[name] = (time.perf_counter() - t0) / 500 * 1e6
        torch.cuda.synchronize()
    return out


def layer_overhead(n: int, m: int, b: int, poet: ModuleType | None = None) -> dict:
    """Wall, host-issue and GPU (graph replay) time and peak extra memory of a layer
    forward+backward at input [1, 2048, n] bf16 for ``nn.Linear``, the POET-X(Q) variants and,
    given the official code's ``poet_torch`` module (:func:`official_poet.try_load`), its
    layers; the top host-side ops of the int8 mem layer."""
    from torch.profiler import ProfilerActivity, profile

    dev = "cuda"
    x = torch.randn(1, 2048, n, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(1, 2048, m, device=dev, dtype=torch.bfloat16)

    def run(mod):
        def fn():
            x.grad = None
            mod(x).backward(dy)

        return fn

    res: dict = {"shape": f"{n}->{m}", "b": b, "launch_host_us": _launch_us()}
    lin = torch.nn.Linear(n, m, bias=False, device=dev, dtype=torch.bfloat16)
    rows = [("nn_linear", lin, None)]
    for bits, variant in ((8, "mem"), (8, "fast"), (16, "mem"), (16, "fast"), (4, "mem")):
        layer = POETXLinear(n, m, block_size=b, bits=bits, variant=variant, device=dev,
                            dtype=torch.bfloat16)  # fmt: skip
        rows.append((f"bits{bits}_{variant}", layer, None))
        if variant == "mem" and bits == 8:  # the default path against its alternatives
            for suffix, kernels in OTHER_LAYER_PATHS:
                rows.append((f"bits8_mem_{suffix}", layer, kernels))
        if variant == "fast":  # the autograd fast path beside the default feature-major one
            rows.append((f"bits{bits}_fast_autograd", layer, FAST_AUTOGRAD))
    if poet is not None:  # the official code's layers side by side (evals/official_poet.py)
        for kind in official_poet.LAYER_KINDS:
            try:
                mod = official_poet.official_layer(poet, kind, n, m, b, device=dev)
            except Exception as exc:
                res[f"official_{kind}"] = {"error": f"{type(exc).__name__}: {exc}"}
                continue
            rows.append((f"official_{kind}", mod, None))
    base = None
    for name, mod, kernels in rows:
        ctx = _kernels(mod, kernels) if kernels else contextlib.nullcontext()
        try:
            with ctx:
                fn = run(mod)
                row = {"eager_ms": cuda_time_ms(fn), "host_issue_ms": _host_issue_ms(fn),
                       "peak_extra_mib": cuda_peak_extra_mib(fn)}  # fmt: skip
                try:  # the GPU time alone: the same call replayed from a CUDA graph
                    row["gpu_ms_graph"] = cuda_graph_ms(fn)
                except Exception as exc:  # (code that cannot be captured keeps its eager rows)
                    row["graph_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        except Exception as exc:  # record and go on
            row = {"error": f"{type(exc).__name__}: {exc}"}
        if name == "nn_linear":
            base = row
        elif base is not None and "error" not in row:
            row["eager_ratio"] = row["eager_ms"] / base["eager_ms"]
            if "gpu_ms_graph" in row and "gpu_ms_graph" in base:
                row["gpu_ratio"] = row["gpu_ms_graph"] / base["gpu_ms_graph"]
        res[name] = row
        torch.cuda.empty_cache()
    layer = rows[1][1]
    fn = run(layer)
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    res["host_profile_int8_mem"] = prof.key_averages().table(
        sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60
    )
    return res


#: the layer's paths other than the default, as (row suffix, policy): the input cast as a
#: separate pass (the default fuses it into the first permutation; only the correctness part's
#: fp32 input under bf16 autocast has a cast to fuse, the timed parts feed bf16 inputs, where this
#: row equals the default path), the row-major path (the feature-major one switched off) and two
#: weight decodes per int8 backward (the one-decode one switched off)
OTHER_LAYER_PATHS = (
    ("separate_cast", KernelPolicy(fused_input_cast=False)),
    ("row_major", KernelPolicy(feature_major=False)),
    ("two_decodes", KernelPolicy(one_decode_backward=False)),
)
#: the int8 x int8 weight GEMMs (``poet.gemm: int8``): their error is the activations'
#: quantization (``quant_kernels.reference_int8_mma.int8_mma_error_bound``), so their
#: correctness rows are a record, not held to the dequant rows' tolerance
INT8_MMA = KernelPolicy(w0_gemm="int8")
#: the ``fast`` variant's autograd path (its feature-major one switched off)
FAST_AUTOGRAD = KernelPolicy(fast_feature_major=False)


@contextlib.contextmanager
def _kernels(layer: torch.nn.Module, kernels: KernelPolicy) -> Iterator[None]:
    """Run ``layer`` (a :class:`POETXLinear`) under ``kernels`` for the block, then under its
    own policy again."""
    before = layer.kernels
    layer.use_kernels(kernels)
    try:
        yield
    finally:
        layer.use_kernels(before)


def layer_profile(n: int, m: int, b: int, bits: int = 8, variant: str = "mem") -> str:
    """Top CUDA kernels of one POET-XQ layer forward+backward (input [1, 2048, n], bf16)."""
    from torch.profiler import ProfilerActivity, profile

    dev = "cuda"
    layer = POETXLinear(n, m, block_size=b, bits=bits, variant=variant, device=dev,
                        dtype=torch.bfloat16)  # fmt: skip
    x = torch.randn(1, 2048, n, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(1, 2048, m, device=dev, dtype=torch.bfloat16)
    for _ in range(3):
        layer(x).backward(dy)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            layer(x).backward(dy)
        torch.cuda.synchronize()
    return prof.key_averages().table(
        sort_by="cuda_time_total", row_limit=18, max_name_column_width=70
    )


PARTS = ("correctness", "kernel_tests", "training_tests", "dequant", "int8_gemm", "layer",
         "profile", "overhead", "train")  # fmt: skip
#: the training tests with GPU-only cases (``training_tests``)
TRAINING_TEST_FILES = (
    "tests/test_graph_optim.py",
    "tests/test_cudagraph.py",
    "tests/test_lowmem.py",
    "tests/test_flat.py",
    "tests/test_optim.py",
)


def run_pytest(repo: Path, paths: list[str], log: Path) -> dict:
    """``pytest -q`` over ``paths`` (relative to ``repo``), its output written to ``log`` as it
    runs (what a device call's time limit cuts short is still there): return code, summary
    line, the ``FAILED`` lines."""
    cmd = [sys.executable, "-m", "pytest", "-q", "--tb=short", "-p", "no:cacheprovider",
           "-o", "addopts=", *(str(repo / p) for p in paths)]  # fmt: skip
    with log.open("w") as f:
        f.write(f"# {' '.join(cmd)}\n")
        f.flush()
        res = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=False, cwd=repo)
    lines = log.read_text().strip().splitlines()
    failed = [ln for ln in lines if ln.startswith("FAILED")]
    return {"returncode": res.returncode, "summary": lines[-1:], "failures": failed,
            "log": log.name}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--skip-train", action="store_true")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {PARTS}")
    ap.add_argument("--official", default=None, help="overhead part: folder holding the official "
                    "poet_torch/ to time beside ours (default $POETXQ_OFFICIAL_DIR or .official/; "
                    "left out when absent)")  # fmt: skip
    args = ap.parse_args(argv)
    parts = set(args.parts.split(","))
    if args.skip_train:
        parts.discard("train")
    if not parts <= set(PARTS):
        ap.error(f"--parts: unknown {sorted(parts - set(PARTS))}; choose from {PARTS}")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 1
    report: dict = {
        "date": time.strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "commit": git_commit(),
        "command": "python evals/gpu_suite.py " + " ".join(argv or sys.argv[1:]),
    }
    gen = torch.Generator().manual_seed(0)
    path = out / "gpu_suite.json"
    if "correctness" in parts:
        report["correctness"] = []
        for n, m, bits in ((4096, 14336, 8), (14336, 4096, 16), (2736, 1024, 8), (4096, 14336, 4)):
            try:  # (2736 -> 1024: the 350M MLP, ragged: 2736 = 10x256 + 176)
                report["correctness"].append(correctness(n, m, 256, bits, gen))
            except Exception as exc:
                report["correctness"].append({"shape": f"{n}->{m}", "bits": bits,
                                              "error": repr(exc)})  # fmt: skip
        for n, m, bits in ((4096, 14336, 8), (14336, 4096, 16), (2736, 1024, 8)):
            try:  # the fast variant (feature-major where the sides are not ragged)
                row = correctness(n, m, 256, bits, gen, variant="fast")
            except Exception as exc:
                row = {"shape": f"{n}->{m}", "bits": bits, "variant": "fast", "error": repr(exc)}
            report["correctness"].append(row)
        for variant, lean in (("mem", False), ("fast", False), ("fast", True)):
            kernels = KernelPolicy(lean_fast_swiglu=lean)
            try:  # the SwiGLU down projection (the lean fast one with the switch)
                row = swiglu_correctness(14336, 4096, 256, 8, gen, variant, kernels=kernels)
            except Exception as exc:
                row = {"shape": "14336->4096", "variant": variant, "error": repr(exc)}
            report["correctness"].append({**row, "swiglu": True, "lean": lean})
        for suffix, kernels in OTHER_LAYER_PATHS:  # the other layer paths at real sizes
            for n, m, bits in ((4096, 14336, 8), (2736, 1024, 8), (14336, 4096, 16)):
                try:
                    row = correctness(n, m, 256, bits, gen, kernels=kernels)
                except Exception as exc:
                    row = {"shape": f"{n}->{m}", "bits": bits, "error": repr(exc)}
                report["correctness"].append({**row, "path": suffix})
        for variant in ("mem", "fast"):  # int8 x int8 GEMMs: recorded beside the dequant rows
            for n, m in ((4096, 14336), (14336, 4096), (2736, 1024)):
                try:
                    row = correctness(n, m, 256, 8, gen, variant=variant, kernels=INT8_MMA)
                except Exception as exc:
                    row = {"shape": f"{n}->{m}", "bits": 8, "variant": variant,
                           "error": repr(exc)}  # fmt: skip
                report["correctness"].append({**row, "path": "int8_mma"})
        print(json.dumps(report["correctness"], indent=1), flush=True)
        path.write_text(json.dumps(report, indent=2) + "\n")
    repo = Path(__file__).resolve().parents[1]
    for part, paths in (("kernel_tests", ["tests/quant_kernels"]),
                        ("training_tests", list(TRAINING_TEST_FILES))):  # fmt: skip
        if part in parts:
            report[part] = run_pytest(repo, paths, out / f"{part}.log")
            print(json.dumps(report[part], indent=1), flush=True)
            path.write_text(json.dumps(report, indent=2) + "\n")
    if "dequant" in parts:
        import bench_dequant_matmul

        report["dequant_matmul"] = bench_dequant_matmul.run_all()
        path.write_text(json.dumps(report, indent=2) + "\n")
    if "int8_gemm" in parts:
        import bench_int8_gemm

        report["int8_gemm"] = bench_int8_gemm.run_all()
        path.write_text(json.dumps(report, indent=2) + "\n")
    if "layer" in parts:
        report["layer_speed_8b_mlp_bf16"] = [
            layer_speed(4096, 14336, 256),
            layer_speed(14336, 4096, 256),
        ]
        print(json.dumps(report["layer_speed_8b_mlp_bf16"], indent=1), flush=True)
        path.write_text(json.dumps(report, indent=2) + "\n")
    if "profile" in parts:
        report["layer_profile_int8_mem_4096_14336"] = table = layer_profile(4096, 14336, 256)
        print(table, flush=True)
        path.write_text(json.dumps(report, indent=2) + "\n")
    if "overhead" in parts:
        poet = official_poet.try_load(args.official)
        report["official_code"] = poet and str(official_poet.official_dir(args.official))
        report["layer_overhead_8b_mlp_bf16"] = rows = [
            layer_overhead(4096, 14336, 256, poet),
            layer_overhead(14336, 4096, 256, poet),
        ]
        report["layer_profile_int8_mem_4096_14336"] = table = layer_profile(4096, 14336, 256)
        print(table)
        for row in rows:
            print(row["host_profile_int8_mem"])
        print(json.dumps([{k: v for k, v in r.items() if k != "host_profile_int8_mem"}
                          for r in rows], indent=1), flush=True)  # fmt: skip
        path.write_text(json.dumps(report, indent=2) + "\n")
    if "train" in parts:
        here = Path(__file__).resolve().parent
        cmd = [sys.executable, str(here / "vertical_slice.py"), "--out",
               str(out / "vertical_slice_gpu.json"), "--runs", *RUNS]  # fmt: skip
        return subprocess.run(cmd, check=False).returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
