"""95% intervals of evaluation metrics: Wilson for proportions, normal for means."""
from __future__ import annotations

import math

import numpy as np


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a binomial proportion (better than the normal one near 0 and 1).
    It always holds the observed proportion: at 0 or 1 rounding would otherwise leave it a hair outside."""
    if n == 0:
        return 0.0, 0.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return min(centre - half, p), max(centre + half, p)


def mean_interval(values: list[float], z: float = 1.96) -> dict:
    arr = np.asarray(values, dtype=float)
    half = z * arr.std(ddof=1) / math.sqrt(len(arr)) if len(arr) > 1 else 0.0
    return {"mean": float(arr.mean()), "low": float(arr.mean() - half), "high": float(arr.mean() + half)}


def proportion(flags: list[bool]) -> dict:
    """A success rate with its 95% Wilson interval and n."""
    low, high = wilson_interval(sum(flags), len(flags))
    return {"mean": sum(flags) / len(flags), "low": low, "high": high, "n": len(flags)}
