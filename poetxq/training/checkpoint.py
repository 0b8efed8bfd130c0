"""Full training-state checkpoints: write atomically, find, verify, load, resume exactly.

A checkpoint is a directory ``<run_dir>/checkpoints/step-<8-digit step>/`` holding:

* ``model.safetensors`` — ``model.state_dict()``: trainable parameters (``Q``, embeddings, norms,
  ``lm_head``) and every buffer, i.e. the frozen low-bit weights with their quantization state
  (int8 ``weight``/``SCB``/``weight_format``; NF4 ``weight``/``absmax``/``quant_map``/nested
  statistics/``quant_state``; Q-GaLore/Q-APOLLO codes, ``scales``, ``zeros``) and the POET
  permutations ``perm``/``inv_perm``.
* ``state.safetensors`` — every tensor of the optimizer state (Adam moments, 8-bit moment codes
  and their absmax, INT4 projector codes, APOLLO projections, step tensors, the stochastic-rounding
  generator) and the RNG states (torch CPU, CUDA, numpy's MT19937 key, named generators such as the
  POET merge generator).
* ``recipe.yaml`` — the resolved recipe of the run.
* ``state.json`` — everything else, as JSON: format and version, the step, the loop state (merge
  counter, steps since the last merge, data position, initial validation perplexity, ...), the
  non-tensor optimizer state with ``{"__tensor__": key}`` placeholders, the scheduler state, the
  Python ``random`` state, numpy's position, and the size and SHA-256 of every other file.

Nothing is pickled; tensors are read with safetensors only.

Writing is atomic: files go to ``checkpoints/.tmp-step-...-<pid>/``, are fsynced, and the
directory is renamed to ``step-...`` (then the parent is fsynced). A crash at any point leaves the
previous ``step-*`` directories untouched; a stale temp directory is removed by the next save.
Only after the new checkpoint is complete are the oldest ones beyond ``keep_last`` deleted.

What ``--resume`` continues, and which recipe edits it allows: :mod:`poetxq.training.resume`.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from poetxq.paths import file_sha256

FORMAT = "poetxq-training-checkpoint"
VERSION = 1
CHECKPOINT_DIR = "checkpoints"
_STEP_DIR = re.compile(r"^step-(\d{8})$")
_FILES = ("model.safetensors", "state.safetensors", "recipe.yaml")


class CheckpointError(ValueError):
    """A checkpoint cannot be used: missing, incomplete, corrupted or from another recipe."""


# ------------------------------------------------------------------------------------------------
# JSON + safetensors encoding of nested state (optimizer / scheduler state dicts)
# ------------------------------------------------------------------------------------------------


def encode_state(obj: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    """Turn a nested state (dicts, lists, tuples, scalars, tensors) into JSON-able data.

    Tensors are moved to ``tensors`` (CPU, contiguous) under ``prefix``-derived keys and replaced
    by ``{"__tensor__": key}``; tuples become ``{"__tuple__": [...]}``; dicts whose keys are not
    all strings become ``{"__dict__": [[key, value], ...]}`` (keys kept as JSON scalars).

    Raises:
        CheckpointError: an object of another type (names its path).
    """
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        # a copy of its own: optimizers may share one tensor between states (bitsandbytes' qmaps),
        # and safetensors refuses shared storage; a device tensor is copied by .cpu() anyway
        t = t.cpu() if t.device.type != "cpu" else t.clone()
        tensors[prefix] = t.contiguous()
        return {"__tensor__": prefix}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {k: encode_state(v, f"{prefix}.{k}", tensors) for k, v in obj.items()}
        return {
            "__dict__": [[k, encode_state(v, f"{prefix}.{k}", tensors)] for k, v in obj.items()]
        }
    if isinstance(obj, tuple):
        return {"__tuple__": [encode_state(v, f"{prefix}.{i}", tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [encode_state(v, f"{prefix}.{i}", tensors) for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise CheckpointError(f"cannot store {type(obj).__name__} at '{prefix}' in a checkpoint")


def decode_state(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of :func:`encode_state`.

    Raises:
        CheckpointError: a ``__tensor__`` key absent from ``tensors``.
    """
    if isinstance(obj, dict):
        if set(obj) == {"__tensor__"}:
            key = obj["__tensor__"]
            if key not in tensors:
                raise CheckpointError(f"tensor '{key}' is missing from state.safetensors")
            return tensors[key]
        if set(obj) == {"__tuple__"}:
            return tuple(decode_state(v, tensors) for v in obj["__tuple__"])
        if set(obj) == {"__dict__"}:
            return {k: decode_state(v, tensors) for k, v in obj["__dict__"]}
        return {k: decode_state(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode_state(v, tensors) for v in obj]
    return obj


# ------------------------------------------------------------------------------------------------
# RNG states
# ------------------------------------------------------------------------------------------------


def capture_rng(
    generators: dict[str, torch.Generator], tensors: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """Record torch (CPU and every CUDA device), numpy, Python ``random`` and ``generators``.

    Tensor parts go to ``tensors`` under ``rng.*``; returns the JSON part.
    """
    tensors["rng.torch"] = torch.get_rng_state()
    cuda = 0
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{i}"] = s
        cuda = torch.cuda.device_count()
    np_state = np.random.get_state(legacy=False)
    tensors["rng.numpy.key"] = torch.from_numpy(np_state["state"]["key"].astype(np.int64))
    for name, gen in generators.items():
        tensors[f"rng.gen.{name}"] = gen.get_state()
    version, internal, gauss = random.getstate()
    return {
        "cuda_devices": cuda,
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "python": [version, list(internal), gauss],
        "generators": sorted(generators),
    }


def restore_rng(
    meta: dict[str, Any], tensors: dict[str, torch.Tensor], generators: dict[str, torch.Generator]
) -> None:
    """Inverse of :func:`capture_rng` (CUDA states only for devices present on both sides).

    Raises:
        CheckpointError: a named generator of ``generators`` was not saved.
    """
    torch.set_rng_state(tensors["rng.torch"])
    if meta["cuda_devices"] and torch.cuda.is_available():
        for i in range(min(meta["cuda_devices"], torch.cuda.device_count())):
            torch.cuda.set_rng_state(tensors[f"rng.cuda.{i}"], i)
    n = meta["numpy"]
    np.random.set_state(
        {
            "bit_generator": n["bit_generator"],
            "state": {"key": tensors["rng.numpy.key"].numpy().astype(np.uint32), "pos": n["pos"]},
            "has_gauss": n["has_gauss"],
            "gauss": n["gauss"],
        }
    )
    version, internal, gauss = meta["python"]
    random.setstate((version, tuple(internal), gauss))
    for name, gen in generators.items():
        key = f"rng.gen.{name}"
        if key not in tensors:
            raise CheckpointError(f"checkpoint has no state for generator '{name}'")
        gen.set_state(tensors[key])


# ------------------------------------------------------------------------------------------------
# Files
# ------------------------------------------------------------------------------------------------


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of ``run_dir`` as ``(step, path)``, oldest first (temp dirs ignored)."""
    root = Path(run_dir) / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint directory of ``run_dir``, or None."""
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None


def _remove_stale(root: Path) -> None:
    for p in root.glob(".tmp-step-*"):
        shutil.rmtree(p, ignore_errors=True)
    for p in root.glob(".old-step-*"):
        shutil.rmtree(p, ignore_errors=True)


def distinct_storage(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with a copy of every tensor whose bytes overlap an earlier one's (tied weights
    such as ``lm_head.weight`` = ``embed_tokens.weight``): safetensors refuses overlapping
    tensors. Views of disjoint parts of one buffer (:class:`poetxq.model.flat.FlatParams`) are kept
    as they are. Loading back and re-tying gives the same model."""
    seen: dict[tuple[Any, int], list[tuple[int, int]]] = {}
    out = {}
    for name, t in tensors.items():
        if t.numel():
            start = t.data_ptr()
            end = start + t.numel() * t.element_size()  # contiguous tensors (as saved)
            spans = seen.setdefault((t.device, t.untyped_storage().data_ptr()), [])
            if any(s < end and start < e for s, e in spans):
                t = t.clone()
            else:
                spans.append((start, end))
        out[name] = t
    return out


def _tied_names(state: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    """Each name of ``state`` → every name holding the very same tensor (tied weights)."""
    by_tensor: dict[tuple[Any, ...], list[str]] = {}
    for name, t in state.items():
        key = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride()) if t.numel() else name
        by_tensor.setdefault(key, []).append(name)
    return {name: names for names in by_tensor.values() for name in names}


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with each tied tensor once, under its alphabetically first name
    (what ``safetensors.torch.save_model`` keeps). Unlike ``save_model`` this accepts parameters
    that are views into a larger buffer (:class:`poetxq.model.flat.FlatParams`)."""
    state = model.state_dict()
    tied = _tied_names(state)
    return {name: t.contiguous() for name, t in state.items() if min(tied[name]) == name}


def load_model_tensors(model: nn.Module, path: Path) -> tuple[list[str], list[str]]:
    """Load a :func:`model_tensors` file (or one by ``safetensors.torch.save_model``) into
    ``model`` in place (parameters keep their storage).

    Returns:
        ``(missing, unexpected)`` names; a tied name counts as present when one of its ties is.

    Raises:
        safetensors.SafetensorError, OSError: unreadable file. RuntimeError: a shape mismatch.
    """
    tensors = load_file(str(path))
    state = model.state_dict()
    tied = _tied_names(state)
    unexpected = sorted(k for k in tensors if k not in state)
    missing = sorted(k for k in state if not any(n in tensors for n in tied[k]))
    model.load_state_dict({k: v for k, v in tensors.items() if k in state}, strict=False)
    return missing, unexpected


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """``safetensors.torch.save_file`` with ``{"format": "pt"}`` metadata, then the file's mode
    set as ``open()`` would under the process umask (safetensors 0.8 creates files ``0600``,
    which leaves shared checkpoints and exports unreadable to the group)."""
    save_file(tensors, str(path), metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def write_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """:func:`save_safetensors` (a separate function so tests can interrupt it); tied tensors
    are written as copies (:func:`distinct_storage`)."""
    save_safetensors(distinct_storage(tensors), path)


def save_training_checkpoint(
    run_dir: Path,
    step: int,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    generators: dict[str, torch.Generator],
    loop_state: dict[str, Any],
    recipe_yaml: str,
    keep_last: int,
) -> Path:
    """Write the full training state at ``step`` atomically and prune to ``keep_last``.

    Args:
        run_dir: the run directory; the checkpoint goes to ``<run_dir>/checkpoints/step-N``.
        step: optimizer steps completed.
        model: the unwrapped model (its ``state_dict`` is saved; shared tensors once).
        optimizer: the unwrapped optimizer (``state_dict()``; tensors to safetensors).
        scheduler: an LR scheduler with ``state_dict()``.
        generators: named generators to save (e.g. ``{"poet": merge_generator}``).
        loop_state: JSON-able loop variables (merges, data position, ...).
        recipe_yaml: the resolved recipe (``dump_recipe``).
        keep_last: number of newest checkpoints to keep (>= 1).

    Returns:
        The checkpoint directory.

    Raises:
        OSError: the write failed (the previous checkpoints are intact; the temp dir is removed).
    """
    root = Path(run_dir) / CHECKPOINT_DIR
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale(root)
    name = f"step-{step:08d}"
    final = root / name
    tmp = root / f".tmp-{name}-{os.getpid()}"
    tmp.mkdir()
    try:
        write_tensors(model_tensors(model), tmp / "model.safetensors")
        tensors: dict[str, torch.Tensor] = {}
        opt_meta = encode_state(optimizer.state_dict(), "optimizer", tensors)
        sched_meta = encode_state(scheduler.state_dict(), "scheduler", tensors)
        rng_meta = capture_rng(generators, tensors)
        write_tensors(tensors, tmp / "state.safetensors")
        (tmp / "recipe.yaml").write_text(recipe_yaml, encoding="utf-8")
        files = {}
        for f in _FILES:
            _fsync_path(tmp / f)
            files[f] = {"bytes": (tmp / f).stat().st_size, "sha256": file_sha256(tmp / f)}
        meta = {
            "format": FORMAT,
            "version": VERSION,
            "step": step,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "loop": loop_state,
            "optimizer": opt_meta,
            "scheduler": sched_meta,
            "rng": rng_meta,
            "files": files,
        }
        with (tmp / "state.json").open("w", encoding="utf-8") as fh:
            json.dump(meta, fh)
            fh.flush()
            os.fsync(fh.fileno())
        _fsync_path(tmp)
        old = None
        if final.exists():  # the same step saved twice (e.g. SIGTERM right after a periodic save)
            old = root / f".old-{name}-{os.getpid()}"
            os.rename(final, old)
        os.rename(tmp, final)
        _fsync_path(root)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for _step, path in list_checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(path, ignore_errors=True)
    return final


def read_checkpoint(ckpt_dir: Path) -> dict[str, Any]:
    """Read and verify ``state.json`` of ``ckpt_dir`` (format, files present, sizes, SHA-256).

    Raises:
        CheckpointError: one line naming the missing or corrupted file and what to do.
    """
    ckpt_dir = Path(ckpt_dir)
    older = [p for _, p in list_checkpoints(ckpt_dir.parent.parent) if p.name < ckpt_dir.name]
    hint = (
        f"delete '{ckpt_dir}' to resume from the checkpoint before it ('{older[-1].name}'), or "
        "start a new run"
        if older
        else "it is the run's only checkpoint: start a new run (--overwrite)"
    )
    meta_path = ckpt_dir / "state.json"
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint '{ckpt_dir}' has no state.json; {hint}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(
            f"checkpoint file '{meta_path}' is corrupted ({type(exc).__name__}); {hint}"
        ) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"'{meta_path}' is not a poetxq training checkpoint; {hint}")
    if meta.get("version") != VERSION:
        raise CheckpointError(
            f"'{meta_path}' has checkpoint version {meta.get('version')}, this poetxq reads "
            f"version {VERSION}; resume it with the poetxq version that wrote it"
        )
    for name, info in meta["files"].items():
        path = ckpt_dir / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint file '{path}' is missing; {hint}")
        if path.stat().st_size != info["bytes"] or file_sha256(path) != info["sha256"]:
            raise CheckpointError(
                f"checkpoint file '{path}' is corrupted (size or SHA-256 differs from "
                f"state.json); {hint}"
            )
    return meta


def check_world_size(ckpt_dir: Path, world: int) -> None:
    """Refuse to resume a checkpoint written by another number of processes (a changed global
    batch and data order would not continue the run). Reads only ``state.json``, so the check
    can run before any work; an unreadable one is left to :func:`load_training_checkpoint`,
    which names the problem.

    Raises:
        CheckpointError: ``ckpt_dir`` was written by a different number of processes.
    """
    try:
        meta = json.loads((ckpt_dir / "state.json").read_text(encoding="utf-8"))
        saved = int(meta["loop"].get("num_processes", 1))
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return
    if saved != world:
        raise CheckpointError(
            f"checkpoint '{ckpt_dir}' was written by {saved} process(es) and this run has "
            f"{world}; resume with {saved} (torchrun --nproc_per_node {saved} ...), or start a "
            "new run"
        )


def load_training_checkpoint(
    ckpt_dir: Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    generators: dict[str, torch.Generator],
) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_training_checkpoint` into live objects.

    Verifies the files first (:func:`read_checkpoint`), then loads the model state (strict),
    optimizer, scheduler, RNG states and ``generators`` in place.

    Returns:
        ``state.json``'s content (``meta["step"]``, ``meta["loop"]``, ...).

    Raises:
        CheckpointError: corrupted files or a model/optimizer that does not match the checkpoint.
    """
    ckpt_dir = Path(ckpt_dir)
    meta = read_checkpoint(ckpt_dir)
    try:
        missing, unexpected = load_model_tensors(model, ckpt_dir / "model.safetensors")
        tensors = load_file(str(ckpt_dir / "state.safetensors"))
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"checkpoint '{ckpt_dir}' cannot be read: {exc}") from None
    except RuntimeError as exc:  # shape mismatch or a layer's own load check
        first = str(exc).strip().splitlines()
        raise CheckpointError(
            f"checkpoint '{ckpt_dir}' does not fit this model: "
            f"{' '.join(s.strip() for s in first[:3])}"
        ) from None
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint '{ckpt_dir}' does not fit this model (missing {sorted(missing)[:3]}, "
            f"unexpected {sorted(unexpected)[:3]})"
        )
    try:
        optimizer.load_state_dict(decode_state(meta["optimizer"], tensors))
        scheduler.load_state_dict(decode_state(meta["scheduler"], tensors))
    except (KeyError, ValueError, RuntimeError) as exc:
        raise CheckpointError(
            f"checkpoint '{ckpt_dir}': optimizer/scheduler state does not fit: {exc}"
        ) from None
    restore_rng(meta["rng"], tensors, generators)
    return meta
