"""POET-X(Q) layer vs a dense float64 reference ``x @ (R·W0·P)ᵀ``."""

import pytest
import torch

from poetxq.model.layer import POETXLinear, normalized_gaussian

SHAPES = [  # (n, m, b): divisible, ragged in, ragged out, both ragged, b == dim
    (24, 40, 8),
    (20, 16, 8),
    (16, 13, 4),
    (19, 23, 6),
    (12, 12, 12),
]


def _random_q(layer: POETXLinear, scale: float, gen: torch.Generator) -> None:
    with torch.no_grad():
        for side in (layer.P, layer.R):
            side.Q.copy_(torch.randn(side.Q.shape, generator=gen, dtype=side.Q.dtype) * scale)


def _dense_reference(layer: POETXLinear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """R, W0, P assembled densely in float64 from the layer's blocks and permutations."""
    w_stored = layer.frozen.dequantize(torch.float64)
    w0 = w_stored[layer.R.inv_perm][:, layer.P.inv_perm]  # undo W' = Ψ_m W0 Ψ_nᵀ
    return layer.R.dense(torch.float64), w0, layer.P.dense(torch.float64)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("n,m,b", SHAPES)
@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("variant", ["fast", "mem"])
def test_forward_and_grads_match_dense_float64(n, m, b, bits, variant, gen):
    layer = POETXLinear(n, m, block_size=b, bits=bits, variant=variant, generator=gen,
                        dtype=torch.float64)  # fmt: skip
    _random_q(layer, 0.05, gen)
    x = torch.randn(2, 5, n, generator=gen, dtype=torch.float64, requires_grad=True)
    y = layer(x)

    # Independent reference: dense R, P built from the same packed Q (as leaf copies).
    qp = layer.P.Q.detach().clone().requires_grad_()
    qr = layer.R.Q.detach().clone().requires_grad_()
    from quant_kernels.reference import cayley_neumann

    def dense_side(side, q):
        qm = q if side.mask is None else q * side.mask
        g = cayley_neumann(qm, side.block_size, side.neumann_terms)
        bd = torch.block_diag(*g)[: side.dim, : side.dim]
        psi = torch.eye(side.dim, dtype=torch.float64)[side.perm]
        return psi.t() @ bd @ psi

    _, w0, _ = _dense_reference(layer)
    x_ref = x.detach().clone().requires_grad_()
    y_ref = x_ref @ (dense_side(layer.R, qr) @ w0 @ dense_side(layer.P, qp)).t()
    assert y.shape == (2, 5, m)
    assert _rel(y, y_ref) <= 1e-12

    dy = torch.randn(y.shape, generator=gen, dtype=torch.float64)
    y.backward(dy)
    y_ref.backward(dy)
    assert _rel(x.grad, x_ref.grad) <= 1e-12
    assert _rel(layer.P.Q.grad, qp.grad) <= 1e-10
    assert _rel(layer.R.Q.grad, qr.grad) <= 1e-10
    if layer.P.mask is not None:  # padded entries of a ragged block get no gradient
        assert layer.P.Q.grad[layer.P.mask == 0].abs().max() == 0


@pytest.mark.parametrize("n,m,b", SHAPES)
def test_fast_and_mem_agree(n, m, b, gen):
    w0 = normalized_gaussian(m, n, generator=gen)
    layers = {}
    for variant in ("fast", "mem"):
        g = torch.Generator().manual_seed(7)
        layers[variant] = POETXLinear(n, m, block_size=b, bits=8, variant=variant, weight=w0,
                                      generator=g)  # fmt: skip
        _random_q(layers[variant], 0.05, torch.Generator().manual_seed(8))
    x = torch.randn(4, 3, n, generator=gen)
    outs = {}
    for variant, layer in layers.items():
        xv = x.clone().requires_grad_()
        y = layer(xv)
        (y * torch.linspace(-1, 1, m)).sum().backward()
        outs[variant] = (y, xv.grad, layer.P.Q.grad, layer.R.Q.grad)
    for a, c in zip(outs["fast"], outs["mem"]):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n,m,b", SHAPES)
def test_merge_preserves_function_unquantized(n, m, b, gen):
    layer = POETXLinear(n, m, block_size=b, bits=16, generator=gen)
    _random_q(layer, 0.05, gen)
    x = torch.randn(6, n, generator=gen)
    perm_before = layer.P.perm.clone()
    with torch.no_grad():
        y0 = layer(x)
        layer.merge_then_reinitialize(gen)
        y1 = layer(x)
    assert _rel(y1, y0) <= 1e-5
    assert layer.P.Q.abs().max() == 0 and layer.R.Q.abs().max() == 0
    assert not torch.equal(layer.P.perm, perm_before)  # new permutation drawn
    assert torch.equal(layer.P.perm[layer.P.inv_perm], torch.arange(n))


def test_merge_quantized_error_is_requantization_error(gen):
    n, m, b = 64, 48, 16
    layer = POETXLinear(n, m, block_size=b, bits=8, generator=gen)
    _random_q(layer, 0.02, gen)
    x = torch.randn(32, n, generator=gen)
    with torch.no_grad():
        w_eff = layer.effective_weight()
        y0 = layer(x)
        layer.merge_then_reinitialize(gen)
        y1 = layer(x)
    # After the merge the layer computes exactly with the re-quantized effective weight...
    w_new = layer.effective_weight()
    torch.testing.assert_close(y1, x @ w_new.t(), rtol=1e-5, atol=1e-5)
    # ...which is the int8 row-wise quantization of the pre-merge effective weight.
    scb = w_eff.abs().amax(1, keepdim=True)
    torch.testing.assert_close(w_new, torch.round(w_eff * 127 / scb) * scb / 127, rtol=0, atol=1e-6)
    assert _rel(y1, y0) < 0.01


@pytest.mark.parametrize("bits", [16, 8, 4])
@pytest.mark.parametrize("n,m,b", [(64, 48, 16), (72, 40, 16), (128, 96, 32)])
def test_merge_stores_what_the_old_composition_stored(n, m, b, bits, gen):
    """The merge gathers M into the new stored order with composed permutations (one fp32 copy
    less); its stored W0 is byte for byte ``_to_store_order(effective_weight())`` after
    reinitializing, the composition it replaced; the measured error is the same up to rounding
    (int8, NF4 with its input-order store, 16 bits; ragged dims)."""
    import copy

    layer = POETXLinear(n, m, block_size=b, bits=bits, generator=gen)
    _random_q(layer, 0.05, gen)
    twin = copy.deepcopy(layer)
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    with torch.no_grad():
        err = layer.merge_then_reinitialize(g1, measure=True)
        w = twin.effective_weight(torch.float32)
        twin.P.reinitialize(g2)
        twin.R.reinitialize(g2)
        twin.frozen.store(twin._to_store_order(w), generator=g2)
        want = float((twin.stored_w0(torch.float32) - w).norm() / w.norm())
    assert torch.equal(layer.P.perm, twin.P.perm) and torch.equal(layer.R.perm, twin.R.perm)
    for (k, a), (_, c) in zip(layer.frozen.state_dict().items(), twin.frozen.state_dict().items()):
        assert torch.equal(a, c), k
    assert err == pytest.approx(want, rel=1e-5, abs=1e-7) and (bits == 16) == (err == 0)


def test_initial_weight_is_normalized_gaussian(gen):
    layer = POETXLinear(40, 24, block_size=8, bits=16, generator=gen)
    w = layer.effective_weight()
    torch.testing.assert_close(w.norm(dim=1), torch.ones(24), rtol=1e-5, atol=1e-5)


def test_bad_arguments():
    with pytest.raises(ValueError, match="exceeds"):
        POETXLinear(16, 32, block_size=32)
    with pytest.raises(ValueError, match="variant"):
        POETXLinear(16, 16, block_size=4, variant="slow")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="bits"):
        POETXLinear(16, 16, block_size=4, bits=3)


def test_no_float_copy_of_int8_weight(gen):
    layer = POETXLinear(32, 64, block_size=8, bits=8, generator=gen)
    buffers = dict(layer.frozen.named_buffers())
    assert buffers["weight"].dtype == torch.int8
    assert buffers["SCB"].dtype == torch.float32 and buffers["SCB"].shape == (64,)
    assert not any(b.is_floating_point() and b.numel() >= 32 * 64 for b in layer.buffers())
