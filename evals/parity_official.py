"""Parity with the official POET-XQ (issue 32, item 4): our trainer and the official code, same
data, seed and settings, validation loss at the same steps on the same windows.

(a) ours: :func:`poetxq.training.train.train` of the ``<model>:poetxq`` recipe on the study's token
corpus
    (``train`` split; validation on the ``tune`` split, as the quality study does).
(b) official: ``poet_torch.POETModel(QPOETConfig)`` around a transformers ``LlamaForCausalLM`` of
    the same shape, trained by :func:`train_official`, a loop written here after the official
    training script (``examples/torchrun_main.py --optimizer q_poet`` of
    github.com/Sphere-AI-Lab/poet): ``get_poet_optimizer`` (``POETAdamW``), the script's cosine
    schedule with warmup and a min lr ratio (:func:`official_lr_factor`), gradient clipping with
    the official ``calc_poet_grad_clipping_value`` (0.1x -> 1x over 10 steps after each merge),
    ``merge_if_needed`` after every optimizer step (merge every ``merge_interval`` steps; the
    optimizer resets Q's Adam moments on the same steps by itself).

Both draw the same micro-batches in the same order
(:class:`poetxq.training.distributed.ShardedBatches` with the trainer's seed, ``train.seed + 2``),
use the same loss (:func:`poetxq.training.evaluate .causal_lm_loss`: next-token cross-entropy over
the window, fp32) and the same evaluation (:func:`poetxq.training.evaluate.evaluate_perplexity` over
the same validation windows, same batch size). How each setting maps onto each side, and what cannot
be made equal, is written into the JSON (``mapping``, ``differences``). The rotation lr: both sides
train Q at ``--poet-lr`` × 0.5 (the official ``QPOETConfig.poet_scale`` default at @3a34bb6, read
from the loaded code; our ``optim.poet_lr_scale`` is set to it).

Precision (``--precision``, both sides): ``autocast`` (default, as the quality study runs ours):
fp32 parameters and moments, bf16 autocast; the official custom ops get autocast rules
(:data:`OFFICIAL_AUTOCAST`) because the official code itself only runs in pure bf16 or fp32.
``bf16-true``: bf16 parameters, no autocast (the official script's ``--dtype bfloat16``; ours
``train.precision: bf16-true``). ``fp32``. The official model runs eagerly unless
``--official-compile`` (the script compiles it; the layer's own compiled forward under autocast
is untested). Each official run records a check of its Cayley-Neumann kernel
(:func:`cayley_check`).

The official code is never committed here: a copy of its ``poet_torch/`` lives in ``.official/``
(git-ignored; :mod:`evals.official_poet`). Make one from a clone or a bare mirror::

    mkdir -p .official && git --git-dir=POET.git archive HEAD poet_torch | tar -x -C .official
    git --git-dir=POET.git rev-parse HEAD > .official/COMMIT   # recorded in the JSON

Usage (on the GPU host; several seeds give the seed noise the curves are judged against; the
JSON is rewritten after each finished side, and ``--previous`` continues from an earlier call's
JSON, so seeds can be spread over calls of limited time)::

    python evals/parity_official.py --steps 400 --poet-lr 8e-3 --eval-every 50 \
        --seeds 0 1 --out evals/results/parity_official_60m_h200.json --official .official
    python evals/parity_official.py ... --seeds 2 --previous FIRST.json --out BOTH.json

A smoke test on the CPU (``TRITON_INTERPRET=1``, a tiny shape)::

    TRITON_INTERPRET=1 python evals/parity_official.py --steps 4 --merge-interval 2 \
        --eval-every 2 --batch-size 4 --seq-len 32 --block-size 16 --val-tokens 2048 \
        --set model.hidden_size=32 --set model.intermediate_size=64 \
        --set model.num_attention_heads=2 --set model.num_hidden_layers=1 --out /tmp/p.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import yaml
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "evals"))

import official_poet  # noqa: E402
from _common import provenance, write_json_atomic  # noqa: E402

#: the official training script's ``gd_warmup_steps`` default: the post-merge clip re-warm runs
#: only up to this step (``calc_poet_grad_clipping_value(max_steps=...)``)
OFFICIAL_GD_WARMUP_STEPS = 2000
#: ``calc_poet_grad_clipping_value`` as the official script calls it: re-warm over 10 steps
#: from 0.1x (the same numbers as our ``optim.clip_rewarm_steps`` and its fixed 0.1 start)
OFFICIAL_CLIP_WARMUP_STEPS, OFFICIAL_CLIP_MIN_RATIO = 10, 0.1


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


class PreviousMismatch(ValueError):
    """The earlier results given to continue from compare something else."""


@dataclass
class Settings:
    """One parity comparison. Defaults: the quality study's Llama-60M POET-XQ settings."""

    steps: int = 400
    poet_lr: float = 8e-3  # both sides multiply it by the POET lr scale (official_poet_scale)
    lr: float = 1e-2  # embeddings, lm_head, norms
    eval_every: int = 50
    seeds: list[int] = field(default_factory=lambda: [0])
    model: str = "llama-60m"
    block_size: int = 256
    merge_interval: int = 200
    batch_size: int = 128
    grad_accum: int = 1
    seq_len: int = 256
    warmup_fraction: float = 0.1
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    weight_decay: float = 0.0
    precision: str = "autocast"  # autocast | bf16-true | fp32, both sides
    val_tokens: int | None = 1_048_576
    log_every: int = 10
    # recipe overrides for a smaller model (tests): e.g. {"model.hidden_size": 32}
    model_overrides: dict[str, Any] = field(default_factory=dict)

    @property
    def warmup_steps(self) -> int:
        return round(self.warmup_fraction * self.steps)

    def eval_steps(self) -> list[int]:
        """Steps with a validation loss on both sides: 0, every ``eval_every``, the last."""
        every = [s for s in range(self.eval_every, self.steps, self.eval_every)]
        return [0, *every, self.steps] if self.eval_every else [0, self.steps]


def official_poet_scale(poet: ModuleType) -> float:
    """The rotation lr scale the official code applies: ``QPOETConfig.poet_scale``'s default
    (``POETAdamW`` multiplies the ``use_poet`` group's lr by it when it is > 0)."""
    scale = float(poet.QPOETConfig().poet_scale)
    return scale if scale > 0 else 1.0


# --------------------------------------------------------------------------------------------
# Settings mapping
# --------------------------------------------------------------------------------------------


def recipe_overrides(s: Settings, seed: int, poet_lr_scale: float) -> dict[str, Any]:
    """Our recipe (``<model>:poetxq``) for ``s`` and ``seed``: every generic setting from ``s``,
    POET-XQ int8 W0 with ``b``, ``T``, k = 3, round-to-nearest re-quantization (as the official
    code), and the official code's Adam (betas 0.9/0.999, eps 1e-6) and rotation lr scale."""
    return {
        **s.model_overrides,
        "poet.bits": 8,
        "poet.block_size": s.block_size,
        "poet.merge_interval": s.merge_interval,
        "poet.neumann_terms": 3,
        "poet.requant": "nearest",
        # the official loop merges after every optimizer step whose count T divides, the last
        # one included: so do we when T divides the run's length
        "poet.merge_at_end": s.steps % s.merge_interval == 0,
        "optim.lr": s.lr,
        "optim.poet_lr": s.poet_lr,
        "optim.poet_lr_scale": poet_lr_scale,
        "optim.weight_decay": s.weight_decay,
        "optim.betas": [0.9, 0.999],  # POETAdamW's defaults (get_poet_optimizer passes none)
        "optim.eps": 1e-6,  # POETAdamW's default
        "optim.warmup_steps": s.warmup_steps,
        "optim.min_lr_ratio": s.min_lr_ratio,
        "optim.grad_clip": s.grad_clip,
        "optim.clip_rewarm_steps": OFFICIAL_CLIP_WARMUP_STEPS,
        "optim.state_bits": 32,  # POETAdamW keeps its moments in the parameters' dtype
        "train.max_steps": s.steps,
        "train.batch_size": s.batch_size,
        "train.grad_accum": s.grad_accum,
        "train.seq_len": s.seq_len,
        "train.eval_every": s.eval_every,
        "train.log_every": s.log_every,
        "train.seed": seed,
        "train.precision": s.precision,
        "train.save_checkpoint": False,
        "name": f"parity-{s.model}-seed{seed}",
    }


def our_recipe(s: Settings, seed: int, poet_lr_scale: float) -> Any:
    """The validated recipe of our side (:func:`recipe_overrides`)."""
    from poetxq.training.recipe_files import load_recipe

    return load_recipe(f"{s.model}:poetxq", recipe_overrides(s, seed, poet_lr_scale))


def official_lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """The official script's lr multiplier (``--scheduler cosine``: one cycle of its cyclical
    cosine with min lr ratio) at 0-based optimizer step ``step``: ``step / warmup`` during warmup
    (0 at the first step), then ``min_ratio + (1 - min_ratio) · ½(1 + cos(π · progress))`` with
    ``progress = (step - warmup) / (total - warmup)``. Ours
    (:func:`poetxq.training.optim.cosine_lr_factor`) is the same after warmup and ``(step + 1) /
    warmup`` during it: one step ahead there."""
    if step < warmup:
        return step / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def train_batches(data: Any, s: Settings, seed: int) -> Any:
    """The micro-batch source both sides draw from:
    :class:`poetxq.training.distributed.ShardedBatches` over ``data.train`` with the seed
    :func:`poetxq.training.train.train` gives it (``train.seed + 2``), one process. Micro-batch
    ``k`` (0-based, counted over the whole run) is ``.batch(k)``."""
    from poetxq.training.distributed import ShardedBatches

    return ShardedBatches(data.train, s.batch_size, rank=0, world_size=1, seed=seed + 2)


# --------------------------------------------------------------------------------------------
# The two runs
# --------------------------------------------------------------------------------------------


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
    """The official side (module docstring): seeds as the script sets them, the transformers
    Llama built in fp32 on the CPU (as the script builds it) from the same recipe shape, wrapped
    by :func:`evals.official_poet.qpoet_setup` and moved to ``device`` (cast to bf16 for
    ``bf16-true``, as the script's ``--dtype bfloat16``; kept fp32 under autocast, like ours).
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


# --------------------------------------------------------------------------------------------
# Summary, mapping and the whole comparison
# --------------------------------------------------------------------------------------------


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per evaluation step: each side's mean validation loss over the seeds, their difference
    (official − ours) and, with two or more seeds, the standard error of that difference
    (seed noise); ``agree`` at a step when ``|difference| <= 2 · SE``. With one seed there is no
    noise estimate and ``agree`` is None."""
    done = [r for r in runs if "ours" in r and "official" in r]
    if not done:
        return {"seeds": 0, "steps": []}
    by_side: dict[str, dict[int, list[float]]] = {"ours": {}, "official": {}}
    diverged = {side: [r["seed"] for r in done if r[side].get("diverged")] for side in by_side}
    for r in done:
        for side in by_side:
            for p in r[side]["val"]:
                if p["val_loss"] is not None:
                    by_side[side].setdefault(p["step"], []).append(p["val_loss"])
    rows = []
    for step in sorted(set(by_side["ours"]) & set(by_side["official"])):
        a, b = by_side["ours"][step], by_side["official"][step]
        if not len(a) == len(b) == len(done):  # a seed diverged before this step
            continue
        row: dict[str, Any] = {"step": step, "ours": statistics.fmean(a),
                               "official": statistics.fmean(b)}  # fmt: skip
        row["difference"] = row["official"] - row["ours"]
        if len(a) >= 2:
            se = math.sqrt(statistics.variance(a) / len(a) + statistics.variance(b) / len(b))
            row["se"] = se
            row["agree"] = abs(row["difference"]) <= 2 * se
        else:
            row["se"], row["agree"] = None, None
        rows.append(row)
    final = rows[-1] if rows else None
    trained = [r for r in rows if r["step"] > 0]
    return {
        "seeds": len(done),
        "rule": "agree at a step: |mean official - mean ours| <= 2 x SE over seeds (>= 2 seeds); "
        "all_agree: at every evaluated step after step 0 (step 0 compares the two inits only)",
        "steps": rows,
        "final": final,
        "diverged_seeds": diverged,
        "all_agree": _all_agree(trained, diverged),
    }


def _all_agree(trained: list[dict[str, Any]], diverged: dict[str, list[int]]) -> bool | None:
    """False when a seed diverged on either side; None without a noise estimate (one seed);
    else whether every trained step agrees."""
    if any(diverged.values()):
        return False
    if not trained or trained[0]["agree"] is None:
        return None
    return all(r["agree"] for r in trained)


def mapping(s: Settings, poet_scale: float, official_commit: str) -> dict[str, Any]:
    """How each setting reaches each side (written into the JSON)."""
    rot = s.poet_lr * poet_scale
    return {
        "rotation_lr": {
            "poet_lr": s.poet_lr,
            "ours": {
                "effective": s.poet_lr * poet_scale,
                "poet_lr_scale": poet_scale,
                "how": "optim.poet_lr x optim.poet_lr_scale "
                "(poetxq.training.optim.build_optimizer)",
            },
            "official": {
                "effective": rot,
                "poet_scale": poet_scale,
                "how": f"QPOETConfig.poet_scale default {poet_scale} (@{official_commit}"
                "); POETAdamW multiplies the use_poet group's lr by it",
            },
        },
        "base_lr": {"ours": "optim.lr", "official": "QPOETConfig.base_lr", "value": s.lr},
        "schedule": {
            "warmup_steps": s.warmup_steps,
            "min_lr_ratio": s.min_lr_ratio,
            "ours": "(step+1)/warmup, then cosine to min_lr_ratio "
            "(poetxq.training.optim.cosine_lr_factor)",
            "official": "step/warmup (lr 0 at the first step), then the same cosine "
            "(examples/peft_pretraining/training_utils.py, cosine; official_lr_factor here)",
        },
        "grad_clip": {
            "value": s.grad_clip,
            "ours": "clip_threshold: 0.1x -> 1x over optim.clip_rewarm_steps=10 after each merge",
            "official": "calc_poet_grad_clipping_value(warmup_steps=10, min_ratio=0.1, "
            f"max_steps={OFFICIAL_GD_WARMUP_STEPS}) over every optimizer param",
        },
        "merge": {
            "interval": s.merge_interval,
            "ours": "merge_and_reset every poet.merge_interval steps (+ poet.merge_at_end when "
            "T divides the run); Adam moments of Q zeroed, step count reset",
            "official": "model.merge_if_needed(optimizer step count) after each step; POETAdamW "
            "restarts Q's moments at the next step (its global counter % T == 0)",
        },
        "optimizer": {
            "betas": [0.9, 0.999],
            "eps": 1e-6,
            "weight_decay": s.weight_decay,
            "ours": "torch AdamW, moments fp32; eps added to sqrt(v_hat)",
            "official": "POETAdamW defaults (get_poet_optimizer passes no betas/eps); eps added "
            "to sqrt(v) before the bias correction folds into the step size",
        },
        "precision": {
            "setting": s.precision,
            "ours": "train.precision (autocast: bf16 autocast, fp32 parameters and moments)",
            "official": {
                "autocast": "fp32 parameters, forward under bf16 autocast; its custom ops by "
                "OFFICIAL_AUTOCAST: Cayley-Neumann in fp32, layer ops in bf16",
                "bf16-true": "model.to(bfloat16) as the script's --dtype bfloat16",
                "fp32": "fp32",
            }.get(s.precision),
        },
        "data": "same ShardedBatches (seed train.seed + 2), same micro-batch positions",
        "loss": "poetxq.training.evaluate.causal_lm_loss on both (the script calls the model with "
        "labels=input_ids: the same next-token loss)",
        "evaluation": "poetxq.training.evaluate.evaluate_perplexity, same validation windows "
        "and batch",
    }


DIFFERENCES = [
    "W0 quantizer: ours int8 row-wise absmax (bitsandbytes LLM.int8 layout); official uint8 "
    "asymmetric min/max in groups of 256 elements (weight_group_size 256)",
    "W0 and embeddings are drawn by each side's own code from the same seed (ours: normalized "
    "Gaussian W0 from the generator seeded train.seed + 1; official: transformers init std 0.02, "
    "rows normalized): the same distribution, not the same numbers",
    "our layers run the mem variant through our kernels; the official QPOETLinear its "
    "mem_efficient_mode=False path (convert_to_qpoet's default): same function, other kernels",
    "warmup: the official schedule is one step behind ours (lr 0 at its first step)",
    "the official script wraps its own copy of the Llama model (peft_pretraining.modeling_llama) "
    "unless --use_hf_model; here the transformers LlamaForCausalLM (--use_hf_model), as ours",
    "Adam eps placement (see mapping.optimizer): differs by a factor sqrt(1 - beta2^t) on eps",
]


def official_commit_of(folder: Path) -> str:
    """``folder/COMMIT`` (written beside the copy, see the module docstring) or ``unknown``."""
    path = folder / "COMMIT"
    return path.read_text().strip() if path.is_file() else "unknown"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"cpu ({platform.machine()})"


def run_parity(
    s: Settings,
    poet: ModuleType,
    data: Any,
    *,
    device: torch.device,
    work: Path,
    official_commit: str = "unknown",
    compile_official: bool = False,
    echo: Callable[[str], None] = print,
    on_update: Callable[[dict[str, Any]], None] | None = None,
    previous: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Train both sides for every seed of ``s`` (ours first) and return the document: settings,
    mapping, differences, per-seed curves and :func:`summarize`. ``on_update`` gets the document
    after every finished side (the CLI writes it, so a stopped run keeps what was done).
    ``previous``: the document of an earlier call with the same settings (seeds aside): its
    finished seeds are kept and not run again (seeds spread over several calls of limited time).

    Raises:
        PreviousMismatch: ``previous`` was made with other settings, data or official code.
    """
    scale = official_poet_scale(poet)
    official_poet.one_config_under_interpreter(poet)
    doc: dict[str, Any] = {
        "what": "validation loss of our POET-XQ and the official POET-XQ (poet_torch "
        "POETModel(QPOETConfig)), same data, seed, settings, batches and validation windows",
        "official_code": {"repo": "github.com/Sphere-AI-Lab/poet", "commit": official_commit},
        "settings": {
            **{k: v for k, v in asdict(s).items() if k != "seeds"},
            "seeds": list(s.seeds),
            "warmup_steps": s.warmup_steps,
            "model_shape": our_recipe(s, 0, scale).model.model_dump(mode="json"),
            "tokens_per_step": s.batch_size * s.grad_accum * s.seq_len,
            "vocab_size": data.vocab_size,
            "train_windows": int(data.train.shape[0]),
            "val_windows": int(data.val.shape[0]),
            "val_tokens_scored": int(data.val[:, 1:].numel()),
            "data": data.source_description,
        },
        "mapping": mapping(s, scale, official_commit),
        "differences": DIFFERENCES,
        "runs": [],
    }
    if previous is not None:
        kept = _finished_runs(previous, doc)
        doc["runs"] = kept
        done = [r["seed"] for r in kept]
        doc["settings"]["seeds"] = done + [x for x in s.seeds if x not in done]
        echo(f"kept the finished seeds {done} of the earlier results")
    for seed in s.seeds:
        if any(r["seed"] == seed for r in doc["runs"]):
            continue
        run: dict[str, Any] = {"seed": seed, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                    time.gmtime())}  # fmt: skip
        doc["runs"].append(run)
        echo(f"seed {seed}: ours")
        run["ours"] = train_ours(s, seed, data, scale, work, echo)
        if on_update:
            on_update(doc)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        echo(f"seed {seed}: official")
        run["official"] = train_official(poet, s, seed, data, device, echo,
                                         compile_model=compile_official)  # fmt: skip
        doc["summary"] = summarize(doc["runs"])
        if on_update:
            on_update(doc)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    doc["summary"] = summarize(doc["runs"])
    return doc


def _finished_runs(previous: dict[str, Any], doc: dict[str, Any]) -> list[dict[str, Any]]:
    """``previous``'s runs with both sides done, after checking that it compares the same thing
    as ``doc`` (settings but the seeds, official commit)."""
    a = {k: v for k, v in previous.get("settings", {}).items() if k != "seeds"}
    b = {k: v for k, v in doc["settings"].items() if k != "seeds"}
    differ = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    if previous.get("official_code") != doc["official_code"]:
        differ.append("official_code")
    if differ:
        raise PreviousMismatch(f"--previous results were made with other settings: {differ}")
    return [r for r in previous.get("runs", []) if "ours" in r and "official" in r]


def load_data(corpus_dir: Path, s: Settings) -> Any:
    """The study's token corpus: ``train`` windows for training, ``tune`` for validation
    (``s.val_tokens`` of it, evenly spread), windows of ``seq_len + 1`` tokens."""
    from poetxq.data.corpus import TokenCorpus, token_data

    corpus = TokenCorpus.open(corpus_dir)
    return token_data(corpus, s.seq_len, heldout="tune", max_val_tokens=s.val_tokens)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument(
        "--poet-lr",
        type=float,
        default=8e-3,
        help="rotation lr before the POET scale (both sides: x0.5 at @3a34bb6)",
    )
    ap.add_argument("--lr", type=float, default=1e-2, help="embeddings, lm_head, norms")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--model", default="llama-60m", help="recipes/models name")
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--merge-interval", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--precision", default="autocast", choices=["autocast", "bf16-true", "fp32"])
    ap.add_argument("--val-tokens", type=int, default=1_048_576)
    ap.add_argument("--corpus", default=str(REPO / "data" / "quality-corpus"))
    ap.add_argument(
        "--official",
        default=None,
        help="folder holding poet_torch/ (default $POETXQ_OFFICIAL_DIR or .official/)",
    )
    ap.add_argument(
        "--official-compile",
        action="store_true",
        help="torch.compile the official model as its script does (default: eager)",
    )
    ap.add_argument("--work-dir", default=None, help="our run directories (default: a temp dir)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="model.KEY=VALUE",
        help="model shape override (repeatable; smoke tests on a small model)",
    )
    ap.add_argument(
        "--previous",
        default=None,
        help="results JSON of an earlier call with the "
        "same settings: its finished seeds are kept and not run again",
    )
    ap.add_argument("--out", required=True, help="JSON file to write")
    args = ap.parse_args(argv)  # fmt: skip
    overrides: dict[str, Any] = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key.startswith("model."):
            ap.error(f"--set {item!r}: only model.KEY=VALUE (the shape both sides build)")
        overrides[key] = yaml.safe_load(value)
    previous = None
    if args.previous:
        try:
            previous = json.loads(Path(args.previous).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            ap.error(f"--previous {args.previous}: {exc}")
    try:
        poet = official_poet.load(args.official)
    except official_poet.OfficialNotFound as exc:
        print(f"parity_official: error: {exc}", file=sys.stderr)
        return 2
    s = Settings(
        steps=args.steps, poet_lr=args.poet_lr, lr=args.lr, eval_every=args.eval_every,
        seeds=args.seeds, model=args.model, block_size=args.block_size,
        merge_interval=args.merge_interval, batch_size=args.batch_size,
        grad_accum=args.grad_accum, seq_len=args.seq_len, precision=args.precision,
        val_tokens=args.val_tokens, model_overrides=overrides,
    )  # fmt: skip
    device = torch.device(args.device)
    data = load_data(Path(args.corpus), s)
    head = provenance(device_name(device), argv)
    out = Path(args.out)
    commit = official_commit_of(official_poet.official_dir(args.official))

    def echo(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    def write(doc: dict[str, Any]) -> None:
        write_json_atomic(out, {**head, **doc})

    with contextlib.ExitStack() as stack:
        work = Path(args.work_dir) if args.work_dir else Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="parity-")))  # fmt: skip
        try:
            doc = run_parity(s, poet, data, device=device, work=work, official_commit=commit,
                             compile_official=args.official_compile, echo=echo,
                             on_update=write, previous=previous)  # fmt: skip
        except PreviousMismatch as exc:
            print(f"parity_official: error: {exc}", file=sys.stderr)
            return 2
    write(doc)
    summ = doc["summary"]
    for row in summ["steps"]:
        se = "" if row["se"] is None else f" (SE {row['se']:.4f}, agree {row['agree']})"
        echo(f"step {row['step']}: ours {row['ours']:.4f}, official {row['official']:.4f}, "
             f"diff {row['difference']:+.4f}{se}")  # fmt: skip
    print(out)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
