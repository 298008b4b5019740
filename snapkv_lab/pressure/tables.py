"""The pressure suites' tables read as tables: accuracy by policy, budget and length; RULER-style grades per task.

Experiment code (grid.py) writes the tidy tables; this module summarises them; figures.py draws them.
"""

from __future__ import annotations

import pandas as pd

from .intervals import accuracy_intervals
from .runner import MODES


def run_label(table: pd.DataFrame) -> pd.Series:
    """"FullCache" for the full cache's rows, else "<policy> <mode>"."""
    return table.policy.where(table["mode"] == "full", table.policy + " " + table["mode"])


def ruler_table(table: pd.DataFrame) -> pd.DataFrame:
    """Accuracy (RULER's substring grade and the strict one) per task and value kind (rows) for the full cache
    and each policy and mode (columns); `full_cache_fails` marks the tasks the uncompressed model already fails."""
    table = table.assign(run=run_label(table))
    grades = table.pivot_table(index=["task", "value_kind"], columns="run", values=["correct", "exact"], aggfunc="mean")
    full = table[table["mode"] == "full"].groupby(["task", "value_kind"]).correct.mean()
    return grades.assign(full_cache_fails=full.reindex(grades.index) < 1)


def accuracy_table(table: pd.DataFrame) -> pd.DataFrame:
    """Accuracy by mode, policy and budget (rows; budgets in numeric order, "full" first) and prompt length
    (columns, numeric order), the full cache expanded into every mode."""
    table = table.copy()
    full = table[table.policy == "FullCache"]
    expanded = pd.concat([full.assign(mode=m) for m in MODES if m in set(table["mode"])]
                         + [table[table.policy != "FullCache"]], ignore_index=True)
    expanded["budget"] = budget_labels(expanded.capacity)
    return expanded.pivot_table(index=["mode", "policy", "budget"], columns="length", values="correct", aggfunc="mean",
                                observed=True)


def budget_labels(capacity: pd.Series) -> pd.Series:
    """Capacities as labels ("full" where there is none) that sort in numeric order, full first: an ordered
    categorical, so that tables and figures never order budgets as text (1024 before 256)."""
    budgets = sorted(int(c) for c in capacity.dropna().unique())
    labels = capacity.map(lambda c: "full" if pd.isna(c) else str(int(c)))
    return pd.Series(pd.Categorical(labels, categories=["full", *map(str, budgets)], ordered=True),
                     index=capacity.index)


def paired_table(table: pd.DataFrame, baseline: str = "SnapKV") -> pd.DataFrame:
    """Per compressed policy and mode of a needle table, on the contexts the full cache answers (RULER's grade): found
    / asked with its Wilson interval, the KV entries held (kv_share, least and most), and the discordant pairs with
    `baseline` in the same mode, needle for needle: found by the policy alone (`only_policy`) and by the baseline
    alone (`only_baseline`). Descriptive: no test, as the comparisons are not in data/comparison_family.csv."""
    key = ["key", "sample", "depth"]
    answered = table[(table.policy == "FullCache") & table.correct][key]
    compressed = table[table.policy != "FullCache"].merge(answered, on=key)
    found = accuracy_intervals(compressed, by=("policy", "mode"))[["policy", "mode", "asked", "correct", "correct_low",
                                                                     "correct_high"]]
    shares = (compressed.groupby(["policy", "mode"], sort=False).kv_share.agg(kv_share_min="min", kv_share_max="max")
              .reset_index())
    base = compressed[compressed.policy == baseline][[*key, "mode", "correct"]]
    pairs = compressed.merge(base, on=[*key, "mode"], suffixes=("", "_baseline"), validate="many_to_one")
    discordant = (pairs.assign(only_policy=pairs.correct & ~pairs.correct_baseline,
                               only_baseline=~pairs.correct & pairs.correct_baseline)
                  .groupby(["policy", "mode"], sort=False)[["only_policy", "only_baseline"]].sum().reset_index())
    return found.merge(shares, on=["policy", "mode"]).merge(discordant, on=["policy", "mode"]).assign(
        answered=len(answered))


def methods_table(table: pd.DataFrame) -> pd.DataFrame:
    """The methods suite (data/pressure_methods.csv) per policy and mode, the full cache first: found / asked with its
    Wilson interval (RULER's grade), the mean kept tokens of the longest layer, and two means of the ablations'
    coverage columns over the compressed runs: coverage / oracle (sinks excluded) and the share of the answer's
    needle-value attention the kept positions serve (where the table has them: not the presses suite's)."""
    if "coverage" in table:  # a suite run without the coverage describer (the presses) has the counts alone
        table = table.assign(coverage_of_oracle=table.coverage / table.oracle,
                             value_served=table.value_attention_kept / table.value_attention)
    order = ["FullCache", *dict.fromkeys(table.policy[table.policy != "FullCache"])]
    table = table.assign(policy=pd.Categorical(table.policy, categories=order, ordered=True))
    found = accuracy_intervals(table.sort_values(["policy", "mode"]), by=("policy", "mode"))
    means = table.groupby(["policy", "mode"], observed=True)[
        [c for c in ("cache_length", "coverage_of_oracle", "value_served") if c in table]].mean()
    return found.merge(means.reset_index(), on=["policy", "mode"]).astype({"policy": str})
