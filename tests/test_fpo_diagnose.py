"""FPO's layer diagnostic: cosines against an independent autograd reference, micro-batch
accumulation, the target and learning-rate rules (the command: tests/test_fpo_cli.py)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from poetxq.adapt.diagnose import diagnose, suggest_lr, suggest_targets
from poetxq.adapt.fpo import MLP_PROJS, FPOAdapter, FPOError


def _exact_rmsnorm(self, hidden_states):
    var = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(var + self.variance_epsilon))


@pytest.fixture
def exact_norm(monkeypatch):
    monkeypatch.setattr(LlamaRMSNorm, "forward", _exact_rmsnorm)


def _tiny(n_layers=4, dtype=torch.float64):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=n_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attn_implementation="eager",
    )  # fmt: skip
    return LlamaForCausalLM(config).to(dtype).eval()


def _windows(n=5, length=9):
    return torch.randint(0, 97, (n, length + 1), generator=torch.Generator().manual_seed(3))


def _cos(a, b):
    return float((a * b).sum() / (a.norm() * b.norm()))


def test_cosines_match_an_independent_autograd_reference(exact_norm):
    model = _tiny()
    windows = _windows()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    diag = diagnose(model, windows, micro_batch=2)
    for name, p in model.named_parameters():  # nothing changed, grads cleared
        assert torch.equal(p, before[name]) and p.grad is None
    # reference: one autograd pass over the whole batch, FPO gradients through FPOAdapter
    ids, labels = windows[:, :-1], windows[:, 1:]
    F.cross_entropy(model(input_ids=ids).logits.flatten(0, 1), labels.flatten()).backward()
    true = {(i, n): getattr(layer.mlp, n).weight.grad.clone()
            for i, layer in enumerate(model.model.layers) for n in MLP_PROJS}  # fmt: skip
    ours, _ = FPOAdapter(model, range(4), lr=1.0).pseudo_grads(ids, labels)
    for row in diag.layers:
        i = row.layer
        assert row.cos_w3 == pytest.approx(_cos(ours[i, "down_proj"], true[i, "down_proj"]),
                                           abs=1e-10)  # fmt: skip
        flat = [torch.cat([d[i, n].flatten() for n in MLP_PROJS]) for d in (ours, true)]
        assert row.cos_mlp == pytest.approx(_cos(*flat), abs=1e-10)
        w3 = before[f"model.layers.{i}.mlp.down_proj.weight"]
        assert row.ratio == pytest.approx(float(ours[i, "down_proj"].norm() / w3.norm()), 1e-10)
        assert row.w3_rms == pytest.approx(float(w3.norm()) / math.sqrt(w3.numel()), 1e-12)
    # the last block's pseudo-gradient is exact; an inner one is not
    assert diag.layers[-1].cos_w3 == pytest.approx(1.0, abs=1e-10)
    assert diag.layers[-1].cos_mlp == pytest.approx(1.0, abs=1e-10)
    assert diag.layers[0].cos_mlp < 0.999
    assert diag.n_tokens == labels.numel()
    assert diag.targets == [3]  # quarter of 4 layers: the last one


def test_micro_batches_accumulate_to_the_whole_batch(exact_norm):
    model, windows = _tiny(n_layers=3), _windows(n=5)
    one = diagnose(model, windows, micro_batch=5)
    many = diagnose(model, windows, micro_batch=2)
    for a, b in zip(one.layers, many.layers, strict=True):
        assert a.cos_w3 == pytest.approx(b.cos_w3, abs=1e-10)
        assert a.cos_mlp == pytest.approx(b.cos_mlp, abs=1e-10)
        assert a.ratio == pytest.approx(b.ratio, rel=1e-10)
    assert one.loss == pytest.approx(many.loss, rel=1e-12)


def test_requires_grad_is_restored():
    model = _tiny(n_layers=2, dtype=torch.float32)
    model.lm_head.weight.requires_grad_(False)
    diagnose(model, _windows(n=2))
    assert not model.lm_head.weight.requires_grad
    assert all(p.requires_grad for n, p in model.named_parameters() if "lm_head" not in n)


def test_target_rule_keeps_the_plateau_of_the_last_quarter():
    # SmolLM2-135M's measured curve (30 layers; last quarter = 8 layers, 22..29): level is the
    # median of 22..28 = 0.459, so layers >= 0.359 are kept: 24..29
    smol = [0.0] * 22 + [0.318, 0.290, 0.394, 0.459, 0.547, 0.618, 0.613, 1.0]
    assert suggest_targets(smol) == [24, 25, 26, 27, 28, 29]
    assert suggest_targets(smol, tolerance=0.0) == [25, 26, 27, 28, 29]
    # an early high cosine is outside the quarter; the exact last layer sets no bar
    assert suggest_targets([0.9] + [0.2] * 8 + [0.50, 0.58, 1.0]) == [9, 10, 11]
    assert suggest_targets([0.9] + [0.2] * 8 + [0.30, 0.58, 1.0]) == [10, 11]  # level .44
    assert suggest_targets([-0.2, -0.1, -0.3]) == [2]  # nothing positive: the last one
    assert suggest_targets([0.1, 0.2]) == [1]
    with pytest.raises(FPOError):
        suggest_targets([])


def test_lr_rule_from_the_ratio_and_the_weight_scale():
    lr = suggest_lr([0.02, 0.04, 0.03], [0.01, 0.03, 0.02])
    assert lr["sgd"] == pytest.approx(1e-3 * 0.1 / 0.03)
    assert lr["adamw"] == pytest.approx(1e-3 * 0.02)
    with pytest.raises(FPOError, match="zero"):
        suggest_lr([0.0], [0.1])
