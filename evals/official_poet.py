"""The official POET-X / POET-XQ code beside ours, from a local copy outside this repository.

The official implementation (github.com/Sphere-AI-Lab/poet, package ``poet_torch``) is never
committed here. Put a copy of its ``poet_torch/`` folder under ``.official/`` (git-ignored) or
point ``$POETXQ_OFFICIAL_DIR`` / ``--official DIR`` at the folder that holds it; it needs only
torch and triton. The benchmarks then time it side by side with ours in the same process or call:

- :func:`official_layer`: one official layer at a given shape (``QPOETLinear`` for POET-XQ with
  its ``mem_efficient_mode`` on or off, ``POETLinear`` for POET-X ``mem`` / ``fast``), used by
  ``evals/gpu_suite.py --parts overhead``.
- :func:`measure_step` (``python evals/official_poet.py step``): peak memory and step time of one
  official POET-XQ training step at Llama-8B / 13B, set up as the official training script does
  it (``examples/torchrun_main.py`` with ``--optimizer q_poet --use_hf_model``: the transformers
  Llama wrapped by ``POETModel(QPOETConfig)``, ``gradient_checkpointing_enable()`` for the
  checkpointed setting, bf16 parameters, ``get_poet_optimizer``, gradient clipping at 1.0), used
  by ``evals/gpu_memory.py --official``. The model is built on the GPU in bf16 (the script builds
  it on the CPU in fp32 and then casts; the trained model is the same, the setup is faster).

Usage (on the GPU host):
    python evals/official_poet.py step --model llama-8b [--ckpt] --out /tmp/official.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
#: the default place of the local copy (``.official/poet_torch/...``), ignored by git
DEFAULT_DIR = REPO / ".official"
#: the official layer kinds :func:`official_layer` builds, as (class, mem_efficient_mode)
LAYER_KINDS = {
    "xq_mem": ("QPOETLinear", True),
    "xq": ("QPOETLinear", False),
    "x_mem": ("POETLinear", True),
    "x_fast": ("POETLinear", False),
}
VOCAB = 32000


class OfficialNotFound(RuntimeError):
    """No ``poet_torch`` package in the folder given (or in the default ``.official/``)."""


def official_dir(path: str | os.PathLike | None = None) -> Path:
    """The folder holding ``poet_torch/``: ``path``, else ``$POETXQ_OFFICIAL_DIR``, else
    ``.official/`` beside ``evals/``."""
    return Path(path or os.environ.get("POETXQ_OFFICIAL_DIR") or DEFAULT_DIR)


def load(path: str | os.PathLike | None = None) -> ModuleType:
    """Import the official ``poet_torch`` from :func:`official_dir` (``path``).

    Raises:
        OfficialNotFound: the folder has no ``poet_torch/__init__.py``; the message names the
            folder and how to provide the copy.
    """
    root = official_dir(path).resolve()
    if not (root / "poet_torch" / "__init__.py").is_file():
        raise OfficialNotFound(
            f"no official POET code in {root} (expected {root / 'poet_torch' / '__init__.py'}); "
            "copy poet_torch/ from github.com/Sphere-AI-Lab/poet there, or set "
            "POETXQ_OFFICIAL_DIR / --official to the folder that holds it"
        )
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return importlib.import_module("poet_torch")


def try_load(path: str | os.PathLike | None = None) -> ModuleType | None:
    """:func:`load`, or None when the copy is absent (benchmarks then leave the official rows
    out); any other import error propagates."""
    try:
        return load(path)
    except OfficialNotFound:
        return None


def official_layer(
    poet: ModuleType,
    kind: str,
    n: int,
    m: int,
    block_size: int,
    *,
    device: torch.device | str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> nn.Module:
    """One official layer ``n → m`` of ``kind`` (:data:`LAYER_KINDS`), parameters in ``dtype``.

    ``W0`` is a random ``nn.Linear`` weight (std 0.02), converted as the official code converts
    a model's linears (rows normalized; int8 in 256-element groups for POET-XQ); the packed
    skew-symmetric parameters ``oft_R`` get small random values (0.01 std) so that ``R, P ≠ I``
    as in our layer benchmarks.

    Raises:
        ValueError: unknown ``kind``.
    """
    if kind not in LAYER_KINDS:
        raise ValueError(f"unknown official layer kind {kind!r}; choose from {sorted(LAYER_KINDS)}")
    cls_name, mem = LAYER_KINDS[kind]
    gen = torch.Generator(device=device).manual_seed(seed)
    lin = nn.Linear(n, m, bias=False, device=device, dtype=dtype)
    with torch.no_grad():
        lin.weight.normal_(0.0, 0.02, generator=gen)
    if cls_name == "QPOETLinear":
        layer = poet.QPOETLinear.from_linear(lin, block_size=block_size, mem_efficient_mode=mem)
    else:
        layer = poet.POETLinear(n, m, block_size=block_size, device=device, dtype=dtype,
                                mem_efficient_mode=mem)  # fmt: skip
        with torch.no_grad():
            layer.weight.copy_(lin.weight / lin.weight.norm(dim=1, keepdim=True))
    with torch.no_grad():
        layer.oft_R.normal_(0.0, 0.01, generator=gen)
    return layer


def qpoet_setup(
    poet: ModuleType,
    model: nn.Module,
    *,
    block_size: int,
    merge_interval: int,
    poet_lr: float,
    base_lr: float,
    weight_decay: float,
    device: torch.device | str,
    dtype: torch.dtype | None = None,
) -> tuple[nn.Module, object, torch.optim.Optimizer]:
    """The official POET-XQ setup of a transformers causal LM, as ``examples/torchrun_main.py
    --optimizer q_poet`` does it: ``QPOETConfig`` (int8 W0 in groups of 256 and the POET lr scale
    at the code's own defaults, ``weight_bits`` / ``weight_group_size`` / ``poet_scale``),
    ``POETModel(model, cfg)`` (every linear but ``lm_head`` whose dims ``block_size`` divides
    becomes a ``QPOETLinear``), moved to ``device`` (and cast to ``dtype`` when given: the script
    casts to bf16), then ``get_poet_optimizer`` (``POETAdamW``: Q at ``poet_lr × poet_scale``,
    the rest at ``base_lr``; Adam moments of Q reset every ``merge_interval`` steps).

    Returns:
        ``(wrapped model, config, optimizer)``.
    """
    cfg = poet.QPOETConfig(block_size=block_size, merge_interval=merge_interval, poet_lr=poet_lr,
                           base_lr=base_lr, weight_decay=weight_decay)  # fmt: skip
    wrapped = poet.POETModel(model, cfg).to(device=device, dtype=dtype)
    return wrapped, cfg, poet.get_poet_optimizer(wrapped, cfg)


def one_config_under_interpreter(poet: ModuleType) -> int:
    """Under Triton's CPU interpreter (``TRITON_INTERPRET=1``) give each autotuned official
    kernel (the Cayley–Neumann kernels) one configuration, the smallest tiles: the autotuner
    would otherwise time its configurations through a GPU driver that the interpreter lacks.
    The tiles change the work split, not the result. No-op off the interpreter.

    Returns:
        the number of kernels narrowed.
    """
    if os.environ.get("TRITON_INTERPRET") != "1":
        return 0
    from triton.runtime.autotuner import Autotuner

    ops = importlib.import_module(f"{poet.__name__}.core.triton_ops")
    narrowed = 0
    for name in dir(ops):
        tuner = getattr(ops, name)
        if isinstance(tuner, Autotuner) and len(tuner.configs) > 1:
            tuner.configs = [min(tuner.configs, key=_tile_key)]
            narrowed += 1
    return narrowed


def _tile_key(config: object) -> tuple:
    """Sort key of a Triton config: its ``BLOCK_*`` sizes, then stages and warps."""
    kw = config.kwargs  # type: ignore[attr-defined]
    blocks = tuple(v for k, v in sorted(kw.items()) if k.startswith("BLOCK"))
    return (*blocks, config.num_stages, config.num_warps)  # type: ignore[attr-defined]


def measure_step(
    poet: ModuleType,
    model_name: str,
    *,
    ckpt: bool,
    steps: int = 3,
    batch_size: int = 1,
    seq_len: int = 2048,
    block_size: int = 256,
    device: torch.device | str = "cuda",
) -> dict:
    """Peak memory and median step time of the official POET-XQ training step (module docstring).

    One step = forward (``labels = input_ids``, as the official script) + backward + gradient
    clipping (1.0) + ``POETAdamW.step`` + ``zero_grad``, synchronized; one untimed warm-up step
    first (``torch.compile`` of the official layer forward, optimizer states). Peak =
    ``torch.cuda.max_memory_allocated`` over the timed steps (bytes); ``peak_reserved_bytes`` the
    allocator's reserved peak. Rates follow recipes/methods/poetxq.yaml (lr and poet_lr 1e-3,
    weight decay 0.01, merge interval 400: no merge falls in the measured steps).
    """
    from poetxq.model.surgery import build_llama
    from poetxq.training.recipe_files import load_recipe

    dev = torch.device(device)
    recipe = load_recipe(f"{model_name}:poetxq")
    t0 = time.perf_counter()
    model = build_llama(recipe.model, VOCAB, device=dev, dtype=torch.bfloat16)
    if ckpt:
        model.gradient_checkpointing_enable()
    model, _, optimizer = qpoet_setup(poet, model, block_size=block_size, merge_interval=400,
                                      poet_lr=1e-3, base_lr=1e-3, weight_decay=0.01, device=dev,
                                      dtype=torch.bfloat16)  # fmt: skip
    params = [p for g in optimizer.param_groups for p in g["params"]]
    cuda = dev.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    sync()
    if cuda:
        torch.cuda.empty_cache()
    build_s = time.perf_counter() - t0
    model.train()
    gen = torch.Generator(device=dev).manual_seed(1)

    def step() -> None:
        ids = torch.randint(0, VOCAB, (batch_size, seq_len), device=dev, generator=gen)
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad()

    t0 = time.perf_counter()
    step()  # warm-up: compile, optimizer states
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    warmup_s = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        sync()
        t = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t)
    peak = torch.cuda.max_memory_allocated(dev) if cuda else None
    return {
        "code": "official poet_torch (github.com/Sphere-AI-Lab/poet), QPOETLinear int8",
        "model": model_name,
        "gradient_checkpointing": ckpt,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "block_size": block_size,
        "dtype": "bf16",
        "step_time_s": statistics.median(times),
        "step_times_s": times,
        "peak_memory_bytes": peak,
        "peak_memory_gib": None if peak is None else peak / 2**30,
        "peak_reserved_bytes": torch.cuda.max_memory_reserved(dev) if cuda else None,
        "build_s": build_s,
        "warmup_s": warmup_s,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    st = sub.add_parser("step", help="peak memory and step time of the official POET-XQ step")
    st.add_argument("--model", default="llama-8b", help="recipes/models name (default llama-8b)")
    st.add_argument("--ckpt", action="store_true", help="gradient_checkpointing_enable()")
    st.add_argument("--steps", type=int, default=3, help="timed steps (median); default 3")
    st.add_argument("--batch-size", type=int, default=1)
    st.add_argument("--seq-len", type=int, default=2048)
    st.add_argument("--block-size", type=int, default=256)
    st.add_argument("--device", default="cuda")
    st.add_argument("--official", default=None, help="folder holding poet_torch/ "
                    "(default $POETXQ_OFFICIAL_DIR or .official/)")  # fmt: skip
    st.add_argument("--out", required=True, help="JSON file to write")
    args = ap.parse_args(argv)
    try:
        poet = load(args.official)
    except OfficialNotFound as exc:
        print(f"official_poet: error: {exc}", file=sys.stderr)
        return 2
    row = measure_step(poet, args.model, ckpt=args.ckpt, steps=args.steps,
                       batch_size=args.batch_size, seq_len=args.seq_len,
                       block_size=args.block_size, device=args.device)  # fmt: skip
    Path(args.out).write_text(json.dumps(row, indent=1) + "\n")
    print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
