"""evals/fpo_e2e.py: the tolerance arithmetic, the table docs/FPO.md shows, and a smoke run."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _load():
    sys.path.insert(0, str(REPO / "evals"))
    spec = importlib.util.spec_from_file_location("fpo_e2e", REPO / "evals" / "fpo_e2e.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["fpo_e2e"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_tolerance_is_relative_on_perplexity_and_inclusive():
    e2e = _load()
    assert e2e.OOD_TOLERANCE == 0.05
    assert e2e.relative_change(40.0, 42.0) == pytest.approx(0.05)
    assert e2e.within_tolerance(40.0, 41.9)
    assert e2e.within_tolerance(40.0, 30.0)  # falling is fine
    assert not e2e.within_tolerance(40.0, 42.1)
    assert not e2e.within_tolerance(40.0, math.nan)
    assert not e2e.within_tolerance(40.0, 41.0, tolerance=0.02)


def test_table_renders_each_method_row():
    e2e = _load()
    row = {"method": "fpo", "lr": 3.75416e-5, "lr_scale": 0.25,
           "in_domain_ppl_before": 120.0, "in_domain_ppl_after": 80.5,
           "ood_ppl_before": 50.0, "ood_ppl_after": 53.0, "ood_rel_change": 0.06,
           "ood_within_tolerance": False, "tokens_per_s": 12345.6,
           "peak_rss_bytes": 600 * 2**20}  # fmt: skip
    table = e2e.render_table({"ood_tolerance": 0.05, "methods": [row]})
    lines = table.splitlines()
    assert len(lines) == 3
    assert "within 5%?" in lines[0]
    assert lines[2] == (
        "| fpo | 3.75e-05 (× 0.25) | 120.00 → 80.50 | 50.00 → 53.00 (+6.0%, **no**) | 12,346 "
        "| 600 MiB |"
    )


def test_docs_show_the_committed_table():
    e2e = _load()
    doc = json.loads((REPO / "evals/results/fpo_e2e_cpu.json").read_text())
    assert not doc["smoke"]
    methods = [r["method"] for r in doc["methods"]]
    assert methods == ["fpo", "sft-partial", "full"] * (len(methods) // 3) and methods
    assert e2e.render_table(doc) in (REPO / "docs/FPO.md").read_text()


@pytest.mark.slow
def test_smoke_run_writes_three_methods_and_poetxq_continued(tmp_path):
    e2e = _load()
    out = tmp_path / "e2e.json"
    argv = ["--smoke", "--out", str(out), "--work", str(tmp_path / "work"), "--lr-scales", "1",
            "0.5"]  # fmt: skip
    assert e2e.main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["smoke"] is True
    assert doc["ood_tolerance"] == 0.05 and "0.05" in doc["ood_tolerance_rule"]
    assert doc["commit"] and doc["date"] and doc["command"].startswith("python ")
    rows = doc["methods"]
    assert [r["method"] for r in rows] == ["fpo", "sft-partial", "full"] * 2
    assert [r["lr_scale"] for r in rows] == [1.0] * 3 + [0.5] * 3
    targets = doc["diagnose"]["targets"]
    assert targets == [1]  # 2 layers: the last quarter is the last layer
    for r in rows:  # the one lr rule: the diagnosis' AdamW suggestion (x the scale) for all
        assert r["lr"] == pytest.approx(doc["diagnose"]["lr"]["adamw"] * r["lr_scale"], rel=1e-5)
    for r in rows:
        assert r["steps"] == 2 and r["layers"] == targets
        for key in ("in_domain_ppl_before", "in_domain_ppl_after", "ood_ppl_before",
                    "ood_ppl_after"):  # fmt: skip
            assert math.isfinite(r[key]) and r[key] > 1
        assert r["ood_within_tolerance"] == (r["ood_ppl_after"] / r["ood_ppl_before"] - 1 <= 0.05)
        assert r["tokens_per_s"] > 0 and r["peak_rss_bytes"] > 50 * 2**20
        assert f"--method {r['method']}" in r["command"]
    # every method starts from the same base model and evaluation
    assert len({r["in_domain_ppl_before"] for r in rows}) == 1
    assert len({r["ood_ppl_before"] for r in rows}) == 1
    # full fine-tuning adapts every weight, the partial methods only the last MLP
    assert rows[2]["adapted_params"] > rows[0]["adapted_params"] == rows[1]["adapted_params"]
    # the last block's pseudo-gradient is exact: FPO and SFT-partial of it end at the same model
    fpo, sft = rows[0], rows[1]
    assert fpo["in_domain_ppl_after"] == pytest.approx(sft["in_domain_ppl_after"], rel=1e-4)
    assert fpo["ood_ppl_after"] == pytest.approx(sft["ood_ppl_after"], rel=1e-4)
    # POET-XQ continued training of the same base: the same start, steps and evaluation windows
    cont = doc["continued"]
    assert cont["method"] == "poetxq-continued" and cont["steps"] == 2 and cont["lr_scale"] is None
    assert "train --model" in cont["command"] and "--max-steps 2" in cont["command"]
    assert cont["lr"] == cont["poet_lr"] == 1e-4  # the defaults `--model` takes
    assert (cont["in_domain_ppl_before"], cont["ood_ppl_before"]) == (
        fpo["in_domain_ppl_before"], fpo["ood_ppl_before"],
    )  # fmt: skip
    assert math.isfinite(cont["in_domain_ppl_after"]) and cont["in_domain_ppl_after"] > 1
    assert cont["in_domain_ppl_after"] != cont["in_domain_ppl_before"]  # it trained
    assert "| poetxq-continued | 0.0001 (its --model default) |" in e2e.render_table(doc)
