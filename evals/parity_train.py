"""Parity with the official POET-XQ, the two trainers: our side (:func:`train_ours`, our trainer
into a run directory) and the official side (:func:`train_official`, a loop written after the
official training script), plus what the official code needs to run beside ours: autocast rules
for its custom ops (:data:`OFFICIAL_AUTOCAST`) and a check of its Cayley-Neumann kernel
(:func:`cayley_check`). The entry point is ``evals/parity_official.py``.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "evals"))

import official_poet  # noqa: E402
from parity_settings import (  # noqa: E402
    OFFICIAL_CLIP_MIN_RATIO,
    OFFICIAL_CLIP_WARMUP_STEPS,
    OFFICIAL_GD_WARMUP_STEPS,
    Settings,
    official_lr_factor,
    official_poet_scale,
    our_recipe,
    train_batches,
)

#: how the official custom ops run under autocast (``torch.library.register_autocast``: cast the
#: floating-point inputs, run with autocast off). The official code runs in pure bf16 or fp32; under
#: autocast with fp32 parameters its Cayley-Neumann Triton kernel would get Q in fp32 and Q² (an
#: autocast matmul inside the op) in bf16 and refuse them, so that op runs in fp32; the layer ops
#: run in bf16, as the script's pure-bf16 model runs them.
OFFICIAL_AUTOCAST = {
    "poet::cayley": torch.float32,
    "poet::chain_layer_checkpoint_q8": torch.bfloat16,
    "poet::chain_layer_checkpoint_mem_o2_q8": torch.bfloat16,
}
_AUTOCAST_REGISTERED: set[tuple[str, str]] = set()


def official_autocast_rules(device_type: str) -> list[str]:
    """Register :data:`OFFICIAL_AUTOCAST` for ``device_type`` (once per process; ops the loaded
    official code lacks are skipped). Returns the ops registered so far for that device."""
    for name, dtype in OFFICIAL_AUTOCAST.items():
        ns, op = name.split("::")
        if (name, device_type) in _AUTOCAST_REGISTERED or not hasattr(getattr(torch.ops, ns), op):
            continue
        torch.library.register_autocast(name, device_type, dtype)
        _AUTOCAST_REGISTERED.add((name, device_type))
    return sorted(n for n, d in _AUTOCAST_REGISTERED if d == device_type)


@torch.no_grad()
def cayley_check(block_size: int, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """The official Cayley-Neumann op (``torch.ops.poet.cayley``, a Triton kernel) against
    ``I + 2(Q + Q² + Q³) + Q⁴`` in fp64, on 4 random skew-symmetric ``b×b`` blocks of the size
    training reaches (entries ~0.003) given in ``dtype``: the largest absolute error. Recorded
    beside the official run; under Triton's CPU interpreter the bf16 kernel returns values of
    ~1e10 (the fp32 one is exact), so a bf16 official run on the CPU is no evidence."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(4, block_size, block_size, generator=gen, dtype=torch.float64) * 3e-3
    q64 = a - a.transpose(1, 2)
    q2 = q64 @ q64
    ref = torch.eye(block_size, dtype=torch.float64) + 2 * (q64 + q2 + q2 @ q64) + q2 @ q2
    got = torch.ops.poet.cayley(q64.to(device=device, dtype=dtype))[0]
    err = (got.double().cpu() - ref).abs().max().item()
    return {"dtype": str(dtype).removeprefix("torch."), "block_size": block_size,
            "max_abs_error": err if math.isfinite(err) else None}  # fmt: skip


def train_ours(
    s: Settings, seed: int, data: Any, poet_lr_scale: float, work: Path, echo: Callable
) -> dict[str, Any]:
    """Our side: :func:`poetxq.training.train.train` into ``work/ours-seed<seed>``; the validation
    and training-loss curves read back from its ``metrics.jsonl``."""
    from poetxq.training.train import DivergedError, train

    recipe = our_recipe(s, seed, poet_lr_scale)
    run_dir = work / f"ours-seed{seed}"
    t0 = time.perf_counter()
    try:
        res = train(recipe, run_dir, data=data, progress=False, echo=echo)
    except DivergedError as exc:
        res, diverged = None, str(exc)
        echo(f"ours seed {seed}: {exc}")
    else:
        diverged = None
    seconds = time.perf_counter() - t0
    val, loss = [], []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("val_loss") is not None:
            val.append({k: rec[k] for k in ("step", "val_loss", "val_ppl")})
        if "grad_norm" in rec:
            loss.append({"step": rec["step"], "loss": rec["loss"], "lr": rec["lr"],
                         "poet_lr": rec.get("poet_lr"), "grad_norm": rec["grad_norm"],
                         "clip": rec["clip"]})  # fmt: skip
    return {
        "val": val,
        "train": loss,
        "diverged": diverged,
        "merges": None if res is None else res.merges,
        "seconds": seconds,
        "tokens_per_s": None if res is None else res.tokens_per_s,
        "device": None if res is None else res.device,
        "precision": None if res is None else res.precision,
        "peak_memory_bytes": None if res is None else res.peak_memory_bytes,
    }


class _Autocast(nn.Module):
    """``model`` whose forward runs under bf16 autocast with fp32 outputs, as accelerate's
    ``mixed_precision="bf16"`` wraps our model's forward (training and evaluation)."""

    def __init__(self, model: nn.Module, device_type: str) -> None:
        super().__init__()
        self.model, self.device_type = model, device_type

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(self.device_type, dtype=torch.bfloat16):
            out = self.model(*args, **kwargs)
        if getattr(out, "logits", None) is not None:
            out.logits = out.logits.float()
        return out


def train_official(
    poet: ModuleType,
    s: Settings,
    seed: int,
    data: Any,
    device: torch.device,
    echo: Callable,
    *,
    compile_model: bool = False,
) -> dict[str, Any]:
    """The official side (``evals/parity_official.py``'s docstring): seeds as the script sets
    them, the transformers Llama built in fp32 on the CPU (as the script builds it) from the same
    recipe shape, wrapped by :func:`evals.official_poet.qpoet_setup` and moved to ``device`` (cast
    to bf16 for ``bf16-true``, as the script's ``--dtype bfloat16``; kept fp32 under autocast,
    like ours).
    ``compile_model``: ``torch.compile`` the wrapped model as the script does; otherwise the whole
    loop runs eagerly (``torch.compiler.set_stance("force_eager")``, which also runs the official
    layer forward, compiled by the official code itself, eagerly: a compiled graph of that layer
    under autocast is untested)."""
    from poetxq.model.surgery import build_llama
    from poetxq.training.evaluate import causal_lm_loss, evaluate_perplexity

    recipe = our_recipe(s, seed, official_poet_scale(poet))
    torch.manual_seed(seed)
    random.seed(seed)
    with contextlib.suppress(ImportError):
        import numpy as np

        np.random.seed(seed)
    base = build_llama(recipe.model, data.vocab_size)  # CPU, fp32
    dtype = torch.bfloat16 if s.precision == "bf16-true" else None
    model, cfg, optimizer = official_poet.qpoet_setup(
        poet, base, block_size=s.block_size, merge_interval=s.merge_interval,
        poet_lr=s.poet_lr, base_lr=s.lr, weight_decay=s.weight_decay, device=device, dtype=dtype,
    )  # fmt: skip
    n_q8 = sum(type(m).__name__ == "QPOETLinear" for m in model.modules())
    # the dtype the Cayley op sees: Q's own, or fp32 under autocast (OFFICIAL_AUTOCAST)
    check = cayley_check(s.block_size, device, dtype or torch.float32)
    echo(f"official Cayley op ({check['dtype']}) max abs error {check['max_abs_error']}")
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda st: official_lr_factor(st, s.warmup_steps, s.steps, s.min_lr_ratio),
    )
    params = [p for g in optimizer.param_groups for p in g["params"]]
    net: nn.Module = model
    if compile_model:
        torch.compiler.reset()
        net = torch.compile(model)
    autocast_rules = None
    if s.precision == "autocast":
        autocast_rules = official_autocast_rules(device.type)
        net = _Autocast(net, device.type)
    stance = contextlib.nullcontext() if compile_model else torch.compiler.set_stance("force_eager")
    batches = train_batches(data, s, seed)
    position, count, merges = 0, 0, 0
    val, loss_curve = [], []

    def evaluate(step: int) -> None:
        vl, vp = evaluate_perplexity(net, data.val, batch_size=s.batch_size, device=device)
        ok = math.isfinite(vl)
        val.append({"step": step, "val_loss": vl if ok else None, "val_ppl": vp if ok else None})
        echo(f"official seed {seed} step {step}: val loss {vl:.4f} (ppl {vp:.2f})")

    tokens_per_step = s.batch_size * s.grad_accum * s.seq_len
    t_start = time.perf_counter()
    paused = 0.0
    diverged = None
    with stance:
        model.train()
        evaluate(0)
        for step in range(1, s.steps + 1):
            loss_sum = torch.zeros((), device=device)
            for _ in range(s.grad_accum):
                batch = batches.batch(position).to(device)
                position += 1
                loss = causal_lm_loss(net, batch)
                (loss / s.grad_accum).backward()
                loss_sum += loss.detach().float()
            clip = poet.calc_poet_grad_clipping_value(
                global_step=count, grad_clipping=s.grad_clip,
                warmup_steps=OFFICIAL_CLIP_WARMUP_STEPS, poet_merge_interval=s.merge_interval,
                min_ratio=OFFICIAL_CLIP_MIN_RATIO, max_steps=OFFICIAL_GD_WARMUP_STEPS,
            )  # fmt: skip
            grad_norm = torch.nn.utils.clip_grad_norm_(params, clip)
            optimizer.step()
            scheduler.step()
            # logged as metrics.jsonl logs ours: the group lrs after this step's scheduler.step
            lr = optimizer.param_groups[0]["lr"]
            poet_lr = next(g["lr"] for g in optimizer.param_groups if g.get("use_poet"))
            optimizer.zero_grad()
            count += 1
            merges += bool(model.merge_if_needed(count))
            logging = step % s.log_every == 0 or step == s.steps
            evaluating = (s.eval_every and step % s.eval_every == 0) or step == s.steps
            if not (logging or evaluating):
                continue  # no host sync on the other steps
            mean_loss = loss_sum.item() / s.grad_accum
            if not math.isfinite(mean_loss):
                diverged = f"training loss {mean_loss} at step {step}"
                echo(f"official seed {seed}: {diverged}: diverged")
                break
            if logging:
                # poet_lr: the Q group's lr before POETAdamW's poet_scale (ours logs it after)
                loss_curve.append({"step": step, "loss": mean_loss, "lr": lr,
                                   "poet_lr": poet_lr, "grad_norm": float(grad_norm),
                                   "clip": clip})  # fmt: skip
            if evaluating:
                t0 = time.perf_counter()
                evaluate(step)
                paused += time.perf_counter() - t0
    seconds = time.perf_counter() - t_start
    return {
        "val": val,
        "train": loss_curve,
        "diverged": diverged,
        "merges": merges,
        "seconds": seconds,
        "tokens_per_s": count * tokens_per_step / max(seconds - paused, 1e-9),
        "qpoet_layers": n_q8,
        "cayley_check": check,
        "config": {k: v for k, v in asdict(cfg).items() if not callable(v)},
        "compiled": compile_model,
        "autocast_rules": autocast_rules,
        "peak_memory_bytes": (
            torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        ),
    }
