"""Hostile and ordinary bad input (issue 55): run names and recipe paths that would leave the
output folder, argument errors as one line, plain-text documentation as data, and the small
wording cases (FPO targets, a refused pickle, report plots of other data, bf16 on a CPU)."""

from __future__ import annotations

import argparse
import json
import os
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from poetxq.tools.cli import build_parser, main


def _err_lines(capsys) -> list[str]:
    return capsys.readouterr().err.strip().splitlines()


def _files_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


# --------------------------------------------------------------------------------------------
# argument errors: one line `poetxq COMMAND: error: ...` naming the valid choices, exit 2
# --------------------------------------------------------------------------------------------

#: argv, the command the line names, pieces the line holds
ARGUMENT_ERRORS = [
    (["quantize-and-train", "--bits", "3"], "quantize-and-train",
     ["argument --bits: invalid choice: 3 (choose from 4, 8, 16)"]),
    (["quantize-and-train", "--quant-type", "int3"], "quantize-and-train",
     ["argument --quant-type: invalid choice: 'int3' (choose from 'nf4', 'fp4')"]),
    (["train", "--method", "sgd"], "train", ["invalid choice: 'sgd'", "'poetxq'", "'qapollo'"]),
    (["train", "--bits"], "train",
     ["argument --bits: expected one argument (--bits: one of 4, 8, 16)"]),
    (["train", "--max-steps", "abc"], "train", ["argument --max-steps: invalid int value: 'abc'"]),
    (["export", "RUN", "OUT", "--format", "hf"], "export",
     ["argument --format: invalid choice: 'hf' (choose from 'hf-bf16', 'hf-bnb8', 'hf-bnb4')"]),
    (["export", "RUN", "OUT"], "export",
     ["the following arguments are required: --format (--format: one of hf-bf16, hf-bnb8, "
      "hf-bnb4)"]),
    (["fpo-adapt", "M", "--data", "pydoc", "--out", "o", "--bits", "5"], "fpo-adapt",
     ["argument --bits: invalid choice: 5 (choose from 16, 8, 4)"]),
    (["fpo-adapt", "M", "--data", "pydoc", "--out", "o", "--method", "lora"], "fpo-adapt",
     ["invalid choice: 'lora' (choose from 'fpo', 'sft-partial', 'full')"]),
    (["fpo-diagnose", "M", "--data", "pydoc", "--device", "tpu"], "fpo-diagnose",
     ["invalid choice: 'tpu' (choose from 'cuda', 'cpu')"]),
    (["fpo-diagnose", "M"], "fpo-diagnose", ["the following arguments are required: --data"]),
    (["estimate-memory", "--memory", "least"], "estimate-memory",
     ["invalid choice: 'least' (choose from 'auto', 'fastest', 'balanced', 'lowest')"]),
    (["estimate-memory", "--precision", "fp16"], "estimate-memory",
     ["'fp16': choose from autocast, bf16-true, fp32"]),
    (["bench", "--device", "tpu"], "bench", ["invalid choice: 'tpu' (choose from 'cuda', 'cpu')"]),
    (["bench", "--steps", "x"], "bench", ["argument --steps: invalid int value: 'x'"]),
    (["report"], "report", ["the following arguments are required: RUN_DIR"]),
    (["validate"], "validate", ["the following arguments are required: RECIPE"]),
    (["train", "--maxsteps", "3"], "train",
     ["unrecognized arguments: --maxsteps 3 (did you mean --max-steps for --maxsteps?)"]),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "command", "pieces"), ARGUMENT_ERRORS)
def test_an_argument_error_is_one_line_naming_the_command_and_the_choices(
    capsys, argv, command, pieces
):
    """No usage dump before it: one line on stderr, nothing on stdout, exit 2, with a pointer to
    the command's --help."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "usage:" not in err
    assert err.startswith(f"poetxq {command}: error: ")
    for piece in pieces:
        assert piece in err, (piece, err)
    assert err.rstrip().endswith(f"see poetxq {command} --help")


@pytest.mark.parametrize(
    ("argv", "piece"),
    [([], "the following arguments are required: COMMAND (COMMAND: one of quantize-and-train, "
      "train, export, validate, estimate-memory, plan, bench, report, fpo-diagnose, "
      "fpo-adapt)"),
     (["nosuch"], "argument COMMAND: invalid choice: 'nosuch' (choose from 'quantize-and-train',")],
)  # fmt: skip
def test_a_missing_or_unknown_command_is_one_line_naming_the_commands(capsys, argv, piece):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("poetxq: error: ") and piece in err
    assert err.rstrip().endswith("; see poetxq --help")


def test_every_command_parses_with_the_one_line_parser_and_help_still_shows_usage(capsys):
    """Each sub-command's parser is the one-line parser (a command added later without it
    would dump usage again); ``--help`` still prints the usage, exit 0."""
    from poetxq.tools.cli_common import CommandParser

    parser = build_parser()
    assert isinstance(parser, CommandParser)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == {"quantize-and-train", "train", "export", "validate",
                                "estimate-memory", "plan", "bench", "report", "fpo-diagnose",
                                "fpo-adapt"}  # fmt: skip
    for name, p in sub.choices.items():
        assert type(p) is CommandParser, name
    with pytest.raises(SystemExit) as exc:
        main(["export", "--help"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith("usage: poetxq export ")


def test_the_readme_states_the_bad_input_lines_as_they_are():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    text = " ".join(readme.split())
    assert (
        "Bad input gets one error line and exit status 2, and nothing is written: `poetxq: "
        "error: ...`, or `poetxq COMMAND: error: ...` naming the valid choices for a flag's value"
    ) in text


# --------------------------------------------------------------------------------------------
# run names: one check for --run-name, a recipe's name and the default; inside --output-dir
# --------------------------------------------------------------------------------------------

#: a hostile name and a piece of the problem its error names
HOSTILE_NAMES = [
    ("..", "is '..', a step in a path, not a folder name"),
    (".", "is '.', a step in a path, not a folder name"),
    ("../escape", "is a path (it holds '/' or '\\'), not one folder name"),
    ("/tmp/abs-poetxq-run", "is a path (it holds '/' or '\\'), not one folder name"),
    ("a\\b", "is a path (it holds '/' or '\\'), not one folder name"),
    ("a\x00b", "holds a NUL byte"),
    ("x" * 10_000, "is 10,000 characters long, over 100"),
    (".hidden", "starts with '.' (a hidden folder)"),
    ("-rf", "starts with '-' (it would read as a flag)"),
    ("a b", "holds ' '"),
    ("tab\there", "holds '\\t'"),
    ("", "is empty"),
]


@pytest.mark.parametrize(("name", "problem"), HOSTILE_NAMES)
def test_a_hostile_run_name_is_one_line_and_creates_nothing(tmp_path, capsys, name, problem):
    out = tmp_path / "runs" / "a"
    assert main(["train", "--output-dir", str(out), f"--run-name={name}", "--max-steps", "1"]) == 2
    (line,) = _err_lines(capsys)
    assert line.startswith("poetxq: error: --run-name ")
    assert f" {problem}; it must be a plain folder name (a run name is one folder name: at most " \
        "100 characters, letters, digits and '._-+=@,' only, not starting with '.' or '-'); use " \
        "--output-dir to choose where runs go" in line  # fmt: skip
    assert len(line) < 500  # a 10 kB name is shown cut
    assert _files_under(tmp_path) == []
    assert not Path("/tmp/abs-poetxq-run").exists()


@pytest.mark.parametrize(("name", "problem"), HOSTILE_NAMES)
def test_a_hostile_recipe_name_is_refused_by_validate_and_train(tmp_path, capsys, name, problem):
    """The same check for a recipe's ``name:`` (a recipe handed over by someone else): validate
    and train refuse it in one line naming the key; nothing is created, also not outside."""
    recipe = tmp_path / "shared.yaml"
    recipe.write_text(yaml.safe_dump({"name": name}), encoding="utf-8")
    assert main(["validate", str(recipe)]) == 2
    (line,) = _err_lines(capsys)
    assert line.startswith(f"poetxq: error: {recipe}: key 'name': the recipe's name {problem}; ")
    assert "give it one (e.g. name: my-run) and choose where runs go with --output-dir" in line
    assert len(line) < 1000  # not the whole name
    out = tmp_path / "runs" / "a" / "b"
    assert main(["train", "--recipe", str(recipe), "--output-dir", str(out)]) == 2
    (again,) = _err_lines(capsys)
    assert again == line
    assert _files_under(tmp_path) == ["shared.yaml"]
    assert not (tmp_path / "runs").exists() and not Path("/tmp/abs-poetxq-run").exists()


def test_the_escaping_recipe_names_of_the_issue_create_nothing_anywhere(tmp_path, capsys):
    """issue 55: ``name: ../../escaped`` with ``--output-dir runs/a/b`` made runs/escaped-...;
    ``name: /abs/dir/x`` ignored --output-dir. Both are refused, and so is the same value
    through ``--set name=...``."""
    for name in ("../../escaped", str(tmp_path / "abs" / "dir" / "x")):
        recipe = tmp_path / "r.yaml"
        recipe.write_text(f"name: {name}\n", encoding="utf-8")
        argv = ["train", "--recipe", str(recipe), "--output-dir", str(tmp_path / "runs/a/b")]
        assert main(argv) == 2
        assert "key 'name': the recipe's name is a path" in _err_lines(capsys)[0]
        assert main(["train", "--output-dir", str(tmp_path / "runs"), "--set", f"name={name}"]) == 2
        assert "key 'name': the recipe's name is a path" in _err_lines(capsys)[0]
        assert _files_under(tmp_path) == ["r.yaml"]


def test_a_default_name_made_from_an_unchecked_recipe_is_checked_too(tmp_path):
    """The automatic name starts with the recipe's name; a recipe built past the schema (a
    copy with another name) meets the same check in resolve_run_dir."""
    from poetxq.training.recipe_files import load_recipe
    from poetxq.training.rundir import RunDirError, resolve_run_dir

    recipe = load_recipe(None, {"train.output_dir": str(tmp_path / "runs")})
    bad = recipe.model_copy(update={"name": "../../escaped"})
    with pytest.raises(RunDirError, match=r"the recipe's name '\.\./\.\./escaped' is a path"):
        resolve_run_dir(bad, None, claim=True)
    assert _files_under(tmp_path) == []


def test_a_derived_name_is_made_safe():
    """A name taken from elsewhere (a --model checkpoint folder's) is made into a run name."""
    from poetxq.paths import MAX_NAME_CHARS, name_problem, safe_name

    assert safe_name("SmolLM2-135M") == "SmolLM2-135M"
    assert safe_name("my model (v2)") == "my-model-v2"
    assert safe_name("..") == "run" and safe_name("") == "run"
    assert len(safe_name("x" * 500)) == MAX_NAME_CHARS
    for text in ("a/b", ".x", "-x", "a\x00b", "é ü"):
        assert name_problem(safe_name(text)) is None, text


@pytest.mark.parametrize("dangling", [False, True])
def test_a_run_name_that_is_a_link_out_of_the_output_folder_is_refused(tmp_path, capsys, dangling):
    """``runs/link -> <outside>``: the run directory would resolve outside --output-dir; one
    line, exit 2, and nothing is written through the link (also with --resume auto)."""
    runs, outside = tmp_path / "runs", tmp_path / "outside"
    runs.mkdir()
    if not dangling:
        outside.mkdir()
    (runs / "link").symlink_to(outside, target_is_directory=True)
    expected = (
        f"poetxq: error: run directory '{runs / 'link'}' is a link to '{outside}', not a "
        f"folder inside --output-dir '{runs}'; remove the link or choose another --run-name"
    )
    for extra in ([], ["--resume", "auto"], ["--overwrite"]):
        argv = ["train", "--output-dir", str(runs), "--run-name", "link", "--max-steps", "1"]
        assert main([*argv, *extra]) == 2
        assert _err_lines(capsys) == [expected]
        assert outside.exists() is not dangling
        assert dangling or list(outside.iterdir()) == []
    assert _files_under(tmp_path) == (["runs", "runs/link"] if dangling else
                                      ["outside", "runs", "runs/link"])  # fmt: skip


def test_a_link_that_stays_inside_the_output_folder_is_a_run_directory(tmp_path):
    from poetxq.training.rundir import RunDirError, run_dir_inside

    runs = tmp_path / "runs"
    (runs / "real").mkdir(parents=True)
    (runs / "alias").symlink_to(runs / "real", target_is_directory=True)
    (runs / "self").symlink_to(runs, target_is_directory=True)
    assert run_dir_inside(runs, "alias") == runs / "alias"
    assert run_dir_inside(runs, "fresh") == runs / "fresh"  # does not exist yet: fine
    with pytest.raises(RunDirError, match=r"is a link to .*, not a folder inside --output-dir"):
        run_dir_inside(runs, "self")


# --------------------------------------------------------------------------------------------
# recipe keys that name a path: documented as relative to the working directory, checked alike
# --------------------------------------------------------------------------------------------

PATH_KEYS = ["train.output_dir", "data.source", "data.tokenizer", "data.cache_dir",
             "model.pretrained"]  # fmt: skip


@pytest.mark.parametrize("key", PATH_KEYS)
@pytest.mark.parametrize(
    ("value", "problem"),
    [("a\x00b", "holds a NUL byte"),
     ("a\nb", "holds a control character (a newline, tab, ...)"),
     ("d/" * 2100, "is 4,200 bytes long, over the 4,096 a path may have"),
     ("d/" + "n" * 300, "holds the name 'nnnnnnnnnnnnnnnnnnnn'... (300 characters), over the 255 "
      "bytes a file system takes for one name"),
     ("  ", "is empty")],
)  # fmt: skip
def test_every_path_key_is_checked_the_same_way(key, value, problem):
    from poetxq.training.recipe import RecipeError
    from poetxq.training.recipe_files import load_recipe

    with pytest.raises(RecipeError) as exc:
        load_recipe(None, {key: value})
    msg = str(exc.value)
    assert f"key '{key}': the path {problem}; give a file or folder path (relative to the " \
        "working directory)" in msg  # fmt: skip
    assert "\n" not in msg and len(msg) < 700


def test_each_path_key_says_what_it_is_relative_to():
    from poetxq.data.config import DataConfig
    from poetxq.model.config import ModelConfig
    from poetxq.training.recipe import Recipe, TrainConfig
    from poetxq.training.recipe_files import compose_recipe_tree

    where = {"train": TrainConfig, "data": DataConfig, "model": ModelConfig}
    for key in PATH_KEYS:
        section, name = key.split(".")
        doc = " ".join((where[section].__doc__ or "").split())
        assert f"``{name}``" in doc and "relative to the working directory" in doc, key
        assert f"``{key}``" in " ".join((Recipe.__doc__ or "").split()), key
    recipe_doc = " ".join((Recipe.__doc__ or "").split())
    assert "a recipe file's ``base`` to that file" in recipe_doc
    assert "relative to the file" in (compose_recipe_tree.__doc__ or "")


# --------------------------------------------------------------------------------------------
# plain-text documentation files as data
# --------------------------------------------------------------------------------------------

DOC_TEXTS = {
    "guide.md": "# Guide\n\nMarkdown *text* for the model.\n",
    "notes.markdown": "Some notes.\n",
    "api.rst": "API\n===\n\nreStructuredText body.\n",
    "paper.tex": "\\section{Intro} A \\LaTeX{} paper.\n",
    "todo.org": "* TODO an org-mode heading\n",
}


def test_documentation_files_are_read_as_text(tmp_path):
    from poetxq.data.config import DataConfig
    from poetxq.data.local import file_documents, local_files, local_source

    for name, text in DOC_TEXTS.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    (tmp_path / "server.log").write_text("a log line\n", encoding="utf-8")
    (tmp_path / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    files, what = local_files(str(tmp_path))
    assert what == f"directory {tmp_path}"
    assert sorted(p.name for p in files) == sorted(DOC_TEXTS)
    for path in files:
        assert list(file_documents(path, "text")) == [DOC_TEXTS[path.name].strip()]
    source = local_source(DataConfig(source=str(tmp_path)))
    assert source.description == f"local: directory {tmp_path} (5 file(s))"
    # an ending a data key names is text too; its identity (the token cache's key) says so
    cfg = DataConfig(source=str(tmp_path), text_extensions=["LOG"])
    assert cfg.text_extensions == [".log"]
    files, _ = local_files(cfg.source, cfg.text_extensions)
    assert sorted(p.name for p in files) == sorted([*DOC_TEXTS, "server.log"])
    log = tmp_path / "server.log"
    assert list(file_documents(log, "text", cfg.text_extensions)) == ["a log line"]
    assert local_source(cfg).identity["text_extensions"] == [".log"]
    assert "text_extensions" not in source.identity  # caches of other sources keep their keys


def test_a_binary_documentation_file_is_refused_as_a_binary_txt_is(tmp_path):
    from poetxq.data import DataError
    from poetxq.data.local import file_documents

    fake = tmp_path / "fake.md"
    fake.write_bytes(b"# title\x00\x01\x02")
    with pytest.raises(DataError, match=r"fake\.md holds NUL bytes: it looks binary, not text"):
        list(file_documents(fake, "text"))
    latin = tmp_path / "old.rst"
    latin.write_bytes("caf\xe9 ".encode("latin-1") * 50)
    with pytest.raises(DataError, match=r"old\.rst is \d+% not UTF-8"):
        list(file_documents(latin, "text"))


def test_an_unread_ending_names_the_data_key_that_reads_it(tmp_path):
    from poetxq.data import DataError
    from poetxq.data.config import DataConfig
    from poetxq.data.local import local_files

    (tmp_path / "a.log").write_text("text\n", encoding="utf-8")
    with pytest.raises(DataError) as exc:
        local_files(str(tmp_path / "a.log"))
    assert str(exc.value).endswith(
        ".txt, .md, .markdown, .rst, .tex, .org; to read other plain-text files, list their "
        "ending in data.text_extensions (e.g. --set 'data.text_extensions=[.log]')"
    )
    for bad in ("*.log", "a/b", "."):
        with pytest.raises(ValueError, match="is not a file name ending; give endings such as"):
            DataConfig(text_extensions=[bad])


# --------------------------------------------------------------------------------------------
# the small items
# --------------------------------------------------------------------------------------------


def test_fpo_diagnose_names_target_layers_as_layers():
    from poetxq.tools.cli_adapt import target_layers

    assert target_layers([3]) == "layer 3"
    assert target_layers([25, 26, 27]) == "layers 25, 26, 27"
    assert target_layers([]) == "no layer"


class _RunsCode:
    """A pickled object whose loading would create a folder (it must never be loaded)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (str(self.marker),))


def test_a_refused_pickle_checkpoint_gets_safe_advice_and_runs_nothing(tmp_path):
    """A ``pytorch_model.bin`` holding more than tensors: torch's weights_only loader refuses
    it and suggests ``weights_only=False``; our line does not pass that on, and the object's
    code never ran."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from poetxq.model.pretrained import PretrainedError, load_pretrained

    ckpt = tmp_path / "ckpt"
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=2,
                      num_hidden_layers=1, vocab_size=64, max_position_embeddings=32)  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(str(ckpt))
    state = LlamaForCausalLM(cfg).state_dict()
    marker = tmp_path / "code-ran"
    state["extra"] = _RunsCode(marker)
    torch.save(state, ckpt / "pytorch_model.bin")  # pickling only
    for f in ckpt.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(PretrainedError) as exc:
        load_pretrained(str(ckpt))
    msg = str(exc.value)
    assert msg == (
        f"cannot load '{ckpt}': its weights are a pickle file that holds more than tensors (it "
        "names os.makedirs), and poetxq does not unpickle such a file (loading it could run code "
        "from it); get the checkpoint as safetensors (model.safetensors) from its source"
    )
    assert "weights_only" not in msg and "trust" not in msg
    assert not marker.exists()


def test_the_pickle_line_replaces_torch_s_advice_whatever_the_error_type():
    from poetxq.model.pretrained import load_error_line

    torch_text = (
        "Weights only load failed. This file can still be loaded, to do so you have two "
        "options.\n\t(1) Re-running `torch.load` with `weights_only` set to `False` will likely "
        "succeed\n\tWeightsUnpickler error: Unsupported global: GLOBAL builtins.exec was not an "
        "allowed global by default."
    )
    for exc in (pickle.UnpicklingError(torch_text), RuntimeError(torch_text)):
        line = load_error_line("/m", exc)
        assert "(it names builtins.exec)" in line and "weights_only" not in line
        assert "\n" not in line
    assert load_error_line("/m", OSError("no file\nmore")) == "cannot load '/m': no file"


def test_report_plots_of_runs_on_other_data_say_so(tmp_path, capsys):
    """Runs of one model on other data drawn on one loss / perplexity panel: the panel's title
    and legend say so, report.md and the command's output carry a note; runs on the same data
    say nothing."""
    from poetxq.tools.report import curve_legend, plot_notes
    from poetxq.tools.run_dir import Run
    from poetxq.training.recipe import dump_recipe
    from poetxq.training.recipe_files import load_recipe

    def run_dir(name: str, **over) -> Path:
        path = tmp_path / name
        path.mkdir()
        (path / "recipe.yaml").write_text(dump_recipe(load_recipe(None, over)))
        rows = [{"step": 0, "val_ppl": 400.0}, {"step": 2, "loss": 5.0, "tokens": 64}]
        (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return path

    a, b, c = run_dir("a"), run_dir("b", **{"data.source": "pydoc"}), run_dir("c")
    runs = [Run(p, load_recipe(p / "recipe.yaml"), {}) for p in (a, b)]
    title, labels = curve_legend("tiny", runs)
    assert title == "tiny: different data.source, not comparable"
    assert labels == ["poetxq (a; data.source embedded)", "poetxq (b; data.source pydoc)"]
    same = [Run(p, load_recipe(p / "recipe.yaml"), {}) for p in (a, c)]
    assert curve_legend("tiny", same) == ("tiny", ["poetxq (a)", "poetxq (c)"])
    assert plot_notes(same) == []
    note = (
        "the loss and perplexity plots of tiny draw runs that differ in data.source on one "
        "panel: their curves are not comparable (the legend names each run's values)"
    )
    assert plot_notes(runs) == [note]
    out = tmp_path / "rep"
    assert main(["report", str(a), str(b), "-o", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == f"note: {note}" and printed[1].startswith("report: ")
    assert f"**Note:** {note}." in (out / "report.md").read_text()
    assert main(["report", str(a), str(c), "-o", str(tmp_path / "rep2")]) == 0
    assert "note:" not in capsys.readouterr().out


@pytest.mark.parametrize(
    ("native", "clause"),
    [(True, "; this CPU does;"), (False, "; this CPU does not;"), (None, " does not; it is")],
)
def test_bf16_on_a_cpu_is_a_warning_with_the_slowdown_and_the_fix(monkeypatch, native, clause):
    import poetxq.training.precision as precision

    monkeypatch.setattr(precision, "native_bf16", lambda: native)
    line = precision.cpu_note(SimpleNamespace(precision="bf16-true"), "cpu")
    assert line is not None and line.startswith(
        "warning: train.precision bf16-true on the CPU runs slower than fp32: about 2x on a CPU "
        "that computes bf16 natively (AVX512-BF16, AMX) and up to ~40x on one that does not"
    )
    assert clause in line
    assert line.endswith(
        "it is meant for the GPU: for a CPU run set train.precision auto (fp32 there) or fp32"
    )
    assert precision.cpu_note(SimpleNamespace(precision="bf16"), "cpu") is not None
    assert precision.cpu_note(SimpleNamespace(precision="fp32"), "cpu") is None
    assert precision.cpu_note(SimpleNamespace(precision="auto"), "cpu") is None
    assert precision.cpu_note(SimpleNamespace(precision="bf16-true"), "cuda") is None
