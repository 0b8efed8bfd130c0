"""The quality study: token corpus format, decision rule, grid extension, planner, and a tiny
study run end to end through the runner (worker processes), stopped half-way and resumed."""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from evals.quality_plan import REPO, load_study, plan_runs, run_id, summarize
from evals.quality_stats import best_point, decide, extension_points, paired_stats
from poetxq.data.corpus import (
    CorpusError,
    TokenCorpus,
    pack_windows,
    token_data,
    write_token_corpus,
)

# ------------------------------------------------------------------ decision rule (hand numbers)


def test_decide_needs_a_t_interval_that_excludes_zero():
    a = {0: 20.0, 1: 20.5, 2: 19.8}
    # b - a = 1.0, 1.1, 0.9: mean 1.0, sd 0.1, se 0.0577; t(0.975, 2) = 4.3027 -> CI 0.752..1.248
    b = {0: 21.0, 1: 21.6, 2: 20.7}
    st = paired_stats(a, b)
    assert st["n"] == 3 and st["df"] == 2 and st["mean"] == pytest.approx(1.0)
    assert st["sd"] == pytest.approx(0.1) and st["se"] == pytest.approx(0.1 / math.sqrt(3))
    half = 4.302652729911275 * 0.1 / math.sqrt(3)
    assert st["ci"] == pytest.approx([1.0 - half, 1.0 + half])
    # t = 1.0 / 0.0577 = 17.32 on 2 df: p = 2 (1 - F(17.32)) = 0.003317
    assert st["p"] == pytest.approx(0.0033167, rel=1e-3)
    assert decide(a, b) == "better" and decide(b, a) == "worse"
    # b - a = 0.1, 0.5, 0.9: mean 0.5, se 0.231 (the old "2 SE" rule said better): CI
    # 0.5 +- 4.303 * 0.231 = -0.49..1.49 contains 0 -> tie; t = 2.165, p = 0.163
    c = {0: 20.1, 1: 21.0, 2: 20.7}
    assert decide(a, c) == "tie"
    assert paired_stats(a, c)["p"] == pytest.approx(0.1627, abs=2e-3)
    # five seeds: t(0.975, 4) = 2.7764; diffs 0.3, 0.1, 0.2, 0.25, 0.15: mean 0.2, sd 0.0791
    a5 = {s: 20.0 for s in range(5)}
    b5 = {0: 20.3, 1: 20.1, 2: 20.2, 3: 20.25, 4: 20.15}
    st5 = paired_stats(a5, b5)
    assert st5["ci"][0] == pytest.approx(0.2 - 2.7764451 * 0.0790569 / math.sqrt(5), rel=1e-4)
    assert decide(a5, b5) == "better"
    assert decide({0: 20.0, 1: 20.0}, {0: 30.0, 1: 31.0}) == "n/a"  # two seeds never decide
    assert decide({0: 20.0}, {0: 30.0}) == "n/a"
    # identical differences: the interval is the point
    same = paired_stats(a, {k: v + 0.5 for k, v in a.items()})
    assert same["ci"] == pytest.approx([0.5, 0.5]) and same["p"] == 0.0


def test_best_point_and_edge_extension():
    grid = {"optim.lr": [1e-3, 2e-3, 4e-3, 8e-3]}
    points = [{"optim.lr": v} for v in grid["optim.lr"]]
    key = lambda p: json.dumps(p, sort_keys=True)  # noqa: E731
    scores = {key(p): [s] for p, s in zip(points, [30.0, 25.0, 22.0, 21.0])}
    best = best_point(points, scores)
    assert best == {"optim.lr": 8e-3}
    assert extension_points(grid, points, best, [], 2) == [{"optim.lr": 0.016}]
    # a diverged run (None) never wins; the low edge extends downwards by the grid's ratio
    scores = {key(p): [s] for p, s in zip(points, [20.0, 25.0, None, 30.0])}
    best = best_point(points, scores)
    assert best == {"optim.lr": 1e-3}
    assert extension_points(grid, points, best, [], 2) == [{"optim.lr": 0.0005}]
    # interior best: nothing to add; max_extend reached: nothing either
    assert extension_points(grid, points, {"optim.lr": 2e-3}, [], 2) == []
    added = [{"optim.lr": 0.016}, {"optim.lr": 0.032}]
    pts = points + added
    assert extension_points(grid, pts, {"optim.lr": 0.032}, added, 2) == []
    # two axes: only the axis on its edge moves, the other stays at the best value
    grid2 = {"optim.poet_lr": [4e-3, 8e-3, 1.6e-2], "optim.lr": [5e-3, 1e-2]}
    pts2 = [
        {"optim.poet_lr": p, "optim.lr": q}
        for p in grid2["optim.poet_lr"]
        for q in grid2["optim.lr"]
    ]
    new = extension_points(grid2, pts2, {"optim.poet_lr": 8e-3, "optim.lr": 1e-2}, [], 2)
    assert new == [{"optim.poet_lr": 8e-3, "optim.lr": 0.02}]


# ------------------------------------------------------------------------------ token corpus


def _tiny_corpus(folder: Path, ood: bool = False) -> TokenCorpus:
    """pydoc topics as a token corpus; ``ood`` adds an ``ood`` split of topics kept out of the
    others (the build's out-of-distribution split)."""
    import importlib

    from poetxq.data.tokenizer import train_bpe

    topics = importlib.import_module("pydoc_data.topics").topics
    docs = [topics[k] for k in sorted(topics)]
    a, b = docs[::2], docs[1::2]
    first = 9 if ood else 6
    splits = {
        "train": {"even": a[first:], "odd": b[first:]},
        "tune": {"even": a[:3], "odd": b[:3]},
        "test": {"even": a[3:6], "odd": b[3:6]},
    }
    if ood:
        splits["ood"] = {"held-out": a[6:9] + b[6:9]}
    enc = train_bpe(a[first:] + b[first:], 512, progress=False)
    ids = {s: {src: enc.encode_batch(d) for src, d in v.items()} for s, v in splits.items()}
    write_token_corpus(folder, enc.tokenizer, enc.eos_id, ids, extra={"note": "test"})
    return TokenCorpus.open(folder)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> TokenCorpus:
    return _tiny_corpus(tmp_path_factory.mktemp("corpus"))


def test_token_corpus_round_trip_and_integrity(corpus, tmp_path):
    tok = corpus.tokenizer()
    eos = corpus.manifest["eos_id"]
    test = corpus.tokens("test")
    assert test.dtype == np.dtype("<u2")
    ranges = corpus.source_ranges("test")
    assert list(ranges) == ["even", "odd"] and ranges["even"][1] == ranges["odd"][0]
    assert ranges["odd"][1] == test.size
    # every document ends with EOS; decoding the first document gives the text back
    first_end = int(np.flatnonzero(test == eos)[0])
    import importlib

    topics = importlib.import_module("pydoc_data.topics").topics
    docs = [topics[k] for k in sorted(topics)][::2]
    assert tok.decode(test[:first_end].tolist()) == docs[3]
    assert int((test == eos).sum()) == 6
    w = pack_windows(test, 31)
    assert w.shape == (test.size // 32, 32) and int(w[1, 0]) == int(test[32])
    data = token_data(corpus, 31, heldout="test", max_val_tokens=64)
    assert data.val.shape == (2, 32) and data.vocab_size == corpus.manifest["vocab_size"]
    # a damaged file is refused by its checksum, an unknown split by name
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(corpus.folder, bad)
    raw = bytearray((bad / "test.u16.xz").read_bytes())
    raw[-10] ^= 0xFF
    (bad / "test.u16.xz").write_bytes(bytes(raw))
    with pytest.raises(CorpusError, match="SHA-256"):
        TokenCorpus.open(bad).tokens("test")
    with pytest.raises(CorpusError, match="split 'valid'"):
        corpus.tokens("valid")
    with pytest.raises(CorpusError, match="not a token corpus"):
        TokenCorpus.open(tmp_path)


def _without(corpus: TokenCorpus, tmp_path: Path, name: str) -> Path:
    """A copy of ``corpus`` without the file ``name``."""
    import shutil

    folder = tmp_path / "incomplete"
    shutil.copytree(corpus.folder, folder)
    (folder / name).unlink()
    return folder


@pytest.mark.parametrize("name", ["tokenizer.json", "test.u16.xz"])
def test_a_missing_corpus_file_is_one_line_naming_it_and_the_fix(corpus, tmp_path, name):
    folder = _without(corpus, tmp_path, name)
    with pytest.raises(CorpusError) as err:
        TokenCorpus.open(folder)
    msg = str(err.value)
    assert "\n" not in msg and f"lacks {name}" in msg
    assert f"prepare_offline_corpus.py --out {folder}" in msg and f"copy {name}" in msg
    # a file lost after opening: tokenizer() and tokens() say the same
    opened = TokenCorpus.open(corpus.folder)
    opened.folder = folder
    with pytest.raises(CorpusError, match=re.escape(f"lacks {name}")):
        opened.tokenizer() if name == "tokenizer.json" else opened.tokens("test")
    # a damaged tokenizer file is one line too (tokenizers raises a bare Exception)
    (tmp_path / "bad_tok").mkdir()
    opened.folder = tmp_path / "bad_tok"
    (opened.folder / "tokenizer.json").write_text("{not json")
    with pytest.raises(CorpusError, match="not a readable tokenizer"):
        opened.tokenizer()


def test_cli_paths_report_an_incomplete_corpus_in_one_line(corpus, tmp_path, capsys):
    """``quality.py plan`` / ``run`` and ``poetxq train --data`` on a corpus without its
    tokenizer: one error line naming the file, exit status 2 (bad input), no traceback."""
    import subprocess
    import sys

    from evals.quality import main as quality_main
    from poetxq.tools.cli import main as poetxq_main

    folder = _without(corpus, tmp_path, "tokenizer.json")
    study = _study(tmp_path, folder)
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "evals/quality.py", "plan", str(study)],
        cwd=repo, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    err = proc.stderr.strip()
    assert proc.returncode == 2 and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert "lacks tokenizer.json" in err and "prepare_offline_corpus.py" in err
    capsys.readouterr()
    assert quality_main(["run", str(study)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "lacks tokenizer.json" in err[0], err
    assert not (tmp_path / "runs").exists()  # no worker started
    code = poetxq_main(["train", "--data", str(folder), "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "lacks tokenizer.json" in err[0], err


def test_max_test_tokens_scores_an_even_spread_of_each_source(corpus):
    from evals.quality_worker import windows_by_source

    whole = windows_by_source(corpus, "test", 31)
    stream = corpus.tokens("test")
    for src, (a, b) in corpus.source_ranges("test").items():  # the default: every window
        assert torch.equal(whole[src], pack_windows(stream[a:b], 31))
    n = {src: w.shape[0] for src, w in whole.items()}
    cut = windows_by_source(corpus, "test", 31, max_tokens=32 * 20)
    assert set(cut) == set(whole) and sum(w.shape[0] for w in cut.values()) <= 20
    for src, w in cut.items():
        assert w.shape[0] == n[src] * 20 // sum(n.values())  # in proportion to the source
        rows = {tuple(r) for r in whole[src].tolist()}
        assert all(tuple(r) in rows for r in w.tolist())  # whole windows of that source
        assert torch.equal(w[0], whole[src][0]) and torch.equal(w[-1], whole[src][-1])  # spread
    assert windows_by_source(corpus, "test", 31, max_tokens=10**9).keys() == whole.keys()
    # the committed study scores the whole split (its results were scored so)
    assert load_study("evals/studies/llama60m_50m.yaml").max_test_tokens is None


def test_scoring_prints_a_line_per_phase_and_progress():
    from evals.quality_worker import Progress, mean_loss

    windows = torch.arange(40, dtype=torch.float64).view(10, 4)
    lines: list[str] = []
    progress = Progress("test split", 10, " (40 tokens)", every=0.0, echo=lines.append)
    seen: list[int] = []

    def loss(w: torch.Tensor) -> float:
        seen.append(w.shape[0])
        return float(w[:, 0].mean())

    assert mean_loss(loss, windows, 2, progress, chunks=3) == pytest.approx(18.0)
    progress.finish(1.5)
    assert seen == [4, 4, 2]  # whole batches of 2, about 3 calls
    assert lines[0] == "scoring test split: 10 windows (40 tokens) ..."
    assert [ln.split(",")[0] for ln in lines[1:3]] == [
        "  test split: 4/10 windows (40%)", "  test split: 8/10 windows (80%)",
    ]  # fmt: skip
    assert lines[3].startswith("  test split: done, ppl 1.500") and len(lines) == 4


# ------------------------------------------------------------------------- planner and runner

_TINY = {
    "model.hidden_size": 64, "model.intermediate_size": 128, "model.num_attention_heads": 2,
    "model.num_hidden_layers": 2, "model.max_position_embeddings": 64,
    "train.batch_size": 4, "train.grad_accum": 1, "train.seq_len": 32,
    "optim.min_lr_ratio": 0.1, "optim.grad_clip": 1.0, "optim.weight_decay": 0.0,
}  # fmt: skip


def _study(tmp_path: Path, corpus_dir: Path, **over) -> Path:
    tree = {
        "name": "tiny",
        "corpus": str(corpus_dir),
        "model": "llama-60m",
        "tokens": 4 * 32 * 6,  # 6 steps
        "shared": _TINY,
        "eval_points": 2,
        "val_tokens": None,
        "tune_seeds": [0, 1],
        "final_seeds": [0, 1],
        "max_extend": 0,
        "methods": {
            "poetxq": {"recipe": "poetxq", "set": {"poet.block_size": 32, "poet.merge_interval": 3},
                       "grid": {"optim.poet_lr": [4e-3, 8e-3]}},
            "adamw": {"recipe": "adamw", "grid": {"optim.lr": [1e-3, 2e-3]}},
        },
        "results": str(tmp_path / "results.json"),
        "runs_dir": str(tmp_path / "runs"),
        **over,
    }  # fmt: skip
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    return path


def test_planner_extends_a_winning_edge_then_finalizes(tmp_path, corpus):
    frozen = {"recipe": "poetxq", "like": "poetxq", "set": {"poet.freeze_orthogonal": True}}
    controls = {"frozen": frozen}
    study = load_study(
        _study(tmp_path, corpus.folder, max_extend=1, tune_seeds=[0], controls=controls)
    )
    results: dict = {"runs": {}}
    pending, state = plan_runs(study, results)
    assert len(pending) == 4 and not state["poetxq"]["tuned"]
    assert [p["method"] for p in pending] == ["poetxq", "adamw", "poetxq", "adamw"]

    def fake(pid: str, method: str, ppl: float) -> None:
        results["runs"][pid] = {"method": method, "tune_ppl": ppl, "test_ppl": ppl + 1}

    fake(run_id("poetxq", {"optim.poet_lr": 4e-3}, 0), "poetxq", 30.0)
    fake(run_id("poetxq", {"optim.poet_lr": 8e-3}, 0), "poetxq", 25.0)  # upper edge wins
    fake(run_id("adamw", {"optim.lr": 1e-3}, 0), "adamw", 28.0)
    fake(run_id("adamw", {"optim.lr": 2e-3}, 0), "adamw", 29.0)  # lower edge wins
    pending, state = plan_runs(study, results)
    ids = [p["id"] for p in pending]
    assert run_id("poetxq", {"optim.poet_lr": 0.016}, 0) in ids
    assert run_id("adamw", {"optim.lr": 0.0005}, 0) in ids
    fake(run_id("poetxq", {"optim.poet_lr": 0.016}, 0), "poetxq", 26.0)  # 8e-3 is interior now
    fake(run_id("adamw", {"optim.lr": 0.0005}, 0), "adamw", 27.0)  # edge again, max_extend hit
    pending, state = plan_runs(study, results)
    assert state["poetxq"]["best"] == {"optim.poet_lr": 8e-3}
    assert state["adamw"]["best"] == {"optim.lr": 0.0005}
    ids = [p["id"] for p in pending]
    assert sorted(ids) == sorted([
        run_id("poetxq", {"optim.poet_lr": 8e-3}, 1), run_id("adamw", {"optim.lr": 0.0005}, 1),
        run_id("frozen", {"optim.poet_lr": 8e-3}, 0), run_id("frozen", {"optim.poet_lr": 8e-3}, 1),
    ])  # fmt: skip
    frozen = next(p for p in pending if p["method"] == "frozen")
    assert frozen["extra"] == {"poet.block_size": 32, "poet.merge_interval": 3,
                               "poet.freeze_orthogonal": True}  # fmt: skip


def test_a_new_run_starts_only_when_its_method_typical_time_fits(tmp_path, corpus):
    from evals.quality_runner import _startable, expected_seconds

    study = load_study(_study(tmp_path, corpus.folder, tune_seeds=[0]))
    results: dict = {"runs": {
        "a": {"method": "adamw", "train_seconds": 200.0, "wall_s": 230.0, "resumed_from": []},
        "b": {"method": "adamw", "train_seconds": 100.0, "resumed_from": []},  # 100 + 30 scoring
        "c": {"method": "adamw", "train_seconds": 900.0, "wall_s": 50.0, "resumed_from": [40]},
    }}  # fmt: skip
    # median of 130, 230 and 930 (a resumed run counts its whole training time, 900 + 30, not
    # its last call's 50 s); poetxq has no finished run yet and borrows every method's median
    assert expected_seconds(study, results, "adamw") == 230.0
    assert expected_seconds(study, results, "poetxq") == 230.0
    assert expected_seconds(study, {"runs": {}}, "adamw") is None
    # only resumed runs finished (each call stopped them at its deadline): still an estimate
    resumed = {"runs": {"c": results["runs"]["c"]}}
    assert expected_seconds(study, resumed, "poetxq") == 930.0
    pending, _ = plan_runs(study, {"runs": {}})
    pending = [p for p in pending if p["method"] == "adamw"] + [
        p for p in pending if p["method"] == "poetxq"]  # fmt: skip
    root = tmp_path / "runs"
    assert _startable(study, results, pending, root, None) is pending[0]  # no deadline
    assert _startable(study, results, pending, root, 231.0) is pending[0]
    assert _startable(study, results, pending, root, 229.0) is None  # none fits
    # a caller that will call again on the same machine starts it anyway, while a minute is left
    assert _startable(study, results, pending, root, 229.0, resume_later=True) is pending[0]
    assert _startable(study, results, pending, root, 59.0, resume_later=True) is None
    # a run with a checkpoint on disk resumes while a minute is left, past the ones that do not fit
    (root / pending[2]["id"] / "checkpoints").mkdir(parents=True)
    assert _startable(study, results, pending, root, 61.0) is pending[2]
    assert _startable(study, results, pending, root, 59.0) is None
    assert _startable(study, {"runs": {}}, pending, root, 61.0) is pending[0]  # nothing known
    # a call that starts nothing says why, in one line
    from evals.quality_runner import _none_started

    assert _none_started(study, results, pending, 229.4) == (
        "no run started: a new run starts only when its method's typical time fits the 229 s "
        "left (adamw ~230 s, poetxq ~230 s); give a longer --deadline, or --resume-later to "
        "start runs that finish in a later call on the same machine"
    )
    assert _none_started(study, results, pending, 15.0).startswith(
        "no run started: 15 s were left before --deadline and a run starts only while a minute"
    )


def test_plan_shows_each_method_then_why_each_run_is_pending_in_start_order(
    tmp_path, corpus, capsys
):
    from evals.quality import main

    frozen = {"recipe": "poetxq", "like": "poetxq", "set": {"poet.freeze_orthogonal": True}}
    study_file = _study(tmp_path, corpus.folder, max_extend=1, tune_seeds=[0],
                        controls={"frozen": frozen})  # fmt: skip
    results = {"study": {"name": "tiny"}, "runs": {}}

    def fake(method: str, params: dict, ppl: float) -> None:
        rec = {"method": method, "tune_ppl": ppl, "test_ppl": ppl + 1}
        results["runs"][run_id(method, params, 0)] = rec

    def plan() -> list[str]:
        (tmp_path / "results.json").write_text(json.dumps(results))
        assert main(["plan", str(study_file)]) == 0
        return capsys.readouterr().out.splitlines()

    fake("poetxq", {"optim.poet_lr": 4e-3}, 30.0)
    fake("poetxq", {"optim.poet_lr": 8e-3}, 25.0)  # the high edge wins: one point past it
    fake("adamw", {"optim.lr": 1e-3}, 28.0)
    out = plan()
    assert out[0] == "poetxq: tuning, 3 points (2 grid + 1 edge extensions); 1 run(s) pending"
    assert out[1] == "adamw: tuning, 2 points (2 grid + 0 edge extensions); 1 run(s) pending"
    assert out[2] == "frozen: control, waits until poetxq is tuned; 0 run(s) pending"
    # adamw has run fewer points than poetxq: its turn comes first
    assert out[3].split()[:2] == ["[1]", run_id("adamw", {"optim.lr": 2e-3}, 0)]
    assert out[3].endswith("6 steps, 768 tokens  grid point")
    ext = run_id("poetxq", {"optim.poet_lr": 0.016}, 0)
    assert out[4].split() == [
        "[2]", ext, "6", "steps,", "768", "tokens", "edge", "extension:", "best", "point",
        "optim.poet_lr=0.008", "is", "on", "the", "high", "edge", "of", "optim.poet_lr",
    ]  # fmt: skip
    assert out[5] == (
        "2 run(s) pending, 1,536 training tokens; `run` starts them in this order (the methods "
        "in turn)"
    )
    fake("poetxq", {"optim.poet_lr": 0.016}, 26.0)  # 8e-3 is interior now: tuned
    fake("adamw", {"optim.lr": 2e-3}, 29.0)
    fake("adamw", {"optim.lr": 5e-4}, 29.5)  # 1e-3 is interior
    out = plan()
    best = {"optim.poet_lr": 8e-3}
    assert out[0] == "poetxq: tuned, best point optim.poet_lr=0.008; 1 run(s) pending"
    assert out[2] == "frozen: control at poetxq's best point; 2 run(s) pending"
    assert [ln.split()[1] for ln in out[3:7]] == [
        run_id("frozen", best, 0), run_id("frozen", best, 1), run_id("poetxq", best, 1),
        run_id("adamw", {"optim.lr": 1e-3}, 1),
    ]  # fmt: skip
    assert out[3].endswith("control at poetxq's best point, seed 0")
    assert out[5].endswith("final seed 1 at the best point")


class _InstantWorker:
    """A worker of :mod:`evals.quality_runner` that has finished when it starts (in-process: it
    writes its ``result.json`` at once), for testing the runner's scheduling alone."""

    class _Done:
        returncode = 0

        def poll(self) -> int:
            return 0

        def wait(self) -> int:
            return 0

    def __init__(self, spec: dict, study_file: Path, run_dir: Path, gpu: str | None) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        rec = {"id": spec["id"], "method": spec["method"], "diverged": None, "tune_ppl": 20.0,
               "test_ppl": 21.0, "train_seconds": 1.0}  # fmt: skip
        (run_dir / "result.json").write_text(json.dumps(rec))
        self.spec, self.run_dir, self.gpu, self.proc = spec, run_dir, gpu, self._Done()
        self.log = (run_dir / "worker.log").open("a")
        self.start = time.monotonic()


@pytest.mark.parametrize("jobs", [1, 3])
def test_plan_lists_the_runs_in_the_order_run_starts_them(tmp_path, corpus, monkeypatch,
                                                          capsys, jobs):  # fmt: skip
    """The [n] order ``plan`` prints is the order in which ``run`` starts the runs: the methods
    in turn, counted with the runs already finished (one poetxq run here), however many run
    at a time."""
    import evals.quality_runner as q
    from evals.quality import main

    grids = {"poetxq": {"recipe": "poetxq", "set": {"poet.block_size": 32},
                        "grid": {"optim.poet_lr": [4e-3, 8e-3, 1.6e-2]}},
             "adamw": {"recipe": "adamw", "grid": {"optim.lr": [1e-3, 2e-3, 4e-3]}}}  # fmt: skip
    study_file = _study(tmp_path, corpus.folder, tune_seeds=[0], final_seeds=[0], methods=grids)
    first = run_id("poetxq", {"optim.poet_lr": 4e-3}, 0)
    done = {"id": first, "method": "poetxq", "diverged": None, "tune_ppl": 30.0,
            "test_ppl": 31.0, "train_seconds": 1.0}  # fmt: skip
    results = {"study": {"name": "tiny"}, "runs": {first: done}}
    (tmp_path / "results.json").write_text(json.dumps(results))
    assert main(["plan", str(study_file)]) == 0
    planned = [ln.split()[1] for ln in capsys.readouterr().out.splitlines()
               if ln.startswith("  [")]  # fmt: skip
    assert len(planned) == 5 and planned[0].startswith("adamw__")  # adamw's turn: none run yet
    monkeypatch.setattr(q, "_Worker", _InstantWorker)
    lines: list[str] = []
    study = load_study(study_file)
    q.execute(study, study_file, Path(study.results), jobs=jobs, gpus=None, deadline=None,
              max_runs=None, echo=lines.append)  # fmt: skip
    started = [ln.split()[1] for ln in lines if ln.startswith("start ")]
    assert started == planned, lines


def test_help_explains_stopping_and_resuming(capsys):
    from evals.quality import main

    for argv in (["--help"], ["run", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
        text = " ".join(capsys.readouterr().out.split())
        assert "--deadline" in text and "--max-runs" in text
        assert "Every finished run is written to the results JSON" in text
        assert "resumes from that checkpoint when its run folder" in text
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "SIGTERM and save a checkpoint; a later `run` resumes them" in text
    assert "a later `run` goes on with the next ones" in text


@pytest.mark.parametrize(
    ("where", "bad"),
    [("grid", "optim.poet_lrr"), ("set", "poet.blok_size"), ("control", "poet.freeze_orthogonall")],
)
def test_a_bad_recipe_key_fails_plan_and_run_in_one_line(tmp_path, corpus, where, bad, capsys):
    """A typo in a grid key, a method's knobs or a control (which has no pending run while its
    method tunes) is found when planning, before any worker starts."""
    from evals import quality, quality_plan, quality_worker

    poet = {"recipe": "poetxq", "set": {"poet.block_size": 32}, "grid": {"optim.poet_lr": [4e-3]}}
    controls = {}
    if where == "grid":
        poet["grid"] = {bad: [4e-3]}
    elif where == "set":
        poet["set"] = {bad: 32}
    else:
        controls = {"frozen": {"recipe": "poetxq", "like": "poetxq", "set": {bad: True}}}
    study = _study(tmp_path, corpus.folder, controls=controls,
                   methods={"poetxq": poet, "adamw": {"recipe": "adamw",
                                                      "grid": {"optim.lr": [1e-3]}}})  # fmt: skip
    method = "frozen" if where == "control" else "poetxq"
    for cmd in ("plan", "run"):
        assert quality.main([cmd, str(study)]) == 2
        msg = capsys.readouterr().err.rstrip("\n")
        assert msg.startswith(f"error: study {study}: method {method} ") and "\n" not in msg
        assert f"unknown key '{bad}'" in msg
    assert not (tmp_path / "runs").exists() and not (tmp_path / "results.json").exists()
    # the worker composes a run's config with the very function the planner checks
    assert quality_worker.run_recipe is quality_plan.run_recipe


def test_run_recipe_sets_the_run_length_seed_and_schedule(tmp_path, corpus):
    from evals.quality_plan import check_runs

    study = load_study(_study(tmp_path, corpus.folder))
    pending, _ = plan_runs(study, {"runs": {}})
    recipes = check_runs(study, "study.yaml", pending)
    assert list(recipes) == [p["id"] for p in pending]
    r = recipes[run_id("adamw", {"optim.lr": 2e-3}, 1)]
    assert (r.train.max_steps, r.train.seed, r.train.eval_every) == (6, 1, 3)
    assert r.optim.lr == 2e-3 and r.optim.warmup_steps == 1 and r.train.save_checkpoint


_FAKE_WORKER = """
import json, sys, time
from pathlib import Path
run_dir = Path(sys.argv[1])
spec = json.loads((run_dir / "spec.json").read_text())
tries = run_dir / "tries"
n = int(tries.read_text()) + 1 if tries.exists() else 1
tries.write_text(str(n))
time.sleep(0.2 if spec["method"] == "adamw" and n == 1 else 0.6)
if spec["method"] == "adamw" and n == 1:
    print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.91 GiB.")
    sys.exit(1)
rec = {"id": spec["id"], "method": spec["method"], "diverged": None, "tune_ppl": 20.0 + n,
       "test_ppl": 21.0, "train_seconds": 1.0}
(run_dir / "result.json").write_text(json.dumps(rec))
"""


@pytest.fixture
def fake_workers(monkeypatch):
    """``evals.quality`` with its workers replaced by :data:`_FAKE_WORKER` processes (no
    training: each writes a result.json, or prints an out-of-memory line once)."""
    import subprocess
    import sys

    import evals.quality_runner as q

    class FakeWorker(q._Worker):
        def __init__(self, spec, study_file, run_dir, gpu):
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "spec.json").write_text(json.dumps(spec))
            self.spec, self.run_dir, self.gpu = spec, run_dir, gpu
            self.log = (run_dir / "worker.log").open("a")
            self.proc = subprocess.Popen([sys.executable, "-c", _FAKE_WORKER, str(run_dir)],
                                         stdout=self.log, stderr=subprocess.STDOUT)  # fmt: skip
            self.start = q.time.monotonic()

    monkeypatch.setattr(q, "_Worker", FakeWorker)
    return q


def test_a_run_out_of_gpu_memory_is_requeued_with_fewer_runs_at_a_time(
    tmp_path, corpus, fake_workers
):
    q = fake_workers
    study_file = _study(tmp_path, corpus.folder, tune_seeds=[0], final_seeds=[0])
    study = load_study(study_file)
    lines: list[str] = []
    results = q.execute(study, study_file, Path(study.results), jobs=4, gpus=None,
                        deadline=None, max_runs=None, echo=lines.append)  # fmt: skip
    oom = [ln for ln in lines if ln.startswith("out of GPU memory")]
    # both adamw runs ran out of memory beside the others, were re-queued, then finished
    assert len(oom) == 2 and not any(ln.startswith("FAILED") for ln in lines), lines
    assert "with 4 runs sharing the GPU" in oom[0] and "at most 3 run at a time" in oom[0]
    assert "at most 2 run at a time" in oom[1]  # 3 sharing after the first: jobs 3 -> 2
    assert len(results["runs"]) == 4
    adamw = [r for r in results["runs"].values() if r["method"] == "adamw"]
    assert [r["tune_ppl"] for r in adamw] == [22.0, 22.0]  # each finished on its second try


def test_methods_starts_only_the_named_methods_runs(tmp_path, corpus, fake_workers):
    q = fake_workers
    study_file = _study(tmp_path, corpus.folder, tune_seeds=[0], final_seeds=[0])
    study = load_study(study_file)
    results = q.execute(study, study_file, Path(study.results), jobs=1, gpus=None,
                        deadline=None, max_runs=None, echo=lambda _: None,
                        methods=["poetxq"])  # fmt: skip
    assert sorted(results["runs"]) == sorted(
        run_id("poetxq", {"optim.poet_lr": v}, 0) for v in (4e-3, 8e-3)
    )
    pending, _ = plan_runs(study, results)
    assert {p["method"] for p in pending} == {"adamw"}  # left for a later call
    with pytest.raises(SystemExit, match="--methods: qgalore not in the study; it has poetxq"):
        q.execute(study, study_file, Path(study.results), jobs=1, gpus=None, deadline=None,
                  max_runs=None, methods=["qgalore"])  # fmt: skip


def test_report_of_an_own_study_needs_out_and_says_its_own_command(tmp_path, corpus, capsys):
    """docs/QUALITY.md is the committed studies' report: another study's report needs --out,
    names the command that made it and leaves the repository's parity runs out."""
    from evals.quality import main

    study_file = _study(tmp_path, corpus.folder)
    before = (REPO / "docs" / "QUALITY.md").read_bytes()
    assert main(["report", str(study_file)]) == 2
    assert capsys.readouterr().err.startswith("error: report: --out is needed for a study outside")
    assert (REPO / "docs" / "QUALITY.md").read_bytes() == before
    out = tmp_path / "rep" / "report.md"
    assert main(["report", str(study_file), "--out", str(out)]) == 0
    text = out.read_text()
    assert f"Rendered by `python evals/quality.py report {study_file}`" in text
    assert "## tiny:" in text and "Parity" not in text
    assert not (out.parent / "img" / "parity_official_60m_h200.png").exists()


@pytest.mark.slow
def test_tiny_study_end_to_end_with_resume(tmp_path, monkeypatch):
    from evals.quality_report import render
    from evals.quality_runner import execute

    corpus = _tiny_corpus(tmp_path / "corpus", ood=True)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    study_file = _study(tmp_path, corpus.folder, max_test_tokens=32 * 20)
    study = load_study(study_file)
    results_path = Path(study.results)
    lines: list[str] = []
    execute(study, study_file, results_path, jobs=2, gpus=None, deadline=None, max_runs=3,
            echo=lines.append)  # fmt: skip
    first = json.loads(results_path.read_text())
    assert len(first["runs"]) == 3, lines
    execute(study, study_file, results_path, jobs=2, gpus=None, deadline=None, max_runs=None,
            echo=lines.append)  # fmt: skip
    results = json.loads(results_path.read_text())
    assert len(results["calls"]) == 2
    assert len(results["runs"]) == 8, lines  # 2 methods x 2 lrs x 2 seeds; finals reuse them
    for rid, rec in first["runs"].items():  # finished runs are kept, not re-run
        assert results["runs"][rid] == rec
    for rec in results["runs"].values():
        assert rec["diverged"] is None and rec["steps"] == 6
        # the worker's rebuilt model scores the whole tune split as the trainer's last eval did
        assert rec["tune_ppl"] == pytest.approx(rec["trainer_final_val_ppl"], rel=1e-4)
        assert set(rec["test_ppl_by_source"]) == {"even", "odd"}
        lo, hi = sorted(rec["test_ppl_by_source"].values())
        assert lo < rec["test_ppl"] < hi  # token-weighted over the sources
        assert 0 < rec["test_tokens_scored"] <= 32 * 20  # max_test_tokens
        log = (tmp_path / "runs" / "tiny" / rec["id"] / "worker.log").read_text()
        assert "scoring tune split: " in log and "scoring train sample: " in log
        assert "scoring test split: " in log and "max_test_tokens 640)" in log
        assert "scoring ood split: " in log and rec["ood_ppl"] > 1
        assert math.isfinite(rec["train_tune_gap_nats"])
        if rec["device"].startswith("cpu"):  # the host's peak only (CI)
            assert rec["peak_memory_gib"] is None and rec["peak_rss_gib"] > 0
        else:  # on a GPU host the workers train on the GPU (the GPU test record)
            assert rec["device"].startswith("cuda") and rec["peak_memory_gib"] > 0
    poet = results["runs"][run_id("poetxq", {"optim.poet_lr": 4e-3}, 0)]
    assert poet["effective_lr"]["orthogonal_Q"] == pytest.approx(2e-3)
    assert poet["merges"] == 1 and poet["settings"]["grad_clip"] == 1.0
    assert not (tmp_path / "runs" / "tiny" / poet["id"] / "model.safetensors").exists()
    summary = summarize(study, results)
    assert summary["poetxq"]["tuned"] and len(summary["adamw"]["test_ppl"]) == 2
    assert summary["adamw"]["vs_reference"] in ("better", "worse", "tie", "n/a")
    render([(study, results)], tmp_path / "docs" / "QUALITY.md")
    text = (tmp_path / "docs" / "QUALITY.md").read_text()
    assert "| poetxq |" in text and "| adamw |" in text
    assert (tmp_path / "docs" / "img" / "quality_tiny_lr.png").stat().st_size > 1000


def test_parity_section_renders_each_step_and_the_agreement(tmp_path):
    from evals.quality_report import parity_section

    steps = [
        {"step": 0, "ours": 10.5, "official": 10.4, "difference": -0.1, "se": 0.01,
         "agree": None},
        {"step": 50, "ours": 6.0, "official": 6.3, "difference": 0.3, "se": 0.05, "agree": False},
    ]  # fmt: skip
    runs = [
        {"seed": s, "ours": {"val": [{"step": 0, "val_loss": 10.5}, {"step": 50, "val_loss": 6.0}]},
         "official": {"val": [{"step": 50, "val_loss": 6.3}]}}
        for s in (0, 1)
    ]  # fmt: skip
    d = {
        "settings": {"model": "llama-60m", "steps": 50, "batch_size": 8, "seq_len": 32,
                     "block_size": 16, "merge_interval": 20, "poet_lr": 4e-3, "lr": 1e-2,
                     "precision": "fp32"},
        "summary": {"rule": "a rule", "steps": steps},
        "official_code": {"repo": "github.com/x/poet", "commit": "3a34bb6acacf"},
        "runs": runs, "gpu": "CPU", "commit": "abcdef123", "what": "a test",
        "differences": ["one", "two"],
    }  # fmt: skip
    path = tmp_path / "parity_official_t.json"
    path.write_text(json.dumps(d))
    lines = parity_section(path, tmp_path, "img")
    assert "| 50 | 6.0000 | 6.3000 | +0.3000 | +0.3000, +0.3000 | **no** |" in lines
    assert "| 0 | 10.5000 | 10.4000 | -0.1000 | – | – (one seed) |" in lines  # no official 0
    text = "\n".join(lines)
    assert "seeds run: 0, 1" in text and "one; two." in text and "@3a34bb6" in text
    assert (tmp_path / "parity_official_t.png").stat().st_size > 1000
    assert lines[-2] == "![parity curves](img/parity_official_t.png)"


@pytest.mark.parametrize(
    "path",
    sorted((Path(__file__).parents[1] / "evals" / "studies").glob("*.yaml")),
    ids=lambda p: p.stem,
)
def test_every_committed_study_file_loads_and_its_recipes_compose(path):
    from evals.quality_plan import check_runs

    study = load_study(path)
    pending, _ = plan_runs(study, {"runs": {}})
    recipes = check_runs(study, path, pending)
    assert set(recipes) == {p["id"] for p in pending} and len(pending) >= 4 * len(study.methods)
    for p in pending:  # the shared settings reach every run
        r = recipes[p["id"]]
        assert r.train.seq_len == study.shared["train.seq_len"]
        assert r.optim.grad_clip == study.shared["optim.grad_clip"]


def test_a_method_still_tuning_reports_its_tuning_seeds_best_not_other_seeds(tmp_path, corpus):
    from evals.quality_report import render

    # seed 2 at one point (a control's seeds before the method was tuned) scores lower than
    # any tuning run: the best-so-far must be the tuning seed's, as the planner chooses it
    study = load_study(_study(tmp_path, corpus.folder, tune_seeds=[0]))
    point = {"optim.poet_lr": 4e-3}
    results: dict = {"runs": {}}
    for seed, ppl in ((0, 30.0), (2, 20.0)):
        rid = run_id("poetxq", point, seed)
        results["runs"][rid] = {"id": rid, "method": "poetxq", "seed": seed, "params": point,
                                "tune_ppl": ppl, "test_ppl": ppl + 1}  # fmt: skip
    render([(study, results)], tmp_path / "QUALITY.md")
    row = next(ln for ln in (tmp_path / "QUALITY.md").read_text().splitlines()
               if ln.startswith("| poetxq |"))  # fmt: skip
    assert "tuning: 1 point(s) run, best tune ppl so far 30.00 at optim.poet_lr 0.004" in row
    # the heading names the model and the shape `shared` gives it
    heading = (
        "## tiny: llama-60m (reshaped by `shared`: hidden_size 64, intermediate_size 128, "
        "num_attention_heads 2, num_hidden_layers 2, max_position_embeddings 64), "
    )
    assert heading in (tmp_path / "QUALITY.md").read_text()


def test_the_results_note_is_folded_under_the_call_line(tmp_path, corpus):
    from evals.quality_report import render

    study = load_study(_study(tmp_path, corpus.folder, tune_seeds=[0]))
    call = {"date": "2026-12-06T00:00:00Z", "device": "1 x GPU", "commit": "abcdef0123"}
    results = {"runs": {}, "calls": [call], "note": "Session 1: two calls, 3 jobs."}
    render([(study, results)], tmp_path / "QUALITY.md")
    lines = (tmp_path / "QUALITY.md").read_text().splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith("Results file"))
    assert lines[at].endswith("last call 2026-12-06T00:00:00Z on 1 x GPU at abcdef0.")
    fold = lines[at + 2 : at + 7]
    assert fold[0].startswith("<details><summary>") and fold[-1] == "</details>"
    assert "Session 1: two calls, 3 jobs." in fold


def test_a_control_with_its_own_seeds_runs_only_those(tmp_path, corpus):
    lowest = {"recipe": "poetxq", "like": "poetxq", "set": {"train.memory": "lowest"},
              "seeds": [1]}  # fmt: skip
    study = load_study(_study(tmp_path, corpus.folder, controls={"lowest": lowest}))
    results: dict = {"runs": {}}
    for seed in (0, 1):  # poetxq and adamw tuned at both tuning seeds (= final seeds)
        for method, key, values in (("poetxq", "optim.poet_lr", (4e-3, 8e-3)),
                                    ("adamw", "optim.lr", (1e-3, 2e-3))):  # fmt: skip
            for v, ppl in zip(values, (30.0, 29.0), strict=True):  # interior? max_extend 0
                rid = run_id(method, {key: v}, seed)
                results["runs"][rid] = {"method": method, "tune_ppl": ppl, "test_ppl": ppl}
    pending, state = plan_runs(study, results)
    assert state["poetxq"]["tuned"]
    assert [p["id"] for p in pending] == [run_id("lowest", {"optim.poet_lr": 8e-3}, 1)]
    bad = {**lowest, "seeds": [7]}
    with pytest.raises(SystemExit, match=r"control lowest's seeds \[7\] must be among final_seeds"):
        load_study(_study(tmp_path, corpus.folder, controls={"lowest": bad}))


def test_a_diverged_seed_is_reported_as_diverged_not_averaged(tmp_path, corpus):
    from evals.quality_report import render

    wide = {"recipe": "poetxq", "like": "poetxq", "set": {"poet.block_size": 64}}
    study = load_study(_study(tmp_path, corpus.folder, controls={"wide": wide}))
    results: dict = {"runs": {}}
    for seed in (0, 1):
        for method, key, values in (("poetxq", "optim.poet_lr", (4e-3, 8e-3)),
                                    ("adamw", "optim.lr", (1e-3, 2e-3))):  # fmt: skip
            for v, ppl in zip(values, (30.0, 29.0), strict=True):
                rid = run_id(method, {key: v}, seed)
                results["runs"][rid] = {"id": rid, "method": method, "seed": seed,
                                        "params": {key: v}, "tune_ppl": ppl,
                                        "test_ppl": ppl + seed}  # fmt: skip
    point = {"optim.poet_lr": 8e-3}
    for seed, ppl in ((0, 31.0), (1, None)):  # seed 1 of the control went to nan
        rid = run_id("wide", point, seed)
        results["runs"][rid] = {"id": rid, "method": "wide", "seed": seed, "params": point,
                                "tune_ppl": ppl, "test_ppl": ppl,
                                "diverged": None if ppl else "loss is nan"}  # fmt: skip
    summary = summarize(study, results)
    assert summary["wide"]["test_ppl"] == {0: 31.0}
    assert summary["wide"]["diverged"] == [1]
    assert summary["wide"]["mean"] == 31.0
    render([(study, results)], tmp_path / "QUALITY.md")
    row = next(ln for ln in (tmp_path / "QUALITY.md").read_text().splitlines()
               if ln.startswith("| wide |"))  # fmt: skip
    assert "| 31.00 ± –; diverged (1 seed(s)) | 2 |" in row


def test_a_cpu_run_reports_its_host_rss_peak_labelled_as_such(tmp_path, corpus):
    """A CPU run has no CUDA peak: its record carries the worker's peak RSS (the trainer's
    peak_rss_bytes) and the report's peak column shows it marked host RSS, with a note saying
    what that is; a GPU run's record and row keep the CUDA peak alone."""
    from evals.quality_report import render
    from evals.quality_worker import memory_peaks
    from poetxq.training.train import TrainResult

    def summary(cuda: int | None, rss: int | None) -> TrainResult:
        return TrainResult(run_dir="r", steps=6, tokens=768, initial_val_ppl=500.0,
                           final_val_ppl=30.0, unigram_val_ppl=400.0, final_train_loss=3.4,
                           tokens_per_s=900.0, train_seconds=1.0, merges=1, device="cpu fp32",
                           peak_memory_bytes=cuda, peak_rss_bytes=rss)  # fmt: skip

    cpu, gpu = memory_peaks(summary(None, 3 * 2**29)), memory_peaks(summary(2**31, 3 * 2**29))
    assert cpu == {"peak_memory_gib": None, "peak_rss_gib": 1.5}
    assert gpu == {"peak_memory_gib": 2.0}
    study = load_study(_study(tmp_path, corpus.folder, tune_seeds=[0], final_seeds=[0]))
    results: dict = {"runs": {}}
    for method, key, values, peaks in (("poetxq", "optim.poet_lr", (4e-3, 8e-3), cpu),
                                       ("adamw", "optim.lr", (1e-3, 2e-3), gpu)):  # fmt: skip
        for v, ppl in zip(values, (30.0, 29.0), strict=True):
            rid = run_id(method, {key: v}, 0)
            results["runs"][rid] = {"id": rid, "method": method, "seed": 0, "params": {key: v},
                                    "tune_ppl": ppl, "test_ppl": ppl, **peaks}  # fmt: skip
    render([(study, results)], tmp_path / "QUALITY.md")
    text = (tmp_path / "QUALITY.md").read_text()
    rows = {ln.split(" | ")[0]: ln for ln in text.splitlines() if ln.startswith("| ")}
    assert rows["| poetxq"].endswith("| 1.50 host RSS | – | – |")  # peak, gap, ood ppl
    assert rows["| adamw"].endswith("| 2.00 | – | – |")
    assert "marked host RSS (a CPU run), the worker process's peak resident set size" in text
    del results["runs"][run_id("poetxq", {"optim.poet_lr": 8e-3}, 0)]["peak_rss_gib"]
    render([(study, results)], tmp_path / "QUALITY.md")  # no peak known: no note either
    text = (tmp_path / "QUALITY.md").read_text()
    assert "| – | – |" in text and "host RSS" not in text


def test_the_val_curve_has_one_point_per_step(tmp_path):
    """A resume at the final step logs that step's evaluation again: the curve keeps one point
    per step (the last), in step order, with tokens = step x tokens per step."""
    from evals.quality_worker import _curve

    rows = [{"step": 0, "val_ppl": 900.0}, {"step": 2, "loss": 3.0},
            {"step": 2, "val_ppl": 20.0}, {"step": 4, "val_ppl": 13.3},
            {"step": 4, "event": "resumed"}, {"step": 4, "val_ppl": 13.2}]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert _curve(tmp_path, 10) == [
        {"step": 0, "tokens": 0, "val_ppl": 900.0},
        {"step": 2, "tokens": 20, "val_ppl": 20.0},
        {"step": 4, "tokens": 40, "val_ppl": 13.2},
    ]
    assert _curve(tmp_path / "missing", 10) == []


def test_an_interrupted_runner_stops_its_workers_and_records_an_orphans_result(
    tmp_path, corpus, fake_workers
):
    """SIGTERM (or Ctrl-C) to the runner: its workers are stopped (SIGTERM) and the call ends
    with KeyboardInterrupt after one line; a run whose worker finished after its runner was
    killed (result.json beside an equal spec.json) is recorded, not trained again."""
    import signal

    q = fake_workers
    study_file = _study(tmp_path, corpus.folder, tune_seeds=[0], final_seeds=[0])
    study = load_study(study_file)
    pending = [p for p in plan_runs(study, {"runs": {}})[0] if p["method"] == "poetxq"]
    orphan = REPO / study.runs_dir / study.name / pending[0]["id"]
    orphan.mkdir(parents=True)
    (orphan / "spec.json").write_text(json.dumps(pending[0]))
    rec = {"id": pending[0]["id"], "method": "poetxq", "diverged": None, "tune_ppl": 30.0,
           "test_ppl": 31.0, "train_seconds": 1.0}  # fmt: skip
    (orphan / "result.json").write_text(json.dumps(rec))
    lines: list[str] = []

    def echo(line: str) -> None:  # the runner's main thread: the signal arrives right here
        lines.append(line)
        if line.startswith("start "):  # one worker running (it sleeps 0.6 s): a scheduler stops us
            signal.raise_signal(signal.SIGTERM)

    with pytest.raises(KeyboardInterrupt):
        q.execute(study, study_file, Path(study.results), jobs=2, gpus=None, deadline=None,
                  max_runs=None, echo=echo, methods=["poetxq"])  # fmt: skip
    assert lines[0] == f"recorded {rec['id']}: its worker had finished after its runner stopped"
    assert lines[1].startswith(f"start {pending[1]['id']}")
    assert lines[2].startswith(f"stopped {pending[1]['id']} after ")
    assert lines[3:] == ["interrupted: 1 run(s) stopped with a checkpoint; run again to resume"]
    saved = json.loads(Path(study.results).read_text())
    assert saved["runs"] == {rec["id"]: rec}  # the orphan's result, nothing else finished
    assert signal.getsignal(signal.SIGTERM) is not q._raise_interrupt  # handler put back


@pytest.mark.parametrize(
    ("over", "says"),
    [({"reference": "poetq"}, "reference 'poetq' is not one of its methods (poetxq, adamw)"),
     ({"tune_seed": [0]}, "tune_seed: extra inputs are not permitted"),
     ({"max_extend": -1}, "max_extend: input should be greater than or equal to 0")],
)  # fmt: skip
def test_a_study_file_mistake_is_one_line_naming_the_key(tmp_path, corpus, over, says):
    """A misspelt reference (the table's "is better" column would read "—" everywhere), an
    unknown key and a bad value each stop the study in one line naming the key."""
    with pytest.raises(SystemExit) as exc:
        load_study(_study(tmp_path, corpus.folder, **over))
    msg = str(exc.value)
    assert msg.startswith("error: study ") and says in msg and "\n" not in msg, msg


def test_bad_input_exits_2_with_one_error_line_on_stderr(tmp_path, corpus, capsys):
    """plan, run and report refuse bad input (a study file mistake, a results file of another
    study, an unknown --methods name) with status 2 and one ``error:`` line on stderr, as the
    ``poetxq`` commands do; nothing on stdout, no worker started."""
    from evals.quality import main

    bad = _study(tmp_path, corpus.folder, tune_seed=[0])

    def refused(*argv: str) -> str:
        assert main(list(argv)) == 2
        out, err = capsys.readouterr()
        assert out == "" and len(err.splitlines()) == 1 and err.startswith("error: "), err
        return err

    for cmd in (["plan"], ["run"], ["report", "--out", str(tmp_path / "r.md")]):
        assert "tune_seed: extra inputs are not permitted" in refused(*cmd, str(bad))
    good = _study(tmp_path, corpus.folder)
    methods = refused("run", str(good), "--methods", "qgalore")
    assert "--methods: qgalore not in the study" in methods
    (tmp_path / "results.json").write_text(json.dumps({"study": {"name": "other"}, "runs": {}}))
    assert "belongs to another study" in refused("plan", str(good))
    assert not (tmp_path / "runs").exists() and not (tmp_path / "r.md").exists()


def test_a_study_corpus_builds_from_your_own_text(tmp_path, capsys):
    """prepare_offline_corpus --text DIR: each first-level subfolder is a source, files directly
    in DIR the source named after it; every document lands in exactly one split, and the
    corpus opens with those sources. A folder without usable text is one line."""
    import importlib

    from evals.prepare_offline_corpus import collect_text
    from evals.prepare_offline_corpus import main as prepare

    topics = importlib.import_module("pydoc_data.topics").topics
    text = tmp_path / "mine"
    for i, key in enumerate(sorted(topics)[:60]):
        folder = text / ("manuals" if i % 3 else "") / ("notes" if i % 3 == 2 else "")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{key}.txt").write_text(topics[key])
    (text / "binary.bin").write_bytes(b"\x00" * 500)  # not .txt/.md: left out
    out = tmp_path / "corpus"
    assert prepare(["--text", str(text), "--out", str(out), "--vocab-size", "300",
                    "--tune-fraction", "0.2", "--test-fraction", "0.2"]) == 0  # fmt: skip
    c = TokenCorpus.open(out)
    info = json.loads((out / "corpus.json").read_text())
    assert set(info["sources"]) == {"mine", "manuals"}
    docs = collect_text(text)
    per_split = [info["splits"][s]["documents"] for s in ("train", "tune", "test")]
    assert min(per_split) > 0 and sum(per_split) == sum(map(len, docs.values()))
    assert c.manifest["splits"]["train"]["tokens"] > c.manifest["splits"]["test"]["tokens"] > 0
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit, match=r"holds no \.txt or \.md file"):
        prepare(["--text", str(empty), "--out", str(tmp_path / "c2")])


def test_a_folder_of_text_named_as_a_corpus_gets_the_text_build_command(tmp_path):
    """A study (or --data) naming a folder of .txt files where a token corpus belongs: the error
    says to build the corpus from that text into a new folder, not to write into the text."""
    text = tmp_path / "notes"
    (text / "a").mkdir(parents=True)
    (text / "a" / "one.txt").write_text("some words\n")
    with pytest.raises(CorpusError) as err:
        TokenCorpus.open(text)
    assert str(err.value) == (
        f"{text} is not a token corpus (no corpus.json); build one with python "
        f"evals/prepare_offline_corpus.py --text {text} --out {text}-corpus, and name "
        f"{text}-corpus instead"
    )
    with pytest.raises(CorpusError, match=re.escape(f"--out {tmp_path / 'none'}") + "$"):
        TokenCorpus.open(tmp_path / "none")


def test_a_best_point_left_on_a_grid_edge_is_flagged(tmp_path, corpus):
    """With max_extend reached (0 here) a best point on the edge of what was tried is named in
    the report (a better rate may lie outside); an interior best and a one-value axis are not."""
    from evals.quality_report import _edge_notes

    study = load_study(_study(tmp_path, corpus.folder))
    pts = [{"optim.lr": 1e-3}, {"optim.lr": 2e-3}]
    state = {
        "adamw": {"tuned": True, "points": pts, "best": {"optim.lr": 2e-3}},
        "poetxq": {"tuned": True, "best": {"optim.poet_lr": 4e-3, "optim.lr": 1e-2},
                   "points": [{"optim.poet_lr": v, "optim.lr": 1e-2} for v in (2e-3, 4e-3, 8e-3)]},
    }  # fmt: skip
    assert _edge_notes(study, state) == ["adamw: optim.lr 0.002 (high edge)"]
    state["adamw"]["best"] = {"optim.lr": 1e-3}
    assert _edge_notes(study, state) == ["adamw: optim.lr 0.001 (low edge)"]
    state["adamw"]["tuned"] = False  # still tuning: nothing to say yet
    assert _edge_notes(study, state) == []


def test_the_corpus_split_keeps_every_file_whole():
    """split_documents assigns whole units (files): no unit has documents in two splits, each
    held-out split takes at least its share of a source's documents (whole files, so a little
    more), train the rest, the order within a split is the input order, and the same seed
    gives the same split."""
    from evals.prepare_offline_corpus import split_documents

    docs = {
        "manuals": [(f"m{i // 4}", f"manual {i // 4} page {i}") for i in range(200)],  # 50 files
        "novels": [(f"n{i // 10}", f"novel {i // 10} part {i}") for i in range(100)],  # 10 files
    }
    fractions = {"test": 0.1, "tune": 0.05}
    splits = split_documents(docs, 7, fractions)
    assert splits == split_documents(docs, 7, fractions)
    assert splits != split_documents(docs, 8, fractions)
    for source, items in docs.items():
        unit_of = dict((d, u) for u, d in items)
        owners: dict[str, set[str]] = {}
        for split, by_source in splits.items():
            got = by_source[source]
            assert got == [d for _, d in items if d in set(got)]  # input order kept
            for d in got:
                owners.setdefault(unit_of[d], set()).add(split)
        assert all(len(s) == 1 for s in owners.values()), owners
        assert sum(len(splits[s][source]) for s in splits) == len(items)
        for split, frac in fractions.items():
            n = len(splits[split][source])
            per_file = 4 if source == "manuals" else 10
            assert frac * len(items) <= n < frac * len(items) + per_file
    # a source of one file goes to train whole (a held-out split never takes the last unit)
    one = split_documents({"solo": [("f", "a"), ("f", "b")]}, 0, fractions)
    assert one["train"]["solo"] == ["a", "b"] and one["test"]["solo"] == []


def test_embedded_units_are_the_embedded_documents_in_order():
    """The units the corpus build splits by are the embedded source's documents, in its order:
    a play's scenes under its file name, a Bible chapter under its book."""
    from poetxq.data.sources import embedded_files, embedded_source, embedded_units

    units = list(embedded_units(*embedded_files()))
    assert [d for _, d in units] == list(embedded_source().documents())
    books = {u for u, _ in units if u.startswith("kjv:")}
    assert len(books) == 66 and "kjv:Genesis" in books
    assert len({u for u, _ in units} - books) == 42  # the Shakespeare texts


def test_methods_within_two_percent_get_the_close_seeds(tmp_path, corpus):
    """Once a method and the reference have their final seeds, a mean test ppl within
    close_margin (2 %) of the reference's adds the close seeds to both (paired); further apart,
    none are added; the summary then pairs over all seeds the two share."""
    study = load_study(_study(tmp_path, corpus.folder, tune_seeds=[0], final_seeds=[1, 2, 3],
                              close_seeds=[4, 5]))  # fmt: skip
    results: dict = {"runs": {}}
    best = {"poetxq": {"optim.poet_lr": 4e-3}, "adamw": {"optim.lr": 1e-3}}

    def put(method: str, params: dict, seed: int, ppl: float) -> None:
        rid = run_id(method, params, seed)
        results["runs"][rid] = {"id": rid, "method": method, "seed": seed, "params": params,
                                "tune_ppl": ppl, "test_ppl": ppl}  # fmt: skip

    for method, pts in (("poetxq", [4e-3, 8e-3]), ("adamw", [1e-3, 2e-3])):
        key = "optim.poet_lr" if method == "poetxq" else "optim.lr"
        for v, ppl in zip(pts, (20.0, 25.0)):
            put(method, {key: v}, 0, ppl)
    pending, _ = plan_runs(study, results)
    assert sorted((p["method"], p["seed"]) for p in pending) == [
        ("adamw", 1),
        ("adamw", 2),
        ("adamw", 3),
        ("poetxq", 1),
        ("poetxq", 2),
        ("poetxq", 3),
    ]
    for s, (a, b) in zip((1, 2, 3), ((20.0, 20.3), (20.2, 20.4), (19.9, 20.2))):
        put("poetxq", best["poetxq"], s, a)
        put("adamw", best["adamw"], s, b)  # 1.3 % above poetxq: close
    pending, _ = plan_runs(study, results)
    assert sorted((p["method"], p["seed"]) for p in pending) == [
        ("adamw", 4),
        ("adamw", 5),
        ("poetxq", 4),
        ("poetxq", 5),
    ]
    assert "within 2% of poetxq" in pending[0]["why"]
    for s in (4, 5):
        put("poetxq", best["poetxq"], s, 20.0)
        put("adamw", best["adamw"], s, 20.25)
    assert plan_runs(study, results)[0] == []
    row = summarize(study, results)["adamw"]
    assert row["vs_reference_stats"]["n"] == 5 and sorted(row["test_ppl"]) == [1, 2, 3, 4, 5]
    # 5 % apart: no close seeds
    for s in (1, 2, 3):
        put("adamw", best["adamw"], s, 21.0)
    for s in (4, 5):
        del results["runs"][run_id("adamw", best["adamw"], s)]
        del results["runs"][run_id("poetxq", best["poetxq"], s)]
    assert plan_runs(study, results)[0] == []


def test_a_refining_study_tries_the_sqrt2_neighbours_of_an_interior_best(tmp_path, corpus):
    """refine: true: once the best point is interior, best·√2 and best/√2 on each axis are
    planned (labelled as a refinement), counted apart from max_extend; around a refinement
    winner no more points are added."""
    from evals.quality_stats import refinement_points

    grid = {"optim.lr": [1e-3, 2e-3, 4e-3], "optim.matrix_lr": [1e-3]}
    pts = [{"optim.lr": v, "optim.matrix_lr": 1e-3} for v in grid["optim.lr"]]
    best = pts[1]
    assert refinement_points(grid, pts, best) == [
        {"optim.lr": 0.00141421, "optim.matrix_lr": 1e-3},
        {"optim.lr": 0.00282843, "optim.matrix_lr": 1e-3},
    ]
    won = {"optim.lr": 0.00282843, "optim.matrix_lr": 1e-3}
    assert refinement_points(grid, [*pts, *refinement_points(grid, pts, best)], won) == []
    # inside the original range a refinement does not use up the edge extensions (max_extend
    # 1 here); the step past the edge is then the refined ratio, √2
    edge = {"optim.lr": 4e-3, "optim.matrix_lr": 1e-3}
    assert extension_points(grid, [*pts, won], edge, [won], 1) == [
        {"optim.lr": 0.00565685, "optim.matrix_lr": 1e-3}
    ]
    study = load_study(_study(tmp_path, corpus.folder, tune_seeds=[0], final_seeds=[0],
                              refine=True))  # fmt: skip
    results: dict = {"runs": {}}
    for method, key, values, scores in (
        ("poetxq", "optim.poet_lr", (4e-3, 8e-3), (30.0, 31.0)),
        ("adamw", "optim.lr", (1e-3, 2e-3), (25.0, 24.0)),
    ):
        for v, ppl in zip(values, scores):
            rid = run_id(method, {key: v}, 0)
            results["runs"][rid] = {"method": method, "tune_ppl": ppl, "test_ppl": ppl}
    pending, _ = plan_runs(study, results)
    # max_extend 0: both bests sit on an edge, so the refinement is all that is added
    got = sorted((p["method"], tuple(p["params"].values())) for p in pending)
    assert got == [("adamw", (0.00141421,)), ("adamw", (0.00282843,)),
                   ("poetxq", (0.00282843,)), ("poetxq", (0.00565685,))]  # fmt: skip
    labels = {p["params"].get("optim.lr"): p["why"] for p in pending if p["method"] == "adamw"}
    assert labels[0.00141421] == "√2 refinement of optim.lr around the best point"
    assert labels[0.00282843].startswith("edge extension")
