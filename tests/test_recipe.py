"""Recipe schema: defaults, YAML files, overrides and one-line errors."""

from pathlib import Path

import pytest
import yaml

from poetxq.training.recipe import Recipe, RecipeError, dump_recipe
from poetxq.training.recipe_files import load_recipe, parse_override

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").rglob("*.yaml"))


def test_recipes_exist():
    assert RECIPES, "no recipe files found"


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_recipe_validates(path):
    recipe = load_recipe(path)
    assert recipe.poet.block_size <= recipe.model.hidden_size


def test_tiny_recipe_file_equals_embedded_default():
    assert load_recipe(ROOT / "recipes/tiny/poetxq.yaml") == Recipe()


def test_round_trip_and_overrides(tmp_path):
    r = load_recipe(None, {"train.max_steps": 7, "poet.bits": 16, "data.source": "pydoc"})
    assert (r.train.max_steps, r.poet.bits, r.data.source) == (7, 16, "pydoc")
    f = tmp_path / "r.yaml"
    f.write_text(dump_recipe(r))
    assert load_recipe(f) == r
    assert parse_override("optim.lr=3e-4") == ("optim.lr", 3e-4)
    assert parse_override("poet.freeze_orthogonal=true") == ("poet.freeze_orthogonal", True)
    with pytest.raises(RecipeError, match=r"section\.key=value"):
        parse_override("optim.lr")
    with pytest.raises(RecipeError, match=r"override '=3' has no key before '='"):
        parse_override("=3")
    with pytest.raises(RecipeError, match=r"'train.max_steps=' has no value after '='"):
        parse_override("train.max_steps=")
    assert parse_override("train.max_steps=null") == ("train.max_steps", None)


def test_typo_key_names_file_key_and_allowed(tmp_path):
    f = tmp_path / "typo.yaml"
    f.write_text(yaml.safe_dump({"poet": {"blok_size": 32}}))
    with pytest.raises(RecipeError) as exc:
        load_recipe(f)
    msg = str(exc.value)
    assert str(f) in msg and "poet.blok_size" in msg and "block_size" in msg
    assert "\n" not in msg


@pytest.mark.parametrize(
    "tree,needle",
    [
        ({"poet": {"bits": 3}}, "poet.bits"),
        ({"poet": {"quant_type": "int3"}}, "poet.quant_type"),
        ({"poet": {"variant": "slow"}}, "poet.variant"),
        ({"poet": {"gemm": "fp8"}}, "poet.gemm"),
        ({"poet": {"gemm": "int8", "bits": 4}}, r"poet.gemm: int8 needs an int8 W0.*NF4/FP4"),
        ({"method": "poetx", "poet": {"gemm": "int8"}}, r"poet.bits 16 \(unquantized, method "),
        ({"poet": {"block_size": 512}}, "exceeds the smallest layer dimension"),
        ({"model": {"hidden_size": 250}}, "not divisible"),
        ({"model": {"hidden_size": 100}}, "per-head width 25 is odd.*quotient is even"),
        ({"model": {"head_dim": 3}}, "per-head width 3 is odd.*set model.head_dim to an even"),
        ({"model": {"head_dim": 8}}, "exceeds the smallest layer dimension 32;"),  # 4 heads x 8
        (
            {"model": {"num_key_value_heads": 1}, "poet": {"block_size": 128}},
            "exceeds the smallest layer dimension 64;",
        ),  # one key/value head of 64
        ({"train": {"max_steps": 0}}, "train.max_steps"),
        ({"data": {"val_fraction": 0.9}}, "data.val_fraction"),
        ([1, 2], "mapping"),
        ({"optim": {"betas": [1.5, 0.9]}}, r"optim\.betas\.0': Input should be less than 1"),
        ({"optim": {"betas": [0.9, 1.0]}}, r"optim\.betas\.1': Input should be less than 1"),
        ({"optim": {"betas": [-0.1, 0.9]}}, r"optim\.betas\.0': Input should be greater"),
        ({"poet": {"target_modules": []}}, r"poet\.target_modules is empty; list one or more"),
        ({"baseline": {"target_modules": []}}, "baseline.target_modules is empty"),
    ],
)
def test_bad_values(tmp_path, tree, needle):
    f = tmp_path / "bad.yaml"
    f.write_text(yaml.safe_dump(tree))
    with pytest.raises(RecipeError, match=needle):
        load_recipe(f)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(RecipeError, match="does not exist"):
        load_recipe(tmp_path / "nope.yaml")
    f = tmp_path / "broken.yaml"
    f.write_text("poet: [unclosed")
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(f)
    f.write_text("# only a comment\n")  # empty: refused, not silently the tiny defaults
    with pytest.raises(RecipeError, match="the file is empty") as exc:
        load_recipe(f)
    assert "\n" not in str(exc.value) and str(f) in str(exc.value)


def test_8bit_optimizer_states_only_for_poet_methods():
    assert load_recipe(None, {"optim.state_bits": 8}).optim.state_bits == 8
    with pytest.raises(RecipeError, match="state_bits 8 applies to the POET methods"):
        load_recipe(None, {"method": "adamw", "optim.state_bits": 8})


def test_duplicate_yaml_key_is_one_error(tmp_path):
    p = tmp_path / "dup.yaml"
    p.write_text("train:\n  max_steps: 10\n  max_steps: 20\n")
    with pytest.raises(RecipeError, match="key 'max_steps' appears twice") as exc:
        load_recipe(p)
    assert "\n" not in str(exc.value) and str(p) in str(exc.value)


def test_seq_len_above_max_positions_raises_them_with_a_note():
    r = load_recipe(None, {"train.seq_len": 2048, "model.max_position_embeddings": 1024})
    assert r.model.max_position_embeddings == 2048
    assert len(r.notes) == 1 and "train.seq_len 2048 exceeds" in r.notes[0]
    assert "1024" in r.notes[0]
    assert load_recipe(None, {"train.seq_len": 1024}).notes == []
    # a checkpoint's own limit is checked where it is read (an error there, no note here; the
    # explicit rates keep the continued-training note away, tests/test_continued_training.py)
    pre = {"model.pretrained": "some/dir", "optim.lr": 1e-4, "optim.poet_lr": 1e-4}
    assert load_recipe(None, {"train.seq_len": 2048, **pre}).notes == []


@pytest.mark.parametrize(
    "text,key,expected",
    [
        ("train:\n  max_steps: true\n", "train.max_steps", "an integer, not a boolean"),
        ("optim:\n  lr: false\n", "optim.lr", "a number, not a boolean"),
        ("data:\n  split_seed: yes\n", "data.split_seed", "an integer, not a boolean"),
        ("model:\n  num_key_value_heads: true\n", "model.num_key_value_heads",
         "an integer, not a boolean"),
        ("optim:\n  betas: [true, 0.9]\n", "optim.betas", "a number, not a boolean"),
        # pydantic's lax mode would read "yes", 1 or "false" as booleans
        ('train:\n  cuda_graph: "yes"\n', "train.cuda_graph", "true or false"),
        ("train:\n  gradient_checkpointing: 1\n", "train.gradient_checkpointing", "true or false"),
        ('poet:\n  double_quant: "false"\n', "poet.double_quant", "true or false"),
        ("train:\n  fuse_elementwise: gpu\n", "train.fuse_elementwise", "true or false or 'auto'"),
    ],
)  # fmt: skip
def test_booleans_and_numbers_do_not_mix(tmp_path, text, key, expected):
    f = tmp_path / "bool.yaml"
    f.write_text(text)
    with pytest.raises(RecipeError) as exc:
        load_recipe(f)
    msg = str(exc.value)
    assert msg.startswith(f"{f}: key '{key}': Input should be {expected}")
    assert "\n" not in msg
    # booleans stay booleans; integers still fill float fields
    r = load_recipe(None, {"model.tie_word_embeddings": True, "optim.lr": 1})
    assert r.model.tie_word_embeddings is True and r.optim.lr == 1.0


@pytest.mark.parametrize(
    "key,value",
    [("optim.lr", "inf"), ("optim.lr", "nan"), ("optim.poet_lr", "-inf"),
     ("optim.weight_decay", "inf"), ("optim.grad_clip", "inf"), ("optim.betas", [0.9, "nan"]),
     ("model.initializer_range", "inf"), ("baseline.scale", "inf")],
)  # fmt: skip
def test_non_finite_floats_are_rejected(key, value):
    value = [float(v) for v in value] if isinstance(value, list) else float(value)
    with pytest.raises(RecipeError, match=rf"key '{key}(\.1)?': Input should be a finite number"):
        load_recipe(None, {key: value})


def test_validate_command_reports_every_file(tmp_path, capsys):
    from poetxq.tools.cli import main

    good = ROOT / "recipes/tiny/poetxq.yaml"
    typo = tmp_path / "typo.yaml"
    typo.write_text("train:\n  max_stepz: 3\n")
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes(b"name: caf\xe9\n")
    args = [str(typo), str(good), str(tmp_path), str(latin1), str(tmp_path / "absent.yaml")]
    assert main(["validate", *args]) == 2
    out, err = capsys.readouterr()
    assert out.strip().splitlines() == [f"{good}: ok (tiny-poetxq: method=poetxq, bits=8, b=64)"]
    err = err.strip().splitlines()
    assert len(err) == 4 and all(line.startswith("poetxq: error: ") for line in err)
    assert "max_stepz" in err[0]
    assert f"recipe path '{tmp_path}' is a directory" in err[1]
    assert f"{latin1}: not UTF-8 text" in err[2]
    assert "absent.yaml' does not exist" in err[3]
    assert main(["validate", str(good)]) == 0
    adamw, qgalore = ROOT / "recipes/tiny/adamw.yaml", ROOT / "recipes/tiny/qgalore.yaml"
    capsys.readouterr()
    assert main(["validate", str(adamw), str(qgalore)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "method=adamw, lr=" in lines[0] and "rank" not in lines[0]  # adamw projects nothing
    assert "method=qgalore, rank=" in lines[1]
    # --set checks an override against the schema too, for every file
    assert main(["validate", str(good), "--set", "poet.block_size=128"]) == 0
    assert "b=128" in capsys.readouterr().out
    assert main(["validate", str(good), "--set", "train.fuse_elementwise=maybe"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("poetxq: error: ") and "train.fuse_elementwise" in err


def test_settings_the_method_ignores_get_a_note(capsys):
    """poet.* under a baseline and baseline.* under a POET method change nothing: a note (in
    validate's output and at the start of a run), not silence; the shipped recipes get none."""
    from poetxq.tools.cli import main

    qg = load_recipe("llama-1b:qgalore", {"poet.bits": 4, "poet.block_size": 128})
    assert qg.notes == [
        "poet.bits=4, poet.block_size=128: no effect with method qgalore (poet.* applies to "
        "poetxq and poetx only)"
    ]
    assert load_recipe("llama-1b:poetxq", {"baseline.rank": 8}).notes == [
        "baseline.rank=8: no effect with method poetxq (baseline.* applies to the baselines only)"
    ]
    assert load_recipe("llama-1b:qgalore", {"baseline.rank": 8}).notes == []
    for path in sorted((ROOT / "recipes").rglob("*.yaml")):
        if "models" not in path.parts and "methods" not in path.parts:
            assert load_recipe(str(path)).notes == [], path
    assert main(["validate", "llama-1b:qgalore", "--set", "poet.bits=4"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[1] == f"llama-1b:qgalore: note: {qg.notes[0].replace(', poet.block_size=128', '')}"


def test_override_is_shown_as_yaml_reads_it():
    """``--set key=`` is null and ``--set key=true`` is true in the message, as in the YAML."""
    with pytest.raises(RecipeError, match=r"^override train\.cuda_graph=null: "):
        load_recipe(None, {"train.cuda_graph": None})
    with pytest.raises(RecipeError, match=r"^override train\.max_steps=true: "):
        load_recipe(None, {"train.max_steps": True})
    with pytest.raises(RecipeError, match=r"^override train\.cuda_graph=1: "):
        load_recipe(None, {"train.cuda_graph": 1})


def test_a_warmup_as_long_as_the_run_gets_a_note():
    """optim.warmup_steps >= train.max_steps: the learning rate never reaches optim.lr; a
    note says so (validate's output, the start of a run); one step shorter warm-up: none."""
    r = load_recipe(None, {"train.max_steps": 20, "optim.warmup_steps": 20})
    assert r.notes == [
        "optim.warmup_steps 20 >= train.max_steps 20: the learning rate rises for the whole run "
        "and never reaches optim.lr; lower optim.warmup_steps for a short run"
    ]
    assert load_recipe(None, {"train.max_steps": 21, "optim.warmup_steps": 20}).notes == []


@pytest.mark.parametrize("key", ["base", "by_model.llama-60m", "by_model"])
def test_composition_keys_are_refused_as_overrides(key):
    """``base`` / ``by_model`` compose files; as a --set they are named as file-only keys (they
    used to be reported as unknown while the message listed them as allowed)."""
    with pytest.raises(RecipeError, match=f"override {key}: 'base' and 'by_model' compose"):
        load_recipe(None, {key: "x.yaml"})


def test_an_error_between_keys_of_a_section_names_every_source():
    """hidden_size vs num_attention_heads: the line names both overrides and the file, not
    only the first override (which may be the innocent one)."""
    with pytest.raises(RecipeError) as exc:
        load_recipe(None, {"model.hidden_size": 64, "model.num_attention_heads": 3})
    text = str(exc.value)
    assert "override model.hidden_size=64" in text
    assert "override model.num_attention_heads=3" in text
    assert "hidden_size 64 is not divisible by num_attention_heads 3" in text


def test_validate_says_when_a_file_names_no_model(capsys):
    """A method file alone validates on the schema's defaults (the embedded tiny model): one
    note says so and how to pick a model; files that name one get no such note."""
    from poetxq.tools.cli import main

    method = ROOT / "recipes/methods/poetxq4.yaml"
    assert (
        main(["validate", str(method), "llama-60m:poetxq4", str(ROOT / "recipes/tiny/poetxq.yaml")])
        == 0
    )
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == f"{method}: ok (tiny-poetxq4: method=poetxq, bits=4, b=256)"
    assert lines[1] == (
        f"{method}: note: it names no model, so the embedded tiny model's defaults fill in; give "
        "one with MODEL:METHOD (e.g. llama-60m:poetxq4) or a file whose base lists a model file"
    )
    assert len(lines) == 4 and "note" not in lines[2] + lines[3]


def test_the_no_model_note_suggests_a_method_that_exists(tmp_path, capsys):
    """A file that is not one of recipes/methods/ gets its recipe's method in the example, not
    its own file name (``llama-60m:b63`` names no method file)."""
    from poetxq.tools.cli import main

    f = tmp_path / "b63.yaml"
    f.write_text("poet: {block_size: 63}\n")
    assert main(["validate", str(f)]) == 0
    out = capsys.readouterr().out
    assert "(e.g. llama-60m:poetxq)" in out and "b63)" not in out


def test_a_shipped_recipe_path_from_another_folder_names_the_shipped_file(tmp_path, monkeypatch):
    """``recipes/tiny/qgalore.yaml`` run outside the checkout: the error points at the shipped
    file; a path that names no shipped recipe keeps the plain fix."""
    monkeypatch.chdir(tmp_path)
    shipped = (ROOT / "recipes/tiny/qgalore.yaml").resolve()
    with pytest.raises(RecipeError) as exc:
        load_recipe("recipes/tiny/qgalore.yaml")
    assert str(exc.value) == (
        f"recipe file 'recipes/tiny/qgalore.yaml' does not exist; the shipped one is '{shipped}' "
        "(relative paths start in the current folder)"
    )
    with pytest.raises(RecipeError, match="does not exist; pass an existing YAML file"):
        load_recipe("recipes/tiny/nope.yaml")


def test_validation_fills_dependent_keys_without_changing_what_it_was_given():
    """``method: poetx`` is ``poet.bits`` 16 and ``model.max_position_embeddings`` follows
    ``train.seq_len``, filled in at construction: the sections passed in are left as given
    (the schema never changes a validated object), and validating the result again changes
    nothing."""
    from poetxq.model.config import ModelConfig, POETConfig
    from poetxq.training.recipe import TrainConfig

    poet, model = POETConfig(bits=8), ModelConfig(max_position_embeddings=64)
    r = Recipe(method="poetx", poet=poet, model=model, train=TrainConfig(seq_len=256))
    assert r.poet.bits == 16 and r.model.max_position_embeddings == 256
    assert poet.bits == 8 and model.max_position_embeddings == 64
    assert "train.seq_len 256 exceeds model.max_position_embeddings 64" in r.notes[0]
    again = Recipe.model_validate(r.model_dump())
    assert again.poet.bits == 16 and again.model.max_position_embeddings == 256
