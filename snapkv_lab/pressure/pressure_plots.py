"""The pressure figures, drawn from data/pressure_*.csv: PNG (matplotlib) for papers and HTML (plotly) to explore.

Every accuracy is shown as found / asked with its count, and every budget curve with 95% Wilson intervals, so
a reader sees how few prompts stand behind a point. Heatmaps use viridis (readable without red-green vision, in
grey scale too) with a labelled colour bar. Budgets, lengths and depths are drawn in numeric order.

Drawings use `matplotlib.figure.Figure` directly, never pyplot: no global backend is switched, so drawing
from a notebook leaves its inline backend alone.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from ..core.figure_files import write_html, write_png
from ..views.palette import HEATMAP_COLOURS, LINE_COLOURS, line_style
from .ablations import ABLATION_CAPACITY, ABLATION_LENGTH, ablation_table, retrieval_predictors
from .grid import RULER_CAPACITY, RULER_LENGTH
from .intervals import wilson
from .long_generation_plots import long_generation_figure
from .runner import MODES
from .tables import methods_table, run_label

FOUND_LABEL = "share of prompts answered right"


def model_name(table: pd.DataFrame) -> str:
    """The model that wrote the table (its `model` column). Tables written before that column existed all come
    from the bundled model, which is what they are labelled with."""
    names = [str(m) for m in table["model"].dropna().unique() if str(m)] if "model" in table.columns else []
    if names:
        return ", ".join(names)
    from ..core.models import DEFAULT_MODEL

    return DEFAULT_MODEL


def found_counts(table: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    """Per group: found, asked, accuracy and its 95% Wilson interval (low, high), groups in sorted (numeric) order."""
    counts = table.groupby(by, sort=True).correct.agg(found="sum", asked="size").reset_index()
    counts["found"] = counts.found.astype(int)
    counts["accuracy"] = counts.found / counts.asked
    bounds = [wilson(f, n) for f, n in zip(counts.found, counts.asked)]
    counts["low"], counts["high"] = [b[0] for b in bounds], [b[1] for b in bounds]
    return counts


def _n_text(asked: pd.Series) -> str:
    sizes = sorted(set(int(n) for n in asked))
    return f"n = {sizes[0]}" if len(sizes) == 1 else f"n = {sizes[0]}-{sizes[-1]}"


def _annotate_cells(ax, share: np.ndarray, found: np.ndarray, asked: np.ndarray, fontsize: float = 7) -> None:
    """k/n in each heatmap cell, white on dark cells and black on light ones (viridis is light above ~0.6)."""
    for i in range(share.shape[0]):
        for j in range(share.shape[1]):
            if asked[i, j] > 0:
                ax.text(j, i, f"{int(found[i, j])}/{int(asked[i, j])}", ha="center", va="center", fontsize=fontsize,
                        color="black" if share[i, j] > 0.6 else "white")


def _budget_axis(ax, budgets) -> None:
    """Log-2 budget axis labelled with the budgets themselves (256, not 2^8)."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(budgets, [str(b) for b in budgets])
    ax.minorticks_off()


def _dodge(budgets: pd.Series, index: int, count: int) -> pd.Series:
    """Shift series `index` of `count` sideways on a log-2 axis so that their interval bars do not overlap."""
    return budgets * 2 ** ((index - (count - 1) / 2) * 0.07)


def draw(data_dir: Path, figures_dir: Path) -> list[Path]:
    """Every pressure figure whose table exists in data_dir: needle heatmaps per mode, accuracy vs budget,
    the ablations (`draw_ablations`), the RULER-style suite, the lines ablation and long generation."""
    data_dir, figures_dir = Path(data_dir), Path(figures_dir)
    written = []
    if (data_dir / "pressure_needle.csv").exists():
        table = pd.read_csv(data_dir / "pressure_needle.csv")
        for mode in [m for m in MODES if m in set(table["mode"])]:  # a grid run with --modes has one
            written += needle_heatmaps(table, mode, figures_dir / f"pressure_needle_{mode}")
        written += needle_budget(table, figures_dir / "pressure_needle_budget")
    written += draw_ablations(data_dir, figures_dir)
    if (data_dir / "pressure_ruler.csv").exists():
        written += ruler_figure(pd.read_csv(data_dir / "pressure_ruler.csv"), figures_dir / "pressure_ruler")
    if (data_dir / "pressure_lines.csv").exists():
        written += lines_figure(pd.read_csv(data_dir / "pressure_lines.csv"), figures_dir / "pressure_lines")
    if (data_dir / "pressure_methods.csv").exists():
        written += methods_figure(pd.read_csv(data_dir / "pressure_methods.csv"), figures_dir / "pressure_methods")
    if (data_dir / "pressure_presses.csv").exists():
        written += methods_figure(pd.read_csv(data_dir / "pressure_presses.csv"), figures_dir / "pressure_presses",
                                  what="kvpress's other presses")
    if (data_dir / "long_generation.csv").exists():
        written += long_generation_figure(pd.read_csv(data_dir / "long_generation.csv"),
                                          figures_dir / "long_generation")
    return written


def needle_heatmaps(table: pd.DataFrame, mode: str, stem: Path) -> list[Path]:
    """Depth x length heatmaps, one panel per policy and budget in `mode`; the full cache (the same in both modes,
    no budget) gets one panel on the top row. Each cell: found / asked over its haystacks."""
    import plotly.graph_objects as go
    from matplotlib.figure import Figure
    from plotly.subplots import make_subplots

    full = table[table.policy == "FullCache"]
    part = table[table["mode"] == mode]
    policies = list(dict.fromkeys(part.policy))  # the grid's own order
    budgets = sorted(int(c) for c in part.capacity.dropna().unique())
    lengths, depths = sorted(table.length.unique()), sorted(table.depth.unique())
    cells = {("FullCache", None): found_counts(full, ["depth", "length"])}
    for policy in policies:
        for budget in budgets:
            cells[(policy, budget)] = found_counts(part[(part.policy == policy) & (part.capacity == budget)],
                                                   ["depth", "length"])

    def grid(counts: pd.DataFrame, column: str) -> np.ndarray:
        return (counts.pivot(index="depth", columns="length", values=column).reindex(index=depths, columns=lengths)
                .to_numpy())

    name = model_name(table)
    n = _n_text(pd.concat(cells.values()).asked)
    title = f"Needle retrieval, {name}, {mode}: found / asked per cell ({n} haystacks)"
    rows = ["FullCache", *policies]
    fig = Figure(figsize=(2.3 * len(budgets) + 1.4, 1.75 * len(rows) + 1.0), layout="constrained")
    axes = fig.subplots(len(rows), len(budgets), squeeze=False, sharex=True, sharey=True)
    image = None
    for r, policy in enumerate(rows):
        for c, budget in enumerate(budgets):
            ax = axes[r, c]
            if policy == "FullCache" and c > 0:
                ax.set_axis_off()
                if c == 1:
                    ax.text(0, 0.5, "full cache: every position kept,\nthe same in every mode and budget",
                            transform=ax.transAxes, va="center", fontsize=8, color="#444")
                continue
            counts = cells[(policy, None if policy == "FullCache" else budget)]
            share = grid(counts, "accuracy")
            image = ax.imshow(share, vmin=0, vmax=1, cmap=HEATMAP_COLOURS, aspect="auto")
            _annotate_cells(ax, share, grid(counts, "found"), grid(counts, "asked"))
            ax.set_xticks(range(len(lengths)), [str(x) for x in lengths], fontsize=8)
            ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths], fontsize=8)
            ax.tick_params(labelbottom=True)
            ax.set_title(f"{policy}, full cache" if policy == "FullCache" else f"{policy}, budget {budget}", fontsize=8)
    fig.colorbar(image, ax=axes, label=FOUND_LABEL, shrink=0.5, aspect=30)
    fig.supxlabel("prompt length (tokens)")
    fig.supylabel("needle depth (0% = start of the haystack)")
    fig.suptitle(title, fontsize=10)
    png = stem.with_suffix(".png")
    write_png(fig, png)

    titles = [(f"{p}, full cache" if c == 0 else "") if p == "FullCache" else f"{p}, budget {b}"
              for p in rows for c, b in enumerate(budgets)]
    interactive = make_subplots(rows=len(rows), cols=len(budgets), subplot_titles=titles, shared_xaxes=True,
                                shared_yaxes=True, vertical_spacing=0.04, horizontal_spacing=0.03)
    for r, policy in enumerate(rows):
        for c, budget in enumerate(budgets[:1] if policy == "FullCache" else budgets):
            counts = cells[(policy, None if policy == "FullCache" else budget)]
            found, asked = grid(counts, "found"), grid(counts, "asked")
            interactive.add_trace(go.Heatmap(
                z=grid(counts, "accuracy"), x=[str(x) for x in lengths], y=[f"{d:.0%}" for d in depths],
                text=[[f"{int(f)}/{int(a)}" for f, a in zip(fr, ar)] for fr, ar in zip(found, asked)],
                texttemplate="%{text}", coloraxis="coloraxis",
                hovertemplate=f"{titles[r * len(budgets) + c]}<br>length %{{x}} tokens<br>depth %{{y}}<br>"
                              "found %{text} (%{z:.0%})<extra></extra>"), row=r + 1, col=c + 1)
    interactive.update_annotations(font_size=11)
    interactive.update_layout(title=title, height=230 * len(rows) + 120, width=290 * len(budgets) + 220,
                              coloraxis=dict(colorscale="Viridis", cmin=0, cmax=1, colorbar=dict(title=FOUND_LABEL)))
    interactive.update_xaxes(title_text="prompt length (tokens)", row=len(rows))
    interactive.update_yaxes(autorange="reversed")  # depth 0% (the start) on top, as in the PNG
    interactive.update_yaxes(title_text="needle depth", col=1)
    return [png, write_html(interactive, stem.with_suffix(".html"))]


def needle_budget(table: pd.DataFrame, stem: Path) -> list[Path]:
    """Accuracy vs KV budget per policy, one panel per (mode, length), with 95% Wilson intervals; the full
    cache as a dotted line with its interval as a grey band."""
    import plotly.express as px
    from matplotlib.figure import Figure

    compressed = found_counts(table[table.policy != "FullCache"], ["mode", "length", "policy", "capacity"])
    compressed["budget"] = compressed.capacity.astype(int)
    full = found_counts(table[table.policy == "FullCache"], ["length"]).set_index("length")
    modes = [m for m in MODES if m in set(compressed["mode"])]
    lengths, budgets = sorted(compressed.length.unique()), sorted(compressed.budget.unique())
    policies = list(dict.fromkeys(table.policy[table.policy != "FullCache"]))
    title = (f"Needle accuracy vs KV budget, {model_name(table)}: found / asked ({_n_text(compressed.asked)} prompts "
             "per point), 95% Wilson intervals")

    fig = Figure(figsize=(3.6 * len(lengths) + 0.5, 2.9 * len(modes) + 1.2), layout="constrained")
    axes = fig.subplots(len(modes), len(lengths), squeeze=False, sharex=True, sharey=True)
    for r, mode in enumerate(modes):
        for c, length in enumerate(lengths):
            ax = axes[r, c]
            reference = full.loc[length]
            ax.axhspan(reference.low, reference.high, color="0.88", lw=0)
            ax.axhline(reference.accuracy, ls=":", color="k",
                       label="FullCache (band: its 95% interval)")
            for i, policy in enumerate(policies):
                line = compressed[(compressed["mode"] == mode) & (compressed.length == length)
                                  & (compressed.policy == policy)]
                line = line.sort_values("budget")
                ax.errorbar(_dodge(line.budget, i, len(policies)), line.accuracy,
                            yerr=[line.accuracy - line.low, line.high - line.accuracy], ms=4, lw=1.2, capsize=2,
                            label=policy, **line_style(i))
            _budget_axis(ax, budgets)
            ax.set_ylim(-0.03, 1.03)
            ax.grid(alpha=0.3)
            ax.set_title(f"{mode}, {length} tokens (full cache {int(reference.found)}/{int(reference.asked)})",
                         fontsize=9)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=len(labels), fontsize=8, frameon=False)
    for ax in axes[-1]:
        ax.set_xlabel("KV budget (positions per KV head, log scale)", fontsize=9)
    fig.supylabel(FOUND_LABEL)
    fig.suptitle(title, fontsize=10)
    png = stem.with_suffix(".png")
    write_png(fig, png)

    points = compressed.sort_values(["mode", "length", "policy", "budget"]).assign(
        plus=lambda d: d.high - d.accuracy, minus=lambda d: d.accuracy - d.low)
    interactive = px.line(points, x="budget", y="accuracy", color="policy", facet_col="length", facet_row="mode",
                          markers=True, log_x=True, error_y="plus", error_y_minus="minus",
                          hover_data=["found", "asked", "low", "high"],
                          category_orders={"mode": modes, "policy": policies}, color_discrete_sequence=LINE_COLOURS,
                          title=title.replace(": ", ":<br>", 1) + "; dotted: full cache",
                          labels=dict(budget="KV budget (positions per KV head)", accuracy="accuracy"))
    for c, length in enumerate(lengths):
        for r in range(len(modes)):
            interactive.add_hline(y=full.loc[length, "accuracy"], line_dash="dot", row=r + 1, col=c + 1,
                                  annotation_text=f"full {int(full.loc[length, 'found'])}/"
                                                  f"{int(full.loc[length, 'asked'])}",
                                  annotation_font_size=9)
    interactive.update_xaxes(tickvals=budgets, ticktext=[str(b) for b in budgets])
    interactive.update_yaxes(range=[-0.03, 1.03])
    interactive.update_layout(height=300 * len(modes) + 150, width=330 * len(lengths) + 200)
    return [png, write_html(interactive, stem.with_suffix(".html"))]


def ruler_figure(table: pd.DataFrame, stem: Path) -> list[Path]:
    """RULER-style suite: a task x run heatmap of the substring grade with counts (PNG), both grades as bars (HTML)."""
    import plotly.express as px
    from matplotlib.figure import Figure

    table = table.assign(run=run_label(table))
    runs = ["FullCache", *sorted(set(table.run) - {"FullCache"})]
    counts = found_counts(table, ["task", "value_kind", "run"])
    cells = counts.pivot_table(index=["task", "value_kind"], columns="run", values=["accuracy", "found", "asked"])
    cells = cells.reindex(columns=runs, level=1)
    title = (f"RULER-style needles, {model_name(table)}, {RULER_LENGTH} tokens, budget {RULER_CAPACITY}: "
             "found / asked (RULER's substring grade)")
    fig = Figure(figsize=(0.75 * len(runs) + 3.5, 0.4 * len(cells) + 2.4), layout="constrained")
    ax = fig.subplots()
    share = cells["accuracy"].to_numpy()
    image = ax.imshow(share, vmin=0, vmax=1, cmap=HEATMAP_COLOURS, aspect="auto")
    _annotate_cells(ax, share, cells["found"].to_numpy(), cells["asked"].to_numpy())
    ax.set_xticks(range(len(runs)), runs, rotation=40, ha="right", fontsize=8)
    ax.set_yticks(range(len(cells.index)), [f"{t} / {k}" for t, k in cells.index], fontsize=8)
    ax.set_ylabel("task / value kind")
    ax.set_xlabel(f"policy and mode (budget {RULER_CAPACITY} each; FullCache: no budget)")
    ax.set_title(title, fontsize=9)
    fig.colorbar(image, ax=ax, label=FOUND_LABEL, shrink=0.8)
    png = stem.with_suffix(".png")
    write_png(fig, png)

    grades = table.melt(id_vars=["task", "value_kind", "run"],
                        value_vars=[g for g in ("correct", "exact") if g in table], var_name="grade",
                        value_name="accuracy")
    grades = (grades.groupby(["task", "value_kind", "run", "grade"], as_index=False).accuracy
              .agg(["mean", "sum", "size"]))
    grades = grades.rename(columns={"mean": "accuracy", "sum": "found", "size": "asked"})
    bars = px.bar(grades, x="run", y="accuracy", color="grade", barmode="group", facet_row="task",
                  facet_col="value_kind", hover_data=["found", "asked"], category_orders={"run": runs},
                  color_discrete_sequence=LINE_COLOURS,
                  title=title.replace("(RULER's substring grade)", "<br>(correct: RULER's substring grade; exact: the "
                                                                     "value as a whole token)"), height=900)
    return [png, write_html(bars, stem.with_suffix(".html"))]


def lines_figure(table: pd.DataFrame, stem: Path) -> list[Path]:
    """Lines retrieval vs budget, SnapKV with and without pooling: accuracy with 95% Wilson intervals against the
    full cache, and the share of the asked value's tokens each kept (which still separates the two where the model
    answers nothing right)."""
    import plotly.express as px
    from matplotlib.figure import Figure

    compressed = found_counts(table[table.policy != "FullCache"], ["policy", "capacity"])
    compressed["budget"] = compressed.capacity.astype(int)
    kept = table.groupby(["policy", "capacity"]).value_kept.mean().rename("value_kept").reset_index()
    compressed = compressed.merge(kept, on=["policy", "capacity"])
    full = found_counts(table[table.policy == "FullCache"], ["policy"]).iloc[0]
    budgets, policies = sorted(compressed.budget.unique()), list(dict.fromkeys(compressed.policy))
    title = (f"LongEval-Lines-style retrieval, {model_name(table)}: pooling ablation "
             f"({_n_text(compressed.asked)} questions per point)")
    fig = Figure(figsize=(10, 4), layout="constrained")
    accuracy_ax, kept_ax = fig.subplots(1, 2, sharex=True)
    accuracy_ax.axhspan(full.low, full.high, color="0.88", lw=0)
    accuracy_ax.axhline(full.accuracy, ls=":", color="k",
                        label=f"FullCache {full.found}/{full.asked} (band: 95% interval)")
    for i, policy in enumerate(policies):
        line = compressed[compressed.policy == policy].sort_values("budget")
        style = dict(line_style(i), label=policy)
        accuracy_ax.errorbar(_dodge(line.budget, i, len(policies)), line.accuracy,
                             yerr=[line.accuracy - line.low, line.high - line.accuracy], capsize=3, **style)
        kept_ax.plot(line.budget, line.value_kept, **style)
    for ax, label in ((accuracy_ax, FOUND_LABEL),
                      (kept_ax, "share of the value's tokens kept\n(mean over layers and KV heads)")):
        _budget_axis(ax, budgets)
        ax.set_ylim(-0.03, 1.03)
        ax.grid(alpha=0.3)
        ax.set_ylabel(label)
        ax.set_xlabel("KV budget (positions kept per KV head, log scale)")
    accuracy_ax.set_title("answers (95% Wilson intervals)", fontsize=9)
    if full.found == 0:
        accuracy_ax.text(0.5, 0.6, f"the full cache finds 0/{int(full.asked)}: the model fails the task\nitself, so "
                         "these zeros say nothing about pooling", transform=accuracy_ax.transAxes, ha="center",
                         fontsize=8, color="#444")
    kept_ax.set_title("what the cache kept of the answer", fontsize=9)
    accuracy_ax.legend(fontsize=8, loc="upper left")
    fig.suptitle(title, fontsize=10)
    png = stem.with_suffix(".png")
    write_png(fig, png)

    shown = pd.concat([compressed.assign(budget=compressed.budget.astype(str)),
                       pd.DataFrame([dict(full, budget="full", value_kept=1.0)])])
    shown["count"] = [f"{int(f)}/{int(n)}" for f, n in zip(shown.found, shown.asked)]
    measures = shown.melt(id_vars=["policy", "budget", "count"], value_vars=["accuracy", "value_kept"],
                          var_name="measure", value_name="share")
    measures["label"] = measures["count"].where(measures.measure == "accuracy", measures.share.map("{:.2f}".format))
    measures["measure"] = measures.measure.map({"accuracy": "answered right (found / asked)",
                                                "value_kept": "share of the value's tokens kept"})
    bars = px.bar(measures, x="budget", y="share", color="policy", barmode="group", facet_col="measure", text="label",
                  category_orders={"budget": ["full", *map(str, budgets)]}, color_discrete_sequence=LINE_COLOURS,
                  title=title.replace(": ", ":<br>", 1), labels=dict(budget="KV budget (positions per KV head)"))
    bars.update_traces(textposition="outside")
    bars.update_yaxes(range=[0, 1.1])
    bars.for_each_annotation(lambda a: a.update(text=a.text.split("=")[-1]))
    return [png, write_html(bars, stem.with_suffix(".html"))]


def draw_ablations(data_dir, figures_dir) -> list[Path]:
    """figures/pressure_ablations.png (found / asked with Wilson intervals per axis and setting, both modes) and
    figures/pressure_coverage_retrieval.{png,html} (each run's coverage against the needle attention it served,
    found vs missed), from data/pressure_ablations.csv; nothing when the table is absent."""
    import plotly.express as px
    from matplotlib.figure import Figure

    path = Path(data_dir) / "pressure_ablations.csv"
    if not path.exists():
        return []
    table = pd.read_csv(path)
    summary = ablation_table(table)
    figures_dir = Path(figures_dir)
    modes = ("query-aware", "query-agnostic")
    labels = summary[summary["mode"] == modes[0]][["axis", "setting"]].apply(lambda r: f"{r.axis}: {r.setting}", axis=1)
    fig = Figure(figsize=(10, 0.24 * len(labels) + 1.6))
    axes = fig.subplots(1, 2, sharey=True)
    for ax, mode in zip(axes, modes):
        part = summary[summary["mode"] == mode].reset_index(drop=True)
        y = range(len(part))[::-1]
        share = part.correct / part.asked
        ax.errorbar(share, y, xerr=[share - part.correct_low, part.correct_high - share], fmt="o", ms=3,
                    color="tab:blue", ecolor="0.6", capsize=2, clip_on=False)  # points at 0 and 1 drawn whole
        for row, first in enumerate(part.axis != part.axis.shift()):
            if first and row:
                ax.axhline(len(part) - row - 0.5, color="0.85", lw=0.8)
        ax.set_xlim(-0.05, 1.05)
        ax.set_xlabel(f"needles found ({mode}), 95% Wilson interval")
        ax.set_yticks(list(y))
        ax.set_title(f"{mode}: {ABLATION_CAPACITY} of {ABLATION_LENGTH} tokens, n = {int(part.asked.max())} per row",
                     fontsize=9)
    axes[0].set_yticklabels(labels, fontsize=7)  # shared y: label the left panel only
    models = ", ".join(sorted(table.model.dropna().astype(str).unique())) if "model" in table else "?"
    fig.suptitle(f"SnapKV's settings and the other methods at {ABLATION_CAPACITY} of {ABLATION_LENGTH} tokens: "
                 f"needle retrieval, {models}", fontsize=10)
    fig.tight_layout()
    bars = figures_dir / "pressure_ablations.png"
    write_png(fig, bars)

    runs = table[table["mode"] != "full"].assign(coverage_of_oracle=lambda t: t.coverage / t.oracle,
                                                 value_served=lambda t: t.value_attention_kept / t.value_attention,
                                                 outcome=lambda t: t.correct.map({True: "found", False: "missed"}))
    auc = {mode: retrieval_predictors(table[table["mode"].isin(["full", mode])]).set_index("predictor").auc
           for mode in modes}
    fig = Figure(figsize=(10, 4))
    axes = fig.subplots(1, 2, sharex=True, sharey=True)
    for ax, mode in zip(axes, modes):
        part = runs[runs["mode"] == mode]
        for outcome, marker, colour in (("missed", "x", "tab:orange"), ("found", "o", "tab:blue")):
            sel = part[part.outcome == outcome]
            ax.scatter(sel.coverage_of_oracle, sel.value_served, marker=marker, s=18, color=colour,
                       label=f"{outcome} ({len(sel)})")
        ax.set_xlabel("coverage / oracle (sinks excluded)")
        ax.set_title(f"{mode}: AUC coverage {auc[mode]['coverage_of_oracle']:.2f}, "
                     f"needle served {auc[mode]['value_served']:.2f}", fontsize=9)
        ax.legend(fontsize=8, loc="upper left")
    axes[0].set_ylabel("share of the answer's needle-value attention served")
    fig.suptitle("Does coverage predict retrieval? Each point a compressed run of the ablations", fontsize=10)
    fig.tight_layout()
    scatter = figures_dir / "pressure_coverage_retrieval.png"
    write_png(fig, scatter)
    interactive = px.scatter(runs, x="coverage_of_oracle", y="value_served", color="outcome", facet_col="mode",
                             hover_data=["policy", "depth", "sample", "output"],
                             labels=dict(coverage_of_oracle="coverage / oracle (sinks excluded)",
                                         value_served="needle-value attention served"),
                             title="Does coverage predict retrieval? (ablation runs)")
    return [bars, scatter, write_html(interactive, figures_dir / "pressure_coverage_retrieval.html")]


def methods_figure(table: pd.DataFrame, stem: Path, what: str = "The newer methods") -> list[Path]:
    """The methods suite (or the presses suite, `what` naming it): needles found per method with 95% Wilson intervals,
    one panel per mode, the full cache as a line with its interval as a band (PNG); the same with the kept tokens and
    the coverage columns, where the table has them, on hover (HTML)."""
    import plotly.express as px
    from matplotlib.figure import Figure

    summary = methods_table(table)
    full = summary[summary.policy == "FullCache"].iloc[0]
    runs = summary[summary.policy != "FullCache"]
    modes = [m for m in ("query-aware", "query-agnostic") if m in set(runs["mode"])]
    policies = list(dict.fromkeys(runs.policy))
    title = (f"{what} at {ABLATION_CAPACITY} of {ABLATION_LENGTH} tokens: needles found, "
             f"{model_name(table)}, n = {int(runs.asked.max())} per point\n(95% Wilson intervals; grey line and band: "
             f"the full cache, {int(full.correct)}/{int(full.asked)}, and its interval)")
    fig = Figure(figsize=(11, 0.32 * len(policies) + 2.0), layout="constrained")
    axes = fig.subplots(1, len(modes), sharey=True, squeeze=False)[0]
    for ax, mode in zip(axes, modes):
        part = runs[runs["mode"] == mode].set_index("policy").reindex(policies)
        share = part.correct / part.asked
        y = np.arange(len(policies))[::-1]
        ax.axvspan(full.correct_low, full.correct_high, color="0.9", zorder=0)
        ax.axvline(full.correct / full.asked, color="0.5", lw=1)
        ax.errorbar(share, y, xerr=[share - part.correct_low, part.correct_high - share], fmt="o", ms=4,
                    color=LINE_COLOURS[0], ecolor="0.5", capsize=2, clip_on=False)
        for yi, found, asked in zip(y, part.correct, part.asked):
            if pd.isna(asked):  # a method not run in this mode
                continue
            ax.annotate(f"{int(found)}/{int(asked)}", (1.04, yi), xycoords=("axes fraction", "data"), fontsize=7,
                        va="center")
        ax.set_xlim(-0.05, 1.05)
        ax.set_xlabel(f"{FOUND_LABEL}, {mode}", fontsize=9)
        ax.set_yticks(list(y), policies, fontsize=8)
    fig.suptitle(title, fontsize=9)
    png = stem.with_suffix(".png")
    write_png(fig, png)
    shown = runs.assign(share=runs.correct / runs.asked)
    dots = px.scatter(shown, x="share", y="policy", facet_col="mode", error_x=shown.correct_high - shown.share,
                      error_x_minus=shown.share - shown.correct_low,
                      hover_data=[c for c in ("correct", "asked", "cache_length", "coverage_of_oracle", "value_served")
                                  if c in shown],
                      category_orders={"policy": policies}, title=title, labels={"share": FOUND_LABEL})
    return [png, write_html(dots, stem.with_suffix(".html"))]
