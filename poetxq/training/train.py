# Over 500 lines: train() is one loop whose closures (log, evaluate, checkpoint) share its state.
"""The training loop (accelerate): recipe → data → model surgery → POET AdamW → metrics/checkpoint.

CPU runs in fp32; on a GPU the loop runs under bf16 autocast (accelerate ``mixed_precision="bf16"``)
with no flag needed (``train.precision`` overrides). Every ``merge_interval`` optimizer steps all
POET-X(Q) layers are merged and re-initialized and the Adam moments of ``Q`` are reset. Metrics go
to ``<run_dir>/metrics.jsonl`` (one JSON object per line) and, when asked, accelerate's trackers.

Under ``accelerate launch`` / ``torchrun`` every process trains a replica on its own shard of each
global batch (:mod:`poetxq.training.distributed`); rank 0 writes metrics and checkpoints. Full
training checkpoints (:mod:`poetxq.training.checkpoint`) are written every ``train.save_every``
steps, at the end and when SIGTERM/SIGINT arrives; ``resume_from`` continues a run exactly where its
checkpoint left it.
"""

from __future__ import annotations

import json
import math
import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import DistributedDataParallelKwargs, set_seed
from tqdm.auto import tqdm

from poetxq.baselines import build_baseline_optimizer
from poetxq.data import TokenData, prepare_data, unigram_perplexity
from poetxq.model.diagnostics import (
    DRIFT_WARNING,
    REQUANT_KEY,
    LayerDiagnostics,
    summarize_layers,
)
from poetxq.model.relayout import relayout_if_wanted
from poetxq.model.surgery import poet_layers
from poetxq.paths import RUN_LOCK
from poetxq.text import count
from poetxq.training.build import build_for_training
from poetxq.training.checkpoint import (
    CHECKPOINT_DIR,
    check_world_size,
    load_training_checkpoint,
    save_training_checkpoint,
)
from poetxq.training.cudagraph import (
    grad_sync_mode,
    graph_hint,
    graph_wanted,
)
from poetxq.training.distributed import (
    ShardedBatches,
    StopSignals,
    all_reduce_float_grads,
    any_rank,
    broadcast_module,
    replicas_identical,
)
from poetxq.training.evaluate import evaluate_perplexity
from poetxq.training.loss import training_loss
from poetxq.training.lowmem import enable_activation_checkpointing
from poetxq.training.memory import apply_allocator, resolve_memory_plan
from poetxq.training.optim import (
    build_optimizer,
    build_scheduler,
    clip_threshold,
    merge_and_reset,
)
from poetxq.training.precision import cpu_note, run_precision
from poetxq.training.recipe import POET_METHODS, Recipe, dump_recipe, method_label
from poetxq.training.rundir import (
    RUN_OUTPUTS,
    RunDirError,
    keep_metrics_until,
    lock_run_dir,
    save_checkpoint,
    save_run_artifacts,
    unlock_run_dir,
)
from poetxq.training.step import StepEngine


class DataPrepInterrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) while the data was read and tokenized, before the run directory was
    touched; the message is the one line the CLI prints."""


class DivergedError(RuntimeError):
    """The training loss became NaN or infinite; nothing was saved after that point."""


def _diverged(loss: float, step: int, run_dir: Path) -> DivergedError:
    return DivergedError(
        f"training loss is {loss} at step {step}: the run diverged. Lower the learning rates "
        "(--lr, and --poet-lr for POET methods) or raise warmup; checkpoints written before "
        f"step {step} in {run_dir} are kept, nothing was saved after the divergence"
    )


@dataclass
class TrainResult:
    """Summary of a finished run (also written to ``<run_dir>/summary.json``)."""

    run_dir: str
    steps: int
    tokens: int
    initial_val_ppl: float
    final_val_ppl: float
    unigram_val_ppl: float
    final_train_loss: float
    tokens_per_s: float  # this session's steps (a resumed run's too): evals and saves left out
    train_seconds: float  # wall seconds of the training loop over all sessions, evals included
    merges: int
    device: str
    method: str = ""  # label: poetxq, poetxq4, poetx or the baseline's name
    # torch.cuda.max_memory_allocated since the model was built (None on CPU): see train()
    peak_memory_bytes: int | None = None
    peak_rss_bytes: int | None = None  # the process's peak resident set size (ru_maxrss)
    num_processes: int = 1
    interrupted: bool = False  # stopped early by SIGTERM/SIGINT (a checkpoint was saved)
    stop_signal: str | None = None
    resumed_from: list[int] = field(default_factory=list)  # checkpoint steps this run resumed at
    replicas_identical: bool | None = None  # multi-process: all ranks ended with equal weights
    # the memory settings in use, e.g. ["gradient_checkpointing", "loss_chunk_tokens=256"]
    memory_options: list[str] = field(default_factory=list)
    # the memory plan (poetxq.training.memory.PlanChoice.to_dict): name, how it was chosen, the
    # keys it set, the predicted peak and the device memory it was planned for
    memory_plan: dict | None = None
    # torch.cuda.max_memory_reserved since the model was built (None on CPU): what the
    # allocator held, the number to compare with a GPU's memory
    peak_reserved_bytes: int | None = None
    cuda_graph: bool = False  # the micro-steps replayed a CUDA graph (train.cuda_graph resolved)
    grad_sync: str = "none"  # "none" (one process), "ddp" or "step" (train.grad_sync resolved)
    precision: str = ""  # "autocast", "bf16-true" or "fp32" (train.precision resolved)


def _diagnostics(
    model: torch.nn.Module, every: int, seed: int
) -> Callable[[], dict[str, float]] | None:
    """With ``every`` > 0 and POET layers in ``model``: a function returning the
    :func:`poetxq.model.diagnostics.summarize_layers` record of every layer now, against the
    layers as they are at this call (the neuron sample drawn from ``seed``); else None."""
    layers = poet_layers(model) if every else []
    if not layers:
        return None
    gen = torch.Generator().manual_seed(seed + 7)
    trackers = [LayerDiagnostics(layer, generator=gen) for layer in layers]
    return lambda: summarize_layers([t.measure() for t in trackers])


def _finite(record: dict) -> dict:
    """``record`` with NaN / inf floats as None, so the JSON is valid (a run stopped before its
    first logged loss has no loss)."""
    return {
        k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()
    }


def peak_rss_bytes() -> int | None:
    """Peak resident set size of this process in bytes (``ru_maxrss``), None where unknown."""
    try:
        import resource
        import sys

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    except (ImportError, OSError):
        return None
    return int(rss) if sys.platform == "darwin" else int(rss) * 1024  # Linux reports KiB


def train(
    recipe: Recipe,
    run_dir: Path,
    *,
    log_with: str | None = None,
    progress: bool = True,
    data: TokenData | None = None,
    echo: Callable[[str], None] = print,
    resume_from: Path | None = None,
    gpu_mem: int | None = None,
) -> TrainResult:
    """Train ``recipe`` and write metrics, the checkpoint and the resolved recipe to ``run_dir``.

    Args:
        recipe: validated recipe.
        run_dir: output directory (created once data and model are ready, so bad input writes
            nothing).
        log_with: accelerate tracker name (e.g. ``"tensorboard"``) or None.
        progress: show tqdm bars.
        data: pre-tokenized data (tests); default: :func:`poetxq.data.prepare_data`.
        echo: where human-readable lines go.
        resume_from: a checkpoint directory (``<run_dir>/checkpoints/step-N``) to continue from;
            its recipe must match ``recipe`` (checked by the caller, see
            :func:`poetxq.training.resume.recipe_differences`).
        gpu_mem: bytes of GPU memory ``train.memory: auto`` plans for (default: the GPU's own;
            :func:`poetxq.training.memory.resolve_memory_plan`).

    Returns:
        :class:`TrainResult` (``interrupted`` is True when a signal stopped the run early).

    Raises:
        poetxq.training.checkpoint.CheckpointError: ``resume_from`` is corrupted or does not fit.
        RunDirError: ``train.cuda_graph`` without CUDA or under DDP, or another process is
            training into ``run_dir`` (:func:`lock_run_dir`).
        DataPrepInterrupted: Ctrl-C while the data was prepared (nothing written).
    """
    cuda = torch.cuda.is_available()
    # train.memory: the plan fitted to this GPU (poetxq.training.memory) decides memory keys,
    # precision included, so it comes before anything reads them; recipe.yaml records its keys
    vocab = data.vocab_size if data is not None else None
    recipe, plan = resolve_memory_plan(
        recipe, "cuda" if cuda else "cpu", gpu_mem=gpu_mem, vocab_size=vocab
    )
    apply_allocator(plan)
    tc, oc, pc = recipe.train, recipe.optim, recipe.poet
    # autocast: accelerate's bf16 mixed precision; bf16-true: bf16 parameters (cast by
    # poetxq.training.build), no autocast; fp32
    precision = run_precision(tc, "cuda" if cuda else "cpu")
    mixed = "bf16" if precision == "autocast" else "no"
    # accelerate keeps one AcceleratorState per process and refuses a second run of another
    # precision (a bf16 run after an fp32 one in a notebook or a test session): start it afresh
    # for each run (the distributed PartialState, set up by the launcher, is kept; an Accelerator
    # object of an earlier run that is still alive reads the new run's settings from then on)
    AcceleratorState._reset_state()
    GradientState._reset_state()
    accelerator = Accelerator(
        cpu=not cuda,  # lets torchrun/accelerate launch run DDP over gloo on CPU-only hosts
        mixed_precision=mixed,
        gradient_accumulation_steps=tc.grad_accum,
        log_with=log_with,
        project_dir=str(run_dir),
        # frozen W0, permutations and int8 codes are buffers kept identical by deterministic
        # updates: never re-broadcast them on every forward
        kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)],
    )
    main = accelerator.is_main_process
    world = accelerator.num_processes
    # --overwrite / --resume: refuse a busy directory before any work (a process training there
    # holds the lock file; where there is none, nothing is created until the run starts writing)
    if main and (run_dir / RUN_LOCK).is_file():
        lock_run_dir(run_dir)
    if tc.cuda_graph is True:
        if not cuda:  # the method is checked by the recipe schema
            raise RunDirError("train.cuda_graph needs a CUDA device; set train.cuda_graph: false")
        if world > 1 and tc.grad_sync == "ddp":
            raise RunDirError(
                "train.cuda_graph with train.grad_sync: ddp cannot work (DDP all-reduces inside "
                "backward, outside the graph); set train.grad_sync: step (or auto)"
            )
    graph = graph_wanted(recipe, accelerator.device, world)
    sync = grad_sync_mode(tc, graph, world)  # "none", "ddp" or "step"
    for key in ("optimizer_in_backward", "offload_optimizer"):  # no all-reduce of their grads
        if world > 1 and getattr(tc, key):
            raise RunDirError(f"train.{key} runs in one process only; set train.{key}: false")
    if sync == "ddp" and tc.loss_chunk_tokens:  # it calls the bare model, past DDP's hooks
        raise RunDirError(
            "train.loss_chunk_tokens cannot run under DDP; set train.grad_sync: step (or auto), "
            "or train.loss_chunk_tokens: 0"
        )
    say = echo if main else (lambda _s: None)
    if cuda or plan.name != "fastest" or gpu_mem is not None:  # on a CPU auto changes nothing
        say(plan.line())
    if note := cpu_note(tc, accelerator.device):  # what a user on a laptop would wonder about
        say(note)
    hint = graph_hint(recipe, accelerator.device, world)  # a graph would serve this run
    if hint:
        say(hint)
    if sync != "none":
        say(
            f"grad sync: {sync} across {world} processes ("
            + ("DistributedDataParallel, all-reduce during backward" if sync == "ddp" else
               "one all-reduce of every gradient per step, after the micro-steps")
            + "; train.grad_sync)"
        )  # fmt: skip
    if resume_from is not None:  # before any work: the global batch and data order depend on it
        check_world_size(Path(resume_from), world)
    for note in recipe.notes:  # what recipe validation adjusted
        say(f"note: {note}")
    set_seed(tc.seed)

    if data is None:
        try:
            with accelerator.main_process_first():  # rank 0 tokenizes and fills the cache first
                data = prepare_data(recipe.data, tc.seq_len, progress=progress and main)
        except KeyboardInterrupt:  # the cache entry is written whole or not at all
            raise DataPrepInterrupted(
                "interrupted during data preparation; nothing was written"
            ) from None
    say(f"data: {data.source_description}")
    say(
        f"  train {data.train.shape[0]:,} x {tc.seq_len + 1} tokens, "
        f"val {data.val.shape[0]:,} windows, vocab {data.vocab_size:,}"
    )
    # the unigram baseline scores exactly the tokens the model predicts (labels of each window)
    unigram = unigram_perplexity(data.train.flatten(), data.val[:, 1:], data.vocab_size)

    poet_gen = torch.Generator().manual_seed(tc.seed + 1)
    is_poet = recipe.method in POET_METHODS
    # CUDA: built on the device (meta init, W0 drawn and quantized there); CPU: as always
    built = build_for_training(
        recipe,
        data.vocab_size,
        accelerator.device,
        generator=poet_gen,
        echo=say,
        cuda_graph=graph,
    )  # --model: pretrained
    model = built.model
    say(built.summary(recipe))
    say(built.build_line())
    if is_poet:
        # HostOffload moves each parameter's states on their own: no flattened groups
        optimizer = build_optimizer(model, oc, flatten=not tc.offload_optimizer)
        relayout_if_wanted(model, optimizer, built.device, say)
    else:
        assert built.baseline is not None
        optimizer = build_baseline_optimizer(model, built.baseline, recipe.baseline, oc)
    scheduler = build_scheduler(optimizer, oc, tc.max_steps)
    if tc.gradient_checkpointing:  # whole decoder layers: keep inputs, recompute in backward
        # offloaded in a graph: to host buffers made once (poetxq.training.lowmem.HostSlots)
        enable_activation_checkpointing(model, offload=tc.offload_activations, graph_safe=graph)

    sharded = ShardedBatches(
        data.train, tc.batch_size, rank=accelerator.process_index, world_size=world,
        seed=tc.seed + 2,
    )  # fmt: skip
    with warnings.catch_warnings():  # torch >= 2.13 renames broadcast_buffers; same meaning
        warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
        if sync == "step":  # no DDP wrapper: autocast and device placement only
            model = accelerator.prepare_model(model, evaluation_mode=True)
            optimizer = accelerator.prepare_optimizer(optimizer)
            broadcast_module(model)  # rank 0's parameters (as DDP's wrap) and buffers
        else:
            model, optimizer = accelerator.prepare(model, optimizer)
    raw_model = accelerator.unwrap_model(model)
    trainable = [p for p in raw_model.parameters() if p.requires_grad]
    raw_optimizer = getattr(optimizer, "optimizer", optimizer)

    def batch_loss(batch: torch.Tensor) -> torch.Tensor:
        if not tc.loss_chunk_tokens:
            return training_loss(model, batch)
        # the chunked loss runs the unwrapped decoder (one process, checked above), outside the
        # autocast accelerate wraps around the model's own forward: enter it here
        with accelerator.autocast():
            return training_loss(raw_model, batch, tc.loss_chunk_tokens)

    # micro-steps (eager or replayed from a CUDA graph captured on the first micro-batch) and
    # the update (host offload, optimizer in backward, int8 weights' float_grad, or plain);
    # train.optimizer_in_backward's hooks now, host offload after a resume loaded the states
    engine = StepEngine(
        model, raw_optimizer, tc, loss_fn=batch_loss, graph=graph, echo=say,
        backward=accelerator.backward,  # divides by gradient_accumulation_steps itself
        clip=accelerator.clip_grad_norm_, stepper=optimizer, offload=False,
    )  # fmt: skip
    device = accelerator.device
    generators = {"poet": poet_gen}

    resumed: dict = {}
    if resume_from is not None:
        meta = load_training_checkpoint(
            resume_from, model=raw_model, optimizer=raw_optimizer, scheduler=scheduler,
            generators=generators,
        )  # fmt: skip
        resumed = meta["loop"]
        say(f"resumed from {resume_from} (step {meta['step']} of {tc.max_steps})")
    if tc.offload_optimizer:  # gradients and states wait in host memory (a resumed optimizer's
        engine.start_offload()  # states go there now); clipping and updates in offload.step()
    if device.type == "cuda":
        # peak_memory_bytes measures training from here on: the built model and optimizer, the
        # steps' activations and optimizer states, evaluations and checkpoint writes; not the
        # transients of building (fp32 W0 drawn before quantization) or of loading a checkpoint
        torch.cuda.reset_peak_memory_stats(device)

    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        lock_run_dir(run_dir)  # before anything below deletes, truncates or appends
        if resume_from is None:  # --overwrite: never leave the previous run's results behind
            for stale in RUN_OUTPUTS:
                (run_dir / stale).unlink(missing_ok=True)
            shutil.rmtree(run_dir / CHECKPOINT_DIR, ignore_errors=True)
        else:
            keep_metrics_until(run_dir / "metrics.jsonl", resumed["step"])
            (run_dir / "summary.json").unlink(missing_ok=True)
        (run_dir / "recipe.yaml").write_text(dump_recipe(recipe), encoding="utf-8")
    accelerator.wait_for_everyone()
    if main and resume_from is None:  # config.json + tokenizer/, for poetxq export
        save_run_artifacts(run_dir, raw_model, data.tokenizer, data.eos_id)
    if log_with:
        accelerator.init_trackers(recipe.name, config=recipe.model_dump(mode="json"))
    metrics_file = (
        (run_dir / "metrics.jsonl").open("a" if resumed else "w", encoding="utf-8")
        if main
        else None
    )

    def log(record: dict) -> None:
        if metrics_file is not None:
            metrics_file.write(json.dumps(_finite(record)) + "\n")  # NaN/inf as null: valid JSON
            metrics_file.flush()
        if log_with:
            accelerator.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def evaluate() -> tuple[float, float]:
        return evaluate_perplexity(
            model, data.val, batch_size=tc.batch_size, device=device,
            max_batches=tc.eval_max_batches,
        )  # fmt: skip

    diagnose = _diagnostics(raw_model, tc.diagnostics_every if is_poet else 0, tc.seed)
    if resumed:
        val_loss0, val_ppl0 = resumed["initial_val_loss"], resumed["initial_val_ppl"]
        log({"step": resumed["step"], "event": "resumed", "checkpoint": str(resume_from)})
    else:
        val_loss0, val_ppl0 = evaluate()
        say(f"step 0: val ppl {val_ppl0:.1f} (unigram baseline on this split: {unigram:.1f})")
        log({"step": 0, "val_loss": val_loss0, "val_ppl": val_ppl0, "unigram_val_ppl": unigram,
             **(diagnose() if diagnose else {})})  # fmt: skip

    tokens_per_step = tc.batch_size * tc.grad_accum * tc.seq_len * world
    start_step = resumed.get("step", 0)
    position = resumed.get("data_position", 0)  # micro-batches this rank has drawn
    batches = sharded.iterate(position)
    steps_since_merge: int | None = resumed.get("steps_since_merge")
    merges = resumed.get("merges", 0)
    loss_value = resumed.get("loss", float("nan"))
    seconds_before = resumed.get("train_seconds", 0.0)
    resumed_from = [*resumed.get("resumed_from", []), start_step] if resumed else []
    window_tokens, window_start = 0, time.perf_counter()
    train_start = time.perf_counter()
    # seconds of evaluations and checkpoint writes: left out of every tokens/s figure
    paused = 0.0

    def checkpoint(step: int) -> None:
        if main:
            save_training_checkpoint(
                run_dir, step, model=raw_model, optimizer=raw_optimizer, scheduler=scheduler,
                generators=generators, recipe_yaml=dump_recipe(recipe), keep_last=tc.keep_last,
                loop_state={
                    "step": step, "merges": merges, "steps_since_merge": steps_since_merge,
                    "data_position": position, "loss": loss_value,
                    "initial_val_loss": val_loss0, "initial_val_ppl": val_ppl0,
                    "train_seconds": seconds_before + time.perf_counter() - train_start,
                    "resumed_from": resumed_from, "num_processes": world,
                },
            )  # fmt: skip
        accelerator.wait_for_everyone()

    bar = tqdm(
        total=tc.max_steps, initial=start_step, desc="train", disable=not (progress and main),
        dynamic_ncols=True,
    )  # fmt: skip
    model.train()
    step = start_step
    zero_grad_noted = False  # the one "gradient norm is 0" note of this run
    drift_noted = False  # the one "past the CNP's accurate range" note of this run
    stop = StopSignals(announce=main)  # SIGTERM/SIGINT: finish the step, save, stop
    # a non-finite loss on any step since the last check (on the device: no sync per step)
    nonfinite = torch.zeros((), dtype=torch.bool, device=device)

    def check_finite(step: int) -> float:
        """The step's loss (mean over ranks); raises DivergedError if it or any loss since the
        last check was NaN/inf. Called before merges, logs, evaluations and every checkpoint."""
        value = accelerator.reduce(loss_sum, "mean").item() / tc.grad_accum
        if not math.isfinite(value) or any_rank(bool(nonfinite.item()), device):
            log({"step": step, "event": "diverged", "loss": value})
            bar.close()
            raise _diverged(value, step, run_dir)
        return value

    for step in stop.guard(range(start_step + 1, tc.max_steps + 1)):
        loss_sum = torch.zeros((), device=device)
        for micro in range(tc.grad_accum):
            batch = next(batches).to(device)
            position += 1
            with accelerator.accumulate(model):
                loss = engine.micro(batch, final=micro == tc.grad_accum - 1)
            loss_sum += loss.detach()
        nonfinite |= ~torch.isfinite(loss_sum)
        # grad_sync step: every gradient averaged once, after the (graphed) micro-steps; DDP
        # averages .grad only, so the int8 weights' float_grad always goes here (no-op in one
        # process)
        to_average = [p.grad for p in trainable if p.grad is not None] if sync == "step" else []
        to_average += [q.float_grad for q in engine.qmods if q.float_grad is not None]
        all_reduce_float_grads(to_average)
        max_norm = clip_threshold(oc.grad_clip, steps_since_merge, oc.clip_rewarm_steps)
        # clip (grad_clip 0: none, the norm is still logged), step, zero the gradients
        grad_norm = engine.update(max_norm)
        scheduler.step()
        if steps_since_merge is not None:
            steps_since_merge += 1
        merging = (
            is_poet
            and not pc.freeze_orthogonal
            and (
                (step % pc.merge_interval == 0 and step < tc.max_steps)
                or (pc.merge_at_end and step == tc.max_steps)
            )
        )
        saving = bool(tc.save_every) and step % tc.save_every == 0 and step < tc.max_steps
        evaluating = bool(tc.eval_every) and step % tc.eval_every == 0 and step < tc.max_steps
        logging = step % tc.log_every == 0 or step == tc.max_steps
        if merging or saving or evaluating or logging:
            loss_value = check_finite(step)  # a NaN model is never merged, evaluated or saved
        if diagnose and step % tc.diagnostics_every == 0:  # before a merge: this period's drift
            t0 = time.perf_counter()
            diag = diagnose()
            log({"step": step, **diag})
            if main and not drift_noted and diag["diag_sigma_drift_w0"] > DRIFT_WARNING:
                drift_noted = True
                bar.write(
                    f"note: at step {step} the weights' singular values moved "
                    f"{diag['diag_sigma_drift_w0']:.3f} (rotations {diag['diag_orth_error']:.3f} "
                    "from orthogonal): the Cayley-Neumann series is past its accurate range; "
                    "lower optim.poet_lr or poet.merge_interval, or raise poet.neumann_terms"
                )
            window_start += time.perf_counter() - t0
            paused += time.perf_counter() - t0
        if merging:
            errors: list[float] | None = [] if diagnose else None
            merge_and_reset(raw_model, raw_optimizer, poet_gen, requant_errors=errors)
            if errors:  # the worst layer's W0 re-quantization error at this merge
                log({"step": step, REQUANT_KEY: max(errors)})
            merges += 1
            steps_since_merge = 0
            if world > 1 and not replicas_identical(raw_model):
                raise RuntimeError(f"ranks hold different weights after the merge at step {step}")

        window_tokens += tokens_per_step
        bar.update(1)
        if logging:
            now = time.perf_counter()
            tps = window_tokens / max(now - window_start, 1e-9)
            window_tokens, window_start = 0, now
            lrs = {g.get("name", str(i)): g["lr"] for i, g in enumerate(raw_optimizer.param_groups)}
            record = {"step": step, "loss": loss_value, "lr": scheduler.get_last_lr()[-1]}
            if lrs.get("poet") is not None:  # a POET method's orthogonal group (not a baseline)
                record["poet_lr"] = lrs["poet"]
            log({**record, "grad_norm": float(grad_norm), "clip": max_norm,
                 "tokens": step * tokens_per_step, "tokens_per_s": tps})  # fmt: skip
            if main and not zero_grad_noted and float(grad_norm) == 0.0:
                zero_grad_noted = True  # once: e.g. a learning rate that saturated the model
                bar.write(
                    f"note: gradient norm is 0 at step {step} (loss {loss_value:.4f}): the model "
                    "has stopped learning; a learning rate far too high can saturate it (lower "
                    "optim.lr / poet_lr)"
                )
            post = {"loss": f"{loss_value:.3f}", "lr": f"{scheduler.get_last_lr()[-1]:.2e}"}
            if lrs.get("poet") is not None:  # as in metrics.jsonl: lr, then poet_lr
                post["poet_lr"] = f"{lrs['poet']:.2e}"
            bar.set_postfix(**post, tok_s=f"{tps:,.0f}")
        if evaluating:
            t0 = time.perf_counter()
            val_loss, val_ppl = evaluate()
            log({"step": step, "loss": loss_value, "val_loss": val_loss, "val_ppl": val_ppl})
            if main:
                bar.write(f"step {step}: loss {loss_value:.3f}, val ppl {val_ppl:.1f}")
            window_start += time.perf_counter() - t0
            paused += time.perf_counter() - t0
        if any_rank(stop.received is not None, device):  # every rank stops at the same step
            loss_value = check_finite(step)  # the interrupt checkpoint must not hold NaNs
            break
        if saving:
            t0 = time.perf_counter()
            checkpoint(step)
            window_start += time.perf_counter() - t0
            paused += time.perf_counter() - t0
    bar.close()

    def finish() -> TrainResult:
        """Final checkpoint, evaluation, model file and summary."""
        interrupted = step < tc.max_steps
        train_seconds = seconds_before + time.perf_counter() - train_start
        # at the end, and always on SIGTERM/SIGINT; not again for a resume that trained no
        # step (a run that only needed its final model written: the checkpoint is there)
        if (tc.save_checkpoint or interrupted) and not (resumed and step == start_step):
            checkpoint(step)
        same = replicas_identical(raw_model) if world > 1 else None
        # this session's training steps only: evaluations and checkpoint writes left out
        this_session = max(train_seconds - seconds_before - paused, 1e-9)
        tokens_per_s = (step - start_step) * tokens_per_step / this_session

        if interrupted:
            sig = stop.received.name if stop.received is not None else "signal"
            log({"step": step, "event": "interrupted", "signal": sig})
            # the caller says how to continue (poetxq.tools.cli: one line)
            val_loss = val_ppl = None
        else:
            sig = None
            val_loss, val_ppl = evaluate()
            log({"step": step, "loss": loss_value, "val_loss": val_loss, "val_ppl": val_ppl})
        result = TrainResult(
            run_dir=str(run_dir),
            steps=step,
            tokens=step * tokens_per_step,
            initial_val_ppl=val_ppl0,
            final_val_ppl=val_ppl,  # type: ignore[arg-type]  # None when interrupted
            unigram_val_ppl=unigram,
            final_train_loss=loss_value,
            tokens_per_s=tokens_per_s,
            train_seconds=train_seconds,
            merges=merges,
            device=str(device)
            + {"autocast": " bf16", "bf16-true": " bf16-true"}.get(precision, " fp32"),
            method=method_label(recipe),
            precision=precision,
            peak_memory_bytes=(
                torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
            ),
            peak_rss_bytes=peak_rss_bytes(),
            num_processes=world,
            interrupted=interrupted,
            stop_signal=sig,
            resumed_from=resumed_from,
            replicas_identical=same,
            memory_options=tc.memory_options(),
            memory_plan=plan.to_dict(),
            peak_reserved_bytes=(
                torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None
            ),
            cuda_graph=engine.graph,
            grad_sync=sync,
        )
        if main:
            if tc.save_checkpoint and not interrupted:
                save_checkpoint(raw_model, run_dir / "model.safetensors")
            (run_dir / "summary.json").write_text(
                json.dumps(_finite(asdict(result)), indent=2), encoding="utf-8"
            )
            metrics_file.close()
            unlock_run_dir(run_dir)
        accelerator.end_training()
        if not interrupted:
            since = " since the resume" if resumed_from else ""  # tokens/s of this session
            merged = f", {count(merges, 'merge')}" if is_poet else ""
            say(
                f"done: {step} steps, {result.tokens:,} tokens in {train_seconds:.0f} s "
                f"({result.tokens_per_s:,.0f} tok/s{since}){merged}; val ppl {val_ppl0:.1f} -> "
                f"{val_ppl:.2f} (unigram {unigram:.1f}); run dir {run_dir}"
            )
        return result

    with stop:  # a SIGTERM/SIGINT from here on waits until the outputs are written
        return finish()
