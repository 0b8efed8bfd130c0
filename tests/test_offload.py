"""Gradients and optimizer states in host memory (poetxq.training.offload.HostOffload): the same
parameters as the usual accumulate → clip_grad_norm_ → step loop, for torch AdamW and
bitsandbytes AdamW8bit, with clipping active and gradient accumulation; clear errors."""

import bitsandbytes as bnb
import pytest
import torch
from small_nets import small_mlp, two_groups
from torch import nn

from poetxq.training.offload import HostOffload
from poetxq.training.optim import adamw8bit_class


def _batches(device: str = "cpu") -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [[torch.randn(5, 64, generator=gen).to(device) for _ in range(3)] for _ in range(4)]


def _reference(model, opt, steps, max_norm):
    norms = []
    for micro in steps:
        for x in micro:
            (model(x).square().sum() / len(micro)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return norms


def _offloaded(model, opt, steps, max_norm):
    engine = HostOffload(opt)
    norms = []
    for micro in steps:
        for i, x in enumerate(micro):
            engine.final = i == len(micro) - 1
            (model(x).square().sum() / len(micro)).backward()
            assert all(p.grad is None for p in model.parameters())  # taken by the hook
        norms.append(float(engine.step(max_norm)))
    return engine, norms


@pytest.mark.parametrize("make", [torch.optim.AdamW, bnb.optim.AdamW8bit], ids=["torch", "8bit"])
@pytest.mark.parametrize("max_norm", [0.5, float("inf")], ids=["clipped", "unclipped"])
def test_offloaded_steps_equal_accumulate_clip_step(make, max_norm):
    steps = _batches()
    ref, m = small_mlp(), small_mlp()
    want = _reference(ref, make(two_groups(ref)), steps, max_norm)
    _, got = _offloaded(m, make(two_groups(m)), steps, max_norm)
    # the gradient norms (2-3 x the threshold: clipping acts on every step)
    assert got == pytest.approx(want, rel=1e-6)
    if max_norm < 1:
        assert min(want) > 2 * max_norm
    for a, b in zip(ref.parameters(), m.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)


def test_one_micro_batch_needs_no_accumulation_and_state_dict_is_the_optimizers():
    steps = [s[:1] for s in _batches()]
    ref, m = small_mlp(), small_mlp()
    opt_ref, opt = torch.optim.AdamW(two_groups(ref)), torch.optim.AdamW(two_groups(m))
    _reference(ref, opt_ref, steps, 1.0)
    _offloaded(m, opt, steps, 1.0)
    for a, b in zip(ref.parameters(), m.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
    want, got = opt_ref.state_dict(), opt.state_dict()
    assert got["param_groups"] == want["param_groups"]
    for k in want["state"]:
        for name, t in want["state"][k].items():
            torch.testing.assert_close(got["state"][k][name], t, rtol=1e-6, atol=1e-9)


def test_a_resumed_8bit_optimizer_keeps_its_states_where_they_are():
    """bitsandbytes moves every state to its parameter's device on its first update after a
    load (``to_gpu``); HostOffload marks it done, so states move one parameter at a time."""
    m = small_mlp()
    opt = bnb.optim.AdamW8bit(two_groups(m))
    _offloaded(m, opt, _batches()[:1], 1.0)
    again = bnb.optim.AdamW8bit(two_groups(m))
    again.load_state_dict(opt.state_dict())
    assert again.initialized is False
    HostOffload(again)
    assert again.initialized is True


def test_errors_name_the_fix():
    m = small_mlp()
    opt = torch.optim.AdamW(two_groups(m))
    engine = HostOffload(opt)
    assert torch.isnan(engine.step())  # no gradient arrived: nothing to do
    engine.final = False  # the caller forgot to mark the last micro-batch
    m(torch.randn(2, 64)).sum().backward()
    with pytest.raises(RuntimeError, match=r"set \.final = True before the step.s last backward"):
        engine.step()
    with pytest.raises(ValueError, match="not in the optimizer's param groups"):
        HostOffload(opt, params=[nn.Parameter(torch.zeros(3))])
    with pytest.raises(ValueError, match="without flattened groups"):
        flat = adamw8bit_class()([{"params": list(small_mlp().parameters()), "name": "poet"}])
        flat.flatten_group(0)
        HostOffload(flat)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_states_and_gradients_wait_in_pinned_host_memory():
    steps = _batches("cuda")
    ref, m = small_mlp().cuda(), small_mlp().cuda()
    want = _reference(ref, bnb.optim.AdamW8bit(two_groups(ref)), steps, 0.5)
    opt = bnb.optim.AdamW8bit(two_groups(m))
    engine, got = _offloaded(m, opt, steps, 0.5)
    assert got == pytest.approx(want, rel=1e-5)
    for a, b in zip(ref.parameters(), m.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    for p in m.parameters():
        assert engine.grads[id(p)].device.type == "cpu" and engine.grads[id(p)].is_pinned()
        for t in opt.state[p].values():
            if torch.is_tensor(t):
                assert t.device.type == "cpu"


_ACCUM_CLIP = (
    "--set", "train.grad_accum=2", "--set", "optim.grad_clip=0.05", "--set",
    "optim.warmup_steps=1", "--set", "train.gradient_checkpointing=true",
    "--set", "train.precision=fp32",
)  # fmt: skip


@pytest.mark.slow
def test_a_run_with_offload_equals_the_run_without_clipping_and_accumulation_included(tiny_train):
    """The tiny recipe with 2 micro-batches per step and a clip threshold every step's norm
    exceeds (re-warmed after the merge at step 2): the same losses and gradient norms."""
    want, plain = tiny_train("plain", *_ACCUM_CLIP)
    got, rows = tiny_train("offload", *_ACCUM_CLIP, "--set", "train.offload_optimizer=true")
    assert len(want) == 3 and got == pytest.approx(want, rel=1e-5)
    norms = [r["grad_norm"] for r in plain if "grad_norm" in r]
    assert [r["grad_norm"] for r in rows if "grad_norm" in r] == pytest.approx(norms, rel=1e-5)
    assert min(norms) > 0.05  # clipping acted on every step


@pytest.mark.slow
def test_an_offloaded_run_resumes_bit_for_bit(tmp_path, monkeypatch):
    """Stopped after its step-2 checkpoint and resumed (the states come back from the
    checkpoint onto the device, then to the host): steps 3 and 4 as in the uninterrupted run."""
    import json
    import shutil

    from poetxq.tools.cli import main

    monkeypatch.setenv("POETXQ_CACHE", str(tmp_path / "cache"))
    base = ["--data", "pydoc", "--vocab-size", "512", "--seq-len", "32", "--batch-size", "4",
            "--max-steps", "4", "--no-progress", "--output-dir", str(tmp_path), "--set",
            "model.num_hidden_layers=1", "--set", "optim.state_bits=8", "--set",
            "train.log_every=1", "--set", "train.save_every=2", "--set", "train.grad_accum=2",
            "--set", "train.offload_optimizer=true"]  # fmt: skip
    assert main(["train", *base, "--run-name", "a"]) == 0
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "step-00000004")  # as if stopped at step 3
    assert main(["train", "--resume", str(tmp_path / "b"), "--no-progress"]) == 0

    def losses(run):
        rows = [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().split("\n")
                if x]  # fmt: skip
        return {r["step"]: (r["loss"], r["grad_norm"]) for r in rows if "grad_norm" in r}

    a, b = losses("a"), losses("b")
    assert sorted(b) == [1, 2, 3, 4] and [b[s] for s in (3, 4)] == [a[s] for s in (3, 4)]
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["memory_options"] == ["offload_optimizer"]


@pytest.mark.parametrize(
    "over,needle",
    [({"train.optimizer_in_backward": True, "optim.grad_clip": 0},
      "two ways to keep gradients off the GPU"),
     ({"train.cuda_graph": True}, "runs eager steps; set train.cuda_graph: false"),
     ({"method": "qgalore"}, "applies to poetxq, poetx and adamw, not qgalore")],
)  # fmt: skip
def test_recipe_refuses_what_offload_cannot_do(over, needle):
    from poetxq.training.recipe_files import RecipeError, load_recipe

    method = over.pop("method", "poetxq")
    with pytest.raises(RecipeError, match=needle):
        load_recipe(f"llama-60m:{method}", {"train.offload_optimizer": True, **over})


@pytest.mark.parametrize("state_bits", [32, 8])
def test_estimate_books_the_host_buffers_of_a_built_model(state_bits):
    """The estimator's offload terms against a real model's HostOffload after one accumulated
    step: host bytes = every gradient buffer + every optimizer state; the update's transient =
    the largest parameter's gradient + its states; the accumulator = the largest gradient buffer
    HostOffload brings back; the norms = the 0-d tensors it holds after the last micro-batch,
    one CUDA allocator block each; and the breakdown's row shows those two."""
    from poetxq.baselines.lowrank import optimizer_state_bytes
    from poetxq.model.surgery import build_llama, convert_to_poetx
    from poetxq.tools.estimate_report import format_estimate
    from poetxq.training.estimate import CUDA_BLOCK, estimate_memory
    from poetxq.training.evaluate import causal_lm_loss
    from poetxq.training.optim import build_optimizer
    from poetxq.training.recipe_files import load_recipe

    vocab = 96
    recipe = load_recipe(None, {
        "model.hidden_size": 64, "model.intermediate_size": 176, "model.num_hidden_layers": 2,
        "model.num_attention_heads": 4, "poet.block_size": 32, "optim.state_bits": state_bits,
        "train.offload_optimizer": True, "train.grad_accum": 2,
    })  # fmt: skip
    est = estimate_memory(recipe, vocab_size=vocab, precision="fp32")
    torch.manual_seed(0)
    model = build_llama(recipe.model, vocab)
    convert_to_poetx(model, recipe.poet, generator=torch.Generator().manual_seed(0))
    opt = build_optimizer(model, recipe.optim, flatten=False)
    engine = HostOffload(opt)
    for i in range(2):
        engine.final = i == 1
        causal_lm_loss(model, torch.randint(0, vocab, (2, 17))).backward()
    held = list(engine._norms)  # on the GPU from the last backward to the end of the update
    assert len(held) == len(engine.params) and all(t.dim() == 0 for t in held)
    assert est.offload_norms == len(held) * CUDA_BLOCK
    engine.step(1.0)
    # the accumulator: a gradient's host buffer brought back to the device (_take), the largest
    assert est.offload_accumulator == max(b.nbytes for b in engine.grads.values())
    row = next(ln for ln in format_estimate(est).splitlines() if "offload accumulator" in ln)
    want = (est.offload_accumulator + est.offload_norms) / 2**30
    assert row.split()[4:6] == [f"{want:.3f}", "GiB"]
    assert row.endswith(f"the largest gradient's accumulator (micro-batches 2+); {len(held)} "
                        "gradient norms")  # fmt: skip
    grads = sum(b.nbytes for b in engine.grads.values())
    assert est.host_optimizer == grads + optimizer_state_bytes(opt)
    largest = max((p for p in model.parameters() if p.requires_grad), key=lambda p: p.numel())
    # 8-bit: codes, absmax and bitsandbytes' two 256-entry fp32 code maps (qmap1/2)
    state = sum(t.nbytes for t in opt.state[largest].values() if torch.is_tensor(t))
    assert est.offload_transient == largest.nbytes + state
    assert est.offload_accumulator == largest.nbytes
    assert est.peak == (
        est.frozen_weights + est.buffers + est.trainable_params
        + max(est.activations + est.logits + est.workspace + est.lm_head_grad
              + est.offload_accumulator,
              est.in_backward_gradients + est.layer_activations + est.workspace
              + est.offload_accumulator + est.offload_norms,
              est.offload_transient + est.offload_norms)
    )  # fmt: skip
