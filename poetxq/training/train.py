# Over 500 lines: train() runs the phases of one _Run (set-up, loop, finish; none over ~50 lines)
# that share its state; they stay in this module, whose names (training_loss, prepare_data, ...)
# the tests patch.
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
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import DistributedDataParallelKwargs, set_seed
from tqdm.auto import tqdm

from poetxq.data import TokenData, check_data, prepare_data, unigram_perplexity
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
from poetxq.training.baseline_methods import MATRIX_GROUPS, build_baseline_optimizer
from poetxq.training.build import build_for_training
from poetxq.training.checkpoint import (
    CHECKPOINT_DIR,
    check_world_size,
    load_training_checkpoint,
    save_training_checkpoint,
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
from poetxq.training.memory import apply_allocator
from poetxq.training.optim import (
    build_optimizer,
    build_scheduler,
    clip_threshold,
    merge_and_reset,
)
from poetxq.training.plan import RunPlan, resolve_plan
from poetxq.training.recipe import POET_METHODS, Recipe, dump_recipe, method_label
from poetxq.training.rundir import (
    RUN_OUTPUTS,
    RunDirError,
    keep_metrics_until,
    lock_run_dir,
    save_checkpoint,
    save_run_artifacts,
    unlock_run_dir,
    write_plan,
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
    tokens_per_s: float  # all sessions' steps over their stepping seconds: evals, saves left out
    train_seconds: float  # wall seconds of the training loop over all sessions, evals included
    merges: int
    device: str
    method: str = ""  # label: poetxq, poetxq4, poetx or the baseline's name
    # torch.cuda.max_memory_allocated since the model was built, the largest over the run's
    # sessions (None on CPU): see train()
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
    # torch.cuda.max_memory_reserved since the model was built, the largest over the run's
    # sessions (None on CPU): what the allocator held, the number to compare with a GPU's memory
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


def _loss_fn(
    model: torch.nn.Module, raw_model: torch.nn.Module, accelerator: Accelerator, tc: Any
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The step engine's ``loss_fn``: a micro-batch's mean next-token loss through ``model``, or
    the chunked loss (``train.loss_chunk_tokens``) through the unwrapped ``raw_model``. A
    closure over these, not a method of :class:`_Run`: the engine holds it, and a reference
    back to the run would keep the model alive past :func:`train` until a garbage collection."""

    def batch_loss(batch: torch.Tensor) -> torch.Tensor:
        if not tc.loss_chunk_tokens:
            return training_loss(model, batch)
        # the chunked loss runs the unwrapped decoder (one process, checked by _Run._refuse),
        # outside the autocast accelerate wraps around the model's own forward: enter it here
        with accelerator.autocast():
            return training_loss(raw_model, batch, tc.loss_chunk_tokens)

    return batch_loss


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
        poetxq.data.DataError: bad data input; the checks that read no text
            (:func:`poetxq.data.check_data`) come before anything is printed.
        poetxq.training.checkpoint.CheckpointError: ``resume_from`` is corrupted or does not fit.
        RunDirError: ``train.cuda_graph`` without CUDA or under DDP, or another process is
            training into ``run_dir`` (:func:`lock_run_dir`).
        DataPrepInterrupted: Ctrl-C while the data was prepared (nothing written).
    """
    if data is None:  # a missing, unsupported or empty data path: its one error line before
        check_data(recipe.data, recipe.train.seq_len)  # the plan's and the recipe's notes
    run = _Run(run_dir, log_with=log_with, progress=progress, echo=echo, resume_from=resume_from)
    vocab = data.vocab_size if data is not None else None
    run.start_accelerator(recipe, gpu_mem, vocab)  # memory plan, precision, refusals
    run.load_data(data)
    run.build()  # model, optimizer, scheduler, the step engine
    run.restore()  # resume_from's checkpoint, if any
    run.open_run_dir()  # nothing was written before this
    run.begin()  # step 0's evaluation (or the resume's record), the loop's state
    run.loop()  # returns at max_steps or at the step a signal arrived
    with run.stop:  # a SIGTERM/SIGINT from here on waits until the outputs are written
        return run.finish()


class _Run:
    """One call of :func:`train`: its settings, what it built and the loop's state, shared by its
    phases, which :func:`train` calls in order (each method says what it sets up).

    The loop's counters (``step``, ``position``, ``merges``, ``steps_since_merge``,
    ``loss_value``, ``paused``, ...) are attributes, so that a checkpoint written at any point
    (:meth:`checkpoint`) and the summary (:meth:`finish`) read their current values.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        log_with: str | None,
        progress: bool,
        echo: Callable[[str], None],
        resume_from: Path | None,
    ) -> None:
        self.run_dir, self.log_with, self.progress = run_dir, log_with, progress
        self.echo, self.resume_from = echo, resume_from

    # -- set-up: nothing below writes to the run directory before open_run_dir -----------------

    def start_accelerator(self, recipe: Recipe, gpu_mem: int | None, vocab: int | None) -> None:
        """The memory plan, the precision and the Accelerator; refuses settings this launch
        cannot run (:meth:`_refuse`) and says what the run will do (:meth:`_announce`)."""
        cuda = torch.cuda.is_available()
        # the run plan (poetxq.training.plan): the memory plan fitted to this GPU decides memory
        # keys, precision included, so it comes before anything reads them; recipe.yaml records
        # its keys, plan.json every decision
        self.run_plan = resolve_plan(
            recipe, "cuda" if cuda else "cpu", gpu_memory_limit=gpu_mem, vocab_size=vocab
        )
        self._take_plan(self.run_plan)
        apply_allocator(self.plan)
        tc = self.tc
        # autocast: accelerate's bf16 mixed precision; bf16-true: bf16 parameters (cast by
        # poetxq.training.build), no autocast; fp32
        mixed = "bf16" if self.precision == "autocast" else "no"
        # accelerate keeps one AcceleratorState per process and refuses a second run of another
        # precision (a bf16 run after an fp32 one in a notebook or a test session): start it
        # afresh for each run (the distributed PartialState, set up by the launcher, is kept; an
        # Accelerator object of an earlier run that is still alive reads the new run's settings
        # from then on)
        AcceleratorState._reset_state()
        GradientState._reset_state()
        self.accelerator = Accelerator(
            cpu=not cuda,  # lets torchrun/accelerate launch run DDP over gloo on CPU-only hosts
            mixed_precision=mixed,
            gradient_accumulation_steps=tc.grad_accum,
            log_with=self.log_with,
            project_dir=str(self.run_dir),
            # frozen W0, permutations and int8 codes are buffers kept identical by deterministic
            # updates: never re-broadcast them on every forward
            kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)],
        )
        self.main = self.accelerator.is_main_process
        self.world = self.accelerator.num_processes
        self.device = self.accelerator.device
        if self.world != self.run_plan.world_size:  # the launcher's count, not $WORLD_SIZE's
            self.run_plan = resolve_plan(
                recipe, "cuda" if cuda else "cpu", self.world, gpu_mem, vocab_size=vocab
            )
            self._take_plan(self.run_plan)
        self._refuse()
        self.say: Callable[[str], None] = self.echo if self.main else (lambda _s: None)
        self._announce()

    def _take_plan(self, plan: RunPlan) -> None:
        """The run's settings from ``plan``: the recipe that runs and its sections, the memory
        plan (``plan``), precision, ``graph`` (the micro-steps replay a CUDA graph) and
        ``sync`` (``"none"``, ``"ddp"`` or ``"step"``)."""
        self.recipe, self.plan = plan.recipe, plan.memory
        self.tc, self.oc, self.pc = plan.recipe.train, plan.recipe.optim, plan.recipe.poet
        self.precision, self.graph, self.sync = plan.precision, plan.cuda_graph, plan.grad_sync

    def _refuse(self) -> None:
        """Raise RunDirError for a busy run directory or the first setting this launch cannot
        run (:attr:`RunPlan.refusals <poetxq.training.plan.RunPlan.refusals>`)."""
        run_dir = self.run_dir
        # --overwrite / --resume: refuse a busy directory before any work (a process training
        # there holds the lock file; where there is none, nothing is created until the run starts
        # writing)
        if self.main and (run_dir / RUN_LOCK).is_file():
            lock_run_dir(run_dir)
        if self.run_plan.refusals:
            raise RunDirError(self.run_plan.refusals[0])

    def _announce(self) -> None:
        """The plan's lines (memory plan, CPU bf16 warning, CUDA graph hint, grad sync) and the
        recipe's notes; refuses a ``resume_from`` saved by another number of processes."""
        say, world = self.say, self.world
        for line in self.run_plan.notes:
            say(line)
        if self.resume_from is not None:  # before any work: the global batch and data order
            check_world_size(Path(self.resume_from), world)  # depend on it
        for note in self.recipe.notes:  # what recipe validation adjusted
            say(f"note: {note}")

    def load_data(self, data: TokenData | None) -> None:
        """Seed everything, then ``data`` (prepared here when None) and the unigram baseline."""
        tc, say = self.tc, self.say
        set_seed(tc.seed)
        if data is None:
            try:
                # rank 0 tokenizes and fills the cache first
                with self.accelerator.main_process_first():
                    data = prepare_data(
                        self.recipe.data, tc.seq_len, progress=self.progress and self.main
                    )
            except KeyboardInterrupt:  # the cache entry is written whole or not at all
                raise DataPrepInterrupted(
                    "interrupted during data preparation; nothing was written"
                ) from None
        self.data = data
        say(f"data: {data.source_description}")
        say(
            f"  train {data.train.shape[0]:,} x {tc.seq_len + 1} tokens, "
            f"val {data.val.shape[0]:,} windows, vocab {data.vocab_size:,}"
        )
        # the unigram baseline scores exactly the tokens the model predicts (labels of each window)
        self.unigram = unigram_perplexity(data.train.flatten(), data.val[:, 1:], data.vocab_size)

    def build(self) -> None:
        """The model, its optimizer and schedule, the data shards, accelerate's wrappers and the
        step engine."""
        recipe, tc, oc, say = self.recipe, self.tc, self.oc, self.say
        self.poet_gen = poet_gen = torch.Generator().manual_seed(tc.seed + 1)
        self.is_poet = recipe.method in POET_METHODS
        # CUDA: built on the device (meta init, W0 drawn and quantized there); CPU: as always
        built = build_for_training(
            recipe,
            self.data.vocab_size,
            self.device,
            generator=poet_gen,
            echo=say,
            plan=self.run_plan,
            progress=self.progress and self.main,  # --no-progress: no "Loading weights" bar
        )  # --model: pretrained
        model = built.model
        say(built.summary(recipe))
        say(built.build_line())
        if self.is_poet:
            # HostOffload moves each parameter's states on their own: no flattened groups
            optimizer = build_optimizer(model, oc, flatten=not tc.offload_optimizer)
            if self.run_plan.relayout:
                relayout_if_wanted(model, optimizer, built.device, say)
        else:
            assert built.baseline is not None
            optimizer = build_baseline_optimizer(model, built.baseline, recipe.baseline, oc)
        self.scheduler = build_scheduler(optimizer, oc, tc.max_steps)
        if tc.gradient_checkpointing:  # whole decoder layers: keep inputs, recompute in backward
            # offloaded in a graph: to host buffers made once (poetxq.training.lowmem.HostSlots)
            enable_activation_checkpointing(
                model, offload=tc.offload_activations, graph_safe=self.graph
            )
        self.sharded = ShardedBatches(
            self.data.train, tc.batch_size, rank=self.accelerator.process_index,
            world_size=self.world, seed=tc.seed + 2,
        )  # fmt: skip
        self._prepare(model, optimizer)
        self.generators = {"poet": poet_gen}

    def _prepare(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """accelerate's wrappers of ``model`` and ``optimizer`` (none for ``grad_sync: step``),
        their unwrapped selves and the step engine over them."""
        accelerator = self.accelerator
        with warnings.catch_warnings():  # torch >= 2.13 renames broadcast_buffers; same meaning
            warnings.filterwarnings(
                "ignore", message=".*broadcast_buffers.*", category=FutureWarning
            )
            if self.sync == "step":  # no DDP wrapper: autocast and device placement only
                model = accelerator.prepare_model(model, evaluation_mode=True)
                optimizer = accelerator.prepare_optimizer(optimizer)
                broadcast_module(model)  # rank 0's parameters (as DDP's wrap) and buffers
            else:
                model, optimizer = accelerator.prepare(model, optimizer)
        self.model, self.optimizer = model, optimizer
        self.raw_model = accelerator.unwrap_model(model)
        self.trainable = [p for p in self.raw_model.parameters() if p.requires_grad]
        self.raw_optimizer = getattr(optimizer, "optimizer", optimizer)
        # micro-steps (eager or replayed from a CUDA graph captured on the first micro-batch) and
        # the update (host offload, optimizer in backward, int8 weights' float_grad, or plain);
        # train.optimizer_in_backward's hooks now, host offload after a resume loaded the states
        self.engine = StepEngine(
            model, self.raw_optimizer, self.tc, graph=self.graph,
            loss_fn=_loss_fn(model, self.raw_model, accelerator, self.tc),
            echo=self.say,
            backward=accelerator.backward,  # divides by gradient_accumulation_steps itself
            clip=accelerator.clip_grad_norm_, stepper=optimizer, offload=False,
        )  # fmt: skip

    def restore(self) -> None:
        """Take the diagnostics' reference, load ``resume_from`` (``resumed``: its loop state,
        empty for a fresh run), start host offload and the peak-memory count."""
        self.resumed: dict = {}
        # the diagnostics' reference (spectrum, neuron sample and directions) is the model as
        # built, before any step: a fresh run's step 0, and what a resumed run rebuilds from
        # the same seed before its checkpoint loads, so the records go on as if never stopped
        tc = self.tc
        self.diagnose = _diagnostics(
            self.raw_model, tc.diagnostics_every if self.is_poet else 0, tc.seed
        )
        if self.resume_from is not None:
            meta = load_training_checkpoint(
                self.resume_from, model=self.raw_model, optimizer=self.raw_optimizer,
                scheduler=self.scheduler, generators=self.generators,
            )  # fmt: skip
            self.resumed = meta["loop"]
            self._keep_plan_origin(self.resumed.get("memory_plan"))
            self.say(
                f"resumed from {self.resume_from} (step {meta['step']} of {self.tc.max_steps})"
            )
        # gradients and states wait in host memory (a resumed optimizer's states go there now);
        # clipping and updates in offload.step()
        if self.tc.offload_optimizer:
            self.engine.start_offload()
        if self.device.type == "cuda":
            # peak_memory_bytes measures training from here on: the built model and optimizer,
            # the steps' activations and optimizer states, evaluations and checkpoint writes; not
            # the transients of building (fp32 W0 drawn before quantization) or of loading a
            # checkpoint
            torch.cuda.reset_peak_memory_stats(self.device)

    def _keep_plan_origin(self, first: Any) -> None:
        """A resumed run's recipe names the plan its first session took (``train.memory:
        fastest``): where ``auto`` chose it and the resume keeps it, the summary says so."""
        if not isinstance(first, dict) or self.plan.chosen_by != "train.memory":
            return
        by = first.get("chosen_by")
        if first.get("name") == self.plan.name and isinstance(by, str) and by.startswith("auto"):
            self.plan.chosen_by = by

    def open_run_dir(self) -> None:
        """Lock the run directory and clear it (a fresh run) or cut its metrics back to the
        checkpoint (a resume); write recipe.yaml and the export artifacts; open metrics.jsonl."""
        run_dir, main, resumed = self.run_dir, self.main, self.resumed
        if main:
            run_dir.mkdir(parents=True, exist_ok=True)
            lock_run_dir(run_dir)  # before anything below deletes, truncates or appends
            if self.resume_from is None:  # --overwrite: never leave the previous run's results
                for stale in RUN_OUTPUTS:
                    (run_dir / stale).unlink(missing_ok=True)
                shutil.rmtree(run_dir / CHECKPOINT_DIR, ignore_errors=True)
            else:
                keep_metrics_until(run_dir / "metrics.jsonl", resumed["step"])
                (run_dir / "summary.json").unlink(missing_ok=True)
            (run_dir / "recipe.yaml").write_text(dump_recipe(self.recipe), encoding="utf-8")
            write_plan(run_dir, self.run_plan)  # plan.json: every decision the run took
        self.accelerator.wait_for_everyone()
        if main and self.resume_from is None:  # config.json + tokenizer/, for poetxq export
            save_run_artifacts(run_dir, self.raw_model, self.data.tokenizer, self.data.eos_id)
        if self.log_with:
            self.accelerator.init_trackers(
                self.recipe.name, config=self.recipe.model_dump(mode="json")
            )
        self.metrics_file = (
            (run_dir / "metrics.jsonl").open("a" if resumed else "w", encoding="utf-8")
            if main
            else None
        )

    # -- records, evaluations, checkpoints ------------------------------------------------------

    def log(self, record: dict) -> None:
        """One line of metrics.jsonl (rank 0) and the trackers' record."""
        if self.metrics_file is not None:
            # NaN/inf as null: valid JSON
            self.metrics_file.write(json.dumps(_finite(record)) + "\n")
            self.metrics_file.flush()
        if self.log_with:
            self.accelerator.log(
                {k: v for k, v in record.items() if k != "step"}, step=record["step"]
            )

    def evaluate(self) -> tuple[float, float]:
        """Validation loss and perplexity of the model now."""
        return evaluate_perplexity(
            self.model, self.data.val, batch_size=self.tc.batch_size, device=self.device,
            max_batches=self.tc.eval_max_batches,
        )  # fmt: skip

    def checkpoint(self, step: int) -> None:
        """Rank 0 writes the training checkpoint of ``step`` with the loop's state; all wait."""
        if self.main:
            carried = self._carried(step)  # first: the recipe's YAML below takes milliseconds
            save_training_checkpoint(
                self.run_dir, step, model=self.raw_model, optimizer=self.raw_optimizer,
                scheduler=self.scheduler, generators=self.generators,
                recipe_yaml=dump_recipe(self.recipe), keep_last=self.tc.keep_last,
                loop_state={
                    "step": step, "merges": self.merges,
                    "steps_since_merge": self.steps_since_merge,
                    "data_position": self.position, "loss": self.loss_value,
                    "initial_val_loss": self.val_loss0, "initial_val_ppl": self.val_ppl0,
                    "train_seconds": self.seconds_before + time.perf_counter() - self.train_start,
                    "resumed_from": self.resumed_from, "num_processes": self.world,
                    # how the run's first session chose its plan (a resume reads it by name)
                    "memory_plan": {"name": self.plan.name, "chosen_by": self.plan.chosen_by},
                    **carried,
                },
            )  # fmt: skip
        self.accelerator.wait_for_everyone()

    def _carried(self, step: int) -> dict[str, Any]:
        """What the next session adds its own to: the steps trained so far and their stepping
        seconds (evaluations and saves left out), and the largest CUDA peaks (None on CPU)."""
        alloc, reserved = self._peaks()
        return {
            "timed_steps": self.timed_before[0] + step - self.start_step,
            "step_seconds": self.timed_before[1] + self._session_step_seconds(),
            "peak_memory_bytes": alloc, "peak_reserved_bytes": reserved,
        }  # fmt: skip

    def _session_step_seconds(self) -> float:
        """This session's seconds in training steps: evaluations and checkpoint writes left out."""
        return max(time.perf_counter() - self.train_start - self.paused, 1e-9)

    def _peaks(self) -> tuple[int | None, int | None]:
        """CUDA allocated and reserved peaks (bytes) since the model was built, the largest of
        this session's and the earlier sessions' (a checkpoint carries them); None on CPU."""
        if self.device.type != "cuda":
            return None, None
        now = (
            torch.cuda.max_memory_allocated(self.device),
            torch.cuda.max_memory_reserved(self.device),
        )
        return tuple(max(a, b or 0) for a, b in zip(now, self.peaks_before))  # type: ignore[return-value]

    def _unpause(self, t0: float) -> None:
        """Leave the seconds since ``t0`` (an evaluation, a checkpoint write) out of tokens/s."""
        self.window_start += time.perf_counter() - t0
        self.paused += time.perf_counter() - t0

    # -- the loop --------------------------------------------------------------------------------

    def begin(self) -> None:
        """Step 0's evaluation (a fresh run) or the resume's record, then the loop's state, the
        progress bar and the signal handler (``stop``)."""
        tc, resumed = self.tc, self.resumed
        if resumed:
            self.val_loss0, self.val_ppl0 = resumed["initial_val_loss"], resumed["initial_val_ppl"]
            self.log({"step": resumed["step"], "event": "resumed",
                      "checkpoint": str(self.resume_from)})  # fmt: skip
        else:
            self.val_loss0, self.val_ppl0 = self.evaluate()
            self.say(
                f"step 0: val ppl {self.val_ppl0:.1f} "
                f"(unigram baseline on this split: {self.unigram:.1f})"
            )
            self.log({"step": 0, "val_loss": self.val_loss0, "val_ppl": self.val_ppl0,
                      "unigram_val_ppl": self.unigram,
                      **(self.diagnose() if self.diagnose else {})})  # fmt: skip

        self.tokens_per_step = tc.batch_size * tc.grad_accum * tc.seq_len * self.world
        self.start_step = resumed.get("step", 0)
        self.position = resumed.get("data_position", 0)  # micro-batches this rank has drawn
        self.batches = self.sharded.iterate(self.position)
        self.steps_since_merge: int | None = resumed.get("steps_since_merge")
        self.merges = resumed.get("merges", 0)
        self.loss_value = resumed.get("loss", float("nan"))
        self.seconds_before = resumed.get("train_seconds", 0.0)
        # earlier sessions' steps and stepping seconds, and CUDA peaks; a checkpoint written
        # before they were carried has none: this run's tokens/s then covers this session only
        self.timed_before = (resumed.get("timed_steps", 0), resumed.get("step_seconds", 0.0))
        self.peaks_before = (resumed.get("peak_memory_bytes"), resumed.get("peak_reserved_bytes"))
        self.resumed_from = [*resumed.get("resumed_from", []), self.start_step] if resumed else []
        self.window_tokens, self.window_start = 0, time.perf_counter()
        self.train_start = time.perf_counter()
        # seconds of evaluations and checkpoint writes: left out of every tokens/s figure
        self.paused = 0.0

        self.bar = tqdm(
            total=tc.max_steps, initial=self.start_step, desc="train",
            disable=not (self.progress and self.main), dynamic_ncols=True,
        )  # fmt: skip
        self.model.train()
        self.step = self.start_step
        self.zero_grad_noted = False  # the one "gradient norm is 0" note of this run
        self.drift_noted = False  # the one "past the CNP's accurate range" note of this run
        self.stop = StopSignals(announce=self.main)  # SIGTERM/SIGINT: finish the step, save, stop
        # a non-finite loss on any step since the last check (on the device: no sync per step)
        self.nonfinite = torch.zeros((), dtype=torch.bool, device=self.device)

    def loop(self) -> None:
        """The steps up to ``train.max_steps``, each followed by what is due at it (diagnostics,
        merge, log line, evaluation, checkpoint); stops after the step a signal arrived in."""
        tc, pc = self.tc, self.pc
        for step in self.stop.guard(range(self.start_step + 1, tc.max_steps + 1)):
            self.step = step
            grad_norm, max_norm = self._train_step()
            merging = (
                self.is_poet
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
                # a NaN model is never merged, evaluated or saved
                self.loss_value = self._check_finite(step)
            if self.diagnose and step % tc.diagnostics_every == 0:  # before a merge: the drift
                self._log_diagnostics(step)  # of this period
            if merging:
                self._merge(step)

            self.window_tokens += self.tokens_per_step
            self.bar.update(1)
            if logging:
                self._log_step(step, grad_norm, max_norm)
            if evaluating:
                t0 = time.perf_counter()
                val_loss, val_ppl = self.evaluate()
                self.log({"step": step, "loss": self.loss_value, "val_loss": val_loss,
                          "val_ppl": val_ppl})  # fmt: skip
                if self.main:
                    self.bar.write(
                        f"step {step}: loss {self.loss_value:.3f}, val ppl {val_ppl:.1f}"
                    )
                self._unpause(t0)
            if any_rank(self.stop.received is not None, self.device):  # all stop at the same step
                self.loss_value = self._check_finite(step)  # the interrupt checkpoint: no NaNs
                break
            if saving:
                t0 = time.perf_counter()
                self.checkpoint(step)
                self._unpause(t0)
        self.bar.close()

    def _train_step(self) -> tuple[torch.Tensor | float, float]:
        """One optimizer step: the micro-batches, the gradients averaged over ranks, the clipped
        update and the schedule; returns the gradient norm and the clip threshold used."""
        tc, device, engine = self.tc, self.device, self.engine
        self.loss_sum = torch.zeros((), device=device)
        for micro in range(tc.grad_accum):
            batch = next(self.batches).to(device)
            self.position += 1
            with self.accelerator.accumulate(self.model):
                loss = engine.micro(batch, final=micro == tc.grad_accum - 1)
            self.loss_sum += loss.detach()
        self.nonfinite |= ~torch.isfinite(self.loss_sum)
        # grad_sync step: every gradient averaged once, after the (graphed) micro-steps; DDP
        # averages .grad only, so the int8 weights' float_grad always goes here (no-op in one
        # process)
        to_average = (
            [p.grad for p in self.trainable if p.grad is not None] if self.sync == "step" else []
        )
        to_average += [q.float_grad for q in engine.qmods if q.float_grad is not None]
        all_reduce_float_grads(to_average)
        oc = self.oc
        max_norm = clip_threshold(oc.grad_clip, self.steps_since_merge, oc.clip_rewarm_steps)
        # clip (grad_clip 0: none, the norm is still logged), step, zero the gradients
        grad_norm = engine.update(max_norm)
        self.scheduler.step()
        if self.steps_since_merge is not None:
            self.steps_since_merge += 1
        return grad_norm, max_norm

    def _check_finite(self, step: int) -> float:
        """The step's loss (mean over ranks); raises DivergedError if it or any loss since the
        last check was NaN/inf. Called before merges, logs, evaluations and every checkpoint."""
        value = self.accelerator.reduce(self.loss_sum, "mean").item() / self.tc.grad_accum
        if not math.isfinite(value) or any_rank(bool(self.nonfinite.item()), self.device):
            self.log({"step": step, "event": "diverged", "loss": value})
            self.bar.close()
            raise _diverged(value, step, self.run_dir)
        return value

    def _log_diagnostics(self, step: int) -> None:
        """The layers' diagnostics record; notes (once) a drift past the CNP's accurate range."""
        t0 = time.perf_counter()
        assert self.diagnose is not None
        diag = self.diagnose()
        self.log({"step": step, **diag})
        if self.main and not self.drift_noted and diag["diag_sigma_drift_w0"] > DRIFT_WARNING:
            self.drift_noted = True
            self.bar.write(
                f"note: at step {step} the weights' singular values moved "
                f"{diag['diag_sigma_drift_w0']:.3f} (rotations {diag['diag_orth_error']:.3f} "
                "from orthogonal): the Cayley-Neumann series is past its accurate range; "
                "lower optim.poet_lr or poet.merge_interval, or raise poet.neumann_terms"
            )
        self._unpause(t0)

    def _merge(self, step: int) -> None:
        """Merge and re-initialize every POET layer, reset the Adam moments of ``Q``."""
        errors: list[float] | None = [] if self.diagnose else None
        merge_and_reset(self.raw_model, self.raw_optimizer, self.poet_gen, requant_errors=errors)
        if errors:  # the worst layer's W0 re-quantization error at this merge
            self.log({"step": step, REQUANT_KEY: max(errors)})
        self.merges += 1
        self.steps_since_merge = 0
        if self.world > 1 and not replicas_identical(self.raw_model):
            raise RuntimeError(f"ranks hold different weights after the merge at step {step}")

    def _log_step(self, step: int, grad_norm: torch.Tensor | float, max_norm: float) -> None:
        """The step's metrics record (loss, learning rates, gradient norm, tokens/s since the
        last one) and the progress bar's; notes (once) a gradient norm of 0."""
        now = time.perf_counter()
        tps = self.window_tokens / max(now - self.window_start, 1e-9)
        self.window_tokens, self.window_start = 0, now
        groups = self.raw_optimizer.param_groups
        lrs = {g.get("name", str(i)): g["lr"] for i, g in enumerate(groups)}
        lr = self.scheduler.get_last_lr()[-1]
        record = {"step": step, "loss": self.loss_value, "lr": lr}
        if lrs.get("poet") is not None:  # a POET method's orthogonal group (not a baseline)
            record["poet_lr"] = lrs["poet"]
        for name in MATRIX_GROUPS:  # a baseline's hidden matrices (optim.matrix_lr)
            if name in lrs:
                record["matrix_lr"] = lrs[name]
        self.log({**record, "grad_norm": float(grad_norm), "clip": max_norm,
                  "tokens": step * self.tokens_per_step, "tokens_per_s": tps})  # fmt: skip
        if self.main and not self.zero_grad_noted and float(grad_norm) == 0.0:
            self.zero_grad_noted = True  # once: e.g. a learning rate that saturated the model
            self.bar.write(
                f"note: gradient norm is 0 at step {step} (loss {self.loss_value:.4f}): the model "
                "has stopped learning; a learning rate far too high can saturate it (lower "
                "optim.lr / poet_lr)"
            )
        post = {"loss": f"{self.loss_value:.3f}", "lr": f"{self.scheduler.get_last_lr()[-1]:.2e}"}
        if lrs.get("poet") is not None:  # as in metrics.jsonl: lr, then poet_lr
            post["poet_lr"] = f"{lrs['poet']:.2e}"
        self.bar.set_postfix(**post, tok_s=f"{tps:,.0f}")

    # -- the end ---------------------------------------------------------------------------------

    def finish(self) -> TrainResult:
        """Final checkpoint, evaluation, model file and summary."""
        tc, step, main, run_dir = self.tc, self.step, self.main, self.run_dir
        interrupted = step < tc.max_steps
        train_seconds = self.seconds_before + time.perf_counter() - self.train_start
        # every session's training steps: evaluations and checkpoint writes left out (a resume
        # that only evaluates and writes the final model keeps the earlier sessions' rate)
        timed = self.timed_before[0] + step - self.start_step
        seconds = self.timed_before[1] + self._session_step_seconds()
        tokens_per_s = timed * self.tokens_per_step / seconds if timed else 0.0
        # at the end, and always on SIGTERM/SIGINT; not again for a resume that trained no
        # step (a run that only needed its final model written: the checkpoint is there)
        if (tc.save_checkpoint or interrupted) and not (self.resumed and step == self.start_step):
            self.checkpoint(step)  # carries the same steps and seconds (to the microsecond)
        same = replicas_identical(self.raw_model) if self.world > 1 else None

        if interrupted:
            received = self.stop.received
            sig = received.name if received is not None else "signal"
            self.log({"step": step, "event": "interrupted", "signal": sig})
            # the caller says how to continue (poetxq.tools.cli: one line)
            val_loss = val_ppl = None
        else:
            sig = None
            val_loss, val_ppl = self.evaluate()
            self.log({"step": step, "loss": self.loss_value, "val_loss": val_loss,
                      "val_ppl": val_ppl})  # fmt: skip
        result = self._result(
            interrupted=interrupted, stop_signal=sig, final_val_ppl=val_ppl,
            tokens_per_s=tokens_per_s, train_seconds=train_seconds, replicas_same=same,
        )  # fmt: skip
        if main:
            if tc.save_checkpoint and not interrupted:
                save_checkpoint(self.raw_model, run_dir / "model.safetensors")
            (run_dir / "summary.json").write_text(
                json.dumps(_finite(asdict(result)), indent=2), encoding="utf-8"
            )
            assert self.metrics_file is not None
            self.metrics_file.close()
            unlock_run_dir(run_dir)
        self.accelerator.end_training()
        if not interrupted:
            # a checkpoint from before sessions' rates were carried: this session's rate
            since = " since the resume" if self.resumed_from and not self.timed_before[0] else ""
            merged = f", {count(self.merges, 'merge')}" if self.is_poet else ""
            self.say(
                f"done: {step} steps, {result.tokens:,} tokens in {train_seconds:.0f} s "
                f"({result.tokens_per_s:,.0f} tok/s{since}){merged}; val ppl "
                f"{self.val_ppl0:.1f} -> {val_ppl:.2f} (unigram {self.unigram:.1f}); "
                f"run dir {run_dir}"
            )
        return result

    def _result(
        self,
        *,
        interrupted: bool,
        stop_signal: str | None,
        final_val_ppl: float | None,
        tokens_per_s: float,
        train_seconds: float,
        replicas_same: bool | None,
    ) -> TrainResult:
        """The run's :class:`TrainResult` (summary.json) at the step the loop ended."""
        device, tc = self.device, self.tc
        peak_alloc, peak_reserved = self._peaks()
        return TrainResult(
            run_dir=str(self.run_dir),
            steps=self.step,
            tokens=self.step * self.tokens_per_step,
            initial_val_ppl=self.val_ppl0,
            final_val_ppl=final_val_ppl,  # type: ignore[arg-type]  # None when interrupted
            unigram_val_ppl=self.unigram,
            final_train_loss=self.loss_value,
            tokens_per_s=tokens_per_s,
            train_seconds=train_seconds,
            merges=self.merges,
            device=str(device)
            + {"autocast": " bf16", "bf16-true": " bf16-true"}.get(self.precision, " fp32"),
            method=method_label(self.recipe),
            precision=self.precision,
            peak_memory_bytes=peak_alloc,
            peak_rss_bytes=peak_rss_bytes(),
            num_processes=self.world,
            interrupted=interrupted,
            stop_signal=stop_signal,
            resumed_from=self.resumed_from,
            replicas_identical=replicas_same,
            memory_options=tc.memory_options(),
            memory_plan=self.plan.to_dict(),
            peak_reserved_bytes=peak_reserved,
            cuda_graph=self.engine.graph,
            grad_sync=self.sync,
        )
