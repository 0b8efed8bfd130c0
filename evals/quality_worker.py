"""One run of the quality study (started by ``evals/quality.py run``; not meant to be run by hand).

``python -m evals.quality_worker STUDY.yaml RUN_DIR`` reads ``RUN_DIR/spec.json``, trains the
run's recipe on the study's token corpus (``train`` split; ``tune`` split for validation),
resuming from ``RUN_DIR/checkpoints`` when an earlier attempt was stopped, then rebuilds the
trained model from ``RUN_DIR/model.safetensors`` and scores it: the whole ``tune`` split, the
``test`` split overall and per source (the whole split unless the study sets
``max_test_tokens``), a sample of training windows (the train / tune gap), and the ``ood`` split
when the corpus has one (a source kept out of training entirely). Before each
scoring phase it prints one line (``scoring test split: N windows ...``), then progress lines.
It writes ``RUN_DIR/result.json`` last, so a result file always belongs to a finished run.
Its output goes to ``RUN_DIR/worker.log``.

Exit status: 0 done (a diverged run is a result too), 3 stopped by a signal (checkpoint saved),
2 a damaged or incomplete corpus (one line).
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from evals.quality_plan import load_study, run_recipe  # noqa: E402
from poetxq.data.corpus import CorpusError, TokenCorpus, pack_windows, token_data  # noqa: E402
from poetxq.training.checkpoint import latest_checkpoint, load_model_tensors  # noqa: E402
from poetxq.training.evaluate import evaluate_perplexity  # noqa: E402
from poetxq.training.recipe import POET_METHODS, Recipe  # noqa: E402
from poetxq.training.train import DivergedError, TrainResult, train  # noqa: E402


def effective_lrs(recipe: Recipe) -> dict[str, float]:
    """The learning rates each group of weights actually trains at (peak of the schedule)."""
    oc, out = recipe.optim, {"embeddings_lm_head_norms": recipe.optim.lr}
    matrix_lr = oc.matrix_lr if oc.matrix_lr is not None else oc.lr
    if recipe.method in POET_METHODS:
        out["orthogonal_Q"] = oc.poet_lr * oc.poet_lr_scale
    elif recipe.method == "adamw":
        out["linear_weights"] = matrix_lr
    elif recipe.method == "muon":  # before the per-shape 0.2·sqrt(max(m, n)) RMS match
        out["linear_weights_muon"] = matrix_lr
    else:  # GaLore / APOLLO family: the projected update is scaled
        default = 0.25 if "galore" in recipe.method else 1.0
        scale = recipe.baseline.scale if recipe.baseline.scale is not None else default
        out["linear_weights_projected"] = matrix_lr * scale
    return out


def _curve(run_dir: Path, tokens_per_step: int) -> list[dict[str, float]]:
    """Validation ppl by step from metrics.jsonl, one point per step (the last logged: a resume
    at the final step evaluates that step again)."""
    by_step: dict[int, dict[str, float]] = {}
    path = run_dir / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.is_file() else []:
        rec = json.loads(line)
        if rec.get("val_ppl") is not None:
            by_step[rec["step"]] = {"step": rec["step"], "tokens": rec["step"] * tokens_per_step,
                                    "val_ppl": rec["val_ppl"]}  # fmt: skip
    return sorted(by_step.values(), key=lambda c: c["step"])


def _spread(windows: torch.Tensor, n: int) -> torch.Tensor:
    if windows.shape[0] <= n:
        return windows
    return windows[torch.linspace(0, windows.shape[0] - 1, n).round().long()]


class Progress:
    """Progress lines for one scoring phase, on stdout (the worker's log, so lines rather than a
    redrawn bar): one line when the phase starts, then one at most every ``every`` seconds, and
    one when it ends."""

    def __init__(
        self, label: str, windows: int, detail: str = "", *, every: float = 15.0,
        echo: Callable[[str], None] | None = None,
    ) -> None:  # fmt: skip
        self.label, self.total, self.every = label, windows, every
        self.echo = echo or (lambda line: print(line, flush=True))
        self.done = 0
        self.start = self.last = time.monotonic()
        self.echo(f"scoring {label}: {windows:,} windows{detail} ...")

    def advance(self, windows: int) -> None:
        """Count ``windows`` more as scored; print a line when ``every`` seconds have passed."""
        self.done += windows
        now = time.monotonic()
        if self.done < self.total and now - self.last >= self.every:
            self.last = now
            self.echo(
                f"  {self.label}: {self.done:,}/{self.total:,} windows "
                f"({self.done / self.total:.0%}), {now - self.start:.0f} s"
            )

    def finish(self, ppl: float) -> None:
        """The phase's last line, with its perplexity."""
        self.echo(f"  {self.label}: done, ppl {ppl:.3f}, {time.monotonic() - self.start:.0f} s")


def mean_loss(
    loss: Callable[[torch.Tensor], float], windows: torch.Tensor, batch_size: int,
    progress: Progress, *, chunks: int = 20,
) -> float:  # fmt: skip
    """The mean loss over ``windows`` (all of one length) from ``loss``, called on about
    ``chunks`` slices of whole batches so that ``progress`` advances as they are scored."""
    n = windows.shape[0]
    step = batch_size * max(1, math.ceil(n / batch_size / chunks))
    total = 0.0
    for start in range(0, n, step):
        part = windows[start : start + step]
        total += loss(part) * part.shape[0]
        progress.advance(part.shape[0])
    return total / n


def windows_by_source(
    corpus: TokenCorpus, split: str, seq_len: int, max_tokens: int | None = None
) -> dict[str, torch.Tensor]:
    """A split's windows of ``seq_len + 1`` tokens, per source (a window never straddles two
    sources; sources too short for one window are left out).

    Args:
        max_tokens: keep at most about this many tokens (the study's ``max_test_tokens``): an
            even spread over each source's windows, in proportion to its size (at least one
            window per source); None keeps the whole split.
    """
    stream = corpus.tokens(split)
    by_source = {
        src: pack_windows(stream[a:b], seq_len)
        for src, (a, b) in corpus.source_ranges(split).items()
    }
    by_source = {src: w for src, w in by_source.items() if w.shape[0]}
    total = sum(w.shape[0] for w in by_source.values())
    keep = None if max_tokens is None else max(1, max_tokens // (seq_len + 1))
    if keep is not None and keep < total:
        by_source = {
            src: _spread(w, max(1, w.shape[0] * keep // total)) for src, w in by_source.items()
        }
    return by_source


def score(
    recipe: Recipe, run_dir: Path, corpus: TokenCorpus, train_windows: torch.Tensor,
    max_test_tokens: int | None = None,
) -> dict:  # fmt: skip
    """Rebuild the trained model and measure tune, test (overall and per source; at most about
    ``max_test_tokens`` of it, :func:`windows_by_source`) and train-sample perplexity with the
    trainer's precision, printing a line before each phase and progress lines during it."""
    from poetxq.training.build import build_for_training
    from poetxq.training.precision import run_precision

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    seq = recipe.train.seq_len
    built = build_for_training(
        recipe, int(corpus.manifest["vocab_size"]), device,
        generator=torch.Generator().manual_seed(0), echo=lambda s: None, cuda_graph=False,
    )  # fmt: skip
    model = built.model
    missing, _ = load_model_tensors(model, run_dir / "model.safetensors")
    if missing:
        raise RuntimeError(f"model.safetensors lacks {missing[:3]}")
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if device.type == "cuda" and run_precision(recipe.train, "cuda") == "autocast"
        else contextlib.nullcontext()
    )
    bs = recipe.train.batch_size

    def loss(windows: torch.Tensor) -> float:
        with autocast:
            return evaluate_perplexity(model, windows, batch_size=bs, device=device)[0]

    def tokens(n_windows: int) -> str:
        return f" ({n_windows * (seq + 1):,} tokens)"

    def ppl(label: str, windows: torch.Tensor) -> float:
        progress = Progress(label, windows.shape[0], tokens(windows.shape[0]))
        value = math.exp(mean_loss(loss, windows, bs, progress))
        progress.finish(value)
        return value

    tune_w = pack_windows(corpus.tokens("tune"), seq)
    tune_ppl = ppl("tune split", tune_w)
    # the test split is scored source by source (windows never straddle two sources); the
    # overall test perplexity is the token-weighted mean loss over the sources
    test_w = windows_by_source(corpus, "test", seq, max_test_tokens)
    n_test = sum(w.shape[0] for w in test_w.values())
    limit = "" if max_test_tokens is None else f", max_test_tokens {max_test_tokens:,}"
    progress = Progress(
        "test split", n_test, f"{tokens(n_test)[:-1]}, {len(test_w)} sources{limit})"
    )
    by_source, total, count = {}, 0.0, 0
    for src, w in test_w.items():
        src_loss = mean_loss(loss, w, bs, progress)
        by_source[src] = math.exp(src_loss)
        total += src_loss * w[:, 1:].numel()
        count += w[:, 1:].numel()
    progress.finish(math.exp(total / count))
    out = {
        "tune_ppl": tune_ppl,
        "test_ppl": math.exp(total / count),
        "test_ppl_by_source": by_source,
        "train_sample_ppl": ppl("train sample", _spread(train_windows, tune_w.shape[0])),
        "tune_tokens": int(tune_w.numel()),
        "test_tokens_scored": count,
    }
    out["train_tune_gap_nats"] = math.log(out["tune_ppl"]) - math.log(out["train_sample_ppl"])
    if "ood" in corpus.splits:  # a source never trained on (prepare_offline_corpus's ood split)
        ood_w = pack_windows(corpus.tokens("ood"), seq)
        if max_test_tokens is not None:
            ood_w = _spread(ood_w, max(1, max_test_tokens // (seq + 1)))
        out["ood_ppl"] = ppl("ood split", ood_w)
    return out


def memory_peaks(res: TrainResult) -> dict[str, float | None]:
    """A run's peak memory for its record (GiB): ``peak_memory_gib``, the CUDA allocator's peak
    (None on a CPU); without it, ``peak_rss_gib``: the worker's peak resident set size on the
    host up to the end of training (``ru_maxrss``: the whole process, Python, torch and the data
    included; a resumed run's last call only), which the report labels as host RSS."""
    out: dict[str, float | None] = {
        "peak_memory_gib": None if res.peak_memory_bytes is None else res.peak_memory_bytes / 2**30
    }
    if res.peak_memory_bytes is None and res.peak_rss_bytes is not None:
        out["peak_rss_gib"] = res.peak_rss_bytes / 2**30
    return out


def main(argv: list[str] | None = None) -> int:
    """Train and score the run in ``argv[1]`` (``[STUDY.yaml, RUN_DIR]``); returns the exit
    status (0 done, 3 stopped by a signal, 2 a damaged or incomplete corpus: one line)."""
    try:
        return _run(sys.argv[1:] if argv is None else argv)
    except CorpusError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _run(argv: list[str]) -> int:
    study = load_study(argv[0])
    run_dir = Path(argv[1])
    spec = json.loads((run_dir / "spec.json").read_text())
    recipe = run_recipe(study, spec)
    corpus = TokenCorpus.open(REPO / study.corpus)
    tc = recipe.train
    data = token_data(corpus, tc.seq_len, heldout="tune", max_val_tokens=study.val_tokens)
    per_step = tc.batch_size * tc.grad_accum * tc.seq_len
    record: dict[str, Any] = {
        "id": spec["id"], "method": spec["method"], "recipe": spec["recipe"],
        "params": spec["params"], "seed": spec["seed"], "steps": tc.max_steps,
        "tokens": tc.max_steps * per_step, "epochs": tc.max_steps * per_step / data.train_tokens,
        "effective_lr": effective_lrs(recipe),
        "settings": {"batch": tc.batch_size * tc.grad_accum, "seq_len": tc.seq_len,
                     "warmup_steps": recipe.optim.warmup_steps,
                     "min_lr_ratio": recipe.optim.min_lr_ratio, "betas": list(recipe.optim.betas),
                     "eps": recipe.optim.eps, "weight_decay": recipe.optim.weight_decay,
                     "grad_clip": recipe.optim.grad_clip, "precision": tc.precision},
    }  # fmt: skip
    resume = latest_checkpoint(run_dir) if (run_dir / "checkpoints").is_dir() else None
    try:
        res = train(recipe, run_dir, data=data, progress=False, resume_from=resume)
    except DivergedError as exc:
        record.update({"diverged": str(exc), "tune_ppl": None, "test_ppl": None,
                       "val_curve": _curve(run_dir, per_step)})  # fmt: skip
    else:
        if res.interrupted:
            return 3
        record.update({
            "diverged": None,
            "trainer_final_val_ppl": res.final_val_ppl,
            "final_train_loss": res.final_train_loss,
            "tokens_per_s": res.tokens_per_s,
            "train_seconds": res.train_seconds,
            **memory_peaks(res),
            "merges": res.merges,
            "device": res.device,
            "resumed_from": res.resumed_from,
            "val_curve": _curve(run_dir, per_step),
        })  # fmt: skip
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        record.update(score(recipe, run_dir, corpus, data.train, study.max_test_tokens))
    tmp = run_dir / "result.json.tmp"
    tmp.write_text(json.dumps(record, indent=1, allow_nan=False))
    tmp.replace(run_dir / "result.json")
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    (run_dir / "model.safetensors").unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
