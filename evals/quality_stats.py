"""The quality study's rules: best grid point, grid extension past a winning edge, the decision.

Pure functions of numbers (no torch), so the rules are tested on hand-made values.
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["best_point", "decide", "extension_points", "paired_stats"]


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
        beyond = sum(1 for v in {p[key] for p in added} if v not in original)
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


def paired_stats(a: dict[Any, float], b: dict[Any, float]) -> dict[str, Any]:
    """Paired differences ``b - a`` over the seeds both have: mean, sd, standard error, n."""
    seeds = sorted(set(a) & set(b), key=str)
    d = [b[s] - a[s] for s in seeds]
    n = len(d)
    mean = sum(d) / n if n else math.nan
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1)) if n > 1 else math.nan
    return {
        "n": n,
        "diffs": d,
        "mean": mean,
        "sd": sd,
        "se": sd / math.sqrt(n) if n > 1 else math.nan,
    }


def decide(a: dict[Any, float], b: dict[Any, float]) -> str:
    """The study's decision between method A and method B from per-seed test perplexities.

    A is ``"better"`` (lower perplexity) when the paired mean difference ``b - a`` exceeds two
    standard errors and every seed's difference is positive; ``"worse"`` in the mirror case;
    otherwise ``"tie"``. Fewer than two common seeds is always a ``"tie"``.

    Args:
        a, b: ``{seed: test perplexity}``.
    """
    st = paired_stats(a, b)
    if st["n"] < 2:
        return "tie"
    d, mean, se = st["diffs"], st["mean"], st["se"]
    if se == 0:  # identical differences on every seed: the sign decides if it is non-zero
        return "better" if mean > 0 else "worse" if mean < 0 else "tie"
    if mean > 2 * se and all(x > 0 for x in d):
        return "better"
    if mean < -2 * se and all(x < 0 for x in d):
        return "worse"
    return "tie"
