"""The kernel policy (quant_kernels.policy) and the paths the entry points take by it.

The policy is data, so it gets a test: its defaults are the measured choices of docs/KERNELS.md,
``POETXQ_KERNELS`` maps onto it in one place, and the entry points follow the policy they are
given (fake CUDA tensors stand in where only the decision is checked).
"""

import dataclasses

import pytest
import torch

import quant_kernels
from quant_kernels import cnp_hybrid, policy, reference
from quant_kernels.policy import (
    AUTO,
    STREAMED_MIN_M,
    KernelPolicy,
    default_policy,
    slab_bytes_for,
)

needs_triton = pytest.mark.skipif(not quant_kernels.HAS_TRITON, reason="triton not installed")


class _FakeCuda:
    """Stands in for a CUDA tensor in the policy's decisions only."""

    def __init__(self, rows: int, cols: int = 8, dtype: torch.dtype = torch.bfloat16) -> None:
        self.is_cuda = True
        self.shape = (rows, cols)
        self.dtype = dtype
        self.device = torch.device("cuda", 0)

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]


def test_the_default_is_every_measured_path():
    # every switch on: each was measured faster on the H200 (docs/KERNELS.md names the files)
    choices = ("weight_gemm", "w0_gemm", "int8_dx_rounding")
    switches = [f.name for f in dataclasses.fields(AUTO) if f.name not in choices]
    assert all(getattr(AUTO, n) is True for n in switches if n != "interpret_on_cpu")
    assert not AUTO.interpret_on_cpu and AUTO.weight_gemm == "auto"
    # the int8 tensor-core path is not measured yet: auto keeps the dequant GEMMs
    assert AUTO.w0_gemm == "auto" and AUTO.int8_dx_rounding == "nearest"
    assert KernelPolicy() == AUTO
    with pytest.raises(dataclasses.FrozenInstanceError):
        AUTO.fused_cnp = False  # type: ignore[misc]


def test_cpu_tensors_never_use_kernels():
    x = torch.zeros(4096, 8)
    assert not AUTO.uses_triton(x)
    assert AUTO.weight_gemm_path(x) == "torch" and AUTO.weight_gemm_path(x, bits=4) == "torch"
    assert not AUTO.feature_major_for(x) and not AUTO.fused_cnp_for(x, 3)
    assert not AUTO.triton_8bit_update_for(x)


@needs_triton
def test_weight_gemm_paths_and_slabs():
    small, big = _FakeCuda(STREAMED_MIN_M - 1), _FakeCuda(STREAMED_MIN_M)
    assert AUTO.weight_gemm_path(small) == "fused"
    assert AUTO.weight_gemm_path(big) == "streamed"
    assert AUTO.weight_gemm_path(small, bits=4) == "streamed"  # 4-bit: always
    for gemm in ("fused", "streamed", "torch"):
        pol = KernelPolicy(weight_gemm=gemm)
        assert pol.weight_gemm_path(small) == pol.weight_gemm_path(big) == gemm
    assert KernelPolicy(weight_gemm="fused").weight_gemm_path(small, bits=4) == "streamed"
    assert KernelPolicy(triton=False).weight_gemm_path(big) == "torch"
    assert slab_bytes_for(2048) == 64 * 2**20 and slab_bytes_for(8192) == 32 * 2**20


def test_poetxq_kernels_maps_onto_the_policy_in_one_place(monkeypatch):
    assert KernelPolicy.from_env({}) == AUTO
    assert KernelPolicy.from_env({"POETXQ_KERNELS": "auto"}) == AUTO
    assert KernelPolicy.from_env({"POETXQ_KERNELS": "torch"}) == KernelPolicy(triton=False)
    assert KernelPolicy.from_env({"POETXQ_KERNELS": "fused"}).weight_gemm == "fused"
    assert KernelPolicy.from_env({"POETXQ_KERNELS": "streamed"}).weight_gemm == "streamed"
    with pytest.raises(ValueError, match="POETXQ_KERNELS='bogus'; use one of auto, fused"):
        KernelPolicy.from_env({"POETXQ_KERNELS": "bogus"})
    monkeypatch.setenv("POETXQ_KERNELS", "torch")
    assert default_policy() == KernelPolicy(triton=False)
    monkeypatch.delenv("POETXQ_KERNELS")
    assert default_policy() == AUTO


def test_overrides_name_fields_and_refuse_the_rest():
    pol = AUTO.with_overrides(["fused_cnp=0", "weight_gemm=streamed"])
    assert pol == KernelPolicy(fused_cnp=False, weight_gemm="streamed")
    assert AUTO.with_overrides([]) == AUTO
    for bad in ("fused_cnp=yes", "NO_SUCH_FIELD=1", "fused_cnp", "weight_gemm=fastest"):
        with pytest.raises(ValueError, match="use NAME=0 or NAME=1 with NAME one of triton, "):
            AUTO.with_overrides([bad])
    with pytest.raises(ValueError, match="weight_gemm='fastest'"):
        KernelPolicy(weight_gemm="fastest")
    with pytest.raises(ValueError, match="fused_cnp must be True or False"):
        KernelPolicy(fused_cnp=1)  # type: ignore[arg-type]


def test_w0_gemm_choices_and_overrides():
    pol = AUTO.with_overrides(["w0_gemm=int8", "int8_dx_rounding=stochastic"])
    assert pol == KernelPolicy(w0_gemm="int8", int8_dx_rounding="stochastic")
    for bad in ("w0_gemm=fp8", "int8_dx_rounding=1"):
        with pytest.raises(ValueError, match=r"w0_gemm=auto\|bf16\|int8"):
            AUTO.with_overrides([bad])
    with pytest.raises(ValueError, match="w0_gemm='int4'"):
        KernelPolicy(w0_gemm="int4")


def test_int8_mma_path_by_choice(monkeypatch):
    cpu = torch.zeros(4096, 8)
    assert AUTO.int8_mma_path(cpu) is None  # auto: the dequant path
    assert KernelPolicy(w0_gemm="bf16").int8_mma_path(cpu) is None
    assert KernelPolicy(w0_gemm="int8").int8_mma_path(cpu) == "torch"  # the reference
    assert KernelPolicy(w0_gemm="int8", triton=False).int8_mma_path(cpu) == "torch"
    if quant_kernels.HAS_TRITON:
        on_cpu = KernelPolicy(w0_gemm="int8", interpret_on_cpu=True)
        assert on_cpu.int8_mma_path(cpu) == "triton"
        assert on_cpu.int8_mma_path(cpu.double()) == "torch"  # not a Triton dtype
    big, small = _FakeCuda(policy.INT8_MMA_MIN_M), _FakeCuda(policy.INT8_MMA_MIN_M - 1)
    if quant_kernels.HAS_TRITON:
        assert KernelPolicy(w0_gemm="int8").int8_mma_path(small) == "triton"
    assert AUTO.int8_mma_path(big) is None  # INT8_MMA_AUTO is off until measured
    # with it on: sm80+ cards from INT8_MMA_MIN_M rows
    monkeypatch.setattr(policy, "INT8_MMA_AUTO", True)
    monkeypatch.setattr(policy, "HAS_TRITON", True)
    cap = {"value": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap["value"])
    assert AUTO.int8_mma_path(big) == "triton" and AUTO.int8_mma_path(small) is None
    cap["value"] = (7, 5)
    assert AUTO.int8_mma_path(big) is None


@needs_triton
def test_fused_cnp_serves_k3_and_the_triton_dtypes():
    fp32, bf16 = _FakeCuda(4, 120, torch.float32), _FakeCuda(4, 120, torch.bfloat16)
    assert AUTO.fused_cnp_for(fp32, 3) and AUTO.fused_cnp_for(bf16, 3)
    assert AUTO.fused_cnp_for(_FakeCuda(4, 120, torch.float16), 3)
    assert not AUTO.fused_cnp_for(fp32, 4)  # only k = 3 is fused
    assert not AUTO.fused_cnp_for(_FakeCuda(4, 120, torch.float64), 3)
    assert not KernelPolicy(fused_cnp=False).fused_cnp_for(bf16, 3)
    assert not KernelPolicy(triton=False).fused_cnp_for(bf16, 3)


@needs_triton
def test_layer_switches_are_on_for_cuda_triton_dtypes_only():
    act = _FakeCuda(4, 8, torch.bfloat16)
    assert AUTO.feature_major_for(act) and AUTO.feature_major_for(act, fast=True)
    assert AUTO.lean_fast_swiglu_for(act)
    assert AUTO.fused_input_cast_for(_FakeCuda(4, 8, torch.float32), torch.bfloat16)
    assert not AUTO.fused_input_cast_for(act, torch.bfloat16)  # nothing to cast
    assert not AUTO.feature_major_for(_FakeCuda(4, 8, torch.float64))
    assert not KernelPolicy(feature_major=False).feature_major_for(act)
    assert KernelPolicy(feature_major=False).feature_major_for(act, fast=True)
    assert not KernelPolicy(fast_feature_major=False).feature_major_for(act, fast=True)
    assert not KernelPolicy(triton=False).feature_major_for(act)
    # the estimator's view: what a GPU run with the policy takes
    assert AUTO.on_gpu("lean_fast_swiglu") and not KernelPolicy(triton=False).on_gpu("fused_cnp")


def test_the_cnp_entry_point_uses_torch_on_cpu():
    packed = (torch.randn(3, 28, generator=torch.Generator().manual_seed(0)) * 0.1).double()
    leaf = packed.clone().requires_grad_(True)
    g = quant_kernels.cayley_neumann(leaf, 8, 3, kernels=KernelPolicy(weight_gemm="fused"))
    ref_leaf = packed.clone().requires_grad_(True)
    ref = reference.cayley_neumann(ref_leaf, 8, 3)
    assert torch.equal(g, ref)
    d_g = torch.randn(3, 8, 8, dtype=torch.float64)
    g.backward(d_g)
    ref.backward(d_g)
    assert torch.equal(leaf.grad, ref_leaf.grad)


@needs_triton
def test_fused_cnp_under_autocast_runs_in_the_autocast_dtype(monkeypatch, gen):
    """fp32 ``Q`` under autocast reaches the fused kernels in bf16 — the dtype autocast gives
    the reference's products, whose ``G`` is bf16 — and the gradient flows back to fp32. (The
    values agree with autocast's run of the reference to bf16 rounding, not bit for bit: there
    the elementwise sums stay fp32.)"""
    seen = []

    def fake_fused(x, b, terms):
        seen.append(x.dtype)
        return reference.cayley_neumann(x, b, terms)

    monkeypatch.setattr(cnp_hybrid, "cayley_neumann_fused", fake_fused)
    on_cpu = KernelPolicy(interpret_on_cpu=True)  # the fused path for CPU tensors
    packed = (0.1 * torch.randn(2, 6, generator=gen)).requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        g = quant_kernels.cayley_neumann(packed, 4, kernels=on_cpu)
        with torch.no_grad():
            ref = reference.cayley_neumann(packed, 4, 3)  # autocast's own run of the reference
    assert seen == [torch.bfloat16] and g.dtype == ref.dtype == torch.bfloat16
    assert (g.detach().float() - ref.float()).abs().max().item() <= 2**-7
    g.float().sum().backward()
    assert packed.grad.dtype == torch.float32 and packed.grad.abs().sum() > 0
    quant_kernels.cayley_neumann(packed.detach(), 4, kernels=on_cpu)  # fp32 goes through as is
    assert seen[-1] == torch.float32
