"""The long-generation figure: accuracy against the KV footprint over the generation, the output's length beside it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from ..core.figure_files import write_png
from ..views.palette import LINE_COLOURS
from .long_generation import long_generation_summary

BUDGET_MARKERS = ("o", "s", "D", "^")  # one per budget, in increasing order; the full cache a star


def _errors(row, column: str, low: float, high: float) -> list[list[float]]:
    """The t interval of `column` as errorbar lengths, clipped to what the value can be ([low, high]) for drawing."""
    mean = row[column]
    bottom, top = np.clip([row[f"{column}_low"], row[f"{column}_high"]], low, high)
    return [[mean - bottom if not np.isnan(bottom) else 0.0], [top - mean if not np.isnan(top) else 0.0]]


def long_generation_figure(table: pd.DataFrame, stem: Path) -> list[Path]:
    """Left: share of codes copied against the footprint integral (entry-steps, log scale), per policy: means over the
    lists with 95% t intervals on both axes (drawn clipped to the possible range), colour by method, marker by budget,
    marker area proportional to the mean output length. Right: the mean output length per policy with its interval,
    the limit (max_new_tokens) dashed."""
    from matplotlib.figure import Figure

    summary = long_generation_summary(table)
    methods = list(dict.fromkeys(p.split("@")[0] for p in summary.policy))
    budgets = sorted(summary.budget.dropna().unique())
    limit = float(table.max_new_tokens.max())
    fig = Figure(figsize=(12, 5), layout="constrained")
    left, right = fig.subplots(1, 2, width_ratios=(1.4, 1))
    for i, row in summary.iterrows():
        colour = LINE_COLOURS[methods.index(row.policy.split("@")[0]) % len(LINE_COLOURS)]
        marker = "*" if pd.isna(row.budget) else BUDGET_MARKERS[budgets.index(row.budget) % len(BUDGET_MARKERS)]
        left.errorbar(row.footprint_integral, row.correct, xerr=_errors(row, "footprint_integral", 0, np.inf),
                      yerr=_errors(row, "correct", 0, 1), fmt="none", ecolor=colour, alpha=0.6)
        left.scatter(row.footprint_integral, row.correct, s=row.new_tokens * 2, color=colour, marker=marker,
                     label=row.policy, edgecolor="black", linewidth=0.5)
        right.barh(i, row.new_tokens, color=colour, xerr=_errors(row, "new_tokens", 0, limit))
    left.set_xscale("log")
    left.set_xlabel("KV footprint integral: entries held, summed over layers, KV heads and decode steps")
    left.set_ylabel("share of the list's codes copied (correct)")
    left.set_ylim(-0.05, 1.05)
    left.legend(fontsize=7, loc="center right", title="marker: budget; area: output length", title_fontsize=7)
    right.set_yticks(range(len(summary)), summary.policy, fontsize=8)
    right.invert_yaxis()
    right.axvline(limit, linestyle="--", color="grey", linewidth=1)
    right.set_xlim(0, limit * 1.05)
    right.set_xlabel("output tokens (end token included; dashed: the limit)")
    items = int(table.n_items.iloc[0])
    lists = f"{summary.lists.min()}" + ("" if summary.lists.min() == summary.lists.max() else f"-{summary.lists.max()}")
    fig.suptitle(f"Long generation: copying a list of {items} codes, {lists} lists per policy (means, 95% t intervals)",
                 fontsize=10)
    png = stem.with_suffix(".png")
    write_png(fig, png)
    return [png]
