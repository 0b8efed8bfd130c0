"""Baselines: one step of each update rule vs a plain-torch reference written here from the papers;
every weight moves; optimizer-state bytes; a short CLI run per method learns."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from poetxq.baselines import (
    LowRankAdamW,
    QuantLinear,
    apollo_projection_seed,
    optimizer_state_bytes,
    quant_modules,
)
from poetxq.baselines.lowrank import _Blockwise8bit
from poetxq.baselines.qlinear import dequantize_groupwise, pack_int4, quantize_groupwise
from poetxq.model.config import ModelConfig
from poetxq.model.surgery import build_llama
from poetxq.tools.cli import main
from poetxq.training.baseline_methods import (
    build_baseline_optimizer,
    prepare_baseline,
    summarize_baseline,
)
from poetxq.training.recipe import BaselineConfig, OptimConfig

B1, B2, EPS, LR = 0.9, 0.999, 1e-8, 0.01


def ref_quant(w, g, bits, noise=None):
    """Asymmetric min/max group quantization, written out element by element per group."""
    flat = w.flatten().tolist()
    u = noise.flatten().tolist() if noise is not None else None
    L = 2**bits - 1
    codes, scales, zeros = [], [], []
    for start in range(0, len(flat), g):
        grp = flat[start : start + g]
        lo, hi = min(grp), max(grp)
        s = max(hi - lo, 1e-5) / L
        z = min(max(-round(lo / s), 0), L)
        for i, x in enumerate(grp):
            y = x / s
            if u is None:
                q = round(y)
            else:
                q = math.ceil(y) if u[start + i] < y - math.floor(y) else math.floor(y)
            codes.append(min(max(q + z, 0), L))
        scales.append(s)
        zeros.append(z)
    return codes, scales, zeros


def ref_dequant(codes, scales, zeros, g, shape):
    vals = [(c - zeros[i // g]) * scales[i // g] for i, c in enumerate(codes)]
    return torch.tensor(vals, dtype=torch.float64).reshape(shape)


def test_group_quantization_matches_reference(gen):
    w = torch.randn(5, 60, generator=gen) * 0.05  # 300 elements: a ragged last group of 44
    noise = torch.rand(w.shape, generator=gen)
    for bits, g, nz in ((8, 256, None), (8, 128, noise), (4, 64, None)):
        codes, scales, zeros = quantize_groupwise(w, g, bits, nz)
        rc, rs, rz = ref_quant(w.double(), g, bits, nz)
        assert codes.flatten().tolist() == rc
        torch.testing.assert_close(scales.flatten().double(), torch.tensor(rs, dtype=torch.float64),
                                   rtol=1e-6, atol=0)  # fmt: skip
        assert zeros.flatten().tolist() == rz
        deq = dequantize_groupwise(codes, scales, zeros, g)
        torch.testing.assert_close(deq.double(), ref_dequant(rc, rs, rz, g, w.shape), rtol=1e-5,
                                   atol=1e-7)  # fmt: skip
    packed = pack_int4(torch.tensor([1, 15, 7, 0, 9], dtype=torch.uint8))
    assert packed.tolist() == [0x1F, 0x70, 0x90]


def test_stochastic_rounding_is_unbiased():
    w = torch.full((1, 256), 0.3)
    w[0, 0], w[0, -1] = 0.0, 1.0  # scale 1/255: 0.3 lies at 76.5 steps
    g = torch.Generator().manual_seed(0)
    mean = torch.stack([
        dequantize_groupwise(*quantize_groupwise(w, 256, 8, torch.rand(w.shape, generator=g)), 256)
        for _ in range(400)
    ]).mean(0)  # fmt: skip
    assert abs(mean[0, 1:-1].mean().item() - 0.3) < 2e-4


def adam_dir(moments, r, t, corrected=True):
    """Adam direction at step t from the moments list [m, v] (updated in place); with
    ``corrected=False`` the uncorrected m / (√v + ε) (APOLLO over float weights)."""
    moments[0] = B1 * moments[0] + (1 - B1) * r
    moments[1] = B2 * moments[1] + (1 - B2) * r * r
    if not corrected:
        return moments[0] / (moments[1].sqrt() + EPS)
    mhat, vhat = moments[0] / (1 - B1**t), moments[1] / (1 - B2**t)
    return mhat / (vhat.sqrt() + EPS)


def _opt(p, method, **kw):
    group = {"params": [p], "method": method, "rank": 3, "update_proj_gap": 200, **kw}
    return LowRankAdamW([group], lr=LR, betas=(B1, B2), eps=EPS, quant_modules=kw.pop("q", ()))


@pytest.mark.parametrize("shape", [(12, 8), (6, 10)])
def test_galore_two_steps_match_reference(gen, shape):
    w0 = torch.randn(shape, generator=gen, dtype=torch.float64).float()
    g1, g2 = (torch.randn(shape, generator=gen) for _ in range(2))
    p = nn.Parameter(w0.clone())
    opt = _opt(p, "galore", scale=0.25)
    # reference: SVD of the first gradient, rank 3, the smaller side projected
    u, _s, vh = torch.linalg.svd(g1, full_matrices=False)
    right = shape[0] >= shape[1]
    P = vh[:3] if right else u[:, :3]
    mom = [0.0, 0.0]
    w = w0.clone()
    for t, g in enumerate((g1, g2), start=1):
        r = g @ P.T if right else P.T @ g
        n = adam_dir(mom, r, t)
        w = w - LR * 0.25 * (n @ P if right else P @ n)
        p.grad = g.clone()
        opt.step()
        torch.testing.assert_close(p.detach(), w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scale_type,shape", [("channel", (12, 8)), ("channel", (6, 10)),
                                              ("tensor", (12, 8))])  # fmt: skip
def test_apollo_two_steps_match_reference(gen, scale_type, shape):
    w0 = torch.randn(shape, generator=gen)
    g1 = torch.randn(shape, generator=gen)
    p = nn.Parameter(w0.clone())
    opt = _opt(p, "apollo", scale=4.0, scale_type=scale_type, seed=7)
    m, n = shape
    right = m >= n
    pg = torch.Generator().manual_seed(apollo_projection_seed(7, 0, 0))
    P = torch.randn((3, n) if right else (m, 3), generator=pg) / math.sqrt(3)
    # second gradient: g1 plus a 10x larger part that the projection does not see, so the scaled
    # gradient's norm jumps and the norm-growth limiter binds
    z = torch.randn(shape, generator=gen)
    orth = z - z @ torch.linalg.pinv(P) @ P if right else z - P @ torch.linalg.pinv(P) @ z
    g2 = g1 + 10 * orth
    mom, prev, w = [0.0, 0.0], None, w0.clone()
    for t, g in enumerate((g1, g2), start=1):
        r = g @ P.T if right else P.T @ g
        d = adam_dir(mom, r, t, corrected=False)  # the limiter sees uncorrected norms
        if scale_type == "tensor":
            s = d.norm() / (r.norm() + 1e-8)
        elif right:  # one factor per row of G
            s = torch.stack([d[i].norm() / (r[i].norm() + 1e-8) for i in range(m)])[:, None]
        else:  # one factor per column
            s = torch.stack([d[:, j].norm() / (r[:, j].norm() + 1e-8) for j in range(n)])[None]
        gs = g * s
        if prev is not None:
            lim = max(gs.norm().item() / (prev + 1e-8), 1.01) / 1.01
            if t == 2:
                assert lim > 1.5  # the limiter is exercised
            gs = gs / lim
        prev = gs.norm().item()
        w = w - LR * math.sqrt(4.0) * gs * (math.sqrt(1 - B2**t) / (1 - B1**t))
        p.grad = g.clone()
        opt.step()
        torch.testing.assert_close(p.detach(), w, rtol=1e-5, atol=1e-6)


def test_plain_adamw_group_matches_torch(gen):
    w0 = torch.randn(7, 5, generator=gen)
    a, b = nn.Parameter(w0.clone()), nn.Parameter(w0.clone())
    mine = LowRankAdamW([{"params": [a], "method": "adamw"}], lr=LR, betas=(B1, B2), eps=EPS,
                        weight_decay=0.1)  # fmt: skip
    ref = torch.optim.AdamW([b], lr=LR, betas=(B1, B2), eps=EPS, weight_decay=0.1)
    for _ in range(3):
        g = torch.randn(7, 5, generator=gen)
        a.grad, b.grad = g.clone(), g.clone()
        mine.step()
        ref.step()
    # torch decays before the update, ours after (as the GaLore/APOLLO code): equal to O(lr^2 wd)
    torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=5e-5)


@pytest.mark.parametrize("method", ["qgalore", "qapollo"])
def test_quantized_one_step_matches_reference(gen, method):
    m, n, group = 16, 24, (256 if method == "qgalore" else 128)
    q = QuantLinear(torch.randn(m, n, generator=gen) * 0.05, group_size=group)
    w0 = q.dequantize().double()
    g = torch.randn(m, n, generator=gen)
    q.float_grad = g.clone()
    galore = method == "qgalore"
    opt = LowRankAdamW([{"params": [q.weight], "method": "galore" if galore else "apollo",
                         "rank": 3, "scale": 0.25 if galore else 1.0, "proj_bits": 4 if galore
                         else 32, "state_bits": 8 if galore else 32, "lazy": galore}],
                       lr=LR, betas=(B1, B2), eps=EPS, quant_modules=[q],
                       rounding_seed=5)  # fmt: skip
    codes_before = q.weight.clone()
    opt.step()
    # reference (m < n: left projection [m, 3])
    if galore:
        u, _s, _vh = torch.linalg.svd(g, full_matrices=False)
        pc, ps, pz = ref_quant(u[:, :3].double(), 256, 4)  # INT4 projector, group 256
        P = ref_dequant(pc, ps, pz, 256, (m, 3)).float()
    else:
        pg = torch.Generator().manual_seed(apollo_projection_seed(0, 0, 0))
        P = torch.randn(m, 3, generator=pg) / math.sqrt(3)
    r = P.T @ g
    d = adam_dir([0.0, 0.0], r, 1)
    if galore:
        upd = 0.25 * (P @ d)
    else:
        s = torch.stack([d[:, j].norm() / (r[:, j].norm() + 1e-8) for j in range(n)])[None]
        upd = g * s
    w1 = w0 - LR * upd.double()
    noise = torch.rand((m, n), generator=torch.Generator().manual_seed(5))
    rc, rs, rz = ref_quant(w1, group, 8, noise)
    torch.testing.assert_close(q.scales.flatten().double(), torch.tensor(rs, dtype=torch.float64),
                               rtol=1e-5, atol=0)  # fmt: skip
    assert q.zeros.flatten().tolist() == rz
    got = q.weight.flatten().tolist()
    mismatch = sum(a != b for a, b in zip(got, rc, strict=True))
    assert mismatch <= 2, mismatch  # float32 vs float64 at a rounding boundary, at most
    assert (q.weight != codes_before).sum() > m * n // 4
    state = opt.state[q.weight]
    if galore:  # 8-bit blockwise moments hold (1 - b1) r and (1 - b2) r^2
        assert state["exp_avg"].dtype == torch.uint8
        m1 = opt._m8.dequantize(state["exp_avg"], state["exp_avg_absmax"])
        torch.testing.assert_close(m1, (1 - B1) * r, rtol=0, atol=0.02 * (1 - B1) * r.abs().max())


def test_8bit_state_map_is_copied_to_each_device_once(gen, monkeypatch):
    """The 8-bit moments' quantization maps are copied to a device once and kept: a host copy
    per call blocks the host until the GPU's queue drains (four per matrix per step before)."""
    store = _Blockwise8bit(signed=True)
    copies, real_to = [], torch.Tensor.to

    def spy(self, *args, **kwargs):
        if self is store.code:
            copies.append(args)
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", spy)
    meta = torch.device("meta")  # a device other than the host's, with no kernels needed
    first, again = store.code_on(meta), store.code_on(meta)
    assert first is again and first.device == meta and first.shape == store.code.shape
    assert len(copies) == 1
    # the optimizer's steps go through code_on: one cached map per device it has seen
    q = QuantLinear(torch.randn(16, 24, generator=gen) * 0.05, group_size=256)
    opt = LowRankAdamW([{"params": [q.weight], "method": "galore", "rank": 3, "state_bits": 8}],
                       lr=LR, quant_modules=[q])  # fmt: skip
    for _ in range(3):
        q.float_grad = torch.randn(16, 24, generator=gen)
        opt.step()
    assert list(opt._m8._codes) == [torch.device("cpu")] == list(opt._v8._codes)
    assert torch.equal(opt._m8._codes[torch.device("cpu")], opt._m8.code)


TINY_MODEL = ModelConfig(hidden_size=32, intermediate_size=48, num_attention_heads=2,
                         num_hidden_layers=1)  # fmt: skip


def _tiny(method, **cfg):
    torch.manual_seed(0)
    model = build_llama(TINY_MODEL, 64)
    bcfg = BaselineConfig(**{"rank": 4, "update_proj_gap": 2, **cfg})
    report = prepare_baseline(model, method, bcfg)
    opt = build_baseline_optimizer(model, report, bcfg, OptimConfig(lr=1e-2))
    return model, report, bcfg, opt


def _train_steps(model, opt, steps):
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        out = model(input_ids=tokens[:, :-1], labels=tokens[:, 1:])
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


METHODS = ["adamw", "muon", "galore", "apollo", "qgalore", "qapollo"]


@pytest.mark.parametrize("method", METHODS)
def test_every_weight_changes_in_three_steps(method):
    model, report, _cfg, opt = _tiny(method)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _train_steps(model, opt, 3)
    after = model.state_dict()
    weights = [k for k in before if not k.endswith(("scales", "zeros"))]
    unchanged = [k for k in weights if torch.equal(before[k], after[k])]
    assert not unchanged, unchanged
    qs = quant_modules(model)
    assert (
        len(qs)
        == (len(report.targets) if method.startswith("q") else 0)
        == (7 if method.startswith("q") else 0)
    )
    for q in qs:
        assert q.weight.dtype == torch.uint8 and q.float_grad is None


@pytest.mark.parametrize("method", METHODS)
def test_summary_counts_what_the_optimizer_updates(method):
    """The summary's trainable count is every weight the optimizer updates each step, as for
    POET: Q-GaLore / Q-APOLLO's int8 weights (requires_grad=False codes) count beside the float
    parameters and are named as such, so a quantized baseline counts what its float twin does."""
    model, _report, cfg, opt = _tiny(method)
    h, i, layers, vocab = 32, 48, 1, 64  # TINY_MODEL, untied lm_head, one kv head per head
    linear = layers * (4 * h * h + 3 * i * h)  # q, k, v, o + gate, up, down, no biases
    rest = 2 * vocab * h + (2 * layers + 1) * h  # embeddings + lm_head, RMSNorm weights
    assert (linear, rest) == (8704, 4192)
    line = summarize_baseline(model, _report, cfg).splitlines()[-1]
    if method.startswith("q"):
        assert line == (
            f"  trainable: 12,896 parameters = 8,704 int8 weights (updated in place by {method} "
            "every step: dequantized, updated, re-quantized; no autograd gradient) + 4,192 float "
            "(the unquantized rest: embeddings, lm_head, norms)"
        )
        assert sum(q.weight.numel() for q in quant_modules(model)) == linear
    else:
        assert line == "  trainable: 12,896 float parameters"
    # the same number the optimizer holds, int8 codes included
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == linear + rest


def _expected_state_bytes(model, report, cfg, method):
    targets = {id(model.get_submodule(n).weight): model.get_submodule(n).weight.shape
               for n in report.targets}  # fmt: skip
    total = 0
    for p in model.parameters():
        if method == "adamw" or (method == "muon" and id(p) not in targets):
            total += 8 * p.numel() + 4  # fp32 m, v and torch's fp32 step tensor
        elif method == "muon":
            total += 4 * p.numel()  # one fp32 momentum buffer
        elif id(p) not in targets:
            total += 8 * p.numel()  # plain AdamW moments (our step count is an int)
        else:
            m, n = p.shape
            r = min(cfg.rank, m, n)
            low = m * r if m >= n else r * n
            proj = r * n if m >= n else m * r
            if method == "qgalore":  # 8-bit moments + absmax per 256, INT4 projector, 1st vector
                total += 2 * (low + 4 * math.ceil(low / 256))
                total += math.ceil(proj / 2) + 8 * math.ceil(proj / 256)
                total += 4 * (n if m >= n else m)
            else:
                total += 8 * low + 4 * proj
                if method in ("apollo", "qapollo"):
                    total += 4  # the limiter's previous norm
    return total


@pytest.mark.parametrize("method", METHODS)
def test_optimizer_state_bytes_match_formula(method):
    model, report, cfg, opt = _tiny(method)
    _train_steps(model, opt, 1)
    assert optimizer_state_bytes(opt) == _expected_state_bytes(model, report, cfg, method)


def test_lazy_refresh_doubles_the_gap(gen):
    p = nn.Parameter(torch.randn(8, 6, generator=gen))
    opt = _opt(p, "galore", update_proj_gap=1, lazy=True, queue_size=2, cos_threshold=0.4)
    base = torch.randn(8, 6, generator=gen)
    for _ in range(3):  # nearly the same gradient: first singular vectors stay aligned
        p.grad = base + 0.01 * torch.randn(8, 6, generator=gen)
        opt.step()
    state = opt.state[p]
    assert state["refreshes"] == 3 and state["gap"] == 2
    assert all(abs(c) > 0.9 for c in state["cos_queue"])


# --- a short CLI run per method (the TINY arguments of tests/test_cli.py) ---
TINY = [
    "--data", "pydoc", "--vocab-size", "512", "--seq-len", "32", "--batch-size", "8",
    "--set", "poet.block_size=16", "--eval-every", "100", "--no-progress", "--max-steps", "16",
    "--set", "model.hidden_size=64", "--set", "model.intermediate_size=136",
    "--set", "model.num_attention_heads=4", "--set", "model.num_hidden_layers=2",
    "--set", "train.log_every=4", "--set", "optim.warmup_steps=4", "--lr", "1e-2",
    "--set", "baseline.rank=8", "--set", "baseline.update_proj_gap=8",
    "--set", "train.eval_max_batches=4",
]  # fmt: skip


@pytest.fixture
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("POETXQ_CACHE", str(tmp_path_factory.getbasetemp() / "data-cache"))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["poetx", *METHODS])
def test_cli_run_learns(tmp_path, _cache, method, capsys):
    assert main(["train", *TINY, "--method", method, "--output-dir", str(tmp_path),
                 "--run-name", method]) == 0  # fmt: skip
    run = tmp_path / method
    # the printed trainable count: TINY's 2 layers of d 64, ffn 136, vocab 512, untied lm_head
    linear, rest = 2 * (4 * 64 * 64 + 3 * 136 * 64), 2 * 512 * 64 + 5 * 64
    out = capsys.readouterr().out
    if method.startswith("q"):
        assert (
            f"  trainable: {linear + rest:,} parameters = {linear:,} int8 weights (updated in "
            f"place by {method} every step" in out
        )
    elif method != "poetx":
        assert f"  trainable: {linear + rest:,} float parameters\n" in out
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r and "val_ppl" not in r]
    evals = [r["val_ppl"] for r in records if "val_ppl" in r]
    logged = [r for r in records if "grad_norm" in r]
    # poet_lr is logged by the POET methods only (a baseline has no orthogonal group)
    assert all((r.get("poet_lr", 0) > 0) == method.startswith("poet") for r in logged), logged[0]
    assert losses[-1] < losses[0] - 0.3, losses
    assert evals[-1] < 0.6 * evals[0], evals
    state = load_file(run / "model.safetensors")
    key = "model.layers.0.mlp.down_proj"
    if method.startswith("q"):
        assert state[f"{key}.weight"].dtype == torch.uint8 and f"{key}.scales" in state
    elif method == "poetx":
        assert f"{key}.frozen.weight" in state and state[f"{key}.frozen.weight"].is_floating_point()
    else:
        assert state[f"{key}.weight"].dtype == torch.float32


def test_a_rank_at_least_a_layer_width_is_noted():
    """LowRankAdamW projects at min(rank, m, n): a rank of a layer's smaller side or more
    projects nothing away there, and the summary says so (TINY_MODEL: every side is 32 or 48)."""
    model, report, cfg, _ = _tiny("qgalore", rank=32)
    notes = [ln for ln in summarize_baseline(model, report, cfg).splitlines() if "note:" in ln]
    assert notes == [
        "  note: rank 32 is at least min(out, in) = 32 of 7 of 7 target layers: they train at "
        "full rank (nothing projected away); set baseline.rank below 32 for a low-rank run"
    ]
    model, report, cfg, _ = _tiny("galore", rank=31)
    assert "note:" not in summarize_baseline(model, report, cfg)
