"""The long-generation figure: accuracy against the KV footprint over the generation, the output's length beside it."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from ..core.figure_files import write_png
from ..views.palette import LINE_COLOURS
from .long_generation import long_generation_summary


def long_generation_figure(table: pd.DataFrame, stem: Path) -> list[Path]:
    """Left: share of codes copied against the footprint integral (entry-steps, log scale), per policy: means over the
    lists with 95% t intervals on both axes, marker area proportional to the mean output length. Right: the mean
    output length per policy with its interval, the largest allowed (max_new_tokens) dashed."""
    from matplotlib.figure import Figure

    summary = long_generation_summary(table)
    fig = Figure(figsize=(12, 4.8), layout="constrained")
    left, right = fig.subplots(1, 2, width_ratios=(1.4, 1))
    for i, row in summary.iterrows():
        colour = LINE_COLOURS[i % len(LINE_COLOURS)]
        left.errorbar(row.footprint_integral, row.correct,
                      xerr=[[row.footprint_integral - row.footprint_integral_low],
                            [row.footprint_integral_high - row.footprint_integral]],
                      yerr=[[row.correct - row.correct_low], [row.correct_high - row.correct]],
                      fmt="none", ecolor=colour, alpha=0.6)
        left.scatter(row.footprint_integral, row.correct, s=row.new_tokens * 2, color=colour, label=row.policy,
                     edgecolor="black", linewidth=0.5)
        right.barh(i, row.new_tokens, color=colour,
                   xerr=[[row.new_tokens - row.new_tokens_low], [row.new_tokens_high - row.new_tokens]])
    left.set_xscale("log")
    left.set_xlabel("KV footprint: entries held summed over layers, KV heads and decode steps (entry-steps)")
    left.set_ylabel("share of the list's codes copied (correct)")
    left.set_ylim(-0.05, 1.05)
    left.legend(fontsize=7, loc="best", title="marker area: output length", title_fontsize=7)
    right.set_yticks(range(len(summary)), summary.policy, fontsize=8)
    right.invert_yaxis()
    right.axvline(table.max_new_tokens.max(), linestyle="--", color="grey", linewidth=1)
    right.set_xlabel("output length (new tokens, the end token included; dashed: max_new_tokens)")
    items, lists = int(table.n_items.iloc[0]), table.seed.nunique()
    fig.suptitle(f"Long generation: copying a list of {items} codes, {lists} lists per policy (means, 95% t intervals)",
                 fontsize=10)
    png = stem.with_suffix(".png")
    write_png(fig, png)
    return [png]
