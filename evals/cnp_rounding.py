"""bf16 rounding of alternative Cayley–Neumann factorizations (CPU, seconds).

The hybrid CNP (:mod:`quant_kernels.cnp_hybrid`) stores every intermediate in the input dtype.
Which intermediates it stores decides both how many passes over ``[nb, b, b]`` tensors it makes
and how much bf16 rounding it adds. This script emulates each candidate in float64 with every
stored intermediate rounded to bf16 and every product accumulated in fp32 (as the GPU does), and
prints its relative error against the exact float64 result:

forward (``S = Q²``):
    ``hybrid``   ``G = G₀ + S·B``, ``G₀ = I + 2Q``, ``B = 2I + 2Q + S`` (the default: 9.5 passes)
    ``A·Z``      ``G = A·Z``, ``A = I + 2Q + S``, ``Z = I + S`` (a plain product: 7.5 passes)
    ``A+A·S``    ``G = A + A·S``
backward (``M = ∂L/∂G``; the packed gradient is the strict upper triangle of ``Y − Yᵀ``):
    ``hybrid``   ``N = S·M``, ``E' = M·(2I − 2Q + S)``, ``D = (E' + N) + (E' + N)ᵀ``,
                 ``Y = 2M + 2N − D·Q`` with ``2M`` added in the fold (20 passes)
    ``A/Z``      ``gA = M·Z``, ``gZ = Aᵀ·M``, ``D = F + Fᵀ`` (``F = gA + gZ``),
                 ``Y = 2gA − D·Q`` (19 passes: the fold reads ``Y`` only)

The cheaper factorizations round ``O(1)`` diagonals (``1 + s``) or ``M``-sized terms to bf16
before the last product; the default keeps them out of every stored intermediate (``G₀`` has an
exact unit diagonal, ``N`` and ``S·B`` are small) and adds them in fp32.

Usage:  python evals/cnp_rounding.py [--block-size 256] [--blocks 16] [--seed 0]
"""

from __future__ import annotations

import argparse
import sys

import torch


def _bf(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16)


def _mm(a: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Product of two stored (bf16) operands, accumulated in fp32."""
    return a.float() @ c.float()


def _fold(y: torch.Tensor) -> torch.Tensor:
    return torch.triu(y - y.transpose(1, 2), 1)


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref).norm() / ref.norm()).item()


def rounding_errors(b: int, nb: int, seed: int) -> dict[str, dict[str, float]]:
    """Relative errors (Frobenius) of each factorization's ``G`` and packed gradient against
    float64, for ``nb`` blocks of ``b × b`` with packed entries ~ N(0, (0.2/√b)²) and an
    upstream gradient ~ N(0, 1/b)."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.triu(torch.randn(nb, b, b, generator=gen, dtype=torch.float64) * (0.2 / b**0.5), 1)
    m = torch.randn(nb, b, b, generator=gen, dtype=torch.float64) / b**0.5
    eye = torch.eye(b, dtype=torch.float64)
    leaf = u.clone().requires_grad_(True)
    q = leaf - leaf.transpose(1, 2)
    s = q @ q
    g64 = eye + 2 * q + 2 * s + 2 * q @ s + s @ s
    (grad,) = torch.autograd.grad((g64 * m).sum(), leaf)
    g64, d64 = g64.detach(), torch.triu(grad, 1)

    qb = _bf(u - u.transpose(1, 2))
    sb = _bf(_mm(qb, qb))
    q64, s64, mb = qb.double(), sb.double(), _bf(m)
    fwd = {
        "hybrid": _bf(_bf(eye + 2 * q64).float() + _mm(sb, _bf(2 * eye + 2 * q64 + s64))),
        "A·Z": _bf(_mm(_bf(eye + 2 * q64 + s64), _bf(eye + s64))),
        "A+A·S": _bf(_bf(eye + 2 * q64 + s64).float() + _mm(_bf(eye + 2 * q64 + s64), sb)),
    }
    n = _bf(_mm(sb, mb))
    e = _bf(_mm(mb, _bf(2 * eye - 2 * q64 + s64)))
    x = e.float() + n.float()
    d = _bf(x + x.transpose(1, 2))
    y = _bf(2 * n.float() - _mm(d, qb))
    ga = _bf(_mm(mb, _bf(eye + s64)))
    gz = _bf(_mm(_bf(eye - 2 * q64 + s64), mb))
    f = ga.float() + gz.float()
    d2 = _bf(f + f.transpose(1, 2))
    bwd = {
        "hybrid": _fold(y.double() + 2 * mb.double()),
        "A/Z": _fold(_bf(2 * ga.float() - _mm(d2, qb)).double()),
    }
    return {
        "forward": {k: _rel(v, g64) for k, v in fwd.items()},
        "backward": {k: _rel(v, d64) for k, v in bwd.items()},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.block_size < 2 or args.blocks < 1:
        ap.error("--block-size must be >= 2 and --blocks >= 1")
    errs = rounding_errors(args.block_size, args.blocks, args.seed)
    for part, rows in errs.items():
        print(f"{part}: " + "  ".join(f"{k} {v:.2e}" for k, v in rows.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
