"""train.precision: how each setting resolves, bf16-true's parameter cast, runs and estimates."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from poetxq.model.surgery import build_llama, convert_to_poetx
from poetxq.tools.cli import main
from poetxq.training.precision import cast_parameters, run_precision
from poetxq.training.recipe import RecipeError
from poetxq.training.recipe_files import load_recipe


@pytest.mark.parametrize(
    ("setting", "device", "want"),
    [
        ("auto", "cuda", "autocast"),
        ("auto", "cpu", "fp32"),
        ("bf16", "cpu", "autocast"),
        ("bf16", "cuda", "autocast"),
        ("autocast", "cpu", "autocast"),  # the name summary.json and bench record
        ("autocast", "cuda", "autocast"),
        ("bf16-true", "cpu", "bf16-true"),
        ("bf16-true", "cuda", "bf16-true"),
        ("fp32", "cuda", "fp32"),
    ],
)
def test_run_precision(setting, device, want):
    assert run_precision(SimpleNamespace(precision=setting), device) == want


def _tiny(bits: int):
    over = {"model.hidden_size": 64, "model.intermediate_size": 128,
            "model.num_attention_heads": 4, "model.num_hidden_layers": 1,
            "poet.block_size": 16, "poet.bits": bits}  # fmt: skip
    recipe = load_recipe(None, over)
    torch.manual_seed(0)
    model = build_llama(recipe.model, 96)
    convert_to_poetx(model, recipe.poet, generator=torch.Generator().manual_seed(0))
    return model


@pytest.mark.parametrize("bits", [8, 4])
def test_cast_parameters_casts_every_float_parameter_and_no_buffer(bits):
    model = _tiny(bits)
    buffers = {n: (b.dtype, b.clone()) for n, b in model.named_buffers()}
    weights = {n: m.effective_weight() for n, m in model.named_modules() if hasattr(m, "bits")}
    n_params = len(list(model.parameters()))

    assert cast_parameters(model) == n_params
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    for n, b in model.named_buffers():  # SCB / absmax fp32, codes int8 / uint8: unchanged
        assert b.dtype == buffers[n][0] and torch.equal(b, buffers[n][1]), n
    assert any(b.dtype == torch.float32 for b in model.buffers())  # scales exist and stay fp32
    for n, m in model.named_modules():  # Q = 0: the effective weight is W0's, to the bit
        if n in weights:
            assert torch.equal(m.effective_weight(), weights[n]), n
    assert cast_parameters(model) == 0  # already bf16


@pytest.mark.slow
def test_bf16_true_run_trains_bf16_parameters_and_matches_fp32_to_bf16_precision(
    tmp_path, tiny_train
):
    want, _ = tiny_train("fp32", "--set", "train.precision=fp32")
    got, _ = tiny_train("bf16", "--set", "train.precision=bf16-true")
    assert len(got) == 3 and all(map(torch.isfinite, torch.tensor(got)))
    # the first loss is the initial model's: the same function, bf16 arithmetic
    assert got[0] == pytest.approx(want[0], rel=2e-2)
    assert got != want  # and not the fp32 run itself
    summary = json.loads((tmp_path / "bf16" / "summary.json").read_text())
    assert summary["device"].endswith("bf16-true")
    ckpt = next((tmp_path / "bf16" / "checkpoints").iterdir()) / "model.safetensors"
    with safe_open(str(ckpt), "pt") as f:
        dtypes = {k: f.get_tensor(k).dtype for k in f.keys()}  # noqa: SIM118
    assert dtypes["model.embed_tokens.weight"] == torch.bfloat16
    assert any(k.endswith("SCB") and v == torch.float32 for k, v in dtypes.items())
    q = [v for k, v in dtypes.items() if k.endswith(".Q")]
    assert q and all(v == torch.bfloat16 for v in q)


def test_bf16_true_is_refused_for_the_int8_baselines():
    for method in ("qgalore", "galore", "qapollo", "apollo"):
        with pytest.raises(RecipeError, match="bf16-true applies to poetxq, poetx and adamw"):
            load_recipe(f"llama-60m:{method}", {"train.precision": "bf16-true"})
    load_recipe("llama-60m:adamw", {"train.precision": "bf16-true"})  # accepted


def test_estimate_memory_refuses_a_precision_train_refuses(capsys):
    """--precision bf16-true for a method train refuses it for is the same one-line error, not an
    estimate of a run that cannot start; a precision set by the memory plan is named as such."""
    assert (
        main(["estimate-memory", "--recipe", "llama-8b:qgalore", "--precision", "bf16-true"]) == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("poetxq: error: --precision bf16-true: ")
    assert "applies to poetxq, poetx and adamw, not qgalore" in err[0]
    argv = ["estimate-memory", "--recipe", "llama-8b:poetxq", "--memory", "lowest"]
    assert main([*argv, "--precision", "fp32"]) == 0
    assert "train.precision bf16-true (the lowest memory plan's) runs on a GPU (bf16-true)" in (
        capsys.readouterr().out
    )


def test_estimate_memory_reads_the_precision_from_the_recipe(capsys):
    base = ["estimate-memory", "--recipe", "llama-60m:poetxq"]
    assert main([*base, "--set", "train.precision=bf16-true"]) == 0
    from_recipe = capsys.readouterr().out
    assert main([*base, "--precision", "bf16-true"]) == 0
    explicit = capsys.readouterr().out.splitlines()
    assert main(base) == 0
    autocast = capsys.readouterr().out
    # an explicit --precision other than the recipe's runs says so in a note first
    assert explicit[0] == (
        "note: --precision bf16-true estimates another setting than the recipe's "
        "train.precision auto runs on a GPU (autocast)"
    )
    # the breakdown (the plans' table below it estimates each plan at the recipe's precision)
    breakdown = from_recipe.split("memory plans")[0].splitlines()
    assert breakdown == explicit[1 : len(breakdown) + 1] and "note: --precision" not in from_recipe
    assert from_recipe != autocast and "autocast" in autocast.splitlines()[0]
    # the names are the recipe's run precisions: "bf16" (autocast as train.precision) is
    # refused by name rather than read as everything-bf16
    with pytest.raises(SystemExit) as exc:
        main([*base, "--precision", "bf16"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "'bf16' is ambiguous: use autocast" in err and "or bf16-true" in err
    with pytest.raises(SystemExit):
        main([*base, "--precision", "fp16"])
    assert "'fp16': choose from autocast, bf16-true, fp32" in capsys.readouterr().err


@pytest.mark.slow
def test_summary_and_the_cpu_note_name_the_precision(tiny_train, tmp_path, capsys):
    tiny_train("b", "--set", "train.precision=bf16-true", "--max-steps", "1")
    out = capsys.readouterr().out
    on_cpu = not torch.cuda.is_available()  # train takes the GPU where there is one
    warned = "warning: train.precision bf16-true on the CPU runs slower than fp32: about 2x"
    assert (warned in out) is on_cpu
    assert json.loads((tmp_path / "b" / "summary.json").read_text())["precision"] == "bf16-true"
    tiny_train("f", "--set", "train.precision=fp32", "--max-steps", "1")
    assert "on the CPU runs slower" not in capsys.readouterr().out
    assert json.loads((tmp_path / "f" / "summary.json").read_text())["precision"] == "fp32"


@pytest.mark.slow
def test_bench_notes_bf16_on_the_cpu_as_train_does(tmp_path, capsys):
    out = tmp_path / "b.json"
    sets = ["--set", "model.num_hidden_layers=1", "--steps", "1", "--device", "cpu"]
    assert main(["bench", "--recipe", "recipes/tiny/poetxq.yaml", *sets, "--out", str(out),
                 "--set", "train.precision=autocast"]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "warning: train.precision autocast on the CPU runs slower than fp32: about 2x" in text
    assert json.loads(out.read_text())["precision"] == "autocast"
    assert main(["bench", "--recipe", "recipes/tiny/poetxq.yaml", *sets, "--out", str(out)]) == 0
    assert "on the CPU runs slower" not in capsys.readouterr().out  # auto is fp32 there


@pytest.mark.slow
def test_bench_follows_train_precision(tmp_path):
    out = tmp_path / "b.json"
    sets = ["--set", "train.precision=bf16-true", "--set", "model.num_hidden_layers=1"]
    args = ["--steps", "1", "--device", "cpu", "--out", str(out)]
    assert main(["bench", "--recipe", "recipes/tiny/poetxq.yaml", *sets, *args]) == 0
    data = json.loads(out.read_text())
    assert data["precision"] == "bf16-true"
    # the estimate books bf16 parameters: the estimator's own bf16 figure
    from poetxq.training.estimate import estimate_memory

    recipe = load_recipe("recipes/tiny/poetxq.yaml", {"train.precision": "bf16-true",
                                                      "model.num_hidden_layers": 1})  # fmt: skip
    est = estimate_memory(recipe, vocab_size=data["vocab_size"], precision="bf16-true")
    assert data["estimated_peak_bytes"] == est.peak
