"""Export: merged frozen weights under bitsandbytes' keys, and ``poetxq export`` directories that
``transformers.AutoModelForCausalLM.from_pretrained`` loads, checked against bitsandbytes' own
functions and transformers' own model."""

import copy
import hashlib
import json
import os
import shutil

import bitsandbytes as bnb
import bitsandbytes.functional as bnbF
import pytest
import torch
from hosts import cpu_host
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from poetxq.model.layer import POETXLinear
from poetxq.tools.cli import main
from poetxq.tools.export import load_run
from poetxq.tools.export_weights import (
    EXPORT_MERGE_SEED,
    bnb_4bit_state_dict,
    decode_state_dict,
    is_merged,
    merged_linear_state_dict,
    merged_state_dict,
    stored_codes_state_dict,
)
from quant_kernels import reference_4bit as q4
from quant_kernels.reference import dequant_int8_rowwise
from quant_kernels.reference_double_quant import double_dequantize_absmax, double_quantize_absmax

# in_features multiples of 64: bitsandbytes 0.50.2's CPU dequantize_4bit is right there
TINY = [
    "--data", "pydoc", "--vocab-size", "512", "--seq-len", "32", "--batch-size", "8",
    "--block-size", "16", "--eval-every", "100", "--no-progress", "--max-steps", "6",
    "--merge-interval", "4",
    "--set", "model.hidden_size=64", "--set", "model.intermediate_size=128",
    "--set", "model.num_attention_heads=4", "--set", "model.num_hidden_layers=2",
    "--set", "train.log_every=2", "--set", "optim.warmup_steps=2",
]  # fmt: skip
TEXT = "def merge(a, b):\n    return sorted(a + b)  # lists, dicts and the for statement"


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("POETXQ_CACHE", str(tmp_path_factory.getbasetemp() / "data-cache"))


def _trained_layer(n: int, m: int, bits: int, quant_type: str = "nf4") -> POETXLinear:
    g = torch.Generator().manual_seed(7)
    layer = POETXLinear(n, m, block_size=16, bits=bits, quant_type=quant_type, generator=g)
    with torch.no_grad():  # as if trained: R, P far from the identity
        layer.P.Q.normal_(0, 0.05, generator=g)
        layer.R.Q.normal_(0, 0.05, generator=g)
    return layer


# ------------------------------------------------------------------------------------------------
# One layer: save -> bitsandbytes load -> the same dequantized weight
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [8, 16])
def test_int8_export_loads_into_linear8bitlt(bits):
    m, n = 96, 128
    layer = _trained_layer(n, m, bits)
    w = layer.effective_weight(torch.float64)
    sd = merged_linear_state_dict(layer, "hf-bnb8")
    assert set(sd) == {"weight", "SCB", "weight_format"} and sd["weight"].dtype == torch.int8
    # the bytes are bitsandbytes' own quantization of the merged weight (it wants fp16 input)
    cb, _, _ = bnbF.int8_vectorwise_quant(w.to(torch.float16))
    assert (sd["weight"].int() - cb.int()).abs().max() <= 1  # fp16 input rounding
    # bitsandbytes loads the state dict (after .to(device) has set up its int8 parameter)
    lin = bnb.nn.Linear8bitLt(n, m, bias=False, has_fp16_weights=False).to("cpu")
    lin.load_state_dict(sd)
    assert torch.equal(lin.weight.data, sd["weight"]) and torch.equal(lin.weight.SCB, sd["SCB"])
    theirs = bnbF.int8_vectorwise_dequant(lin.weight.data, lin.weight.SCB)
    ours = dequant_int8_rowwise(sd["weight"], sd["SCB"])
    torch.testing.assert_close(theirs, ours, rtol=1e-6, atol=0)
    # ... and it is the merged weight R·W0·P up to one int8 rounding: |err| <= absmax_row / 254
    bound = w.abs().amax(1, keepdim=True) / 254 * (1 + 1e-5) + 1e-7
    assert ((ours.double() - w).abs() <= bound).all()
    # bitsandbytes' forward with these weights (training-mode path: dequantize + matmul)
    x = torch.randn(5, n, generator=torch.Generator().manual_seed(1))
    lin.train()
    torch.testing.assert_close(lin(x), x @ ours.t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize(("m", "n"), [(96, 128), (64, 192), (33, 64)])
def test_4bit_export_loads_into_linear4bit(quant_type, m, n):
    layer = _trained_layer(n, m, 4, quant_type)
    w = layer.effective_weight(torch.float32)
    sd = merged_linear_state_dict(layer, "hf-bnb4", quant_type=quant_type)
    assert is_merged(layer)  # its own format: merged first, as training merges
    qs_key = f"weight.quant_state.bitsandbytes__{quant_type}"
    assert qs_key in sd and sd["weight"].shape == (m * n // 2, 1)
    # the merge rounds R·W0·P to nearest once, block by block (rows only permuted), so the nibbles
    # are byte-identical to bitsandbytes quantizing the merged weight itself
    packed, state = bnbF.quantize_4bit(w, blocksize=64, quant_type=quant_type)
    assert torch.equal(sd["weight"], packed)
    # the block scales are bitsandbytes' up to the merge's and the export's 8-bit double quant
    meta = q4.quant_state_from_tensor(sd[qs_key])
    absmax = double_dequantize_absmax(
        sd["weight.absmax"], sd["weight.nested_absmax"], sd["weight.nested_quant_map"],
        meta["nested_offset"],
    )  # fmt: skip
    assert ((absmax - state.absmax).abs() / state.absmax).max() < 0.02
    # Linear4bit.load_state_dict ignores the quant-state keys in bitsandbytes 0.50.2; its way in
    # is Params4bit.from_prequantized (what transformers calls).
    lin = bnb.nn.Linear4bit(n, m, bias=False, quant_type=quant_type)
    stats = {k.removeprefix("weight."): v for k, v in sd.items() if k != "weight"}
    lin.weight = bnb.nn.Params4bit.from_prequantized(sd["weight"], stats, device="cpu", module=lin)
    theirs = bnbF.dequantize_4bit(lin.weight.data, lin.weight.quant_state)
    ours = q4.dequantize_4bit_blockwise(sd["weight"], absmax, quant_type, 64, (m, n))
    assert torch.equal(theirs, ours)
    assert (ours - w).norm() / w.norm() < (0.12 if quant_type == "nf4" else 0.2)  # one rounding
    x = torch.randn(5, n, generator=torch.Generator().manual_seed(1))
    lin.train()
    torch.testing.assert_close(lin(x), x @ ours.t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("bits", "quant_type", "requant"),
    [(4, "nf4", "nearest"), (4, "fp4", "nearest"), (4, "nf4", "stochastic"), (8, "nf4", "nearest"),
     (8, "nf4", "stochastic")],
)  # fmt: skip
def test_export_writes_the_training_merges_codes_unpermuted(bits, quant_type, requant):
    """hf-bnb8 / hf-bnb4 of a store in that format: a training merge, then the stored codes."""
    m, n = 80, 128
    g = torch.Generator().manual_seed(11)
    layer = POETXLinear(n, m, block_size=16, bits=bits, quant_type=quant_type, generator=g,
                        stochastic_requant=requant == "stochastic")  # fmt: skip
    with torch.no_grad():
        layer.P.Q.normal_(0, 0.05, generator=g)
        layer.R.Q.normal_(0, 0.05, generator=g)
    assert not is_merged(layer)
    with pytest.raises(ValueError, match="merge the layer first"):
        stored_codes_state_dict(layer, "hf-bnb4" if bits == 4 else "hf-bnb8")
    twin = copy.deepcopy(layer)
    fmt = "hf-bnb4" if bits == 4 else "hf-bnb8"
    sd = merged_linear_state_dict(layer, fmt, quant_type=quant_type)
    # the layer was merged exactly as training merges (same generator draws, same rounding policy)
    twin.merge_then_reinitialize(torch.Generator().manual_seed(EXPORT_MERGE_SEED))
    for (k, a), (k2, b) in zip(layer.state_dict().items(), twin.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k
    assert is_merged(layer)
    rows = layer.R.perm  # stored row i holds original row rows[i]
    if bits == 8:  # stored Ψ_m W0 Ψ_nᵀ: scatter rows and columns back
        cb = torch.empty_like(layer.frozen.weight)
        cb[rows.unsqueeze(1), layer.P.perm.unsqueeze(0)] = layer.frozen.weight
        scb = torch.empty_like(layer.frozen.SCB)
        scb[rows] = layer.frozen.SCB
        assert torch.equal(sd["weight"], cb) and torch.equal(sd["SCB"], scb)
        # exactly the merged layer's weight (no rounding of any kind)
        assert torch.equal(dequant_int8_rowwise(sd["weight"], sd["SCB"]), layer.stored_w0())
        return
    # stored Ψ_m W0: unpack the nibbles ourselves, scatter whole rows back, pack high nibble first
    byte = layer.frozen.weight.view(-1).long()
    codes = torch.stack([byte >> 4, byte & 15], 1).view(m, n)
    orig = torch.empty_like(codes)
    orig[rows] = codes
    expect = ((orig[:, 0::2] << 4) | orig[:, 1::2]).to(torch.uint8).view(-1, 1)
    assert torch.equal(sd["weight"], expect)
    # block scales travel with their blocks; only the double quant is redone (bitsandbytes' own
    # quantize_blockwise; our reference implementation agrees byte for byte)
    scales = torch.empty(m, n // 64)
    scales[rows] = layer.frozen.dequantized_absmax().view(m, n // 64)
    offset = scales.mean()
    q, st = bnbF.quantize_blockwise(scales.view(-1) - offset, blocksize=256)
    assert torch.equal(sd["weight.absmax"], q) and torch.equal(
        sd["weight.nested_absmax"], st.absmax
    )
    q_ref, nested_ref, _, off_ref = double_quantize_absmax(scales.view(-1))
    assert torch.equal(q, q_ref) and torch.equal(st.absmax, nested_ref)
    meta = q4.quant_state_from_tensor(sd[f"weight.quant_state.bitsandbytes__{quant_type}"])
    assert meta["nested_offset"] == pytest.approx(off_ref.item(), abs=0)
    assert meta["shape"] == [m, n] and meta["blocksize"] == 64 and meta["quant_type"] == quant_type
    absmax = bnbF.dequantize_blockwise(q, st) + offset
    # re-rounding moves the scales little: measured max 1.4e-4 (nf4) / 9.9e-4 (fp4) relative after
    # a nearest merge, 8.7e-3 after a stochastic one (whose nested stats were rounded up)
    assert ((absmax - scales.view(-1)).abs() / scales.view(-1)).max() < 0.015
    # so the exported weight is the merged layer's up to that: measured 6.8e-5 (nf4) / 4.5e-4
    # (fp4) relative after a nearest merge, 3.3e-3 after a stochastic one
    w_out = q4.dequantize_4bit_blockwise(sd["weight"], absmax, quant_type, 64, (m, n))
    assert _rel(w_out, layer.stored_w0()) < (0.005 if requant == "stochastic" else 0.001)


@pytest.mark.slow
def test_4bit_rows_not_multiple_of_64_match_bnb_reference_backend():
    """Blocks that straddle rows: our bytes decode the same as bitsandbytes' pure-torch backend.

    (bitsandbytes 0.50.2's CPU kernel ``dequantize_4bit`` decodes such shapes wrongly when the row
    length is a multiple of 16, e.g. 96; see poetxq/tools/export.py.)
    """
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute

    m, n = 64, 96
    w = torch.randn(m, n, generator=torch.Generator().manual_seed(3))
    sd = bnb_4bit_state_dict(w, "nf4", double_quant=False)
    code = q4.get_4bit_code("nf4")
    theirs = _dequantize_4bit_compute(
        sd["weight"].reshape(-1), sd["weight.absmax"], code, 64, (m, n), torch.float32
    )
    ours = q4.dequantize_4bit_blockwise(sd["weight"], sd["weight.absmax"], "nf4", 64, (m, n))
    assert torch.equal(theirs, ours)


# ------------------------------------------------------------------------------------------------
# poetxq export RUN_DIR --format F OUT_DIR -> from_pretrained -> the same logits
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def _cpu_host():
    """Every export here is of a CPU run and loads on the CPU, also on a GPU host (there
    transformers would put a bitsandbytes model on the GPU)."""
    with cpu_host():
        yield


@pytest.fixture(scope="module")
def runs(tmp_path_factory, _cpu_host):
    """Three tiny finished runs (int8, NF4 and FP4 W0), 6 steps with one merge at step 4, so R and
    P are not the identity at the end."""
    root = tmp_path_factory.mktemp("runs")
    os.environ.setdefault("POETXQ_CACHE", str(tmp_path_factory.getbasetemp() / "data-cache"))
    for name, extra in (("b8", ["--bits", "8"]), ("b4", ["--bits", "4"]),
                        ("b4fp4", ["--bits", "4", "--quant-type", "fp4"])):  # fmt: skip
        code = main(["quantize-and-train", *TINY, *extra, "--output-dir", str(root),
                     "--run-name", name])  # fmt: skip
        assert code == 0
    return root


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _reference_from_export(run, fmt: str) -> torch.nn.Module:
    """fp32 transformers model whose weights are *our* decoding of the exported tensors.

    Builds them as export does, so ``run.model`` is merged in place where export merges.
    """
    sd = merged_state_dict(run.model, fmt, quant_type=run.recipe.poet.quant_type)
    plain = AutoModelForCausalLM.from_config(run.config, dtype=torch.float32)
    plain.load_state_dict(decode_state_dict(sd))
    return plain.eval()


def _digest(run_dir) -> dict[str, str]:
    return {
        str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(run_dir.rglob("*")) if p.is_file()
    }  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    ("bits", "fmt", "vs_ours"),
    # vs the run's own model after export's merge (where it merges): bf16 ~0.3 %; int8 export of
    # an int8 run: its merged codes, plus bitsandbytes' int8 activations on the CPU (0.74 % here);
    # int8 export of an NF4 run: one int8 rounding of R·W0·P (no merge); NF4 export of an NF4 run:
    # its merged codes, bf16 and the re-done double quant (0.7 % here)
    [(8, "hf-bf16", 0.01), (8, "hf-bnb8", 0.02), (4, "hf-bnb8", 0.02), (4, "hf-bnb4", 0.015)],
)
def test_export_loads_with_from_pretrained_and_logits_match(runs, tmp_path, bits, fmt, vs_ours):
    out = tmp_path / "export"
    assert main(["export", str(runs / f"b{bits}"), "--format", fmt, str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    if fmt == "hf-bf16":
        assert "quantization_config" not in config
    else:
        qc = config["quantization_config"]
        assert qc["quant_method"] == "bitsandbytes"
        assert qc["load_in_8bit"] is (fmt == "hf-bnb8") and qc["load_in_4bit"] is (fmt != "hf-bnb8")
    loaded = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    expect = {"hf-bf16": torch.nn.Linear, "hf-bnb8": bnb.nn.Linear8bitLt,
              "hf-bnb4": bnb.nn.Linear4bit}[fmt]  # fmt: skip
    assert type(loaded.model.layers[0].mlp.down_proj) is expect
    assert loaded.dtype == torch.bfloat16

    run = load_run(runs / f"b{bits}", echo=lambda _s: None)
    tok = AutoTokenizer.from_pretrained(str(out))
    ids = tok(TEXT, return_tensors="pt").input_ids
    assert ids.shape[1] > 10 and ids.tolist() == [run.tokenizer(TEXT).input_ids]
    with torch.no_grad():
        theirs = loaded(ids).logits.float()
        ref = _reference_from_export(run, fmt)(ids).logits  # merges run.model as export did
        ours = run.model(ids).logits
    # transformers + bitsandbytes decode the exported bytes as we do (bf16 activations there)
    assert _rel(theirs, ref) < 0.01
    # ... and match the trained POET model (after export's merge) up to bf16 and int8 activations
    assert _rel(theirs, ours) < vs_ours
    assert _rel(ref, ours) < vs_ours


@pytest.mark.slow
@pytest.mark.parametrize(("run_name", "quant_type"), [("b4", "nf4"), ("b4fp4", "fp4")])
def test_bnb4_export_is_the_run_after_one_training_merge(runs, tmp_path, run_name, quant_type):
    """hf-bnb4 of a 4-bit run between merges (R, P != I): export merges as training does and writes
    the stored nibbles un-permuted, so from_pretrained's logits are our model's after that merge.

    Measured (this 2-layer model, torch 2.13 CPU, bitsandbytes 0.50.2): loaded vs merged 0.67 %
    (NF4) / 0.53 % (FP4): bf16 weights and activations in transformers, bf16 embeddings and
    lm_head, and the re-done double quant of the block scales. Loaded vs the *unmerged* model
    11.5 % (NF4) / 10.3 % (FP4): that is the merge itself, one 4-bit rounding of R·W0·P, the same
    change the run's next training merge would make (a weight between merges is not on the
    4-bit grid).
    """
    run_dir = runs / run_name
    before = _digest(run_dir)
    out = tmp_path / "export"
    assert main(["export", str(run_dir), "--format", "hf-bnb4", str(out)]) == 0
    assert _digest(run_dir) == before  # the run directory is read, never written
    info = json.loads((out / "poetxq_export.json").read_text())
    assert info["layers_stored_codes"] == info["layers_merged_as_training"] == 14
    loaded = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert loaded.model.layers[0].mlp.down_proj.weight.quant_state.quant_type == quant_type

    unmerged = load_run(run_dir, echo=lambda _s: None).model
    merged = load_run(run_dir, echo=lambda _s: None).model
    layers = {n: m for n, m in merged.named_modules() if isinstance(m, POETXLinear)}
    assert layers and not any(is_merged(m) for m in layers.values())
    merged_state_dict(merged, "hf-bnb4", quant_type=quant_type)  # export's merge, in memory
    assert all(is_merged(m) for m in layers.values())

    # the exported nibbles are the merged stores' codes with whole rows scattered back (built here
    # from the layers' buffers and permutations, not through export's code)
    exported = load_file(str(out / "model.safetensors"))
    for name, layer in layers.items():
        m, n = layer.out_features, layer.in_features
        byte = layer.frozen.weight.view(-1).long()
        codes = torch.stack([byte >> 4, byte & 15], 1).view(m, n)
        orig = torch.empty_like(codes)
        orig[layer.R.perm] = codes
        expect = ((orig[:, 0::2] << 4) | orig[:, 1::2]).to(torch.uint8).view(-1, 1)
        assert torch.equal(exported[f"{name}.weight"], expect), name

    ids = AutoTokenizer.from_pretrained(str(out))(TEXT, return_tensors="pt").input_ids
    with torch.no_grad():
        theirs = loaded(ids).logits.float()
        ours_merged = merged(ids).logits
        ours_unmerged = unmerged(ids).logits
    vs_merged, vs_unmerged = _rel(theirs, ours_merged), _rel(theirs, ours_unmerged)
    print(f"{quant_type}: exported vs merged {vs_merged:.4f}, vs unmerged {vs_unmerged:.4f}, "
          f"merge itself {_rel(ours_merged, ours_unmerged):.4f}")  # fmt: skip
    assert vs_merged < 0.015  # bf16 level
    assert vs_unmerged < 0.25  # reported, not a tight bound: one 4-bit rounding


@pytest.mark.slow
def test_export_refuses_non_empty_out_dir(runs, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    # not a previous export: refused with or without --overwrite, which is not offered
    for extra in ([], ["--overwrite"]):
        assert main(["export", str(runs / "b8"), "--format", "hf-bf16", str(out), *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "holds no previous export" in err[0], err
        assert "--overwrite" not in err[0]
        assert [p.name for p in out.iterdir()] == ["keep.txt"]
    (out / "keep.txt").unlink()
    assert main(["export", str(runs / "b8"), "--format", "hf-bf16", str(out)]) == 0
    # a previous export: --overwrite is named, and replaces it
    assert main(["export", str(runs / "b8"), "--format", "hf-bnb8", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds a previous export; pass --overwrite" in err[0]
    (out / "stale.txt").write_text("from the previous export")
    assert main(["export", str(runs / "b8"), "--format", "hf-bnb8", str(out), "--overwrite"]) == 0
    assert not (out / "stale.txt").exists() and (out / "model.safetensors").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]  # no temp left


@pytest.mark.slow
def test_export_into_an_unwritable_folder_is_one_line(runs, tmp_path, capsys, monkeypatch):
    from pathlib import Path

    def denied(self, *a, **k):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "mkdir", denied)
    assert main(["export", str(runs / "b8"), "--format", "hf-bf16", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot write the export next to" in err[0], err
    assert "Permission denied" in err[0] and ".tmp-" not in err[0]


@pytest.mark.slow
def test_a_damaged_run_config_is_one_line(runs, tmp_path, capsys):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(runs / "b8", run)
    (run / "config.json").write_text("{not json")
    assert main(["export", str(run), "--format", "hf-bf16", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"poetxq: error: cannot read {run / 'config.json'}")
    assert "the run directory is damaged" in err[0] and not (tmp_path / "o").exists()


@pytest.mark.slow
def test_export_never_overwrites_the_run_or_its_parent(runs, capsys):
    before = sorted(p.name for p in runs.iterdir())
    files = sorted(p.name for p in (runs / "b8").iterdir())
    for out in (runs / "b8", runs, runs / "b8" / "sub"):
        code = main(["export", str(runs / "b8"), "--format", "hf-bf16", str(out), "--overwrite"])
        assert code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "overlaps the run directory" in err[0]
    assert sorted(p.name for p in runs.iterdir()) == before
    assert sorted(p.name for p in (runs / "b8").iterdir()) == files


@pytest.mark.slow
def test_failed_export_leaves_out_dir_as_it_was(runs, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    (out / "poetxq_export.json").write_text("{}")  # a previous export: --overwrite may replace it

    def boom(*_a, **_k):
        raise OSError("disk full")

    monkeypatch.setattr("poetxq.training.checkpoint.save_file", boom)
    code = main(["export", str(runs / "b8"), "--format", "hf-bnb8", str(out), "--overwrite"])
    assert code == 2 and "disk full" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt", "poetxq_export.json"]
    assert not [p for p in tmp_path.iterdir() if p.name != "out"]


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_export_of_checkpoint_with_bad_quant_state_is_one_error(runs, tmp_path, capsys, damage):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(runs / "b4", run)
    sd = load_file(str(run / "model.safetensors"))
    key = next(k for k in sd if k.endswith("quant_state.bitsandbytes__nf4"))
    if damage == "missing":
        del sd[key]
    else:
        sd[key] = torch.tensor(list(b"{not json"), dtype=torch.uint8)
    save_file(sd, str(run / "model.safetensors"))
    out = tmp_path / "out"
    assert main(["export", str(run), "--format", "hf-bnb4", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("poetxq: error: ") and "quant_state" in err[0]
    assert not out.exists()


def test_export_of_a_non_run_is_one_error(tmp_path, capsys):
    (tmp_path / "r").mkdir()
    assert main(["export", str(tmp_path / "r"), "--format", "hf-bf16", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a finished run directory" in err[0]


@pytest.mark.slow
def test_export_refuses_non_finite_weights_and_writes_into_cwd(runs, tmp_path, capsys,
                                                               monkeypatch):  # fmt: skip
    import shutil

    run = tmp_path / "run"
    shutil.copytree(runs / "b8", run)
    sd = load_file(str(run / "model.safetensors"))
    sd["model.embed_tokens.weight"][3, 5] = float("nan")  # damaged bytes that still parse
    save_file(sd, str(run / "model.safetensors"))
    assert main(["export", str(run), "--format", "hf-bnb8", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "NaN/inf" in err[0] and "embed_tokens" in err[0]
    assert not (tmp_path / "out").exists()
    here = tmp_path / "here"  # OUT_DIR "." is the current (empty) directory itself
    here.mkdir()
    monkeypatch.chdir(here)
    assert main(["export", str(runs / "b8"), "--format", "hf-bf16", "."]) == 0
    assert (here / "model.safetensors").is_file()


def test_unfinished_run_names_resume(tmp_path):
    """A run stopped before its end holds checkpoints but no model.safetensors: the error says
    how to finish it instead of calling the folder foreign."""
    from poetxq.tools.export import ExportError, export_run

    run = tmp_path / "stopped"
    (run / "checkpoints" / "step-00000010").mkdir(parents=True)
    with pytest.raises(ExportError, match=r"has not finished.*--resume"):
        export_run(run, "hf-bf16", tmp_path / "out")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["qgalore", "adamw"])
def test_a_baseline_run_exports_as_bf16_and_loads_with_its_logits(tmp_path, capsys, method):
    """Q-GaLore's int8 groups are dequantized into plain linears (AdamW's weights are plain
    already): the hf-bf16 export loads in transformers and gives the run's logits up to bf16."""
    from poetxq.baselines.qlinear import QuantLinear, dequantize_groupwise

    runs = tmp_path / "runs"
    poet_only = {"--block-size", "--merge-interval"}
    flags = [a for i, a in enumerate(TINY) if a not in poet_only and TINY[i - 1] not in poet_only]
    assert main(["train", "--method", method, *flags, "--set", "baseline.rank=8",
                 "--output-dir", str(runs), "--run-name", method]) == 0  # fmt: skip
    run_dir = runs / method
    out = tmp_path / "export"
    assert main(["export", str(run_dir), "--format", "hf-bnb8", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"poetxq: error: {method} runs export as hf-bf16 only (their weights are not "
                   "stored in a bitsandbytes layout); pass --format hf-bf16"]  # fmt: skip
    assert main(["export", str(run_dir), "--format", "hf-bf16", str(out)]) == 0
    loaded = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert type(loaded.model.layers[0].mlp.down_proj) is torch.nn.Linear
    # the reference: the run's own file, decoded independently of export's code
    state = load_file(str(run_dir / "model.safetensors"))
    key = "model.layers.1.mlp.down_proj"
    if method == "qgalore":
        assert state[f"{key}.weight"].dtype == torch.uint8
        group = load_run(run_dir, echo=lambda _s: None).recipe.baseline.weight_group_size or 256
        want = dequantize_groupwise(state[f"{key}.weight"], state[f"{key}.scales"],
                                    state[f"{key}.zeros"], group)  # fmt: skip
    else:
        want = state[f"{key}.weight"]
    got = loaded.model.layers[1].mlp.down_proj.weight.float()
    torch.testing.assert_close(got, want.to(torch.bfloat16).float(), rtol=0, atol=0)
    assert not any(isinstance(m, QuantLinear) for m in load_run(run_dir).model.modules())
    tok = AutoTokenizer.from_pretrained(str(out))
    ids = tok(TEXT, return_tensors="pt").input_ids
    with torch.no_grad():
        theirs = loaded(ids).logits.float()
        ours = load_run(run_dir, echo=lambda _s: None).model(ids).logits
    assert _rel(theirs, ours) < 0.01  # bf16 weights and activations against fp32


@pytest.mark.parametrize(
    ("method", "fmt"),
    [("qgalore", "hf-bnb8"), ("qapollo", "hf-bnb4"), ("adamw", "hf-bnb8"),
     ("galore", "hf-bnb4"), ("apollo", "hf-bnb8")],
)  # fmt: skip
def test_a_baseline_run_is_refused_another_format_before_its_model_is_read(
    tmp_path, capsys, monkeypatch, method, fmt
):
    """The format refusal comes from recipe.yaml alone: with a model.safetensors that cannot be
    read (and safetensors' loader never called) the error is still that one line."""
    import safetensors.torch

    from poetxq.training.recipe import dump_recipe
    from poetxq.training.recipe_files import load_recipe

    run = tmp_path / method
    run.mkdir()
    tiny = os.path.join(os.path.dirname(__file__), "..", "recipes", "tiny", f"{method}.yaml")
    (run / "recipe.yaml").write_text(dump_recipe(load_recipe(tiny)))
    (run / "model.safetensors").write_bytes(b"not safetensors")  # load_run would fail on it

    def never(*args, **kwargs):
        raise AssertionError("model.safetensors was read")

    monkeypatch.setattr(safetensors.torch, "load_file", never)
    out = tmp_path / "export"
    assert main(["export", str(run), "--format", fmt, str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"poetxq: error: {method} runs export as hf-bf16 only (their weights are not "
                   "stored in a bitsandbytes layout); pass --format hf-bf16"]  # fmt: skip
    assert not out.exists()


def test_a_damaged_model_file_points_to_the_newest_checkpoint(runs, tmp_path, capsys):
    run = tmp_path / "b8"
    shutil.copytree(runs / "b8", run)
    model_file = run / "model.safetensors"
    model_file.write_bytes(model_file.read_bytes()[:100])  # cut short
    assert main(["export", str(run), "--format", "hf-bf16", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    newest = sorted((run / "checkpoints").iterdir())[-1]
    assert len(err) == 1 and err[0].startswith(f"poetxq: error: cannot read {model_file}: ")
    assert err[0].endswith(
        f"export the run's newest checkpoint instead (poetxq export {newest} ...)"
    )
    assert main(["export", str(newest), "--format", "hf-bf16", str(tmp_path / "out")]) == 0
