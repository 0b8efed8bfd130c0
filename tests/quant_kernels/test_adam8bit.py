"""quant_kernels.adam8bit: the blockwise 8-bit AdamW update with a table-driven code search.

Oracles: ``torch.searchsorted`` for the table, bitsandbytes' own Triton kernel of the same update
(bit for bit, both through Triton's CPU interpreter without a GPU) and a float64 AdamW step.
"""

from __future__ import annotations

import pytest
import torch

F = pytest.importorskip("bitsandbytes.functional")

from quant_kernels.adam8bit import BLOCK, adam8bit_update, search_table  # noqa: E402

MAPS = {"signed": True, "unsigned": False}
# the kernel runs on CUDA tensors where a GPU is, else on CPU tensors through Triton's interpreter
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _probe_values(code: torch.Tensor) -> torch.Tensor:
    """Every map entry, its float neighbours, the midpoints between entries, random values,
    zeros, tiny and subnormal values, in [-1, 1]."""
    gen = torch.Generator().manual_seed(0)
    up, down = torch.nextafter(code, code + 1), torch.nextafter(code, code - 1)
    mid = (code[1:] + code[:-1]) / 2
    tiny = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e-40, -1e-40, 1e-7, -1e-7, 3e-7, 1.0, -1.0])
    rand = torch.cat([torch.rand(20000, generator=gen) * 2 - 1,
                      (torch.rand(20000, generator=gen) * 2 - 1) ** 7])  # fmt: skip
    return torch.cat([code, up, down, mid, tiny, rand]).clamp(-1.0, 1.0)


@pytest.mark.parametrize("kind", MAPS)
def test_table_gives_the_count_of_entries_below_every_value(kind):
    code = F.create_dynamic_map(signed=MAPS[kind])
    table = search_table(code).long()
    x = _probe_values(code)
    key = (x.view(torch.int32).long() & 0xFFFFFFFF) >> 16  # sign, exponent, 7 mantissa bits
    below = table[key]
    pos = below + (x > code[below]).long()
    torch.testing.assert_close(pos, torch.searchsorted(code, x), rtol=0, atol=0)


def test_table_refuses_buckets_that_hold_two_entries_and_bad_maps():
    code = F.create_dynamic_map(signed=True)
    with pytest.raises(ValueError, match="two or more quant_map entries"):
        search_table(code, mantissa_bits=0)
    with pytest.raises(ValueError, match="strictly increasing"):
        search_table(code.flip(0))
    with pytest.raises(ValueError, match=r"\[256\] float32"):
        search_table(code.double())


def _run(update, n: int, dtype: torch.dtype, weight_decay: float, steps: int = 4):
    q1 = F.create_dynamic_map(signed=True).to(DEV)
    q2 = F.create_dynamic_map(signed=False).to(DEV)
    gen = torch.Generator().manual_seed(1)
    p = torch.randn(n, generator=gen).to(DEV, dtype)
    s1 = torch.zeros(n, dtype=torch.uint8, device=DEV)
    s2 = torch.zeros(n, dtype=torch.uint8, device=DEV)
    nb = -(-n // BLOCK)
    a1, a2 = torch.zeros(nb, device=DEV), torch.zeros(nb, device=DEV)
    for step in range(1, steps + 1):
        g = (torch.randn(n, generator=gen) * torch.rand(n, generator=gen) ** 4).to(DEV, dtype)
        update(g, p, s1, s2, step, q1, q2, a1, a2, weight_decay)
    return p, s1, s2, a1, a2


def _ours(g, p, s1, s2, step, q1, q2, a1, a2, wd):
    adam8bit_update(g, p, s1, s2, 0.9, 0.999, 1e-8, step, 1e-3, q1, q2, a1, a2, wd)


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # interpreter: 0/0 in empty blocks
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "wd"), [(256 * 5 + 77, 0.01), (256 * 8, 0.0)])
def test_update_is_bit_identical_to_bitsandbytes_triton_kernel(dtype, n, wd):
    kernels_optim = pytest.importorskip("bitsandbytes.backends.triton.kernels_optim")

    def bnb(g, p, s1, s2, step, q1, q2, a1, a2, wd):
        kernels_optim.optimizer_update_8bit_blockwise_impl(
            "adam", g, p, s1, s2, 0.9, 0.999, 0.0, 0.0, 1e-8, step, 1e-3, q1, q2, a1, a2, wd
        )

    names = ("p", "state1", "state2", "absmax1", "absmax2")
    want, got = _run(bnb, n, dtype, wd), _run(_ours, n, dtype, wd)
    for a, b, name in zip(want, got, names, strict=True):
        assert torch.equal(a, b), name


@pytest.mark.filterwarnings("ignore:invalid value encountered")
def test_first_step_follows_float64_adamw_and_states_hold_the_moments():
    n, lr, wd, eps = 256 * 3 + 5, 1e-2, 0.1, 1e-8
    gen = torch.Generator().manual_seed(2)
    p0, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    q1, q2 = F.create_dynamic_map(signed=True), F.create_dynamic_map(signed=False)
    p, s1 = p0.clone().to(DEV), torch.zeros(n, dtype=torch.uint8, device=DEV)
    s2 = torch.zeros(n, dtype=torch.uint8, device=DEV)
    a1, a2 = torch.zeros(-(-n // BLOCK), device=DEV), torch.zeros(-(-n // BLOCK), device=DEV)
    maps = (q1.to(DEV), q2.to(DEV))
    adam8bit_update(g.to(DEV), p, s1, s2, 0.9, 0.999, eps, 1, lr, *maps, a1, a2, wd)
    p, s1, s2, a1, a2 = (t.cpu() for t in (p, s1, s2, a1, a2))
    pd, gd = p0.double(), g.double()
    m, v = 0.1 * gd, 0.001 * gd * gd
    want = pd * (1 - lr * wd) - lr / 0.1 * m / (v.sqrt() / 0.001**0.5 + eps)
    torch.testing.assert_close(p.double(), want, rtol=0, atol=1e-6)
    blocks = torch.arange(n) // BLOCK
    m8, v8 = q1[s1.long()] * a1[blocks], q2[s2.long()] * a2[blocks]
    assert (m8.double() - m).abs().max() <= 0.02 * m.abs().max()  # 8-bit dynamic codes
    assert (v8.double() - v).abs().max() <= 0.02 * v.abs().max()
    for b in range(a1.numel()):  # absmax: the largest |moment| of each block (the last one partial)
        block = slice(b * BLOCK, (b + 1) * BLOCK)
        torch.testing.assert_close(a1[b].double(), m[block].abs().max(), rtol=1e-6, atol=0)
        torch.testing.assert_close(a2[b].double(), v[block].abs().max(), rtol=1e-6, atol=0)


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # interpreter: empty blocks
def test_bad_arguments_are_refused_in_one_line(monkeypatch):
    q = F.create_dynamic_map(signed=True).to(DEV)
    p, g = torch.zeros(300, device=DEV), torch.zeros(300, device=DEV)
    s, a = torch.zeros(300, dtype=torch.uint8, device=DEV), torch.zeros(2, device=DEV)
    with pytest.raises(ValueError, match="300 elements"):
        adam8bit_update(g[:10], p, s, s, 0.9, 0.999, 1e-8, 1, 1e-3, q, q, a, a)
    with pytest.raises(ValueError, match="2 blocks"):
        adam8bit_update(g, p, s, s, 0.9, 0.999, 1e-8, 1, 1e-3, q, q, a[:1], a)
    with pytest.raises(ValueError, match="uint8"):
        adam8bit_update(g, p, s.float(), s, 0.9, 0.999, 1e-8, 1, 1e-3, q, q, a, a)
    with pytest.raises(ValueError, match="step must be >= 1"):
        adam8bit_update(g, p, s, s, 0.9, 0.999, 1e-8, 0, 1e-3, q, q, a, a)
    wide = torch.zeros(300, 2, device=DEV)
    with pytest.raises(ValueError, match="p must be contiguous"):
        adam8bit_update(g, wide[:, 0], s, s, 0.9, 0.999, 1e-8, 1, 1e-3, q, q, a, a)
    with pytest.raises(ValueError, match="absmax1 must be float32"):
        adam8bit_update(g, p, s, s, 0.9, 0.999, 1e-8, 1, 1e-3, q, q, a.half(), a)
    with pytest.raises(ValueError, match="p and g must be fp32, fp16 or bf16"):
        adam8bit_update(g, p.int(), s, s, 0.9, 0.999, 1e-8, 1, 1e-3, q, q, a, a)
    # a short view of a map, even one whose table is cached, is refused before the kernel
    adam8bit_update(g, p, s, s.clone(), 0.9, 0.999, 1e-8, 1, 1e-3, q, q, a, a.clone())
    with pytest.raises(ValueError, match=r"quant maps must be \[256\]"):
        adam8bit_update(g, p, s, s, 0.9, 0.999, 1e-8, 1, 1e-3, q[:128], q, a, a)
    with pytest.raises(ValueError, match="quant_map1 must be contiguous"):
        adam8bit_update(
            g, p, s, s, 0.9, 0.999, 1e-8, 1, 1e-3, torch.stack([q, q], 1)[:, 0], q, a, a
        )
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # CPU tensors without the interpreter
    cpu = [t.cpu() for t in (g, p, s, s, a, a)]
    with pytest.raises(ValueError, match="runs on CUDA tensors"):
        adam8bit_update(*cpu[:4], 0.9, 0.999, 1e-8, 1, 1e-3, q.cpu(), q.cpu(), *cpu[4:])


@pytest.mark.filterwarnings("ignore:invalid value encountered")
def test_maps_made_under_inference_mode_are_accepted():
    with torch.inference_mode():
        q1, q2 = F.create_dynamic_map(signed=True), F.create_dynamic_map(signed=False)
    n = 300
    p, g = torch.randn(n).to(DEV), torch.randn(n).to(DEV)
    s1, s2 = (
        torch.zeros(n, dtype=torch.uint8, device=DEV),
        torch.zeros(n, dtype=torch.uint8, device=DEV),
    )
    a1, a2 = torch.zeros(2, device=DEV), torch.zeros(2, device=DEV)
    adam8bit_update(g, p, s1, s2, 0.9, 0.999, 1e-8, 1, 1e-3, q1.to(DEV), q2.to(DEV), a1, a2)
    assert bool((a1 > 0).all()) and bool((a2 > 0).all())


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # interpreter: 0/0 in empty blocks
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_device_scalars_give_the_host_scalar_update_bit_for_bit(dtype):
    from quant_kernels.adam8bit import adam8bit_update_device_scalars

    lrs = [1e-3, 3.7e-4, 2.2e-3, 1e-5]  # a schedule: the lr changes every step

    def host(g, p, s1, s2, step, q1, q2, a1, a2, wd):
        adam8bit_update(g, p, s1, s2, 0.9, 0.999, 1e-8, step, lrs[step - 1], q1, q2, a1, a2, wd)

    scalars = torch.zeros(3, device=DEV)

    def device(g, p, s1, s2, step, q1, q2, a1, a2, wd):
        # written in place before each call, as the graph's host side does before a replay
        scalars.copy_(torch.tensor([lrs[step - 1], 0.9**step, 0.999**step], dtype=torch.float64))
        adam8bit_update_device_scalars(g, p, s1, s2, 0.9, 0.999, 1e-8, scalars, q1, q2, a1, a2, wd)

    n = 256 * 3 + 5
    want, got = _run(host, n, dtype, 0.01), _run(device, n, dtype, 0.01)
    assert not torch.equal(want[0], _run(host, n, dtype, 0.01, steps=3)[0])  # the steps count
    if DEV == "cuda":  # compiled, a float argument is fp32 as the loaded scalar is: bit for bit
        for w, g in zip(want, got, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
        return
    # Triton's interpreter keeps float arguments in float64 inside ``1 - beta2**t``: the host
    # path differs there by ~1e-7 relative; the codes may flip where a value sits on a midpoint
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    for w, g in zip(want[1:3], got[1:3], strict=True):
        assert (w == g).float().mean() > 0.99
    for w, g in zip(want[3:], got[3:], strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=0)


def test_device_scalars_must_be_three_fp32_on_the_device():
    from quant_kernels.adam8bit import adam8bit_update_device_scalars

    q1 = F.create_dynamic_map(signed=True).to(DEV)
    q2 = F.create_dynamic_map(signed=False).to(DEV)
    p, g = torch.zeros(256, device=DEV), torch.zeros(256, device=DEV)
    s = torch.zeros(256, dtype=torch.uint8, device=DEV)
    a = torch.zeros(1, device=DEV)
    for bad in (torch.zeros(2, device=DEV), torch.zeros(3, dtype=torch.float64, device=DEV)):
        with pytest.raises(ValueError, match=r"scalars must be \[3\] contiguous float32"):
            adam8bit_update_device_scalars(g, p, s, s.clone(), 0.9, 0.999, 1e-8, bad, q1, q2,
                                           a, a.clone())  # fmt: skip
