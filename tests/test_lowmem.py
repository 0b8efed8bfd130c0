"""Memory-saving options (poetxq.training.lowmem): the optimizer step inside backward equals the
usual step, activation offload equals plain checkpointing, the recipe refuses combinations that
cannot work, the estimator accounts for each option, and a CPU training run with all of them on
equals one without them."""

import copy
import json
from typing import ClassVar

import bitsandbytes as bnb
import pytest
import torch
from small_nets import small_mlp, two_groups
from torch import nn

from poetxq.model.surgery import build_llama, convert_to_poetx
from poetxq.tools.cli import main
from poetxq.tools.estimate_report import format_estimate
from poetxq.training.estimate import estimate_memory
from poetxq.training.evaluate import causal_lm_loss
from poetxq.training.lowmem import OptimizerInBackward, enable_activation_checkpointing
from poetxq.training.recipe_files import load_recipe


@pytest.mark.parametrize("make", [torch.optim.AdamW, bnb.optim.AdamW8bit], ids=["torch", "8bit"])
def test_in_backward_equals_step_after_backward(make):
    # 64x96 = 6144 elements: bitsandbytes keeps 8-bit states for it, fp32 for the rest
    ref, m = small_mlp(), small_mlp()
    opt_ref, opt = make(two_groups(ref)), make(two_groups(m))
    hooks = OptimizerInBackward(opt)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(5, 64, generator=gen)
        ref(x).square().sum().backward()
        opt_ref.step()
        opt_ref.zero_grad()
        m(x).square().sum().backward()
        assert hooks.reset_count() == 4  # every parameter updated once
        assert all(p.grad is None for p in m.parameters())  # and its gradient freed
    for a, b in zip(ref.parameters(), m.parameters(), strict=True):
        assert torch.equal(a, b)
    # the optimizer is the run's own: its groups are intact and its state is keyed as usual
    assert [len(g["params"]) for g in opt.param_groups] == [2, 2]
    assert opt.state_dict()["state"].keys() == opt_ref.state_dict()["state"].keys()


def test_in_backward_remove_and_foreign_parameter():
    m = small_mlp()
    opt = torch.optim.AdamW(m.parameters())
    hooks = OptimizerInBackward(opt)
    hooks.remove()
    m(torch.randn(2, 64)).sum().backward()
    assert all(p.grad is not None for p in m.parameters())  # no hook ran
    with pytest.raises(ValueError, match="not in the optimizer's param groups"):
        OptimizerInBackward(opt, [nn.Parameter(torch.zeros(3))])


def _tiny_llama(recipe):
    torch.manual_seed(0)
    model = build_llama(recipe.model, 96)
    convert_to_poetx(model, recipe.poet, generator=torch.Generator().manual_seed(0))
    model.train()
    return model


def _recipe(**over):
    base = {"model.hidden_size": 64, "model.intermediate_size": 128,
            "model.num_attention_heads": 4, "model.num_hidden_layers": 2,
            "poet.block_size": 16, "train.batch_size": 2, "train.seq_len": 16}  # fmt: skip
    return load_recipe(None, {**base, **over})


def _grads(model, windows):
    model.zero_grad(set_to_none=True)
    causal_lm_loss(model, windows).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


class _CountingSaveOnCpu(torch.autograd.graph.save_on_cpu):
    """torch's offload hooks, counting the shapes they move to the host."""

    packed: ClassVar[list] = []

    def __init__(self, pin_memory: bool = False, device_type: str = "cuda") -> None:
        super().__init__(pin_memory=pin_memory, device_type=device_type)
        pack = self.pack_hook

        def counting(t):
            _CountingSaveOnCpu.packed.append(tuple(t.shape))
            return pack(t)

        self.pack_hook = counting


def test_offloaded_checkpointing_gives_the_plain_gradients(monkeypatch):
    """The offload path as on a GPU (save_on_cpu around each layer's checkpoint, made to run on
    this CPU-only host): what it moves off the device is each decoder layer's input [B, S, d],
    and the gradients equal those without checkpointing."""
    recipe = _recipe()
    plain = _tiny_llama(recipe)
    offloaded = copy.deepcopy(plain)
    windows = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(2))
    want = _grads(plain, windows)
    monkeypatch.setattr("poetxq.training.lowmem.save_on_cpu", _CountingSaveOnCpu)
    monkeypatch.setattr("poetxq.training.lowmem._on_accelerator", lambda m: True)
    enable_activation_checkpointing(offloaded, offload=True)
    assert offloaded.is_gradient_checkpointing
    _CountingSaveOnCpu.packed = []
    got = _grads(offloaded, windows)
    assert _CountingSaveOnCpu.packed.count((2, 16, 64)) == 2  # one input per decoder layer
    assert got.keys() == want.keys() and len(want) > 10
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-7, msg=name)


def test_graph_safe_offload_keeps_each_layer_input_in_host_buffers_made_once(monkeypatch):
    """offload with graph_safe (a CUDA graph's offload): every checkpointed layer copies what it
    keeps into host buffers of its own, made on the first step and reused on later ones; the
    gradients are plain checkpointing's."""
    from poetxq.training.lowmem import HostSlots

    plain = _tiny_llama(_recipe())
    offloaded = copy.deepcopy(plain)
    windows = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(4))
    want = _grads(plain, windows)
    monkeypatch.setattr("poetxq.training.lowmem._on_accelerator", lambda m: True)  # as on a GPU
    enable_activation_checkpointing(offloaded, offload=True, graph_safe=True)
    hooks = [m._gradient_checkpointing_func.args[0] for m in offloaded.model.layers]
    assert len(hooks) == 2 and all(isinstance(h, HostSlots) for h in hooks)
    got = _grads(offloaded, windows)
    inputs = [[s for s in h.slots if s.shape == (2, 16, 64)] for h in hooks]
    assert [len(i) for i in inputs] == [1, 1]  # each layer keeps its input [B, S, d]
    ptrs = [s.data_ptr() for h in hooks for s in h.slots]
    got_again = _grads(offloaded, windows)  # a second step reuses the buffers
    assert [s.data_ptr() for h in hooks for s in h.slots] == ptrs
    with torch.no_grad():  # layer 0 keeps the embeddings of the window's inputs
        torch.testing.assert_close(inputs[0][0], offloaded.model.embed_tokens(windows[:, :-1]))
    assert got.keys() == want.keys() and len(want) > 10
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-7, msg=name)
        torch.testing.assert_close(got_again[name], g, rtol=1e-5, atol=1e-7, msg=name)


def test_offload_on_a_cpu_model_is_plain_checkpointing(monkeypatch):
    """On the CPU there is nothing to move (and no pinned memory): the layer inputs are never
    handed to the offload hooks, and the gradients are plain checkpointing's."""
    model = _tiny_llama(_recipe())
    windows = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(3))
    want = _grads(copy.deepcopy(model), windows)
    monkeypatch.setattr("poetxq.training.lowmem.save_on_cpu", _CountingSaveOnCpu)
    _CountingSaveOnCpu.packed = []
    enable_activation_checkpointing(model, offload=True)
    assert model.is_gradient_checkpointing
    got = _grads(model, windows)
    assert _CountingSaveOnCpu.packed == []
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize(
    "over,needle",
    [
        ({"train.offload_activations": True}, "set train.gradient_checkpointing: true"),
        ({"train.optimizer_in_backward": True}, r"needs optim.grad_clip: 0 \(not 1.0"),
        ({"train.optimizer_in_backward": True, "optim.grad_clip": 0, "train.grad_accum": 2},
         r"needs train.grad_accum: 1 \(not 2"),
        ({"train.optimizer_in_backward": True, "train.grad_accum": 2},  # both at once
         r"needs train.grad_accum: 1 .* and optim.grad_clip: 0"),
        ({"train.optimizer_in_backward": True, "optim.grad_clip": 0, "method": "qgalore"},
         "applies to poetxq, poetx and adamw"),
        ({"train.optimizer_in_backward": True, "optim.grad_clip": 0, "train.cuda_graph": True},
         r"needs optim.state_bits: 8 \(the CUDA graph captures"),
        ({"train.loss_chunk_tokens": -1}, "loss_chunk_tokens"),
    ],
)  # fmt: skip
def test_recipe_refuses_what_cannot_work(over, needle):
    with pytest.raises(ValueError, match=needle):
        _recipe(**over)


def test_recipe_takes_the_optimizer_in_backward_inside_a_cuda_graph_with_8bit_states():
    over = {"train.optimizer_in_backward": True, "optim.grad_clip": 0, "train.cuda_graph": True,
            "optim.state_bits": 8}  # fmt: skip
    recipe = load_recipe(None, over)
    assert recipe.train.cuda_graph is True and recipe.train.optimizer_in_backward


def test_estimate_accounts_for_each_option():
    """Llama-8B, batch 1 x 2048, bf16, 8-bit states, checkpointing: each option's term by hand."""
    over = {"train.gradient_checkpointing": True, "optim.state_bits": 8, "optim.grad_clip": 0,
            "poet.block_size": 256, "train.grad_accum": 1}  # fmt: skip
    kw = {"vocab_size": 32000, "batch_size": 1, "seq_len": 2048, "precision": "bf16-true"}
    base = estimate_memory(load_recipe("llama-8b:poetxq", over), **kw)
    T, d, L, V = 2048, 4096, 32, 32000

    off = estimate_memory(load_recipe("llama-8b:poetxq", {**over,
                          "train.offload_activations": True}), **kw)  # fmt: skip
    assert base.activations - off.activations == L * T * d * 2 == off.host_offloaded
    persistent = off.frozen_weights + off.buffers + off.trainable_params + off.optimizer_states
    start = off.activations + off.logits + off.workspace + V * d * 2
    end = off.gradients + off.layer_activations + off.workspace
    assert off.peak == persistent + max(start, end, off.gradients + off.optimizer_transient)
    assert off.peak < base.peak and start < end  # offloaded, the end of backward is the peak

    chunk = estimate_memory(load_recipe("llama-8b:poetxq", {**over,
                            "train.loss_chunk_tokens": 512}), **kw)  # fmt: skip
    assert (base.logits, chunk.logits) == (12 * T * V, 12 * 512 * V)

    inb = estimate_memory(load_recipe("llama-8b:poetxq", {**over,
                          "train.optimizer_in_backward": True}), **kw)  # fmt: skip
    # one layer's Q gradients (bf16), ceil(dim / 256) blocks per side: q, k, v, o 4096 -> 4096
    # (no GQA), gate, up, down 4096 <-> 14336
    sides = 4 * (16 + 16) + 3 * (16 + 56)
    assert inb.in_backward_gradients == sides * (256 * 255 // 2) * 2
    persistent = inb.frozen_weights + inb.buffers + inb.trainable_params + inb.optimizer_states
    # lm_head's gradient at the start of backward (bitsandbytes updates it in place)
    start = inb.activations + inb.logits + inb.workspace + V * d * 2
    end = inb.in_backward_gradients + inb.layer_activations + inb.workspace
    assert inb.peak == persistent + max(start, end) == base.peak  # the start is the peak still
    inb32 = estimate_memory(load_recipe("llama-8b:poetxq", {**over, "optim.state_bits": 32,
                            "train.optimizer_in_backward": True}), **kw)  # fmt: skip
    assert inb32.in_backward_transient == V * d * 2  # torch AdamW's temporary for lm_head
    # without checkpointing the batched CNP hands every layer's Q gradient back at once
    flat = estimate_memory(load_recipe("llama-8b:poetxq", {**over,
                           "train.gradient_checkpointing": False,
                           "train.optimizer_in_backward": True}), **kw)  # fmt: skip
    assert flat.in_backward_gradients == L * inb.in_backward_gradients

    every = estimate_memory(load_recipe("llama-8b:poetxq", {**over,
        "train.optimizer_in_backward": True, "train.offload_activations": True,
        "train.loss_chunk_tokens": 256}), **kw)  # fmt: skip
    start = every.activations + every.logits + every.workspace + V * d * 2
    assert every.peak == persistent + max(start, end)
    assert base.peak - every.peak > 2**30  # 1.2 GB of the 2.5 GB above the persistent state


_LOWMEM_BASE = (
    "--set", "optim.warmup_steps=1", "--set", "optim.grad_clip=0",
    "--set", "train.gradient_checkpointing=true",
    "--set", "train.precision=fp32",  # fp32 on a GPU too: compared at 1e-5
)  # fmt: skip


@pytest.mark.slow
def test_training_with_every_option_equals_training_without(tmp_path, tiny_train):
    want, _ = tiny_train("plain", *_LOWMEM_BASE)
    got, rows = tiny_train(
        "lowmem", *_LOWMEM_BASE, "--set", "train.optimizer_in_backward=true",
        "--set", "train.offload_activations=true", "--set", "train.loss_chunk_tokens=40",
    )  # fmt: skip
    assert len(want) == len(got) == 3  # three steps, a merge after step 2
    assert got == pytest.approx(want, rel=1e-5)
    assert all(r["grad_norm"] is None for r in rows if "grad_norm" in r)  # no norm to log
    summary = json.loads((tmp_path / "lowmem" / "summary.json").read_text())
    want_options = ["gradient_checkpointing", "offload_activations", "optimizer_in_backward",
                    "loss_chunk_tokens=40"]  # fmt: skip
    assert summary["memory_options"] == want_options
    assert main(["report", str(tmp_path / "plain"), str(tmp_path / "lowmem"), "-o",
                 str(tmp_path / "report")]) == 0  # fmt: skip
    table = (tmp_path / "report" / "report.md").read_text()
    assert "| checkpointing |" in table  # the plain run (checkpointing only)
    assert ("| checkpointing, offload, optimizer in backward, chunked loss (40) |") in table


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offload_on_cuda_gives_the_plain_gradients_and_keeps_less():
    """Real pinned-memory offload: the gradients equal those without checkpointing, and what
    stays on the GPU after the forward is smaller than with plain checkpointing."""
    recipe = _recipe(**{"model.num_hidden_layers": 4})
    base = _tiny_llama(recipe).cuda()
    windows = torch.randint(0, 96, (8, 257), device="cuda")
    want = _grads(base, windows)

    def after_forward(offload: bool) -> tuple[int, dict]:
        model = copy.deepcopy(base)
        enable_activation_checkpointing(model, offload=offload)
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        loss = causal_lm_loss(model, windows)
        kept = torch.cuda.memory_allocated() - before
        loss.backward()
        return kept, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    kept_plain, _ = after_forward(False)
    kept_off, got = after_forward(True)
    # 4 layer inputs of [8, 256, 64] fp32 stay on the host
    assert kept_plain - kept_off >= 4 * 8 * 256 * 64 * 4
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    "options,line",
    [(["train.optimizer_in_backward=true"],
      "runs in one process only; set train.optimizer_in_backward: false"),
     (["train.loss_chunk_tokens=64", "train.grad_sync=ddp"],
      "cannot run under DDP; set train.grad_sync: step (or auto), or train.loss_chunk_tokens: 0")],
)  # fmt: skip
def test_train_refuses_the_options_under_ddp(tmp_path, capsys, monkeypatch, options, line):
    """The optimizer in backward updates before any all-reduce, and the chunked loss calls the
    bare model past DDP's hooks: with more than one process (the chunked loss: under DDP) the
    run stops with one line before writing anything."""
    import accelerate

    monkeypatch.setenv("POETXQ_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(accelerate.Accelerator, "num_processes", property(lambda self: 2))
    code = main(["train", "--data", "pydoc", "--vocab-size", "512", "--seq-len", "32",
                 "--max-steps", "1", "--no-progress", "--output-dir", str(tmp_path),
                 "--run-name", "d", "--set", "optim.grad_clip=0",
                 *[a for o in options for a in ("--set", o)]])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0
    assert err[-1].endswith(line)
    assert not (tmp_path / "d").exists()


@pytest.mark.slow
def test_chunked_loss_runs_under_the_runs_mixed_precision(tmp_path, monkeypatch):
    """The chunked loss calls the decoder directly, past the autocast that accelerate wraps
    around the model's forward; the trainer must enter it itself (else bf16 runs compute the
    decoder in fp32). The bf16 run follows an fp32 one in the same process, which accelerate's
    process-wide state refused until the trainer started it afresh for each run."""
    import poetxq.training.loss

    monkeypatch.setenv("POETXQ_CACHE", str(tmp_path / "cache"))
    seen = []
    real = poetxq.training.loss.causal_lm_loss_chunked

    dev = "cuda" if torch.cuda.is_available() else "cpu"  # where the trainer puts the model

    def spy(model, windows, chunk_tokens):
        seen.append(torch.is_autocast_enabled(dev) and torch.get_autocast_dtype(dev))
        return real(model, windows, chunk_tokens)

    monkeypatch.setattr(poetxq.training.loss, "causal_lm_loss_chunked", spy)
    args = ["train", "--data", "pydoc", "--vocab-size", "512", "--seq-len", "32",
            "--batch-size", "4", "--max-steps", "2", "--no-progress", "--output-dir",
            str(tmp_path), "--set", "model.num_hidden_layers=1",
            "--set", "train.loss_chunk_tokens=64"]  # fmt: skip
    assert main([*args, "--run-name", "fp32", "--set", "train.precision=fp32"]) == 0
    assert seen == [False, False]
    seen.clear()
    assert main([*args, "--run-name", "bf16", "--set", "train.precision=bf16"]) == 0
    assert seen == [torch.bfloat16, torch.bfloat16]


def test_estimate_names_the_phase_of_the_peak():
    """Llama-8B at batch 1 x 2048 with checkpointing: the logits and activations make the start
    of backward the peak; with the layer inputs offloaded the gradients at its end are; with the
    optimizer in backward as well, the start again."""
    over = {"train.gradient_checkpointing": True, "optim.grad_clip": 0, "train.grad_accum": 1}
    kw = {"vocab_size": 32000, "batch_size": 1, "seq_len": 2048, "precision": "bf16-true"}
    phases = []
    off = {"train.offload_activations": True}
    for extra in ({}, off, {**off, "train.optimizer_in_backward": True}):
        est = estimate_memory(load_recipe("llama-8b:poetxq", {**over, **extra}), **kw)
        phases.append(est.peak_phase)
    assert phases == ["start of backward", "end of backward", "start of backward"]
    assert "at the start of backward" in format_estimate(est)


@pytest.mark.slow
def test_in_backward_with_8bit_states_resumes_and_may_be_turned_off(tmp_path, monkeypatch):
    """8-bit states + optimizer in backward: no false LR-scheduler-order warning; a run resumed
    from its step-2 checkpoint with the option turned off (memory settings may change on
    resume) logs the uninterrupted run's losses for steps 3 and 4."""
    import shutil
    import warnings

    monkeypatch.setenv("POETXQ_CACHE", str(tmp_path / "cache"))
    base = ["--data", "pydoc", "--vocab-size", "512", "--seq-len", "32", "--batch-size", "4",
            "--max-steps", "4", "--no-progress", "--output-dir", str(tmp_path), "--set",
            "model.num_hidden_layers=1", "--set", "optim.state_bits=8", "--set",
            "optim.grad_clip=0", "--set", "train.log_every=1", "--set", "train.save_every=2",
            "--set", "optim.warmup_steps=1"]  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["train", *base, "--run-name", "a",
                     "--set", "train.optimizer_in_backward=true"]) == 0  # fmt: skip
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)]
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "step-00000004")  # as if stopped at step 3
    assert main(["train", "--resume", str(tmp_path / "b"), "--no-progress",
                 "--set", "train.optimizer_in_backward=false"]) == 0  # fmt: skip

    def losses(run):
        rows = [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().split("\n")
                if x]  # fmt: skip
        return {r["step"]: r["loss"] for r in rows if "grad_norm" in r}

    a, b = losses("a"), losses("b")
    assert sorted(b) == [1, 2, 3, 4]
    # on a GPU run b's steps take the CUDA graph and the flat Triton 8-bit update, run a's the
    # per-parameter bitsandbytes op: the same rule, rounded apart (test_flat, test_graph_optim)
    rel = 1e-4 if torch.cuda.is_available() else 1e-6
    assert [b[s] for s in (3, 4)] == pytest.approx([a[s] for s in (3, 4)], rel=rel)


@pytest.mark.slow
def test_resume_may_turn_the_optimizer_into_backward_on_with_clipping_off(
    tmp_path, monkeypatch, capsys
):
    """A run with gradient clipping (every shipped recipe's) may switch the optimizer into
    backward at a resume: clipping goes off with it, said in a note; other changes of
    optim.grad_clip stay refused."""
    monkeypatch.setenv("POETXQ_CACHE", str(tmp_path / "cache"))
    base = ["--data", "pydoc", "--vocab-size", "512", "--seq-len", "32", "--batch-size", "4",
            "--max-steps", "4", "--no-progress", "--output-dir", str(tmp_path), "--set",
            "model.num_hidden_layers=1", "--set", "optim.state_bits=8", "--set",
            "train.log_every=1", "--set", "train.save_every=2"]  # fmt: skip
    import shutil

    assert main(["train", *base, "--run-name", "a"]) == 0
    shutil.rmtree(tmp_path / "a" / "checkpoints" / "step-00000004")  # as if stopped at step 3
    resume = ["train", "--resume", str(tmp_path / "a"), "--no-progress"]
    assert main([*resume, "--set", "optim.grad_clip=0.5"]) == 2  # not with the option off
    assert "optim.grad_clip: 1.0 -> 0.5" in capsys.readouterr().err
    assert main([*resume, "--set", "train.optimizer_in_backward=true",
                 "--set", "optim.grad_clip=0"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "gradient clipping (optim.grad_clip 1.0) is off from step 3 on" in out
    rows = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "grad_norm" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert steps[2]["grad_norm"] is None and steps[1]["grad_norm"] is not None


def test_estimate_books_the_optimizer_inside_a_cuda_graph_as_in_backward():
    """With the optimizer inside the captured backward the gradients are booked as an eager
    optimizer_in_backward run's (one layer alive), not as the graph's static gradients."""
    over = {"optim.grad_clip": 0, "optim.state_bits": 8, "train.gradient_checkpointing": True,
            "train.optimizer_in_backward": True}  # fmt: skip
    eager = estimate_memory(_recipe(**over, **{"train.cuda_graph": False}), precision="bf16-true")
    graph = estimate_memory(_recipe(**over, **{"train.cuda_graph": True}), precision="bf16-true")
    static = estimate_memory(
        _recipe(**{**over, "train.optimizer_in_backward": False, "train.cuda_graph": True}),
        precision="bf16-true",
    )
    assert graph.cuda_graph and graph.peak < static.peak
    # the same booking as eagerly (the graph's fused RMSNorm / rotary keep a little less)
    assert abs(graph.peak - eager.peak) < 0.01 * eager.peak
    assert graph.in_backward_gradients == eager.in_backward_gradients < graph.gradients
    assert any("optimizer runs inside the captured backward" in n for n in graph.notes)
    assert not any("gradients exist for the whole step" in n for n in graph.notes)


def test_estimate_books_the_lm_head_gradient_by_slices_inside_a_graph_with_a_chunked_loss():
    """Inside a graph with a chunked loss the LM head's gradient exists a slice at a time
    (poetxq.training.loss.SLICE_BYTES); eagerly, or tied to the embeddings, as a whole."""
    from poetxq.training.loss import SLICE_BYTES

    over = {"optim.grad_clip": 0, "optim.state_bits": 8, "train.gradient_checkpointing": True,
            "train.optimizer_in_backward": True, "train.loss_chunk_tokens": 64,
            "model.hidden_size": 1024, "model.intermediate_size": 2048}  # fmt: skip
    v = 32000
    whole = v * 1024 * 2  # bf16 [V, d]: 62.5 MiB, two slices' worth
    graph = estimate_memory(_recipe(**over, **{"train.cuda_graph": True}), vocab_size=v,
                            precision="bf16-true")  # fmt: skip
    eager = estimate_memory(_recipe(**over, **{"train.cuda_graph": False}), vocab_size=v,
                            precision="bf16-true")  # fmt: skip
    tied = estimate_memory(_recipe(**over, **{"train.cuda_graph": True,
                                              "model.tie_word_embeddings": True}),
                           vocab_size=v, precision="bf16-true")  # fmt: skip
    assert graph.lm_head_grad == SLICE_BYTES < whole
    assert eager.lm_head_grad == tied.lm_head_grad == whole
    assert any("a slice of rows at a time" in n for n in graph.notes)
