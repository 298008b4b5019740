"""Scores as the field reads them, with intervals over examples: per task, the leaderboard, the gap to the full cache.

Scores are on 0-100 (the benchmarks' reporting scale). An example's score is the mean over its questions; a task's
score the mean over its examples; a dataset's the mean over its tasks (RULER's and LongBench's averages, as kvpress
reports them). Intervals are 95% percentile bootstraps that resample examples within each task (seeded); the gap to
the full cache and the difference between two policies are paired, resampling the same examples for both.

A generated set run at several prompt lengths (RULER's `--lengths 4096 8192`) is scored per length, as RULER reports
it: a table's `length` column, where it has one, is part of every key below (NA for sets of fixed texts).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from .ruler import SYNTHETIC_TASKS, TASKS

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


# What a run's rows record of the KV entries they held (compression.entries), and how an example's or a cell's rows
# sum up: its mean share of the full cache held and allowed, and whether any held more than allowed.
HELD = {"kv_share": "mean", "budget_share": "mean", "over_budget": "any"}


def example_scores(table: pd.DataFrame) -> pd.DataFrame:
    """One row per (dataset, [length,] task, example, policy, budget, mode): the mean score over its questions, x 100,
    and where the table records them, the mean kv_share and budget_share and whether any question's cache held more
    than its budget (over_budget; compression.entries). The full cache's rows are repeated under every mode of the
    run, so that each mode's line has its baseline."""
    keys = [*_scope(table), "task", "example", "policy", _budget(table), "mode"]
    held = {column: (column, how) for column, how in HELD.items() if column in table}
    scores = table.groupby(keys, dropna=False, sort=False).agg(score=("score", "mean"), **held).reset_index()
    scores["score"] *= 100
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


def leaderboard(table: pd.DataFrame, n_boot: int = 2000, seed: int = 0, tasks=None) -> pd.DataFrame:
    """Per (dataset, [length,] policy, budget, mode): the average over tasks of the task scores, with its interval and
    the number of tasks and examples: kvpress's leaderboard (score vs compression ratio per method), full cache
    included (ratio 0). Where the table records KV entries: kv_share (the mean share of the uncompressed cache's
    entries held), budget_share (the mean share its budget allows: above 1 - ratio where sliding-window layers keep
    their own cache) and over_budget (some example held more than the budget: not a matched-totals comparison). tasks:
    average over these alone (None: every task of the table; `averages` gives RULER's 13 and its 11 synthetic ones
    side by side)."""
    if tasks is not None:
        table = table[table.task.isin(list(tasks))]
    scores, budget = example_scores(table), _budget(table)
    keys = [*_scope(table), "policy", budget, "mode"]
    rows = []
    for key, part in scores.groupby(keys, dropna=False, sort=False):
        groups = [task.score.to_numpy() for _, task in part.groupby("task", sort=False)]
        estimate, low, high = _interval(groups, n_boot, seed)
        held = {column: part[column].agg(how) for column, how in HELD.items() if column in part}
        rows.append(dict(zip(keys, key), score=estimate, low=low, high=high, tasks=len(groups), examples=len(part),
                         **held))
    return pd.DataFrame(rows).sort_values([*_scope(table), "mode", "policy", budget], ignore_index=True)


# RULER's published averages (and kvpress's leaderboard) are over its 13 tasks; the lab's runs before 2026-11-29 asked
# its 11 synthetic ones (qa_1 and qa_2 need SQuAD and HotpotQA).
RULER_AVERAGES = {"13 tasks": TASKS, "11 synthetic": SYNTHETIC_TASKS}


def averages(table: pd.DataFrame, n_boot: int = 2000, seed: int = 0) -> pd.DataFrame:
    """The leaderboard with a column `average` naming what each row averages: for RULER every average of
    RULER_AVERAGES whose tasks the table holds all of (both where it has all 13, the 11 alone where it has those),
    else the table's own tasks ("tasks run"). One row per (average, dataset, [length,] policy, budget, mode)."""
    held = set(table.task)
    named = [name for name, tasks in RULER_AVERAGES.items() if set(tasks) <= held]
    if set(table.dataset) != {"ruler"} or not named:
        return leaderboard(table, n_boot, seed).assign(average="tasks run")
    return pd.concat([leaderboard(table, n_boot, seed, RULER_AVERAGES[name]).assign(average=name) for name in named],
                     ignore_index=True)


def _paired(table: pd.DataFrame, baseline: str) -> pd.DataFrame:
    """example_scores of every policy but `baseline`, each with `baseline_score`: the baseline's score on the same
    example and mode (and budget, unless the baseline is the full cache, which has none); examples the baseline did
    not answer are dropped."""
    scores, scope, budget = example_scores(table), _scope(table), _budget(table)
    if baseline not in set(scores.policy):
        raise ValueError(f"the table has no rows of {baseline!r}: its policies are {sorted(set(scores.policy))}")
    paired = [*scope, "task", "example", "mode"] + ([] if baseline == "FullCache" else [budget])
    base = scores.loc[scores.policy == baseline, [*paired, "score"]].rename(columns={"score": "baseline_score"})
    return scores[scores.policy != baseline].merge(base, on=paired, how="inner")


def gap_to_full(table: pd.DataFrame, n_boot: int = 2000, seed: int = 0) -> pd.DataFrame:
    """Per (dataset, [length,] task, policy, budget, mode): the policy's score less the full cache's on the same
    examples (paired), with its interval: negative where compression loses. The full cache's own score rides along."""
    keys = [*_scope(table), "task", "policy", _budget(table), "mode"]
    out = []
    for key, part in _paired(table, "FullCache").groupby(keys, dropna=False, sort=False):
        estimate, low, high = _interval([(part.score - part.baseline_score).to_numpy()], n_boot, seed)
        out.append(dict(zip(keys, key), gap=estimate, low=low, high=high,
                        full=float(part.baseline_score.mean()), examples=len(part)))
    return pd.DataFrame(out)


# A sign-flip test enumerates every assignment of signs when the nonzero paired differences number at most
# EXACT_UP_TO (2^20 patterns, seconds in scipy); past that it counts them by their sums where the weighted
# differences are whole multiples of one unit with at most COUNTED_SUMS sums between the extremes (scores of a few
# references, each example weighing 1/n or 1/(tasks x n_task): every committed run), and only otherwise draws
# N_RESAMPLES of them, so that p never goes below 1 / (N_RESAMPLES + 1): about 1e-5, under the smallest threshold
# Holm sets on a family of a few hundred.
EXACT_UP_TO = 20
N_RESAMPLES = 100_000
COUNTED_SUMS = 20_000_000
_UNIT_DENOMINATOR = 10 ** 7  # the largest denominator a term's fraction is read back with (fractions.limit_denominator)


def _whole_terms(terms: np.ndarray) -> np.ndarray | None:
    """|terms| as whole multiples of one unit (int64), or None where no unit of denominator at most
    _UNIT_DENOMINATOR gives them back to float rounding, or their sum passes COUNTED_SUMS."""
    import math
    from fractions import Fraction

    sizes = np.abs(terms)
    fractions = [Fraction(float(size)).limit_denominator(_UNIT_DENOMINATOR) for size in sizes]
    unit = 1
    for fraction in fractions:
        unit = unit * fraction.denominator // math.gcd(unit, fraction.denominator)
        if unit > COUNTED_SUMS:
            return None
    whole = np.array([fraction.numerator * (unit // fraction.denominator) for fraction in fractions], dtype=np.int64)
    if whole.sum() > COUNTED_SUMS or not np.allclose(whole / unit, sizes, rtol=1e-9, atol=0):
        return None
    return whole


def _counted_sign_flip(whole: np.ndarray, observed: int) -> float:
    """Two-sided p of the sign flip of whole-number terms of sizes `whole`: the share of the 2^n sign assignments
    whose |sum| reaches `observed` (the observed |sum|), from the distribution of the signed sum built one term at a
    time (a convolution: exact counts, each a float64 integer below 2^53 for n up to 52)."""
    total = int(whole.sum())
    counts = np.zeros(2 * total + 1)  # counts[s + total]: the assignments whose sum is s
    counts[total] = 1.0
    reach = 0  # the sums so far lie in [-reach, reach]
    for size in map(int, whole):
        current = counts[total - reach:total + reach + 1].copy()
        counts[total - reach:total + reach + 1] = 0.0
        counts[total - reach - size:total + reach - size + 1] += current
        counts[total - reach + size:total + reach + size + 1] += current
        reach += size
    sums = np.abs(np.arange(-total, total + 1))
    return float(counts[sums >= observed].sum() / counts.sum())


def sign_flip_test(differences: np.ndarray, weights: np.ndarray, n_resamples: int = N_RESAMPLES,
                   seed: int = 0) -> tuple[float, str]:
    """Two-sided p of a paired sign-flip (randomisation) test of the statistic sum(weights * differences), and how
    it was reached. differences, weights: (examples,). Under "no difference" each example's paired difference is as
    likely to have either sign: the test flips each example's difference and recomputes the same weighted statistic
    (a mean over examples, weights 1 / n; a mean over tasks of task means, 1 / (examples in its task x tasks)), and
    p is the share of flips whose |statistic| reaches the observed one. A zero difference flips to itself, so it is
    left out of the flips (the share is the same with it). Exact ("exact") where every flip can be counted: when the
    nonzero terms weights * differences share one magnitude (an example won or lost, each weighing the same: the
    statistic counts signs, and p is the two-sided binomial test's, scipy.stats.binomtest, at any n), or when there
    are at most EXACT_UP_TO of them (scipy.stats.permutation_test(permutation_type="samples") enumerates all 2^n
    flips), or when they are whole multiples of one unit (every flip counted by its sum: _counted_sign_flip); else
    n_resamples drawn flips ("monte carlo (floor 1/(n_resamples+1))": the drawn count is taken with
    the observed flip, so that p is never 0). Unlike a percentile bootstrap, which collapses to a point on one or two
    examples per task, it cannot call fewer than six agreeing examples a difference (all of five agree: p = 2 / 32)."""
    from scipy.stats import binomtest, permutation_test

    differences, weights = np.asarray(differences, dtype=float), np.asarray(weights, dtype=float)
    if differences.shape != weights.shape or differences.ndim != 1:
        raise ValueError(f"differences and weights must be two 1-d arrays of one length, not of shapes "
                         f"{differences.shape} and {weights.shape}")
    nonzero = differences != 0
    differences, weights = differences[nonzero], weights[nonzero]
    terms = weights * differences
    if len(terms) < 2:  # both signs of one difference reach it (scipy asks for two)
        return 1.0, "exact"
    if np.allclose(np.abs(terms), abs(terms[0]), rtol=1e-9, atol=0):
        return float(binomtest(int(np.count_nonzero(terms > 0)), len(terms)).pvalue), "exact"
    exact = len(terms) <= EXACT_UP_TO
    whole = None if exact else _whole_terms(terms)
    if whole is not None:
        # the observed statistic is |sum(terms)|: flipping every sign of the terms' sizes to the observed ones
        observed = abs(int(whole[terms > 0].sum()) - int(whole[terms < 0].sum()))
        return _counted_sign_flip(whole, observed), "exact"
    result = permutation_test((differences,), lambda x, axis: np.abs((x * weights).sum(axis=axis)),
                              permutation_type="samples", vectorized=True, alternative="greater",
                              n_resamples=np.inf if exact else n_resamples, batch=2 ** 15, rng=seed)
    return float(result.pvalue), "exact" if exact else f"monte carlo (floor 1/{n_resamples + 1})"


def holm(p: np.ndarray) -> np.ndarray:
    """Holm's step-down adjustment of p-values for the family they form (each at most 1, order kept). scipy.stats
    has Benjamini-Hochberg (false_discovery_control) but no Holm."""
    p = np.asarray(p, dtype=float)
    order = np.argsort(p, kind="stable")
    adjusted = np.maximum.accumulate(np.minimum(1.0, (len(p) - np.arange(len(p))) * p[order]))
    return adjusted[np.argsort(order, kind="stable")]


AVERAGES = ("tasks", "examples")


def paired_difference(table: pd.DataFrame, baseline: str = "SnapKV", n_boot: int = 2000, seed: int = 0,
                      n_perm: int = N_RESAMPLES, average: str = "tasks") -> pd.DataFrame:
    """Per (dataset, [length,] policy, budget, mode): the policy's score less `baseline`'s at the same budget and
    mode, on the examples both answered, with a 95% bootstrap interval that resamples examples within each task for
    both at once, the two-sided p of a paired sign-flip test of the same statistic (sign_flip_test: `p_method` says
    whether it is exact) and the number of `nonzero` differences it flips. No adjusted p: one run is not a family (a
    claim could pass in a small run and fail in a large one); the family is written down across runs in
    evaluation.family, which adjusts these p once over all of it. The statistic is, with `average="tasks"`, the
    leaderboard's: the mean over tasks of each task's mean paired difference; with "examples", the mean over
    examples (each example weighs the same, whichever task holds it). The question a leaderboard's overlapping
    intervals cannot answer: does A beat B on these examples? Pairing removes what the examples share (a hard
    example is hard for both), so it separates methods that unpaired intervals leave overlapping; the test, not the
    interval, decides, because on a handful of examples the bootstrap interval shrinks to a point. The lab's
    figures, pages and notebooks mark differences by the family's adjustment (family.run_adjustment)."""
    if average not in AVERAGES:
        raise ValueError(f"average must be one of {AVERAGES}, not {average!r}")
    keys = [*_scope(table), "policy", _budget(table), "mode"]
    out = []
    for key, part in _paired(table, baseline).groupby(keys, dropna=False, sort=False):
        groups = [(task.score - task.baseline_score).to_numpy() for _, task in part.groupby("task", sort=False)]
        if average == "examples":
            groups = [np.concatenate(groups)]
        estimate, low, high = _interval(groups, n_boot, seed)
        weights = np.concatenate([np.full(len(values), 1 / (len(values) * len(groups))) for values in groups])
        p, method = sign_flip_test(np.concatenate(groups), weights, n_perm, seed)
        out.append(dict(zip(keys, key), baseline=baseline, difference=estimate, low=low, high=high, p=p,
                        p_method=method, nonzero=int(np.count_nonzero(np.concatenate(groups))),
                        tasks=part.task.nunique(), examples=len(part)))
    columns = [*keys, "baseline", "difference", "low", "high", "p", "p_method", "nonzero", "tasks", "examples"]
    return pd.DataFrame(out, columns=columns)  # no rows where nothing else ran at the baseline's budgets


def answered_examples(table: pd.DataFrame, at: float = 100.0) -> pd.DataFrame:
    """The examples the full cache answers: its score on them (the mean over their questions, 0-100) at least `at`;
    by default 100, every question answered whole by the task's metric (RULER's string match: every needle value,
    every variable). The subset a comparison of compressors is read on first: where the full cache fails, a
    compressed cache has nothing to keep, and one that outscores it is noise until shown otherwise. Columns: dataset,
    [length,] task, example."""
    scores = example_scores(table[table["mode"] == "full"])
    keys = [*_scope(table), "task", "example"]
    return scores.loc[scores.score >= at, keys].drop_duplicates(ignore_index=True)


def full_cache_fails(table: pd.DataFrame, below: float = 50.0) -> list[str]:
    """Tasks where the full cache itself scores under `below` (of 100): what compression cannot be judged on. A table
    of several lengths names a task failed at some of them as "task at LENGTH" for each."""
    full = task_scores(table[table["mode"] == "full"], n_boot=0)
    failed = full[full.score < below]
    if len(lengths(table)) < 2:
        return sorted(failed.task.unique())
    return [f"{r.task} at {r.length}" for r in failed.sort_values(["task", "length"]).itertuples()]
