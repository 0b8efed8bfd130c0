"""The FPO loop: deterministic batches, resumable state, the saved model."""

from __future__ import annotations

import json

import torch
from tiny_llama import tiny_llama
from transformers import AutoModelForCausalLM

from poetxq.adapt.fpo import FPOAdapter
from poetxq.adapt.loop import LoopConfig, adapt, batch_indices


def _tiny():
    return tiny_llama()


def _windows(n, seed):
    return torch.randint(0, 61, (n, 13), generator=torch.Generator().manual_seed(seed))


def test_batches_walk_seeded_epochs_without_repeats():
    seen = torch.cat([batch_indices(s, 2, 5, seed=7) for s in range(5)])  # 10 = two epochs
    assert sorted(seen[:5].tolist()) == list(range(5))
    assert sorted(seen[5:].tolist()) == list(range(5))
    assert torch.equal(batch_indices(3, 2, 5, seed=7), seen[6:8])  # a function of the step


def test_resumed_run_equals_the_uninterrupted_one(tmp_path):
    train, val = _windows(7, 1), _windows(3, 2)
    cfg = dict(batch_size=2, eval_every=0, eval_batches=1, save_every=2, log_every=1)
    whole = FPOAdapter(_tiny(), [1, 2], lr=1e-2)
    adapt(whole, train, val, LoopConfig(steps=4, **cfg), tmp_path / "a", echo=lambda _s: None)
    half = FPOAdapter(_tiny(), [1, 2], lr=1e-2)
    adapt(half, train, val, LoopConfig(steps=2, **cfg), tmp_path / "b", echo=lambda _s: None)
    resumed = FPOAdapter(_tiny(), [1, 2], lr=1e-2)  # a fresh load of the base model
    summary = adapt(resumed, train, val, LoopConfig(steps=4, **cfg), tmp_path / "b",
                    resume=True, echo=lambda _s: None)  # fmt: skip
    assert resumed.steps == 4
    for key, master in whole.masters.items():
        assert torch.equal(resumed.masters[key], master), key
        for name, value in whole.state[key].items():
            assert torch.equal(resumed.state[key][name], value), (key, name)
    first = json.loads((tmp_path / "a" / "summary.json").read_text())["first"]
    assert summary["first"] == first  # the pre-adaptation evaluation survives the resume
    rows = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "b" / "model"))
    for (layer, proj), master in whole.masters.items():
        weight = getattr(loaded.model.layers[layer].mlp, proj).weight
        assert torch.equal(weight, master)


def test_a_resume_without_the_ood_data_says_it_measures_none(tmp_path):
    """A run that tracked out-of-domain perplexity, resumed without --ood-data: one note says
    the comparison stops (summary.json's last evaluation has no ood_ppl)."""
    train, val, ood = _windows(7, 1), _windows(3, 2), _windows(3, 3)
    cfg = dict(batch_size=2, eval_every=0, eval_batches=1, save_every=1, log_every=1)
    quiet = lambda _s: None  # noqa: E731
    adapt(FPOAdapter(_tiny(), [2], lr=1e-2), train, val, LoopConfig(steps=1, **cfg),
          tmp_path, ood_val=ood, echo=quiet)  # fmt: skip
    said: list[str] = []
    summary = adapt(FPOAdapter(_tiny(), [2], lr=1e-2), train, val, LoopConfig(steps=2, **cfg),
                    tmp_path, resume=True, echo=said.append)  # fmt: skip
    notes = [line for line in said if line.startswith("note:")]
    assert len(notes) == 1 and "without it this session measures none" in notes[0]
    assert "ood_ppl" in summary["first"] and "ood_ppl" not in summary["last"]
    said.clear()  # with the same --ood-data again: no note
    adapt(FPOAdapter(_tiny(), [2], lr=1e-2), train, val, LoopConfig(steps=3, **cfg),
          tmp_path, ood_val=ood, resume=True, echo=said.append)  # fmt: skip
    assert not [line for line in said if line.startswith("note:")]


def test_a_signal_finishes_the_step_saves_the_state_and_the_resume_continues(tmp_path):
    """SIGINT during a step: the step completes, the state is saved at it (no periodic save
    due), no model is written, and --resume goes on to equal the uninterrupted run."""
    import signal

    train, val = _windows(7, 1), _windows(3, 2)
    cfg = dict(batch_size=2, eval_every=0, eval_batches=1, save_every=0, log_every=1)
    whole = FPOAdapter(_tiny(), [2], lr=1e-2)
    adapt(whole, train, val, LoopConfig(steps=4, **cfg), tmp_path / "a", echo=lambda _s: None)
    said: list[str] = []

    def echo(line: str) -> None:
        said.append(line)
        if line.startswith("step 2/"):
            signal.raise_signal(signal.SIGINT)  # as a Ctrl-C in the middle of the run

    stopped = adapt(FPOAdapter(_tiny(), [2], lr=1e-2), train, val, LoopConfig(steps=4, **cfg),
                    tmp_path / "b", echo=echo)  # fmt: skip
    assert stopped == {"stopped_by": "SIGINT", "step": 2}
    assert "stopped at step 2 of 4 by SIGINT" in said[-1] and "--resume" in said[-1]
    assert not (tmp_path / "b" / "model").exists()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers restored
    resumed = FPOAdapter(_tiny(), [2], lr=1e-2)
    adapt(resumed, train, val, LoopConfig(steps=4, **cfg), tmp_path / "b", resume=True,
          echo=lambda _s: None)  # fmt: skip
    for key, master in whole.masters.items():
        assert torch.equal(resumed.masters[key], master), key


def test_a_resume_checks_the_settings_and_steps_and_a_finished_run_is_left_alone(tmp_path):
    import pytest

    from poetxq.adapt.fpo import FPOError

    train, val = _windows(7, 1), _windows(3, 2)
    cfg = dict(batch_size=2, eval_every=0, eval_batches=1, save_every=0, log_every=1)
    settings = {"data": "pydoc", "method": "fpo", "bits": 16, "lr": 1e-2}
    quiet = lambda _s: None  # noqa: E731
    first = adapt(FPOAdapter(_tiny(), [2], lr=1e-2), train, val, LoopConfig(steps=2, **cfg),
                  tmp_path, settings=settings, echo=quiet)  # fmt: skip
    for key, value, flag in (("data", "embedded", "--data"), ("bits", 8, "--bits"),
                             ("method", "full", "--method")):  # fmt: skip
        with pytest.raises(FPOError, match=f"was adapted with {flag} .*resume with the same"):
            adapt(FPOAdapter(_tiny(), [2], lr=1e-2), train, val, LoopConfig(steps=3, **cfg),
                  tmp_path, resume=True, settings={**settings, key: value}, echo=quiet)  # fmt: skip
    with pytest.raises(FPOError, match="is at step 2; --steps 1 is below it"):
        adapt(FPOAdapter(_tiny(), [2], lr=1e-2), train, val, LoopConfig(steps=1, **cfg),
              tmp_path, resume=True, settings=settings, echo=quiet)  # fmt: skip
    rows = (tmp_path / "metrics.jsonl").read_text()
    said: list[str] = []
    again = adapt(FPOAdapter(_tiny(), [2], lr=1e-2), train, val, LoopConfig(steps=2, **cfg),
                  tmp_path, resume=True, settings=settings, echo=said.append)  # fmt: skip
    assert again == first and said == [f"'{tmp_path}' already finished at step 2; nothing to do"]
    assert (tmp_path / "metrics.jsonl").read_text() == rows  # nothing appended
