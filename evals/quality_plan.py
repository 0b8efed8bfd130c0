"""The quality study's plan: the study file, each run's recipe, which runs are pending and why,
and the per-method summary the report shows (issue 32). No process is started here: the runner
(:mod:`evals.quality`) starts the workers, :mod:`evals.quality_report` renders the results.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from evals.quality_stats import (  # noqa: E402
    best_point,
    decide,
    extension_points,
    paired_stats,
    refinement_points,
)

if TYPE_CHECKING:
    from poetxq.training.recipe import Recipe

__all__ = [
    "ControlSpec",
    "MethodSpec",
    "Study",
    "check_runs",
    "final_seeds",
    "load_study",
    "plan_runs",
    "point_label",
    "run_id",
    "run_recipe",
    "shown",
    "summarize",
]  # fmt: skip


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class MethodSpec(_Strict):
    """One method of the study: its recipe, its own knobs and its lr grid."""

    recipe: str  # recipes/methods/<recipe>.yaml
    set: dict[str, Any] = Field(default_factory=dict)  # the method's own knobs (authors' values)
    grid: dict[str, list[float]] = Field(min_length=1)  # recipe key -> values (product grid)


class ControlSpec(_Strict):
    """A control run at another method's best setting (e.g. POET-X, frozen rotations)."""

    recipe: str
    like: str  # the method whose best grid point it takes
    set: dict[str, Any] = Field(default_factory=dict)
    # its seeds (default: the study's final_seeds); fewer for a costly control whose question
    # is a paired A/B against the reference's own seed (each must be one of final_seeds)
    seeds: list[int] | None = Field(default=None, min_length=1)


class Study(_Strict):
    """A study file (the format: :mod:`evals.quality`'s docstring).

    ``max_test_tokens`` bounds the test-split scoring of each run (default None: the whole
    split, as the final numbers need). A small study on a CPU sets it to finish in minutes:
    the test windows kept are an even spread over each source, in proportion to its size
    (:func:`evals.quality_worker.windows_by_source`). The worker prints a line before each scoring
    phase and progress lines during it to its ``worker.log``.
    """

    name: str
    corpus: str  # token corpus folder (poetxq.data.corpus), relative to the repository root
    model: str  # recipes/models/<model>.yaml
    tokens: float = Field(gt=0)  # training tokens per run
    shared: dict[str, Any] = Field(default_factory=dict)  # recipe overrides for every run
    warmup_fraction: float = Field(0.1, ge=0, lt=1)
    eval_points: int = Field(5, ge=1)  # validation points along each run
    val_tokens: int | None = Field(1 << 20, ge=1)  # tune tokens validated during training
    # test tokens each run is scored on: None (the default) the whole test split; a number keeps
    # an even spread of about that many tokens over each source (a quick CPU study)
    max_test_tokens: int | None = Field(None, ge=1)
    tune_seeds: list[int] = Field(default_factory=lambda: [0], min_length=1)
    final_seeds: list[int] = Field(default_factory=lambda: [0, 1, 2], min_length=1)
    # more final seeds for a method whose mean test ppl lies within close_margin (relative) of
    # the reference's once both have their final seeds; the reference runs them too (paired)
    close_seeds: list[int] = Field(default_factory=list)
    close_margin: float = Field(0.02, ge=0)
    max_extend: int = Field(2, ge=0)  # points added past a winning grid edge, per axis
    # once the best point is interior: try best·√2 and best/√2 on each axis (the grid refined
    # to √2 at the optimum), then choose again
    refine: bool = False
    methods: dict[str, MethodSpec] = Field(min_length=1)
    controls: dict[str, ControlSpec] = Field(default_factory=dict)
    reference: str = "poetxq"  # the method the others are compared with
    results: str  # results JSON, relative to the repository root
    runs_dir: str = "runs/quality"  # run folders (git-ignored), relative to the repository root


def load_study(path: str | Path) -> Study:
    """Read and validate a study file (``yaml.safe_load``).

    Raises:
        SystemExit: unreadable file or invalid study (one line).
    """
    path = Path(path)
    try:
        tree = yaml.safe_load(path.read_text(encoding="utf-8"))
        study = Study.model_validate(tree)
    except (OSError, yaml.YAMLError) as exc:
        raise SystemExit(f"error: cannot read study {path}: {exc}") from None
    except ValidationError as exc:  # one line: key: message, per problem
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'the file'}: {e['msg'].lower()}"
            for e in exc.errors()
        )
        raise SystemExit(f"error: study {path}: {problems}") from None
    if study.reference not in study.methods:
        raise SystemExit(
            f"error: study {path}: reference {study.reference!r} is not one of its methods "
            f"({', '.join(study.methods)}); name the method the others are compared with"
        )
    for name, c in study.controls.items():
        if c.like not in study.methods:
            raise SystemExit(f"error: study {path}: control {name} is like unknown {c.like!r}")
        if c.seeds and not set(c.seeds) <= set(study.final_seeds):
            raise SystemExit(
                f"error: study {path}: control {name}'s seeds {c.seeds} must be among "
                f"final_seeds {study.final_seeds} (it is paired with {c.like}'s final seeds)"
            )
    return study


def _fmt(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def run_id(method: str, params: dict[str, Any], seed: int) -> str:
    """Stable run name, e.g. ``poetxq__optim.lr=0.01__optim.poet_lr=0.002__s0``."""
    keys = "__".join(f"{k}={_fmt(params[k])}" for k in sorted(params))
    return f"{method}__{keys}__s{seed}" if keys else f"{method}__s{seed}"


def _spec(
    study: Study, method: str, recipe: str, params: dict, seed: int, extra: dict, why: str = ""
) -> dict:
    return {
        "id": run_id(method, params, seed),
        "method": method,
        "recipe": recipe,
        "params": params,
        "seed": seed,
        "extra": extra,
        "why": why,  # shown by `plan`; not part of the run's identity
    }


def point_label(p: dict[str, Any]) -> str:
    return ", ".join(f"{k}={_fmt(p[k])}" for k in sorted(p))


def _extension_origins(grid: dict[str, list[float]], ext: list[dict]) -> dict[str, str]:
    """Why each grid extension was added: ``{json point: "edge extension of best ..."}``, or a
    √2 refinement (:func:`evals.quality_stats.refinement_points`) for a point inside the range.

    An extension point is its best point with one axis moved past the values tried before it
    (:func:`evals.quality_stats.extension_points`), so the best point is the extension with that
    axis set back to the nearest tried value.
    """
    tried = {k: set(v) for k, v in grid.items()}
    out: dict[str, str] = {}
    for p in ext:
        moved = [k for k in grid if p[k] not in tried[k]]
        why = "edge extension"
        if len(moved) == 1 and min(tried[moved[0]]) < p[moved[0]] < max(tried[moved[0]]):
            why = f"√2 refinement of {moved[0]} around the best point"
        elif len(moved) == 1:
            k = moved[0]
            low = p[k] < min(tried[k])
            edge = min(tried[k]) if low else max(tried[k])
            why = (
                f"edge extension: best point {point_label({**p, k: edge})} is on the "
                f"{'low' if low else 'high'} edge of {k}"
            )
        out[json.dumps(p, sort_keys=True)] = why
        for k in grid:
            tried[k].add(p[k])
    return out


def run_recipe(study: Study, spec: dict[str, Any]) -> Recipe:
    """The run's recipe: the study's model and the method's recipe file, then the shared
    settings, the method's own knobs, the grid point, and the run's length, seed and schedule.

    The one place a run's config is composed: the worker trains with it, and :func:`check_runs`
    builds it for every run at plan time.

    Raises:
        RecipeError: an unknown key or invalid value (one line naming the key).
    """
    from poetxq.training.recipe_files import load_recipe

    path = f"{study.model}:{spec['recipe']}"
    overrides = {**study.shared, **spec["extra"], **spec["params"]}
    tc = load_recipe(path, overrides).train
    steps = max(1, math.ceil(study.tokens / (tc.batch_size * tc.grad_accum * tc.seq_len)))
    overrides = {
        **overrides,
        "name": f"{study.name}-{spec['id']}",
        "train.max_steps": steps,
        "train.seed": spec["seed"],
        "train.eval_every": max(1, steps // study.eval_points),
        "train.log_every": max(1, min(50, steps // 20)),
        "train.save_checkpoint": True,
        "optim.warmup_steps": round(study.warmup_fraction * steps),
    }
    return load_recipe(path, overrides)


def _probe_specs(study: Study) -> list[dict]:
    """One run of every method and control (at the first grid point), so that a bad key in a
    method or control that has no pending run yet is found now too."""
    specs = []
    for method, m in study.methods.items():
        first = _grid(m, [])[0]
        specs.append(_spec(study, method, m.recipe, first, study.tune_seeds[0], m.set, "probe"))
    for name, c in study.controls.items():
        like = study.methods[c.like]
        first = _grid(like, [])[0]
        extra = {**like.set, **c.set}
        specs.append(_spec(study, name, c.recipe, first, study.final_seeds[0], extra, "probe"))
    return specs


def check_runs(study: Study, study_file: str | Path, specs: list[dict]) -> dict[str, Recipe]:
    """Compose the recipe of every run in ``specs`` and of one run per method and control with
    :func:`run_recipe` (what the worker does), before any run starts.

    Returns:
        ``{run id: recipe}`` for ``specs``.

    Raises:
        SystemExit: a run's config is invalid (one line naming the study file, the method and
            the bad key or value).
    """
    from poetxq.training.recipe import RecipeError

    recipes: dict[str, Recipe] = {}
    for spec in [*specs, *_probe_specs(study)]:
        if spec["id"] in recipes:
            continue
        try:
            recipe = run_recipe(study, spec)
        except RecipeError as exc:
            raise SystemExit(
                f"error: study {study_file}: method {spec['method']} (recipe {spec['recipe']}): "
                f"{exc}"
            ) from None
        recipes[spec["id"]] = recipe
    return {s["id"]: recipes[s["id"]] for s in specs}


def _grid(spec: MethodSpec, extended: list[dict[str, float]]) -> list[dict[str, float]]:
    keys = list(spec.grid)
    points: list[dict[str, float]] = [{}]
    for k in keys:
        points = [{**p, k: v} for p in points for v in spec.grid[k]]
    return points + [p for p in extended if p not in points]


def plan_runs(study: Study, results: dict[str, Any]) -> tuple[list[dict], dict[str, Any]]:
    """The runs still to do, in order, and the study's state.

    Returns:
        ``(pending, state)``: run specs not yet in ``results["runs"]``; ``state`` holds
        per method the points tuned so far (``"points"``), whether tuning is complete, the best
        point, and the grid extensions.
    """
    done = results.get("runs", {})
    pending: list[dict] = []
    state: dict[str, Any] = {}
    extensions = results.setdefault("extensions", {})
    for method, spec in study.methods.items():
        ext = extensions.setdefault(method, [])
        while True:
            points = _grid(spec, ext)
            origins = _extension_origins(spec.grid, ext)
            todo: list[dict] = []
            for p in points:
                why = origins.get(json.dumps(p, sort_keys=True), "grid point")
                todo += [
                    _spec(study, method, spec.recipe, p, s, spec.set, why)
                    for s in study.tune_seeds
                    if run_id(method, p, s) not in done
                ]
            if todo:
                pending.extend(todo)
                state[method] = {"tuned": False, "points": points}
                break
            scores = {
                json.dumps(p, sort_keys=True): [
                    done[run_id(method, p, s)]["tune_ppl"] for s in study.tune_seeds
                ]
                for p in points
            }
            best = best_point(points, scores)
            new = extension_points(spec.grid, points, best, ext, study.max_extend)
            if not new and study.refine:
                new = refinement_points(spec.grid, points, best)
            if not new:
                state[method] = {"tuned": True, "points": points, "best": best}
                break
            ext.extend(new)
    for method, spec in study.methods.items():
        if state[method]["tuned"]:
            best = state[method]["best"]
            for s in final_seeds(study, results, state, method):
                if run_id(method, best, s) not in done:
                    why = f"final seed {s} at the best point"
                    if s in study.close_seeds:
                        near = f"{study.close_margin:.0%} of {study.reference}"
                        why += f" (within {near}: more seeds)"
                    pending.append(_spec(study, method, spec.recipe, best, s, spec.set, why))
    for name, c in study.controls.items():
        if state[c.like]["tuned"]:
            best = state[c.like]["best"]
            extra = {**study.methods[c.like].set, **c.set}
            for s in c.seeds or study.final_seeds:
                if run_id(name, best, s) not in done:
                    why = f"control at {c.like}'s best point, seed {s}"
                    pending.append(_spec(study, name, c.recipe, best, s, extra, why))
    return _unique(_in_turn(pending, done)), state


def _mean_test(study: Study, done: dict[str, Any], method: str, best: dict) -> float | None:
    """Mean test ppl over the study's final seeds at ``best``; None until every one finished
    (a diverged seed: inf)."""
    vals = []
    for s in study.final_seeds:
        rec = done.get(run_id(method, best, s))
        if rec is None:
            return None
        vals.append(rec["test_ppl"] if rec.get("test_ppl") is not None else math.inf)
    return sum(vals) / len(vals)


def final_seeds(
    study: Study, results: dict[str, Any], state: dict[str, Any], method: str
) -> list[int]:
    """The final seeds ``method`` runs at its best point: the study's ``final_seeds``, plus its
    ``close_seeds`` when the method's mean test ppl over the final seeds lies within
    ``close_margin`` (relative) of the reference's; for the reference, when any method does."""
    seeds = list(study.final_seeds)
    if not study.close_seeds:
        return seeds
    done = results.get("runs", {})
    ref = state.get(study.reference, {})
    if not ref.get("tuned"):
        return seeds
    ref_mean = _mean_test(study, done, study.reference, ref["best"])
    if ref_mean is None or not math.isfinite(ref_mean):
        return seeds
    others = [method] if method != study.reference else list(study.methods)
    for m in others:
        st = state.get(m, {})
        if m == study.reference or not st.get("tuned"):
            continue
        mean = _mean_test(study, done, m, st["best"])
        if mean is not None and abs(mean / ref_mean - 1) < study.close_margin:
            return seeds + [s for s in study.close_seeds if s not in seeds]
    return seeds


def _in_turn(specs: list[dict], done: dict[str, Any]) -> list[dict]:
    """The methods in turn, so a study stopped early has tuned every method about as far: a
    run's place is the number of its method's runs before it, finished ones included (ties in
    the study's order of methods and controls). Counting the finished runs keeps the order as
    runs finish: the runner plans again after each and starts the first pending run, which
    with pending runs alone counted is the first method's next one, every time."""
    count: dict[str, int] = {}
    for rec in done.values():
        if isinstance(rec, dict) and "method" in rec:
            count[rec["method"]] = count.get(rec["method"], 0) + 1
    methods = list(dict.fromkeys(s["method"] for s in specs))
    keyed = []
    for s in specs:
        place = count.get(s["method"], 0)
        count[s["method"]] = place + 1
        keyed.append((place, methods.index(s["method"]), s))
    return [s for *_, s in sorted(keyed, key=lambda k: k[:2])]


def _unique(specs: list[dict]) -> list[dict]:
    seen: set[str] = set()
    return [s for s in specs if not (s["id"] in seen or seen.add(s["id"]))]


def shown(path: Path) -> Path:
    """``path`` relative to the repository when it lies inside it (shorter lines)."""
    try:
        return path.relative_to(REPO)
    except ValueError:
        return path


def summarize(study: Study, results: dict[str, Any]) -> dict[str, Any]:
    """Per method: best setting, final seeds' test ppl (mean, sd), and the decision against the
    reference method (:func:`evals.quality_stats.decide`)."""
    _, state = plan_runs(study, json.loads(json.dumps(results)))
    runs = results.get("runs", {})
    out: dict[str, Any] = {}
    names = list(study.methods) + list(study.controls)
    for name in names:
        like = study.controls[name].like if name in study.controls else name
        best = state.get(like, {}).get("best")
        if best is None:
            out[name] = {"tuned": False}
            continue
        seeds = {
            s: runs[run_id(name, best, s)]
            for s in [*study.final_seeds, *study.close_seeds]
            if run_id(name, best, s) in runs
        }
        # a diverged seed has no perplexity: listed apart, never averaged in as a number
        ppl = {s: r["test_ppl"] for s, r in seeds.items() if r.get("test_ppl") is not None}
        diverged = sorted(s for s, r in seeds.items() if r.get("diverged"))
        vals = list(ppl.values())
        mean = sum(vals) / len(vals) if vals else math.nan
        sd = (
            math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))
            if len(vals) > 1
            else math.nan
        )
        out[name] = {
            "tuned": True, "best": best, "test_ppl": ppl, "mean": mean, "sd": sd,
            "diverged": diverged,
        }  # fmt: skip
    ref = out.get(study.reference, {})
    for name, row in out.items():
        if name != study.reference and row.get("test_ppl") and ref.get("test_ppl"):
            row["vs_reference"] = decide(ref["test_ppl"], row["test_ppl"])
            row["vs_reference_stats"] = paired_stats(ref["test_ppl"], row["test_ppl"])
    return out
