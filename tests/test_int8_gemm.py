"""``poet.gemm: int8`` end to end on the CPU: the recipe key reaches the layers' kernel policy,
a POET-XQ layer's forward and dX stay within the derived quantization bound of the dequant
(``bf16``) path, and a tiny model trains.

The CPU runs the plain-torch int8 reference (quant_kernels.reference_int8_mma); its kernels are
tested in tests/quant_kernels/test_int8_mma.py."""

import dataclasses

import pytest
import torch

from poetxq.model.config import ModelConfig, POETConfig
from poetxq.model.layer import POETXLinear
from poetxq.model.surgery import build_llama, convert_to_poetx, poet_layers, summarize
from quant_kernels import reference_int8_mma
from quant_kernels.policy import KernelPolicy

INT8 = KernelPolicy(w0_gemm="int8")


def _pair(variant: str, gen_seed: int, n: int = 48, m: int = 40, b: int = 8):
    """The same layer twice (same W0, permutations, Q): on the int8 path and on the dequant
    path."""
    layer = POETXLinear(n, m, block_size=b, bits=8, variant=variant, kernels=INT8,
                        generator=torch.Generator().manual_seed(gen_seed))  # fmt: skip
    with torch.no_grad():
        for side in (layer.P, layer.R):
            side.Q.copy_(0.05 * torch.randn(side.Q.shape, generator=torch.Generator()
                                            .manual_seed(gen_seed + 1)))  # fmt: skip
    twin = POETXLinear(n, m, block_size=b, bits=8, variant=variant,
                       kernels=KernelPolicy(w0_gemm="bf16"))  # fmt: skip
    twin.load_state_dict(layer.state_dict())
    return layer, twin


def _row_sums_norm(w: torch.Tensor, dim: int) -> torch.Tensor:
    """‖ Σ |w| along ``dim`` ‖₂: permutation-invariant, so the stored ``W'`` serves for W0."""
    return w.abs().sum(dim=dim).norm()


@pytest.mark.parametrize("variant", ["fast", "mem"])
def test_layer_forward_and_dx_within_the_bound_of_the_dequant_path(variant):
    """Per token, ‖Δy‖₂ = ‖Δh‖₂ (R is orthogonal) ≤ (s_z/2)·‖Σ_k|W[n,k]|‖₂ with
    s_z = max|z|/127 ≤ ‖z‖₂/127 ≈ ‖x‖₂/127 (P orthogonal); dX likewise with
    s_g ≤ max(SCB/127)·‖dy‖₂/127 and the codes' column sums. 1 % covers the Cayley–Neumann
    blocks' deviation from orthogonality at this ‖Q‖, the rest the fp32 rounding of both paths."""
    layer, twin = _pair(variant, 3)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 9, 48, generator=gen)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = layer(xa), twin(xb)
    dy = torch.randn(ya.shape, generator=gen)
    ya.backward(dy)
    yb.backward(dy)

    cb, scb = layer.frozen.weight, layer.frozen.SCB
    w = cb.double() * (scb.double() / 127)[:, None]
    tok = x.reshape(-1, 48).double().norm(dim=1)
    bound_y = 1.01 * tok / 254 * _row_sums_norm(w, 1) + 1e-5 * yb.reshape(-1, 40).norm(dim=1)
    err_y = (ya - yb).reshape(-1, 40).double().norm(dim=1)
    assert (err_y <= bound_y).all()
    assert (err_y / bound_y).max() > 0.01, (err_y / bound_y).max()  # not vacuous

    g_tok = dy.reshape(-1, 40).double().norm(dim=1)
    scale = (scb.double() / 127).max()
    bound_dx = (1.01 * scale * g_tok / 254 * _row_sums_norm(cb.double(), 0)
                + 1e-5 * xb.grad.reshape(-1, 48).norm(dim=1))  # fmt: skip
    err_dx = (xa.grad - xb.grad).reshape(-1, 48).double().norm(dim=1)
    assert (err_dx <= bound_dx).all()
    assert (err_dx / bound_dx).max() > 0.01
    # the block gradients stay close (they see the quantized h / dz only through the GEMMs)
    for pa, pb in zip(layer.orthogonal_parameters(), twin.orthogonal_parameters(), strict=True):
        assert ((pa.grad - pb.grad).norm() / pb.grad.norm()).item() < 0.05


def _tiny(gemm: str):
    torch.manual_seed(0)
    cfg = ModelConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                      num_hidden_layers=2)  # fmt: skip
    model = build_llama(cfg, 64)
    convert_to_poetx(model, POETConfig(block_size=8, gemm=gemm),
                     generator=torch.Generator().manual_seed(1))  # fmt: skip
    return model


def test_recipe_gemm_reaches_every_layer():
    for gemm, want in (("int8", "int8"), ("bf16", "bf16"), ("auto", "auto")):
        layers = poet_layers(_tiny(gemm))
        assert layers and all(layer.kernels.w0_gemm == want for layer in layers)
    model = build_llama(ModelConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                    num_hidden_layers=1), 64)  # fmt: skip
    report = convert_to_poetx(model, POETConfig(block_size=8, gemm="int8"))
    assert "int8 x int8 GEMMs" in summarize(model, report).splitlines()[0]
    report = convert_to_poetx(build_llama(ModelConfig(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=1), 64),
        POETConfig(block_size=8))  # fmt: skip
    assert report.w0_gemm == "auto"
    # auto leaves an explicit policy's own choice
    model = build_llama(ModelConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                    num_hidden_layers=1), 64)  # fmt: skip
    convert_to_poetx(model, POETConfig(block_size=8),
                     kernels=dataclasses.replace(INT8, fused_cnp=False))  # fmt: skip
    assert all(layer.kernels.w0_gemm == "int8" for layer in poet_layers(model))


@pytest.mark.slow
def test_tiny_model_trains_on_the_int8_path(monkeypatch):
    calls = {"fwd": 0, "dx": 0}
    fwd, dx = reference_int8_mma.int8_mma_matmul, reference_int8_mma.int8_mma_matmul_t

    def count_fwd(*a, **k):
        calls["fwd"] += 1
        return fwd(*a, **k)

    def count_dx(*a, **k):
        calls["dx"] += 1
        return dx(*a, **k)

    monkeypatch.setattr(reference_int8_mma, "int8_mma_matmul", count_fwd)
    monkeypatch.setattr(reference_int8_mma, "int8_mma_matmul_t", count_dx)
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(2))
    losses = {}
    for gemm in ("int8", "bf16"):
        model = _tiny(gemm)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-2)
        run = []
        for _ in range(25):
            loss = model(input_ids=tokens, labels=tokens).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            run.append(loss.item())
        losses[gemm] = run
        if gemm == "int8":
            assert calls["fwd"] > 0 and calls["dx"] > 0  # the int8 path served the GEMMs
            seen = dict(calls)
    assert calls == seen  # and the bf16 run did not touch it
    a, b = losses["int8"], losses["bf16"]
    assert a[-1] < 0.7 * a[0]  # the int8 path trains
    assert abs(a[0] - b[0]) / b[0] < 0.01  # the same model at the start, to quantization error
    assert abs(a[-1] - b[-1]) / b[-1] < 0.15  # and a similar one after 25 steps


@pytest.mark.slow
def test_cli_flag_sets_the_recipe_key(tiny_train, tmp_path, capsys):
    import yaml

    from poetxq.tools.cli import main

    losses, _ = tiny_train("int8", "--gemm", "int8")
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    saved = yaml.safe_load((tmp_path / "int8" / "recipe.yaml").read_text())
    assert saved["poet"]["gemm"] == "int8"
    bad = ["validate", "recipes/tiny/poetxq.yaml", "--set", "poet.bits=4",
           "--set", "poet.gemm=int8"]  # fmt: skip
    capsys.readouterr()
    assert main(bad) == 2
    err = capsys.readouterr().err.strip()
    assert "poet.gemm: int8 needs an int8 W0" in err and "\n" not in err  # one line
