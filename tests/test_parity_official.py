"""evals/parity_official.py and its parts (parity_settings, parity_train, parity_summary): the
settings mapping, the shared batch order, the summary rule, and (where a local copy of the
official ``poet_torch`` exists in ``.official/``) both trainers end to end on a tiny model on the
CPU (official Triton kernels through the interpreter)."""

from __future__ import annotations

import importlib
import importlib.util
import math
import sys
import warnings
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
OFFICIAL = REPO / ".official"


def _load(name: str):
    sys.path.insert(0, str(REPO / "evals"))
    spec = importlib.util.spec_from_file_location(name, REPO / "evals" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _part(name: str):
    """A module of evals/ that parity_official imports by its bare name (the same object)."""
    sys.path.insert(0, str(REPO / "evals"))
    return importlib.import_module(name)


@pytest.fixture(scope="module")
def po():
    return _load("parity_official")


@pytest.fixture(scope="module")
def ps():
    return _part("parity_settings")


@pytest.fixture(scope="module")
def pt():
    return _part("parity_train")


@pytest.fixture(scope="module")
def psum():
    return _part("parity_summary")


def _token_data(n_train: int = 48, n_val: int = 6, seq: int = 16, vocab: int = 64):
    """Synthetic windows with structure a tiny model learns in a few steps (each token mostly
    follows from the previous one)."""
    from poetxq.data import TokenData

    gen = torch.Generator().manual_seed(5)
    n = n_train + n_val
    x = torch.empty(n, seq + 1, dtype=torch.long)
    x[:, 0] = torch.randint(0, vocab, (n,), generator=gen)
    for t in range(1, seq + 1):
        noise = torch.randint(0, vocab, (n,), generator=gen)
        keep = torch.rand(n, generator=gen) < 0.8
        x[:, t] = torch.where(keep, (x[:, t - 1] * 7 + 3) % vocab, noise)
    return TokenData(
        train=x[:n_train], val=x[n_train:], tokenizer=None, vocab_size=vocab,
        train_tokens=n_train * seq, val_tokens=n_val * seq, source_description="synthetic",
        eos_id=0,
    )  # fmt: skip


def _tiny(ps, **kw):
    base = dict(
        steps=4, poet_lr=2e-2, lr=1e-2, eval_every=2, seeds=[0], block_size=16,
        merge_interval=2, batch_size=4, seq_len=16, precision="fp32", val_tokens=None,
        log_every=1,
        model_overrides={"model.hidden_size": 32, "model.intermediate_size": 64,
                         "model.num_attention_heads": 2, "model.num_hidden_layers": 1},
    )  # fmt: skip
    return ps.Settings(**{**base, **kw})


# ------------------------------------------------------------------ no official code needed


def test_defaults_map_to_the_study_settings_with_equal_rotation_lr(ps):
    s = ps.Settings()
    assert (s.steps, s.poet_lr, s.eval_every, s.block_size, s.merge_interval) == (
        400, 8e-3, 50, 256, 200,
    )  # fmt: skip
    assert s.warmup_steps == 40 and s.eval_steps() == [0, 50, 100, 150, 200, 250, 300, 350, 400]
    r = ps.our_recipe(s, seed=3, poet_lr_scale=0.5)
    assert r.method == "poetxq" and r.poet.bits == 8 and r.poet.requant == "nearest"
    assert (r.poet.block_size, r.poet.merge_interval, r.poet.neumann_terms) == (256, 200, 3)
    assert r.poet.merge_at_end  # T divides 400: the official loop merges after step 400 too
    oc, tc = r.optim, r.train
    assert oc.poet_lr * oc.poet_lr_scale == pytest.approx(4e-3)  # = official 8e-3 x poet_scale 0.5
    assert (oc.lr, oc.weight_decay, oc.min_lr_ratio, oc.grad_clip) == (1e-2, 0.0, 0.1, 1.0)
    assert (tuple(oc.betas), oc.eps, oc.warmup_steps, oc.clip_rewarm_steps) == (
        (0.9, 0.999), 1e-6, 40, 10,
    )  # fmt: skip
    assert (tc.batch_size * tc.grad_accum, tc.seq_len, tc.seed, tc.max_steps) == (128, 256, 3, 400)
    assert tc.precision == "autocast" and r.model.hidden_size == 512
    assert not ps.our_recipe(ps.Settings(steps=300), 0, 0.5).poet.merge_at_end


def test_official_schedule_is_ours_one_step_behind_in_warmup_and_equal_after(ps):
    from poetxq.training.optim import cosine_lr_factor

    w, total, floor = 40, 400, 0.1
    assert ps.official_lr_factor(0, w, total, floor) == 0.0  # the script's first step: lr 0
    for step in range(1, w + 1):
        assert ps.official_lr_factor(step, w, total, floor) == pytest.approx(
            cosine_lr_factor(step - 1, w, total, floor)
        )
    for step in range(w, total + 1, 7):
        assert ps.official_lr_factor(step, w, total, floor) == pytest.approx(
            cosine_lr_factor(step, w, total, floor)
        )
    assert ps.official_lr_factor(total, w, total, floor) == pytest.approx(floor)


def test_official_loop_draws_the_micro_batches_our_trainer_draws(ps, pt, tmp_path, monkeypatch):
    """Record every micro-batch poetxq.training.train.train takes and compare with the parity
    script's batch source for the same seed (the official loop reads position k with .batch(k))."""
    import poetxq.training.train as train_mod

    seen: list[torch.Tensor] = []

    class Recording(train_mod.ShardedBatches):
        def batch(self, position: int) -> torch.Tensor:
            out = super().batch(position)
            seen.append(out.clone())
            return out

    monkeypatch.setattr(train_mod, "ShardedBatches", Recording)
    data = _token_data()
    s = _tiny(ps, steps=3, grad_accum=2, eval_every=0)
    pt.train_ours(s, 7, data, 0.5, tmp_path, lambda _line: None)
    assert len(seen) == 6  # 3 steps x 2 micro-batches
    source = ps.train_batches(data, s, 7)
    for k, batch in enumerate(seen):
        assert torch.equal(batch, source.batch(k))
    assert not torch.equal(ps.train_batches(data, s, 8).batch(0), seen[0])  # the seed matters


def test_summary_rule_on_hand_made_curves(psum):
    def run(seed, ours, official):
        pts = lambda v: [{"step": i * 10, "val_loss": x} for i, x in enumerate(v)]  # noqa: E731
        return {"seed": seed, "ours": {"val": pts(ours)}, "official": {"val": pts(official)}}

    one = psum.summarize([run(0, [5.0, 4.0], [5.0, 4.1])])
    assert one["seeds"] == 1 and one["final"]["difference"] == pytest.approx(0.1)
    assert one["final"]["agree"] is None and one["all_agree"] is None  # no noise estimate
    two = psum.summarize([run(0, [5.0, 4.0], [5.0, 4.05]), run(1, [5.0, 4.1], [5.0, 4.15])])
    f = two["final"]
    assert f["ours"] == pytest.approx(4.05) and f["official"] == pytest.approx(4.1)
    assert f["se"] == pytest.approx(math.sqrt(0.005 / 2 + 0.005 / 2)) and f["agree"]
    far = psum.summarize([run(0, [5.0, 4.0], [5.0, 4.5]), run(1, [5.0, 4.1], [5.0, 4.6])])
    assert far["final"]["agree"] is False and far["all_agree"] is False
    # step 0 compares the two initializations only: it never decides all_agree
    init = psum.summarize([run(0, [5.0, 4.0], [5.2, 4.05]), run(1, [5.0, 4.1], [5.2, 4.15])])
    assert init["steps"][0]["agree"] is False and init["all_agree"] is True
    assert psum.summarize([{"seed": 0, "ours": {"val": []}}]) == {"seeds": 0, "steps": []}
    bad = run(1, [5.0, 4.1], [5.0, 4.2])
    bad["official"]["val"][1]["val_loss"] = None
    bad["official"]["diverged"] = "training loss nan at step 10"
    div = psum.summarize([run(0, [5.0, 4.0], [5.0, 4.05]), bad])
    assert [r["step"] for r in div["steps"]] == [0]  # step 10 lacks a seed: not compared
    assert div["diverged_seeds"] == {"ours": [], "official": [1]} and div["all_agree"] is False


def test_previous_results_are_kept_only_when_they_compare_the_same_thing(po):
    doc = {"settings": {"steps": 400, "seeds": [0]}, "official_code": {"commit": "a"}}
    runs = [{"seed": 0, "ours": {}, "official": {}}, {"seed": 1, "ours": {}}]
    same = {"settings": {"steps": 400, "seeds": [0, 1]}, "official_code": {"commit": "a"},
            "runs": runs}  # fmt: skip
    assert po._finished_runs(same, doc) == runs[:1]  # seed 1 stopped half-way: run again
    with pytest.raises(po.PreviousMismatch, match="steps"):
        po._finished_runs({**same, "settings": {"steps": 300}}, doc)
    with pytest.raises(po.PreviousMismatch, match="official_code"):
        po._finished_runs({**same, "official_code": {"commit": "b"}}, doc)


def test_cli_without_the_official_copy_is_one_line(po, tmp_path, capsys):
    assert po.main(["--official", str(tmp_path), "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert "no official POET code" in err and err.count("\n") == 1
    assert not (tmp_path / "x.json").exists()


# ------------------------------------------------------------------ with the official code


@pytest.fixture(scope="module")
def poet():
    if not (OFFICIAL / "poet_torch" / "__init__.py").is_file():
        pytest.skip(
            "no local copy of the official POET code in .official/poet_torch (never committed; "
            "CI has none): see evals/parity_official.py for how to make one"
        )
    op = _load("official_poet")
    with warnings.catch_warnings():  # "CUDA is not available" on import without a GPU
        warnings.simplefilter("ignore", UserWarning)
        return op.load(OFFICIAL)


@pytest.mark.slow
def test_both_trainers_on_a_tiny_model_on_cpu(po, ps, poet, tmp_path):
    """Both sides train 4 steps (merge every 2, the last step included) under bf16 autocast (the
    default precision; the official custom ops through OFFICIAL_AUTOCAST) on the same batches and
    are scored on the same windows at steps 0, 2, 4; the losses fall and start alike."""
    if torch.cuda.is_available():
        pytest.skip("CPU test (the GPU runs the script itself)")
    assert ps.official_poet_scale(poet) == 0.5  # QPOETConfig.poet_scale @3a34bb6
    data = _token_data()
    s = _tiny(ps, precision="autocast")
    doc = po.run_parity(s, poet, data, device=torch.device("cpu"), work=tmp_path,
                        echo=lambda _line: None)  # fmt: skip
    run = doc["runs"][0]
    ours, off = run["ours"], run["official"]
    assert [p["step"] for p in ours["val"]] == [p["step"] for p in off["val"]] == [0, 2, 4]
    assert ours["merges"] == off["merges"] == 2
    assert off["qpoet_layers"] == 7  # q k v o gate up down: lm_head stays dense (as ours)
    assert "poet::cayley" in off["autocast_rules"] and ours["precision"] == "autocast"
    # under autocast the official Cayley-Neumann op runs in fp32: exact to rounding
    assert off["cayley_check"]["dtype"] == "float32"
    assert off["cayley_check"]["max_abs_error"] < 1e-6
    for side in (ours, off):
        losses = [p["val_loss"] for p in side["val"]]
        assert all(math.isfinite(x) for x in losses)
        assert losses[-1] < losses[0] - 0.05, losses
    # same windows, same untrained-model level: ln(vocab) give or take the init
    assert abs(ours["val"][0]["val_loss"] - off["val"][0]["val_loss"]) < 0.2
    rot = doc["mapping"]["rotation_lr"]
    assert rot["ours"]["effective"] == rot["official"]["effective"] == pytest.approx(1e-2)
    # the official Q group's lr at the last step, times POETAdamW's scale, is ours
    assert off["train"][-1]["poet_lr"] * 0.5 == pytest.approx(ours["train"][-1]["poet_lr"])
    assert off["train"][0]["clip"] == 1.0 and off["train"][2]["clip"] == pytest.approx(0.1)
    assert ours["train"][2]["clip"] == pytest.approx(0.1)  # both re-warm after the merge
    s_ = doc["summary"]
    assert s_["seeds"] == 1 and [r["step"] for r in s_["steps"]] == [0, 2, 4]
