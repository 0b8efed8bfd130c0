"""StepEngine (poetxq.training.step) against a hand-written step: accumulation, clipping, the
optimizer in backward, host offload's norm, and its one error."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from poetxq.training.step import StepEngine


def _train(**kw) -> SimpleNamespace:
    base = dict(grad_accum=2, optimizer_in_backward=False, offload_optimizer=False,
                cuda_graph=False)  # fmt: skip
    return SimpleNamespace(**{**base, **kw})


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _loss(net: nn.Module):
    return lambda batch: ((net(batch[:, :6]) - batch[:, 6:]) ** 2).mean()


def _batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(5, 9, generator=g) * 3 for _ in range(n)]


def test_matches_a_hand_written_accumulated_clipped_step():
    batches = _batches(4)
    ref, mine = _net(), _net()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(mine.parameters(), lr=1e-2)
    engine = StepEngine(mine, opt, _train(), loss_fn=_loss(mine), graph=False)
    for step in range(2):
        pair = batches[2 * step : 2 * step + 2]
        ref_losses = []
        for b in pair:  # the reference: loss / accumulation, backward, clip, step, zero
            ref_losses.append(_loss(ref)(b))
            (ref_losses[-1] / 2).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        losses = [engine.micro(b, final=i == 1) for i, b in enumerate(pair)]
        norm = engine.update(0.05)
        assert float(norm) == float(ref_norm) and float(norm) > 0.05  # it did clip
        assert [float(x.detach()) for x in losses] == [float(x.detach()) for x in ref_losses]
        for p in mine.parameters():
            assert p.grad is None  # zeroed to None eagerly
    for a, b in zip(ref.parameters(), mine.parameters(), strict=True):
        assert torch.equal(a, b)


def test_no_clip_when_max_norm_is_zero_or_none_but_the_norm_is_reported():
    for limit in (0.0, None):
        net = _net()
        opt = torch.optim.SGD(net.parameters(), lr=1.0)
        engine = StepEngine(net, opt, _train(grad_accum=1), loss_fn=_loss(net), graph=False)
        b = _batches(1)[0]
        _loss(net)(b).backward()  # what the gradient will be, to compare
        expect = [p.grad.clone() for p in net.parameters()]
        before = [p.detach().clone() for p in net.parameters()]
        opt.zero_grad(set_to_none=True)
        engine.micro(b, final=True)
        norm = engine.update(limit)
        total = math.sqrt(sum(float(g.double().pow(2).sum()) for g in expect))
        assert float(norm) == pytest.approx(total, rel=1e-6) and total > 1
        for p, p0, g in zip(net.parameters(), before, expect, strict=True):
            torch.testing.assert_close(p, p0 - g, rtol=0, atol=1e-6)  # SGD lr 1, unclipped


def test_optimizer_in_backward_updates_like_the_optimizer_and_reports_no_norm():
    b = _batches(1)[0]
    ref, mine = _net(), _net()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    _loss(ref)(b).backward()
    ref_opt.step()
    opt = torch.optim.AdamW(mine.parameters(), lr=1e-2)
    engine = StepEngine(
        mine, opt, _train(grad_accum=1, optimizer_in_backward=True), loss_fn=_loss(mine),
        graph=False,
    )  # fmt: skip
    engine.micro(b, final=True)
    assert all(p.grad is None for p in mine.parameters())  # applied and freed in backward
    assert math.isnan(engine.update(None))
    for a, c in zip(ref.parameters(), mine.parameters(), strict=True):
        torch.testing.assert_close(a, c, rtol=0, atol=1e-7)
    engine.remove()


def test_optimizer_in_backward_that_never_fired_is_an_error():
    net = _net()
    other = torch.ones(2, requires_grad=True)  # the loss reaches no hooked parameter
    engine = StepEngine(
        net, torch.optim.AdamW(net.parameters()), _train(grad_accum=1, optimizer_in_backward=True),
        loss_fn=lambda batch: (other * 2).sum(), graph=False,
    )  # fmt: skip
    engine.micro(_batches(1)[0], final=True)
    with pytest.raises(RuntimeError, match="updated no parameter in backward"):
        engine.update(1.0)


def test_host_offload_clips_by_the_global_norm_of_the_accumulated_gradients():
    batches = _batches(2)
    ref, mine = _net(), _net()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for b in batches:
        (_loss(ref)(b) / 2).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    ref_opt.step()
    opt = torch.optim.AdamW(mine.parameters(), lr=1e-2)
    engine = StepEngine(mine, opt, _train(offload_optimizer=True), loss_fn=_loss(mine), graph=False)
    assert engine.offload is not None
    for i, b in enumerate(batches):
        engine.micro(b, final=i == 1)
    norm = engine.update(0.05)
    assert float(norm) == pytest.approx(float(ref_norm), rel=1e-6)
    for a, c in zip(ref.parameters(), mine.parameters(), strict=True):
        torch.testing.assert_close(a, c, rtol=0, atol=1e-6)
    engine.remove()
