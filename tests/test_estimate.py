"""The memory estimator against a hand computation, real byte counts of built models and
optimizers after one step, and the tensors autograd really saves (CPU)."""

import dataclasses
import math

import pytest
import torch

from poetxq.baselines import optimizer_state_bytes, quant_modules
from poetxq.model.surgery import build_llama, convert_to_poetx, poet_layers
from poetxq.tools.estimate_report import format_estimate, parse_bytes
from poetxq.training import estimate as estimate_mod
from poetxq.training.baseline_methods import build_baseline_optimizer, prepare_baseline
from poetxq.training.estimate import EstimateError, estimate_memory
from poetxq.training.evaluate import causal_lm_loss
from poetxq.training.optim import build_optimizer
from poetxq.training.recipe_files import load_recipe
from quant_kernels.policy import AUTO, KernelPolicy

V = 96


def _recipe(method="poetxq", **over):
    base = {
        "method": method, "model.hidden_size": 64, "model.intermediate_size": 176,
        "model.num_attention_heads": 4, "model.num_hidden_layers": 2, "poet.block_size": 32,
        "baseline.rank": 8, "train.batch_size": 2, "train.seq_len": 16,
    }  # fmt: skip
    base.update(over)
    return load_recipe(None, base)


def test_hand_computation_poetxq_int8_autocast():
    """d=64, f=192, h=4, L=2, b=32 (no ragged block), V=96, B=2, S=16 (T=32), autocast."""
    r = _recipe(**{"model.intermediate_size": 192, "train.fuse_elementwise": False})
    est = estimate_memory(r, vocab_size=V, precision="autocast")
    d, f, L, T, b = 64, 192, 2, 32, 32
    shapes = [(d, d)] * 4 + [(f, d)] * 2 + [(d, f)]  # (out m, in n)
    # int8 store: m*n codes + 4*m SCB + 1 weight_format byte
    assert est.frozen_weights == L * sum(m * n + 4 * m + 1 for m, n in shapes)
    # Q per side: ceil(dim/32) blocks x 496 packed entries, fp32
    q = L * sum((n // b + m // b) * 496 for m, n in shapes)
    assert q == 2 * (4 * 4 * 496 + 3 * 8 * 496) == 39680
    other = 2 * V * d + (2 * L + 1) * d  # embeddings, lm_head, norms
    assert est.num_trainable == q + other
    assert est.trainable_params == 4 * (q + other) == est.gradients
    # torch AdamW: two fp32 moments + a 4-byte step per tensor (14 Q sides, 2 embeddings, 5 norms)
    assert est.optimizer_states == 8 * (q + other) + 4 * (L * 14 + 2 + 5)
    assert est.buffers == L * sum(16 * (m + n) for m, n in shapes)  # perm + inv_perm, int64
    # activations: per layer and token 34d + 4f + 8 + 4h; per side the bf16 blocks G (the CNP
    # keeps no intermediates); once, the concatenated fp32 Q of all sides (the batched CNP's
    # input); head: ids, fp32 cos/sin, final norm, bf16 lm_head copy
    blocks = sum(n // b + m // b for m, n in shapes)
    # MLP keeps gate, up only; q/k/v keep their shared fp32 input, not a bf16 copy each (a
    # GPU's fused input cast: 6d -> 4d)
    layer = T * (34 * d - 2 * d + 4 * f + 8 + 16) + blocks * b * b * 2
    assert est.layer_activations == layer
    head = 8 * 2 * 17 + 2 * 16 * 16 * 4 + T * (10 * d + 4) + 2 * V * d  # cos/sin [1, S, 16]
    assert est.activations == L * layer + head + 4 * q
    assert est.logits == 12 * T * V
    assert est.workspace == 4 * 2 * T * f + f * d * 2
    persistent = est.frozen_weights + est.buffers + est.trainable_params + est.optimizer_states
    # a GPU run of this recipe replays a CUDA graph (train.cuda_graph auto): every gradient is a
    # static tensor made before the capture, alive from the start of backward
    assert est.cuda_graph
    start = est.activations + est.logits + est.workspace + est.gradients
    end = est.gradients + layer + est.workspace
    step = est.gradients + max(4 * q, 4 * other)
    assert est.peak == persistent + max(start, end, step) == persistent + start
    # eager: only lm_head's gradient (fp32 [V, d]) exists when backward starts
    eager = estimate_memory(
        _recipe(**{"model.intermediate_size": 192, "train.fuse_elementwise": False,
                   "train.cuda_graph": False}), vocab_size=V, precision="autocast",
    )  # fmt: skip
    assert not eager.cuda_graph and eager.activations == est.activations
    start = est.activations + est.logits + est.workspace + 4 * V * d
    assert eager.peak == persistent + max(start, end, step)
    # poetxq.model.fuse (on by default on a GPU): a compiled RMSNorm keeps its input and the per-row
    # scale, not an fp32 copy beside the normalized rows: 4d bytes per token less per norm
    fused = estimate_memory(_recipe(**{"model.intermediate_size": 192}), vocab_size=V)
    assert fused.layer_activations == layer - T * 2 * 4 * d
    assert fused.head_activations == head - T * 4 * d
    # poetxq.model.flat with 8-bit states: a Q of 2 or 6 blocks x 496 entries leaves gaps between
    # the 256-aligned slots, so the CNP still concatenates (the gapless case: ACT_CASES)
    flat = estimate_memory(
        _recipe(**{"model.intermediate_size": 192, "train.fuse_elementwise": False,
                   "optim.state_bits": 8}), vocab_size=V,
    )  # fmt: skip
    assert flat.activations == L * layer + head + 4 * q


def _build(recipe, dtype=torch.float32, kernels=None):
    model = build_llama(recipe.model, V, dtype=dtype if dtype != torch.float32 else None)
    if recipe.method in ("poetxq", "poetx"):
        g = torch.Generator().manual_seed(0)
        convert_to_poetx(model, recipe.poet, generator=g, kernels=kernels)
        opt = build_optimizer(model, recipe.optim)
    else:
        rep = prepare_baseline(model, recipe.method, recipe.baseline)
        opt = build_baseline_optimizer(model, rep, recipe.baseline, recipe.optim)
    return model, opt


METHOD_CASES = [
    ("poetxq", {}), ("poetxq", {"poet.bits": 4}), ("poetxq", {"poet.bits": 4,
    "poet.double_quant": False}), ("poetx", {}), ("poetxq", {"poet.variant": "fast"}),
    ("adamw", {}), ("muon", {}), ("galore", {}), ("apollo", {}), ("qgalore", {}),
    ("qapollo", {}),
    ("qgalore", {"baseline.proj_bits": 32, "baseline.state_bits": 32}),
    ("poetxq", {"optim.state_bits": 8, "poet.block_size": 64}),  # Q of 2016 and 6048 entries
    ("poetxq", {"poet.structure": "full"}),  # POET-FS: every block but one masked
    # heads x head_dim != hidden (Qwen3's shapes): q_proj and o_proj are not square
    ("poetxq", {"model.head_dim": 32}), ("qgalore", {"model.head_dim": 32}),
]  # fmt: skip


@pytest.mark.parametrize("method,over", METHOD_CASES, ids=lambda x: str(x))
def test_parameter_and_state_bytes_equal_a_built_model_after_one_step(method, over):
    recipe = _recipe(method, **over)  # f=176 is ragged for b=32
    est = estimate_memory(recipe, vocab_size=V, precision="fp32")
    torch.manual_seed(0)
    model, opt = _build(recipe)
    layers = poet_layers(model)
    qmods = quant_modules(model)
    frozen = sum(layer.frozen.nbytes() for layer in layers) + sum(q.nbytes() for q in qmods)
    buffers = sum(
        t.nbytes for layer in layers for side in (layer.P, layer.R)
        for t in (side.perm, side.inv_perm, side.mask) if t is not None
    )  # fmt: skip
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert est.frozen_weights == frozen
    assert est.buffers == buffers
    sides = [side for layer in layers for side in (layer.P, layer.R)]
    q_ids = {id(side.Q) for side in sides}
    counted = sum(side.num_trainable() for side in sides)  # masked entries do not train
    counted += sum(p.numel() for p in trainable if id(p) not in q_ids)
    counted += sum(q.weight.numel() for q in qmods)  # int8 weights, updated in place
    assert est.num_trainable == counted
    assert est.trainable_params == sum(p.nbytes for p in trainable)
    loss = causal_lm_loss(model, torch.randint(0, V, (2, 17)))
    loss.backward()
    grads = sum(p.grad.nbytes for p in trainable) + sum(q.float_grad.nbytes for q in qmods)
    assert est.gradients == grads
    opt.step()
    assert est.optimizer_states == optimizer_state_bytes(opt)


def _saved_bytes(model, windows, autocast=False):
    """Bytes of the distinct storages autograd saves in one forward (parameters and buffers,
    which live anyway, excluded)."""
    live = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in live:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast),
    ):
        model(input_ids=windows[:, :-1])
    return sum(seen.values())


ACT_CASES = [
    ("poetxq", "bf16-true", {}), ("poetxq", "autocast", {}), ("poetxq", "fp32", {}),
    ("poetxq", "bf16-true", {"poet.variant": "fast"}),
    ("poetxq", "autocast", {"poet.variant": "fast"}),
    ("poetx", "fp32", {"poet.variant": "fast"}), ("adamw", "bf16-true", {}),
    ("adamw", "autocast", {}),
    ("qgalore", "autocast", {}), ("poetxq", "bf16-true", {"train.gradient_checkpointing": True}),
    ("poetxq", "autocast", {"train.gradient_checkpointing": True}),
    # 8-bit states, b = 128: every Q fills whole 256-element blocks, the flat group is gapless
    # and the batched CNP reads Q through a view (poetxq.model.flat), no concatenated copy
    ("poetxq", "autocast", {"optim.state_bits": 8, "model.hidden_size": 512,
                            "model.intermediate_size": 1024, "poet.block_size": 128}),
]  # fmt: skip


@pytest.mark.parametrize("method,precision,over", ACT_CASES, ids=lambda x: str(x))
def test_activations_equal_what_autograd_saves(method, precision, over, monkeypatch):
    # the CPU model runs eager RMSNorms and the torch layer path: the estimate without
    # poetxq.model.fuse's compiled ones and without the GPU's kernel paths (POETXQ_KERNELS=torch,
    # which the estimate reads as the layers do)
    monkeypatch.setenv("POETXQ_KERNELS", "torch")
    recipe = _recipe(
        method, **{"model.intermediate_size": 192, "train.fuse_elementwise": False, **over}
    )
    est = estimate_memory(recipe, vocab_size=V, precision=precision)
    torch.manual_seed(0)
    model, _ = _build(recipe, torch.bfloat16 if precision == "bf16-true" else torch.float32)
    if recipe.train.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    saved = _saved_bytes(model, torch.randint(0, V, (2, 17)), autocast=precision == "autocast")
    if recipe.train.gradient_checkpointing:
        # the estimate adds one recomputed layer; the rotary cos/sin [1, S, 16] are kept as
        # checkpoint inputs, not through saved-tensor hooks
        rotary = 2 * 16 * 16 * (2 if precision == "bf16-true" else 4)
        assert saved == est.activations - est.layer_activations - rotary
    else:
        assert saved == est.activations


@pytest.mark.parametrize("b,copies", [(256, 2), (384, 3)])  # 384 pads 8192 to whole blocks
def test_a_merge_is_the_peak_when_a_step_holds_little(b, copies):
    """Llama-70B, lowest plan, 1 x 16 tokens: the step's transients are small (its largest,
    lm_head's gradient and states during its update, 0.98 GiB), so the merge between steps (fp32
    R·W0·P of the largest layer, 28672 x 8192: two copies, three where a side is padded) is the
    peak, over the persistent tensors only."""
    from poetxq.training.memory import apply_plan, plan_overrides

    r = load_recipe("llama-70b:poetxq4", {"poet.block_size": b})
    r = apply_plan(r, plan_overrides(r, "lowest")[0], "lowest")
    assert r.train.offload_optimizer
    est = estimate_memory(r, batch_size=1, seq_len=16, precision="bf16-true")
    assert est.merge_workspace == copies * 4 * 28672 * 8192
    assert est.peak_phase == "merge"
    persistent = est.frozen_weights + est.buffers + est.trainable_params
    if not est.offload_optimizer:
        persistent += est.optimizer_states
    assert est.peak == persistent + est.merge_workspace
    assert ("merge workspace", est.merge_workspace) in est.peak_terms
    assert "merge workspace" in format_estimate(est) and "at the merge" in format_estimate(est)
    # a baseline never merges
    assert estimate_memory(load_recipe("llama-8b:qgalore", {})).merge_workspace == 0


def test_checkpointing_shrinks_activations_and_format():
    r = load_recipe("llama-8b:poetxq", {"poet.block_size": 256})
    a = estimate_memory(r, vocab_size=32000, batch_size=1, seq_len=2048, precision="bf16-true")
    r2 = load_recipe("llama-8b:poetxq", {"train.gradient_checkpointing": True})
    b = estimate_memory(r2, vocab_size=32000, batch_size=1, seq_len=2048, precision="bf16-true")
    assert b.activations < a.activations / 5 and b.peak < a.peak
    # int8 W0 of the 7 projections x 32 layers: ~6.5 GB, 1.000x bytes per weight
    assert math.isclose(a.frozen_weights / a.num_frozen, 1.0, rel_tol=1e-3)
    text = format_estimate(a, parse_bytes("80GB"))
    assert "fits in 80.0 GiB" in text and "predicted peak" in text
    assert "does not fit" in format_estimate(a, parse_bytes("1GB"))


def test_parse_bytes():
    assert parse_bytes("80GB") == 80 * 2**30 == parse_bytes("80 GiB")
    assert parse_bytes("500MB") == 500 * 2**20 and parse_bytes("1e9") == 10**9
    with pytest.raises(EstimateError, match="80GB"):
        parse_bytes("lots")
    for bad in ("0GB", "-5GB", " -80 GiB"):
        with pytest.raises(EstimateError, match=f"memory size '{bad}' must be positive"):
            parse_bytes(bad)
    assert parse_bytes("1MiB") == 2**20
    for slip in ("80kB", "1023KiB", "80"):  # below 1 MiB: surely not a GPU
        with pytest.raises(EstimateError, match="80GB"):
            parse_bytes(slip)
    for empty in ("", " "):
        with pytest.raises(EstimateError, match="cannot read memory size"):
            parse_bytes(empty)


def test_estimate_memory_cli(tmp_path, capsys):
    import json

    from poetxq.tools.cli import main

    out = tmp_path / "est.json"
    args = ["estimate-memory", "--recipe", "llama-60m:poetxq", "--batch-size", "4", "--gpu-mem",
            "80GB", "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    text = capsys.readouterr().out
    ref = estimate_memory(load_recipe("llama-60m:poetxq", {"train.batch_size": 4}))
    assert json.loads(out.read_text())["peak"] == ref.peak
    assert f"{ref.peak / 2**30:9.3f} GiB" in text and "fits in 80.0 GiB" in text
    fast = estimate_memory(load_recipe("llama-60m:poetxq", {"train.batch_size": 4,
                                                            "poet.variant": "fast"}))  # fmt: skip
    line = next(x for x in text.splitlines() if "peak with poet.variant=fast" in x)
    assert f"{fast.peak / 2**30:9.3f} GiB" in line and fast.peak > ref.peak
    assert "fits in 80.0 GiB" in line
    assert json.loads(out.read_text())["other_variant"] == {"variant": "fast", "peak": fast.peak}
    assert main(["estimate-memory", "--recipe", "llama-60m:adamw"]) == 0
    assert "poet.variant" not in capsys.readouterr().out  # baselines have no variant
    # no --recipe: the embedded tiny recipe, as poetxq train takes it
    assert main(["estimate-memory", "--json", str(out)]) == 0
    tiny = estimate_memory(load_recipe(None))
    assert json.loads(out.read_text())["peak"] == tiny.peak
    assert f"{tiny.peak / 2**30:9.3f} GiB" in capsys.readouterr().out
    assert main(["estimate-memory", "--recipe", "llama-60m:poetxq", "--gpu-mem", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot read memory size 'x'" in err[0]
    # a negative size after a space: the size's own message, not argparse's "expected one argument"
    assert main(["estimate-memory", "--recipe", "llama-60m:poetxq", "--gpu-mem", "-5GB"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "memory size '-5GB' must be positive" in err[0]


def test_estimate_memory_exits_1_when_no_plan_fits_the_gpu_mem(tmp_path, capsys):
    """With --gpu-mem and no plan under auto's limit, the last line says so and the exit status
    is 1 (the breakdown and --json still written); one plan that fits, or no --gpu-mem: 0."""
    import json

    from poetxq.tools.cli import main
    from poetxq.training.memory_table import plan_table

    out = tmp_path / "est.json"
    recipe = load_recipe(None)  # the embedded tiny recipe
    lowest = min(row["peak"] for row in plan_table(recipe))
    assert 2**20 < lowest < 2**30
    assert main(["estimate-memory", "--gpu-mem", "1MiB", "--json", str(out)]) == 1
    text = capsys.readouterr().out.strip().splitlines()
    assert text[-1] == (
        f"does not fit: no memory plan fits 1 MiB with 10% of it kept free (smallest predicted "
        f"peak: lowest, {lowest / 2**30:.2f} GiB); try a smaller batch or sequence, a larger GPU "
        "or several (docs/MEMORY.md)"
    )
    assert [row["fits"] for row in json.loads(out.read_text())["plans"]] == [False] * 3
    # only the lowest plan fits (the one auto takes): 0, no such line
    size = f"{int(lowest / 0.9) + 2**20}"
    fits = [row["fits"] for row in plan_table(recipe, gpu_mem=int(size))]
    assert fits[-1] and not any(fits[:-1])
    assert main(["estimate-memory", "--gpu-mem", size]) == 0
    assert "does not fit: no memory plan" not in capsys.readouterr().out
    assert main(["estimate-memory"]) == 0  # no --gpu-mem: no verdict
    assert "does not fit" not in capsys.readouterr().out
    # a plan named with --memory that does not fit: 1, naming the plan auto would take
    fastest = next(row["peak"] for row in plan_table(recipe) if row["plan"] == "fastest")
    assert main(["estimate-memory", "--gpu-mem", size, "--memory", "fastest"]) == 1
    assert capsys.readouterr().out.strip().splitlines()[-1] == (
        f"does not fit: the fastest plan predicts {fastest / 2**30:.2f} GiB, over "
        f"{int(size) / 2**20:.0f} MiB with 10% of it kept free; --memory lowest fits (auto takes "
        "it)"
    )
    assert main(["estimate-memory", "--gpu-mem", size, "--memory", "lowest"]) == 0
    with pytest.raises(SystemExit):
        main(["estimate-memory", "--help"])
    assert "Exit status 1 when no memory plan fits it (or the one --memory names does not)" in (
        " ".join(capsys.readouterr().out.split())
    )


def test_memory_sizes_need_a_unit():
    assert parse_bytes("80GB") == parse_bytes("80 GiB") == 80 * 2**30
    assert parse_bytes("500MB") == 500 * 2**20 and parse_bytes("1e9") == 10**9
    with pytest.raises(EstimateError, match=r"has no unit; write e\.g\. 80GB"):
        parse_bytes("80")
    with pytest.raises(EstimateError, match=r"'0' has no unit; write e\.g\. 80GB"):
        parse_bytes("0")  # not "0GB", which is refused as not positive
    with pytest.raises(EstimateError, match="cannot read memory size"):
        parse_bytes("eighty")


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--vocab-size", "-5"], "--vocab-size must be at least 256 (data.vocab_size's minimum)"),
        (["--vocab-size", "0"], "--vocab-size must be at least 256 (data.vocab_size's minimum)"),
        (["--batch-size", "0"], "key 'train.batch_size': Input should be greater than 0"),
        (["--seq-len", "-3"], "key 'train.seq_len': Input should be greater than 1"),
    ],
)
def test_non_positive_sizes_are_one_line(capsys, flags, needle):
    from poetxq.tools.cli import main

    assert main(["estimate-memory", "--recipe", "llama-60m:poetxq", *flags]) == 2
    out, err = capsys.readouterr()
    err_lines = err.strip().splitlines()
    assert out == "" and len(err_lines) == 1 and needle in err_lines[0]
    assert err_lines[0].startswith("poetxq: error: ")


def test_gpu_mem_help_says_gb_is_gib(capsys):
    from poetxq.tools.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["estimate-memory", "--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "GB and GiB are both read as GiB (2^30 bytes)" in text
    assert parse_bytes("80GB") == parse_bytes("80GiB") == 80 * 2**30


@pytest.mark.parametrize("lean", [False, True])
def test_fast_feature_major_activations_equal_what_autograd_saves(lean, monkeypatch):
    """The fast variant on its feature-major path (the GPU default; forced here, the Triton
    kernels run in the interpreter), with and without the lean SwiGLU down projection
    (KernelPolicy.lean_fast_swiglu), against the estimate; d = 64, f = 192, b = 32."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":  # CPU tensors through the Triton interpreter
        pytest.skip("forces the Triton paths on CPU tensors: needs TRITON_INTERPRET=1")
    kernels = KernelPolicy(interpret_on_cpu=True, weight_gemm="torch", fused_cnp=False,
                           lean_fast_swiglu=lean)  # fmt: skip
    # the estimate reads an fp32 run as a CPU one (no GPU paths): tell it the path is taken
    monkeypatch.setattr(estimate_mod, "lean_fast_swiglu", lambda _k, _p: lean)
    recipe = _recipe(**{"model.intermediate_size": 192, "train.fuse_elementwise": False,
                        "poet.variant": "fast"})  # fmt: skip
    est = estimate_memory(recipe, vocab_size=V, precision="fp32", kernels=kernels)
    torch.manual_seed(0)
    model, _ = _build(recipe, torch.float32, kernels)
    model.train()
    assert _saved_bytes(model, torch.randint(0, V, (2, 17))) == est.activations
    monkeypatch.setattr(estimate_mod, "lean_fast_swiglu", lambda _k, _p: False)
    plain = estimate_memory(recipe, vocab_size=V, precision="fp32")
    # SiLU(gate) and the down projection's permuted input: 2 x [T = 32, f = 192] fp32 per layer
    assert plain.activations - est.activations == (2 * 2 * 32 * 192 * 4 if lean else 0)


def test_lean_fast_swiglu_is_booked_only_where_the_path_is_taken(monkeypatch):
    """2·f·c fewer bytes per token and layer with the switch (a 4-bit store too: its
    input-order wrapper runs feature-major); none for a ragged intermediate size
    (176 = 5·32 + 16), without the fast feature-major path, or without Triton
    (POETXQ_KERNELS=torch, the default policy the estimate reads then)."""

    def acts(lean: bool, base: KernelPolicy | None = AUTO, **over) -> int:
        kernels = None if base is None else dataclasses.replace(base, lean_fast_swiglu=lean)
        r = _recipe(**{"model.intermediate_size": 192, "poet.variant": "fast", **over})
        return estimate_memory(r, vocab_size=V, precision="bf16-true", kernels=kernels).activations

    for over in ({}, {"poet.bits": 4}):
        assert acts(False, **over) - acts(True, **over) == 2 * 32 * 2 * 192 * 2  # L 2, T 32, bf16
    assert acts(False, **{"model.intermediate_size": 176}) == acts(
        True, **{"model.intermediate_size": 176}
    )
    no_fm = KernelPolicy(fast_feature_major=False)
    assert acts(False, no_fm) == acts(True, no_fm)
    assert acts(False, KernelPolicy(triton=False)) == acts(True, KernelPolicy(triton=False))
    monkeypatch.setenv("POETXQ_KERNELS", "torch")
    assert acts(False, None) == acts(False, KernelPolicy(triton=False))


def test_fused_input_cast_is_booked_for_mem_under_autocast_only():
    """q/k/v keep one shared fp32 input instead of three bf16 copies (6d -> 4d bytes per token
    and layer); gate/up 4d -> 4d. Not for fast layers (they keep no input), bf16 or fp32
    (CPU) runs, a ragged q/k/v side or POETXQ_KERNELS=torch; a 4-bit store as int8."""
    base = KernelPolicy()

    def acts(flag: bool, precision: str = "autocast", **over) -> int:
        kernels = dataclasses.replace(base, fused_input_cast=flag)
        r = _recipe(**{"model.intermediate_size": 192, **over})
        return estimate_memory(r, vocab_size=V, precision=precision, kernels=kernels).activations

    assert KernelPolicy().fused_input_cast  # on by default since measured
    d, L, T = 64, 2, 32
    assert acts(False) - acts(True) == L * T * 2 * d
    assert acts(False, **{"poet.bits": 4}) - acts(True, **{"poet.bits": 4}) == L * T * 2 * d
    for precision in ("bf16-true", "fp32"):
        assert acts(False, precision) == acts(True, precision)
    for over in ({"poet.variant": "fast"}, {"poet.block_size": 48}):
        assert acts(False, **over) == acts(True, **over)
    # q/k only: two projections share the fp32 input, 2 x 2d -> 4d, no saving
    assert acts(False, **{"poet.target_modules": ["q_proj", "k_proj"]}) == acts(
        True, **{"poet.target_modules": ["q_proj", "k_proj"]}
    )
    # the cast is fused only on the mem layers' feature-major path, behind its own switch
    base = KernelPolicy(feature_major=False)
    assert acts(False) == acts(True)
    base = KernelPolicy(triton=False)  # POETXQ_KERNELS=torch
    assert acts(False) == acts(True)


def test_fused_input_cast_activations_equal_what_autograd_saves():
    """The mem variant under bf16 autocast on its feature-major path with the fused input cast
    (forced; the Triton kernels run in the interpreter) against the estimate."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":  # CPU tensors through the Triton interpreter
        pytest.skip("forces the Triton paths on CPU tensors: needs TRITON_INTERPRET=1")
    # the mem layers feature-major with the cast fused, the rest on the torch path
    kernels = KernelPolicy(interpret_on_cpu=True, weight_gemm="torch", fused_cnp=False,
                           fast_feature_major=False, lean_fast_swiglu=False)  # fmt: skip
    recipe = _recipe(**{"model.intermediate_size": 192, "train.fuse_elementwise": False})
    est = estimate_memory(recipe, vocab_size=V, precision="autocast", kernels=kernels)
    torch.manual_seed(0)
    model, _ = _build(recipe, torch.float32, kernels)
    model.train()
    assert _saved_bytes(model, torch.randint(0, V, (2, 17)), autocast=True) == est.activations


def test_graph_runs_are_also_checked_with_the_measured_pool_overhead():
    """A CUDA-graph estimate gets a second verdict at peak x (1 + GRAPH_POOL_OVERHEAD): the
    graph's reserved peak measured up to 14.4 % above the estimate on an H200 (8B / 13B)."""
    assert estimate_mod.GRAPH_POOL_OVERHEAD == 0.144
    graph = estimate_memory(_recipe(), vocab_size=V, precision="autocast")
    eager = estimate_memory(_recipe(**{"train.cuda_graph": False}), vocab_size=V,
                            precision="autocast")  # fmt: skip
    assert graph.cuda_graph and not eager.cuda_graph
    gpu_mem = int(graph.peak * 1.10)  # room for the estimate, not for the pool's overhead
    text = format_estimate(graph, gpu_mem).splitlines()
    assert text[-len(graph.notes) - 2].startswith("  fits in")
    high = int(graph.peak * 1.144)
    assert (
        f"  with the graph pool's measured overhead (reserved up to +14%): "
        f"{high / 2**30:.3f} GiB, does not fit"
    ) in text
    assert any(line.endswith(", fits") for line in format_estimate(graph, high).splitlines())
    assert "graph pool" not in format_estimate(eager, gpu_mem)  # eager: no second verdict


def test_a_gpu_below_one_gib_is_shown_in_mib():
    from poetxq.tools.estimate_report import _size

    assert _size(2**20) == "1 MiB" and _size(512 * 2**20) == "512 MiB"
    assert _size(80 * 2**30) == "80.0 GiB" and _size(2**30) == "1.0 GiB"


def test_the_breakdown_shows_what_the_optimizer_offload_keeps_on_the_gpu(capsys):
    """train.offload_optimizer at Llama-8B (lowest plan, 2 micro-batches), by hand: the largest
    gradient, the embedding's 32,000 x 4,096 in bf16, comes back as the accumulator; one norm per
    trainable tensor (32 layers x (7 projections x 2 sides + 2 norms) + embedding, lm_head,
    final norm), 512 bytes each; the breakdown gives them their own row, counted in the peak."""
    from poetxq.tools.cli import main

    assert main(["estimate-memory", "--recipe", "llama-8b:poetxq", "--memory", "lowest",
                 "--set", "train.grad_accum=2"]) == 0  # fmt: skip
    text = capsys.readouterr().out
    est = estimate_memory(
        load_recipe("llama-8b:poetxq", {
            "train.grad_accum": 2, "train.gradient_checkpointing": True,
            "train.offload_activations": True, "train.offload_optimizer": True,
            "train.loss_chunk_tokens": 256, "optim.state_bits": 8, "train.precision": "bf16-true",
        }),
        precision="bf16-true",
    )  # fmt: skip
    acc, norms = 32_000 * 4_096 * 2, (32 * (7 * 2 + 2) + 3) * 512
    assert (est.offload_accumulator, est.offload_norms) == (acc, norms)
    row = next(ln for ln in text.splitlines() if "offload accumulator" in ln)
    assert row == (
        f"  {'offload accumulator + norms':<31s}{(acc + norms) / 2**30:9.3f} GiB  the largest "
        "gradient's accumulator (micro-batches 2+); 515 gradient norms"
    )
    end = est.in_backward_gradients + est.layer_activations + est.workspace + acc + norms
    step = est.offload_transient + norms
    start = est.activations + est.logits + est.workspace + est.lm_head_grad + acc
    persistent = est.frozen_weights + est.buffers + est.trainable_params
    assert est.peak == persistent + max(start, end, step)
    assert f"{est.peak / 2**30:9.3f} GiB" in text
    capsys.readouterr()
    assert main(["estimate-memory", "--recipe", "llama-8b:poetxq"]) == 0  # no offload, no row
    assert "offload accumulator" not in capsys.readouterr().out


@pytest.mark.parametrize(
    "over",
    [
        {},  # eager, gradients and states on the GPU
        {"train.memory": "lowest", "train.grad_accum": 4},  # offload, accumulator, chunked loss
        {"train.optimizer_in_backward": True, "optim.grad_clip": 0.0, "train.grad_accum": 1},
        {"train.cuda_graph": True},
    ],
    ids=["default", "lowest", "in_backward", "graph"],
)
def test_the_peak_is_the_sum_of_its_named_terms_and_the_table_says_them(over):
    from poetxq.training.memory import resolve_memory_plan

    recipe = load_recipe("llama-8b:poetxq", {"train.batch_size": 1, "train.seq_len": 2048, **over})
    recipe, _ = resolve_memory_plan(recipe, "cpu")
    est = estimate_memory(recipe, precision="bf16-true")
    assert sum(b for _, b in est.peak_terms) == est.peak > 0
    names = [n for n, _ in est.peak_terms]
    assert names[:3] == ["frozen weights", "buffers", "parameters"]
    assert ("optimizer states" in names) == (not est.offload_optimizer)
    text = format_estimate(est)
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("= frozen weights"))
    shown = [float(t.rsplit(" ", 1)[1]) for t in line.strip()[2:].removesuffix(" GiB").split(" + ")]
    assert sum(shown) == pytest.approx(est.peak / 2**30, abs=5e-3 * len(shown))
    accum = recipe.train.grad_accum
    assert (f"x {accum} micro-batches per step" in text.splitlines()[0]) == (accum > 1)


def test_per_process_peak_gets_the_fit_verdict_of_train_memory_auto():
    from poetxq.tools.estimate_report import format_per_process

    gib = 2**30
    shared = {"processes": 2, "left_out": [], "one_process_only": [], "plan": "lowest",
              "grad_sync": "step", "w0_sharded": 48 * gib}  # fmt: skip
    for peak, verdict in ((60, "fits"), (79.27, "does not leave 10% free"), (90, "does not fit")):
        text = format_per_process({**shared, "data_parallel": int(peak * gib)}, 80 * gib)
        used = f"({peak / 80:.0%} used)"
        assert text.splitlines()[-1] == f"  per GPU: {verdict} in 80.0 GiB {used}"
    assert "per GPU:" not in format_per_process({**shared, "data_parallel": gib})  # no --gpu-mem


def test_estimate_model_dir_errors_are_one_line_naming_the_problem(tmp_path, capsys):
    import json

    from poetxq.tools.cli import main

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    cfg = {"hidden_size": 512, "intermediate_size": 1280, "num_attention_heads": 8,
           "num_hidden_layers": 8, "vocab_size": 32000,
           "max_position_embeddings": 1024, "model_type": "llama"}  # fmt: skip
    (ckpt / "config.json").write_text(json.dumps(cfg))
    cases = [
        (["--model", str(ckpt), "--seq-len", "2048"],
         f"--seq-len (train.seq_len) 2048 exceeds the max_position_embeddings 1024 of '{ckpt}'"),
        (["--model", str(tmp_path / "nope")], f"'{tmp_path / 'nope'}' does not exist"),
        (["--model", str(ckpt / "config.json")], "is a file, not a checkpoint directory"),
    ]  # fmt: skip
    for flags, needle in cases:
        capsys.readouterr()
        assert main(["estimate-memory", *flags]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and len(captured.err.strip().splitlines()) == 1
        assert needle in captured.err
    assert main(["estimate-memory", "--model", str(ckpt), "--seq-len", "1024"]) == 0


def test_estimate_vocab_size_below_train_minimum_is_refused(capsys):
    """--vocab-size takes what train's data.vocab_size takes (at least 256), one line, exit 2."""
    from poetxq.tools.cli import main

    assert main(["estimate-memory", "--vocab-size", "255"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip() == (
        "poetxq: error: --vocab-size must be at least 256 (data.vocab_size's minimum), got 255"
    )
    assert main(["estimate-memory", "--vocab-size", "256"]) == 0


def test_estimate_model_refuses_the_checkpoints_train_refuses(tmp_path, monkeypatch, capsys):
    """estimate-memory --model checks the model type as train --model does: an OLMo-2 or a GPT-2
    directory gets train's one-line error (exit 2) naming its type and the Llama family, before
    any estimate; a Llama directory is still estimated."""
    from tiny_llama import save_tiny_checkpoint
    from transformers import GPT2Config, GPT2LMHeadModel

    from poetxq.model.pretrained import LLAMA_FAMILY
    from poetxq.tools.cli import main

    monkeypatch.chdir(tmp_path)  # train writes nothing, but if it did: here
    sizes = dict(hidden_size=64, intermediate_size=128, layers=2, text_stride=8)
    olmo = save_tiny_checkpoint(tmp_path / "olmo", arch="olmo2", **sizes)
    gpt2 = tmp_path / "gpt2"
    config = GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                        bos_token_id=0, eos_token_id=0)  # fmt: skip
    GPT2LMHeadModel(config).save_pretrained(gpt2)
    flags = ["--seq-len", "64"]  # within the tiny checkpoints' 64 positions
    for ckpt, model_type in ((olmo, "olmo2"), (gpt2, "gpt2")):
        capsys.readouterr()
        assert main(["estimate-memory", "--model", str(ckpt), *flags]) == 2
        est = capsys.readouterr()
        assert est.out == "" and len(est.err.strip().splitlines()) == 1
        assert est.err.startswith("poetxq: error: ")
        assert repr(model_type) in est.err and "Llama-family" in est.err
        assert ", ".join(LLAMA_FAMILY) in est.err  # the families it takes
        assert main(["train", "--model", str(ckpt), *flags, "--max-steps", "1"]) == 2
        assert capsys.readouterr().err == est.err  # train's very line
    llama = save_tiny_checkpoint(tmp_path / "llama", **sizes)
    capsys.readouterr()
    # the tiny recipe's b = 64 exceeds its k_proj's 32 rows (2 KV heads x 16): refused as train does
    assert main(["estimate-memory", "--model", str(llama), *flags]) == 2
    assert "smallest layer dimension 32" in capsys.readouterr().err
    flags += ["--set", "poet.block_size=32"]
    assert main(["estimate-memory", "--model", str(llama), *flags]) == 0
    out = capsys.readouterr().out
    assert f"memory estimate: {llama}/config.json (poetxq), batch" in out
    # a poetxq run directory (it holds a config.json too): export it first, as train says
    for name in ("recipe.yaml", "metrics.jsonl"):
        (llama / name).write_text("method: poetxq\n" if name == "recipe.yaml" else "")
    assert main(["estimate-memory", "--model", str(llama), *flags]) == 2
    err = capsys.readouterr().err
    assert "is a poetxq run directory" in err and len(err.strip().splitlines()) == 1


def test_a_checkpoint_with_its_own_head_dim_is_estimated_at_its_true_widths(tmp_path):
    """Qwen3-0.6B's attention shape (16 heads x head_dim 128 = 2048 rows over hidden 1024, 8 KV
    heads), scaled down: ``--model DIR`` reads head_dim from config.json."""
    import json

    from poetxq.training.estimate_terms import projections
    from poetxq.training.memory import estimation_recipe

    cfg = {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 192,
           "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 8,
           "num_hidden_layers": 2, "vocab_size": 512, "max_position_embeddings": 64}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shaped = estimation_recipe(load_recipe(None, {"model.pretrained": str(tmp_path)}))
    assert shaped is not None and shaped.model.head_dim == 8
    rows = dict((name, (m, n)) for name, m, n in projections(shaped))
    assert rows["q_proj"] == (128, 64) and rows["o_proj"] == (64, 128)
    assert rows["k_proj"] == rows["v_proj"] == (64, 64)
    notes = estimate_memory(shaped).notes
    assert any("heads x head_dim = 128" in n for n in notes)
