"""poetxq.model.fuse: the compiled RMSNorm / rotary give the eager model's loss and gradients."""

from __future__ import annotations

import copy

import pytest
import torch

from poetxq.model.config import ModelConfig, POETConfig
from poetxq.model.fuse import fuse_elementwise, rope_fused, unfuse_elementwise
from poetxq.model.surgery import build_llama, convert_to_poetx

CFG = ModelConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, num_hidden_layers=2,
                  max_position_embeddings=32)  # fmt: skip


@pytest.fixture
def restore_rope(monkeypatch):
    """fuse_elementwise swaps transformers' rotary function process-wide: undo it afterwards
    (tests/conftest.py starts every test from the plain one)."""
    from transformers.models.llama import modeling_llama

    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", modeling_llama.apply_rotary_pos_emb)
    return modeling_llama


def test_fused_model_matches_eager_loss_and_gradients(restore_rope):
    torch.manual_seed(0)
    eager = build_llama(CFG, vocab_size=97)
    convert_to_poetx(eager, POETConfig(block_size=16, bits=8), generator=torch.Generator())
    fused = copy.deepcopy(eager)
    # aot_eager: the same capture and autograd split as on a GPU, no C++ compiler needed
    n = fuse_elementwise(fused, backend="aot_eager")
    # two norms per layer, the final norm, rotary, the two SwiGLU maps
    assert n == 2 * CFG.num_hidden_layers + 1 + 1 + 2
    assert rope_fused()
    assert fuse_elementwise(fused, backend="aot_eager") == 0  # idempotent
    assert list(fused.state_dict()) == list(eager.state_dict())  # names unchanged
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
    losses = []
    for model in (eager, fused):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=0)
    for (name, a), b in zip(eager.named_parameters(), fused.parameters(), strict=True):
        if a.grad is not None:
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_unfuse_restores_the_eager_model(restore_rope):
    from poetxq.model import swiglu
    from poetxq.model.layer import POETXSwiGLUMLP

    plain_rope = restore_rope.apply_rotary_pos_emb
    model = build_llama(CFG, vocab_size=97)
    convert_to_poetx(model, POETConfig(block_size=16, bits=8), generator=torch.Generator())
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
    before = model(input_ids=ids, labels=ids).loss.detach()
    n = fuse_elementwise(model, backend="aot_eager")
    assert unfuse_elementwise(model) == n
    assert restore_rope.apply_rotary_pos_emb is plain_rope
    mlps = [m for m in model.modules() if isinstance(m, POETXSwiGLUMLP)]
    assert mlps and all(m.maps is swiglu.PLAIN for m in mlps)
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert norms and all(m._compiled_call_impl is None for m in norms)
    assert unfuse_elementwise(model) == 0  # nothing left to undo
    assert torch.equal(model(input_ids=ids, labels=ids).loss.detach(), before)
    assert fuse_elementwise(model, backend="aot_eager") == n  # and it can be fused again


def test_fuse_wanted_follows_the_recipe():
    from poetxq.model.fuse import fuse_wanted
    from poetxq.training.recipe import TrainConfig

    assert not fuse_wanted(TrainConfig(fuse_elementwise=True), "cpu")  # never on a CPU
    assert fuse_wanted(TrainConfig(), "cuda")  # auto
    assert not fuse_wanted(TrainConfig(gradient_checkpointing=True), "cuda")  # eager recompute
    assert fuse_wanted(TrainConfig(gradient_checkpointing=True, cuda_graph=True), "cuda")
    assert fuse_wanted(TrainConfig(gradient_checkpointing=True, fuse_elementwise=True), "cuda")
    assert not fuse_wanted(TrainConfig(fuse_elementwise=False), "cuda")


def test_recipe_refuses_a_bad_fuse_value():
    from poetxq.training.recipe import RecipeError
    from poetxq.training.recipe_files import load_recipe

    assert load_recipe(None, {"train.fuse_elementwise": "auto"}).train.fuse_elementwise == "auto"
    assert load_recipe(None, {"train.fuse_elementwise": False}).train.fuse_elementwise is False
    with pytest.raises(RecipeError, match="fuse_elementwise"):
        load_recipe(None, {"train.fuse_elementwise": "maybe"})


def _fused_tiny(hidden: int) -> torch.nn.Module:
    cfg = ModelConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=4,
                      num_key_value_heads=2, num_hidden_layers=1,
                      max_position_embeddings=32)  # fmt: skip
    model = build_llama(cfg, vocab_size=97)
    convert_to_poetx(model, POETConfig(block_size=16, bits=8), generator=torch.Generator())
    return model


def test_many_shapes_stay_compiled(restore_rope):
    """Batch and sequence lengths that change, in more shapes than dynamo's recompile_limit (2
    here, 8 by default), and a second model of another width: every call runs compiled code (no
    fallback to eager), with a static and then one dynamic compile per function and model."""
    from torch._dynamo.utils import counters

    counters.clear()
    with torch._dynamo.config.patch(recompile_limit=2):
        for hidden in (64, 32):
            model = _fused_tiny(hidden)
            assert fuse_elementwise(model, backend="aot_eager") > 0
            for batch, seq in ((2, 4), (3, 5), (2, 6)):  # batch 1 would be specialized
                ids = torch.randint(0, 97, (batch, seq), generator=torch.Generator())
                model(input_ids=ids, labels=ids).loss.backward()
    fell_back = [k for k in counters["unimplemented"] if "recompile limit" in k.lower()]
    assert not fell_back
    assert counters["frames"]["ok"] == counters["frames"]["total"]
    # norm, rotary, two SwiGLU maps: static, then dynamic, for each of the two models
    assert counters["frames"]["total"] == 4 * 2 * 2


def test_a_new_model_starts_dynamo_afresh(restore_rope, monkeypatch):
    """Fusing a model not fused before resets dynamo (its first shapes compile static, as in a
    run of it alone); fusing it again (nothing to do) does not."""
    resets = []
    monkeypatch.setattr(torch._dynamo, "reset", lambda: resets.append(1))
    model = _fused_tiny(32)
    fuse_elementwise(model, backend="aot_eager")
    assert len(resets) == 1
    assert fuse_elementwise(model, backend="aot_eager") == 0 and len(resets) == 1
    fuse_elementwise(_fused_tiny(32), backend="aot_eager")
    assert len(resets) == 2
