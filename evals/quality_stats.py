"""The quality study's rules: best grid point, grid extension past a winning edge, the decision.

Pure functions of numbers (no torch), so the rules are tested on hand-made values.
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["best_point", "decide", "extension_points", "paired_stats", "refinement_points"]


def _score(values: list[float | None]) -> float:
    """Mean of a point's tune perplexities; a diverged run (None / non-finite) counts as inf."""
    vals = [math.inf if v is None or not math.isfinite(v) else v for v in values]
    return sum(vals) / len(vals) if vals else math.inf


def best_point(points: list[dict[str, float]], scores: dict[str, list[float | None]]) -> dict:
    """The point with the lowest mean tune perplexity (ties: the first in ``points``).

    Args:
        points: grid points, each ``{recipe key: value}``.
        scores: ``json.dumps(point, sort_keys=True)`` -> that point's tune ppl per tuning seed.
    """
    return min(points, key=lambda p: _score(scores[json.dumps(p, sort_keys=True)]))


def extension_points(
    grid: dict[str, list[float]],
    points: list[dict[str, float]],
    best: dict[str, float],
    added: list[dict[str, float]],
    max_extend: int,
) -> list[dict[str, float]]:
    """Points to add when ``best`` sits on an edge of the tried values of an axis.

    For each axis whose best value is the smallest (largest) value tried on that axis, one point
    one grid step further (the ratio of the axis's two outermost values on that side, i.e. a
    geometric step) with the other axes at ``best``'s values. An axis gets at most
    ``max_extend`` added values beyond its original grid. Axes with a single value are fixed.

    Returns:
        new points not in ``points`` (empty when ``best`` is interior on every axis).
    """
    new: list[dict[str, float]] = []
    for key, original in grid.items():
        if len(original) < 2:
            continue
        tried = sorted({p[key] for p in points})
        lo, hi = min(original), max(original)  # refinement points inside do not count
        beyond = sum(1 for v in {p[key] for p in added} if v < lo or v > hi)
        if beyond >= max_extend:
            continue
        v = best[key]
        if v == tried[0]:
            step = tried[1] / tried[0] if tried[0] > 0 else None
            nxt = tried[0] / step if step else tried[0] - (tried[1] - tried[0])
        elif v == tried[-1]:
            step = tried[-1] / tried[-2] if tried[-2] > 0 else None
            nxt = tried[-1] * step if step else tried[-1] + (tried[-1] - tried[-2])
        else:
            continue
        point = {**best, key: float(f"{nxt:.6g}")}
        if point not in points and point not in new:
            new.append(point)
    return new


def refinement_points(
    grid: dict[str, list[float]], points: list[dict[str, float]], best: dict[str, float]
) -> list[dict[str, float]]:
    """Points that refine a factor-2 grid to √2 at ``best``: on each axis of two or more values,
    ``best·√2`` and ``best/√2`` with the other axes at ``best``'s values (rounded to 6
    significant digits), those not tried yet. Around a best point that is itself a refinement
    its √2 neighbours are tried grid points, so refining ends after one round.
    """
    new: list[dict[str, float]] = []
    for key, original in grid.items():
        if len(original) < 2:
            continue
        for factor in (1 / math.sqrt(2), math.sqrt(2)):
            point = {**best, key: float(f"{best[key] * factor:.6g}")}
            close = any(
                all(math.isclose(point[k], p[k], rel_tol=1e-4) for k in point) for p in points
            )
            if not close and point not in new:
                new.append(point)
    return new


def paired_stats(
    a: dict[Any, float], b: dict[Any, float], confidence: float = 0.95
) -> dict[str, Any]:
    """Paired differences ``b - a`` over the seeds both have, with a Student-t interval.

    Returns:
        ``n``, ``diffs``, ``mean``, ``sd`` (n − 1 denominator), ``se`` (sd / √n), ``df``
        (n − 1), ``ci`` (``[low, high]``, the ``confidence`` two-sided t-interval of the mean
        difference, ``scipy.stats.t``) and ``p`` (the two-sided paired t-test's p-value against
        a mean difference of 0). With fewer than two seeds every statistic but ``mean`` is NaN;
        with identical differences (sd 0) the interval is the point and ``p`` is 0 (1 when the
        differences are all 0).
    """
    seeds = sorted(set(a) & set(b), key=str)
    d = [b[s] - a[s] for s in seeds]
    n = len(d)
    mean = sum(d) / n if n else math.nan
    out: dict[str, Any] = {"n": n, "diffs": d, "mean": mean, "sd": math.nan, "se": math.nan,
                           "df": n - 1, "ci": [math.nan, math.nan], "p": math.nan}  # fmt: skip
    if n < 2:
        return out
    from scipy import stats  # evals only: the statistics of the report and the plan

    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    se = sd / math.sqrt(n)
    out.update(sd=sd, se=se)
    if se == 0:
        out.update(ci=[mean, mean], p=1.0 if mean == 0 else 0.0)
        return out
    half = float(stats.t.ppf(0.5 + confidence / 2, n - 1)) * se
    out.update(ci=[mean - half, mean + half], p=float(2 * stats.t.sf(abs(mean) / se, n - 1)))
    return out


#: fewer paired seeds than this and the verdict is "n/a" (no interval worth the name)
MIN_SEEDS = 3


def decide(a: dict[Any, float], b: dict[Any, float]) -> str:
    """The study's verdict on method A against method B from per-seed test perplexities.

    A is ``"better"`` (lower perplexity) when the 95 % t-interval of the paired mean difference
    ``b - a`` (:func:`paired_stats`) lies above 0, ``"worse"`` when it lies below 0, ``"tie"``
    when it contains 0 (no difference shown at this number of seeds), and ``"n/a"`` with fewer
    than :data:`MIN_SEEDS` common seeds.

    Args:
        a, b: ``{seed: test perplexity}``.
    """
    st = paired_stats(a, b)
    if st["n"] < MIN_SEEDS:
        return "n/a"
    low, high = st["ci"]
    if low > 0:
        return "better"
    if high < 0:
        return "worse"
    return "tie"
