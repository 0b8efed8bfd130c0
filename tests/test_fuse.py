"""poetxq.fuse: the compiled RMSNorm / rotary give the eager model's loss and gradients."""

from __future__ import annotations

import copy

import pytest
import torch

from poetxq.fuse import fuse_elementwise
from poetxq.recipe import ModelConfig, POETConfig
from poetxq.surgery import build_llama, convert_to_poetx

CFG = ModelConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, num_hidden_layers=2,
                  max_position_embeddings=32)  # fmt: skip


@pytest.fixture
def restore_rope(monkeypatch):
    """fuse_elementwise swaps transformers' rotary function process-wide: undo it afterwards."""
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
    assert n == 2 * CFG.num_hidden_layers + 1 + 1  # two norms per layer, the final norm, rotary
    assert getattr(restore_rope.apply_rotary_pos_emb, "_poetxq_compiled", False)
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
