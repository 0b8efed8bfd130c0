"""The way in: ``--model DIR`` continues a transformers Llama checkpoint (made here with
``save_pretrained``, with its own BPE tokenizer) with POET-XQ, and the run exports back."""

import json

import bitsandbytes.functional as bnbF
import pytest
import torch
from tiny_llama import save_tiny_checkpoint
from transformers import AutoModelForCausalLM, AutoTokenizer

from poetxq.model.surgery import convert_to_poetx, poet_layers
from poetxq.tools.cli import main
from poetxq.tools.export import load_run
from poetxq.training.build import build_model
from poetxq.training.recipe_files import load_recipe

TEXT = "class Point:\n    def __init__(self, x, y):\n        self.x = x  # the attribute"
RUN = [
    "--data", "pydoc", "--seq-len", "32", "--batch-size", "8", "--block-size", "16",
    "--max-steps", "16", "--eval-every", "100", "--merge-interval", "8", "--no-progress",
    "--set", "train.log_every=2", "--set", "optim.warmup_steps=2",
]  # fmt: skip
#: the test checkpoint is random, not pretrained: it trains at the pretraining rates (a --model
#: run without rates takes the lower continued-training ones, tests/test_continued_training.py)
RATES = ["--lr", "5e-3", "--poet-lr", "4e-3"]


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("POETXQ_CACHE", str(tmp_path_factory.getbasetemp() / "data-cache"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A small Llama (d=64, 2 layers) and a 384-token byte-level BPE, saved side by side."""
    path = tmp_path_factory.mktemp("ckpt") / "tiny-llama"
    return save_tiny_checkpoint(path, hidden_size=64, intermediate_size=128, layers=2,
                                text_stride=2)  # fmt: skip


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _quantized_original(path, bits: int) -> torch.nn.Module:
    """The original model with each projection weight quantized *in original coordinates*:
    int8 by hand (float64), NF4 by bitsandbytes' quantize_4bit / dequantize_4bit."""
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name != "lm_head":
            w = mod.weight.detach()
            if bits == 8:
                w64 = w.double()
                scale = w64.abs().amax(1, keepdim=True) / 127
                deq = (torch.round(w64 / scale) * scale).float()
            else:
                packed, state = bnbF.quantize_4bit(w, blocksize=64, quant_type="nf4",
                                                   compress_statistics=True)  # fmt: skip
                deq = bnbF.dequantize_4bit(packed, state)
            mod.weight.data.copy_(deq)
    return model.eval()


@pytest.mark.parametrize("bits", [8, 4])
def test_step0_logits_equal_original_within_quantization_error(checkpoint, bits):
    recipe = load_recipe(None, {"model.pretrained": str(checkpoint), "poet.bits": bits,
                                "poet.block_size": 16, "train.seq_len": 32})  # fmt: skip
    assert recipe.data.tokenizer == str(checkpoint)  # its own tokenizer by default
    model, keep = build_model(recipe, 384, echo=lambda _s: None)
    assert keep and model.config.hidden_size == 64  # architecture from the checkpoint
    convert_to_poetx(model, recipe.poet, generator=torch.Generator().manual_seed(1),
                     keep_weights=True)  # fmt: skip
    model.eval()
    original = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    ids = torch.randint(0, 384, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = model(ids).logits
        orig = original(ids).logits
        ref = _quantized_original(checkpoint, bits)(ids).logits
    err, ref_err = _rel(ours, orig), _rel(ref, orig)
    print(f"bits={bits}: step-0 relative logit error vs the original {err:.2e} "
          f"(reference quantization in original coordinates: {ref_err:.2e})")  # fmt: skip
    assert err > 0
    if bits == 8:
        # row-wise int8 is permutation-invariant: exactly the reference quantization
        assert _rel(ours, ref) < 1e-5 and err < 0.01
    else:
        # NF4 blocks are cut in permuted coordinates: a different rounding of the same size
        assert 0.5 * ref_err < err < 2 * ref_err and err < 0.15
    # W0 is the checkpoint's weight as it is: no re-initialisation, no row normalisation
    for layer, (name, lin) in zip(poet_layers(model), [
        (n, m) for n, m in original.named_modules()
        if isinstance(m, torch.nn.Linear) and n != "lm_head"
    ], strict=True):  # fmt: skip
        w0, w = layer.effective_weight(torch.float64), lin.weight.double()
        assert _rel(w0, w) < (0.01 if bits == 8 else 0.12), name
        rtol = 0.01 if bits == 8 else 0.1  # not normalised to 1 (rows here have norm ~0.16)
        torch.testing.assert_close(w0.norm(dim=1), w.norm(dim=1), rtol=rtol, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize(("bits", "fmt"), [(8, "hf-bnb8"), (4, "hf-bf16")])
def test_model_trains_and_exports_back(checkpoint, tmp_path, bits, fmt, cpu_only):
    code = main(["quantize-and-train", *RUN, *RATES, "--model", str(checkpoint),
                 "--bits", str(bits), "--output-dir", str(tmp_path),
                 "--run-name", "run"])  # fmt: skip
    assert code == 0
    run_dir = tmp_path / "run"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    val = [r["val_ppl"] for r in records if "val_ppl" in r]
    assert losses[-1] < losses[0] - 0.5 and val[-1] < val[0]
    assert json.loads((run_dir / "config.json").read_text())["hidden_size"] == 64
    assert "pretrained" in (run_dir / "recipe.yaml").read_text()
    # the run used the checkpoint's tokenizer and saved it
    ids = AutoTokenizer.from_pretrained(str(checkpoint))(TEXT).input_ids
    assert AutoTokenizer.from_pretrained(str(run_dir / "tokenizer"))(TEXT).input_ids == ids

    out = tmp_path / "export"
    assert main(["export", str(run_dir), "--format", fmt, str(out)]) == 0
    loaded = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    run = load_run(run_dir, echo=lambda _s: None)
    x = torch.tensor([ids])
    with torch.no_grad():
        theirs, ours = loaded(x).logits, run.model(x).logits
    assert _rel(theirs, ours) < 0.01  # bf16 tolerance (plus one int8 rounding for hf-bnb8)


def _one_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("poetxq: error: "), err
    return err[0]


def test_unreachable_hub_id_is_one_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code = main(["quantize-and-train", *RUN, "--model", "nobody/no-such-model",
                 "--output-dir", str(tmp_path / "o")])  # fmt: skip
    assert code == 2
    assert "hub" in _one_error(capsys)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "case", ["missing", "no-config", "adamw", "gpt2", "run-dir", "baseline-run-dir"]
)
def test_bad_model_is_one_error(checkpoint, tmp_path, capsys, case):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=64, n_head=4).save_pretrained(str(tmp_path / "gpt2"))
    run = tmp_path / "run"  # what poetxq train leaves (a config.json too): not a checkpoint
    run.mkdir()
    for name in ("recipe.yaml", "metrics.jsonl", "config.json"):
        (run / name).write_text("{}")
    base_run = tmp_path / "qgalore-run"  # a baseline's run: exported as hf-bf16 like the others
    base_run.mkdir()
    for name in ("metrics.jsonl", "config.json"):
        (base_run / name).write_text("{}")
    (base_run / "recipe.yaml").write_text("method: qgalore\n")
    model = {"missing": str(tmp_path / "nope"), "no-config": str(tmp_path),
             "adamw": str(checkpoint), "gpt2": str(tmp_path / "gpt2"),
             "run-dir": str(run), "baseline-run-dir": str(base_run)}[case]  # fmt: skip
    extra = ["--method", "adamw"] if case == "adamw" else []
    code = main(["quantize-and-train", *RUN, "--model", model, *extra,
                 "--output-dir", str(tmp_path / "o")])  # fmt: skip
    assert code == 2
    msg = _one_error(capsys)
    assert {"missing": "not an existing directory", "no-config": "config.json",
            "adamw": "poetxq and poetx", "gpt2": "Llama-family",
            "run-dir": "is a poetxq run directory, not a Hugging Face checkpoint; export it",
            "baseline-run-dir": f"'{base_run}' is a poetxq run directory, not a Hugging Face "
            f"checkpoint; export it first (poetxq export {base_run} --format hf-bf16 OUT_DIR)"}[
        case] in msg  # fmt: skip
    assert not (tmp_path / "o").exists()


def test_seq_len_beyond_the_checkpoints_positions_is_one_error(checkpoint, tmp_path, capsys):
    """RoPE extension is not what --model asks for: an error before any work, not a silent
    change of the checkpoint's max_position_embeddings (64 here)."""
    code = main(["quantize-and-train", *RUN, "--model", str(checkpoint), "--seq-len", "128",
                 "--output-dir", str(tmp_path / "o")])  # fmt: skip
    assert code == 2
    msg = _one_error(capsys)
    assert "128" in msg and "max_position_embeddings 64" in msg and "--seq-len 64" in msg
    assert not (tmp_path / "o").exists()


def test_block_size_beyond_the_checkpoints_layers_is_one_error(checkpoint, tmp_path, capsys):
    """A block larger than the checkpoint's smallest layer is refused before the data and the
    model are loaded, as it is for a recipe's own model: here k_proj / v_proj (2 KV heads × 16 =
    32 rows under grouped-query attention), below the hidden size 64."""
    for block in ("128", "64"):
        code = main(["quantize-and-train", *RUN, "--model", str(checkpoint), "--block-size",
                     block, "--output-dir", str(tmp_path / "o")])  # fmt: skip
        assert code == 2
        msg = _one_error(capsys)
        assert f"poet.block_size {block} exceeds the smallest layer dimension 32" in msg
        assert "--block-size 32" in msg and not (tmp_path / "o").exists()


def test_no_progress_hides_transformers_loading_bar(checkpoint, tmp_path, capsys, monkeypatch):
    """--no-progress turns transformers' progress bars ("Loading weights") off for the --model
    load, and back on after it; without it the bar shows as transformers draws it."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from poetxq.model.pretrained import load_pretrained

    assert hf_logging.is_progress_bar_enabled()
    load_pretrained(str(checkpoint), progress=False)
    assert "Loading weights" not in capsys.readouterr().err
    assert hf_logging.is_progress_bar_enabled()  # restored
    load_pretrained(str(checkpoint))
    assert "Loading weights" in capsys.readouterr().err
    # through the command line: the bar's setting while train loads the checkpoint
    seen = []

    def spy(*args, **kwargs):  # records the setting, then stops the run before any step
        seen.append(hf_logging.is_progress_bar_enabled())
        raise OSError("stopped by the test")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", spy)
    shown = [a for a in RUN if a != "--no-progress"]
    for flags in (shown, RUN):
        code = main(["quantize-and-train", *flags, "--model", str(checkpoint),
                     "--output-dir", str(tmp_path / "o")])  # fmt: skip
        err = capsys.readouterr().err.strip().splitlines()  # without the flag: data bars too
        assert code == 2 and err[-1].endswith("': stopped by the test")
    assert seen == [True, False] and hf_logging.is_progress_bar_enabled()


def test_a_checkpoint_without_a_tokenizer_trains_with_tokenizer_named(checkpoint, tmp_path,
                                                                      capsys):  # fmt: skip
    """The no-tokenizer error advises --tokenizer: with --model it takes the checkpoint's
    tokenizer from elsewhere (a fresh bpe or --vocab-size cannot match trained embeddings)."""
    import shutil

    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        if (checkpoint / name).exists():
            shutil.copy(checkpoint / name, bare / name)
    short = [*RUN[: RUN.index("--max-steps")], "--max-steps", "2", "--no-progress"]
    code = main(["quantize-and-train", *short, "--model", str(bare),
                 "--output-dir", str(tmp_path / "o0")])  # fmt: skip
    assert code == 2 and "pass --tokenizer" in _one_error(capsys)
    for bad, says in ((["--tokenizer", "bpe"], "does not match"),
                      (["--vocab-size", "512"], "drop --vocab-size")):  # fmt: skip
        code = main(["quantize-and-train", *short, "--model", str(bare), *bad,
                     "--output-dir", str(tmp_path / "o1")])  # fmt: skip
        assert code == 2 and says in _one_error(capsys)
    assert not (tmp_path / "o0").exists() and not (tmp_path / "o1").exists()
    code = main(["quantize-and-train", *short, *RATES, "--model", str(bare), "--tokenizer",
                 str(checkpoint), "--output-dir", str(tmp_path), "--run-name", "r"])  # fmt: skip
    assert code == 0
    ids = AutoTokenizer.from_pretrained(str(checkpoint))(TEXT).input_ids
    assert AutoTokenizer.from_pretrained(str(tmp_path / "r" / "tokenizer"))(TEXT).input_ids == ids
