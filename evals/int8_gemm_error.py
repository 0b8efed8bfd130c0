"""Issue 53: the relative error of the int8 × int8 weight GEMMs on real activations, per layer type,
at the start and at the end of a run.

Trains a recipe (default: the embedded tiny one on its own data) with ``poetxq train`` on the
dequant path (``poet.gemm: bf16``), then runs one validation batch forward and backward through
two models: a freshly built one (the start: the recipe's initialisation, seeded by its
``train.seed``) and the run's final ``model.safetensors`` (the end). Every GEMM against an int8
``W0`` is computed on the dequant path, as the model runs, and again on the int8 path
(:mod:`quant_kernels.reference_int8_mma`: the same numbers as the GPU kernels' up to the epilogue's
rounding) from the same operands; the relative Frobenius error ``‖int8 − dequant‖ / ‖dequant‖``
of ``h = z · W'ᵀ`` (forward and the ``mem`` recompute) and of ``dz = dh · W'`` (round-to-nearest
and stochastic rounding of ``dh``) is collected per projection type (``q_proj`` … ``down_proj``):
the mean, the largest, and the number of GEMMs.

    python evals/int8_gemm_error.py --out evals/results/int8_gemm_error_tiny_cpu.json
        [--steps 300] [--set KEY=VALUE ...] [--batch 8]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from evals._common import provenance, write_json_atomic  # noqa: E402
from quant_kernels import reference_int8_mma as int8  # noqa: E402
from quant_kernels.formats import Int8Rowwise  # noqa: E402


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return ((got.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


@contextlib.contextmanager
def recording(model: torch.nn.Module) -> Iterator[dict[str, dict[str, list[float]]]]:
    """While open, every GEMM of an int8 ``W0`` in ``model`` also runs on the int8 path; yields
    ``{projection type: {"h" | "dz_nearest" | "dz_stochastic": [relative errors]}}``."""
    from poetxq.model.layer import POETXLinear

    names = {mod.frozen.weight.data_ptr(): name.rsplit(".", 1)[-1]
             for name, mod in model.named_modules()
             if isinstance(mod, POETXLinear) and mod.bits == 8}  # fmt: skip
    errors: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    rng = torch.Generator().manual_seed(0)

    def forward(fmt: Int8Rowwise, a: torch.Tensor, out: torch.Tensor) -> None:
        kind = names.get(fmt.cb.data_ptr(), "other")
        errors[kind]["h"].append(_rel(int8.int8_mma_matmul(a, fmt.cb, fmt.scb), out))

    def dx(fmt: Int8Rowwise, g: torch.Tensor, out: torch.Tensor) -> None:
        kind = names.get(fmt.cb.data_ptr(), "other")
        errors[kind]["dz_nearest"].append(_rel(int8.int8_mma_matmul_t(g, fmt.cb, fmt.scb), out))
        sr = int8.int8_mma_matmul_t(g, fmt.cb, fmt.scb, stochastic=True, generator=rng)
        errors[kind]["dz_stochastic"].append(_rel(sr, out))

    originals = {n: getattr(Int8Rowwise, n) for n in ("matmul", "matmul_t", "matmul_fm",
                                                       "matmul_t_fm")}  # fmt: skip

    def matmul(self, x, *, kernels=None, **kw):
        out = originals["matmul"](self, x, **({"kernels": kernels} if kernels else {}))
        forward(self, x.detach().reshape(-1, x.shape[-1]), out.detach().reshape(-1, out.shape[-1]))
        return out

    def matmul_t(self, g, *, kernels=None, **kw):
        out = originals["matmul_t"](self, g, **({"kernels": kernels} if kernels else {}))
        dx(self, g.detach().reshape(-1, g.shape[-1]), out.detach().reshape(-1, out.shape[-1]))
        return out

    def matmul_fm(self, zt, *, kernels=None, **kw):
        out = originals["matmul_fm"](self, zt, **({"kernels": kernels} if kernels else {}))
        forward(self, zt.detach().t(), out.detach().t())
        return out

    def matmul_t_fm(self, dht, *, kernels=None, **kw):
        out = originals["matmul_t_fm"](self, dht, **({"kernels": kernels} if kernels else {}))
        dx(self, dht.detach().t(), out.detach().t())
        return out

    patched = {"matmul": matmul, "matmul_t": matmul_t, "matmul_fm": matmul_fm,
               "matmul_t_fm": matmul_t_fm}  # fmt: skip
    try:
        for n, fn in patched.items():
            setattr(Int8Rowwise, n, fn)
        yield errors
    finally:
        for n, fn in originals.items():
            setattr(Int8Rowwise, n, fn)


def measure(model: torch.nn.Module, batch: torch.Tensor) -> dict[str, dict[str, Any]]:
    """One forward and backward of ``model`` on ``batch`` (token ids ``[B, T]``) under
    :func:`recording`; per projection type and quantity: mean and largest relative error and the
    number of GEMMs."""
    model.zero_grad(set_to_none=True)
    with recording(model) as errors:
        model(input_ids=batch, labels=batch).loss.backward()
    model.zero_grad(set_to_none=True)
    return {kind: {q: {"mean": sum(v) / len(v), "max": max(v), "gemms": len(v)}
                   for q, v in sorted(per.items())}
            for kind, per in sorted(errors.items())}  # fmt: skip


def _train(work: Path, steps: int, extra: list[str]) -> Path:
    from poetxq.tools.cli import main

    argv = ["train", "--gemm", "bf16", "--max-steps", str(steps), "--output-dir", str(work),
            "--run-name", "run", "--no-progress", *extra]  # fmt: skip
    if main(argv) != 0:
        raise SystemExit("error: the training run failed (its output is above)")
    return work / "run"


def _fresh(recipe, vocab: int) -> torch.nn.Module:
    from poetxq.model.surgery import build_llama, convert_to_poetx

    torch.manual_seed(recipe.train.seed)
    model = build_llama(recipe.model, vocab)
    convert_to_poetx(model, recipe.poet,
                     generator=torch.Generator().manual_seed(recipe.train.seed))  # fmt: skip
    return model


def _table(doc: dict) -> str:
    lines = [f"{'':10s} {'':6s} {'h':>9s} {'dz (RTN)':>9s} {'dz (SR)':>9s}   mean rel. error"]
    for when in ("start", "end"):
        for kind, row in doc[when].items():
            cells = [row.get(q, {}).get("mean", float("nan"))
                     for q in ("h", "dz_nearest", "dz_stochastic")]  # fmt: skip
            lines.append(f"{kind:10s} {when:6s} " + " ".join(f"{c:9.2e}" for c in cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="results JSON")
    ap.add_argument("--steps", type=int, default=300, help="training steps of the run")
    ap.add_argument("--batch", type=int, default=8, help="validation windows measured")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="recipe override for the run (repeatable)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.steps < 1 or args.batch < 1:
        ap.error("--steps and --batch must be >= 1")
    from poetxq.data import prepare_data
    from poetxq.tools.export import load_run

    extra = [a for kv in args.set for a in ("--set", kv)]
    with tempfile.TemporaryDirectory() as tmp:
        run = load_run(_train(Path(tmp), args.steps, extra))
    recipe = run.recipe
    data = prepare_data(recipe.data, recipe.train.seq_len, progress=False)
    batch = data.val[: args.batch]
    start = _fresh(recipe, data.vocab_size)
    doc = {
        **provenance("cpu", argv),
        "recipe": recipe.name, "steps": args.steps, "tokens_measured": int(batch.numel()),
        "what": "relative Frobenius error of the int8 x int8 path against the dequant path, per "
                "GEMM, on one validation batch (mean / max / count per projection type)",
        "start": measure(start.train(), batch),
        "end": measure(run.model.train(), batch),
    }  # fmt: skip
    print(_table(doc))
    write_json_atomic(args.out, doc)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
