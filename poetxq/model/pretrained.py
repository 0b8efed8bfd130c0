"""The way in: continue a pretrained transformers Llama-family checkpoint with POET-X(Q).

``poetxq quantize-and-train --model DIR`` (recipe key ``model.pretrained``) loads the checkpoint
with ``AutoModelForCausalLM.from_pretrained`` in fp32, keeps its architecture (the recipe's
``model`` section is ignored, with a note), its tokenizer (``AutoTokenizer`` from the same
directory, through the data layer's Hugging Face tokenizer path) and its weights: each target
projection's weight becomes ``W0`` as it is — quantized to int8 / NF4 / FP4, with no
re-initialisation and no row normalisation (:func:`poetxq.model.surgery.convert_to_poetx` with
``keep_weights=True``). With ``R = P = I`` at step 0 the model computes the checkpoint's function
up to the quantization error of ``W0``.

A hub id is tried only when it is not a local path; with no reachable hub the error says so in one
line.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from poetxq.model.config import check_block_size

#: model types whose projections are named q/k/v/o_proj and gate/up/down_proj
LLAMA_FAMILY: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3")


class PretrainedError(ValueError):
    """A ``--model`` checkpoint cannot be used; the message is one line naming the fix."""


def resolve_pretrained(ref: str) -> str:
    """Where to load ``ref`` from: a local checkpoint directory, or a reachable hub id.

    Args:
        ref: a directory holding ``config.json`` (``save_pretrained`` output), a named base of
            :data:`poetxq.model.bases.NAMED_BASES` (``smollm2-135m``) or a hub id ``owner/name``.

    Returns:
        The local directory (resolved, as a string) or the hub id.

    Raises:
        PretrainedError: a local path that is missing, a named base that cannot be provided
            (its package is not installed), a poetxq run directory (export it first),
            a directory without ``config.json``, or a hub id that cannot be fetched (no network,
            unknown repository).
    """
    path = Path(os.path.expanduser(ref))
    if path.is_dir():
        if (path / "recipe.yaml").is_file() and (path / "metrics.jsonl").is_file():
            # every method's run exports as hf-bf16 (the baselines' int8 groups dequantized)
            raise PretrainedError(
                f"'{ref}' is a poetxq run directory, not a Hugging Face checkpoint; export it "
                f"first (poetxq export {ref} --format hf-bf16 OUT_DIR) and pass OUT_DIR"
            )
        if not (path / "config.json").is_file():
            raise PretrainedError(
                f"'{ref}' holds no config.json; pass a directory written by save_pretrained"
            )
        return str(path.resolve())
    from poetxq.model.bases import NAMED_BASES, NamedBaseError, named_base_dir

    if ref in NAMED_BASES:  # e.g. smollm2-135m, converted once into the model cache
        try:
            return str(named_base_dir(ref))
        except NamedBaseError as exc:
            raise PretrainedError(str(exc)) from None
    parts = ref.split("/")
    is_hub_id = len(parts) == 2 and all(parts) and not ref.startswith((".", "~", "/"))
    if not is_hub_id:
        raise PretrainedError(
            f"model '{ref}' is not an existing directory; pass a checkpoint directory written by "
            "save_pretrained (or a hub id owner/name)"
        )
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(
            ref, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken"]
        )
    except Exception as exc:  # offline, unknown repo, gated, ...
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise PretrainedError(
            f"model '{ref}' is not a local directory and cannot be fetched from the Hugging Face "
            f"hub ({type(exc).__name__}: {first}); pass a local checkpoint directory"
        ) from None


def check_seq_len(
    config: Any, seq_len: int, ref: str, flag: str = "--seq-len (train.seq_len)"
) -> None:
    """A pretrained model is trained at most at its own ``max_position_embeddings``; ``flag``
    names the setting in the error (``poetxq fpo-adapt`` has no recipe: ``--seq-len``).

    poetxq does not extend RoPE (no rope scaling is set up), so a longer ``seq_len`` would feed
    the checkpoint positions it never saw; that is an error, not a silent change.

    Raises:
        PretrainedError: ``seq_len`` exceeds ``config.max_position_embeddings``.
    """
    max_pos = getattr(config, "max_position_embeddings", None)
    if max_pos is not None and seq_len > max_pos:
        raise PretrainedError(
            f"{flag} {seq_len} exceeds the max_position_embeddings {max_pos} "
            f"of '{ref}'; poetxq does not extend a checkpoint's RoPE: use --seq-len {max_pos} "
            "or less"
        )


def check_pretrained_config(
    path: str,
    seq_len: int | None = None,
    block_size: int | None = None,
    families: Sequence[str] = LLAMA_FAMILY,
    command: str | None = None,
) -> Any:
    """Read ``path``'s transformers config and check it is an unquantized Llama-family model.

    Args:
        path: a local checkpoint directory.
        seq_len: the run's ``train.seq_len``, checked against the model's
            ``max_position_embeddings`` (:func:`check_seq_len`); None skips that check.
        block_size: the run's ``poet.block_size`` ``b``, which must not exceed the model's
            smallest layer dimension; None skips that check.
        families: the accepted ``model_type`` values (FPO takes more than POET surgery).
        command: the command the error names (``fpo-adapt``; default: ``--model``, the flag of
            train and bench).

    Returns:
        The ``PretrainedConfig``.

    Raises:
        PretrainedError: unreadable config, a model type outside ``families``, an
            already quantized checkpoint, ``seq_len`` beyond its positions, or ``block_size``
            above its smallest layer dimension.
    """
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as exc:
        raise PretrainedError(
            f"cannot read the config of '{path}': {exc}".splitlines()[0]
        ) from None
    if config.model_type not in families:
        what = "Llama-family checkpoints" if tuple(families) == LLAMA_FAMILY else "checkpoints"
        raise PretrainedError(
            f"'{path}' has model_type {config.model_type!r}; {command or '--model'} takes {what} "
            f"(model_type {', '.join(families)})"
        )
    if getattr(config, "quantization_config", None):
        raise PretrainedError(
            f"'{path}' is already quantized ({config.quantization_config.get('quant_method')}); "
            "pass an unquantized (bf16/fp32) checkpoint"
        )
    if seq_len is not None:
        check_seq_len(config, seq_len, path)
    dims = [getattr(config, k, None) for k in ("hidden_size", "intermediate_size")]
    heads, kv_heads = (getattr(config, k, None) for k in ("num_attention_heads",
                                                           "num_key_value_heads"))  # fmt: skip
    head_dim = getattr(config, "head_dim", None)
    if isinstance(dims[0], int) and isinstance(heads, int) and not isinstance(head_dim, int):
        head_dim = dims[0] // heads
    if isinstance(kv_heads, int) and isinstance(head_dim, int):
        dims.append(kv_heads * head_dim)  # k_proj / v_proj rows under grouped-query attention
    if block_size is not None:
        try:
            check_block_size(block_size, dims, f" of '{path}'")
        except ValueError as exc:
            raise PretrainedError(str(exc)) from None
    return config


def load_error_line(path: str, exc: BaseException) -> str:
    """The one line for a checkpoint that ``from_pretrained`` could not load.

    A pickle weights file (``pytorch_model.bin``) that holds more than tensors is refused by
    torch's ``weights_only`` loader, whose message suggests loading it again with
    ``weights_only=False``: that would run whatever code the file names. That advice is not
    passed on; the line says what the file is and asks for a safetensors copy instead.
    """
    import pickle
    import re

    text = str(exc)
    if isinstance(exc, pickle.UnpicklingError) or "weights_only" in text:
        named = re.search(r"GLOBAL ([\w.]+)", text)
        what = f" (it names {named.group(1)[:80]})" if named else ""
        return (
            f"cannot load '{path}': its weights are a pickle file that holds more than tensors"
            f"{what}, and poetxq does not unpickle such a file (loading it could run code from "
            "it); get the checkpoint as safetensors (model.safetensors) from its source"
        )
    return f"cannot load '{path}': {text}".splitlines()[0]


def load_pretrained(
    path: str, families: Sequence[str] = LLAMA_FAMILY, *, progress: bool = True
) -> nn.Module:
    """``AutoModelForCausalLM.from_pretrained(path)`` in fp32 on the CPU, checked for its family.

    Args:
        path: a local checkpoint directory.
        families: the accepted ``model_type`` values (default :data:`LLAMA_FAMILY`).
        progress: False turns transformers' progress bars (``Loading weights``) off for the
            load (``--no-progress``); their previous setting is restored after it.

    Raises:
        PretrainedError: unreadable checkpoint or a model type outside ``families``.
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    check_pretrained_config(path, families=families)
    was_on = hf_logging.is_progress_bar_enabled()
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    except Exception as exc:
        raise PretrainedError(load_error_line(path, exc)) from None
    finally:
        if was_on and not progress:
            hf_logging.enable_progress_bar()
    model.config._attn_implementation = "sdpa"
    return model


#: the ``optim`` rates a ``--model`` run takes when its recipe does not set them: the recipes'
#: rates are pretraining rates and wreck a trained model within a few steps; these keep the
#: validation perplexity of SmolLM2-135M from rising (evals/continued_training_sweep.py,
#: evals/results/continued_training_smollm2_cpu.json; docs/EXPORT.md)
CONTINUED_TRAINING_RATES: dict[str, float] = {"lr": 1e-4, "poet_lr": 1e-4}


def continued_training_rates(optim: Any) -> tuple[dict[str, float], str | None]:
    """The continued-training rates a ``--model`` run takes where its recipe left the rates at
    their defaults (the recipe fills them in at construction,
    :func:`poetxq.training.recipe.dependent_defaults`; ``optim`` is not changed).

    A rate the user set (in a recipe file, ``--set``, ``--lr`` or ``--poet-lr``; pydantic's
    ``model_fields_set`` of the section) is kept; each other rate of
    :data:`CONTINUED_TRAINING_RATES` replaces the schema's pretraining default.

    Args:
        optim: the recipe's ``optim`` section (:class:`poetxq.training.recipe.OptimConfig`).

    Returns:
        ``(rates, note)``: the rates to take (key -> value, empty when the recipe set every
        rate itself) and the note to print (which rates were taken, and why; which were kept),
        or None.
    """
    explicit = set(optim.model_fields_set)
    taken = {k: v for k, v in CONTINUED_TRAINING_RATES.items() if k not in explicit}
    if not taken:
        return {}, None
    kept = [f"optim.{k} {getattr(optim, k):g}" for k in CONTINUED_TRAINING_RATES if k in explicit]
    note = (
        "--model continues a pretrained checkpoint: "
        + ", ".join(f"optim.{k} {v:g}" for k, v in taken.items())
        + " (continued-training default"
        + ("s" if len(taken) > 1 else "")
        + "; the recipe defaults are pretraining rates that raise a trained model's validation "
        "perplexity within a few steps, docs/EXPORT.md)"
    )
    if kept:
        note += f"; kept {', '.join(kept)} as set"
    return taken, note
