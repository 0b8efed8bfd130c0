"""Recipe composition: ``base:`` files, per-size ``by_model`` overrides, ``MODEL:METHOD``
shorthands, errors that name the file that set a bad key, and run labels."""

import os
from pathlib import Path

import pytest
import yaml

from poetxq.training.recipe import RecipeError, method_label, run_label
from poetxq.training.recipe_files import load_recipe

ROOT = Path(__file__).resolve().parents[1]
MODELS = sorted(p.stem for p in (ROOT / "recipes/models").glob("*.yaml"))
METHODS = sorted(p.stem for p in (ROOT / "recipes/methods").glob("*.yaml"))

# the Llama shapes of the GaLore / POET papers
SHAPES = {
    "llama-60m": (512, 1280, 8, 8),
    "llama-130m": (768, 2048, 12, 12),
    "llama-350m": (1024, 2736, 16, 24),
    "llama-1b": (2048, 5632, 32, 24),
    "llama-3b": (2560, 7168, 32, 32),
    "llama-8b": (4096, 14336, 32, 32),
    "llama-13b": (5120, 13824, 40, 40),
    "llama-70b": (8192, 28672, 64, 80),  # Llama-2-70B's shape (GQA, 8 KV heads)
}


def test_all_sizes_and_methods_exist():
    assert sorted(SHAPES) == MODELS
    assert set(METHODS) == {"poetxq", "poetxq4", "poetxq-fs", "poetx", "qgalore", "qapollo",
                            "galore", "apollo", "adamw", "muon"}  # fmt: skip


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("method", METHODS)
def test_every_combination_validates(model, method):
    r = load_recipe(f"{model}:{method}")
    m = r.model
    assert (m.hidden_size, m.intermediate_size, m.num_attention_heads,
            m.num_hidden_layers) == SHAPES[model]  # fmt: skip
    assert r.train.batch_size * r.train.grad_accum == 512 and r.train.seq_len == 256
    assert r.data.source == "hf:allenai/c4" and r.data.hf_config == "en"
    assert r.data.max_train_tokens == r.train.max_steps * 512 * 256
    assert run_label(r) == f"{model}-{method}"
    assert r.notes == []  # no setting the method ignores


def test_per_size_rates_come_from_by_model():
    # 60M: the 150M-token quality study's best point (lr 1e-2, poet_lr 4e-3), the script's T = 200;
    # 3B: the qpoet script's --lr 0.001 --poet_lr 0.0005 with the method file's T = 400
    r60, r3 = load_recipe("llama-60m:poetxq"), load_recipe("llama-3b:poetxq")
    assert (r60.optim.lr, r60.optim.poet_lr, r60.poet.merge_interval) == (1e-2, 4e-3, 200)
    assert (r3.optim.lr, r3.optim.poet_lr, r3.poet.block_size, r3.poet.merge_interval) == (
        1e-3, 5e-4, 256, 400)  # fmt: skip
    # poetxq4 inherits poetxq's by_model through its own base
    r4 = load_recipe("llama-60m:poetxq4")
    assert (r4.poet.bits, r4.optim.poet_lr) == (4, 4e-3)
    q8 = load_recipe("llama-8b:qgalore")
    assert (q8.optim.lr, q8.baseline.rank, q8.baseline.update_proj_gap) == (4e-3, 1024, 500)
    assert load_recipe("llama-130m:apollo").baseline.rank == 192


def test_base_paths_relative_and_own_keys_win(tmp_path):
    sub = tmp_path / "mine"
    sub.mkdir()
    f = sub / "r.yaml"
    rel = [os.path.relpath(ROOT / "recipes" / p, sub)
           for p in ("models/llama-60m.yaml", "methods/poetxq.yaml")]  # fmt: skip
    assert all(r.startswith("..") for r in rel)
    f.write_text(
        f"base: [{rel[0]}, {rel[1]}]\noptim: {{poet_lr: 3.0e-03}}\ntrain: {{max_steps: 7}}\n"
    )
    r = load_recipe(f)
    assert r.name == "llama-60m" and r.model.hidden_size == 512
    assert r.optim.poet_lr == 3e-3  # own key beats by_model
    assert r.optim.lr == 1e-2  # by_model still applies to keys the file does not set
    assert r.train.max_steps == 7 and r.train.batch_size == 256
    # overrides come last
    assert load_recipe(f, {"optim.poet_lr": 1e-4}).optim.poet_lr == 1e-4


def _write(path: Path, tree) -> Path:
    path.write_text(yaml.safe_dump(tree))
    return path


def test_bad_key_in_base_names_that_file(tmp_path):
    base = _write(tmp_path / "base.yaml", {"poet": {"blok_size": 32}})
    top = _write(tmp_path / "top.yaml", {"base": "base.yaml", "train": {"max_steps": 5}})
    with pytest.raises(RecipeError) as exc:
        load_recipe(top)
    msg = str(exc.value)
    assert msg.startswith(f"{base.resolve()}: unknown key 'poet.blok_size'")
    assert "block_size" in msg and "\n" not in msg


def test_bad_value_in_base_names_file_and_allowed_values(tmp_path):
    base = _write(tmp_path / "base.yaml", {"poet": {"variant": "slow"}})
    top = _write(tmp_path / "top.yaml", {"base": ["base.yaml"]})
    with pytest.raises(RecipeError) as exc:
        load_recipe(top)
    msg = str(exc.value)
    assert msg.startswith(f"{base.resolve()}: key 'poet.variant'")
    assert "'fast'" in msg and "'mem'" in msg


def test_bad_value_in_by_model_names_the_method_file(tmp_path):
    _write(tmp_path / "model.yaml", {"name": "m1", "model": {"hidden_size": 128}})
    meth = _write(tmp_path / "meth.yaml", {"by_model": {"m1": {"optim": {"lr": -1}}}})
    top = _write(tmp_path / "top.yaml", {"base": ["model.yaml", "meth.yaml"]})
    with pytest.raises(RecipeError, match=rf"^{meth.resolve()} \(by_model.m1\): key 'optim.lr'"):
        load_recipe(top)


def test_structural_errors(tmp_path):
    a = _write(tmp_path / "a.yaml", {"base": "b.yaml"})
    _write(tmp_path / "b.yaml", {"base": "a.yaml"})
    with pytest.raises(RecipeError, match="cycle"):
        load_recipe(a)
    with pytest.raises(RecipeError, match=r"base of .*does not exist"):
        load_recipe(_write(tmp_path / "c.yaml", {"base": "nope.yaml"}))
    with pytest.raises(RecipeError, match="'base' must be a path"):
        load_recipe(_write(tmp_path / "d.yaml", {"base": {"x": 1}}))
    with pytest.raises(RecipeError, match=r"unknown model 'llama-2t'.*llama-60m"):
        load_recipe("llama-2t:poetxq")
    with pytest.raises(RecipeError, match=r"unknown method 'sgd'.*qgalore"):
        load_recipe("llama-60m:sgd")


def test_tiny_recipes_unchanged_and_labels():
    tiny = load_recipe(ROOT / "recipes/tiny/poetxq.yaml")
    assert tiny.train.gradient_checkpointing is False
    assert run_label(tiny) == "tiny-poetxq"
    assert run_label(load_recipe(None, {"method": "adamw"})) == "tiny-adamw"
    assert run_label(load_recipe(None, {"poet.bits": 16})) == "tiny-poetx"
    assert method_label(load_recipe(None, {"poet.bits": 4})) == "poetxq4"
    assert run_label(load_recipe(ROOT / "recipes/tiny/qgalore.yaml")) == "tiny-qgalore"


def test_data_flag_replaces_the_hub_source():
    from poetxq.tools.cli import build_parser
    from poetxq.tools.cli_train_flags import train_overrides as _overrides

    args = build_parser().parse_args(["train", "--recipe", "llama-60m:poetxq", "--data", "/c4"])
    r = load_recipe(args.recipe, _overrides(args))
    assert (r.data.source, r.data.hf_config, r.data.hf_val_split) == ("/c4", None, None)
    assert r.data.vocab_size == 32000  # the rest of the recipe's data section stays


def test_c4_recipe_offline_is_one_error_naming_the_choices(tmp_path, capsys, monkeypatch):
    from poetxq.tools.cli import main

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("POETXQ_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "runs"
    assert main(["train", "--recipe", "llama-60m:poetxq", "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "allenai/c4" in err[0]
    assert "c4-train.*.json.gz" in err[0] and "--data embedded" in err[0]
    assert not out.exists()


def test_by_model_keys_name_existing_model_files():
    for path in (ROOT / "recipes/methods").glob("*.yaml"):
        table = yaml.safe_load(path.read_text()).get("by_model", {})
        assert set(table) <= set(MODELS), f"{path.name}: {set(table) - set(MODELS)}"


def test_unknown_top_level_key_lists_composition_keys(tmp_path):
    f = _write(tmp_path / "m.yaml", {"by_modle": {}})
    with pytest.raises(RecipeError, match=r"unknown key 'by_modle'.*base, by_model"):
        load_recipe(f)
