"""The training loop (accelerate): recipe → data → model surgery → POET AdamW → metrics/checkpoint.

CPU runs in fp32; on a GPU the loop runs under bf16 autocast (accelerate ``mixed_precision="bf16"``)
with no flag needed. Every ``merge_interval`` optimizer steps all POET-X(Q) layers are merged and
re-initialized and the Adam moments of ``Q`` are reset. Metrics go to
``<run_dir>/metrics.jsonl`` (one JSON object per line) and, when asked, accelerate's trackers.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from safetensors.torch import save_file
from torch.utils.data import DataLoader, TensorDataset
from tqdm.auto import tqdm

from poetxq.baselines import (
    build_baseline_optimizer,
    clip_grad_norm_all,
    prepare_baseline,
    quant_modules,
    summarize_baseline,
)
from poetxq.data import TokenData, prepare_data, unigram_perplexity
from poetxq.evaluate import causal_lm_loss, evaluate_perplexity
from poetxq.export import save_run_artifacts
from poetxq.optim import (
    build_optimizer,
    build_scheduler,
    clip_threshold,
    merge_and_reset,
)
from poetxq.pretrained import build_model
from poetxq.recipe import Recipe, dump_recipe
from poetxq.surgery import convert_to_poetx, summarize

#: files a run writes into its directory
RUN_OUTPUTS = ("recipe.yaml", "metrics.jsonl", "model.safetensors", "summary.json", "config.json")


class RunDirError(ValueError):
    """The run directory cannot be used (exists and is not empty)."""


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
    tokens_per_s: float
    train_seconds: float
    merges: int
    device: str


def resolve_run_dir(recipe: Recipe, run_name: str | None, *, overwrite: bool = False) -> Path:
    """``<train.output_dir>/<run_name or recipe.name-timestamp>``; nothing is created here.

    Raises:
        RunDirError: the directory exists and is not empty (and ``overwrite`` is False).
    """
    name = run_name or f"{recipe.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    path = Path(recipe.train.output_dir) / name
    for p in (path.parent, path):
        if p.exists() and not p.is_dir():
            raise RunDirError(f"'{p}' exists and is not a directory; choose another run location")
    if path.exists() and any(path.iterdir()) and not overwrite:
        raise RunDirError(
            f"run directory '{path}' already exists and is not empty; "
            "choose another --run-name or pass --overwrite"
        )
    return path


def _atomic_write_bytes(path: Path, write: Callable[[Path], None]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def save_checkpoint(model: torch.nn.Module, path: Path) -> None:
    """Write ``model.state_dict()`` to ``path`` as safetensors, atomically (temp + rename)."""
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    _atomic_write_bytes(path, lambda tmp: save_file(state, str(tmp), metadata={"format": "pt"}))


def _batches(loader: DataLoader) -> Iterator[torch.Tensor]:
    epoch = 0
    while True:
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        for (batch,) in loader:
            yield batch
        epoch += 1


def train(
    recipe: Recipe,
    run_dir: Path,
    *,
    log_with: str | None = None,
    progress: bool = True,
    data: TokenData | None = None,
    echo: Callable[[str], None] = print,
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

    Returns:
        :class:`TrainResult`.
    """
    tc, oc, pc = recipe.train, recipe.optim, recipe.poet
    mixed = "bf16" if torch.cuda.is_available() else "no"
    accelerator = Accelerator(
        mixed_precision=mixed,
        gradient_accumulation_steps=tc.grad_accum,
        log_with=log_with,
        project_dir=str(run_dir),
    )
    main = accelerator.is_main_process
    say = echo if main else (lambda _s: None)
    set_seed(tc.seed)

    if data is None:
        data = prepare_data(recipe.data, tc.seq_len, progress=progress and main)
    say(f"data: {data.source_description}")
    say(
        f"  train {data.train.shape[0]:,} x {tc.seq_len + 1} tokens, "
        f"val {data.val.shape[0]:,} windows, vocab {data.vocab_size:,}"
    )
    # the unigram baseline scores exactly the tokens the model predicts (labels of each window)
    unigram = unigram_perplexity(data.train.flatten(), data.val[:, 1:], data.vocab_size)

    model, keep_weights = build_model(recipe, data.vocab_size, echo=say)  # --model: pretrained
    poet_gen = torch.Generator().manual_seed(tc.seed + 1)
    is_poet = recipe.method in ("poetxq", "poetx")
    if is_poet:
        report = convert_to_poetx(model, pc, generator=poet_gen, keep_weights=keep_weights)
        say(summarize(model, report))
        optimizer = build_optimizer(model, oc)
    else:
        base_report = prepare_baseline(model, recipe.method, recipe.baseline)
        say(summarize_baseline(model, base_report, recipe.baseline))
        optimizer = build_baseline_optimizer(model, base_report, recipe.baseline, oc)
    scheduler = build_scheduler(optimizer, oc, tc.max_steps)

    loader = DataLoader(
        TensorDataset(data.train),
        batch_size=tc.batch_size,
        shuffle=True,
        drop_last=True,
        generator=torch.Generator().manual_seed(tc.seed + 2),
    )
    if len(loader) == 0:
        raise ValueError(
            f"training split has {data.train.shape[0]} windows, fewer than batch_size "
            f"{tc.batch_size}; lower train.batch_size or train.seq_len"
        )
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    raw_model = accelerator.unwrap_model(model)
    raw_optimizer = getattr(optimizer, "optimizer", optimizer)
    qmods = quant_modules(raw_model)  # int8 baseline weights: gradients live in float_grad
    device = accelerator.device

    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in RUN_OUTPUTS:  # --overwrite: never leave the previous run's results behind
        (run_dir / stale).unlink(missing_ok=True)
    (run_dir / "recipe.yaml").write_text(dump_recipe(recipe), encoding="utf-8")
    if main:  # config.json + tokenizer/, for poetxq export
        save_run_artifacts(run_dir, raw_model, data.tokenizer, data.eos_id)
    if log_with:
        accelerator.init_trackers(recipe.name, config=recipe.model_dump(mode="json"))
    metrics_file = (run_dir / "metrics.jsonl").open("w", encoding="utf-8") if main else None

    def log(record: dict) -> None:
        if metrics_file is not None:
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()
        if log_with:
            accelerator.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def evaluate() -> tuple[float, float]:
        return evaluate_perplexity(
            model, data.val, batch_size=tc.batch_size, device=device,
            max_batches=tc.eval_max_batches,
        )  # fmt: skip

    val_loss0, val_ppl0 = evaluate()
    say(f"step 0: val ppl {val_ppl0:.1f} (unigram baseline on this split: {unigram:.1f})")
    log({"step": 0, "val_loss": val_loss0, "val_ppl": val_ppl0, "unigram_val_ppl": unigram})

    tokens_per_step = tc.batch_size * tc.grad_accum * tc.seq_len * accelerator.num_processes
    batches = _batches(loader)
    steps_since_merge: int | None = None
    merges = 0
    loss_value = float("nan")
    window_tokens, window_start = 0, time.perf_counter()
    train_start = time.perf_counter()
    bar = tqdm(
        total=tc.max_steps, desc="train", disable=not (progress and main), dynamic_ncols=True
    )
    model.train()
    for step in range(1, tc.max_steps + 1):
        loss_sum = torch.zeros((), device=device)
        for _ in range(tc.grad_accum):
            batch = next(batches)
            with accelerator.accumulate(model):
                loss = causal_lm_loss(model, batch)
                accelerator.backward(loss / tc.grad_accum)
            loss_sum += loss.detach()
        max_norm = clip_threshold(oc.grad_clip, steps_since_merge, oc.clip_rewarm_steps)
        if qmods:
            grad_norm = clip_grad_norm_all(model.parameters(), qmods, max_norm or float("inf"))
        else:  # grad_clip 0: no clipping, the norm is still logged
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_norm or float("inf"))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if steps_since_merge is not None:
            steps_since_merge += 1
        if (
            is_poet
            and step % pc.merge_interval == 0
            and step < tc.max_steps
            and not pc.freeze_orthogonal
        ):
            merge_and_reset(raw_model, raw_optimizer, poet_gen)
            merges += 1
            steps_since_merge = 0

        window_tokens += tokens_per_step
        bar.update(1)
        if step % tc.log_every == 0 or step == tc.max_steps:
            loss_value = accelerator.reduce(loss_sum, "mean").item() / tc.grad_accum
            now = time.perf_counter()
            tps = window_tokens / max(now - window_start, 1e-9)
            window_tokens, window_start = 0, now
            lrs = {g.get("name", str(i)): g["lr"] for i, g in enumerate(raw_optimizer.param_groups)}
            log({
                "step": step, "loss": loss_value, "lr": scheduler.get_last_lr()[-1],
                "poet_lr": lrs.get("poet"), "grad_norm": float(grad_norm), "clip": max_norm,
                "tokens": step * tokens_per_step, "tokens_per_s": tps,
            })  # fmt: skip
            bar.set_postfix(loss=f"{loss_value:.3f}", lr=f"{scheduler.get_last_lr()[0]:.2e}",
                            tok_s=f"{tps:,.0f}")  # fmt: skip
        if step % tc.eval_every == 0 and step < tc.max_steps:
            val_loss, val_ppl = evaluate()
            log({"step": step, "loss": loss_value, "val_loss": val_loss, "val_ppl": val_ppl})
            if main:
                bar.write(f"step {step}: loss {loss_value:.3f}, val ppl {val_ppl:.1f}")
    bar.close()
    train_seconds = time.perf_counter() - train_start

    val_loss, val_ppl = evaluate()
    log({"step": tc.max_steps, "loss": loss_value, "val_loss": val_loss, "val_ppl": val_ppl})
    result = TrainResult(
        run_dir=str(run_dir),
        steps=tc.max_steps,
        tokens=tc.max_steps * tokens_per_step,
        initial_val_ppl=val_ppl0,
        final_val_ppl=val_ppl,
        unigram_val_ppl=unigram,
        final_train_loss=loss_value,
        tokens_per_s=tc.max_steps * tokens_per_step / train_seconds,
        train_seconds=train_seconds,
        merges=merges,
        device=str(device) + (" bf16" if mixed == "bf16" else " fp32"),
    )
    if main:
        if tc.save_checkpoint:
            save_checkpoint(raw_model, run_dir / "model.safetensors")
        (run_dir / "summary.json").write_text(
            json.dumps(asdict(result), indent=2), encoding="utf-8"
        )
        metrics_file.close()
    accelerator.end_training()
    say(
        f"done: {tc.max_steps} steps, {result.tokens:,} tokens in {train_seconds:.0f} s "
        f"({result.tokens_per_s:,.0f} tok/s), {merges} merges; val ppl {val_ppl0:.1f} -> "
        f"{val_ppl:.2f} (unigram {unigram:.1f}); run dir {run_dir}"
    )
    return result
