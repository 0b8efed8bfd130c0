"""The run plan (:mod:`poetxq.training.plan`): one frozen object of every run-level decision,
built by the same deciding functions the trainer used to call one by one."""

import dataclasses
import json

import pytest

from poetxq.model.fuse import fuse_wanted
from poetxq.training.cudagraph import grad_sync_mode, graph_wanted
from poetxq.training.memory import resolve_memory_plan
from poetxq.training.plan import resolve_plan
from poetxq.training.precision import run_precision
from poetxq.training.recipe_files import load_recipe
from quant_kernels.policy import default_policy

GIB = 2**30


def test_the_plan_is_frozen_and_its_dict_is_json():
    plan = resolve_plan(load_recipe(None), "cpu")
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.cuda_graph = True  # type: ignore[misc]
    data = json.loads(plan.to_json())
    assert data == json.loads(json.dumps(plan.to_dict()))
    assert data["device"] == "cpu" and data["world_size"] == 1
    assert data["memory_plan"]["name"] == "fastest" and data["precision"] == "fp32"
    assert data["cuda_graph"] is False and data["grad_sync"] == "none"
    assert data["refusals"] == [] and data["notes"] == []  # a CPU auto run prints nothing
    assert set(data["kernels"]) >= {"triton", "weight_gemm"}


@pytest.mark.parametrize(
    "over,device,world,gpu",
    [
        ({}, "cpu", 1, None),
        ({}, "cuda", 1, 80 * GIB),
        ({}, "cuda", 2, 80 * GIB),
        ({"train.grad_sync": "ddp"}, "cuda", 2, 80 * GIB),
        ({"train.gradient_checkpointing": True}, "cuda", 1, 80 * GIB),
        ({"method": "adamw"}, "cuda", 2, 80 * GIB),
        ({"train.memory": "lowest"}, "cuda", 1, 80 * GIB),
        ({"train.precision": "bf16"}, "cpu", 1, None),
    ],
)  # fmt: skip
def test_the_plan_holds_what_the_deciding_functions_decide(over, device, world, gpu):
    """Each field is the deciding function's answer for the recipe that runs (the memory plan
    applied), so reading the plan changes no decision."""
    recipe = load_recipe(None, over)
    plan = resolve_plan(recipe, device, world, gpu)
    resolved, choice = resolve_memory_plan(recipe, device, gpu_mem=gpu, world=world)
    assert plan.recipe == resolved and plan.memory == choice
    assert plan.cuda_graph == graph_wanted(resolved, device, world)
    assert plan.grad_sync == grad_sync_mode(resolved.train, plan.cuda_graph, world)
    assert plan.precision == run_precision(resolved.train, device)
    assert plan.fuse == fuse_wanted(resolved.train, device, plan.cuda_graph)
    assert plan.meta_init == (device == "cuda")
    assert recipe.train.memory == over.get("train.memory", "auto")  # the recipe is left as given


@pytest.mark.parametrize(
    "over,device,world,refusal",
    [
        ({"train.cuda_graph": True}, "cpu", 1, "train.cuda_graph needs a CUDA device"),
        ({"train.cuda_graph": True, "train.grad_sync": "ddp"}, "cuda", 2,
         "train.cuda_graph with train.grad_sync: ddp cannot work"),
        ({"train.optimizer_in_backward": True, "optim.grad_clip": 0}, "cpu", 2,
         "train.optimizer_in_backward runs in one process only"),
        ({"train.loss_chunk_tokens": 64, "train.grad_sync": "ddp"}, "cpu", 2,
         "train.loss_chunk_tokens cannot run under DDP"),
    ],
)  # fmt: skip
def test_what_a_launch_cannot_run_is_a_refusal_with_its_fix(over, device, world, refusal):
    plan = resolve_plan(load_recipe(None, over), device, world, 80 * GIB)
    assert plan.refusals and plan.refusals[0].startswith(refusal)
    assert "; set train." in plan.refusals[0]


def test_the_notes_are_the_lines_a_run_prints_about_its_plan():
    plan = resolve_plan(load_recipe(None), "cuda", 2, 80 * GIB)
    assert plan.notes[0] == plan.memory.line()
    assert plan.notes[-1].startswith("grad sync: step across 2 processes")
    text = "\n".join(plan.lines())
    assert "cuda graph: on" in text and "precision: autocast" in text


def test_poetxq_plan_prints_the_plan_for_a_named_gpu_size(tmp_path, capsys):
    from poetxq.tools.cli import main

    out = tmp_path / "plan.json"
    argv = ["plan", "--recipe", "llama-1b:poetxq", "--gpu-memory", "80GiB", "--world-size", "2"]
    assert main([*argv, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("plan of llama-1b (poetxq) on cuda x 2 processes")
    assert "memory plan: fastest (auto)" in text and "cuda graph: on" in text
    assert "grad sync: step (train.grad_sync auto)" in text
    data = json.loads(out.read_text())
    assert data["device"] == "cuda" and data["world_size"] == 2 and data["grad_sync"] == "step"
    assert data["memory_plan"]["device_memory"] == 80 * GIB


def test_poetxq_plan_exits_1_on_a_refusal_and_explains_itself(capsys):
    from poetxq.tools.cli import main

    assert main(["plan", "--device", "cpu", "--set", "train.cuda_graph=true"]) == 1
    out = capsys.readouterr().out
    assert "refused: train.cuda_graph needs a CUDA device; set train.cuda_graph: false" in out
    assert main(["plan", "--world-size", "0"]) == 2
    assert "--world-size must be at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--help"])
    assert exc.value.code == 0
    help_text = capsys.readouterr().out
    for word in ("--gpu-memory", "--world-size", "train.cuda_graph", "plan.json", "refuse"):
        assert word in help_text


def test_a_run_directory_holds_plan_json_beside_recipe_yaml(tmp_path):
    """The plan a run took is written with recipe.yaml, and is the plan ``resolve_plan`` gives
    for that recipe on this machine."""
    from poetxq.tools.cli import main

    argv = ["train", "--data", "pydoc", "--vocab-size", "512", "--seq-len", "32",
            "--batch-size", "4", "--block-size", "16", "--no-progress", "--max-steps", "2",
            "--eval-every", "0", "--set", "model.hidden_size=64",
            "--set", "model.intermediate_size=136", "--set", "model.num_hidden_layers=1",
            "--set", "train.eval_max_batches=1", "--output-dir", str(tmp_path),
            "--run-name", "r"]  # fmt: skip
    assert main(argv) == 0
    run = tmp_path / "r"
    assert (run / "recipe.yaml").is_file()
    data = json.loads((run / "plan.json").read_text())
    assert data["device"] == "cpu" and data["precision"] == "fp32" and data["refusals"] == []
    assert data["memory_plan"]["name"] == "fastest" and data["cuda_graph"] is False
    assert data["recipe"] == load_recipe(str(run / "recipe.yaml")).name


@pytest.mark.parametrize("gemm", ["auto", "bf16", "int8"])
def test_the_plans_kernel_policy_carries_poet_gemm(gemm):
    plan = resolve_plan(load_recipe(None, {"poet.gemm": gemm}), "cpu")
    assert plan.kernels.w0_gemm == (default_policy().w0_gemm if gemm == "auto" else gemm)
    assert plan.to_dict()["kernels"]["w0_gemm"] == plan.kernels.w0_gemm


@pytest.mark.parametrize("over", [{}, {"train.gradient_checkpointing": True}, {"method": "adamw"}])
def test_the_estimate_of_a_cuda_plan_is_the_one_process_gpu_estimate(over):
    """The estimator reads a CUDA plan's graph and fusion; for one process they are what it
    decided for itself, so the numbers agree."""
    from poetxq.training.estimate import estimate_memory

    plan = resolve_plan(load_recipe(None, over), "cuda", 1, 80 * GIB)
    alone = estimate_memory(plan.recipe, precision=plan.precision)
    with_plan = estimate_memory(plan.recipe, precision=plan.precision, plan=plan)
    assert with_plan.to_dict() == alone.to_dict()
