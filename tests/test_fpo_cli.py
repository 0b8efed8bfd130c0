"""``poetxq fpo-diagnose`` and ``poetxq fpo-adapt`` on a tiny random Llama saved to disk."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_llama import save_tiny_checkpoint
from transformers import AutoModelForCausalLM

from poetxq.tools.cli import main


@pytest.fixture
def checkpoint(tmp_path):
    """A 4-layer random Llama and a 384-token byte-level BPE, saved side by side."""
    return save_tiny_checkpoint(tmp_path / "tiny-llama", hidden_size=32, intermediate_size=64,
                                layers=4, text_stride=4)  # fmt: skip


def test_fpo_diagnose_command_writes_json_and_plot(checkpoint, tmp_path, monkeypatch, capsys):

    monkeypatch.setenv("POETXQ_CACHE", str(tmp_path / "cache"))
    out, plot = tmp_path / "o" / "diag.json", tmp_path / "o" / "diag.png"
    argv = ["fpo-diagnose", str(checkpoint), "--data", "pydoc", "--windows", "3", "--seq-len",
            "16", "--micro-batch", "2", "--out", str(out), "--plot", str(plot)]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert [r["layer"] for r in report["layers"]] == [0, 1, 2, 3]
    assert report["layers"][-1]["cos_mlp"] == pytest.approx(1.0, abs=1e-4)  # last: exact
    assert report["targets"] == [3] and report["n_tokens"] == 3 * 16
    assert report["lr"]["adamw"] > 0 and len(report["sweep"]["sgd"]) == 3
    assert report["model"] == str(checkpoint.resolve())
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = capsys.readouterr().out
    assert "targets: layer 3 (" in text and "cos_mlp" in text


def test_fpo_diagnose_errors_are_one_line(tmp_path, capsys):

    assert main(["fpo-diagnose", str(tmp_path / "nope"), "--data", "pydoc"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("poetxq: error: ")
    (tmp_path / "d").mkdir()
    assert main(["fpo-diagnose", str(tmp_path), "--data", "pydoc", "--out", str(tmp_path / "d")])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--out" in err[0]
    assert main(["fpo-diagnose", str(tmp_path), "--data", "pydoc", "--plot", "p.svg"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "give a .png path, not 'p.svg'" in err[0]


def _adapt_argv(checkpoint, out, *extra):
    return ["fpo-adapt", str(checkpoint), "--data", "pydoc", "--seq-len", "16", "--windows", "2",
            "--micro-batch", "2", "--batch-size", "2", "--eval-batches", "1", "--log-every", "1",
            "--out", str(out), *extra]  # fmt: skip


def test_fpo_adapt_command_adapts_the_targets_and_saves_a_loadable_model(
    checkpoint, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("POETXQ_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    argv = _adapt_argv(checkpoint, out, "--layers", "auto", "--steps", "3", "--eval-every", "2",
                       "--ood-data", "pydoc")  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "targets: layer 3 (" in text
    assert "fpo-adapt (fpo): the MLPs of layers 3, adamw lr" in text
    summary = json.loads((out / "summary.json").read_text())
    assert summary["layers"] == [3] and summary["steps"] == 3
    assert summary["first"]["step"] == 0 and summary["last"]["step"] == 3
    assert "ood_ppl" in summary["last"]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "val_ppl" in r] == [0, 2, 3]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3]
    original = AutoModelForCausalLM.from_pretrained(str(checkpoint))
    adapted = AutoModelForCausalLM.from_pretrained(str(out / "model"))
    changed = {
        name for (name, p), q in zip(adapted.named_parameters(), original.parameters(), strict=True)
        if not torch.equal(p, q)
    }  # fmt: skip
    assert changed == {f"model.layers.3.mlp.{n}_proj.weight" for n in ("gate", "up", "down")}
    assert (out / "model" / "tokenizer.json").is_file()


def test_fpo_adapt_refuses_bad_input_in_one_line(checkpoint, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("POETXQ_CACHE", str(tmp_path / "cache"))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    (tmp_path / "afile").write_text("")
    cases = [
        (_adapt_argv(checkpoint, tmp_path / "afile" / "sub", "--layers", "1"),
         f"cannot write --out '{tmp_path / 'afile' / 'sub'}': '{tmp_path / 'afile'}' is a file"),
        (_adapt_argv(checkpoint, tmp_path / "full", "--layers", "1"), "not empty"),
        (_adapt_argv(checkpoint, tmp_path / "a", "--layers", "one"), "--layers 'one'"),
        (_adapt_argv(checkpoint, tmp_path / "b", "--layers", "9", "--lr", "1e-3"), "layer 9"),
        # a list that starts with a negative index is read as the value, not as an option
        (_adapt_argv(checkpoint, tmp_path / "b", "--layers", "-1,9", "--lr", "1e-3"), "layer 9"),
        (_adapt_argv(checkpoint, tmp_path / "c", "--layers", "1", "--lr", "1e-3", "--resume"),
         "nothing to resume"),
        (_adapt_argv(checkpoint, tmp_path / "d", "--resume"), "nothing to resume"),
        (_adapt_argv(checkpoint, tmp_path / "e", "--lr", "-1"), "--lr must be positive"),
        (_adapt_argv(checkpoint, tmp_path / "e", "--log-every", "0"), "--log-every and"),
        (_adapt_argv(checkpoint, tmp_path / "e", "--eval-batches", "0"), "--eval-batches must"),
        (_adapt_argv(checkpoint, tmp_path / "e", "--clip", "-1"), "must not be negative"),
        (_adapt_argv(checkpoint, tmp_path / "e", "--quarter", "4"), "--quarter must lie in"),
        (_adapt_argv(checkpoint, tmp_path / "e", "--tolerance", "-1"), "--tolerance must not"),
        (_adapt_argv(checkpoint, tmp_path / "e", "--seq-len", "100000"),
         "--seq-len 100000 exceeds the max_position_embeddings"),  # no recipe: no train.seq_len
    ]  # fmt: skip
    if not torch.cuda.is_available():
        cases.append((_adapt_argv(checkpoint, tmp_path / "e", "--device", "cuda"), "no CUDA GPU"))
    for argv, expected in cases:
        assert main(argv) == 2
        out, err = capsys.readouterr()
        err = err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("poetxq: error: ") and expected in err[0], err
        assert out.strip() == "", out  # refused before loading, diagnosing or writing anything
    assert not any((tmp_path / name).exists() for name in "abcde")


def test_fpo_adapt_on_an_int8_base_saves_a_dense_transformers_model(
    checkpoint, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("POETXQ_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run8"
    argv = _adapt_argv(checkpoint, out, "--layers", "3,-1", "--lr", "1e-3", "--steps", "1",
                       "--bits", "8")  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "25 frozen linears held in 8-bit" in text  # 4 layers × 7 − 3
    assert "note: --layers 3,-1 names a layer twice" in text and "adapting 3\n" in text
    adapted = AutoModelForCausalLM.from_pretrained(str(out / "model"))
    original = AutoModelForCausalLM.from_pretrained(str(checkpoint))
    q = adapted.model.layers[0].self_attn.q_proj.weight  # the int8 grid, dequantized
    w = original.model.layers[0].self_attn.q_proj.weight
    assert 0 < ((q - w).norm() / w.norm()).item() < 0.02


@pytest.mark.parametrize("method", ["sft-partial", "full"])
def test_fpo_adapt_runs_the_autograd_references(
    method, checkpoint, tmp_path, monkeypatch, cpu_only, capsys
):
    monkeypatch.setenv("POETXQ_CACHE", str(tmp_path / "cache"))
    out = tmp_path / method
    argv = _adapt_argv(checkpoint, out, "--layers", "-1", "--lr", "1e-3", "--steps", "2",
                       "--method", method)  # fmt: skip
    assert main(argv) == 0
    # the start line says what is trained: full fine-tuning trains every layer, not layer 3
    trained = {
        "sft-partial": "the MLPs of layers 3",
        "full": "every parameter (all 4 layers, the embeddings and the LM head)",
    }
    start = f"fpo-adapt ({method}): {trained[method]}, adamw lr 0.001, "
    assert start in capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["method"] == method and summary["peak_memory_bytes"] is None  # CPU
    adapted = AutoModelForCausalLM.from_pretrained(str(out / "model"))
    original = AutoModelForCausalLM.from_pretrained(str(checkpoint))
    moved = {n for (n, p), q in zip(adapted.named_parameters(), original.parameters(), strict=True)
             if not torch.equal(p, q)}  # fmt: skip
    expected = {f"model.layers.3.mlp.{n}_proj.weight" for n in ("gate", "up", "down")}
    if method == "full":
        expected = {n for n, _ in original.named_parameters()}
    assert moved == expected


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["olmo2", "gemma3"])
def test_fpo_adapt_takes_post_mlp_norm_models(arch, tmp_path, monkeypatch, capsys):
    """OLMo-2 and Gemma 3 (a norm after the MLP) go through fpo-adapt --layers auto: the
    diagnosis finds the exact last layer (cosine 1), only its MLP changes, at --bits 8 too;
    POET's --model still takes the Llama family only."""
    monkeypatch.setenv("POETXQ_CACHE", str(tmp_path / "cache"))
    checkpoint = save_tiny_checkpoint(tmp_path / arch, hidden_size=32, intermediate_size=64,
                                      layers=3, text_stride=4, arch=arch)  # fmt: skip
    out = tmp_path / "run"
    argv = _adapt_argv(checkpoint, out, "--layers", "auto", "--steps", "2", "--bits", "8")
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "targets: layer 2 (" in text
    last = next(ln.split() for ln in text.splitlines() if ln.split()[:1] == ["2"])
    assert float(last[1]) == pytest.approx(1.0, abs=1e-3)  # cos_w3 of the last layer: exact
    assert float(last[2]) == pytest.approx(1.0, abs=1e-3)  # cos_mlp
    summary = json.loads((out / "summary.json").read_text())
    assert summary["layers"] == [2] and summary["steps"] == 2
    original = AutoModelForCausalLM.from_pretrained(str(checkpoint))
    adapted = AutoModelForCausalLM.from_pretrained(str(out / "model"))
    assert type(adapted) is type(original)
    params = dict(adapted.named_parameters())
    for name, p in original.named_parameters():
        if ".layers.2.mlp." in name:
            assert not torch.equal(params[name], p), name
        elif ".layers." in name and ("_proj" in name) and "norm" not in name:
            assert torch.allclose(params[name], p, atol=0.05), name  # int8 round trip only
        else:
            assert torch.equal(params[name], p), name
    argv = ["train", "--model", str(checkpoint), "--data", "pydoc", "--max-steps", "1",
            "--output-dir", str(tmp_path / "t")]  # fmt: skip
    assert main(argv) == 2
    assert "takes Llama-family checkpoints" in capsys.readouterr().err


def test_fpo_adapt_resume_keeps_the_run_settings_and_skips_the_diagnosis(
    checkpoint, tmp_path, monkeypatch, capsys
):
    """A resume with other data, method or bits is refused before any work; one with --layers
    auto and no --lr takes the saved run's (no second diagnosis); a finished run is left alone;
    a folder a stopped run left with only metrics.jsonl starts afresh."""
    monkeypatch.setenv("POETXQ_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    assert main(_adapt_argv(checkpoint, out, "--steps", "1", "--save-every", "1")) == 0
    assert "targets: layer 3 (" in capsys.readouterr().out  # the first run diagnoses
    for flag, value in (("--data", "embedded"), ("--method", "full"), ("--bits", "8"),
                        ("--lr", "0.5")):  # fmt: skip
        argv = _adapt_argv(checkpoint, out, "--steps", "2", "--resume", flag, value)
        if flag == "--data":
            argv[argv.index("pydoc")] = value
        assert main(argv) == 2
        stdout, err = capsys.readouterr()
        assert f"was adapted with {flag} " in err and stdout == "", (flag, err)
    assert main(_adapt_argv(checkpoint, out, "--steps", "2", "--resume")) == 0
    text = capsys.readouterr().out
    assert "targets:" not in text and f"resumed '{out}' at step 1 of 2" in text
    assert "the MLPs of layers 3, adamw lr" in text
    assert main(_adapt_argv(checkpoint, out, "--steps", "2", "--resume")) == 0
    assert "already finished at step 2; nothing to do" in capsys.readouterr().out
    stale = tmp_path / "stale"
    stale.mkdir()
    (stale / "metrics.jsonl").write_text('{"step": 0, "val_ppl": 1.0}\n')
    argv = _adapt_argv(checkpoint, stale, "--layers", "-1", "--lr", "1e-3", "--steps", "1")
    assert main(argv) == 0
    assert (stale / "model").is_dir()


def test_fpo_commands_take_data_settings(checkpoint, tmp_path, monkeypatch, capsys):
    """--set data.KEY=VALUE reaches the data section (a JSONL whose text is under another field);
    other sections, data.source and values the section refuses get one line."""
    import pydoc_data.topics

    monkeypatch.setenv("POETXQ_CACHE", str(tmp_path / "cache"))
    jsonl = tmp_path / "c.jsonl"
    texts = list(pydoc_data.topics.topics.values())[:40]
    jsonl.write_text("".join(json.dumps({"content": t}) + "\n" for t in texts))
    base = ["fpo-diagnose", str(checkpoint), "--data", str(jsonl), "--windows", "2", "--seq-len",
            "16", "--micro-batch", "2"]  # fmt: skip
    assert main(base) == 2
    assert "text field 'text'" in capsys.readouterr().err
    assert main([*base, "--set", "data.text_field=content"]) == 0
    assert "targets: layer 3 (" in capsys.readouterr().out
    for bad, expected in (("train.max_steps=3", "data.* settings only"),
                          ("data.source=pydoc", "not data.source"),
                          ("data.val_fraction=0.9", "--set data.val_fraction: "),
                          ("data.nokey=1", "--set data.nokey: unknown key (allowed here: "
                           "data.hf_config, "),
                          ("data.text_field", "write KEY=VALUE")):  # fmt: skip
        assert main([*base, "--set", bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and expected in err[0], (bad, err)


@pytest.mark.parametrize("command", ["fpo-diagnose", "fpo-adapt"])
def test_fpo_help_names_the_named_bases_and_their_install(command, capsys):
    from poetxq.model.bases import NAMED_BASES

    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for name, base in NAMED_BASES.items():
        assert f"{name} (needs: {base.pip})" in text
