"""Throughput, MFU and peak memory of a recipe's training step on random tokens (no dataset).

One step is what ``poetxq train`` does per optimizer step: ``grad_accum`` forward/backward passes
of ``batch_size × seq_len`` tokens, gradient clipping, the optimizer step and ``zero_grad``
(merges are not timed; after the timed steps a POET run merges once, untimed in the step, and
records the merge's seconds and peak memory: a training run's memory peak may be there). On a
GPU the model is built on the device with fp32 parameters (meta init,
as in training: :mod:`poetxq.training.build`) and runs under bf16 autocast, as in training; on the
CPU it runs in fp32; ``train.precision`` changes both as it does for training
(:mod:`poetxq.training.precision`).

* tokens/s = timed steps × tokens per step / wall seconds (after ``warmup`` untimed steps).
* MFU = ``6 · N · tokens/s / peak`` with ``N`` the dense model's parameter count (embeddings,
  ``lm_head`` and every projection at full size, whatever the method stores) and ``peak`` the
  accelerator's dense bf16 FLOP/s (``--peak-tflops`` or :data:`PEAK_TFLOPS` by device name).
* peak memory = ``torch.cuda.max_memory_allocated`` over the timed steps (GPU); on the CPU the
  process's peak RSS.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from poetxq.model.relayout import alloc_conf
from poetxq.text import count
from poetxq.training.estimate_terms import projections
from poetxq.training.precision import cpu_note
from poetxq.training.recipe import Recipe, method_label, poet_variant, run_label
from quant_kernels.policy import KernelPolicy

if TYPE_CHECKING:
    from poetxq.training.plan import RunPlan

#: dense bf16 tensor-core peak, TFLOP/s (vendor data sheets, SXM parts, no sparsity)
PEAK_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0, "L40S": 362.1, "A10": 125.0}


class BenchError(ValueError):
    """Bad bench input (steps < 1, unknown device)."""


@dataclass
class BenchResult:
    """What :func:`run_bench` measured (also the JSON it writes)."""

    recipe: str
    run_label: str
    method: str
    device: str
    precision: str
    batch_size: int
    grad_accum: int
    seq_len: int
    vocab_size: int
    steps: int
    warmup_steps: int
    gradient_checkpointing: bool
    tokens_per_step: int
    step_time_s: float
    tokens_per_s: float
    n_params_dense: int
    peak_tflops: float | None
    mfu: float | None
    peak_memory_bytes: int | None
    peak_rss_bytes: int | None
    estimated_peak_bytes: int
    date: str
    commit: str | None
    torch: str
    command: str | None = None
    build_s: float | None = None  # seconds to build the model and optimizer (before warm-up)
    cuda_graph: bool = False  # forward+backward replayed from a CUDA graph (train.cuda_graph)
    # the memory options (poetxq.training.lowmem, poetxq.training.loss)
    offload_activations: bool = False
    optimizer_in_backward: bool = False
    loss_chunk_tokens: int = 0
    offload_optimizer: bool = False  # gradients and optimizer states in host memory
    #: CUDA reserved-memory peak while the model and optimizer were built (before any step)
    build_peak_reserved_bytes: int | None = None
    #: the memory plan (train.memory resolved: fastest / balanced / lowest)
    memory_plan: str = "fastest"
    # RMSNorm / rotary / SwiGLU compiled (poetxq.model.fuse), resolved
    fuse_elementwise: bool = False
    state_bits: int = 32  # optimizer state bits (optim.state_bits)
    #: CUDA reserved-memory peak; with a CUDA graph the activations live in its private pool,
    #: which ``peak_memory_bytes`` (allocated) does not count
    peak_reserved_bytes: int | None = None
    #: GPU time per step by kind of work, in ms (``profile=``; :mod:`poetxq.tools.profiling`)
    gpu_time_ms: dict[str, float] | None = None
    #: the POET layer variant (``fast`` keeps the GEMM output, ``mem`` recomputes it); None for
    #: the baselines
    variant: str | None = None
    #: the allocator settings of the run (``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF``,
    #: "" when unset; :func:`poetxq.model.relayout.alloc_conf`): they change the reserved bytes
    alloc_conf: str = ""
    #: one merge-then-reinitialize of every POET layer after the timed steps (None: a baseline):
    #: its wall seconds, and the CUDA allocated / reserved peaks while it ran (None off CUDA)
    merge_s: float | None = None
    merge_peak_memory_bytes: int | None = None
    merge_peak_reserved_bytes: int | None = None

    def summary_line(self) -> str:
        """``bench <label>: 12,345 tok/s, MFU 31.2%, peak memory 12.34 GiB (estimate ...)``."""
        mfu = f"MFU {self.mfu:.1%}" if self.mfu is not None else "MFU n/a"
        if self.cuda_graph and self.peak_reserved_bytes is not None:
            # the graph's activations live in its private pool, which allocated peaks miss
            mem = f"peak memory {self.peak_reserved_bytes / 2**30:.2f} GiB reserved (CUDA graph)"
        elif self.peak_memory_bytes is not None:
            mem = f"peak memory {self.peak_memory_bytes / 2**30:.2f} GiB"
        elif self.peak_rss_bytes is not None:
            mem = f"peak RSS {self.peak_rss_bytes / 2**30:.2f} GiB"
        else:
            mem = "peak memory n/a"
        # the estimate counts tensors on a GPU; a CPU run's RSS also holds Python, torch and data
        vs = "estimate" if self.peak_memory_bytes is not None else "GPU tensors' estimate"
        merge = ""
        if self.merge_s is not None:
            at = self.merge_peak_memory_bytes
            merge = f"; a merge {self.merge_s:.2f} s" + (
                f", peak {at / 2**30:.2f} GiB" if at is not None else ""
            )
        return (
            f"bench {self.run_label}{f' ({self.variant})' if self.variant else ''}: "
            f"{self.tokens_per_s:,.0f} tok/s, {mfu}, {mem} "
            f"({vs} {self.estimated_peak_bytes / 2**30:.2f} GiB), "
            f"{count(self.steps, 'step')} of "
            f"{self.batch_size}x{self.grad_accum}x{self.seq_len} tokens, "
            f"{self.step_time_s:.3f} s/step on {self.device} {self.precision}{merge}"
        )


def dense_param_count(recipe: Recipe, vocab_size: int) -> int:
    """Parameters of the recipe's Llama at full size (embeddings, lm_head, projections, norms)."""
    m = recipe.model
    d, L = m.hidden_size, m.num_hidden_layers
    per_layer = sum(rows * cols for _, rows, cols in projections(recipe)) + 2 * d
    heads = vocab_size * d * (1 if m.tie_word_embeddings else 2)
    return L * per_layer + heads + d


def peak_tflops_for(device_name: str) -> float | None:
    """Dense bf16 peak of a GPU from its name (``NVIDIA H200`` → 989.4), None if unknown."""
    for key, value in PEAK_TFLOPS.items():
        if key.lower() in device_name.lower():
            return value
    return None


def git_commit(root: Path | None = None) -> str | None:
    """``$POETXQ_COMMIT``, else the ``.commit`` file of a snapshot (``evals/quality_snapshot.sh``
    writes it: a snapshot has no ``.git`` of its own, and the one above it may be another
    commit's), else the checkout's HEAD; None when none is available. ``root``: the tree's top
    (default the one this package lies in)."""
    env = os.environ.get("POETXQ_COMMIT")
    if env:
        return env
    root = root or Path(__file__).resolve().parents[2]
    dot = root / ".commit"
    if dot.is_file() and dot.read_text().strip():
        return dot.read_text().strip()
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
            cwd=root, check=True,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def build_model_and_optimizer(
    recipe: Recipe,
    vocab_size: int,
    device: torch.device,
    *,
    meta_init: bool | None = None,
    echo: Callable[[str], None] = print,
    kernels: KernelPolicy | None = None,
    plan: RunPlan | None = None,
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The recipe's Llama on ``device`` (POET methods: converted, W0 drawn from
    ``train.seed + 1``; baselines: prepared) and its optimizer, as the trainer builds them
    (:func:`poetxq.training.build.build_for_training`: on CUDA with meta init, no CPU copy;
    ``meta_init`` overrides that choice). ``kernels``: the POET layers' kernel policy (default
    :func:`quant_kernels.policy.default_policy`). ``plan``: the run plan
    (:func:`poetxq.training.plan.resolve_plan`) whose meta init, CUDA graph, fusion, precision,
    kernel policy and relayout decide."""
    from poetxq.model.relayout import relayout_if_wanted
    from poetxq.training.baseline_methods import build_baseline_optimizer
    from poetxq.training.build import build_for_training
    from poetxq.training.optim import build_optimizer

    gen = torch.Generator().manual_seed(recipe.train.seed + 1)
    built = build_for_training(
        recipe, vocab_size, device, generator=gen, meta_init=meta_init, echo=echo,
        kernels=kernels, plan=plan,
    )  # fmt: skip
    kernels = plan.kernels if plan is not None and kernels is None else kernels
    if built.surgery is not None:
        # train.offload_optimizer moves each parameter's states on their own: no flat groups
        optimizer = build_optimizer(
            built.model, recipe.optim, kernels=kernels,
            flatten=not recipe.train.offload_optimizer,
        )  # fmt: skip
        if plan is None or plan.relayout:
            relayout_if_wanted(built.model, optimizer, built.device, echo)
    else:
        assert built.baseline is not None
        optimizer = build_baseline_optimizer(
            built.model, built.baseline, recipe.baseline, recipe.optim
        )
    return built.model, optimizer


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_bench(
    recipe: Recipe,
    steps: int,
    *,
    warmup: int = 1,
    vocab_size: int | None = None,
    peak_tflops: float | None = None,
    device: str | None = None,
    command: str | None = None,
    profile: Path | None = None,
    echo: Callable[[str], None] = print,
    kernels: KernelPolicy | None = None,
    gpu_mem: int | None = None,
) -> BenchResult:
    """Time ``steps`` training steps of ``recipe`` on random tokens.

    Args:
        recipe: validated recipe (model, method, batch, accumulation, sequence length).
        steps: timed optimizer steps (≥ 1).
        warmup: untimed steps first (allocations, autotuning, optimizer states).
        vocab_size: vocabulary of the random tokens (default ``data.vocab_size``).
        peak_tflops: accelerator peak for MFU (default: :data:`PEAK_TFLOPS` by GPU name; none on
            the CPU).
        device: ``"cuda"``/``"cpu"`` (default: CUDA when available).
        command: the command line, recorded in the result.
        profile: after the timed steps, profile two more with torch.profiler and write the
            tables and the GPU-time breakdown (:mod:`poetxq.tools.profiling`) to this text file; the
            breakdown also goes into the result (``gpu_time_ms``).
        echo: where the progress lines go (model build time, first step done).
        kernels: the kernel policy of the POET layers, their optimizer and the memory estimate
            (benchmarks' A/B runs); default :func:`quant_kernels.policy.default_policy`.
        gpu_mem: bytes ``train.memory: auto`` plans for (default: the device's memory), as
            :func:`poetxq.training.train.train`.

    Returns:
        :class:`BenchResult`.

    Raises:
        BenchError: ``steps < 1``, ``warmup < 0``, ``vocab_size < 1``, a non-finite or
            non-positive ``peak_tflops``, or CUDA asked for but absent.
    """
    from poetxq.training.estimate import estimate_memory
    from poetxq.training.loss import training_loss
    from poetxq.training.lowmem import enable_activation_checkpointing
    from poetxq.training.memory import apply_allocator
    from poetxq.training.plan import resolve_plan
    from poetxq.training.step import StepEngine
    from poetxq.training.train import peak_rss_bytes

    if steps < 1 or warmup < 0:
        raise BenchError(f"need --steps >= 1 and --warmup >= 0, got {steps} and {warmup}")
    if vocab_size is not None and vocab_size < 1:  # 0 would fall back to the recipe's silently
        raise BenchError(f"--vocab-size must be a positive integer, got {vocab_size}")
    if peak_tflops is not None and not (math.isfinite(peak_tflops) and peak_tflops > 0):
        raise BenchError(
            f"--peak-tflops must be a positive finite number (the accelerator's dense bf16 "
            f"TFLOP/s, e.g. 989.4), got {peak_tflops}"
        )
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise BenchError("--device cuda asked for but no CUDA device is visible; use --device cpu")
    # the run plan, as the trainer resolves it (before anything reads the memory keys)
    run_plan = resolve_plan(recipe, dev, 1, gpu_mem, vocab_size=vocab_size, kernels=kernels)
    plan = run_plan.memory
    recipe = run_plan.recipe
    apply_allocator(plan)
    if plan.line() in run_plan.notes:  # as train says it
        echo(plan.line())
    tc, oc = recipe.train, recipe.optim
    if run_plan.refusals:  # before the model is built
        raise BenchError(run_plan.refusals[0])
    graph = run_plan.cuda_graph
    V = vocab_size or recipe.data.vocab_size
    torch.manual_seed(tc.seed)
    start = time.perf_counter()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    model, optimizer = build_model_and_optimizer(recipe, V, dev, echo=echo, plan=run_plan)
    build_s = time.perf_counter() - start
    # what building held at most (W0 drawn and quantized layer by layer on the device)
    build_reserved = torch.cuda.max_memory_reserved(dev) if dev.type == "cuda" else None
    echo(f"model: built in {build_s:.1f} s on {dev}")
    if tc.gradient_checkpointing:
        # offloaded in a graph: to host buffers made once (poetxq.training.lowmem.HostSlots)
        enable_activation_checkpointing(model, offload=tc.offload_activations, graph_safe=graph)
    model.train()
    precision = run_plan.precision  # bf16-true: parameters cast by poetxq.training.build
    if note := cpu_note(tc, dev):
        echo(note)
    amp = precision == "autocast"
    data_gen = torch.Generator(device=dev).manual_seed(tc.seed + 2)
    tokens_per_step = tc.batch_size * tc.grad_accum * tc.seq_len

    def loss_fn(batch: torch.Tensor) -> torch.Tensor:
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp):
            return training_loss(model, batch, tc.loss_chunk_tokens)

    # the trainer's step (poetxq.training.step): under cuda_graph auto a failed capture goes
    # on eagerly; the clip is the recipe's, without the trainer's re-warm after merges
    engine = StepEngine(model, optimizer, tc, loss_fn=loss_fn, graph=graph, echo=echo)

    def step() -> None:
        for micro in range(tc.grad_accum):
            batch = torch.randint(0, V, (tc.batch_size, tc.seq_len + 1), device=dev,
                                  generator=data_gen)  # fmt: skip
            engine.micro(batch, final=micro == tc.grad_accum - 1)
        engine.update(oc.grad_clip)

    for _ in range(warmup):
        step()
    _sync(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    start = time.perf_counter()
    for i in range(steps):
        step()
        if i == 0 and steps > 1:
            echo(f"bench: step 1/{steps} done")
    _sync(dev)
    elapsed = time.perf_counter() - start
    tps = steps * tokens_per_step / elapsed
    peak_alloc = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
    peak_reserved = torch.cuda.max_memory_reserved(dev) if dev.type == "cuda" else None
    peak_rss = peak_rss_bytes()
    breakdown = None
    variant = poet_variant(recipe)
    if profile is not None:  # after the peaks are read: the profiler's own buffers stay out
        from poetxq.tools.profiling import profile_steps

        text, breakdown = profile_steps(step, dev)
        head = f"{run_label(recipe)} ({variant or recipe.method}): {elapsed / steps * 1e3:.1f}"
        write_text(f"{head} ms/step timed\n\n{text}", Path(profile))
        echo(f"bench: profile written to {profile}")
    # after the profile: a merge may re-home W0, which a captured CUDA graph still reads
    merge = merge_once(model, optimizer, dev, tc.seed) if poet_variant(recipe) else None
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu"
    peak = peak_tflops if peak_tflops is not None else (
        peak_tflops_for(name) if dev.type == "cuda" else None
    )  # fmt: skip
    n_dense = dense_param_count(recipe, V)
    est = estimate_memory(
        recipe, vocab_size=V, precision=precision, kernels=run_plan.kernels, plan=run_plan
    )
    return BenchResult(
        recipe=recipe.name, run_label=run_label(recipe), method=method_label(recipe),
        device=name, precision=precision, batch_size=tc.batch_size,
        grad_accum=tc.grad_accum, seq_len=tc.seq_len, vocab_size=V, steps=steps,
        warmup_steps=warmup, gradient_checkpointing=tc.gradient_checkpointing,
        tokens_per_step=tokens_per_step, step_time_s=elapsed / steps, tokens_per_s=tps,
        n_params_dense=n_dense, peak_tflops=peak,
        mfu=6 * n_dense * tps / (peak * 1e12) if peak else None,
        peak_memory_bytes=peak_alloc,
        peak_rss_bytes=peak_rss, estimated_peak_bytes=est.peak,
        date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), commit=git_commit(),
        torch=torch.__version__, command=command, build_s=build_s, cuda_graph=engine.graph,
        offload_activations=tc.offload_activations, optimizer_in_backward=tc.optimizer_in_backward,
        loss_chunk_tokens=tc.loss_chunk_tokens, offload_optimizer=tc.offload_optimizer,
        memory_plan=plan.name, build_peak_reserved_bytes=build_reserved,
        fuse_elementwise=run_plan.fuse,
        state_bits=recipe.optim.state_bits,
        peak_reserved_bytes=peak_reserved, gpu_time_ms=breakdown or None,
        variant=variant,
        alloc_conf=alloc_conf(),
        **(merge or {}),
    )  # fmt: skip


def merge_once(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device, seed: int
) -> dict[str, float | int | None]:
    """One merge-then-reinitialize of every POET layer and the reset of ``Q``'s moments, as the
    trainer does every ``merge_interval`` steps (:func:`poetxq.training.optim.merge_and_reset`;
    new permutations from a generator seeded ``seed + 3``), with its peaks measured on their own.

    Returns:
        ``merge_s`` (wall seconds, device synchronized), ``merge_peak_memory_bytes`` and
        ``merge_peak_reserved_bytes`` (CUDA peaks while merging; None off CUDA): the
        :class:`BenchResult` fields.
    """
    from poetxq.training.optim import merge_and_reset

    _sync(device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    merge_and_reset(model, optimizer, torch.Generator().manual_seed(seed + 3))
    _sync(device)
    return {
        "merge_s": time.perf_counter() - start,
        "merge_peak_memory_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
        "merge_peak_reserved_bytes": torch.cuda.max_memory_reserved(device) if cuda else None,
    }


def write_text(text: str, path: Path) -> None:
    """Write ``text`` to ``path`` atomically (temporary file + rename), creating its folder.

    A symbolic link is followed (its target is replaced; the link stays). A path that exists
    and is not a regular file (``/dev/null``, ``/dev/stdout``, a named pipe) is written to
    directly: renaming over it would replace the device or pipe with a file.

    Raises:
        OSError: one line naming ``path`` (as asked for) and what went wrong.
    """
    asked = path
    path = path.resolve() if path.is_symlink() else path
    if path.exists() and not path.is_file() and not path.is_dir():
        try:
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(text)
        except OSError as exc:
            raise OSError(
                f"cannot write '{asked}' ({exc.strerror or exc}); choose another path"
            ) from None
        return
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:  # one line naming the file asked for, not the temporary one
        raise OSError(
            f"cannot write '{asked}' ({exc.strerror or exc}); choose another path"
        ) from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def write_json(obj: dict, path: Path) -> None:
    """Write ``obj`` as indented JSON to ``path`` atomically (:func:`write_text`)."""
    write_text(json.dumps(obj, indent=2) + "\n", path)


def bench_to_dict(result: BenchResult) -> dict:
    """The result as a JSON-ready dict."""
    return asdict(result)
