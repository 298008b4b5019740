"""The benchmark figures, drawn from data/eval_<name>.csv: PNG (matplotlib) and HTML (plotly), as the other sets.

- leaderboard: score vs compression ratio (or capacity) per policy, one panel per mode; the full cache as a dotted
  line with its interval as a grey band; 95% bootstrap intervals over examples (summary.leaderboard). kvpress's own
  results (`snapkv-lab eval --import DIR`: kvpress_format.read_kvpress) beside them, hollow and dashed, each averaged
  over the run's tasks (peer_points).
- heatmap: policy x task at one budget, per mode, each cell its score (viridis, labelled).
- gap: each task's score less the full cache's on the same examples, per policy at one budget (paired intervals in
  the HTML's hover).
- difference (where the run has SnapKV and another compressed policy): each policy's score less SnapKV's on the same
  examples at every budget, per mode, with its paired 95% interval (summary.paired_difference); filled where the
  paired sign-flip test of that difference holds past Holm's adjustment over the family of comparisons
  (evaluation.family: every comparison the docs report, across runs), ringed where it holds there on the examples
  the full cache answers. A run the family does not count is drawn with nothing filled: a p adjusted over one run
  alone would let a comparison pass in a small family that fails in the whole one. The leaderboard's intervals
  overlap where this may still separate.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from ..core.figure_files import write_html, write_png
from ..views.palette import HEATMAP_COLOURS, LINE_COLOURS, line_style
from .family import ALPHA, Adjustment, run_adjustment
from .run import read_results
from .summary import _budget, gap_to_full, leaderboard, lengths, paired_difference, task_scores
from .turns import is_multi_turn

SCORE_LABEL = "score (0-100)"


def _modes(scores: pd.DataFrame) -> list[str]:
    return [m for m in ("query-agnostic", "query-aware") if m in set(scores["mode"])]


def counted(n: int, word: str) -> str:
    """'1 task', '3 tasks': a count with its noun, for titles and generated tables."""
    return f"{n} {word}" + ("" if n == 1 else "s")


def _title(table: pd.DataFrame, what: str) -> str:
    model = str(table.model.iloc[0]).rstrip("/").split("/")[-1]
    examples = table.groupby("task").example.nunique()
    counts = f"{examples.min()}" if examples.min() == examples.max() else f"{examples.min()}-{examples.max()}"
    plural = "" if counts == "1" else "s"
    held = lengths(table)
    length = f" at {held[0]} tokens" if len(held) == 1 else ""
    return (f"{what}, {model}: {', '.join(sorted(table.dataset.unique()))}{length}, {counted(len(examples), 'task')}, "
            f"{counts} example{plural} per task")


def draw(data_dir: Path, figures_dir: Path, names=None, peers: pd.DataFrame | None = None) -> list[Path]:
    """The figures of every data_dir/eval_<name>.csv (or of the named ones), into
    figures_dir/eval_<name>_{leaderboard,heatmap,gap,difference}; a run at several lengths, one set per length, as
    RULER reports them: eval_<name>_<length>_{leaderboard,heatmap,gap,difference}. peers: kvpress's task scores
    (kvpress_format.read_kvpress), drawn in each leaderboard beside the run's points (peer_points)."""
    written = []
    paths = (sorted(Path(data_dir).glob("eval_*.csv")) if names is None
             else [Path(data_dir) / f"eval_{n}.csv" for n in names])
    for path in paths:
        table = read_results(path)
        if is_multi_turn(table):  # turns, feeds and compress options: the multi-turn set draws it (evaluation.turns)
            continue
        held = lengths(table)
        parts = ([(path.stem, table)] if len(held) < 2
                 else [(f"{path.stem}_{n}", table[table.length == n]) for n in held])
        # the family holds runs of one length: a run at several is not in it
        adjustment = run_adjustment(path) if len(parts) == 1 else None
        for name, part in parts:
            stem = Path(figures_dir) / name
            written += leaderboard_figure(part, stem.with_name(name + "_leaderboard"),
                                          None if peers is None else peer_points(peers, part))
            middle = middle_budget(part)
            written += heatmap_figure(part, middle, stem.with_name(name + "_heatmap"))
            written += gap_figure(part, middle, stem.with_name(name + "_gap"))
            if BASELINE in set(part.policy) and part.loc[part["mode"] != "full", "policy"].nunique() > 1:
                written += difference_figure(part, stem.with_name(name + "_difference"), adjustment=adjustment)
    return written


def middle_budget(table: pd.DataFrame) -> float:
    """The budget the one-budget figures show: the middle of the run's ratios or capacities (0.5 of 0.25/0.5/0.75)."""
    budget = _budget(table)
    values = sorted(table.loc[table["mode"] != "full", budget].dropna().unique())
    return values[len(values) // 2]


def _finish(fig, axes, title: str, stem: Path) -> Path:
    """The policies' legend on the right (each label of any panel once), the title, and the PNG written: stem.png."""
    legend = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    fig.legend(list(legend.values()), list(legend), loc="outside right center", fontsize=7, frameon=False)
    fig.suptitle(title, fontsize=9)
    return write_png(fig, stem.with_suffix(".png"))


# Where kvpress's published results are drawn: the lab's own points stay filled and solid.
PEER = "kvpress"


def peer_points(peers: pd.DataFrame, table: pd.DataFrame) -> pd.DataFrame:
    """kvpress's task scores (kvpress_format.read_kvpress) as points of `table`'s leaderboard: per (model, policy,
    ratio, mode) the mean over `table`'s tasks, at its dataset and prompt length, of the results that hold every one
    of those tasks (RULER's leaderboard averages 13; a lab run of 11 is compared on its 11). Columns: model, policy
    ("kvpress <press> (<model>)"; FullCache for no_press), ratio, mode, score, tasks. Empty where none match."""
    tasks = set(table.task)
    held = lengths(table)
    rows = peers[peers.dataset.isin(set(table.dataset)) & peers.task.isin(tasks)
                 & (peers.length.isin(held) if held else True)]
    keys = ["model", "policy", "ratio", "mode"]
    points = rows.groupby(keys, sort=True).agg(score=("score", "mean"), tasks=("task", "nunique")).reset_index()
    points = points[points.tasks == len(tasks)]
    short = points.model.map(lambda m: str(m).rstrip("/").split("/")[-1])
    named = points.policy.where(points.policy == "FullCache", PEER + " " + points.policy + " (" + short + ")")
    return points.assign(policy=named).reset_index(drop=True)


def leaderboard_figure(table: pd.DataFrame, stem: Path, peers: pd.DataFrame | None = None) -> list[Path]:
    """Score vs budget per policy and mode (module doc); peers: peer_points of kvpress's results, drawn hollow and
    dashed (their full cache dash-dotted)."""
    import plotly.express as px
    from matplotlib.figure import Figure

    board, budget = leaderboard(table), _budget(table)
    peers = peers if peers is not None and not peers.empty and budget == "ratio" else None
    full = board[board.policy == "FullCache"].set_index("mode")
    points = board[board.policy != "FullCache"]
    modes, policies = _modes(points), list(dict.fromkeys(points.policy))
    axis = "compression ratio (share of KV pairs removed)" if budget == "ratio" else "capacity (tokens per KV head)"
    title = _title(table, "Score vs compression") + "; 95% bootstrap intervals over examples"
    if peers is not None:
        title += f"\nhollow, dashed: {PEER}'s results averaged over the same {counted(table.task.nunique(), 'task')}"
    fig = Figure(figsize=(5.2 * len(modes) + 0.6, 4.4), layout="constrained")
    axes = fig.subplots(1, len(modes), squeeze=False, sharey=True)[0]
    flagged = False
    for ax, mode in zip(axes, modes, strict=True):
        reference = full.loc[mode]
        ax.axhspan(reference.low, reference.high, color="0.88", lw=0)
        ax.axhline(reference.score, ls=":", color="k", label="FullCache (band: its 95% interval)")
        for i, policy in enumerate(policies):
            line = points[(points["mode"] == mode) & (points.policy == policy)].sort_values(budget)
            offset = (i - (len(policies) - 1) / 2) * (0.004 if budget == "ratio" else 0)
            ax.errorbar(line[budget] + offset, line.score, yerr=[line.score - line.low, line.high - line.score],
                        ms=4, lw=1.2, capsize=2, label=policy, **line_style(i))
            over = line[line.over_budget.eq(True)] if "over_budget" in line else line.iloc[:0]
            if not over.empty:
                ax.scatter(over[budget] + offset, over.score, s=70, facecolors="none", edgecolors="red", lw=1.2,
                           zorder=4, label=None if flagged else OVER_BUDGET)
                flagged = True
        if peers is not None:
            _draw_peers(ax, peers, mode, policies)
        ax.set_title(f"{mode} (full cache {reference.score:.1f})", fontsize=9)
        ax.set_xlabel(axis, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(SCORE_LABEL)
    png = _finish(fig, axes, title, stem)
    shown = points.assign(plus=points.high - points.score, minus=points.score - points.low)
    if peers is not None:  # no intervals: kvpress publishes scores alone
        shown = pd.concat([shown, peers[peers["mode"] != "full"].assign(plus=0.0, minus=0.0)], ignore_index=True)
    interactive = px.line(shown.sort_values(["mode", "policy", budget]), x=budget, y="score", color="policy",
                          facet_col="mode", markers=True, error_y="plus", error_y_minus="minus",
                          hover_data=["low", "high", "tasks", "examples"], category_orders={"mode": modes},
                          title=title + "; dotted: full cache", labels={budget: axis, "score": SCORE_LABEL})
    for c, mode in enumerate(modes):
        interactive.add_hline(y=full.loc[mode, "score"], line_dash="dot", row=1, col=c + 1,
                              annotation_text=f"full {full.loc[mode, 'score']:.1f}", annotation_font_size=9)
        for peer in [] if peers is None else peers[peers["mode"] == "full"].itertuples():
            interactive.add_hline(y=peer.score, line_dash="dashdot", row=1, col=c + 1, annotation_font_size=9,
                                  annotation_text=f"{PEER} no_press ({str(peer.model).split('/')[-1]}) "
                                                  f"{peer.score:.1f}", annotation_position="bottom right")
    interactive.update_layout(height=480, width=520 * len(modes) + 250)
    return [png, write_html(interactive, stem.with_suffix(".html"))]


def _draw_peers(ax, peers: pd.DataFrame, mode: str, policies: list[str]) -> None:
    """kvpress's points of one mode panel: each press a dashed line of hollow markers, styled after the run's
    `policies` (one style per press in every panel); its full cache (no_press, compressed without the question in
    either mode) dash-dotted."""
    for peer in peers[peers["mode"] == "full"].itertuples():
        ax.axhline(peer.score, ls="-.", color="0.45", lw=1,
                   label=f"{PEER} no_press ({str(peer.model).split('/')[-1]})")
    named = sorted(set(peers.policy[peers["mode"] != "full"]))
    for policy, line in peers[peers["mode"] == mode].groupby("policy", sort=True):
        style = dict(line_style(len(policies) + named.index(policy)), ls="--")
        ax.plot(line.ratio, line.score, ms=5, lw=1, markerfacecolor="none", label=policy, **style)


# A point whose cache held more KV entries than its budget (compression.entries): not a matched-totals comparison.
OVER_BUDGET = "held more KV entries than its budget (red ring)"

# Gaps are signed: a diverging map that reads without red-green vision, white at no change.
GAP_COLOURS = "PuOr"


def _policy_task_grid(values: pd.DataFrame, column: str, title: str, stem: Path, *, colours: str, limits: tuple,
                      label: str, hover: list[str]) -> list[Path]:
    """values (policy, task, mode, column, hover...) as one policy x task grid per mode, each cell labelled: policies
    down and tasks across, so that a dozen of each stay legible in a page-wide figure."""
    import plotly.express as px
    from matplotlib.figure import Figure

    modes = _modes(values)
    policies, tasks = list(dict.fromkeys(values.policy)), list(dict.fromkeys(values.task))
    fig = Figure(figsize=(max(7.0, 0.55 * len(tasks) * len(modes) + 3.5), 0.3 * len(policies) + 1.8),
                 layout="constrained")
    axes = fig.subplots(1, len(modes), squeeze=False, sharey=True)[0]
    for ax, mode in zip(axes, modes, strict=True):
        grid = values[values["mode"] == mode].pivot_table(index="policy", columns="task", values=column)
        grid = grid.reindex(index=policies, columns=tasks).to_numpy()
        image = ax.imshow(grid, cmap=colours, vmin=limits[0], vmax=limits[1], aspect="auto")
        for (r, c), value in np.ndenumerate(grid):
            if not np.isnan(value):
                dark = image.cmap(image.norm(value))[:3]
                ax.text(c, r, f"{value:.0f}", ha="center", va="center", fontsize=6,
                        color="white" if sum(dark) < 1.5 else "black")
        ax.set_xticks(range(len(tasks)), tasks, rotation=45, ha="right", fontsize=7)
        ax.set_yticks(range(len(policies)), policies, fontsize=7)
        ax.set_title(mode, fontsize=9)
    fig.colorbar(image, ax=axes, label=label, shrink=0.8)
    fig.suptitle(title, fontsize=9)
    png = stem.with_suffix(".png")
    write_png(fig, png)
    interactive = px.scatter(values[values["mode"].isin(modes)], x="task", y="policy", color=column, facet_col="mode",
                             hover_data=hover, color_continuous_scale=colours, range_color=list(limits),
                             category_orders={"policy": policies, "task": tasks}, title=title, labels={column: label})
    interactive.update_traces(marker=dict(symbol="square", size=18))
    interactive.update_layout(height=24 * len(policies) + 300, width=50 * len(tasks) * len(modes) + 350)
    return [png, write_html(interactive, stem.with_suffix(".html"))]


def _at(budget: str, at: float) -> str:
    return f"ratio {at:g}" if budget == "ratio" else f"capacity {int(at)}"


def heatmap_figure(table: pd.DataFrame, at: float, stem: Path) -> list[Path]:
    """Each task's score per policy at one budget, the full cache on top."""
    budget = _budget(table)
    scores = task_scores(table)
    shown = scores[(scores[budget] == at) | (scores.policy == "FullCache")]
    shown = pd.concat([shown[shown.policy == "FullCache"], shown[shown.policy != "FullCache"]])
    return _policy_task_grid(shown, "score", _title(table, f"Score per task at {_at(budget, at)}"), stem,
                             colours=HEATMAP_COLOURS, limits=(0, 100), label=SCORE_LABEL,
                             hover=["low", "high", "examples"])


def gap_figure(table: pd.DataFrame, at: float, stem: Path) -> list[Path]:
    """Each task's score less the full cache's on the same examples, per policy at one budget (the HTML's hover holds
    the paired 95% intervals)."""
    budget = _budget(table)
    gaps = gap_to_full(table)
    gaps = gaps[gaps[budget] == at]
    title = _title(table, f"Gap to the full cache at {_at(budget, at)}") + " (score - full cache, paired)"
    return _policy_task_grid(gaps, "gap", title, stem, colours=GAP_COLOURS, limits=(-100, 100),
                             label="score - full cache", hover=["low", "high", "full", "examples"])


# The method the lab is named for: every other policy is read against it.
BASELINE = "SnapKV"


def by_difference(differences: pd.DataFrame) -> list[str]:
    """The policies of a paired_difference table, the largest difference (averaged over its modes and budgets) first."""
    return list(differences.groupby("policy").difference.mean().sort_values(ascending=False, kind="stable").index)


NOT_ADJUSTED = "no adjusted p given (draw reads the family's, evaluation.family.run_adjustment)"


def marked_differences(table: pd.DataFrame, baseline: str = BASELINE,
                       adjustment: Adjustment | None = None) -> pd.DataFrame:
    """The difference figure's points: summary.paired_difference's rows (the mean over tasks of the paired
    differences, its interval and p), its per-run Holm columns replaced by the family's adjusted p (`adjustment`,
    family.run_adjustment: p_holm on this statistic, p_holm_answered on the examples the full cache answers; NaN
    where the family does not count the comparison), `filled` where p_holm < 0.05 and `ringed` where
    p_holm_answered < 0.05."""
    budget = _budget(table)
    differences = paired_difference(table, baseline)
    adjusted = (adjustment.p_holm if adjustment is not None else
                pd.DataFrame(columns=["policy", "ratio", "mode", "p_holm", "p_holm_answered"]))
    if budget != "ratio":  # the family compares runs at compression ratios
        adjusted = adjusted.iloc[:0]
    adjusted = adjusted.rename(columns={"ratio": budget}).astype({budget: float, "p_holm": float,
                                                                  "p_holm_answered": float})
    out = differences.merge(adjusted, on=["policy", budget, "mode"], how="left")
    return out.assign(filled=out.p_holm.lt(ALPHA), ringed=out.p_holm_answered.lt(ALPHA))


def difference_figure(table: pd.DataFrame, stem: Path, baseline: str = BASELINE,
                      adjustment: Adjustment | None = None) -> list[Path]:
    """Each policy's score less `baseline`'s on the same examples, per mode (columns) and budget (rows): the paired
    difference over tasks with its 95% interval (marked_differences), filled where it holds past Holm over the family
    of comparisons (`adjustment`, family.run_adjustment; None: nothing filled), ringed where it holds there on the
    examples the full cache answers; policies ordered by their difference averaged over modes and budgets."""
    import plotly.express as px
    from matplotlib.figure import Figure

    budget = _budget(table)
    differences = marked_differences(table, baseline, adjustment)
    modes, steps = _modes(differences), sorted(differences[budget].unique())
    policies = by_difference(differences)[::-1]  # the largest at the top: y counts up
    says = NOT_ADJUSTED if adjustment is None else adjustment.says
    marks = (f"filled: p_holm < {ALPHA:g} on this mean over tasks, ringed: on the examples the full cache answers"
             if differences.p_holm.notna().any() else "nothing filled")
    title = _title(table, f"Score - {baseline}") + f"\npaired 95% bootstrap intervals over examples; {marks};\n{says}"
    fig = Figure(figsize=(4.4 * len(modes) + 1.6, (0.28 * len(policies) + 0.9) * len(steps) + 0.7),
                 layout="constrained")
    grid = fig.subplots(len(steps), len(modes), squeeze=False, sharey=True, sharex=True)
    for row_axes, step in zip(grid, steps, strict=True):
        for ax, mode in zip(row_axes, modes, strict=True):
            rows = differences[(differences["mode"] == mode) & (differences[budget] == step)]
            rows = rows.set_index("policy").reindex(policies)
            y = np.arange(len(policies))
            ax.axvline(0, color="k", lw=0.8, ls=":")
            ax.errorbar(rows.difference, y, xerr=[rows.difference - rows.low, rows.high - rows.difference],
                        fmt="none", ecolor="0.4", lw=1.2, capsize=2)
            filled = rows.filled.fillna(False).astype(bool).to_numpy()
            ringed = rows.ringed.fillna(False).astype(bool).to_numpy()
            ax.scatter(rows.difference[filled], y[filled], color=LINE_COLOURS[0], zorder=3, s=22,
                       label=f"family p_holm < {ALPHA:g} (mean over tasks)")
            ax.scatter(rows.difference[~filled], y[~filled], facecolors="white", edgecolors=LINE_COLOURS[0],
                       zorder=3, s=22, label="not past the family's Holm" if adjustment is not None else "not adjusted")
            ax.scatter(rows.difference[ringed], y[ringed], s=70, facecolors="none", edgecolors="k", lw=1.0, zorder=4,
                       label=f"family p_holm < {ALPHA:g} on the answered examples")
            ax.set_yticks(y, policies, fontsize=7)
            ax.set_title(f"{mode}, {_at(budget, step)}", fontsize=9)
            ax.grid(alpha=0.3, axis="x")
    for ax in grid[-1]:
        ax.set_xlabel(f"score - {baseline} (points, paired)", fontsize=9)
    fig.legend(*grid[0][0].get_legend_handles_labels(), loc="outside lower center", ncols=3, fontsize=7,
               frameon=False)
    fig.suptitle(title, fontsize=9)
    png = stem.with_suffix(".png")
    write_png(fig, png)
    shown = differences.assign(plus=differences.high - differences.difference,
                               minus=differences.difference - differences.low)
    interactive = px.scatter(shown, x="difference", y="policy", facet_col="mode", facet_row=budget,
                             symbol="filled", error_x="plus", error_x_minus="minus",
                             hover_data=["low", "high", "p", "p_holm", "p_holm_answered", "tasks", "examples"],
                             category_orders={"mode": modes, "policy": policies, budget: steps},
                             title=title.replace("\n", "<br>"),
                             labels={"difference": f"score - {baseline} (points, paired)"})
    interactive.add_vline(x=0, line_dash="dot")
    interactive.update_layout(height=(24 * len(policies) + 60) * len(steps) + 200, width=460 * len(modes) + 250)
    return [png, write_html(interactive, stem.with_suffix(".html"))]
