"""Parity with the official POET-XQ, the settings: one comparison's :class:`Settings`, how they
map onto our recipe (:func:`recipe_overrides`, :func:`our_recipe`) and onto the official loop
(:func:`official_lr_factor`, the clip constants, :func:`official_poet_scale`), the micro-batch
source both sides share (:func:`train_batches`), and the mapping and differences written into the
JSON (:func:`mapping`, :data:`DIFFERENCES`). The entry point is ``evals/parity_official.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

#: the official training script's ``gd_warmup_steps`` default: the post-merge clip re-warm runs
#: only up to this step (``calc_poet_grad_clipping_value(max_steps=...)``)
OFFICIAL_GD_WARMUP_STEPS = 2000
#: ``calc_poet_grad_clipping_value`` as the official script calls it: re-warm over 10 steps
#: from 0.1x (the same numbers as our ``optim.clip_rewarm_steps`` and its fixed 0.1 start)
OFFICIAL_CLIP_WARMUP_STEPS, OFFICIAL_CLIP_MIN_RATIO = 10, 0.1


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
