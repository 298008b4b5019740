"""The benchmark figures, drawn from data/eval_<name>.csv: PNG (matplotlib) and HTML (plotly), as the other sets.

- leaderboard: score vs compression ratio (or capacity) per policy, one panel per mode; the full cache as a dotted
  line with its interval as a grey band; 95% bootstrap intervals over examples (summary.leaderboard).
- heatmap: task x policy at one budget, per mode, each cell its score (viridis, labelled).
- gap: each task's score less the full cache's on the same examples, per policy, at one budget, with intervals.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from ..figures import write_html
from ..pressure.figures import HEATMAP_COLOURS, LINE_COLOURS, MARKERS
from .run import read_results
from .summary import _budget, gap_to_full, leaderboard, task_scores

SCORE_LABEL = "score (0-100)"


def _modes(scores: pd.DataFrame) -> list[str]:
    return [m for m in ("query-agnostic", "query-aware") if m in set(scores["mode"])]


def _title(table: pd.DataFrame, what: str) -> str:
    model = str(table.model.iloc[0]).rstrip("/").split("/")[-1]
    examples = table.groupby("task").example.nunique()
    counts = f"{examples.min()}" if examples.min() == examples.max() else f"{examples.min()}-{examples.max()}"
    return f"{what}, {model}: {', '.join(sorted(table.dataset.unique()))}, {len(examples)} tasks, {counts} examples per task"


def draw(data_dir: Path, figures_dir: Path, names=None) -> list[Path]:
    """The three figures of every data_dir/eval_<name>.csv (or of the named ones), into
    figures_dir/eval_<name>_{leaderboard,heatmap,gap}."""
    written = []
    paths = sorted(Path(data_dir).glob("eval_*.csv")) if names is None else [Path(data_dir) / f"eval_{n}.csv" for n in names]
    for path in paths:
        table = read_results(path)
        stem = Path(figures_dir) / path.stem
        written += leaderboard_figure(table, stem.with_name(stem.name + "_leaderboard"))
        middle = middle_budget(table)
        written += heatmap_figure(table, middle, stem.with_name(stem.name + "_heatmap"))
        written += gap_figure(table, middle, stem.with_name(stem.name + "_gap"))
    return written


def middle_budget(table: pd.DataFrame) -> float:
    """The budget the one-budget figures show: the middle of the run's ratios or capacities (0.5 of 0.25/0.5/0.75)."""
    budget = _budget(table)
    values = sorted(table.loc[table["mode"] != "full", budget].dropna().unique())
    return values[len(values) // 2]


def leaderboard_figure(table: pd.DataFrame, stem: Path) -> list[Path]:
    from matplotlib.figure import Figure
    import plotly.express as px

    board, budget = leaderboard(table), _budget(table)
    full = board[board.policy == "FullCache"].set_index("mode")
    points = board[board.policy != "FullCache"]
    modes, policies = _modes(points), list(dict.fromkeys(points.policy))
    axis = "compression ratio (share of KV pairs removed)" if budget == "ratio" else "capacity (tokens per KV head)"
    title = _title(table, "Score vs compression") + "; 95% bootstrap intervals over examples"
    fig = Figure(figsize=(5.2 * len(modes) + 0.6, 4.4), layout="constrained")
    axes = fig.subplots(1, len(modes), squeeze=False, sharey=True)[0]
    for ax, mode in zip(axes, modes, strict=True):
        reference = full.loc[mode]
        ax.axhspan(reference.low, reference.high, color="0.88", lw=0)
        ax.axhline(reference.score, ls=":", color="k", label="FullCache (band: its 95% interval)")
        for i, policy in enumerate(policies):
            line = points[(points["mode"] == mode) & (points.policy == policy)].sort_values(budget)
            offset = (i - (len(policies) - 1) / 2) * (0.004 if budget == "ratio" else 0)
            ax.errorbar(line[budget] + offset, line.score, yerr=[line.score - line.low, line.high - line.score],
                        marker=MARKERS[i % len(MARKERS)], ms=4, lw=1.2, capsize=2,
                        color=LINE_COLOURS[i % len(LINE_COLOURS)], ls="-" if i < len(LINE_COLOURS) else "--", label=policy)
        ax.set_title(f"{mode} (full cache {reference.score:.1f})", fontsize=9)
        ax.set_xlabel(axis, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(SCORE_LABEL)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right center", fontsize=7, frameon=False)
    fig.suptitle(title, fontsize=9)
    png = stem.with_suffix(".png")
    fig.savefig(png, dpi=110)
    shown = points.assign(plus=points.high - points.score, minus=points.score - points.low)
    interactive = px.line(shown.sort_values(["mode", "policy", budget]), x=budget, y="score", color="policy",
                          facet_col="mode", markers=True, error_y="plus", error_y_minus="minus",
                          hover_data=["low", "high", "tasks", "examples"], category_orders={"mode": modes},
                          title=title + "; dotted: full cache", labels={budget: axis, "score": SCORE_LABEL})
    for c, mode in enumerate(modes):
        interactive.add_hline(y=full.loc[mode, "score"], line_dash="dot", row=1, col=c + 1,
                              annotation_text=f"full {full.loc[mode, 'score']:.1f}", annotation_font_size=9)
    interactive.update_layout(height=480, width=520 * len(modes) + 250)
    return [png, write_html(interactive, stem.with_suffix(".html"))]


def heatmap_figure(table: pd.DataFrame, at: float, stem: Path) -> list[Path]:
    from matplotlib.figure import Figure
    import plotly.express as px

    budget = _budget(table)
    scores = task_scores(table, n_boot=0)
    shown = scores[(scores[budget] == at) | (scores.policy == "FullCache")]
    modes = _modes(shown)
    policies = ["FullCache", *dict.fromkeys(shown.policy[shown.policy != "FullCache"])]
    tasks = list(dict.fromkeys(shown.task))
    what = f"ratio {at:g}" if budget == "ratio" else f"capacity {int(at)}"
    title = _title(table, f"Score per task at {what}")
    fig = Figure(figsize=(0.75 * len(policies) * len(modes) + 2.5, 0.38 * len(tasks) + 1.8), layout="constrained")
    axes = fig.subplots(1, len(modes), squeeze=False)[0]
    for ax, mode in zip(axes, modes, strict=True):
        grid = shown[shown["mode"] == mode].pivot_table(index="task", columns="policy", values="score")
        grid = grid.reindex(index=tasks, columns=policies)
        image = ax.imshow(grid.to_numpy(), cmap=HEATMAP_COLOURS, vmin=0, vmax=100, aspect="auto")
        for (r, c), value in np.ndenumerate(grid.to_numpy()):
            if not np.isnan(value):
                ax.text(c, r, f"{value:.0f}", ha="center", va="center", fontsize=6,
                        color="white" if value < 60 else "black")
        ax.set_xticks(range(len(policies)), policies, rotation=60, ha="right", fontsize=7)
        ax.set_yticks(range(len(tasks)), tasks, fontsize=7)
        ax.set_title(mode, fontsize=9)
    fig.colorbar(image, ax=axes, label=SCORE_LABEL, shrink=0.8)
    fig.suptitle(title, fontsize=9)
    png = stem.with_suffix(".png")
    fig.savefig(png, dpi=110)
    interactive = px.density_heatmap(shown[shown["mode"].isin(modes)], x="policy", y="task", z="score", facet_col="mode",
                                     histfunc="avg", text_auto=".0f", color_continuous_scale=HEATMAP_COLOURS,
                                     range_color=[0, 100], category_orders={"policy": policies, "task": tasks},
                                     title=title)
    interactive.update_layout(height=28 * len(tasks) + 300, width=60 * len(policies) * len(modes) + 300)
    return [png, write_html(interactive, stem.with_suffix(".html"))]


def gap_figure(table: pd.DataFrame, at: float, stem: Path) -> list[Path]:
    from matplotlib.figure import Figure
    import plotly.express as px

    budget = _budget(table)
    gaps = gap_to_full(table)
    gaps = gaps[gaps[budget] == at]
    modes, policies = _modes(gaps), list(dict.fromkeys(gaps.policy))
    tasks = list(dict.fromkeys(gaps.task))
    what = f"ratio {at:g}" if budget == "ratio" else f"capacity {int(at)}"
    title = _title(table, f"Gap to the full cache at {what}") + "; paired 95% bootstrap intervals"
    fig = Figure(figsize=(0.35 * len(tasks) * len(policies) / 2 + 3, 3.2 * len(modes) + 1), layout="constrained")
    axes = fig.subplots(len(modes), 1, squeeze=False, sharex=True)[:, 0]
    width = 0.8 / max(len(policies), 1)
    for ax, mode in zip(axes, modes, strict=True):
        for i, policy in enumerate(policies):
            bars = gaps[(gaps["mode"] == mode) & (gaps.policy == policy)].set_index("task").reindex(tasks)
            x = np.arange(len(tasks)) + (i - (len(policies) - 1) / 2) * width
            ax.bar(x, bars.gap, width, color=LINE_COLOURS[i % len(LINE_COLOURS)], label=policy,
                   hatch="" if i < len(LINE_COLOURS) else "//")
            ax.errorbar(x, bars.gap, yerr=[bars.gap - bars.low, bars.high - bars.gap], fmt="none", ecolor="0.3",
                        lw=0.7, capsize=1)
        ax.axhline(0, color="k", lw=0.8)
        ax.set_ylabel("score - full cache", fontsize=8)
        ax.set_title(mode, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes[-1].set_xticks(range(len(tasks)), tasks, rotation=45, ha="right", fontsize=7)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right center", fontsize=7, frameon=False)
    fig.suptitle(title, fontsize=9)
    png = stem.with_suffix(".png")
    fig.savefig(png, dpi=110)
    shown = gaps.assign(plus=gaps.high - gaps.gap, minus=gaps.gap - gaps.low)
    interactive = px.bar(shown, x="task", y="gap", color="policy", barmode="group", facet_row="mode",
                         error_y="plus", error_y_minus="minus", hover_data=["full", "examples"],
                         category_orders={"task": tasks, "mode": modes}, title=title,
                         labels={"gap": "score - full cache"})
    interactive.update_layout(height=320 * len(modes) + 150, width=max(700, 40 * len(tasks) * len(policies) // 2))
    return [png, write_html(interactive, stem.with_suffix(".html"))]
