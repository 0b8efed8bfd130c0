"""Inputs and float64 oracles shared by the CNP kernel tests (test_cnp_triton, test_cnp_hybrid)."""

import torch

from quant_kernels.reference import cayley_neumann


def packed_blocks(nb: int, b: int, gen: torch.Generator, scale: float = 0.3) -> torch.Tensor:
    """``[nb, b(b-1)/2]`` fp32 skew parameters with entries ~ N(0, (scale/√b)²)."""
    return torch.randn(nb, b * (b - 1) // 2, generator=gen) * (scale / b**0.5)


def reference_grad(packed: torch.Tensor, d_g: torch.Tensor, b: int) -> torch.Tensor:
    """Gradient of ``⟨d_g, reference CNP(packed)⟩`` (k = 3) by torch autograd, in
    ``packed.dtype``."""
    leaf = packed.detach().requires_grad_(True)
    (grad,) = torch.autograd.grad(cayley_neumann(leaf, b, 3), leaf, d_g)
    return grad


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """``‖a − ref‖ / ‖ref‖`` in float64 (``a`` moved to the CPU)."""
    return ((a.double().cpu() - ref).norm() / ref.norm()).item()


def run_and_check(fwd, bwd, nb: int, b: int, dtype: torch.dtype, gen: torch.Generator,
                  device: str, tol: float, config=None):  # fmt: skip
    """Run ``fwd(packed, b)`` and ``bwd(packed, d_g, b)`` (a CNP layout's forward and backward)
    on random ``dtype`` inputs and check them against float64 on the same rounded inputs: max
    abs error ≤ ``tol`` in fp32, relative Frobenius error ≤ ``tol`` in 16-bit. Returns
    ``(packed, d_g, G, d_packed)`` for further checks."""
    packed = packed_blocks(nb, b, gen).to(dtype)
    d_g = torch.randn(nb, b, b, generator=gen).to(dtype)
    kw = {} if config is None else {"config": config}
    g = fwd(packed.to(device), b, **kw)
    d_packed = bwd(packed.to(device), d_g.to(device), b, **kw)
    assert g.shape == (nb, b, b) and d_packed.shape == packed.shape
    assert g.dtype == d_packed.dtype == dtype
    g64 = cayley_neumann(packed.double(), b, 3)
    grad64 = reference_grad(packed.double(), d_g.double(), b)
    if dtype == torch.float32:
        assert (g.double().cpu() - g64).abs().max().item() <= tol
        assert (d_packed.double().cpu() - grad64).abs().max().item() <= tol
    else:
        assert rel_err(g, g64) <= tol and rel_err(d_packed, grad64) <= tol
    return packed, d_g, g, d_packed
