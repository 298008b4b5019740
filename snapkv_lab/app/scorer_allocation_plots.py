"""The scorer x allocation study read: its heatmaps, and each method's result split into scoring and allocation.

Every statistic is over the examples the full cache answers (its score 1): a compressed cache can only
lose what the full cache had. Scores here are 0 or 1 per answer (RULER's niah_single tasks and the needles), so a
cell is a proportion with its Wilson 95% interval (pressure.intervals.wilson); two cells on the same examples are
compared paired: the mean of the per-example differences, its t interval, and the exact two-sided sign test on the
examples where they differ (scipy.stats.binomtest: McNemar's exact test).

A published method is a scorer under an allocation; against SnapKV (window attention, uniform) its difference splits
exactly into a scoring part (its scorer under the uniform allocation, less SnapKV) and an allocation part (its scorer
under its allocation, less the same scorer uniform), `decomposition`.

The figure set `scorer-allocation` is registered here (`snapkv-lab figures --only scorer-allocation` draws it;
`--recompute` runs the study first: app.scorer_allocation.recompute).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from ..core.figure_files import FigureSet, register, write_html, write_png
from ..pressure.intervals import wilson
from ..views.palette import HEATMAP_COLOURS
from .scorer_allocation import ALLOCATIONS, FULL, SCORERS, TABLE, recompute

MODES = ("query-aware", "query-agnostic")
# The published methods the grid holds, as (scorer, allocation): each read against SnapKV under the uniform allocation.
METHODS = {"PyramidKV": ("SnapKV", "pyramid"), "AdaKV": ("SnapKV", "adakv"), "HeadKV": ("SnapKV", "headkv"),
           "KVzip": ("KVzip", "global")}
BASELINE = ("SnapKV", "uniform")


def answered(table: pd.DataFrame) -> pd.DataFrame:
    """The compressed answers on the examples the full cache answers (score 1; its one answer serves both modes)."""
    keys = ["benchmark", "task", "example"]
    full = table[table.scorer == FULL]
    good = full.loc[full.score == 1, keys].drop_duplicates()
    return table[table.scorer != FULL].merge(good, on=keys)


def cell_scores(table: pd.DataFrame) -> pd.DataFrame:
    """Per mode, ratio, scorer and allocation over the answered examples: n, found, the score (0-100) with its Wilson
    interval, the mean share of the uncompressed cache's KV entries held and whether any answer was over budget."""
    rows = []
    for (mode, ratio, scorer, allocation), part in answered(table).groupby(["mode", "ratio", "scorer", "allocation"],
                                                                           sort=False):
        found, n = int(round(part.score.sum())), len(part)
        low, high = wilson(found, n)
        rows.append(dict(mode=mode, ratio=ratio, scorer=scorer, allocation=allocation, n=n, found=found,
                         score=100 * found / n, low=100 * low, high=100 * high, kv_share=part.kv_share.mean(),
                         over_budget=bool(part.over_budget.eq(True).any())))
    return pd.DataFrame(rows)


def paired(table: pd.DataFrame, a: tuple[str, str], b: tuple[str, str]) -> pd.DataFrame:
    """Per mode and ratio: (scorer, allocation) a less b on the answered examples both answered, in points: the mean
    difference, its t 95% interval, the discordant examples (a alone, b alone) and the exact sign test's p."""
    from scipy import stats

    keys = ["benchmark", "task", "example", "mode", "ratio"]
    rows = answered(table)

    def side(pair, name):
        part = rows[(rows.scorer == pair[0]) & (rows.allocation == pair[1])]
        return part[[*keys, "score"]].rename(columns={"score": name})

    both = side(a, "a").merge(side(b, "b"), on=keys)
    out = []
    for (mode, ratio), part in both.groupby(["mode", "ratio"], sort=False):
        difference = 100 * (part.a - part.b).to_numpy()
        only_a, only_b = int((part.a > part.b).sum()), int((part.b > part.a).sum())
        low, high = (stats.ttest_1samp(difference, 0).confidence_interval() if difference.std() > 0
                     else (difference.mean(), difference.mean()))
        p = stats.binomtest(only_a, only_a + only_b).pvalue if only_a + only_b else 1.0
        out.append(dict(mode=mode, ratio=ratio, n=len(part), difference=difference.mean(), low=low, high=high,
                        a_only=only_a, b_only=only_b, p=p))
    return pd.DataFrame(out)


def decomposition(table: pd.DataFrame) -> pd.DataFrame:
    """Each method of METHODS against SnapKV (uniform), per mode and ratio: its whole difference, the scoring part (its
    scorer uniform less SnapKV uniform) and the allocation part (its scorer under its allocation less the same scorer
    uniform), each paired (`paired`); the two parts add up to the whole on the examples all three answered. `p` is
    each row's own exact sign-test p, not adjusted: the decomposition is descriptive, outside the lab's one family of
    tests (evaluation.family), and a Holm over this table alone would be the per-run family the lab gave up."""
    out = []
    for method, (scorer, allocation) in METHODS.items():
        parts = {"whole": paired(table, (scorer, allocation), BASELINE),
                 "scoring": paired(table, (scorer, "uniform"), BASELINE),
                 "allocation": paired(table, (scorer, allocation), (scorer, "uniform"))}
        for part, rows in parts.items():
            out += [dict(method=method, part=part, **row) for row in rows.to_dict("records")]
    return pd.DataFrame(out)


def draw(data_dir, figures_dir) -> list[Path]:
    """figures_dir/scorer_allocation.{png,html} from data_dir/scorer_allocation.csv (nothing without the table)."""
    data_dir, figures_dir = Path(data_dir), Path(figures_dir)
    path = data_dir / TABLE
    if not path.is_file():
        return []
    table = pd.read_csv(path, dtype={"example": str, "prediction": str})
    if table.empty:
        return []
    figures_dir.mkdir(parents=True, exist_ok=True)
    return heatmap_figure(table, figures_dir / "scorer_allocation")


def _title(table: pd.DataFrame) -> str:
    shown = answered(table)
    examples = shown.drop_duplicates(["benchmark", "task", "example"])
    counts = ", ".join(f"{n} {task}" for task, n in examples.groupby("task", sort=False).size().items())
    model = str(table.model.iloc[0]).rstrip("/").split("/")[-1]
    shares = shown.groupby(["mode", "ratio", "scorer", "allocation"]).kv_share.mean()
    uniform = shares.xs("uniform", level="allocation").reindex(shares.droplevel("allocation").index).to_numpy()
    worst = float(np.nanmax(np.abs(shares.to_numpy() / uniform - 1))) if len(shares) else float("nan")
    return (f"Scorer x allocation at matched KV entries, {model}: share found (0-100) of the examples the full cache "
            f"answers\n({counts}); every cell's KV entries within {100 * worst:.1f}% of the uniform allocation's")


def heatmap_figure(table: pd.DataFrame, stem: Path) -> list[Path]:
    """One scorer x allocation grid per mode (rows) and compression ratio (columns), each cell the share found, labelled
    with it and its n; the HTML's hover holds the Wilson interval and the KV share."""
    import plotly.graph_objects as go
    from matplotlib.figure import Figure
    from plotly.subplots import make_subplots

    scores = cell_scores(table)
    modes = [m for m in MODES if m in set(scores["mode"])]
    ratios = sorted(scores.ratio.unique())
    scorers = [s for s in SCORERS if s in set(scores.scorer)]
    allocations = [a for a in ALLOCATIONS if a in set(scores.allocation)]
    title = _title(table)
    fig = Figure(figsize=(3.3 * len(ratios) + 1.4, 2.9 * len(modes) + 0.8), layout="constrained")
    axes = fig.subplots(len(modes), len(ratios), squeeze=False, sharex=True, sharey=True)
    interactive = make_subplots(rows=len(modes), cols=len(ratios), shared_xaxes=True, shared_yaxes=True,
                                subplot_titles=[f"{m}, ratio {r:g}" for m in modes for r in ratios])
    image = None
    for i, mode in enumerate(modes):
        for j, ratio in enumerate(ratios):
            part = scores[(scores["mode"] == mode) & (scores.ratio == ratio)]
            grid = part.pivot(index="scorer", columns="allocation", values="score").reindex(index=scorers,
                                                                                             columns=allocations)
            n = part.pivot(index="scorer", columns="allocation", values="n").reindex(index=scorers, columns=allocations)
            ax = axes[i, j]
            image = ax.imshow(grid.to_numpy(), cmap=HEATMAP_COLOURS, vmin=0, vmax=100, aspect="auto")
            for (r, c), value in np.ndenumerate(grid.to_numpy()):
                if not np.isnan(value):
                    dark = sum(image.cmap(image.norm(value))[:3]) < 1.5
                    ax.text(c, r, f"{value:.0f}", ha="center", va="center", fontsize=7,
                            color="white" if dark else "black")
            ax.set_title(f"{mode}, ratio {ratio:g} (n = {int(np.nanmax(n.to_numpy()))})", fontsize=8)
            ax.set_xticks(range(len(allocations)), allocations, rotation=45, ha="right", fontsize=7)
            ax.set_yticks(range(len(scorers)), scorers, fontsize=7)
            hover = part.set_index(["scorer", "allocation"])
            text = [[_hover(hover, s, a) for a in allocations] for s in scorers]
            interactive.add_trace(go.Heatmap(z=grid.to_numpy(), x=allocations, y=scorers, zmin=0, zmax=100,
                                             colorscale=HEATMAP_COLOURS, text=text, hoverinfo="text",
                                             texttemplate="%{z:.0f}", showscale=i == j == 0), row=i + 1, col=j + 1)
    fig.colorbar(image, ax=axes, label="found (0-100)", shrink=0.7)
    fig.suptitle(title, fontsize=8)
    png = write_png(fig, stem.with_suffix(".png"))
    interactive.update_yaxes(autorange="reversed")
    interactive.update_layout(title=dict(text=title.replace("\n", "<br>"), font=dict(size=11)),
                              height=330 * len(modes) + 120, width=330 * len(ratios) + 200)
    return [png, write_html(interactive, stem.with_suffix(".html"))]


def _hover(cells: pd.DataFrame, scorer: str, allocation: str) -> str:
    if (scorer, allocation) not in cells.index:
        return ""
    row = cells.loc[(scorer, allocation)]
    return (f"{scorer} / {allocation}<br>{row.found} of {row.n} found: {row.score:.0f} [{row.low:.0f}, {row.high:.0f}]"
            f"<br>KV share {row.kv_share:.3f}{' (over budget)' if row.over_budget else ''}")


def report(table: pd.DataFrame) -> str:
    """The study's tables as markdown, for docs/scorer_allocation.md: the scores (found / n, Wilson 95%) per mode and
    ratio, and the decomposition of each method against SnapKV (paired differences in points, t 95% interval,
    discordant examples, exact sign-test p)."""
    scores = cell_scores(table)
    scores = scores.assign(order=scores["mode"].map(MODES.index)).sort_values(["order", "ratio"], kind="stable")
    lines = []
    for (mode, ratio), part in scores.groupby(["mode", "ratio"], sort=False):
        n = int(part.n.max())
        lines += [f"**{mode}, ratio {ratio:g}** (n = {n} answered; found / n, Wilson 95% in points):", "",
                  "| scorer | " + " | ".join(a for a in ALLOCATIONS if a in set(part.allocation)) + " |",
                  "|---|" + "---|" * part.allocation.nunique()]
        for scorer in [s for s in SCORERS if s in set(part.scorer)]:
            cells = part[part.scorer == scorer].set_index("allocation")
            lines.append(f"| {scorer} | " + " | ".join(
                f"{r.found}/{r.n} [{r.low:.0f}, {r.high:.0f}]" for a, r in cells.reindex(
                    [a for a in ALLOCATIONS if a in set(part.allocation)]).iterrows()) + " |")
        lines.append("")
    parts = decomposition(table)
    if not parts.empty:
        lines += ["Each method against SnapKV (uniform), paired on the same answered examples, in points "
                  "(difference [t 95%], examples only it / only the other answers, exact sign-test p). Descriptive: "
                  "these comparisons are not in the lab's family of tests (data/comparison_family.csv), so the p is "
                  "each row's own, unadjusted, and no row is a claim:", "",
                  "| method | mode | ratio | whole | scoring | allocation |", "|---|---|---|---|---|---|"]
        for (method, mode, ratio), part in parts.groupby(["method", "mode", "ratio"], sort=False):
            cells = part.set_index("part")
            lines.append(f"| {method} | {mode} | {ratio:g} | " + " | ".join(
                f"{r.difference:+.0f} [{r.low:+.0f}, {r.high:+.0f}] ({r.a_only}/{r.b_only}, p {r.p:.2g})"
                for _, r in cells.reindex(["whole", "scoring", "allocation"]).iterrows()) + " |")
    return "\n".join(lines)


register(FigureSet(name="scorer-allocation", recompute=recompute, draw=draw, recompute_by_default=False))
