"""Muon baseline: two steps of MuonAdamW against a float64 reference written here from the
update rule (Nesterov momentum, quintic Newton-Schulz, RMS matched to AdamW, decoupled decay);
the AdamW part against torch's AdamW; state_dict round trip; per-group learning rates of every
method's optimizer (optim.lr for embeddings / lm_head / norms, optim.matrix_lr for the hidden
matrices, poet_lr for POET's Q)."""

import copy
import math

import pytest
import torch

from poetxq.baselines.muon import MUON_MOMENTUM, MuonAdamW
from poetxq.model.config import ModelConfig
from poetxq.model.surgery import build_llama, convert_to_poetx
from poetxq.training.baseline_methods import build_baseline_optimizer, prepare_baseline
from poetxq.training.optim import build_optimizer
from poetxq.training.recipe import BaselineConfig, OptimConfig, POETConfig, Recipe

A, B, C = 3.4445, -4.7750, 2.0315  # the quintic's coefficients (Jordan et al. 2024)


def ref_orthogonalize(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Five quintic Newton-Schulz steps in float64 on the wide orientation of ``g``."""
    x = g.double()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / max(x.norm().item(), 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = A * x + (B * gram + C * gram @ gram) @ x
    return x.T if tall else x


@pytest.mark.parametrize("shape", [(16, 24), (24, 16)])
def test_muon_two_steps_match_reference(shape):
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(*shape, generator=gen) * 0.1
    grads = [torch.randn(*shape, generator=gen) for _ in range(2)]
    lr, wd, mu = 0.02, 0.1, MUON_MOMENTUM
    p = torch.nn.Parameter(w0.clone())
    opt = MuonAdamW([{"params": [p], "algorithm": "muon", "lr": lr, "weight_decay": wd}])
    ref, buf = w0.double(), torch.zeros(shape, dtype=torch.float64)
    scale = 0.2 * math.sqrt(max(shape))  # adjust_lr_fn="match_rms_adamw"
    for g in grads:
        p.grad = g.clone()
        opt.step()
        buf = mu * buf + g.double()
        update = ref_orthogonalize(g.double() + mu * buf)
        ref = ref * (1 - lr * wd) - lr * scale * update
    # torch runs Newton-Schulz in bf16: ~1 % of an update entry (lr * scale * O(1))
    step_size = lr * scale
    err = (p.detach().double() - ref).abs().max().item()
    assert err < 0.03 * step_size, (err, step_size)
    # and the reference is a real check: one step of plain SGD lands far from it
    assert (w0.double() - lr * grads[0].double() - ref).abs().max().item() > 0.2 * step_size


def test_adamw_part_matches_torch_and_state_round_trips():
    gen = torch.Generator().manual_seed(1)
    mat = torch.randn(8, 12, generator=gen)
    emb, norm = torch.randn(20, 8, generator=gen), torch.rand(8, generator=gen) + 0.5
    ps = [torch.nn.Parameter(t.clone()) for t in (mat, emb, norm)]
    twin = [torch.nn.Parameter(t.clone()) for t in (emb, norm)]
    groups = [
        {"params": [ps[0]], "algorithm": "muon", "lr": 0.01, "weight_decay": 0.1},
        {"params": [ps[1]], "algorithm": "adamw", "lr": 0.003, "weight_decay": 0.1},
        {"params": [ps[2]], "algorithm": "adamw", "lr": 0.003, "weight_decay": 0.0},
    ]
    opt = MuonAdamW(groups, betas=(0.9, 0.95), eps=1e-8)
    ref = torch.optim.AdamW(
        [{"params": [twin[0]], "weight_decay": 0.1}, {"params": [twin[1]], "weight_decay": 0.0}],
        lr=0.003, betas=(0.9, 0.95), eps=1e-8,
    )  # fmt: skip
    for _ in range(3):
        gs = [torch.randn_like(p, generator=None) for p in ps]
        for p, g in zip(ps, gs):
            p.grad = g.clone()
        for p, g in zip(twin, gs[1:]):
            p.grad = g.clone()
        opt.step()
        ref.step()
    assert torch.equal(ps[1], twin[0]) and torch.equal(ps[2], twin[1])
    # a scheduler's lr reaches both inner optimizers (the groups are theirs)
    assert [g["lr"] for g in opt.param_groups] == [0.01, 0.003, 0.003]
    for g in opt.param_groups:
        g["lr"] *= 0.5
    assert opt.muon.param_groups[0]["lr"] == 0.005 and opt.adamw.param_groups[0]["lr"] == 0.0015
    # state_dict round trip: a fresh optimizer loaded from it takes the same next step
    sd = copy.deepcopy(opt.state_dict())  # (a state_dict holds the live tensors)
    assert set(sd) == {"muon", "adamw"}
    clones = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    fresh = MuonAdamW(
        [{**g, "params": [c]} for g, c in zip(opt.param_groups, clones)], betas=(0.9, 0.95)
    )
    fresh.load_state_dict(sd)
    g = [torch.randn_like(p) for p in ps]
    for p, c, gi in zip(ps, clones, g):
        p.grad, c.grad = gi.clone(), gi.clone()
    opt.step()
    fresh.step()
    assert all(torch.equal(p, c) for p, c in zip(ps, clones))
    # after a load the groups are still the inner optimizers' (a resumed run's scheduler)
    fresh.param_groups[0]["lr"] = 0.123
    assert fresh.muon.param_groups[0]["lr"] == 0.123
    assert fresh.state[clones[1]]["exp_avg"].shape == emb.shape
    with pytest.raises(ValueError, match="another method"):
        fresh.load_state_dict({"adamw": sd["adamw"]})


def test_a_group_without_algorithm_is_refused():
    p = torch.nn.Parameter(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="'muon' or 'adamw'"):
        MuonAdamW([{"params": [p], "lr": 0.1}])


TINY = ModelConfig(hidden_size=32, intermediate_size=48, num_attention_heads=2, num_hidden_layers=1)
LINEAR = 4 * 32 * 32 + 3 * 48 * 32  # q, k, v, o + gate, up, down
EMBED = 2 * 64 * 32  # embeddings + untied lm_head
NORMS = 3 * 32


def _groups(opt: torch.optim.Optimizer) -> dict[str, tuple[float, float, int]]:
    return {
        g["name"]: (g["lr"], g["weight_decay"], sum(p.numel() for p in g["params"]))
        for g in opt.param_groups
    }


@pytest.mark.parametrize(
    ("method", "matrix_group"),
    [("adamw", "matrices"), ("muon", "muon"), ("galore", "lowrank"), ("qgalore", "lowrank"),
     ("apollo", "lowrank"), ("qapollo", "lowrank")],
)  # fmt: skip
def test_baseline_groups_take_the_embedding_and_matrix_lrs(method, matrix_group):
    torch.manual_seed(0)
    model = build_llama(TINY, 64)
    cfg = BaselineConfig(rank=4)
    report = prepare_baseline(model, method, cfg)
    oc = OptimConfig(lr=1e-2, matrix_lr=3e-3, weight_decay=0.1)
    opt = build_baseline_optimizer(model, report, cfg, oc)
    assert _groups(opt) == {
        matrix_group: (3e-3, 0.1, LINEAR),
        "decay": (1e-2, 0.1, EMBED),
        "no_decay": (1e-2, 0.0, NORMS),
    }
    assert all(g["initial_lr"] == g["lr"] for g in opt.param_groups)
    # unset, the matrices follow optim.lr (the recipes' one-lr behaviour)
    opt = build_baseline_optimizer(model, report, cfg, OptimConfig(lr=1e-2))
    assert _groups(opt)[matrix_group][0] == 1e-2


def test_poet_groups_take_lr_and_poet_lr():
    torch.manual_seed(0)
    model = build_llama(TINY, 64)
    convert_to_poetx(model, POETConfig(bits=8, block_size=16))
    oc = OptimConfig(lr=1e-2, poet_lr=4e-3, poet_lr_scale=0.5, weight_decay=0.1,
                     betas=(0.9, 0.95), poet_betas=(0.9, 0.999))  # fmt: skip
    opt = build_optimizer(model, oc)
    groups = _groups(opt)
    betas = {g["name"]: tuple(g["betas"]) for g in opt.param_groups}
    assert betas == {"poet": (0.9, 0.999), "decay": (0.9, 0.95), "no_decay": (0.9, 0.95)}
    assert groups["decay"] == (1e-2, 0.1, EMBED)  # embeddings, lm_head: decayed
    assert groups["no_decay"] == (1e-2, 0.0, NORMS)
    lr, wd, _n = groups["poet"]
    assert (lr, wd) == (2e-3, 0.0)  # Q: poet_lr x scale, never decayed


def test_matrix_lr_is_refused_for_poet_methods():
    with pytest.raises(ValueError, match=r"optim\.matrix_lr"):
        Recipe(method="poetxq", optim={"matrix_lr": 1e-3})
    assert Recipe(method="muon", optim={"matrix_lr": 1e-3}).optim.matrix_lr == 1e-3
    with pytest.raises(ValueError, match=r"optim\.poet_betas"):
        Recipe(method="adamw", optim={"poet_betas": [0.9, 0.999]})
