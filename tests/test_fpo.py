"""FPO math against autograd in float64: output error, RMSNorm VJP, residual signal,
pseudo-gradients of the MLP; the update step (optimizers, relative clip, frozen rest, no graph)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from poetxq.adapt.fpo import MLP_PROJS, FPOAdapter, FPOError, mlp_pseudo_grads
from poetxq.adapt.signal import output_error, residual_signal, rmsnorm_vjp


def _exact_rmsnorm(self, hidden_states):
    """LlamaRMSNorm without its fp32 round trip, so a float64 model stays float64."""
    var = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(var + self.variance_epsilon))


@pytest.fixture
def exact_norm(monkeypatch):
    monkeypatch.setattr(LlamaRMSNorm, "forward", _exact_rmsnorm)


def _tiny(n_layers: int = 4, dtype=torch.float64, seed: int = 0, tied: bool = False):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=n_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=tied, rms_norm_eps=1e-5, attn_implementation="eager",
    )  # fmt: skip
    model = LlamaForCausalLM(config).to(dtype)
    with torch.no_grad():  # a non-trivial norm gain, so γ matters in the VJP
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
    return model.eval()


def _batch(b: int = 3, length: int = 11, vocab: int = 97, seed: int = 1, ignore: bool = True):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, length + 1), generator=gen)
    labels = ids[:, 1:].clone()
    if ignore:
        labels[0, :3] = -100
        labels[2, -1] = -100
    return ids[:, :-1], labels


def _mean_ce(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def _close(a, b, rtol=1e-10):
    err = ((a - b).norm() / b.norm()).item()
    assert err < rtol, err


def test_output_error_over_count_is_the_gradient_of_the_mean_cross_entropy():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 13, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 13, (2, 5))
    labels[1, 2] = -100
    _mean_ce(logits, labels).backward()
    e, n = output_error(logits.detach(), labels)
    assert n == 9 and e.dtype == torch.float64
    assert torch.equal(e[1, 2], torch.zeros(13, dtype=torch.float64))
    _close(e / n, logits.grad)
    with pytest.raises(ValueError, match="outside"):
        output_error(logits.detach(), torch.full((2, 5), 13))


def test_rmsnorm_vjp_equals_autograd_in_float64():
    torch.manual_seed(0)
    x = torch.randn(3, 7, 16, dtype=torch.float64, requires_grad=True)
    gamma = 1 + 0.5 * torch.randn(16, dtype=torch.float64)
    upstream = torch.randn(3, 7, 16, dtype=torch.float64)
    y = gamma * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    (ref,) = torch.autograd.grad(y, x, upstream)
    _close(rmsnorm_vjp(x.detach(), gamma, 1e-5, upstream), ref, 1e-13)
    # and the transformers module itself (it computes in fp32): fp32 agreement
    norm = LlamaRMSNorm(16, eps=1e-5)
    norm.weight.data.copy_(gamma.float())
    xf = x.detach().float().requires_grad_()
    (ref32,) = torch.autograd.grad(norm(xf), xf, upstream.float())
    _close(rmsnorm_vjp(xf.detach(), norm.weight, 1e-5, upstream.float()), ref32, 1e-5)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("chunk_tokens", [3, 5, 2048])
def test_residual_signal_equals_autograd_at_the_final_norm_input(exact_norm, tied, chunk_tokens):
    """Loss, count and g̃ against autograd of norm + LM head + cross-entropy in float64; chunks
    of 3 make the first chunk all ignored, 5 splits the batch unevenly, 2048 is one chunk."""
    model = _tiny(tied=tied)
    ids, labels = _batch()
    seen = {}
    model.model.norm.register_forward_pre_hook(lambda _m, args: seen.update(h=args[0]))
    model.model.norm.register_forward_pre_hook(lambda _m, args: args[0].retain_grad())
    loss = _mean_ce(model(input_ids=ids).logits, labels)
    loss.backward()
    hidden = seen["h"]
    sig = residual_signal(hidden.detach(), model.model.norm, model.lm_head.weight, labels,
                          chunk_tokens=chunk_tokens)  # fmt: skip
    assert sig.n_tokens == int((labels != -100).sum()) and isinstance(sig.n_tokens, int)
    assert isinstance(sig.loss, float)
    assert sig.loss == pytest.approx(loss.item(), rel=1e-12)
    assert sig.g_tilde.dtype == torch.float64 and sig.g_tilde.grad_fn is None
    _close(sig.g_tilde, hidden.grad)


def test_residual_signal_checks_the_labels_before_any_chunk():
    model = _tiny(n_layers=1)
    hidden = torch.randn(3, 11, 32, dtype=torch.float64)
    _, labels = _batch()
    args = (model.model.norm, model.lm_head.weight)
    bad = labels.clone()
    bad[2, 4] = 97  # V = 97: one past the vocabulary, in the third chunk of 5
    with pytest.raises(ValueError, match=r"outside \[0, 97\) and is not -100"):
        residual_signal(hidden, *args, bad, chunk_tokens=5)
    bad[2, 4] = -3
    with pytest.raises(ValueError, match="outside"):
        residual_signal(hidden, *args, bad, chunk_tokens=5)
    with pytest.raises(ValueError, match="no labelled position"):
        residual_signal(hidden, *args, torch.full_like(labels, -100), chunk_tokens=5)
    with pytest.raises(ValueError, match="do not match"):
        residual_signal(hidden, *args, labels[:, :-1])


def test_last_layer_pseudo_grads_equal_autograd_with_later_blocks_removed(exact_norm):
    """The issue's exactness test: keep blocks 0..k, so block k is last; all three MLP
    gradients of the true loss equal FPO's (step 0: W3 = W3_init)."""
    model = _tiny(n_layers=4)
    k = 2
    model.model.layers = model.model.layers[: k + 1]
    ids, labels = _batch()
    _mean_ce(model(input_ids=ids).logits, labels).backward()
    mlp = model.model.layers[k].mlp
    truth = {name: getattr(mlp, name).weight.grad.clone() for name in MLP_PROJS}
    adapter = FPOAdapter(model, [k], lr=1e-3)
    grads, _ = adapter.pseudo_grads(ids, labels)
    for name in MLP_PROJS:
        _close(grads[k, name], truth[name])


def test_pseudo_grads_are_the_surrogate_gradient_at_every_layer(exact_norm):
    """Under the output-projection approximation (the MLP's output receives g̃), W1/W2/W3 at
    step 0 equal autograd of <g̃, MLP(x)>; for an inner layer this differs from the loss's."""
    model = _tiny(n_layers=4)
    ids, labels = _batch()
    adapter = FPOAdapter(model, [0, 1, 3], lr=1e-3)
    grads, _ = adapter.pseudo_grads(ids, labels)
    from poetxq.adapt.fpo import ActivationCache

    with torch.no_grad(), ActivationCache(adapter.parts, [1]) as cache:
        model(input_ids=ids)
    g_tilde = residual_signal(cache.hidden, model.model.norm, model.lm_head.weight, labels).g_tilde
    mlp = model.model.layers[1].mlp
    weights = [getattr(mlp, name).weight for name in MLP_PROJS]
    for w in weights:
        w.requires_grad_(True)
    surrogate = (g_tilde * mlp(cache.x[1])).sum()
    truth = torch.autograd.grad(surrogate, weights)
    for name, ref in zip(MLP_PROJS, truth, strict=True):
        _close(grads[1, name], ref)
    # the true loss gradient of the inner layer is different (the later blocks' Jacobians)
    for w in model.parameters():
        w.requires_grad_(True)
    _mean_ce(model(input_ids=ids).logits, labels).backward()
    true_w3 = mlp.down_proj.weight.grad
    assert ((grads[1, "down_proj"] - true_w3).norm() / true_w3.norm()).item() > 1e-3


def test_mlp_pseudo_grads_use_w3_init_not_the_current_w3():
    torch.manual_seed(0)
    x, g = torch.randn(2, 4, 8, dtype=torch.float64), torch.randn(2, 4, 8, dtype=torch.float64)
    a, b = torch.randn(2, 4, 12, dtype=torch.float64), torch.randn(2, 4, 12, dtype=torch.float64)
    w3 = torch.randn(8, 12, dtype=torch.float64)
    one, other = mlp_pseudo_grads(x, a, b, g, w3), mlp_pseudo_grads(x, a, b, g, 2 * w3)
    _close(other["gate_proj"], 2 * one["gate_proj"], 1e-14)
    _close(other["up_proj"], 2 * one["up_proj"], 1e-14)
    assert torch.equal(other["down_proj"], one["down_proj"])  # W3's own gradient: no W3
    with pytest.raises(ValueError, match="shapes"):
        mlp_pseudo_grads(x, a, b, g, w3.T)


def test_a_step_builds_no_autograd_graph_and_changes_only_the_targets():
    model = _tiny(n_layers=3, dtype=torch.float32)
    ids, labels = _batch()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    seen = []

    def watch(_mod, _args, out):
        outs = out if isinstance(out, tuple) else (out,)
        seen.append((torch.is_grad_enabled(), [getattr(t, "grad_fn", None) for t in outs]))

    for mod in model.modules():
        mod.register_forward_hook(watch)
    adapter = FPOAdapter(model, [-1], lr=1e-3)
    stats = adapter.step(ids, labels)
    assert seen and all(not enabled and all(fn is None for fn in fns) for enabled, fns in seen)
    assert stats.loss > 0 and stats.n_tokens == int((labels != -100).sum())
    assert not any(p.requires_grad for p in model.parameters())
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == {f"model.layers.2.mlp.{name}.weight" for name in MLP_PROJS}


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_the_update_is_torch_adamw_or_sgd_on_the_pseudo_gradient(optimizer):
    model = _tiny(n_layers=3, dtype=torch.float32)
    ids, labels = _batch(ignore=False)
    adapter = FPOAdapter(model, [1, 2], lr=3e-3, optimizer=optimizer, clip=None)
    assert adapter.weight_decay == (0.01 if optimizer == "adamw" else 0.0)
    keys = list(adapter.params)
    ref = [torch.nn.Parameter(adapter.masters[k].clone()) for k in keys]
    opt = (torch.optim.AdamW(ref, lr=3e-3, weight_decay=0.01) if optimizer == "adamw"
           else torch.optim.SGD(ref, lr=3e-3, momentum=0.9))  # fmt: skip
    for _ in range(3):
        grads, _ = adapter.pseudo_grads(ids, labels)
        for p, k in zip(ref, keys, strict=True):
            p.grad = grads[k].float()
        opt.step()
        adapter.step(ids, labels)
        for p, k in zip(ref, keys, strict=True):
            torch.testing.assert_close(adapter.masters[k], p.detach(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("clip_on", ["update", "grad"])
def test_relative_clip_bounds_each_tensor_at_one_percent(clip_on):
    model = _tiny(n_layers=2, dtype=torch.float32)
    ids, labels = _batch()
    # SGD's first step is -lr·grad, so either clip gives ‖ΔW‖ = lr·0.01‖W‖ (grad) or 0.01‖W‖
    adapter = FPOAdapter(model, [0, 1], lr=1e4, optimizer="sgd", clip=0.01, clip_on=clip_on)
    old = {k: m.clone() for k, m in adapter.masters.items()}
    stats = adapter.step(ids, labels)
    assert stats.clipped == 6
    bound = 0.01 * (1.0 if clip_on == "update" else 1e4)
    for k, m in adapter.masters.items():
        rel = ((m - old[k]).norm() / old[k].norm()).item()
        assert rel == pytest.approx(bound, rel=1e-4)
    small = FPOAdapter(_tiny(n_layers=2, dtype=torch.float32), [1], lr=1e-9, optimizer="sgd")
    assert small.step(ids, labels).clipped == 0


def test_relative_clip_scales_only_the_updates_over_the_bound():
    """Hand check of the update clip: with ``c`` between the tensors' relative AdamW step sizes,
    each tensor over ``c`` moves by exactly ``c·‖W‖`` along the unclipped step, and each tensor
    under it takes exactly the unclipped step (bit for bit)."""
    ids, labels = _batch()

    def first_step(clip):
        adapter = FPOAdapter(_tiny(n_layers=4, dtype=torch.float32), [0, 1, 2, 3], lr=1e-3,
                             clip=clip, chunk_tokens=5)  # fmt: skip
        old = {k: m.clone() for k, m in adapter.masters.items()}
        return adapter, old, adapter.step(ids, labels)

    free, old, free_stats = first_step(None)
    assert free_stats.clipped == 0
    step = {k: (free.masters[k] - old[k]).double() for k in old}
    rel = {k: (step[k].norm() / old[k].double().norm()).item() for k in old}
    ranked = sorted(rel.values())
    c = (ranked[5] + ranked[6]) / 2  # 6 of the 12 tensors over the bound
    clipped, _, stats = first_step(c)
    assert isinstance(stats.clipped, int) and stats.clipped == 6
    for k, r in rel.items():
        if r > c:
            moved = (clipped.masters[k] - old[k]).double()
            assert (moved.norm() / old[k].double().norm()).item() == pytest.approx(c, rel=1e-6)
            _close(moved, step[k] * (c / r), 1e-5)
        else:
            assert torch.equal(clipped.masters[k], free.masters[k]), k


def test_bf16_model_keeps_fp32_masters_and_rounds_the_weights_from_them():
    model = _tiny(n_layers=2, dtype=torch.bfloat16)
    ids, labels = _batch()
    adapter = FPOAdapter(model, [1], lr=1e-3)
    key = (1, "down_proj")
    assert adapter.masters[key].dtype == torch.float32
    assert adapter.masters[key].data_ptr() != adapter.params[key].data_ptr()
    adapter.step(ids, labels)
    assert torch.equal(adapter.params[key], adapter.masters[key].to(torch.bfloat16))


def test_bf16_pseudo_grads_take_bf16_matmuls_and_match_float64():
    """In a bf16 model the four MLP matmuls run on bf16 operands (their results are bf16 numbers,
    returned as fp32), and the pseudo-gradients match a float64 computation on the same inputs
    to bf16 precision."""
    gen = torch.Generator().manual_seed(5)
    n, d, f = 40, 32, 48
    x, a, b = (torch.randn(2, n // 2, k, generator=gen).to(torch.bfloat16) for k in (d, f, f))
    g_tilde = torch.randn(2, n // 2, d, generator=gen) / n
    w3 = torch.randn(d, f, generator=gen) * 0.1
    got = mlp_pseudo_grads(x, a, b, g_tilde, w3)
    ref = mlp_pseudo_grads(x.double(), a.double(), b.double(), g_tilde.double(), w3.double())
    for name in MLP_PROJS:
        assert got[name].dtype == torch.float32
        assert torch.equal(got[name], got[name].to(torch.bfloat16).float()), name
        _close(got[name].double(), ref[name], rtol=2e-2)


def test_bf16_model_signal_and_grads_match_its_float64_copy():
    """The whole FPO gradient of a bf16 model (bf16 head matmuls, fp32 softmax and norm VJP)
    agrees with the same weights in float64 to bf16 precision."""
    model = _tiny(n_layers=2, dtype=torch.bfloat16)
    ref_model = _tiny(n_layers=2, dtype=torch.bfloat16).double()
    ids, labels = _batch()
    got, stats = FPOAdapter(model, [1], lr=1e-3).pseudo_grads(ids, labels)
    ref, ref_stats = FPOAdapter(ref_model, [1], lr=1e-3).pseudo_grads(ids, labels)
    assert abs(stats.loss - ref_stats.loss) < 1e-2 * ref_stats.loss
    for name in MLP_PROJS:
        _close(got[1, name].double(), ref[1, name], rtol=5e-2)


def test_fpo_steps_lower_the_loss_on_a_fixed_batch():
    model = _tiny(n_layers=3, dtype=torch.float32)
    ids, labels = _batch(b=4, length=16)
    adapter = FPOAdapter(model, [-1, -2], lr=1e-2)
    losses = [adapter.step(ids, labels).loss for _ in range(15)]
    # every step is held to 1 % of ‖W‖ by the clip: slow, but steadily down
    assert all(b < a for a, b in itertools.pairwise(losses)), losses
    assert losses[-1] < losses[0] - 0.01, losses


def test_bad_settings_are_one_line_errors():
    model = _tiny(n_layers=2, dtype=torch.float32)
    with pytest.raises(FPOError, match="does not exist"):
        FPOAdapter(model, [2], lr=1e-3)
    with pytest.raises(FPOError, match="positive"):
        FPOAdapter(model, [0], lr=0.0)
    with pytest.raises(FPOError, match="unknown optimizer"):
        FPOAdapter(model, [0], lr=1e-3, optimizer="lion")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_gpu_step_synchronizes_with_the_host_at_most_three_times_beyond_its_forward():
    """Labels check + count, loss, clipped count: the step's own host synchronizations (counted
    by ``torch.cuda.set_sync_debug_mode("warn")``), whatever the chunks and target tensors."""
    import warnings

    model = _tiny(n_layers=4, dtype=torch.float32).cuda()
    ids, labels = (t.cuda() for t in _batch())
    adapter = FPOAdapter(model, [0, 1, 2, 3], lr=1e-2, chunk_tokens=5)
    adapter.step(ids, labels)  # lazy initialisations outside the count

    def syncs(fn):
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return sum("synchroniz" in str(w.message) for w in seen)

    with torch.no_grad():
        forward = syncs(lambda: adapter.parts.base(input_ids=ids, use_cache=False))
    stats = []
    total = syncs(lambda: stats.append(adapter.step(ids, labels)))
    assert stats[0].clipped > 0  # the clip's count is read, not skipped
    assert total - forward <= 3, (total, forward)
