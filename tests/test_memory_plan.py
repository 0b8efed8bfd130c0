"""Memory plans (poetxq.training.memory): which plan for which memory (against the estimator's
own peaks and auto's stated rule), what each plan sets per method, that keys the recipe sets
itself win, the one-line report, and the CLI (train --memory, estimate-memory's plan list)."""

import json
from pathlib import Path

import pytest

from poetxq.tools.cli import main
from poetxq.training.estimate import GRAPH_POOL_OVERHEAD, estimate_memory
from poetxq.training.memory import (
    HEADROOM,
    MemoryPlanError,
    apply_plan,
    fit_verdict,
    plan_overrides,
    resolve_memory_plan,
)
from poetxq.training.recipe_files import RecipeError, load_recipe

GiB = 2**30
_8B = {"train.batch_size": 1, "train.seq_len": 2048, "train.grad_accum": 1}


def _peaks(recipe) -> dict[str, tuple[int, bool]]:
    """Each plan's predicted peak and whether it replays a CUDA graph, computed here from the
    estimator on the plan's recipe (the keys the plan sets, by hand)."""
    by_hand = {
        "fastest": {},
        "balanced": {"train.gradient_checkpointing": True, "train.loss_chunk_tokens": 1024,
                     "optim.state_bits": 8},
        "lowest": {"train.gradient_checkpointing": True, "train.offload_activations": True,
                   "train.offload_optimizer": True, "train.loss_chunk_tokens": 256,
                   "optim.state_bits": 8, "train.precision": "bf16-true"},
    }  # fmt: skip
    out = {}
    for name, keys in by_hand.items():
        r = load_recipe("llama-8b:poetxq", {**_8B, **keys})
        prec = "bf16-true" if r.train.precision == "bf16-true" else "autocast"
        est = estimate_memory(r, precision=prec)
        out[name] = (est.peak, est.cuda_graph)
    return out


def test_auto_takes_the_fastest_plan_that_fits_by_the_stated_rule():
    recipe = load_recipe("llama-8b:poetxq", _8B)
    peaks = _peaks(recipe)
    fast, graph = peaks["fastest"]
    assert graph  # the fastest 8B plan replays a CUDA graph: its pool overhead counts too
    assert peaks["lowest"][0] < peaks["balanced"][0] < fast

    def smallest_gpu(peak: int, graph: bool) -> int:  # auto's rule, inverted
        return int(peak * (1 + GRAPH_POOL_OVERHEAD if graph else 1) / (1 - HEADROOM)) + 2**20

    cases = [
        (smallest_gpu(*peaks["fastest"]), "fastest"),
        (smallest_gpu(*peaks["fastest"]) - 2**24, "balanced"),
        (smallest_gpu(*peaks["balanced"]), "balanced"),
        (smallest_gpu(*peaks["balanced"]) - 2**24, "lowest"),
        (smallest_gpu(*peaks["lowest"]), "lowest"),
        (4 * GiB, "lowest"),  # nothing fits: the smallest plan, said in the line
    ]
    for gpu_mem, want in cases:
        resolved, choice = resolve_memory_plan(recipe, "cpu", gpu_mem=gpu_mem)
        assert choice.name == want == resolved.train.memory, gpu_mem / GiB
        assert choice.predicted_peak == peaks[want][0] and choice.chosen_by == "auto"
        assert list(choice.tried) == ["fastest", "balanced", "lowest"][: len(choice.tried)]
        assert choice.name not in choice.tried
    _, tight = resolve_memory_plan(recipe, "cpu", gpu_mem=4 * GiB)
    assert "does not leave 10% free: expect out-of-memory" in tight.line()
    assert tight.allocator == "expandable_segments:True"


def test_where_nothing_fits_auto_takes_the_smallest_peak_not_the_last_plan():
    """A baseline's lowest plan can predict more than its fastest (GaLore at 8B: the 8-bit
    states and checkpointing save less than bf16-true's copies cost there): auto then keeps the
    fastest, lists the others as tried, and does not advise --memory lowest."""
    recipe = load_recipe("llama-8b:galore", _8B)
    peaks = {  # each plan named: the peak it predicts
        name: resolve_memory_plan(
            load_recipe("llama-8b:galore", {**_8B, "train.memory": name}), "cpu", gpu_mem=16 * GiB
        )[1].predicted_peak
        for name in ("fastest", "balanced", "lowest")
    }
    assert peaks["fastest"] < peaks["lowest"]  # the case this guards
    resolved, choice = resolve_memory_plan(recipe, "cpu", gpu_mem=16 * GiB)
    assert choice.name == resolved.train.memory == min(peaks, key=peaks.__getitem__)
    assert choice.predicted_peak == min(peaks.values())
    assert choice.name not in choice.tried and set(choice.tried) | {choice.name} == set(peaks)
    line = choice.line()
    assert "expect out-of-memory" in line and "--memory lowest" not in line


def test_fit_verdict_keeps_headroom_free_by_default_and_none_with_headroom_0():
    # 80 GiB with 10% kept free: up to 72 GiB (77_309_411_328 bytes) fits
    gpu = 80 * GiB  # 85_899_345_920 bytes
    assert fit_verdict(72 * GiB - 1, gpu) == "fits"
    assert fit_verdict(72 * GiB, gpu) == "fits"
    assert fit_verdict(72 * GiB + 1, gpu) == "does not leave 10% free"
    assert fit_verdict(80 * GiB, gpu) == "does not leave 10% free"
    assert fit_verdict(80 * GiB + 1, gpu) == "does not fit"
    # headroom 0: only whether the peak fits at all
    assert fit_verdict(80 * GiB, gpu, headroom=0) == "fits"
    assert fit_verdict(80 * GiB + 1, gpu, headroom=0) == "does not fit"
    assert fit_verdict(3000, 4000, headroom=0.25) == "fits"  # 4000 * 0.75 = 3000
    assert fit_verdict(3001, 4000, headroom=0.25) == "does not leave 25% free"


def test_auto_on_a_cpu_is_the_recipe_as_written():
    recipe = load_recipe("llama-60m:poetxq")
    resolved, choice = resolve_memory_plan(recipe, "cpu")
    assert (choice.name, choice.applied, choice.predicted_peak) == ("fastest", {}, None)
    assert choice.allocator is None
    assert resolved.model_dump() == {
        **recipe.model_dump(),
        "train": {**recipe.train.model_dump(), "memory": "fastest"},
    }


def test_each_plan_sets_only_what_the_method_has_and_the_recipe_leaves_open():
    lowest = plan_overrides(load_recipe("llama-60m:poetxq"), "lowest")[0]
    assert lowest == {
        "train.gradient_checkpointing": True, "train.offload_activations": True,
        "train.offload_optimizer": True, "train.loss_chunk_tokens": 256, "optim.state_bits": 8,
        "train.precision": "bf16-true",
    }  # fmt: skip
    adamw = plan_overrides(load_recipe("llama-60m:adamw"), "lowest")[0]
    assert "optim.state_bits" not in adamw and adamw["train.offload_optimizer"] is True
    qgalore = plan_overrides(load_recipe("llama-60m:qgalore"), "lowest")[0]
    assert set(qgalore) == {"train.gradient_checkpointing", "train.offload_activations",
                            "train.loss_chunk_tokens"}  # fmt: skip
    assert (
        "train.offload_optimizer"
        not in plan_overrides(load_recipe("llama-60m:poetxq"), "lowest", world=2)[0]
    )  # one process only
    # keys the recipe sets itself keep their value
    own = load_recipe("llama-60m:poetxq", {"train.loss_chunk_tokens": 64,
                                           "train.precision": "autocast"})  # fmt: skip
    applied, kept = plan_overrides(own, "lowest")
    assert kept == {"train.loss_chunk_tokens": 64, "train.precision": "autocast"}
    resolved = apply_plan(own, applied, "lowest")
    assert resolved.train.loss_chunk_tokens == 64 and resolved.train.offload_optimizer
    _, choice = resolve_memory_plan(own, "cpu")
    own_named = load_recipe("llama-60m:poetxq", {"train.memory": "lowest",
                                                 "train.loss_chunk_tokens": 64})  # fmt: skip
    _, choice = resolve_memory_plan(own_named, "cpu")
    assert choice.chosen_by == "train.memory"
    assert choice.line() == (
        "memory plan: lowest (train.memory); kept as overridden (--set or a flag): "
        "train.loss_chunk_tokens=64"
    )


def test_the_plan_line_calls_a_command_line_value_an_override(tmp_path, capsys):
    """A plan key the recipe file sets is 'kept from the recipe'; one a --set or a flag sets is
    'kept as overridden' (load_recipe records which keys its overrides set)."""
    recipes = Path(__file__).resolve().parents[1] / "recipes"
    own = tmp_path / "own.yaml"
    own.write_text(
        f"base: [{recipes}/models/llama-60m.yaml, {recipes}/methods/poetxq.yaml]\n"
        "train: {loss_chunk_tokens: 64}\n"
    )
    flags = ["estimate-memory", "--recipe", str(own), "--memory", "lowest"]
    assert main([*flags, "--set", "train.precision=autocast"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        "memory plan: lowest (train.memory); kept as overridden (--set or a flag): "
        "train.precision=autocast; kept from the recipe: train.loss_chunk_tokens=64"
    )
    assert main([*flags, "--gradient-checkpointing"]) == 0  # a flag is an override too
    assert capsys.readouterr().out.splitlines()[0] == (
        "memory plan: lowest (train.memory); kept as overridden (--set or a flag): "
        "train.gradient_checkpointing=True; kept from the recipe: train.loss_chunk_tokens=64"
    )
    _, choice = resolve_memory_plan(
        load_recipe(own, {"train.precision": "fp32", "train.memory": "lowest"}), "cpu"
    )
    assert choice.overridden == ["train.precision"]
    assert set(choice.kept) == {"train.precision", "train.loss_chunk_tokens"}


@pytest.mark.parametrize(
    "own",
    [{"train.optimizer_in_backward": True, "optim.grad_clip": 0, "train.grad_accum": 1},
     {"train.cuda_graph": True, "optim.state_bits": 8}],
)  # fmt: skip
def test_the_lowest_plan_gives_way_to_the_recipes_own_gradient_handling(own):
    recipe = load_recipe("llama-60m:poetxq", {**own, "train.memory": "lowest"})
    resolved, choice = resolve_memory_plan(recipe, "cpu")
    assert not resolved.train.offload_optimizer and "train.offload_optimizer" not in choice.applied
    assert resolved.train.offload_activations  # the rest of the plan holds
    why = ("the recipe's train.optimizer_in_backward frees the gradients"
           if "train.optimizer_in_backward" in own
           else "the recipe's train.cuda_graph: true; it runs eager steps")  # fmt: skip
    assert choice.left_out == {"train.offload_optimizer": why}
    assert choice.line().endswith(f"; left out: train.offload_optimizer ({why})")


def test_an_unknown_plan_is_one_line():
    with pytest.raises(RecipeError, match=r"train\.memory"):
        load_recipe(None, {"train.memory": "tiny"})
    with pytest.raises(MemoryPlanError, match="choose auto or one of"):
        plan_overrides(load_recipe(None), "tiny")
    # a plan's key the recipe's own settings refuse: one line naming the conflict
    own = load_recipe("llama-8b:poetxq", {"train.gradient_checkpointing": False,
                                          "train.memory": "lowest"})  # fmt: skip
    with pytest.raises(MemoryPlanError, match=r"memory plan lowest does not combine with this "
                       r"recipe: train\.offload_activations"):  # fmt: skip
        resolve_memory_plan(own, "cpu")


def test_estimate_memory_lists_the_plans(tmp_path, capsys):
    out = tmp_path / "est.json"
    assert main(["estimate-memory", "--recipe", "llama-8b:poetxq", "--batch-size", "1",
                 "--seq-len", "2048", "--set", "train.grad_accum=1", "--gpu-mem", "16GB",
                 "--json", str(out)]) == 0  # fmt: skip
    text = capsys.readouterr().out
    plans = {p["plan"]: p for p in json.loads(out.read_text())["plans"]}
    peaks = _peaks(None)
    for name in ("fastest", "balanced", "lowest"):
        assert plans[name]["peak"] == peaks[name][0]
        line = next(ln for ln in text.splitlines() if ln.startswith(f"  {name} "))
        assert f" {peaks[name][0] / GiB:.3f} GiB" in line
    assert [plans[n]["fits"] for n in ("fastest", "balanced", "lowest")] == [False, False, True]
    low = plans["lowest"]
    # batch 1, one micro-batch: gradients out once, back once with the states, states out;
    # the checkpointed layer inputs out and back
    est = estimate_memory(load_recipe("llama-8b:poetxq", {**_8B, **low["applied"]}),
                          precision="bf16-true")  # fmt: skip
    states = est.optimizer_states
    inputs = est.host_offloaded - est.gradients - states
    assert low["host_traffic_per_step"] == 2 * est.gradients + 2 * states + 2 * inputs
    assert "recomputes each layer, host 2.84 GiB" in text
    assert "note: the plans change this peak" not in text  # 8B POET-XQ: 40.6 -> 10.3 GiB


def test_plans_that_cannot_lower_a_baselines_peak_say_what_holds_it(capsys):
    """Q-GaLore's full gradients (no plan offloads them) hold every plan's peak at one size: a
    note names that term, so the host traffic of `lowest` is not read as a saving."""
    recipe = load_recipe("llama-13b:qgalore")
    est = estimate_memory(recipe, precision="autocast")
    assert max(est.peak_terms, key=lambda t: t[1]) == ("gradients", est.gradients)
    assert main(["estimate-memory", "--recipe", "llama-13b:qgalore", "--gpu-mem", "24GB"]) == 1
    lines = capsys.readouterr().out.splitlines()
    peaks = [float(ln.split()[1]) for ln in lines if ln.split()[:1] in (["fastest"], ["balanced"],
                                                                         ["lowest"])]  # fmt: skip
    assert len(peaks) == 3 and max(peaks) - min(peaks) < 0.02 * max(peaks)
    assert (
        "  note: the plans change this peak by under 2%: its largest term, gradients "
        f"{est.gradients / GiB:.2f} GiB, stays on the GPU in every plan for qgalore"
    ) in lines


@pytest.mark.slow
def test_train_with_a_named_plan_records_it(tmp_path, monkeypatch, capsys, cpu_only):
    monkeypatch.setenv("POETXQ_CACHE", str(tmp_path / "cache"))
    args = ["train", "--data", "pydoc", "--vocab-size", "512", "--seq-len", "32",
            "--batch-size", "4", "--max-steps", "2", "--no-progress", "--output-dir",
            str(tmp_path), "--run-name", "low", "--memory", "lowest", "--grad-accum", "2",
            "--set", "model.num_hidden_layers=1", "--set", "train.precision=fp32"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert (
        "memory plan: lowest (train.memory); kept as overridden (--set or a flag): "
        "train.precision=fp32" in out
    )
    summary = json.loads((tmp_path / "low" / "summary.json").read_text())
    plan = summary["memory_plan"]
    assert plan["name"] == "lowest" and plan["applied"]["train.offload_optimizer"] is True
    assert summary["memory_options"] == ["gradient_checkpointing", "offload_activations",
                                         "offload_optimizer", "loss_chunk_tokens=256"]  # fmt: skip
    recipe = (tmp_path / "low" / "recipe.yaml").read_text()
    assert "memory: lowest" in recipe and "offload_optimizer: true" in recipe
    assert main(["report", str(tmp_path / "low"), "-o", str(tmp_path / "report")]) == 0
    table = (tmp_path / "report" / "report.md").read_text()
    assert "checkpointing, offload, optimizer offload, chunked loss (256), 8-bit states" in table
    # the plan is part of the run: a resume cannot switch it (its keys may change one by one)
    capsys.readouterr()
    resume = ["train", "--resume", str(tmp_path / "low"), "--no-progress"]
    assert main([*resume, "--set", "train.memory=fastest", "--max-steps", "3"]) == 2
    err = capsys.readouterr().err
    assert "train.memory" in err, err
    # --resume auto with the recipe as first given (memory auto) takes the run's own plan: the
    # finished run is found as such, not refused for its plan's keys
    auto = [a for a in args if a not in ("--memory", "lowest")]
    assert main([*auto, "--resume", "auto"]) == 0
    assert "already finished at step 2 of 2" in capsys.readouterr().out
    assert main([*args, "--resume", "auto"]) == 0  # the same line, --memory lowest included
    assert "already finished at step 2 of 2" in capsys.readouterr().out
    assert main(["train", "--gpu-mem", "lots", "--max-steps", "1"]) != 0
    assert "lots" in capsys.readouterr().err
    # what train --help says of --resume: without --memory, with auto or with the run's own
    # plan it keeps that plan, not fitted to the GPU again (auto would take fastest in 1 TiB);
    # without its final model the run counts as resumable at its last checkpoint
    from poetxq.training.resume import plan_resume

    (tmp_path / "low" / "model.safetensors").unlink()
    for memory in ({}, {"train.memory": "auto"}, {"train.memory": "lowest"}):
        again, _, _ = plan_resume(str(tmp_path / "low"), recipe_path=None, run_name=None,
                                  overrides=memory)  # fmt: skip
        kept, choice = resolve_memory_plan(again, "cpu", gpu_mem=2**40)
        assert choice.name == "lowest" and kept.train.offload_optimizer, memory


def test_llama_70b_recipe_builds_the_llama_2_70b_shape_on_meta():
    from poetxq.model.surgery import build_empty_llama

    recipe = load_recipe("llama-70b:poetxq4")
    model = build_empty_llama(recipe.model, recipe.data.vocab_size)
    assert all(p.device.type == "meta" for p in model.parameters())  # nothing allocated
    layer = model.model.layers[0]
    shapes = {n: tuple(m.weight.shape) for n, m in layer.named_modules() if n.endswith("proj")}
    assert shapes == {
        "self_attn.q_proj": (8192, 8192), "self_attn.k_proj": (1024, 8192),
        "self_attn.v_proj": (1024, 8192), "self_attn.o_proj": (8192, 8192),
        "mlp.gate_proj": (28672, 8192), "mlp.up_proj": (28672, 8192),
        "mlp.down_proj": (8192, 28672),
    }  # fmt: skip
    linear = sum(m.weight.numel() for n, m in model.named_modules() if n.endswith("proj"))
    assert len(model.model.layers) == 80 and linear == 80 * 855_638_016  # 68.45 B frozen W0
    assert recipe.poet.bits == 4 and recipe.poet.quant_type == "nf4"


@pytest.mark.parametrize("method,limit", [("poetxq4", 46), ("poetxq", 78)])
def test_the_lowest_plan_predicts_llama_70b_within_the_one_gpu_targets(method, limit):
    """The estimator's prediction (not a measurement: that is the GPU run's) for a POET-XQ step
    of Llama-70B at batch 1 x 2048 with the lowest plan, clipping on: under issue 30's targets
    (NF4 46 GiB, int8 78 GiB), with room for the estimator's error."""
    recipe = load_recipe(f"llama-70b:{method}", {**_8B, "train.memory": "lowest"})
    resolved, choice = resolve_memory_plan(recipe, "cpu", gpu_mem=141 * GiB)
    assert resolved.optim.grad_clip == 1.0 and resolved.train.offload_optimizer
    assert choice.predicted_peak < 0.95 * limit * GiB


def test_per_process_peaks_hold_the_whole_model_per_gpu_and_say_what_sharding_w0_would_leave():
    from poetxq.training.memory_table import per_process_peaks

    recipe = load_recipe("llama-70b:poetxq", {**_8B, "train.memory": "lowest"})
    two = per_process_peaks(recipe, 2)
    # no optimizer offload with two processes; the chunked loss syncs once per step (no buckets)
    keys = {"train.gradient_checkpointing": True, "train.offload_activations": True,
            "train.loss_chunk_tokens": 256, "optim.state_bits": 8,
            "train.precision": "bf16-true"}  # fmt: skip
    est = estimate_memory(load_recipe("llama-70b:poetxq", {**_8B, **keys}), precision="bf16-true")
    assert (two["plan"], two["grad_sync"]) == ("lowest", "step")
    assert two["left_out"] == {"train.offload_optimizer": "2 processes; it serves one"}
    assert two["one_process_only"] == [] and per_process_peaks(recipe, 1)["left_out"] == {}
    assert two["data_parallel"] == est.peak
    layer = est.frozen_weights // 80
    assert two["w0_sharded"] == est.peak - est.frozen_weights + est.frozen_weights // 2 + layer
    eager = per_process_peaks(
        load_recipe("llama-60m:adamw", {"train.memory": "fastest", "train.cuda_graph": False}), 2
    )
    plain = estimate_memory(load_recipe("llama-60m:adamw", {"train.cuda_graph": False}))
    assert eager["grad_sync"] == "ddp" and eager["data_parallel"] == plain.peak + plain.gradients
    with pytest.raises(ValueError, match="at least 1"):
        per_process_peaks(recipe, 0)


@pytest.mark.parametrize(
    ("extra", "code"),
    [
        (["--processes", "2", "--gpu-mem", "12GB"], 1),  # one process fits, two per GPU do not
        (["--processes", "2", "--gpu-mem", "40GB"], 0),
        (["--memory", "lowest", "--gpu-mem", "11GB", "--precision", "fp32"], 1),  # as shown
        (["--memory", "lowest", "--gpu-mem", "11GB"], 0),
    ],
)
def test_estimate_memory_exits_1_where_the_estimate_it_shows_does_not_fit(extra, code, capsys):
    """The exit status follows the verdicts printed: the per-GPU peak of --processes N and the
    estimate at another --precision count, not only the one-process plans' table."""
    argv = ["estimate-memory", "--recipe", "llama-8b:poetxq", "--batch-size", "1",
            "--seq-len", "2048", "--set", "train.grad_accum=1", *extra]  # fmt: skip
    assert main(argv) == code
    out = capsys.readouterr().out
    if "--processes" in extra:
        assert ("per GPU: fits" in out) == (code == 0)
    else:
        assert ("does not fit in 11.0 GiB" in out) == (code == 1)


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_the_lower_plans_turn_on_expandable_segments_unless_the_user_chose(monkeypatch):
    import os

    import torch

    from poetxq.training.memory import PlanChoice, apply_allocator

    seen: list[str] = []  # the allocator itself stays as the test session has it
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", seen.append)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    apply_allocator(PlanChoice("lowest", "auto", allocator="expandable_segments:True"))
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert seen == ["expandable_segments:True"]
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    apply_allocator(PlanChoice("lowest", "auto", allocator="expandable_segments:True"))
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:False"
    assert seen == ["expandable_segments:True"]  # not called again


def test_a_pretrained_checkpoint_is_planned_with_its_own_shape(tmp_path, capsys):
    """--model: the estimator reads the checkpoint's config.json (shape and vocabulary), not the
    recipe's model section; without a local config.json auto stays at fastest and says why."""
    config = {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
              "num_hidden_layers": 32, "num_key_value_heads": 8, "vocab_size": 128256,
              "max_position_embeddings": 8192, "tie_word_embeddings": False,
              "model_type": "llama"}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    recipe = load_recipe(None, {"model.pretrained": str(tmp_path), **_8B})
    _, choice = resolve_memory_plan(recipe, "cpu", gpu_mem=16 * GiB)
    # the same shape written as a recipe, by hand, under the plan auto took
    keys = {f"model.{k}": config[k] for k in ("hidden_size", "intermediate_size",
            "num_attention_heads", "num_hidden_layers", "num_key_value_heads")}  # fmt: skip
    by_hand = load_recipe(None, {**keys, **_8B, **choice.applied,
                                 "model.max_position_embeddings": 8192})  # fmt: skip
    est = estimate_memory(by_hand, vocab_size=128256, precision="bf16-true")
    assert choice.name == "lowest" and choice.predicted_peak == est.peak
    assert est.peak > 8 * GiB  # an 8B shape, not the embedded recipe's tiny one
    flags = ["estimate-memory", "--model", str(tmp_path), "--batch-size", "1",
             "--seq-len", "2048", "--set", "train.grad_accum=1", "--gpu-mem", "16GB"]  # fmt: skip
    assert main(flags) == 0
    out = capsys.readouterr().out
    assert (
        f"note: the shape and vocabulary of {tmp_path}/config.json, the other settings of "
        "recipe tiny-poetxq"
    ) in out
    assert "memory plan: lowest (auto;" in out
    # the table's title names what it estimates: the checkpoint's config.json, not the recipe
    title = next(ln for ln in out.splitlines() if ln.startswith("memory estimate:"))
    assert title == (
        f"memory estimate: {tmp_path}/config.json (poetxq), batch 1 x seq 2048, vocab 128,256, "
        "bf16-true"
    )
    assert f"{est.peak / GiB:9.3f} GiB" in out
    assert main(["estimate-memory", "--set", f"model.pretrained={tmp_path}", *flags[3:]]) == 0
    assert capsys.readouterr().out == out  # --model is model.pretrained
    (tmp_path / "config.json").unlink()
    _, none = resolve_memory_plan(recipe, "cpu", gpu_mem=16 * GiB)
    assert none.name == "fastest" and none.predicted_peak is None and not none.applied
    assert "no local config.json to estimate the --model checkpoint by" in none.line()
    assert main(flags) == 2
    err = capsys.readouterr()
    assert "holds no config.json; pass a checkpoint directory" in err.err and not err.out
    named = load_recipe(None, {"model.pretrained": str(tmp_path), "train.memory": "lowest"})
    assert resolve_memory_plan(named, "cpu")[1].applied["train.offload_optimizer"] is True


def test_several_processes_say_in_one_line_that_the_optimizer_offload_is_left_out(capsys):
    """The lowest plan's optimizer offload serves one process: with --processes 2 the per-GPU
    peak is the plan without it, and one line says so; a recipe that sets it itself is refused
    by train with several processes, so it is estimated without it and the line says that."""
    flags = ["estimate-memory", "--recipe", "llama-8b:poetxq", "--batch-size", "1", "--seq-len",
             "2048", "--set", "train.grad_accum=1", "--memory", "lowest"]  # fmt: skip
    keys = {"train.gradient_checkpointing": True, "train.offload_activations": True,
            "train.loss_chunk_tokens": 256, "optim.state_bits": 8,
            "train.precision": "bf16-true"}  # fmt: skip
    without = estimate_memory(load_recipe("llama-8b:poetxq", {**_8B, **keys}),
                              precision="bf16-true").peak  # fmt: skip
    assert main([*flags, "--processes", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [ln for ln in out if ln.startswith("note: with")] == [
        "note: with 2 processes plan lowest leaves out train.offload_optimizer (it serves one "
        "process): each GPU keeps its gradients and optimizer states, counted in the per-GPU "
        "peak below"
    ]
    per_gpu = next(ln for ln in out if ln.startswith("per GPU with 2"))
    assert f": {without / GiB:.2f} GiB (plan lowest, gradient sync step)" in per_gpu
    assert main([*flags, "--processes", "1"]) == 0  # one process: the offload stays, no line
    assert "note: with" not in capsys.readouterr().out
    recipe = load_recipe("llama-8b:poetxq", {**_8B, "train.memory": "lowest"})
    _, choice = resolve_memory_plan(recipe, "cpu", world=2)  # train under a launcher
    assert choice.line() == (
        "memory plan: lowest (train.memory); left out: train.offload_optimizer (2 processes; it "
        "serves one)"
    )
    assert main([*flags, "--set", "train.offload_optimizer=true", "--processes", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [ln for ln in out if ln.startswith("note: with")] == [
        "note: with 2 processes train.offload_optimizer runs in one process only (poetxq train "
        "refuses it): each GPU keeps its gradients and optimizer states, counted in the per-GPU "
        "peak below"
    ]
    per_gpu = next(ln for ln in out if ln.startswith("per GPU with 2"))
    assert f": {without / GiB:.2f} GiB (plan lowest, gradient sync step)" in per_gpu


def test_the_plan_line_names_the_keys_another_method_does_not_take():
    """Q-GaLore keeps its own 8-bit states and float32 parameters and takes no optimizer offload:
    `lowest` says so after `left out:` instead of dropping the keys silently."""
    qgalore = str(Path(__file__).parents[1] / "recipes/tiny/qgalore.yaml")
    recipe = load_recipe(qgalore, {"train.memory": "lowest"})
    _, choice = resolve_memory_plan(recipe, "cpu")
    assert choice.left_out == {
        "train.offload_optimizer": "poetxq, poetx, adamw only",
        "optim.state_bits": "poetxq, poetx only",
        "train.precision": "poetxq, poetx, adamw only",
    }
    assert "; left out: train.offload_optimizer (poetxq, poetx, adamw only), " in choice.line()
    mine = load_recipe(qgalore, {"train.memory": "lowest", "train.precision": "fp32"})
    assert "train.precision" not in resolve_memory_plan(mine, "cpu")[1].left_out  # set: no note


def test_a_small_gpu_memory_reads_in_mib_not_zero_gib(capsys):
    from poetxq.training.memory import size_text

    assert (size_text(80 * 2**30), size_text(2**30), size_text(10 * 2**20)) == (
        "80.0 GiB", "1.0 GiB", "10 MiB")  # fmt: skip
    assert main(["estimate-memory", "--gpu-mem", "10MiB"]) == 1
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("memory plan: lowest (auto;") and " GiB of 10 MiB (--gpu-mem)" in first


def test_the_plans_tried_read_in_mib_below_one_gib():
    """auto's over-the-limit plans print through size_text: a tiny model's 120 MiB, not 0.1 GiB."""
    from poetxq.training.memory import PlanChoice

    choice = PlanChoice("lowest", "auto", tried={"fastest": 120 * 2**20, "balanced": 3 * 2**30})
    assert choice.line() == (
        "memory plan: lowest (auto; fastest 120 MiB, balanced 3.0 GiB predicted, over the limit)"
    )
    # a plan that replays a CUDA graph says that its limit leaves room for the graph's pool
    graphed = PlanChoice("balanced", "auto", tried={"fastest": 30 * 2**30}, graphed=("fastest",))
    assert graphed.line() == (
        "memory plan: balanced (auto; fastest 30.0 GiB + 14.4% CUDA graph pool predicted, "
        "over the limit)"
    )


def test_auto_names_the_graph_pool_of_a_graphed_plan_it_passed_over():
    """Llama-8B for 34 GB: fastest's 30.1 GiB is under 34, but not with its graph's pool and
    the 10 % kept free; the line says why."""
    recipe = load_recipe("llama-8b:poetxq", _8B)
    _, choice = resolve_memory_plan(recipe, "cpu", gpu_mem=34 * GiB)
    assert choice.name == "balanced" and choice.graphed == ("fastest",)
    assert "fastest 30.1 GiB + 14.4% CUDA graph pool predicted, over the limit" in choice.line()


def test_an_int8_recipe_that_does_not_fit_names_what_nf4_would_take(capsys):
    """Llama-70B int8 for a 48 GB GPU does not fit by any plan (lowest 70.27 GiB); the same
    recipe with NF4 W0 does (lowest, 39.39 GiB, as llama-70b:poetxq4 predicts): the last line
    says so. A 4-bit recipe gets no such line."""
    argv = ["estimate-memory", "--batch-size", "1", "--seq-len", "2048",
            "--set", "train.grad_accum=1", "--gpu-mem", "48GB"]  # fmt: skip
    assert main([*argv, "--recipe", "llama-70b:poetxq"]) == 1
    four = load_recipe("llama-70b:poetxq4", _8B)
    nf4 = estimate_memory(
        apply_plan(four, plan_overrides(four, "lowest")[0], "lowest"), precision="bf16-true"
    )
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == (
        f"with NF4 W0 it fits: plan lowest, predicted peak {nf4.peak / 2**30:.2f} GiB "
        "(--set poet.bits=4, or the MODEL:poetxq4 recipe)"
    )
    assert main([*argv, "--gpu-mem", "30GB", "--recipe", "llama-70b:poetxq4"]) == 1
    assert "with NF4 W0" not in capsys.readouterr().out
