"""Host time of one Triton launch: Triton's own path against :mod:`quant_kernels._launch`'s
cache of compiled kernels (GPU).

Times, on the host, ``--calls`` calls of three of the project's launchers at small sizes (the
GPU work is microseconds, so the host's issue time is what is measured): the permute-transpose
(:func:`quant_kernels.permute_to_feature_major`), an int8 slab decode and the skew blocks of
:mod:`quant_kernels.skew`, each with ``quant_kernels._launch.DIRECT_LAUNCH`` off and on, and a
``torch.add`` for scale. Checks that both paths give the same output.

Usage:  python evals/bench_launch.py [--calls 2000] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import torch
from _common import provenance, write_json_atomic

from quant_kernels import _launch


def host_us(fn: Callable[[], object], calls: int) -> float:
    """Median over 5 rounds of the host time per call of ``fn`` (µs), the GPU drained before
    each round."""
    rounds = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - t0) / calls * 1e6)
    torch.cuda.synchronize()
    return sorted(rounds)[2]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--out", help="results JSON")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_launch: needs a CUDA GPU (none found); nothing measured", file=sys.stderr)
        return 1
    import quant_kernels
    from quant_kernels.skew import skew_forward
    from quant_kernels.streamed import int8_decoder

    dev = "cuda"
    x = torch.randn(64, 256, device=dev, dtype=torch.bfloat16)
    inv = torch.randperm(256, device=dev)
    cb = torch.randint(-127, 128, (128, 256), device=dev, dtype=torch.int8)
    scb = torch.rand(128, device=dev) + 0.5
    buf = torch.empty(128 * 256, device=dev, dtype=torch.bfloat16)
    dec = int8_decoder(cb, scb)
    packed = torch.randn(4, 64 * 63 // 2, device=dev)
    cases: dict[str, Callable[[], torch.Tensor]] = {
        "permute_to_feature_major": lambda: quant_kernels.permute_to_feature_major(x, inv),
        "int8_slab_decode": lambda: dec(buf, 0, 128, 0, 256),
        "skew_forward": lambda: skew_forward(packed, 64),
    }
    a = torch.randn(64, device=dev)
    res: dict = {"calls": args.calls, "torch_add_us": host_us(lambda: a + a, args.calls)}
    before = _launch.DIRECT_LAUNCH
    try:
        for name, fn in cases.items():
            _launch.DIRECT_LAUNCH = False
            want = fn().clone()
            slow = host_us(fn, args.calls)
            _launch.DIRECT_LAUNCH = True
            fn()  # the first call of a kind goes through Triton and is cached
            got = fn().clone()
            fast = host_us(fn, args.calls)
            res[name] = {
                "triton_us": slow, "cached_us": fast, "ratio": slow / fast,
                "same_output": bool(torch.equal(want, got)),
            }  # fmt: skip
            same = res[name]["same_output"]
            print(f"{name}: Triton {slow:.1f} µs, cached {fast:.1f} µs per launch "
                  f"({slow / fast:.2f}x), same output {same}", flush=True)  # fmt: skip
    finally:
        _launch.DIRECT_LAUNCH = before
    print(f"torch.add: {res['torch_add_us']:.1f} µs", flush=True)
    if args.out:
        doc = {**provenance(torch.cuda.get_device_name(), argv), "results": res}
        write_json_atomic(args.out, doc)
        print(f"wrote {args.out}")
    return 0 if all(r["same_output"] for k, r in res.items() if isinstance(r, dict)) else 1


if __name__ == "__main__":
    sys.exit(main())
