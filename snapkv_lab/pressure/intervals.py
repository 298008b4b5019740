"""Accuracies with their uncertainty: Wilson score intervals of found / asked, for both grades."""

from __future__ import annotations

import math

import pandas as pd


def wilson(successes: int, trials: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval (95% by default) of a proportion: (low, high); (nan, nan) without trials."""
    if trials == 0:
        return float("nan"), float("nan")
    p = successes / trials
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / (1 + z * z / trials)
    return max(0.0, centre - half), min(1.0, centre + half)  # the bounds lie in [0, 1]; rounding can step past


def accuracy_intervals(table: pd.DataFrame, by=("policy", "mode")) -> pd.DataFrame:
    """Found / asked per group with its Wilson interval, for both grades (correct: RULER's, exact: strict)."""
    rows = []
    for key, part in table.groupby(list(by), sort=False):
        row = dict(zip(by, key if isinstance(key, tuple) else (key,)), asked=len(part))
        for grade in ("correct", "exact"):
            if grade in part:
                found = int(part[grade].sum())
                row[grade] = found
                row[f"{grade}_low"], row[f"{grade}_high"] = wilson(found, len(part))
        rows.append(row)
    return pd.DataFrame(rows)
