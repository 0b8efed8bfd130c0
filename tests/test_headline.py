"""evals/headline.py: the three device calls that regenerate the README's GPU numbers, the adopt
step that keeps one current file per stem, and the README table rendered from those files."""

import importlib.util
import json
import re
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "evals" / "results"


def _load(name: str):
    sys.path.insert(0, str(REPO / "evals"))
    spec = importlib.util.spec_from_file_location(name, REPO / "evals" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def headline(monkeypatch):
    monkeypatch.setenv("POETXQ_COMMIT", "abc1234")
    return _load("headline")


def test_dry_run_lists_every_part_s_commands_and_files(headline, tmp_path, capsys):
    official = tmp_path / "official"
    official.mkdir()
    out = tmp_path / "out"
    assert headline.main(["--part", "all", "--dry-run", "--out-dir", str(out),
                          "--official", str(official)]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert not out.exists()  # nothing ran, nothing written
    for step in headline.STEPS:
        if step.part == "x2":
            assert step.out_name("abc1234") not in text
            continue
        assert f"writes {step.out_name('abc1234')}" in text
        if step.stem != "gpu_tests":
            assert step.argv[0] in text
            assert f"--out {out / step.out_name('abc1234')}" in text
    assert "pytest -o addopts= -q -m 'slow or not slow'" in text
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in text
    assert text.count(f"--official {official.resolve()}") == 3  # two official steps, the kernels
    for part in ("1", "2", "3"):
        assert f"log headline_part{part}_h200_abc1234.json" in text
    headline.main(["--part", "x2", "--dry-run"])
    assert "multi_gpu_step_h200x2_abc1234.json" in capsys.readouterr().out


def test_without_the_official_code_its_steps_are_skipped(headline, capsys):
    headline.main(["--part", "2", "--dry-run"])
    text = capsys.readouterr().out
    assert text.count("skip gpu_memory_") == 2 and "--official /" not in text
    assert "writes gpu_memory_8b_graph_h200_abc1234.json" in text


def test_parts_fit_three_device_calls(headline):
    assert headline.PART_BUDGET_S < 600
    for part in ("1", "2", "3", "x2"):
        steps = headline.plan(part)
        assert steps
        assert sum(s.est_s for s in steps) <= headline.PART_BUDGET_S - headline.MARGIN_S
        assert all(s.timeout_s <= headline.PART_BUDGET_S for s in steps)
    single = [s for s in headline.STEPS if s.part != "x2"]
    assert {s.machine for s in single} == {"h200"}
    assert sum(s.est_s for s in single) < 3 * 600
    # every GPU file the README's table reads is one of the stems the parts write
    table = _load("readme_table")
    names = set(re.findall(r"\(evals/results/([^)]+)\)", "\n".join(table.headline_rows())))
    assert len(names) == 8
    assert {headline.NAME_RE.match(n)["stem"] for n in names} <= {s.stem for s in headline.STEPS}


def test_a_failing_or_stalled_command_is_recorded_and_the_part_goes_on(
    headline, tmp_path, monkeypatch
):
    ok = "import sys, pathlib; pathlib.Path(sys.argv[-1]).write_text('{}'); print('done')"
    steps = (
        headline.Step("fails", "1", ("-c", "import sys; print('boom'); sys.exit(3)"), 1, 30),
        headline.Step("stalls", "1", ("-c", "import time; time.sleep(60)"), 1, 1),
        headline.Step("works", "1", ("-c", ok), 1, 30),
        headline.Step("too_long", "1", ("-c", ok), 10_000, 30),
    )
    monkeypatch.setattr(headline, "STEPS", steps)
    monkeypatch.setattr(headline, "_gpu_name", lambda: "NVIDIA H200")  # on any host, GPU or not
    assert headline.main(["--part", "1", "--out-dir", str(tmp_path), "--budget-s", "60"]) == 1
    log = json.loads((tmp_path / "headline_part1_h200_abc1234.json").read_text())
    fails, stalls, works, too_long = log["steps"]
    assert fails["returncode"] == 3 and "boom" in fails["output_tail"] and not fails["wrote"]
    assert stalls["timed_out"] and stalls["wall_s"] < 15
    assert works["returncode"] == 0 and works["wrote"]
    assert (tmp_path / "works_h200_abc1234.json").is_file()
    assert "left of the part's budget" in too_long["skipped"]


def test_pytest_record_keeps_summary_counts_and_failures(headline):
    res = {
        "returncode": 1,
        "timed_out": False,
        "wall_s": 301.2,
        "output_tail": "....F.s\nFAILED tests/test_a.py::test_b - assert 0\n"
        "==== 1 failed, 120 passed, 3 skipped, 2 warnings in 298.51s (0:04:58) ====\n",
    }
    rec = headline.pytest_record(res, ["python", "-m", "pytest"], "abc1234", "NVIDIA H200")
    assert rec["summary"] == "1 failed, 120 passed, 3 skipped, 2 warnings in 298.51s (0:04:58)"
    assert rec["counts"] == {"failed": 1, "passed": 120, "skipped": 3, "warnings": 2}
    assert rec["duration_s"] == 298.51 and rec["commit"] == "abc1234"
    assert rec["failures"] == ["FAILED tests/test_a.py::test_b - assert 0"]


def test_a_cut_off_test_run_still_records_its_failures_from_the_test_log(headline, tmp_path):
    """pytest killed at the call's limit prints no summary; the conftest's POETXQ_TEST_LOG
    lines (a report twice, as pytest-xdist relays them) still give the failures and timings."""
    log = tmp_path / "tests.jsonl"
    recs = [
        {"test": "t.py::a", "when": "call", "outcome": "passed", "seconds": 1.5},
        {"test": "t.py::b", "when": "call", "outcome": "failed", "seconds": 0.2,
         "error": "E   assert 1 == 2"},
        {"test": "t.py::b", "when": "call", "outcome": "failed", "seconds": 0.2,
         "error": "E   assert 1 == 2"},
        {"test": "t.py::c", "when": "setup", "outcome": "failed", "seconds": 0.0,
         "error": "fixture 'x' not found"},
        {"test": "t.py::d", "when": "call", "outcome": "passed", "seconds": 9.0},
    ]  # fmt: skip
    log.write_text("\n".join(json.dumps(r) for r in recs) + "\n{truncated")
    res = {"returncode": -15, "timed_out": True, "wall_s": 480.0, "output_tail": "....F..F"}
    rec = headline.pytest_record(res, ["python", "-m", "pytest"], "abc1234", "H200", log)
    assert rec["summary"] == "" and rec["timed_out"]
    assert rec["tests_run"] == 3  # a, b, d; c failed in its setup
    assert [(r["test"], r["when"]) for r in rec["failed_tests"]] == [
        ("t.py::b", "call"),
        ("t.py::c", "setup"),
    ]
    assert rec["failed_tests"][0]["error"] == "E   assert 1 == 2"
    assert [r["test"] for r in rec["slowest"]] == ["t.py::d", "t.py::a", "t.py::b"]
    assert rec["slowest_files"] == [{"file": "t.py", "seconds": 10.7}]  # 1.5 + 0.2 + 9.0
    assert rec["calls_seconds"] == 10.7


def _current_files(headline) -> list[str]:
    names = [headline.current(s.stem, RESULTS, s.machine) for s in headline.STEPS]
    return [n for n in names if n]


def test_adopt_replaces_a_stem_s_file_and_the_readme_table_follows(headline, tmp_path, monkeypatch):
    results, new = tmp_path / "results", tmp_path / "out"
    results.mkdir()
    new.mkdir()
    for name in _current_files(headline):
        shutil.copy(RESULTS / name, results / name)
    shutil.copy(RESULTS / "kernel_targets_h200_7857f3d.md", results)
    old = headline.current("throughput_1b", results)
    doc = json.loads((results / old).read_text())
    doc["date"], doc["commit"] = "2027-01-01T00:00:00Z", "bbbbbbb"
    for row in doc["ratios"]:
        row["poetxq_graph_over_adamw"] = 0.9876 if row["seq_len"] == 256 else 0.9123
    (new / "throughput_1b_h200_bbbbbbb.json").write_text(json.dumps(doc))
    kt = json.loads((results / headline.current("kernel_targets", results)).read_text())
    (new / "kernel_targets_h200_bbbbbbb.json").write_text(json.dumps({**kt, "date": "2027"}))
    (new / "unrelated_h200_bbbbbbb.json").write_text("{}")  # not a stem of the parts
    stale = {**doc, "date": "2020-01-01"}  # older than the one there: left out
    (new / "throughput_3b_h200_0000000.json").write_text(json.dumps(stale))

    done = headline.adopt(new, results, git=False)
    assert f"removed {old}" in done and "added throughput_1b_h200_bbbbbbb.json" in done
    assert not (results / old).exists()
    assert headline.current("throughput_1b", results) == "throughput_1b_h200_bbbbbbb.json"
    assert not (results / "unrelated_h200_bbbbbbb.json").exists()
    assert headline.current("throughput_3b", results) == "throughput_3b_h200_685c4b3.json"
    assert (results / "kernel_targets_h200_bbbbbbb.md").is_file()
    assert not (results / "kernel_targets_h200_7857f3d.md").exists()
    assert (
        "evals/results/kernel_targets_h200_bbbbbbb.json"
        in (results / "kernel_targets_h200_bbbbbbb.md").read_text()
    )

    table = _load("readme_table")
    monkeypatch.setattr(importlib.import_module("results_files"), "RESULTS", results)
    readme = table.render_readme((REPO / "README.md").read_text())
    assert "1B [0.99 / 0.91](evals/results/throughput_1b_h200_bbbbbbb.json)" in readme
    assert old not in readme and "kernel_targets_h200_7857f3d" not in readme
    assert "3B [0.85 / 0.86](evals/results/throughput_3b_h200_685c4b3.json)" in readme


def test_readme_table_rendered_from_today_s_files_is_the_committed_one():
    table = _load("readme_table")
    text = (REPO / "README.md").read_text()
    assert table.render_readme(text) == text
    block = text.split(table.HEADLINE_BEGIN)[1].split(table.HEADLINE_END)[0]
    assert len(table.headline_rows()) == len(table.HEADLINE_LABELS)
    for row in table.headline_rows():
        assert row in block


def test_current_takes_the_newest_file_of_a_stem_by_its_date(headline, tmp_path):
    (tmp_path / "gpu_tests_h200_aaaaaaa.json").write_text('{"date": "2026-12-03T10:00:00Z"}')
    (tmp_path / "gpu_tests_h200_bbbbbbb.json").write_text('{"date": "2026-12-02T10:00:00Z"}')
    (tmp_path / "gpu_tests_more_h200_ccccccc.json").write_text('{"date": "2027"}')
    assert headline.current("gpu_tests", tmp_path) == "gpu_tests_h200_aaaaaaa.json"
    assert headline.current("nothing", tmp_path) is None


def test_only_picks_stems_and_a_run_needs_a_commit(headline, tmp_path, capsys, monkeypatch):
    headline.main(["--part", "3", "--only", "gpu_tests", "--dry-run"])
    text = capsys.readouterr().out
    assert "gpu_tests_h200_abc1234.json" in text and "kernel_targets" not in text
    with pytest.raises(SystemExit):
        headline.main(["--part", "3", "--only", "no_such_stem", "--dry-run"])
    monkeypatch.setenv("POETXQ_COMMIT", "unknown")
    with pytest.raises(SystemExit):
        headline.main(["--part", "1", "--out-dir", str(tmp_path)])
    assert "set POETXQ_COMMIT" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_an_h100_names_its_files_and_never_replaces_an_h200_file(headline, tmp_path):
    step = next(s for s in headline.STEPS if s.stem == "gpu_tests")
    assert step.out_name("abc1234", "NVIDIA H100 80GB HBM3") == "gpu_tests_h100_abc1234.json"
    assert step.out_name("abc1234", "NVIDIA H200") == "gpu_tests_h200_abc1234.json"
    assert step.out_name("abc1234", None) == "gpu_tests_h200_abc1234.json"  # a dry run
    assert headline.machine_tag("h200x2", "NVIDIA H100 80GB HBM3") == "h100x2"
    results, new = tmp_path / "results", tmp_path / "new"
    results.mkdir(), new.mkdir()
    (results / "gpu_tests_h200_aaaaaaa.json").write_text('{"date": "2026-12-01"}')
    (new / "gpu_tests_h100_bbbbbbb.json").write_text('{"date": "2026-12-06"}')
    assert headline.adopt(new, results, git=False) == ["added gpu_tests_h100_bbbbbbb.json"]
    assert headline.current("gpu_tests", results, "h200") == "gpu_tests_h200_aaaaaaa.json"
    assert headline.current("gpu_tests", results, "h100") == "gpu_tests_h100_bbbbbbb.json"
