"""Causal attention forward+backward: each SDPA backend, eagerly and replayed from a CUDA graph.

Why: the Llama-1B profiles of POET-XQ in a CUDA graph (``evals/results/profiles/
profile_1b_1024_poetxq_fast_graph_5ee40a3.txt``) showed torch's cuDNN attention taking 2.1× the
GPU time per step of the eager AdamW step at the same shapes. This script times
``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` + backward at the Llama shapes
(``[B, H, S, hd]`` views of ``[B, S, H·hd]`` projection outputs, as transformers builds them, or
contiguous ``[B, H, S, hd]`` q and k) for each backend, eager and from a graph, and writes the GPU
time per call (CUDA events) to JSON. Its answer (``evals/results/bench_attention_h200.json``): the
graph and the layout change nothing; the cause was the mask transformers builds while a graph is
captured (:mod:`poetxq.model.attention`).

Usage (GPU host, ~1 min):
    python evals/bench_attention.py --out $OUT/bench_attention_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# (name, batch, seq, heads, head_dim): Llama-1B at 8,192 tokens (seq 256 / 1024), Llama-13B
SHAPES = [("llama-1b_256", 32, 256, 32, 64), ("llama-1b_1024", 8, 1024, 32, 64),
          ("llama-13b_2048", 1, 2048, 40, 128)]  # fmt: skip
BACKENDS = {
    "default": None,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}


def _inputs(b: int, s: int, h: int, hd: int, layout: str) -> list[torch.Tensor]:
    """q, k, v ``[b, h, s, hd]`` bf16 leaves: ``bshd`` views (transformers' layout) or
    contiguous ``bhsd`` q and k (v stays a view)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    out = []
    for i in range(3):
        t = torch.randn(b, s, h * hd, device="cuda", dtype=torch.bfloat16, generator=g)
        t = t.view(b, s, h, hd).transpose(1, 2)
        if layout == "bhsd" and i < 2:
            t = t.contiguous()
        out.append(t.detach().requires_grad_(True))
    return out


def _step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dy: torch.Tensor) -> None:
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    y.backward(dy)


def _time(fn, iters: int) -> float:
    """GPU ms per call of ``fn`` (CUDA events around ``iters`` calls)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def bench(shape: tuple, backend: str, layout: str, iters: int) -> dict:
    """Eager and graph ms per forward+backward; an ``error`` entry where a backend refuses."""
    _, b, s, h, hd = shape
    q, k, v = _inputs(b, s, h, hd, layout)
    dy = torch.randn(b, h, s, hd, device="cuda", dtype=torch.bfloat16)
    ctx = (lambda: sdpa_kernel([BACKENDS[backend]])) if BACKENDS[backend] else torch.enable_grad
    row: dict = {}
    try:
        with ctx():
            for _ in range(3):
                _step(q, k, v, dy)
            row["eager_ms"] = _time(lambda: _step(q, k, v, dy), iters)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    _step(q, k, v, dy)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                _step(q, k, v, dy)
            graph.replay()
            row["graph_ms"] = _time(graph.replay, iters)
    except RuntimeError as exc:
        row["error"] = str(exc).strip().splitlines()[0][:200]
    flops = 4 * b * h * s * s * hd / 2 * 3.5  # causal: half; forward 1 + backward 2.5
    for key in ("eager_ms", "graph_ms"):
        if key in row:
            row[key.replace("_ms", "_tflops")] = flops / row[key] / 1e9
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_attention: needs a CUDA GPU", file=sys.stderr)
        return 2
    results = []
    for shape in SHAPES:
        for layout in ("bshd", "bhsd"):
            for backend in BACKENDS:
                row = {"shape": shape[0], "layout": layout, "backend": backend,
                       **bench(shape, backend, layout, args.iters)}  # fmt: skip
                print(json.dumps(row), flush=True)
                results.append(row)
    commit = (
        os.environ.get("POETXQ_COMMIT")
        or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
    )
    doc = {
        "what": "causal SDPA forward+backward, bf16, GPU ms per call, eager vs CUDA graph",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "commit": commit,
        "command": "python evals/bench_attention.py " + " ".join(sys.argv[1:]),
        "results": results,
    }
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
