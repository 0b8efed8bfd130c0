"""The way out: a POET-X(Q) run directory as a Hugging Face / bitsandbytes checkpoint.

:func:`load_run` rebuilds a finished run's model in memory (the run directory is only read);
:func:`export_run` merges and writes it in one of :data:`~poetxq.tools.export_weights.FORMATS`
(how each layer's weight is written: :mod:`poetxq.tools.export_weights`), with its tokenizer
and a ``config.json`` that ``AutoModelForCausalLM.from_pretrained`` reads.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from poetxq.model.layer import POETXLinear
from poetxq.tools.export_weights import (
    EXPORT_MERGE_SEED,
    FORMATS,
    bnb_config,
    is_merged,
    merged_state_dict,
    writes_stored_codes,
)
from poetxq.training.recipe import POET_METHODS, Recipe, RecipeError
from poetxq.training.recipe_files import load_recipe
from poetxq.training.rundir import CONFIG_FILE, TOKENIZER_DIR, as_hf_tokenizer


class ExportError(ValueError):
    """A run cannot be exported as asked; the message is one line naming the fix."""


@dataclass
class LoadedRun:
    """A run directory read back: its recipe, the POET-X(Q) model and the tokenizer."""

    recipe: Recipe
    model: nn.Module  # transformers causal LM with POETXLinear layers, fp32, eval mode
    tokenizer: Any  # transformers tokenizer
    config: Any  # transformers PretrainedConfig


def _one_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    text = "; ".join(lines[1:] if len(lines) > 1 and lines[0].endswith(":") else lines)
    return text[:400]


def _read_run_recipe(run: Path) -> Recipe:
    """The recipe of the finished run directory ``run`` (``recipe.yaml``), read before any
    weights are.

    Raises:
        ExportError: not a finished run directory (an unfinished one names ``--resume``), an
            unreadable recipe, or a method export does not know.
    """
    from poetxq.training.baseline_methods import BASELINE_METHODS

    ckpt = run / "model.safetensors"
    if not run.is_dir() or not ckpt.is_file() or not (run / "recipe.yaml").is_file():
        if (run / "checkpoints").is_dir():  # an interrupted run: its checkpoints hold the model
            raise ExportError(
                f"'{run}' is a run that has not finished (no model.safetensors, only "
                f"checkpoints); finish it with 'poetxq train --resume {run}', then export it"
            )
        raise ExportError(
            f"'{run}' is not a finished run directory (needs recipe.yaml and model.safetensors); "
            "pass a directory written by 'poetxq quantize-and-train'"
        )
    try:
        recipe = load_recipe(run / "recipe.yaml")
    except RecipeError as exc:
        raise ExportError(f"{run}: {exc}") from None
    if recipe.method not in POET_METHODS + BASELINE_METHODS:
        raise ExportError(f"{run} was trained with method {recipe.method!r}, which export does "
                          "not know; pass a run of poetxq, poetx or a baseline")  # fmt: skip
    return recipe


def load_run(
    run_dir: str | Path, *, echo: Callable[[str], None] = print, recipe: Recipe | None = None
) -> LoadedRun:
    """Rebuild a finished run's model from ``run_dir`` (recipe.yaml + model.safetensors).

    The model is rebuilt from ``config.json`` (written by :func:`save_run_artifacts`; runs from
    before it was written fall back to the recipe's ``model`` section), converted with the
    recipe's ``poet`` section (a baseline run: its Q-GaLore / Q-APOLLO int8 layers) and loaded
    strictly from ``model.safetensors``. A baseline run's int8 layers are then dequantized into
    plain ``nn.Linear`` (fp32): its model is a transformers Llama again.

    Args:
        recipe: the run's recipe where the caller has read it already (:func:`_read_run_recipe`).

    Raises:
        ExportError: not a run directory, an unknown method, or a checkpoint that does not
            match (missing/corrupt 4-bit quant_state, wrong shapes).
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from poetxq.model.surgery import build_llama, convert_to_poetx
    from poetxq.training.baseline_methods import prepare_baseline

    run = Path(run_dir)
    ckpt = run / "model.safetensors"
    recipe = recipe or _read_run_recipe(run)
    try:
        state = load_file(str(ckpt))
    except (SafetensorError, OSError) as exc:
        from poetxq.training.checkpoint import latest_checkpoint

        newest = latest_checkpoint(run)
        fix = (f"; the file is damaged: export the run's newest checkpoint instead "
               f"(poetxq export {newest} ...)" if newest is not None else "")  # fmt: skip
        raise ExportError(f"cannot read {ckpt}: {_one_line(exc)}{fix}") from None
    bad = [k for k, t in state.items() if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:  # a damaged file, or a run saved after diverging: never export it silently
        raise ExportError(
            f"{ckpt} holds NaN/inf values in {len(bad)} tensors (e.g. {bad[0]}); the file is "
            "damaged or the run diverged — export an earlier checkpoint's run instead"
        )
    if (run / CONFIG_FILE).is_file():
        try:
            config = AutoConfig.from_pretrained(str(run))
        except (OSError, ValueError) as exc:  # transformers' words for a damaged file
            raise ExportError(
                f"cannot read {run / CONFIG_FILE} ({_one_line(exc)}); the run directory is "
                f"damaged: restore the file, or delete it to rebuild the model from the run's "
                "recipe.yaml"
            ) from None
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    else:
        emb = state.get("model.embed_tokens.weight")
        if emb is None:
            raise ExportError(f"{ckpt} has no model.embed_tokens.weight; not a poetxq checkpoint")
        echo(f"note: {run} has no {CONFIG_FILE}; model rebuilt from the recipe's model section")
        model = build_llama(recipe.model, emb.shape[0])
        config = model.config
    if recipe.method in POET_METHODS:
        convert_to_poetx(model, recipe.poet, generator=torch.Generator().manual_seed(0))
    else:
        prepare_baseline(model, recipe.method, recipe.baseline)  # its int8 layers, if any
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise ExportError(f"{ckpt} does not match its recipe: {_one_line(exc)}") from None
    if recipe.method not in POET_METHODS:
        _dequantize_baseline(model)
    model.eval()
    return LoadedRun(recipe, model, _load_run_tokenizer(run, recipe, echo), config)


def _load_run_tokenizer(run: Path, recipe: Recipe, echo: Callable[[str], None]) -> Any:
    from transformers import AutoTokenizer

    if (run / TOKENIZER_DIR).is_dir():
        return AutoTokenizer.from_pretrained(str(run / TOKENIZER_DIR))
    # Runs from before tokenizer/ was saved: the data layer rebuilds it (from its cache).
    from poetxq.data import prepare_data

    echo(f"note: {run} has no {TOKENIZER_DIR}/; tokenizer rebuilt from the recipe's data section")
    data = prepare_data(recipe.data, recipe.train.seq_len, progress=False)
    return as_hf_tokenizer(data.tokenizer, data.eos_id)


def _check_out_dir(out: Path, overwrite: bool, run_dir: Path | None = None) -> None:
    if run_dir is not None:
        src, dst = run_dir.resolve(), out.resolve()
        if src == dst or src.is_relative_to(dst) or dst.is_relative_to(src):
            raise ExportError(
                f"output directory '{out}' overlaps the run directory '{run_dir}' (exporting there "
                "would replace the run); choose a directory outside the run"
            )
    if out.exists() and not out.is_dir():
        raise ExportError(f"'{out}' exists and is not a directory; choose another output directory")
    if out.is_dir() and any(out.iterdir()):
        previous = (out / "poetxq_export.json").is_file()  # --overwrite replaces exports only
        if not overwrite and previous:
            raise ExportError(
                f"output directory '{out}' holds a previous export; pass --overwrite to replace "
                "it or choose another directory"
            )
        if not previous:
            raise ExportError(
                f"output directory '{out}' exists, is not empty and holds no previous export "
                "(poetxq_export.json); choose an empty or new output directory"
            )
    if not out.parent.exists():
        raise ExportError(f"parent directory '{out.parent}' does not exist; create it first")


def _dequantize_baseline(model: nn.Module) -> None:
    """Replace every Q-GaLore / Q-APOLLO ``QuantLinear`` of ``model`` by an ``nn.Linear`` holding
    its dequantized weight (fp32 ``[out, in]``; bias kept), in place."""
    from poetxq.baselines.qlinear import QuantLinear

    for name, mod in list(model.named_modules()):
        if isinstance(mod, QuantLinear):
            dense = nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None)
            with torch.no_grad():
                dense.weight.copy_(mod.dequantize(torch.float32))
                if mod.bias is not None:
                    dense.bias.copy_(mod.bias)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, dense)


def export_run(
    run_dir: str | Path,
    fmt: str,
    out_dir: str | Path,
    *,
    overwrite: bool = False,
    quant_type: str | None = None,
    echo: Callable[[str], None] = print,
) -> Path:
    """Write ``run_dir`` as a Hugging Face model directory in ``fmt`` at ``out_dir``, atomically.

    The directory holds ``config.json`` (with ``quantization_config`` for the bnb formats),
    ``model.safetensors``, ``generation_config.json`` when the model has one, and the tokenizer
    files; ``transformers.AutoModelForCausalLM.from_pretrained(out_dir)`` loads it. Everything is
    written into a temporary sibling directory first and renamed into place at the end, so a
    failed export leaves ``out_dir`` as it was. ``run_dir`` is only read: ``out_dir`` may not lie
    in it (or contain it), and the merges of ``hf-bnb8``/``hf-bnb4`` (module docstring) happen on
    the model in memory, with a generator seeded :data:`EXPORT_MERGE_SEED` (reproducible).

    Args:
        run_dir: a finished run directory.
        fmt: ``"hf-bf16"``, ``"hf-bnb8"`` or ``"hf-bnb4"``.
        out_dir: output directory; must be absent or empty unless ``overwrite``.
        overwrite: replace a non-empty ``out_dir`` that holds a previous export
            (``poetxq_export.json``); any other non-empty directory is refused.
        quant_type: 4-bit code for ``hf-bnb4`` (default: the run's ``poet.quant_type``).
        echo: where the summary line goes.

    Returns:
        ``out_dir`` as a ``Path``.

    Raises:
        ExportError: bad format, unusable output directory or run directory (one line).
    """
    from poetxq.training.checkpoint import save_safetensors

    if fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    out = Path(out_dir).resolve()  # "." must name the directory, not build ".tmp" inside it
    _check_out_dir(out, overwrite, Path(run_dir))
    recipe = _read_run_recipe(Path(run_dir))  # refusals before the weights are read
    method = recipe.method
    baseline = method not in POET_METHODS
    if baseline and fmt != "hf-bf16":
        raise ExportError(
            f"{method} runs export as hf-bf16 only (their weights are not stored in a "
            "bitsandbytes layout); pass --format hf-bf16"
        )
    run = load_run(run_dir, echo=echo, recipe=recipe)
    model, config = run.model, run.config
    qt = quant_type or run.recipe.poet.quant_type
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, POETXLinear)]
    if fmt == "hf-bnb4":
        straddle = [n for n, m in layers if m.in_features % 64 and m.in_features % 16 == 0]
        if straddle:
            echo(
                f"warning: {len(straddle)} layers (e.g. {straddle[0]}) have in_features not a "
                "multiple of 64; on the CPU bitsandbytes 0.50.2 misreads such blocks or fails "
                "in the forward pass of the loaded model (expected fine on a GPU, not yet checked)"
            )
    tie = bool(getattr(config, "tie_word_embeddings", False))
    config = config.__class__.from_dict(config.to_dict())  # a copy we may edit
    config.dtype = torch.bfloat16
    if fmt != "hf-bf16":
        config.quantization_config = bnb_config(model, fmt, qt)
    as_stored = [n for n, m in layers if writes_stored_codes(m, fmt, qt)]
    needs_merge = sum(1 for n, m in layers if writes_stored_codes(m, fmt, qt) and not is_merged(m))
    rounded = len(layers) - len(as_stored)
    if fmt != "hf-bf16" and as_stored and rounded:
        first = next(n for n, _ in layers if n not in set(as_stored))
        echo(
            f"note: {rounded} layers (e.g. {first}) are not stored as {fmt} holds them (another "
            "format or code, or in_features not a multiple of 64); their R·W0·P is rounded into "
            f"{fmt} afresh, one more rounding than the run's model"
        )
    state = merged_state_dict(model, fmt, quant_type=qt)  # merges `as_stored` layers in memory
    if tie:
        state.pop("lm_head.weight", None)

    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        try:
            tmp.mkdir()
        except OSError as exc:
            raise ExportError(
                f"cannot write the export next to '{out}' ({exc.strerror or exc}); choose an "
                "output directory in a folder you can write"
            ) from None
        config.save_pretrained(str(tmp))
        gen_cfg = getattr(model, "generation_config", None)
        if gen_cfg is not None and getattr(model, "can_generate", lambda: False)():
            gen_cfg.save_pretrained(str(tmp))
        save_safetensors(state, tmp / "model.safetensors")
        run.tokenizer.save_pretrained(str(tmp))
        (tmp / "poetxq_export.json").write_text(
            json.dumps(
                {"run_dir": str(Path(run_dir).resolve()), "format": fmt,
                 "quant_type": qt if fmt == "hf-bnb4" else None, "layers_merged": len(layers),
                 "layers_stored_codes": len(as_stored), "layers_merged_as_training": needs_merge,
                 "merge_seed": EXPORT_MERGE_SEED},
                indent=2,
            ),
            encoding="utf-8",
        )  # fmt: skip
        if out.exists():
            os.replace(out, old)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    kind = {"hf-bf16": "bf16", "hf-bnb8": "int8 row-wise (Linear8bitLt)",
            "hf-bnb4": f"{qt.upper()} blocksize 64, double quant (Linear4bit)"}[fmt]  # fmt: skip
    if baseline:
        how = f"{run.recipe.method} weights" + (
            " (int8 groups dequantized)" if run.recipe.method.startswith("q") else "")  # fmt: skip
    elif as_stored:
        how = (
            f"{len(as_stored)} POET layers merged as a training merge does ({needs_merge} had "
            "R, P != I) and their stored codes written un-permuted"
            + (f", {rounded} rounded afresh from R·W0·P" if rounded else "")
        )
    else:
        how = f"{len(layers)} POET layers' R·W0·P in original coordinates rounded once"
    echo(
        f"exported {run_dir} -> {out} ({fmt}): {how}, stored {kind}; other tensors bf16; "
        f"tokenizer included; {run_dir} not modified"
    )
    return out
