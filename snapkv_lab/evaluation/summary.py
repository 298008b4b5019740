"""Scores as the field reads them, with intervals over examples: per task, the leaderboard, the gap to the full cache.

Scores are on 0-100 (the benchmarks' reporting scale). An example's score is the mean over its questions; a task's
score the mean over its examples; a dataset's the mean over its tasks (RULER's and LongBench's averages, as kvpress
reports them). Intervals are 95% percentile bootstraps that resample examples within each task (seeded); the gap to
the full cache is paired, resampling the same examples for both.

A generated set run at several prompt lengths (RULER's `--lengths 4096 8192`) is scored per length, as RULER reports
it: a table's `length` column, where it has one, is part of every key below (NA for sets of fixed texts).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

RUN = ["policy", "ratio", "capacity", "mode"]


def _budget(table: pd.DataFrame) -> str:
    """The budget column of a run: "ratio", or "capacity" for runs in tokens."""
    return "capacity" if table["capacity"].notna().any() else "ratio"


def _scope(table: pd.DataFrame) -> list[str]:
    """The columns a score is never pooled over: the dataset, and the prompt length where the table has one."""
    return ["dataset", "length"] if "length" in table.columns else ["dataset"]


def lengths(table: pd.DataFrame) -> list[int]:
    """The prompt lengths a generated set's run holds, sorted ([] for sets of fixed texts)."""
    return sorted(table.length.dropna().unique()) if "length" in table.columns else []


def example_scores(table: pd.DataFrame) -> pd.DataFrame:
    """One row per (dataset, [length,] task, example, policy, budget, mode): the mean score over its questions, x 100.
    The full cache's rows are repeated under every mode of the run, so that each mode's line has its baseline."""
    keys = [*_scope(table), "task", "example", "policy", _budget(table), "mode"]
    scores = table.groupby(keys, dropna=False, sort=False).score.mean().mul(100).reset_index()
    modes = [m for m in scores["mode"].unique() if m != "full"] or ["full"]
    full = scores[scores["mode"] == "full"]
    return pd.concat([scores[scores["mode"] != "full"], *[full.assign(mode=m) for m in modes]], ignore_index=True)


def _bootstrap(groups: list[np.ndarray], n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """(n_boot,) means over groups (tasks) of each group's mean over resampled examples."""
    return np.mean([values[rng.integers(0, len(values), (n_boot, len(values)))].mean(1) for values in groups], axis=0)


def _interval(groups: list[np.ndarray], n_boot: int, seed: int) -> tuple[float, float, float]:
    estimate = float(np.mean([values.mean() for values in groups]))
    if n_boot == 0 or all(len(values) < 2 for values in groups):
        return estimate, float("nan"), float("nan")
    draws = _bootstrap(groups, n_boot, np.random.default_rng(seed))
    low, high = np.percentile(draws, [2.5, 97.5])
    return estimate, float(low), float(high)


def task_scores(table: pd.DataFrame, n_boot: int = 2000, seed: int = 0) -> pd.DataFrame:
    """Per (dataset, [length,] task, policy, budget, mode): score, low, high (95%), examples."""
    scores, keys = example_scores(table), [*_scope(table), "task", "policy", _budget(table), "mode"]
    rows = []
    for key, part in scores.groupby(keys, dropna=False, sort=False):
        estimate, low, high = _interval([part.score.to_numpy()], n_boot, seed)
        rows.append(dict(zip(keys, key), score=estimate, low=low, high=high, examples=len(part)))
    return pd.DataFrame(rows)


def leaderboard(table: pd.DataFrame, n_boot: int = 2000, seed: int = 0) -> pd.DataFrame:
    """Per (dataset, [length,] policy, budget, mode): the average over tasks of the task scores, with its interval and
    the number of tasks and examples: kvpress's leaderboard (score vs compression ratio per method), full cache
    included (ratio 0)."""
    scores, budget = example_scores(table), _budget(table)
    keys = [*_scope(table), "policy", budget, "mode"]
    rows = []
    for key, part in scores.groupby(keys, dropna=False, sort=False):
        groups = [task.score.to_numpy() for _, task in part.groupby("task", sort=False)]
        estimate, low, high = _interval(groups, n_boot, seed)
        rows.append(dict(zip(keys, key), score=estimate, low=low, high=high, tasks=len(groups), examples=len(part)))
    return pd.DataFrame(rows).sort_values([*_scope(table), "mode", "policy", budget], ignore_index=True)


def gap_to_full(table: pd.DataFrame, n_boot: int = 2000, seed: int = 0) -> pd.DataFrame:
    """Per (dataset, [length,] task, policy, budget, mode): the policy's score less the full cache's on the same
    examples (paired), with its interval: negative where compression loses. The full cache's own score rides along."""
    scores, scope = example_scores(table), _scope(table)
    keys = [*scope, "task", "policy", _budget(table), "mode"]
    paired = [*scope, "task", "example", "mode"]
    full = {tuple(key): score for *key, score in
            scores.loc[scores.policy == "FullCache", [*paired, "score"]].itertuples(index=False)}
    rows = []
    for key, part in scores[scores.policy != "FullCache"].groupby(keys, dropna=False, sort=False):
        baseline = np.array([full[tuple(k)] for k in part[paired].itertuples(index=False)])
        estimate, low, high = _interval([part.score.to_numpy() - baseline], n_boot, seed)
        rows.append(dict(zip(keys, key), gap=estimate, low=low, high=high, full=float(baseline.mean()),
                         examples=len(part)))
    return pd.DataFrame(rows)


def full_cache_fails(table: pd.DataFrame, below: float = 50.0) -> list[str]:
    """Tasks where the full cache itself scores under `below` (of 100): what compression cannot be judged on. A table
    of several lengths names a task failed at some of them as "task at LENGTH" for each."""
    full = task_scores(table[table["mode"] == "full"], n_boot=0)
    failed = full[full.score < below]
    if len(lengths(table)) < 2:
        return sorted(failed.task.unique())
    return [f"{r.task} at {r.length}" for r in failed.sort_values(["task", "length"]).itertuples()]
