"""SFT-partial and full fine-tuning through FPO's update: only the gradient differs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from tiny_llama import tiny_llama

from poetxq.adapt.fpo import MLP_PROJS, FPOAdapter
from poetxq.adapt.reference import AutogradAdapter


def _tiny():
    return tiny_llama()


def _batch():
    ids = torch.randint(0, 61, (3, 11), generator=torch.Generator().manual_seed(1))
    return ids[:, :-1], ids[:, 1:]


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_sft_partial_gradients_are_autograd_and_match_fpo_on_the_last_layer():
    ids, labels = _batch()
    sft, _ = AutogradAdapter(_tiny(), [1, 2], lr=1e-3).pseudo_grads(ids, labels)
    fpo, _ = FPOAdapter(_tiny(), [1, 2], lr=1e-3).pseudo_grads(ids, labels)
    ref = _tiny()
    F.cross_entropy(ref(input_ids=ids).logits.flatten(0, 1), labels.flatten()).backward()
    for layer in (1, 2):
        for proj in MLP_PROJS:
            truth = getattr(ref.model.layers[layer].mlp, proj).weight.grad
            assert _rel(sft[layer, proj], truth) < 1e-5
    assert all(_rel(fpo[2, p], sft[2, p]) < 1e-4 for p in MLP_PROJS)  # last block: exact
    assert _rel(fpo[1, "down_proj"], sft[1, "down_proj"]) > 1e-2  # inner: an approximation


def test_sft_partial_step_is_adamw_on_the_true_gradient_and_leaves_no_grad_on():
    ids, labels = _batch()
    model = _tiny()
    adapter = AutogradAdapter(model, [2], lr=1e-2, clip=None)
    ref = _tiny()
    params = [getattr(ref.model.layers[2].mlp, p).weight for p in MLP_PROJS]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
    for _ in range(2):
        F.cross_entropy(ref(input_ids=ids).logits.flatten(0, 1), labels.flatten()).backward()
        opt.step()
        opt.zero_grad()
        adapter.step(ids, labels)
    for proj, p in zip(MLP_PROJS, params, strict=True):
        torch.testing.assert_close(adapter.masters[2, proj], p.detach(), rtol=1e-4, atol=1e-6)
    assert not any(p.requires_grad for p in model.parameters())


def test_full_fine_tuning_moves_every_parameter():
    model = _tiny()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    adapter = AutogradAdapter(model, [2], lr=1e-3, mode="full")
    assert adapter.target_numel() == sum(p.numel() for p in model.parameters())
    adapter.step(*_batch())
    assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_each_adapter_says_what_it_trains():
    """The start line's words: FPO and SFT-partial train the target layers' MLPs, full fine-tuning
    every parameter of every layer (on a low-bit base all but the frozen linears)."""
    from poetxq.adapt.lowbit import freeze_low_bit

    assert FPOAdapter(_tiny(), [1, 2], lr=1e-3).trained() == "the MLPs of layers 1,2"
    assert AutogradAdapter(_tiny(), [2], lr=1e-3).trained() == "the MLPs of layers 2"
    full = AutogradAdapter(_tiny(), [2], lr=1e-3, mode="full")
    assert full.trained() == "every parameter (all 3 layers, the embeddings and the LM head)"
    model = _tiny()
    freeze_low_bit(model, [2], 8)
    assert AutogradAdapter(model, [2], lr=1e-3, mode="full").trained() == (
        "every parameter but the 18 linears frozen in low bits (all 3 layers, the embeddings and "
        "the LM head)"
    )
