"""FPO on a low-bit base: non-target linears in int8 / NF4 stores, targets dense and adapted."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from poetxq.adapt.fpo import MLP_PROJS, FPOAdapter
from poetxq.adapt.lowbit import FrozenLinear, densify, freeze_low_bit


def _tiny():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=61, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def _batch():
    ids = torch.randint(0, 61, (2, 13), generator=torch.Generator().manual_seed(1))
    return ids[:, :-1], ids[:, 1:]


def test_int8_base_computes_the_hand_quantized_model():
    model, ref = _tiny(), _tiny()
    assert freeze_low_bit(model, [2], 8) == 3 * 7 - 3  # 4 attention + 3 MLP per layer
    kept = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert sorted(kept) == sorted([f"model.layers.2.mlp.{p}" for p in MLP_PROJS] + ["lm_head"])
    with torch.no_grad():  # independent reference: row-wise absmax int8 by hand, float64
        for name, mod in ref.named_modules():
            if isinstance(mod, torch.nn.Linear) and name not in kept:
                w = mod.weight.double()
                scale = w.abs().amax(1, keepdim=True) / 127
                mod.weight.copy_((torch.round(w / scale) * scale).float())
    ids, _ = _batch()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits,
                                   rtol=1e-4, atol=1e-5)  # fmt: skip


@pytest.mark.parametrize("bits", [8, 4])
def test_fpo_on_a_low_bit_base_is_exact_on_the_last_layer_and_saves_dense(bits, tmp_path):
    model = _tiny()
    freeze_low_bit(model, [2], bits)
    ids, labels = _batch()
    grads, _ = FPOAdapter(model, [2], lr=1e-3).pseudo_grads(ids, labels)
    # the same function densified, differentiated by autograd: the last block's gradient
    dense = _tiny()
    dense.load_state_dict(model.state_dict(), strict=False)  # targets, norms, embeddings
    for name, mod in model.named_modules():
        if isinstance(mod, FrozenLinear):
            dense.get_submodule(name).weight.data.copy_(mod.store.dequantize())
    F.cross_entropy(dense(input_ids=ids).logits.flatten(0, 1), labels.flatten()).backward()
    for proj in MLP_PROJS:
        truth = getattr(dense.model.layers[2].mlp, proj).weight.grad
        assert ((grads[2, proj] - truth).norm() / truth.norm()).item() < 1e-4
    adapter = FPOAdapter(model, [2], lr=1e-3)
    stores = {n: [b.clone() for b in m.store.buffers()] for n, m in model.named_modules()
              if isinstance(m, FrozenLinear)}  # fmt: skip
    adapter.step(ids, labels)
    for name, mod in model.named_modules():
        if isinstance(mod, FrozenLinear):  # frozen codes never move
            assert all(torch.equal(a, b) for a, b in zip(mod.store.buffers(), stores[name]))
    with torch.no_grad():
        before = model(input_ids=ids).logits
    assert densify(model) == 18
    model.save_pretrained(str(tmp_path / "m"))
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "m")).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, before, rtol=1e-4, atol=1e-5)
    w = loaded.model.layers[2].mlp.down_proj.weight
    assert torch.equal(w, adapter.masters[2, "down_proj"])


def test_bits_other_than_8_or_4_are_refused():
    with pytest.raises(ValueError, match="bits 8 or 4"):
        freeze_low_bit(_tiny(), [0], 16)


def test_sft_partial_back_propagates_through_the_frozen_low_bit_layers():
    from poetxq.adapt.reference import AutogradAdapter

    model = _tiny()
    freeze_low_bit(model, [1], 8)
    ids, labels = _batch()
    dense = _tiny()
    dense.load_state_dict(model.state_dict(), strict=False)
    for name, mod in model.named_modules():
        if isinstance(mod, FrozenLinear):
            dense.get_submodule(name).weight.data.copy_(mod.store.dequantize())
    grads, _ = AutogradAdapter(model, [1], lr=1e-3).pseudo_grads(ids, labels)
    F.cross_entropy(dense(input_ids=ids).logits.flatten(0, 1), labels.flatten()).backward()
    for proj in MLP_PROJS:  # layer 1's gradient crosses layer 2's int8 linears on its way
        truth = getattr(dense.model.layers[1].mlp, proj).weight.grad
        assert ((grads[1, proj] - truth).norm() / truth.norm()).item() < 1e-4
