"""POET AdamW param groups, schedule, clip re-warm and the merge-time moment reset."""

import math

import pytest
import torch
from torch import nn

from poetxq.model.layer import POETXLinear
from poetxq.training.optim import (
    build_optimizer,
    clip_threshold,
    cosine_lr_factor,
    merge_and_reset,
    orthogonal_parameters,
)
from poetxq.training.recipe import OptimConfig


class Tiny(torch.nn.Module):
    def __init__(self, gen: torch.Generator) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 16)
        self.proj = POETXLinear(16, 24, block_size=8, bits=8, generator=gen)
        self.norm = torch.nn.LayerNorm(24)

    def forward(self, ids):
        return self.norm(self.proj(self.emb(ids)))


def test_param_groups(gen):
    model = Tiny(gen)
    cfg = OptimConfig(lr=1e-3, poet_lr=2e-3, poet_lr_scale=0.5, weight_decay=0.1)
    opt = build_optimizer(model, cfg)
    groups = {g["name"]: g for g in opt.param_groups}
    assert {id(p) for p in groups["poet"]["params"]} == {
        id(p) for p in orthogonal_parameters(model)
    }
    assert groups["poet"]["lr"] == pytest.approx(1e-3) and groups["poet"]["weight_decay"] == 0
    assert [p.shape for p in groups["decay"]["params"]] == [(10, 16)]  # embedding only
    assert groups["decay"]["weight_decay"] == 0.1
    assert len(groups["no_decay"]["params"]) == 2  # LayerNorm weight and bias
    # no frozen buffer (int8 W0) is handed to the optimizer
    assert all(p.dtype.is_floating_point for g in opt.param_groups for p in g["params"])


def test_adam_step_matches_hand_computation(gen):
    model = Tiny(gen)
    cfg = OptimConfig(lr=1e-3, poet_lr=2e-3, poet_lr_scale=0.5, betas=(0.9, 0.999), eps=1e-8)
    opt = build_optimizer(model, cfg)
    q = model.proj.P.Q
    model(torch.tensor([[1, 2, 3]])).square().sum().backward()
    g = q.grad.clone()
    opt.step()
    # first AdamW step: m = (1-b1) g, v = (1-b2) g², update = lr · m̂ / (sqrt(v̂) + eps)
    expected = -1e-3 * g / (g.abs() + 1e-8)
    torch.testing.assert_close(q.detach(), expected, rtol=1e-5, atol=1e-9)


def test_merge_resets_q_and_moments(gen):
    model = Tiny(gen)
    opt = build_optimizer(model, OptimConfig())
    for _ in range(3):
        model(torch.tensor([[1, 2, 3, 4]])).square().sum().backward()
        opt.step()
        opt.zero_grad()
    q = model.proj.R.Q
    assert q.abs().max() > 0 and opt.state[q]["exp_avg"].abs().max() > 0
    emb_state = opt.state[model.emb.weight]["exp_avg"].clone()
    assert merge_and_reset(model, opt, gen) == 1
    assert q.abs().max() == 0
    for p in orthogonal_parameters(model):
        st = opt.state[p]
        assert st["exp_avg"].abs().max() == 0 and st["exp_avg_sq"].abs().max() == 0
        assert float(st["step"]) == 0
    torch.testing.assert_close(opt.state[model.emb.weight]["exp_avg"], emb_state)  # untouched


def test_cosine_schedule_values():
    assert cosine_lr_factor(0, 10, 110, 0.01) == pytest.approx(0.1)
    assert cosine_lr_factor(9, 10, 110, 0.01) == pytest.approx(1.0)
    assert cosine_lr_factor(10, 10, 110, 0.01) == pytest.approx(1.0)
    mid = 0.01 + 0.99 * 0.5 * (1 + math.cos(math.pi * 0.5))
    assert cosine_lr_factor(60, 10, 110, 0.01) == pytest.approx(mid)
    assert cosine_lr_factor(110, 10, 110, 0.01) == pytest.approx(0.01)
    assert cosine_lr_factor(500, 10, 110, 0.01) == pytest.approx(0.01)


def test_clip_rewarm():
    assert clip_threshold(1.0, None, 10) == 1.0
    assert clip_threshold(1.0, 0, 10) == pytest.approx(0.1)
    assert clip_threshold(1.0, 5, 10) == pytest.approx(0.55)
    assert clip_threshold(1.0, 10, 10) == 1.0
    assert clip_threshold(2.0, 3, 0) == 2.0


def test_8bit_states_use_bitsandbytes_and_merges_restart_them():
    """optim.state_bits=8: bitsandbytes AdamW8bit with 8-bit codes for large tensors; a merge
    drops Q's state so the next step is a fresh Adam start (same as a new optimizer's step)."""
    import bitsandbytes as bnb

    from poetxq.model.layer import POETXLinear
    from poetxq.training.optim import build_optimizer, reset_orthogonal_state
    from poetxq.training.recipe import OptimConfig

    gen = torch.Generator().manual_seed(0)
    layer = POETXLinear(256, 128, block_size=128, bits=8, generator=gen)  # Q: 2 x 8128 entries
    opt = build_optimizer(layer, OptimConfig(state_bits=8))
    assert isinstance(opt, bnb.optim.AdamW8bit)
    x = torch.randn(4, 256, generator=gen)
    layer(x).square().sum().backward()
    opt.step()
    assert opt.state[layer.P.Q]["state1"].dtype == torch.uint8
    reset_orthogonal_state(opt, [layer.P.Q, layer.R.Q])
    assert layer.P.Q not in opt.state and layer.R.Q not in opt.state
    before = layer.P.Q.detach().clone()
    opt.zero_grad()
    layer(x).square().sum().backward()
    grad = layer.P.Q.grad.clone()
    opt.step()  # Adam's first step moves each entry by lr * g / (|g| + eps) = +-lr
    lr = opt.param_groups[0]["lr"]
    step = layer.P.Q.detach() - before
    big = grad.abs() > 1e-3
    torch.testing.assert_close(step[big], -lr * grad[big].sign(), rtol=2e-2, atol=0)


def test_8bit_step_without_per_parameter_sync_equals_bitsandbytes_step():
    """poetxq's AdamW8bit drops only bitsandbytes' device sync after each parameter: three steps
    give bit-identical parameters and states to bitsandbytes' own AdamW8bit."""
    import bitsandbytes as bnb

    from poetxq.training.optim import adamw8bit_class

    def mlp() -> nn.Module:
        torch.manual_seed(0)  # 64x96 = 6144 elements: 8-bit states; the biases keep fp32 ones
        return nn.Sequential(nn.Linear(64, 96), nn.Tanh(), nn.Linear(96, 64))

    ref, m = mlp(), mlp()
    groups = lambda net: [  # noqa: E731
        {"params": [net[0].weight, net[2].weight], "lr": 1e-2, "weight_decay": 0.1},
        {"params": [net[0].bias, net[2].bias], "lr": 3e-3, "weight_decay": 0.0},
    ]
    opt_ref, opt = bnb.optim.AdamW8bit(groups(ref)), adamw8bit_class()(groups(m))
    assert isinstance(opt, bnb.optim.AdamW8bit) and type(opt).step is not type(opt_ref).step
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(5, 64, generator=gen)
        for net, o in ((ref, opt_ref), (m, opt)):
            net(x).square().sum().backward()
            o.step()
            o.zero_grad()
    for a, b in zip(ref.parameters(), m.parameters(), strict=True):
        assert torch.equal(a, b)
    assert opt.state[m[0].weight]["state1"].dtype == torch.uint8
    for key in ("state1", "state2"):
        assert torch.equal(opt.state[m[0].weight][key], opt_ref.state[ref[0].weight][key])
    m[0].weight.grad = None  # a parameter without a gradient is skipped, as bitsandbytes does
    before = m[0].weight.detach().clone()
    opt.step()
    assert torch.equal(m[0].weight, before)


def test_bitsandbytes_optional_cpu_gemm_warning_is_quiet():
    """bitsandbytes' CPU backend warns at import that an optional 4-bit CPU GEMM (which poetxq
    never calls) is missing; importing poetxq quiets that one logger, errors still show."""
    import logging

    import poetxq  # noqa: F401

    assert logging.getLogger("bitsandbytes.backends.cpu.ops").getEffectiveLevel() == logging.ERROR


def test_adamw_is_fused_only_where_every_parameter_is_on_cuda():
    from poetxq.training.optim import adamw

    cpu = [{"params": [nn.Parameter(torch.ones(3))]}]
    assert not adamw(cpu, betas=(0.9, 0.95), eps=1e-8).defaults["fused"]
    if torch.cuda.is_available():
        gpu = [{"params": [nn.Parameter(torch.ones(3, device="cuda"))]}]
        opt = adamw(gpu, betas=(0.9, 0.95), eps=1e-8)
        assert opt.defaults["fused"] is True
        # the fused step equals the foreach step on the same gradient
        ref = torch.optim.AdamW(
            [nn.Parameter(torch.ones(3, device="cuda"))], betas=(0.9, 0.95), eps=1e-8, foreach=True
        )
        for o in (opt, ref):
            p = o.param_groups[0]["params"][0]
            p.grad = torch.tensor([0.5, -1.0, 2.0], device="cuda")
            o.step()
        torch.testing.assert_close(
            opt.param_groups[0]["params"][0], ref.param_groups[0]["params"][0]
        )
