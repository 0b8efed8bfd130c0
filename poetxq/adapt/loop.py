"""The FPO adaptation loop: batches, steps, evaluation, resumable state and the adapted model.

Paper: Patil, Dennis et al., arXiv 2608.14563 (FPO). :func:`adapt` runs
:meth:`poetxq.adapt.fpo.FPOAdapter.step` over training windows, evaluates validation perplexity
with :func:`poetxq.training.evaluate.evaluate_perplexity` (in-domain, and optionally a second,
out-of-domain set), appends records to ``OUT/metrics.jsonl`` and writes:

* ``OUT/fpo_state/`` — masters, optimizer state, ``W3_init`` and the step
  (``state.safetensors`` + ``state.json`` through :mod:`poetxq.training.checkpoint`'s encoding),
  written to a temporary folder and renamed, so a crash leaves the previous state whole;
* ``OUT/model/`` at the end — the adapted model and its tokenizer (``save_pretrained``), which
  transformers loads directly (low-bit frozen layers dequantized); also written to a temporary
  folder and renamed.

Batches are deterministic in the step (epoch ``k`` is a seeded permutation of the windows), so a
resumed run sees the batches the uninterrupted run would have seen.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from poetxq.adapt.fpo import FPOAdapter, FPOError
from poetxq.adapt.lowbit import densify
from poetxq.training.checkpoint import decode_state, encode_state, save_safetensors
from poetxq.training.distributed import StopSignals
from poetxq.training.evaluate import evaluate_perplexity
from poetxq.training.rundir import keep_metrics_until

STATE_DIR = "fpo_state"
MODEL_DIR = "model"


@dataclass
class LoopConfig:
    """Settings of :func:`adapt`."""

    steps: int
    batch_size: int
    eval_every: int = 50  # 0: only before and after
    eval_batches: int | None = 8  # None: the whole validation set
    save_every: int = 50  # 0: only at the end
    log_every: int = 10
    seed: int = 0


def batch_indices(step: int, batch_size: int, n: int, seed: int) -> torch.Tensor:
    """Window indices of ``step``'s batch: positions ``step·B … step·B+B−1`` of the sequence of
    seeded per-epoch permutations of ``range(n)`` (epoch ``k``: generator seed ``seed + k``)."""
    out = []
    for pos in range(step * batch_size, (step + 1) * batch_size):
        epoch, i = divmod(pos, n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
        out.append(int(perm[i]))
    return torch.tensor(out)


def save_state(out: Path, adapter: FPOAdapter, extra: dict[str, Any]) -> None:
    """Write the adapter's resumable state to ``out/fpo_state`` (temporary folder + rename)."""
    tensors: dict[str, torch.Tensor] = {}
    meta = {
        "steps": adapter.steps,
        "layers": adapter.layers,
        "masters": encode_state(
            {f"{i}.{n}": m for (i, n), m in adapter.masters.items()}, "masters", tensors
        ),
        "state": encode_state(
            {f"{i}.{n}": s for (i, n), s in adapter.state.items()}, "state", tensors
        ),
        "w3_init": encode_state(
            {str(i): w for i, w in adapter.w3_init.items()}, "w3_init", tensors
        ),
        **extra,
    }
    tmp, final = out / f".{STATE_DIR}.tmp-{os.getpid()}", out / STATE_DIR
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_safetensors(tensors, tmp / "state.safetensors")
    (tmp / "state.json").write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    old = out / f".{STATE_DIR}.old-{os.getpid()}"
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


#: the command-line flag of each setting a resumed adaptation must keep (:func:`check_resume`)
RESUME_FLAGS: dict[str, str] = {
    "model": "MODEL", "data": "--data", "method": "--method", "bits": "--bits",
    "quant_type": "--quant-type", "optimizer": "--optimizer", "lr": "--lr", "layers": "--layers",
    "seq_len": "--seq-len", "batch_size": "--batch-size", "seed": "--seed", "clip": "--clip",
    "clip_on": "--clip-on", "data_settings": "--set data.*",
}  # fmt: skip


def check_resume(out: Path, settings: dict[str, Any], steps: int) -> dict[str, Any]:
    """Check that ``out/fpo_state`` can be continued with ``settings`` for ``steps`` steps.

    Args:
        out: the adaptation's output folder.
        settings: the settings of this command (keys of :data:`RESUME_FLAGS`; a key left out,
            e.g. ``lr`` when the diagnosis is to choose it, is not compared). States written
            before settings were saved are not compared.
        steps: this command's ``--steps``.

    Returns:
        The saved metadata (``steps``, ``layers``, ``settings``, ...).

    Raises:
        FPOError: nothing saved in ``out``, a setting that differs from the saved one (named
            with its flag), or ``steps`` below the saved step.
    """
    path = out / STATE_DIR / "state.json"
    if not path.is_file():
        raise FPOError(
            f"nothing to resume in '{out}' (no {STATE_DIR}/state.json); drop --resume to start a "
            "new adaptation there"
        )
    meta = json.loads(path.read_text(encoding="utf-8"))
    saved = meta.get("settings") or {}
    for key, value in settings.items():
        if key in saved and saved[key] != value:
            flag = RESUME_FLAGS.get(key, key)
            raise FPOError(
                f"'{out}' was adapted with {flag} {saved[key]}, not {value}; resume with the same "
                f"{flag}, or pass another --out for a new adaptation"
            )
    if meta["steps"] > steps:
        raise FPOError(
            f"'{out}' is at step {meta['steps']}; --steps {steps} is below it: pass --steps "
            f"{meta['steps']} or more to resume it"
        )
    return meta


def load_state(out: Path, adapter: FPOAdapter) -> dict[str, Any]:
    """Restore ``out/fpo_state`` into ``adapter`` (and the model's target weights).

    Returns:
        The saved metadata (``steps`` and what :func:`save_state` got as ``extra``).

    Raises:
        FPOError: no saved state, or one for other target layers.
    """
    path = out / STATE_DIR
    if not (path / "state.json").is_file():
        raise FPOError(f"nothing to resume in '{out}' (no {STATE_DIR}/state.json)")
    meta = json.loads((path / "state.json").read_text(encoding="utf-8"))
    if meta["layers"] != adapter.layers:
        raise FPOError(
            f"'{out}' adapted layers {meta['layers']}, not {adapter.layers}; resume with the "
            "same --layers"
        )
    tensors = load_file(str(path / "state.safetensors"))
    masters = decode_state(meta["masters"], tensors)
    states = decode_state(meta["state"], tensors)
    w3_init = decode_state(meta["w3_init"], tensors)
    with torch.no_grad():
        for (i, n), master in adapter.masters.items():
            master.copy_(masters[f"{i}.{n}"])
            param = adapter.params[i, n]
            if param.data_ptr() != master.data_ptr():
                param.data.copy_(master)
            adapter.state[i, n] = {k: v.to(master.device) for k, v in states[f"{i}.{n}"].items()}
        for i in adapter.w3_init:
            adapter.w3_init[i].copy_(w3_init[str(i)])
    adapter.steps = int(meta["steps"])
    return meta


def save_model(out: Path, model: torch.nn.Module, tokenizer: Any) -> Path:
    """``save_pretrained`` of the model (and ``tokenizer`` when given) as ``out/model``.

    Low-bit frozen layers (:func:`poetxq.adapt.lowbit.freeze_low_bit`) are first turned into
    dense ``nn.Linear`` in place (:func:`~poetxq.adapt.lowbit.densify`): the saved checkpoint is
    plain transformers and computes the function that was adapted.
    """
    densify(model)
    tmp, final = out / f".{MODEL_DIR}.tmp-{os.getpid()}", out / MODEL_DIR
    shutil.rmtree(tmp, ignore_errors=True)
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no per-shard bar in the command's output
    try:
        model.save_pretrained(str(tmp))
    finally:
        if was_on:
            hf_logging.enable_progress_bar()
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


def adapt(
    adapter: FPOAdapter,
    train: torch.Tensor,
    val: torch.Tensor,
    cfg: LoopConfig,
    out: Path,
    *,
    ood_val: torch.Tensor | None = None,
    tokenizer: Any = None,
    resume: bool = False,
    settings: dict[str, Any] | None = None,
    echo: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run FPO for ``cfg.steps`` steps; evaluate, log, save state and the adapted model.

    Args:
        adapter: an :class:`FPOAdapter` over the model (on its device).
        train: training windows ``[N, L+1]`` int64.
        val: in-domain validation windows ``[M, L+1]``.
        cfg: :class:`LoopConfig`.
        out: output folder (created).
        ood_val: optional out-of-domain validation windows, evaluated beside ``val``.
        tokenizer: saved with the model (a transformers tokenizer), or None.
        resume: continue from ``out/fpo_state`` (:func:`check_resume`, :func:`load_state`); a
            state already at ``cfg.steps`` returns its summary without further work.
        settings: what the saved state records for :func:`check_resume` (keys of
            :data:`RESUME_FLAGS`), compared on resume.
        echo: where progress lines go.

    Returns:
        The summary written to ``out/summary.json``: method, first and last in-domain (and
        out-of-domain) loss / perplexity, steps, tokens, tokens/s, peak GPU memory of the steps
        (None on the CPU), path of the saved model. When SIGINT / SIGTERM stopped the loop (it
        finishes the step, saves the state and returns): ``{"stopped_by": "SIGINT"|"SIGTERM",
        "step": N}`` and no model is written.

    Raises:
        FPOError: no training window, nothing to resume, a state for other settings or layers.
    """
    if train.shape[0] == 0:
        raise FPOError("the training split holds no window; lower --seq-len or add data")
    out.mkdir(parents=True, exist_ok=True)
    model = adapter.model
    device = adapter.parts.lm_weight.device
    metrics = out / "metrics.jsonl"
    start, first = 0, None
    settings = dict(settings or {})
    if resume:
        check_resume(out, settings, cfg.steps)
        meta = load_state(out, adapter)
        start, first = adapter.steps, meta.get("first_eval")
        if start == cfg.steps and (out / "summary.json").is_file():
            echo(f"'{out}' already finished at step {start}; nothing to do")
            return json.loads((out / "summary.json").read_text(encoding="utf-8"))
        echo(f"resumed '{out}' at step {start} of {cfg.steps}")
        keep_metrics_until(metrics, start)
        if ood_val is None and first is not None and "ood_ppl" in first:
            echo(
                f"note: the run resumed in '{out}' measured --ood-data (ood ppl "
                f"{first['ood_ppl']:.2f} at step 0); without it this session measures none: "
                "pass the same --ood-data to keep the comparison"
            )
    elif metrics.exists():
        metrics.unlink()

    def evaluate(step: int) -> dict[str, float]:
        rec: dict[str, float] = {"step": step}
        rec["val_loss"], rec["val_ppl"] = evaluate_perplexity(
            model, val, batch_size=cfg.batch_size, device=device, max_batches=cfg.eval_batches
        )
        if ood_val is not None:
            rec["ood_loss"], rec["ood_ppl"] = evaluate_perplexity(
                model, ood_val, batch_size=cfg.batch_size, device=device,
                max_batches=cfg.eval_batches)  # fmt: skip
        log(rec)
        ood = f", ood ppl {rec['ood_ppl']:.2f}" if ood_val is not None else ""
        echo(f"step {step}: val ppl {rec['val_ppl']:.2f}{ood}")
        return rec

    def log(rec: dict) -> None:
        with metrics.open("a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")

    if first is None:
        first = evaluate(0)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    tokens, t0, last = 0, time.perf_counter(), first
    extra = {"first_eval": first, "settings": settings}
    stop = StopSignals(announce=True)  # SIGINT / SIGTERM: finish the step, save the state
    for step in stop.guard(range(start, cfg.steps)):
        idx = batch_indices(step, cfg.batch_size, train.shape[0], cfg.seed)
        batch = train[idx].to(device)
        stats = adapter.step(batch[:, :-1], batch[:, 1:])
        tokens += stats.n_tokens
        done = step + 1
        if done % cfg.log_every == 0 or done == cfg.steps:
            tps = tokens / max(time.perf_counter() - t0, 1e-9)
            log({"step": done, "loss": stats.loss, "clipped": stats.clipped, "tokens_per_s": tps})
            echo(f"step {done}/{cfg.steps}: loss {stats.loss:.4f}, {tps:,.0f} tokens/s")
        if cfg.eval_every and done % cfg.eval_every == 0 and done != cfg.steps:
            last = evaluate(done)
        if cfg.save_every and done % cfg.save_every == 0 and done != cfg.steps:
            save_state(out, adapter, extra)
        if stop.received is not None and done != cfg.steps:
            save_state(out, adapter, extra)
            echo(
                f"stopped at step {done} of {cfg.steps} by {stop.received.name}; state saved in "
                f"'{out / STATE_DIR}': the same command with --resume continues it"
            )
            return {"stopped_by": stop.received.name, "step": done}
    elapsed = time.perf_counter() - t0
    if start < cfg.steps or last is first:
        last = evaluate(cfg.steps)
    save_state(out, adapter, extra)
    path = save_model(out, model, tokenizer)
    method = {"partial": "sft-partial", "full": "full"}.get(getattr(adapter, "mode", ""), "fpo")
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    summary = {
        "method": method, "steps": cfg.steps, "layers": adapter.layers, "lr": adapter.lr,
        "peak_memory_bytes": peak,
        "optimizer": adapter.optimizer, "target_params": adapter.target_numel(),
        "tokens_this_session": tokens, "tokens_per_s": tokens / max(elapsed, 1e-9),
        "first": first, "last": last, "model_dir": str(path),
    }  # fmt: skip
    tmp = out / f".summary.json.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, out / "summary.json")
    return summary
