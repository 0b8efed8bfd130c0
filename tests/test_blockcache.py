"""The batched per-forward CNP (BlockCache) equals per-layer CNP, in values and gradients."""

import pytest
import torch

import quant_kernels
from poetxq.model.config import ModelConfig, POETConfig
from poetxq.model.layer import POETXLinear
from poetxq.model.surgery import build_llama, convert_to_poetx, poet_layers
from poetxq.training.loss import causal_lm_loss_chunked

CFG = ModelConfig(hidden_size=48, intermediate_size=100, num_attention_heads=4,
                  num_hidden_layers=2, max_position_embeddings=64)  # fmt: skip


def _model(bits: int = 16, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = build_llama(CFG, vocab_size=97).double()
    convert_to_poetx(model, POETConfig(block_size=16, bits=bits), generator=gen)
    model.double()
    with torch.no_grad():  # non-trivial, ragged-masked Q everywhere
        for layer in poet_layers(model):
            for side in (layer.P, layer.R):
                side.Q.copy_(0.05 * torch.randn(side.Q.shape, generator=gen, dtype=torch.float64))
    return model


def _loss_and_grads(model, tokens):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


@pytest.mark.parametrize("checkpointing", [False, True])
def test_batched_blocks_equal_per_layer_blocks(checkpointing):
    model = _model()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    tokens = torch.randint(0, 97, (2, 17), generator=torch.Generator().manual_seed(1))
    assert model.poetx_block_cache is not None
    loss_cached, grads_cached = _loss_and_grads(model, tokens)
    model.poetx_block_cache.remove()
    loss_plain, grads_plain = _loss_and_grads(model, tokens)
    torch.testing.assert_close(loss_cached, loss_plain, rtol=1e-12, atol=0)
    assert grads_cached.keys() == grads_plain.keys()
    assert any(".Q" in n for n in grads_cached)
    for name, g in grads_plain.items():
        torch.testing.assert_close(grads_cached[name], g, rtol=1e-10, atol=1e-14, msg=name)


def test_one_cnp_call_per_forward(monkeypatch):
    model = _model()
    calls = []
    real = quant_kernels.cayley_neumann

    def counting(*a, **k):
        calls.append(a[0].shape[0])
        return real(*a, **k)

    monkeypatch.setattr(quant_kernels, "cayley_neumann", counting)
    tokens = torch.randint(0, 97, (1, 9))
    model(input_ids=tokens)
    sides = [s for layer in poet_layers(model) for s in (layer.P, layer.R)]
    assert calls == [sum(s.nb for s in sides)]  # one call over every block of the model
    calls.clear()
    model.model(input_ids=tokens)  # the decoder alone (poetxq.training.loss's chunked loss) too
    assert calls == [sum(s.nb for s in sides)]
    model.poetx_block_cache.remove()
    calls.clear()
    model(input_ids=tokens)
    assert len(calls) == len(sides)
    # under activation checkpointing: one lean CNP per decoder layer, over that layer's blocks
    # (the recomputed layer keeps only its packed input; its backward recomputes the rest)
    calls.clear()
    model = _model()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    model(input_ids=tokens)
    per_layer = [
        sum(s.nb for m in layer.modules() for s in (getattr(m, "P", None), getattr(m, "R", None))
            if s is not None)
        for layer in model.model.layers
    ]  # fmt: skip
    assert calls == per_layer and len(calls) == CFG.num_hidden_layers
    assert all(g.g is None for g in model.poetx_block_cache.layer_groups)  # nothing held after
    # backward recomputes each layer (and its one CNP) once more
    calls.clear()
    model(input_ids=tokens).logits.sum().backward()
    assert calls == per_layer + per_layer[::-1]
    calls.clear()
    causal_lm_loss_chunked(model, torch.randint(0, 97, (1, 10)), 4).backward()
    assert calls == per_layer + per_layer[::-1]


def test_stale_blocks_are_never_used():
    model = _model()
    cache = model.poetx_block_cache
    layer: POETXLinear = poet_layers(model)[0]
    cache._before(model, ())
    with torch.no_grad():
        layer.P.Q.add_(0.1)  # an optimizer step between the cache refresh and a use
    torch.testing.assert_close(layer.P.blocks_as(torch.float64), layer.P.blocks())
    untouched = layer.R
    assert untouched.block_cache.blocks(untouched, torch.float64) is not None
    cache._after(model, (), None)  # the model's forward hook clears the cache
    assert untouched.block_cache.blocks(untouched, torch.float64) is None


def test_lean_cnp_saves_only_its_input_and_matches_the_reference():
    gen = torch.Generator().manual_seed(3)
    packed = (0.1 * torch.randn(5, 6, generator=gen, dtype=torch.float64)).requires_grad_(True)
    weight = torch.randn(5, 4, 4, generator=gen, dtype=torch.float64)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        g = quant_kernels.cayley_neumann(packed, 4, 3)
    assert len(saved) == 1 and saved[0] is packed
    (g * weight).sum().backward()
    lean_grad = packed.grad.clone()
    packed.grad = None
    ref = quant_kernels.reference.cayley_neumann(packed, 4, 3)
    torch.testing.assert_close(g, ref, rtol=0, atol=0)
    (ref * weight).sum().backward()
    torch.testing.assert_close(lean_grad, packed.grad, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("bits", [16, 8])
def test_fused_swiglu_mlp_equals_the_plain_mlp(bits):
    """POETXSwiGLUMLP (keeps gate and up only) vs SiLU(gate)·up through a plain down layer."""
    model = _model(bits=bits)
    mlp = model.model.layers[0].mlp
    assert type(mlp).__name__ == "POETXSwiGLUMLP"
    x = torch.randn(2, 5, CFG.hidden_size, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 5, CFG.hidden_size, dtype=torch.float64)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        gate, up = mlp.gate_proj(x), mlp.up_proj(x)
        n_before = len(saved)
        y = mlp.down_proj.forward_swiglu(gate, up)
    big = [t for t in saved[n_before:] if t.shape[-1] == CFG.intermediate_size and t.dim() == 3]
    assert len(big) == 2 and big[0] is gate and big[1] is up  # no SiLU(gate), no product
    (y * w).sum().backward()
    fused = [t.grad.clone() for t in (x, *mlp.parameters()) if t.grad is not None]
    x.grad = None
    model.zero_grad(set_to_none=True)
    y_ref = mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-14)
    (y_ref * w).sum().backward()
    plain = [t.grad for t in (x, *mlp.parameters()) if t.grad is not None]
    assert len(fused) == len(plain) == 1 + 6  # x and the Q of 3 layers x 2 sides
    for a, b in zip(fused, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-13)


def test_deepcopy_gets_its_own_working_cache():
    import copy

    model = _model()
    twin = copy.deepcopy(model)  # e.g. an EMA copy; its hooks must serve the twin's own sides
    tokens = torch.randint(0, 97, (2, 17), generator=torch.Generator().manual_seed(2))
    loss, grads = _loss_and_grads(model, tokens)
    loss_twin, grads_twin = _loss_and_grads(twin, tokens)
    torch.testing.assert_close(loss_twin, loss, rtol=0, atol=0)
    assert grads_twin.keys() == grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(grads_twin[name], g, rtol=0, atol=0, msg=name)
    with torch.no_grad():  # the twin's cache reads the twin's Q, not the original's
        for layer in poet_layers(twin):
            layer.R.Q.zero_()
            layer.P.Q.zero_()
    loss_identity, _ = _loss_and_grads(twin, tokens)
    twin.poetx_block_cache.remove()
    loss_plain, _ = _loss_and_grads(twin, tokens)
    torch.testing.assert_close(loss_identity, loss_plain, rtol=1e-12, atol=0)
    assert not torch.equal(loss_identity, loss)
