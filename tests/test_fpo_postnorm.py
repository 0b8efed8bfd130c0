"""FPO on models with a norm after the MLP (OLMo-2: SwiGLU; Gemma 3: GeGLU and ``1 + weight``
norm gains), against autograd in float64: the last layer's pseudo-gradients are the loss
gradient, an inner layer's are the gradient of ``⟨g̃, norm_post(MLP(x))⟩``; the activation
derivatives and the norm gain on their own; what llama_parts refuses."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, Olmo2Config, Olmo2ForCausalLM
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

from poetxq.adapt.fpo import (
    ACTIVATIONS,
    MLP_PROJS,
    ActivationCache,
    FPOAdapter,
    FPOError,
    llama_parts,
)
from poetxq.adapt.signal import norm_gain, residual_signal


def _olmo_norm(self, x):  # Olmo2RMSNorm without its fp32 round trip (float64 stays float64)
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _gemma_norm(self, x):  # Gemma3RMSNorm likewise: x̂ · (1 + weight)
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)) * (1.0 + self.weight)


@pytest.fixture
def exact_norms(monkeypatch):
    monkeypatch.setattr(Olmo2RMSNorm, "forward", _olmo_norm)
    monkeypatch.setattr(Gemma3RMSNorm, "forward", _gemma_norm)


SIZES = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64,
             attn_implementation="eager")  # fmt: skip


def _model(kind: str, n_layers: int = 4, seed: int = 0):
    torch.manual_seed(seed)
    if kind == "olmo2":
        model = Olmo2ForCausalLM(Olmo2Config(num_hidden_layers=n_layers, rms_norm_eps=1e-5,
                                             **SIZES))  # fmt: skip
    else:
        config = Gemma3TextConfig(num_hidden_layers=n_layers, head_dim=8, rms_norm_eps=1e-5,
                                  sliding_window=4, **SIZES)  # fmt: skip
        model = Gemma3ForCausalLM(config)
    model = model.to(torch.float64)
    with torch.no_grad():  # non-trivial gains, so γ (and Gemma's 1 + weight) matter in the VJPs
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_((0.0 if kind == "gemma3" else 1.0) + 0.3 * torch.randn_like(p))
    return model.eval()


def _batch(b: int = 3, length: int = 11, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 97, (b, length + 1), generator=gen)
    labels = ids[:, 1:].clone()
    labels[0, :3] = -100
    return ids[:, :-1], labels


def _close(a, b, rtol=1e-10):
    err = ((a - b).norm() / b.norm()).item()
    assert err < rtol, err


@pytest.mark.parametrize("kind", ["olmo2", "gemma3"])
def test_parts_name_the_post_norms_and_activation(kind):
    parts = llama_parts(_model(kind, n_layers=2))
    assert parts.act == ("silu" if kind == "olmo2" else "gelu_pytorch_tanh")
    assert parts.post_norms is not None and len(parts.post_norms) == 2
    assert parts.post_norms[1] is parts.layers[1].post_feedforward_layernorm


@pytest.mark.parametrize("kind", ["olmo2", "gemma3"])
def test_last_layer_pseudo_grads_equal_autograd(kind, exact_norms):
    """Blocks 0..k kept, so block k is last: FPO's three MLP gradients (step 0, W3 = W3_init)
    are the mean cross-entropy's, through the post-MLP norm's VJP and the final norm's."""
    model = _model(kind)
    k = 2
    model.model.layers = model.model.layers[: k + 1]
    model.config.num_hidden_layers = k + 1
    ids, labels = _batch()
    logits = model(input_ids=ids).logits
    F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100).backward()
    mlp = model.model.layers[k].mlp
    truth = {name: getattr(mlp, name).weight.grad.clone() for name in MLP_PROJS}
    grads, stats = FPOAdapter(model, [k], lr=1e-3).pseudo_grads(ids, labels)
    assert stats.n_tokens == int((labels != -100).sum())
    for name in MLP_PROJS:
        _close(grads[k, name], truth[name])


@pytest.mark.parametrize("kind", ["olmo2", "gemma3"])
def test_inner_layer_is_the_gradient_of_the_post_norm_surrogate(kind, exact_norms):
    """An inner layer: the gradient of ⟨g̃, norm_post(MLP(x))⟩ with g̃ and x held fixed — and not
    that of ⟨g̃, MLP(x)⟩ (the post-norm VJP is applied)."""
    model = _model(kind)
    ids, labels = _batch()
    adapter = FPOAdapter(model, [1], lr=1e-3)
    grads, _ = adapter.pseudo_grads(ids, labels)
    with torch.no_grad(), ActivationCache(adapter.parts, [1]) as cache:
        model(input_ids=ids)
    g_tilde = residual_signal(cache.hidden, model.model.norm, adapter.parts.lm_weight,
                              labels).g_tilde  # fmt: skip
    layer = model.model.layers[1]
    weights = [getattr(layer.mlp, name).weight for name in MLP_PROJS]
    for w in weights:
        w.requires_grad_(True)
    out = layer.mlp(cache.x[1])
    truth = torch.autograd.grad((g_tilde * layer.post_feedforward_layernorm(out)).sum(), weights)
    for name, ref in zip(MLP_PROJS, truth, strict=True):
        _close(grads[1, name], ref)
    plain = torch.autograd.grad((g_tilde * layer.mlp(cache.x[1])).sum(), weights[2])[0]
    assert ((grads[1, "down_proj"] - plain).norm() / plain.norm()).item() > 1e-3


@pytest.mark.parametrize("act", sorted(ACTIVATIONS))
def test_activation_value_and_derivative_match_torch(act):
    a = torch.linspace(-6, 6, 241, dtype=torch.float64, requires_grad=True)
    reference = F.silu(a) if act == "silu" else F.gelu(a, approximate="tanh")
    (slope,) = torch.autograd.grad(reference.sum(), a)
    value, ours = ACTIVATIONS[act](a.detach())
    torch.testing.assert_close(value, reference.detach(), rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(ours, slope, rtol=1e-13, atol=1e-14)


def test_norm_gain_is_one_plus_weight_for_gemma_only():
    gemma, olmo = Gemma3RMSNorm(4), Olmo2RMSNorm(4)
    with torch.no_grad():
        gemma.weight.copy_(torch.tensor([0.0, 0.5, -0.25, 2.0]))
        olmo.weight.copy_(torch.tensor([1.0, 0.5, -0.25, 2.0]))
    torch.testing.assert_close(norm_gain(gemma), torch.tensor([1.0, 1.5, 0.75, 3.0]))
    assert norm_gain(olmo) is olmo.weight
    x = torch.randn(5, 4)  # the gain reproduces the module's own output
    rms = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + gemma.eps)
    torch.testing.assert_close(gemma(x), x * rms * norm_gain(gemma))


def test_unsupported_heads_and_activations_are_refused():
    model = _model("gemma3", n_layers=1)
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(FPOError, match="soft-capping"):
        llama_parts(model)
    model.config.final_logit_softcapping = None
    model.config.hidden_activation = "relu"
    with pytest.raises(
        FPOError, match="activation silu or gelu_pytorch_tanh; this model has 'relu'"
    ):
        llama_parts(model)


def test_the_family_check_names_the_command_that_refuses(tmp_path):
    from transformers import GPT2Config

    from poetxq.adapt.fpo import FPO_FAMILY
    from poetxq.model.pretrained import PretrainedError, check_pretrained_config

    olmo, gpt2 = tmp_path / "olmo2", tmp_path / "gpt2"
    Olmo2Config(num_hidden_layers=1, **SIZES).save_pretrained(str(olmo))
    GPT2Config(n_layer=1, n_embd=32, n_head=4).save_pretrained(str(gpt2))
    with pytest.raises(PretrainedError, match="has model_type 'olmo2'; --model takes Llama-family"):
        check_pretrained_config(str(olmo))
    assert check_pretrained_config(str(olmo), families=FPO_FAMILY).model_type == "olmo2"
    with pytest.raises(PretrainedError, match=r"'gpt2'; fpo-adapt takes checkpoints \(model_type "
                       r"llama, mistral, qwen2, qwen3, olmo2, gemma3_text\)"):  # fmt: skip
        check_pretrained_config(str(gpt2), families=FPO_FAMILY, command="fpo-adapt")
