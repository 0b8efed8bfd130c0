"""POET-FS (``structure="full"``): one b×b rotation over a random subset of b coordinates per side,
against a reference assembled by hand in float64 from the subset and the reference CNP."""

from __future__ import annotations

import pytest
import torch

from poetxq.model.layer import POETXLinear
from poetxq.model.orthogonal import OrthogonalSide, side_mask
from poetxq.model.surgery import summarize
from poetxq.training.optim import build_optimizer, merge_and_reset
from poetxq.training.recipe import OptimConfig
from quant_kernels import reference


def _fill_every_q(layer: POETXLinear, scale: float, gen: torch.Generator) -> None:
    """Random values in every packed entry, the masked blocks' too: the mask must hold them off."""
    with torch.no_grad():
        for side in (layer.P, layer.R):
            side.Q.copy_(torch.randn(side.Q.shape, generator=gen) * scale)


def _fs_side(side: OrthogonalSide, q0: torch.Tensor) -> torch.Tensor:
    """``[dim, dim]`` float64: identity, with the CNP of ``q0`` on the subset ``perm[:b]``."""
    b = side.block_size
    g0 = reference.cayley_neumann(q0.double().unsqueeze(0), b, side.neumann_terms)[0]
    m = torch.eye(side.dim, dtype=torch.float64)
    idx = side.perm[:b]
    m[idx[:, None], idx[None, :]] = g0
    return m


def test_side_mask_trains_the_first_block_only():
    mask = side_mask(20, 8, "full")  # 3 blocks, the last ragged
    assert mask.shape == (3, 28) and mask[0].sum() == 28 and mask[1:].sum() == 0
    assert side_mask(16, 8, "block") is None
    with pytest.raises(ValueError, match="structure"):
        side_mask(16, 8, "diagonal")
    side = OrthogonalSide(20, 8, structure="full", generator=torch.Generator().manual_seed(0))
    assert side.num_trainable() == 28 and side.ragged


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("variant", ["mem", "fast"])
def test_forward_and_gradients_match_the_subset_rotation_in_float64(bits, variant):
    gen = torch.Generator().manual_seed(0)
    n, m, b = 20, 28, 8
    layer = POETXLinear(n, m, block_size=b, bits=bits, variant=variant, structure="full",
                        generator=gen)  # fmt: skip
    _fill_every_q(layer, 0.1, gen)
    x = torch.randn(5, n, generator=gen, dtype=torch.float64)
    w0 = layer.stored_w0(torch.float64)

    q0 = {s: getattr(layer, s).Q[0].detach().double().requires_grad_(True) for s in ("P", "R")}
    w_ref = _fs_side(layer.R, q0["R"]) @ w0 @ _fs_side(layer.P, q0["P"])
    y_ref = x @ w_ref.t()
    y_ref.pow(2).sum().backward()

    y = layer(x.float())
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-5, atol=1e-5)
    y.double().pow(2).sum().backward()
    for name, side in (("P", layer.P), ("R", layer.R)):
        torch.testing.assert_close(side.Q.grad[0].double(), q0[name].grad, rtol=1e-4, atol=1e-5)
        assert side.Q.grad[1:].abs().max() == 0  # the other blocks never train
        g = side.blocks().detach()
        torch.testing.assert_close(g[1:], torch.eye(b).expand_as(g[1:]))


def test_a_merge_keeps_the_function_and_draws_a_new_subset():
    gen = torch.Generator().manual_seed(1)
    layer = POETXLinear(24, 32, block_size=8, bits=16, structure="full", generator=gen)
    _fill_every_q(layer, 0.05, gen)
    x = torch.randn(6, 24, generator=gen)
    subset = set(layer.P.perm[:8].tolist())
    with torch.no_grad():
        y0 = layer(x)
        layer.merge_then_reinitialize(gen)
        y1 = layer(x)
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-5)
    assert layer.P.Q.abs().max() == 0 and set(layer.P.perm[:8].tolist()) != subset
    assert layer.P.mask is not None and layer.P.mask[1:].sum() == 0  # still one trained block


def test_training_moves_only_the_subset_block_and_merges_keep_it_so():
    gen = torch.Generator().manual_seed(2)
    model = torch.nn.Sequential(
        POETXLinear(16, 24, block_size=8, bits=8, structure="full", generator=gen),
        POETXLinear(24, 16, block_size=8, bits=8, structure="full", generator=gen),
    )
    opt = build_optimizer(model, OptimConfig(lr=1e-2, poet_lr=0.05, warmup_steps=0))
    for step in range(1, 7):
        x = torch.randn(8, 16, generator=gen)
        (model(x) - x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        for layer in model:
            for side in (layer.P, layer.R):
                assert side.Q[0].abs().max() > 0 and side.Q[1:].abs().max() == 0
        if step % 3 == 0:
            merge_and_reset(model, opt, gen)


def test_the_recipe_key_reaches_every_layer():
    from poetxq.training.build import build_for_training
    from poetxq.training.recipe_files import load_recipe

    over = {"model.num_hidden_layers": 1, "model.hidden_size": 64, "model.intermediate_size": 128,
            "model.num_attention_heads": 4, "poet.block_size": 16}  # fmt: skip
    recipe = load_recipe("recipes/methods/poetxq-fs.yaml", over)
    assert recipe.poet.structure == "full" and recipe.poet.bits == 8
    gen = torch.Generator().manual_seed(0)
    built = build_for_training(recipe, 512, torch.device("cpu"), generator=gen)
    layers = [m for m in built.model.modules() if isinstance(m, POETXLinear)]
    assert layers and all(s.structure == "full" for m in layers for s in (m.P, m.R))
    text = summarize(built.model, built.surgery)
    assert "fully stochastic: one b x b block per side" in text.splitlines()[0]
    # trainable Q: one b(b-1)/2 block per side (the masked blocks do not count)
    assert f"trainable: {len(layers) * 2 * 120:,} orthogonal (Q)" in text


def test_run_labels_name_the_fully_stochastic_runs():
    from poetxq.training.recipe import method_label, run_label
    from poetxq.training.recipe_files import load_recipe

    r = load_recipe("llama-60m:poetxq-fs")
    assert (method_label(r), run_label(r)) == ("poetxq-fs", "llama-60m-poetxq-fs")
    r16 = load_recipe("llama-60m:poetxq-fs", {"poet.bits": 16})
    assert method_label(r16) == "poetx-fs"
