"""The layer's feature-major layout (poetxq.model.layout.FeatureMajor: quant_kernels.transpose_perm
+ WeightFormat.matmul_fm) against its row-major torch path.

On the CPU the Triton kernels run in the interpreter: the layers here run under policies that
let the Triton paths serve CPU tensors (``interpret_on_cpu``) with only the switches under test on
(:func:`forced`), against the same layer under its default policy (the torch path on the CPU).
"""

import dataclasses
import os

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":  # CPU tensors through the Triton interpreter
    pytest.skip(
        "forces the Triton paths on CPU tensors: needs TRITON_INTERPRET=1 (set by "
        "tests/conftest.py without a GPU); on a GPU, `python evals/gpu_suite.py --parts "
        "correctness` checks these paths at real sizes",
        allow_module_level=True,
    )

import quant_kernels
from poetxq.model.layer import POETXLinear
from poetxq.model.layout import ROW_MAJOR
from quant_kernels.policy import AUTO, KernelPolicy

_SWITCHES = [f.name for f in dataclasses.fields(KernelPolicy)
             if f.name not in ("triton", "weight_gemm", "interpret_on_cpu", "w0_gemm",
                               "int8_dx_rounding")]  # fmt: skip


def forced(weight_gemm: str = "torch", **on: bool) -> KernelPolicy:
    """A policy with only the switches ``on`` (and ``weight_gemm``: by default the reference
    GEMMs), serving CPU tensors through the Triton interpreter as a GPU would."""
    return KernelPolicy(**{n: on.get(n, False) for n in _SWITCHES}, weight_gemm=weight_gemm,
                        interpret_on_cpu=True)  # fmt: skip


def _run(layer, x, gate_up=None):
    layer.zero_grad(set_to_none=True)
    if gate_up is None:
        xx = x.clone().requires_grad_(True)
        y = layer(xx)
        inputs = [xx]
    else:
        gate, up = (t.clone().requires_grad_(True) for t in gate_up)
        y = layer.forward_swiglu(gate, up)
        inputs = [gate, up]
    y.backward(torch.linspace(-1, 1, y.numel()).view_as(y))
    grads = [t.grad for t in inputs] + [layer.P.Q.grad, layer.R.Q.grad]
    return y.detach(), grads


def _case(n, m, bits, swiglu, gen, variant="mem"):
    """A layer with non-trivial Q, an input (or gate/up pair): the arguments of _run."""
    layer = POETXLinear(n, m, block_size=16, bits=bits, variant=variant, generator=gen)
    with torch.no_grad():
        for side in (layer.P, layer.R):
            side.Q.copy_(0.1 * torch.randn(side.Q.shape, generator=gen))
    x = torch.randn(2, 5, n, generator=gen)
    gate_up = (torch.randn(2, 5, n, generator=gen), torch.randn(2, 5, n, generator=gen))
    return layer, x, gate_up if swiglu else None


def _assert_same(got, want):
    """Equal up to fp32 rounding in another summation order: relative 1e-5, and absolute 1e-6
    of the tensor's largest magnitude (an element near zero may differ by an ulp of the terms
    summed into it)."""
    (y, g), (y_ref, g_ref) = got, want
    for a, b in zip([y, *g], [y_ref, *g_ref], strict=True):
        if b is None:
            assert a is None
            continue
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * max(1.0, b.abs().max().item()))


# (32 -> 48, b = 16): no ragged block; (40 -> 56): ragged on both sides, which falls back;
# bits 4 keeps its store in input order: the wrapper gathers whole feature-major rows
@pytest.mark.parametrize(
    "n,m,bits,taken", [(32, 48, 8, True), (32, 48, 16, True), (40, 56, 8, False),
                       (32, 48, 4, True)],
)  # fmt: skip
@pytest.mark.parametrize("swiglu", [False, True])
def test_feature_major_path_equals_torch_path(n, m, bits, taken, swiglu, monkeypatch, gen):
    args = _case(n, m, bits, swiglu, gen)
    y_ref, g_ref = _run(*args)
    calls = []
    for name in ("permute_to_feature_major", "permute_to_row_major"):
        real = getattr(quant_kernels, name)

        def counting(*a, _real=real, _name=name, **k):
            calls.append(_name)
            return _real(*a, **k)

        monkeypatch.setattr(quant_kernels, name, counting)
    args[0].use_kernels(forced(feature_major=True))
    y, g = _run(*args)
    # forward: x in, y out; backward: x and dy in, dx out
    into, out = calls.count("permute_to_feature_major"), calls.count("permute_to_row_major")
    assert (into, out) == ((3, 2) if taken else (0, 0))
    _assert_same((y, g), (y_ref, g_ref))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("freeze_r", [False, True])
def test_one_decode_backward_equals_torch_path(bits, freeze_r, monkeypatch, gen):
    """The feature-major int8 / 4-bit backward that decodes each slab once for the recompute and
    the dX GEMM (KernelPolicy.one_decode_backward), in several bands of whole
    blocks (272 = 17·16 rows, bands of 128, 128, 16), equals the torch path; with R frozen it
    skips the recompute."""
    import quant_kernels.streamed as streamed

    layer, x, _ = _case(32, 272, bits, False, gen)
    layer.R.Q.requires_grad_(not freeze_r)
    y_ref, g_ref = _run(layer, x)
    bands = []
    real = streamed.streamed_backward_fm

    def recording(*a, on_rows, **k):
        def rec(row0, rows):
            bands.append((row0, rows.shape[0]))
            on_rows(row0, rows)

        return real(*a, on_rows=rec, **k)

    monkeypatch.setattr(streamed, "streamed_backward_fm", recording)
    monkeypatch.setattr(quant_kernels.formats, "slab_bytes_for", lambda _rows: 1)  # smallest bands
    layer.use_kernels(forced("streamed", feature_major=True, one_decode_backward=True))
    y, g = _run(layer, x)
    assert bands == ([] if freeze_r else [(0, 128), (128, 128), (256, 16)])
    _assert_same((y, g), (y_ref, g_ref))
    assert (g[2] is None) == freeze_r


def _count_calls(monkeypatch, owner, names):
    calls = []
    for name in names:
        real = getattr(owner, name)

        def counting(*a, _real=real, _name=name, **k):
            calls.append(_name)
            return _real(*a, **k)

        monkeypatch.setattr(owner, name, counting)
    return calls


# as above: (32 -> 48) takes the path (the 4-bit store too), ragged sides fall back; with a
# side frozen its block gradient is skipped
@pytest.mark.parametrize(
    "n,m,bits,taken", [(32, 48, 8, True), (32, 48, 16, True), (40, 56, 8, False),
                       (32, 48, 4, True)],
)  # fmt: skip
@pytest.mark.parametrize("frozen_side", [None, "P", "R"])
def test_fast_feature_major_path_equals_torch_path(n, m, bits, taken, frozen_side, monkeypatch,
                                                   gen):  # fmt: skip
    layer, x, _ = _case(n, m, bits, False, gen, variant="fast")
    if frozen_side:
        getattr(layer, frozen_side).Q.requires_grad_(False)
    y_ref, g_ref = _run(layer, x)
    perms = _count_calls(monkeypatch, quant_kernels,
                         ("permute_to_feature_major", "permute_to_row_major"))  # fmt: skip
    weight_format = type(layer.frozen.gemms())
    gemms = _count_calls(monkeypatch, weight_format, ("matmul_fm", "matmul_t_fm", "backward_fm"))
    layer.use_kernels(forced(fast_feature_major=True))
    y, g = _run(layer, x)
    # forward: x in, y out; backward: dy in, dx out; one forward GEMM and one dX GEMM (the
    # saved hᵀ serves dG_R: no recompute)
    counts = (perms.count("permute_to_feature_major"), perms.count("permute_to_row_major"))
    assert counts == ((2, 2) if taken else (0, 0))
    assert gemms == (["matmul_fm", "matmul_t_fm"] if taken else [])
    _assert_same((y, g), (y_ref, g_ref))
    assert (g[1 if frozen_side == "P" else 2] is None) == (frozen_side is not None)


def test_fast_feature_major_path_is_on_by_default_on_cuda_only(gen):
    x = torch.randn(4, 32, generator=gen)
    assert AUTO.fast_feature_major  # measured on the H200
    assert not AUTO.feature_major_for(x, fast=True)  # CPU tensors keep the autograd path
    as_on_a_gpu = KernelPolicy(interpret_on_cpu=True)
    assert as_on_a_gpu.feature_major_for(x, fast=True)
    assert not as_on_a_gpu.feature_major_for(x.double(), fast=True)  # not a Triton dtype
    off = KernelPolicy(interpret_on_cpu=True, fast_feature_major=False)
    assert not off.feature_major_for(x, fast=True)


@pytest.mark.parametrize("variant", ["mem", "fast"])
@pytest.mark.parametrize("bits", [8, 16, 4])
def test_fused_input_cast_equals_a_separate_cast(variant, bits, monkeypatch, gen):
    """fp32 activations under bf16 autocast: the feature-major path takes x uncast and casts it
    in its first permutation (KernelPolicy.fused_input_cast), and returns dx in fp32 from its
    last one. x holds bf16-representable values, so both casts are exact and the two runs must
    agree to the bit (the interpreter truncates where torch rounds)."""
    layer, _, _ = _case(32, 48, bits, False, gen, variant=variant)
    x = torch.randn(2, 5, 32, generator=gen).to(torch.bfloat16).float()
    layer.use_kernels(forced(feature_major=True, fast_feature_major=True))
    seen, written = [], []
    real_in, real_out = quant_kernels.permute_to_feature_major, quant_kernels.permute_to_row_major

    def recording(a, inv, out_dtype=None):
        seen.append((a.dtype, out_dtype))
        return real_in(a, inv, out_dtype=out_dtype)

    def recording_out(a, perm, out_dtype=None):
        out = real_out(a, perm, out_dtype=out_dtype)
        written.append(out.dtype)
        return out

    monkeypatch.setattr(quant_kernels, "permute_to_feature_major", recording)
    monkeypatch.setattr(quant_kernels, "permute_to_row_major", recording_out)

    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y, g = _run(layer, x)
        return y, g

    y_ref, g_ref = run()
    assert all(a == torch.bfloat16 for a, _ in seen)  # cast by torch before the layer's path
    assert written == [torch.bfloat16, torch.bfloat16]  # y, and dx (autograd casts it back)
    seen.clear()
    written.clear()
    layer.use_kernels(forced(feature_major=True, fast_feature_major=True, fused_input_cast=True))
    y, g = run()
    assert (torch.float32, torch.bfloat16) in seen  # x went in uncast
    assert written == [torch.bfloat16, torch.float32]  # y; dx written in fp32 by the kernel
    assert y.dtype == torch.bfloat16 and g[0].dtype == torch.float32
    assert torch.equal(y, y_ref)
    for a, b in zip(g, g_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_fused_input_cast_needs_every_path_feature_major(gen):
    """A ragged layer (40 -> 56) cannot take x uncast: its autograd path needs the cast."""
    layer, _, _ = _case(40, 56, 8, False, gen)
    layer.use_kernels(forced(feature_major=True, fused_input_cast=True))
    x = torch.randn(3, 40, generator=gen)
    assert layer.layout.for_call(x, torch.bfloat16, fast_training=False) == (ROW_MAJOR, False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, g = _run(layer, x)
    assert y.dtype == torch.bfloat16 and g[0].dtype == torch.float32


@pytest.mark.parametrize("bits", [8, 16, 4])
@pytest.mark.parametrize("frozen_side", [None, "P", "R"])
def test_lean_fast_swiglu_equals_the_composition_and_keeps_less(bits, frozen_side, monkeypatch,
                                                                gen):  # fmt: skip
    """The fast down projection under SwiGLU (KernelPolicy.lean_fast_swiglu): the same values
    and gradients as down(SiLU(gate) · up) on the fast feature-major path, with SiLU(gate) and
    the permuted input (2 · T · f fp32 elements here) no longer saved."""
    layer, _, gate_up = _case(32, 48, bits, True, gen, variant="fast")
    if frozen_side:
        getattr(layer, frozen_side).Q.requires_grad_(False)
    layer.use_kernels(forced(fast_feature_major=True))

    def run():
        saved, fns = [], []

        def pack(t):
            saved.append(t.numel() * t.element_size())
            return t

        layer.zero_grad(set_to_none=True)
        gate, up = (t.clone().requires_grad_(True) for t in gate_up)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = layer.forward_swiglu(gate, up)
        fns.append(type(y.grad_fn).__name__)
        y.backward(torch.linspace(-1, 1, y.numel()).view_as(y))
        grads = [gate.grad, up.grad, layer.P.Q.grad, layer.R.Q.grad]
        return y.detach(), grads, sum(saved), fns

    y_ref, g_ref, bytes_ref, fns_ref = run()
    layer.use_kernels(forced(fast_feature_major=True, lean_fast_swiglu=True))  # as on a GPU
    y, g, bytes_lean, fns = run()
    assert fns_ref == ["POETXFastFmFnBackward"] and fns == ["SwiGLUDownFnBackward"]
    assert bytes_ref - bytes_lean == 2 * 10 * 32 * 4  # SiLU(gate) and x'ᵀ: [10 tokens, f = 32]
    _assert_same((y, g), (y_ref, g_ref))
    assert (g[2 if frozen_side == "P" else 3] is None) == (frozen_side is not None)
