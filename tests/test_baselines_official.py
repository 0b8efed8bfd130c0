"""Our APOLLO against the authors' package (``apollo-torch`` 1.0.3, ``apollo_torch.APOLLOAdamW``)
on the same parameters and gradients, step by step (issue 51, item 4).

Both draw the random projection as ``randn(shape) / √r`` from a generator seeded per parameter and
refresh; only the seed sequence differs (theirs: the parameter's 1-based position, advanced by
``apollo_torch.random_projector.next_seed`` at each refresh; ours:
:func:`poetxq.baselines.lowrank.apollo_projection_seed`). The test gives ours their sequence, so
the two optimizers see the same projections and must produce the same weights.

Before this test ours differed in one place: it scaled by the bias-corrected ``m̂ / (√v̂ + ε)``,
so its norm-growth limiter compared corrected norms, while APOLLOAdamW scales by
``m / (√v + ε)`` and applies the bias correction after the limiter (its QAPOLLOAdamW, over int8
weights, takes bitsandbytes' corrected step, as ours does for Q-APOLLO). Ours now follows each;
the weights agree to float32 rounding, with ε = 1e-8 on unit-scale gradients and with their
default ε = 1e-6 on 1e-3-scale gradients, where ε's placement would show.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

apollo_torch = pytest.importorskip("apollo_torch")
from apollo_torch.random_projector import next_seed  # noqa: E402

from poetxq.baselines import lowrank  # noqa: E402
from poetxq.baselines.lowrank import LowRankAdamW  # noqa: E402

SHAPES = [(24, 16), (12, 20), (16, 16)]  # right projection, left projection, square
RANK, GAP, LR, BETAS, SCALE = 4, 5, 1e-2, (0.9, 0.95), 4.0


def _official_seed(position: int, refresh: int) -> int:
    """The seed apollo-torch draws a parameter's ``refresh``-th projection with."""
    seed = position
    for _ in range(refresh):
        seed = next_seed(seed)
    return seed


def _pair(
    scale_type: str, eps: float, weight_decay: float, grad_scale: float, steps: int = 12
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Train the same three matrices ``steps`` steps with each optimizer on the same gradients
    (several projection refreshes; gradients that jump so the norm-growth limiter binds);
    returns the start, their weights and ours."""
    gen = torch.Generator().manual_seed(0)
    w0 = [torch.randn(s, generator=gen) for s in SHAPES]
    grads = [
        [torch.randn(s, generator=gen) * grad_scale * (8.0 if t % 4 == 3 else 1.0) for s in SHAPES]
        for t in range(steps)
    ]
    theirs = [nn.Parameter(w.clone()) for w in w0]
    ours = [nn.Parameter(w.clone()) for w in w0]
    official = apollo_torch.APOLLOAdamW(
        [
            {
                "params": theirs,
                "rank": RANK,
                "update_proj_gap": GAP,
                "scale": SCALE,
                "proj_type": "std",
                "proj": "random",
                "scale_type": scale_type,
            }
        ],
        lr=LR,
        betas=BETAS,
        eps=eps,
        weight_decay=weight_decay,
    )
    mine = LowRankAdamW(
        [
            {
                "params": ours,
                "method": "apollo",
                "rank": RANK,
                "update_proj_gap": GAP,
                "scale": SCALE,
                "scale_type": scale_type,
            }
        ],
        lr=LR,
        betas=BETAS,
        eps=eps,
        weight_decay=weight_decay,
    )
    for g in grads:
        for ps in (theirs, ours):
            for p, gi in zip(ps, g, strict=True):
                p.grad = gi.clone()
        official.step()
        mine.step()
    return w0, [p.detach() for p in theirs], [p.detach() for p in ours]


@pytest.fixture
def official_seeds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        lowrank,
        "apollo_projection_seed",
        lambda seed, index, refresh: _official_seed(index + 1, refresh),
    )


@pytest.mark.parametrize("scale_type", ["channel", "tensor"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_apollo_matches_apollo_torch(official_seeds, scale_type, weight_decay):
    w0, theirs, ours = _pair(scale_type, eps=1e-8, weight_decay=weight_decay, grad_scale=1.0)
    for w, t, o in zip(w0, theirs, ours, strict=True):
        # the weights moved: the comparison is not of untouched tensors
        assert (t - w).abs().max() > 5 * LR
        torch.testing.assert_close(o, t, rtol=2e-5, atol=2e-6)


def test_apollo_eps_placement_is_small(official_seeds):
    """Their default ε = 1e-6 on 1e-3-scale gradients, where ε's placement would show."""
    _, theirs, ours = _pair("channel", eps=1e-6, weight_decay=0.0, grad_scale=1e-3)
    for t, o in zip(theirs, ours, strict=True):
        torch.testing.assert_close(o, t, rtol=2e-5, atol=2e-6)


def test_seed_patch_is_what_differs():
    """Without their seed sequence the projections differ and so do the weights: the agreement
    above comes from the rule, not from an update too small to see."""
    _, theirs, ours = _pair("channel", eps=1e-8, weight_decay=0.0, grad_scale=1.0)
    assert max((t - o).abs().max().item() for t, o in zip(theirs, ours, strict=True)) > 1e-3
