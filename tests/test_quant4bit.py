"""4-bit NF4/FP4 blockwise quantization vs bitsandbytes' own quantizer (the oracle)."""

import json

import pytest
import torch

from poetxq.model.layer import POETXLinear
from poetxq.model.quant import Blockwise4bitWeight, make_frozen_weight
from quant_kernels.reference_4bit import (
    dequantize_4bit,
    dequantize_4bit_blockwise,
    get_4bit_code,
    quantize_4bit,
    unpack_4bit,
)
from quant_kernels.reference_double_quant import dynamic_map_8bit

F = pytest.importorskip("bitsandbytes.functional")

# (shape, blocksize): m*n a multiple of the blocksize but not of 256·blocksize (ragged nested
# block), odd element counts, a short last 4-bit block, rows not a multiple of the blocksize.
SHAPES = [
    ((40, 96), 64),  # 60 blocks: nested block of 60 < 256
    ((17, 64 * 17), 64),  # 289 blocks: one full nested block + 33
    ((300, 512), 64),  # 2400 blocks
    ((5, 7), 64),  # 35 elements: odd, one short block
    ((3, 100), 128),  # 300 elements: short last block
    ((96, 192), 32),
]


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("shape,blocksize", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [None, 128, 192])  # elements per pass (whole blocks)
def test_bytes_match_bitsandbytes(
    shape, blocksize, quant_type, double_quant, dtype, chunk, gen, monkeypatch
):
    """Quantized and dequantized in chunks of whole blocks (``QUANT_CHUNK_ELEMENTS``: several per
    weight here, the last one short or odd) or in one pass, the bytes are bitsandbytes' own and
    the values its dequantizer's."""
    if chunk is not None:
        monkeypatch.setattr("quant_kernels.reference_4bit.QUANT_CHUNK_ELEMENTS", chunk)
    w = (torch.randn(shape, generator=gen) * 2).to(dtype)
    w.view(-1)[:3] = 0  # exact zeros (FP4 has two zero codes)
    ref, st = F.quantize_4bit(
        w, blocksize=blocksize, compress_statistics=double_quant, quant_type=quant_type
    )
    q = quantize_4bit(w, quant_type, blocksize, compress_statistics=double_quant)
    assert q.packed.dtype == torch.uint8
    assert q.packed.shape == ref.shape == ((w.numel() + 1) // 2, 1)
    assert torch.equal(q.packed, ref)
    assert torch.equal(q.absmax, st.absmax)
    assert torch.equal(q.quant_map, st.code)
    if double_quant:
        assert q.absmax.dtype == torch.uint8
        assert torch.equal(q.nested_absmax, st.state2.absmax)
        assert torch.equal(q.nested_quant_map, st.state2.code)
        assert q.nested_offset == st.offset.item()
    # bitsandbytes' CPU dequantizer mis-indexes blocks that straddle rows (n % blocksize != 0),
    # so compare with it only where blocks tile the rows; elsewhere with a float64 formula.
    deq = dequantize_4bit(q, torch.float32)
    if shape[1] % blocksize == 0:
        assert torch.equal(dequantize_4bit(q), F.dequantize_4bit(ref, st))  # in w.dtype
    absmax = q.dequantized_absmax().double().repeat_interleave(blocksize)[: w.numel()]
    codes = unpack_4bit(q.packed, w.numel())
    expect = (get_4bit_code(quant_type).double()[codes] * absmax).view(shape)
    torch.testing.assert_close(deq.double(), expect, rtol=1e-6, atol=0)


def test_code_tables_match_bitsandbytes():
    assert torch.equal(dynamic_map_8bit(), F.create_dynamic_map())
    for qt in ("nf4", "fp4"):
        assert torch.equal(get_4bit_code(qt), F.get_4bit_type(qt, device="cpu"))
    with pytest.raises(ValueError, match="int3"):
        get_4bit_code("int3")


def test_code_table_is_cached_and_stores_own_their_copy():
    # the GEMMs ask for the code on every call: it must not be rebuilt (a host-to-device copy on
    # a GPU, refused inside CUDA-graph capture), and a store's quant_map buffer must not alias it
    assert get_4bit_code("nf4") is get_4bit_code("nf4", "cpu")
    q = quantize_4bit(torch.randn(4, 64), "nf4", 64, compress_statistics=False)
    q.quant_map.zero_()
    assert torch.equal(get_4bit_code("nf4"), F.get_4bit_type("nf4", device="cpu"))


def test_high_nibble_first_and_nearest_error(gen):
    w = torch.tensor([[1.0, -1.0, 0.0, 0.5]])  # one block; absmax 1
    q = quantize_4bit(w, "nf4", 64, compress_statistics=False)
    assert q.packed.view(-1).tolist() == [(15 << 4) | 0, (7 << 4) | 12]  # 0.5 -> 0.4407 (12)
    w = torch.randn(64, 128, generator=gen)
    for qt in ("nf4", "fp4"):
        q = quantize_4bit(w, qt, 64, compress_statistics=False)
        code = get_4bit_code(qt).sort().values
        half_gap = ((code[1:] - code[:-1]).max() / 2).item()
        am = q.dequantized_absmax().repeat_interleave(64).view(64, 128)
        assert ((dequantize_4bit(q) - w).abs() <= half_gap * am * 1.01 + 1e-6).all()


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_store_layout_gemms_and_bnb_keys(quant_type, gen):
    w = torch.randn(24, 64, generator=gen)
    store = make_frozen_weight(w, 4, quant_type=quant_type)
    assert isinstance(store, Blockwise4bitWeight)
    deq = store.dequantize()
    ref, st = F.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type=quant_type)
    assert torch.equal(deq, F.dequantize_4bit(ref, st))
    x = torch.randn(3, 5, 64, generator=gen)
    g = torch.randn(3, 5, 24, generator=gen)
    torch.testing.assert_close(store.gemms().matmul(x), x @ deq.t())
    torch.testing.assert_close(store.gemms().matmul_t(g), g @ deq)
    sd = store.state_dict()
    expected = st.as_dict(packed=True)
    assert set(sd) == {"weight"} | {f"weight.{k}" for k in expected}
    assert torch.equal(sd["weight"], ref)
    for k, v in expected.items():
        if k.startswith("quant_state."):
            assert json.loads(bytes(sd[f"weight.{k}"].tolist())) == json.loads(bytes(v.tolist()))
        else:
            assert torch.equal(sd[f"weight.{k}"], v), k
    # round trip into a fresh store; corrupt / missing quant_state -> one clear error, unchanged
    other = make_frozen_weight(torch.randn(24, 64, generator=gen), 4, quant_type=quant_type)
    before = other.state_dict()
    bad = dict(sd)
    bad[f"weight.quant_state.bitsandbytes__{quant_type}"] = torch.tensor([1, 2], dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="corrupt quant_state"):
        other.load_state_dict(bad)
    del bad[f"weight.quant_state.bitsandbytes__{quant_type}"]
    with pytest.raises(RuntimeError, match="missing"):
        other.load_state_dict(bad)
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())
    other.load_state_dict(sd)
    assert torch.equal(other.dequantize(), deq)


def test_make_frozen_weight_rejects_unknown_quant_type():
    with pytest.raises(ValueError, match="int3"):
        make_frozen_weight(torch.randn(4, 64), 4, quant_type="int3")


@pytest.mark.slow
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("double_quant", [True, False])
def test_stochastic_rounding_is_unbiased(quant_type, double_quant, gen):
    w = torch.randn(4, 64, generator=gen)
    draws = 3000
    total = torch.zeros_like(w, dtype=torch.float64)
    sq = torch.zeros_like(total)
    for _ in range(draws):
        q = quantize_4bit(w, quant_type, 64, compress_statistics=double_quant, stochastic=True,
                          generator=gen)  # fmt: skip
        d = dequantize_4bit(q, torch.float32).double()
        total += d
        sq += d * d
    mean = total / draws
    std = (sq / draws - mean * mean).clamp(min=0).sqrt()
    sigma = std / draws**0.5
    err = (mean - w.double()).abs()
    assert torch.all(err <= 3.5 * sigma + 1e-6), (err - 3.5 * sigma).max()
    # nearest rounding is biased on the same input (the test can fail)
    near = dequantize_4bit(quantize_4bit(w, quant_type, 64, compress_statistics=double_quant))
    assert (near.double() - w.double()).abs().max() > 10 * (sigma.max() + 1e-6)


def test_stochastic_is_reproducible_from_generator():
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    a = quantize_4bit(w, "nf4", stochastic=True, generator=torch.Generator().manual_seed(7))
    b = quantize_4bit(w, "nf4", stochastic=True, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a.packed, b.packed) and torch.equal(a.absmax, b.absmax)


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_poetx_linear_4bit_matches_dense_float64(quant_type, gen):
    n, m, b = 64, 48, 16
    layer = POETXLinear(n, m, block_size=b, bits=4, quant_type=quant_type, generator=gen,
                        dtype=torch.float64)  # fmt: skip
    with torch.no_grad():
        for side in (layer.P, layer.R):
            side.Q.copy_(torch.randn(side.Q.shape, generator=gen, dtype=torch.float64) * 0.05)
    x = torch.randn(2, 5, n, generator=gen, dtype=torch.float64, requires_grad=True)
    y = layer(x)
    w_stored = layer.frozen.dequantize(torch.float64)
    w0 = w_stored[layer.R.inv_perm]  # 4-bit stores W'' = Ψ_m W0: rows permuted, columns not
    w_eff = layer.R.dense(torch.float64) @ w0 @ layer.P.dense(torch.float64)
    y_ref = x @ w_eff.t()
    assert ((y - y_ref).norm() / y_ref.norm()).item() <= 1e-12
    (gx,) = torch.autograd.grad(y.square().sum(), x)
    (gx_ref,) = torch.autograd.grad(y_ref.square().sum(), x)
    assert ((gx - gx_ref).norm() / gx_ref.norm()).item() <= 1e-12
    # a merge keeps the function up to 4-bit re-quantization error
    before = layer.effective_weight(torch.float64)
    layer.merge_then_reinitialize(gen)
    rel = ((layer.effective_weight(torch.float64) - before).norm() / before.norm()).item()
    assert 0 < rel < 0.2


def test_dequantize_4bit_blockwise_dtype(gen):
    w = torch.randn(8, 64, generator=gen).bfloat16()
    q = quantize_4bit(w, "nf4", 64, compress_statistics=False)
    out = dequantize_4bit_blockwise(q.packed, q.absmax, "nf4", 64, (8, 64), torch.bfloat16)
    ref, st = F.quantize_4bit(w, blocksize=64, quant_type="nf4")
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, F.dequantize_4bit(ref, st))


@pytest.mark.slow
def test_cli_bits4_short_run_writes_bnb_keys(tmp_path, monkeypatch, capsys):
    from safetensors.torch import load_file
    from test_cli import TINY

    from poetxq.tools.cli import main

    monkeypatch.setenv("POETXQ_CACHE", str(tmp_path / "cache"))
    with pytest.raises(SystemExit) as exc:
        main(["quantize-and-train", "--bits", "4", "--quant-type", "int3"])
    assert exc.value.code == 2 and "invalid choice: 'int3'" in capsys.readouterr().err
    code = main(["quantize-and-train", *TINY, "--output-dir", str(tmp_path), "--run-name", "nf4",
                 "--bits", "4", "--quant-type", "fp4", "--max-steps", "5", "--merge-interval",
                 "2", "--eval-every", "5", "--requant", "stochastic"])  # fmt: skip
    assert code == 0
    summary = json.loads((tmp_path / "nf4" / "summary.json").read_text())
    assert summary["merges"] == 2 and summary["final_val_ppl"] > 0
    state = load_file(tmp_path / "nf4" / "model.safetensors")
    key = "model.layers.0.mlp.down_proj.frozen.weight"
    assert state[key].dtype == torch.uint8 and state[key].shape == (64 * 136 // 2, 1)
    meta = json.loads(bytes(state[f"{key}.quant_state.bitsandbytes__fp4"].tolist()))
    assert meta["quant_type"] == "fp4" and meta["blocksize"] == 64 and meta["shape"] == [64, 136]
    assert state[f"{key}.absmax"].dtype == torch.uint8  # double quant on by default


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_identity_merges_keep_4bit_weights(quant_type):
    """With R = P = I a merge re-stores the same rows, so the 64-blocks are never regrouped and
    nearest rounding reproduces the weight up to the double-quantized absmax (0.2 % here; before
    W'' = Ψ_m W0 the column permutation regrouped the blocks at every merge: 8 % after 10
    merges on this layer)."""
    gen = torch.Generator().manual_seed(5)
    layer = POETXLinear(128, 96, block_size=32, bits=4, quant_type=quant_type, generator=gen)
    w0 = layer.stored_w0(torch.float64)
    for _ in range(10):
        layer.merge_then_reinitialize(gen)
    drift = ((layer.stored_w0(torch.float64) - w0).norm() / w0.norm()).item()
    assert drift < 5e-3, drift
