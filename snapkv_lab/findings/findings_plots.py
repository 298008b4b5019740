"""Figures of the four findings, drawn from data/findings_*.csv: lines with 95% t-interval bands (over prompts or
documents, `overlap.summarise`), chance dashed, one column per (split, sinks variant), one row per metric; PNG
(matplotlib, without pyplot, so a notebook's backend is never switched) and an HTML twin (plotly) each.

Nothing here assumes a model's layer count or a run's number of segments: both are read from the tables.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from ..core import overlap as metrics
from ..core.figure_files import write_html, write_png
from ..core.overlap import summarise
from .report import read_run, read_tables

CI = 0.95
Y_LABELS = {"hit_rate": "hit rate H (theta 0.05)", "recall": "recall (attention mass share)",
            "coarse": "coarse overlap", "overlap": "overlap H(M_A, M_B)"}
SPLIT_NAMES = {"dev": "dev", "heldout": "held-out"}
PLACEMENTS = {"front": "question before the document", "back": "question after the document"}


@dataclass
class Grid:
    """One figure: `summary` (from `summarise(..., ci=...)`) with columns x, hue, metric, split, sinks."""

    summary: pd.DataFrame
    x: str
    hue: str
    title: str
    xlabel: str
    hue_label: dict = field(default_factory=dict)  # hue value -> legend text
    notes: dict = field(default_factory=dict)  # (split, sinks) -> text under that column's panel titles
    columns: list = field(default_factory=list)  # [(split, sinks)]; default every pair in the summary
    x_ticks: tuple = ()  # x values that must be ticks (the observation window's -1), beside the automatic ones


# A point resting on little support is drawn hollow: defined (>= MIN_SUPPORT) but not a finding to read alone.
LOW_SUPPORT = 4 * metrics.MIN_SUPPORT


def layer_ranges(layers) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8"."""
    layers = sorted(int(x) for x in layers)
    runs, start = [], None
    for i, layer in enumerate(layers):
        if start is None:
            start = layer
        if i + 1 == len(layers) or layers[i + 1] != layer + 1:
            runs.append(f"{start}" if start == layer else f"{start}-{layer}")
            start = None
    return ", ".join(runs)


def layer_groups(layers) -> dict[int, str]:
    """Layer -> "layers a-b" for three contiguous groups of about equal size (any layer count)."""
    layers = sorted(set(int(x) for x in layers))
    out = {}
    for part in np.array_split(np.array(layers), min(3, len(layers))):
        for layer in part:
            out[int(layer)] = f"layers {part[0]}-{part[-1]}" if len(part) > 1 else f"layer {part[0]}"
    return out


def _columns(grid: Grid) -> list[tuple[str, str]]:
    if grid.columns:
        return grid.columns
    present = grid.summary[["split", "sinks"]].drop_duplicates()
    order = {"dev": 0, "heldout": 1, "kept": 0, "excluded": 1}
    return sorted(map(tuple, present.to_numpy()), key=lambda c: (order.get(c[0], 9), order.get(c[1], 9)))


def _metrics(grid: Grid) -> list[str]:
    return [m for m in Y_LABELS if m in set(grid.summary["metric"])]


def _panel_title(grid: Grid, split: str, sinks: str, metric: str) -> str:
    part = grid.summary[(grid.summary.split == split) & (grid.summary.sinks == sinks) & (grid.summary.metric == metric)]
    title = f"{SPLIT_NAMES.get(split, split)}, sinks {sinks}"
    if grid.x == "layer":  # gaps in a line are cells with too little support, not missing data: say whose
        gaps = {}
        for hue, line in part[~part["defined"].astype(bool)].groupby(grid.hue):
            gaps.setdefault(layer_ranges(line[grid.x]), []).append(grid.hue_label.get(hue, str(hue)))
        if gaps:
            whose = "; ".join(
                f"{' & '.join(names) if len(names) < part[grid.hue].nunique() else 'all'}: layers {layers}"
                for layers, names in gaps.items())
            title += "\n" + _wrap(f"undefined (support < {metrics.MIN_SUPPORT}), not drawn: {whose}", 46)
    note = grid.notes.get((split, sinks))
    return title + (f"\n{_wrap(note, 46)}" if note else "")


def _coinciding(lines: dict[str, pd.Series]) -> list[list[str]]:
    """Groups of two or more series (label -> values on a shared x) drawn on top of each other (within 0.005)."""
    groups: list[list[str]] = []
    for label, values in lines.items():
        for group in groups:
            other = lines[group[0]]
            if values.index.equals(other.index) and np.allclose(values, other, atol=0.005, equal_nan=True):
                group.append(label)
                break
        else:
            groups.append([label])
    return [group for group in groups if len(group) > 1]


def _wrap(text: str, width: int) -> str:
    """Each line of `text` broken at `width` characters, so that titles and notes stay inside their panel."""
    return "\n".join(part for line in text.split("\n") for part in textwrap.wrap(line, width))


def draw_png(grid: Grid, path: Path) -> Path:
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    metric_names, columns = _metrics(grid), _columns(grid)
    figure = Figure(figsize=(3.8 * len(columns) + 3.4, 3.1 * len(metric_names) + 1.1), layout="constrained")
    axes = figure.subplots(len(metric_names), len(columns), squeeze=False, sharex=True)
    hues = sorted(grid.summary[grid.hue].unique(), key=_natural)
    colours = {h: f"C{i % 10}" for i, h in enumerate(hues)}
    for r, metric in enumerate(metric_names):
        for c, (split, sinks) in enumerate(columns):
            ax = axes[r][c]
            part = grid.summary[(grid.summary.metric == metric) & (grid.summary.split == split)
                                & (grid.summary.sinks == sinks)]
            drawn = {}
            for hue in hues:
                line = part[part[grid.hue] == hue].sort_values(grid.x)
                if line.empty:
                    continue
                line = line.assign(**{c: line[c].where(line["defined"].astype(bool))
                                      for c in ("value", "ci_low", "ci_high")
                                      if c in line})  # no point and no band at an undefined cell
                label = grid.hue_label.get(hue, str(hue))
                ax.plot(line[grid.x], line["value"], marker=".", color=colours[hue], label=label)
                thin = line[line["support"] < LOW_SUPPORT]
                ax.plot(thin[grid.x], thin["value"], "o", ms=6, markerfacecolor="white", color=colours[hue])
                if "ci_low" in line:  # a band with its own edges: overlapping bands stay apart from their lines
                    ax.fill_between(line[grid.x], line["ci_low"], line["ci_high"], color=colours[hue], alpha=0.12,
                                    linewidth=0)
                    for edge in ("ci_low", "ci_high"):
                        ax.plot(line[grid.x], line[edge], color=colours[hue], linewidth=0.6, linestyle=":", alpha=0.8)
                drawn[label] = line.set_index(grid.x)["value"]
            for group in _coinciding(drawn):  # series hidden under another: say so on the panel
                ax.text(0.5, 0.22,
                        _wrap(f"{len(group)} series coincide (drawn on top of each other): {', '.join(group)}", 40),
                        transform=ax.transAxes, ha="center", va="center", fontsize=7,
                        bbox=dict(boxstyle="round", facecolor="white", alpha=0.85, edgecolor="0.7"))
            chance = part.groupby(grid.x)["chance"].mean()
            ax.plot(chance.index, chance.values, "k--", linewidth=1, label="chance")
            ax.set_ylim(-0.02, 1.02)
            ax.set_ylabel(Y_LABELS[metric])
            ax.set_title(_panel_title(grid, split, sinks, metric), fontsize=9)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            if grid.x_ticks:
                low, high = part[grid.x].min(), part[grid.x].max()
                ticks = [t for t in MaxNLocator(integer=True).tick_values(low, high) if low <= t <= high
                         and all(abs(t - forced) > 1 for forced in grid.x_ticks)]  # no tick crowding a forced one
                ax.set_xticks(sorted({*ticks, *grid.x_ticks}))
            ax.grid(alpha=0.3)
    figure.supxlabel(grid.xlabel, fontsize=10)  # once: a long label per panel runs into its neighbours
    handles, labels = axes[0][0].get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    unique[f"hollow: support < {LOW_SUPPORT}"] = Line2D([], [], marker="o", markerfacecolor="white", color="0.4",
                                                        linestyle="none")
    unique["dotted: interval edges"] = Line2D([], [], color="0.4", linestyle=":", linewidth=0.8)
    figure.legend(unique.values(), unique.keys(), loc="outside right center", fontsize=8)
    figure.suptitle(_wrap(grid.title, int(figure.get_figwidth() * 13)), fontsize=10)
    return write_png(figure, path, dpi=100)


def draw_html(grid: Grid, path: Path) -> Path:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    metric_names, columns = _metrics(grid), _columns(grid)
    titles = [_panel_title(grid, split, sinks, metric).replace("\n", "<br>")
              for metric in metric_names for split, sinks in columns]
    figure = make_subplots(rows=len(metric_names), cols=len(columns), shared_xaxes=True, subplot_titles=titles,
                           vertical_spacing=0.14 if len(metric_names) > 1 else 0.1)
    hues = sorted(grid.summary[grid.hue].unique(), key=_natural)
    palette = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
               "#17becf"]
    for r, metric in enumerate(metric_names, start=1):
        for c, (split, sinks) in enumerate(columns, start=1):
            part = grid.summary[(grid.summary.metric == metric) & (grid.summary.split == split)
                                & (grid.summary.sinks == sinks)]
            first = r == 1 and c == 1
            for i, hue in enumerate(hues):
                line = part[part[grid.hue] == hue].sort_values(grid.x)
                if line.empty:
                    continue
                colour, name = palette[i % len(palette)], grid.hue_label.get(hue, str(hue))
                if "ci_low" in line:
                    band = line.dropna(subset=["ci_low", "ci_high"])
                    figure.add_trace(go.Scatter(x=[*band[grid.x], *band[grid.x][::-1]],
                                                y=[*band["ci_high"], *band["ci_low"][::-1]],
                                                fill="toself", fillcolor=colour, opacity=0.2, line=dict(width=0),
                                                hoverinfo="skip", showlegend=False, legendgroup=name), row=r, col=c)
                hover = (line[["value", "ci_low", "ci_high", "chance", "support", "n_samples"]].to_numpy()
                         if "ci_low" in line else None)
                figure.add_trace(go.Scatter(
                    x=line[grid.x], y=line["value"], mode="lines+markers", name=name, legendgroup=name,
                    showlegend=first, line=dict(color=colour), customdata=hover,
                    hovertemplate=(f"{name}<br>{grid.x} %{{x}}: %{{y:.3f}} [%{{customdata[1]:.3f}}, "
                                   "%{customdata[2]:.3f}]<br>chance %{customdata[3]:.3f}, support "
                                   "%{customdata[4]:.0f}, samples %{customdata[5]}<extra></extra>")
                    if hover is not None else None), row=r, col=c)
            chance = part.groupby(grid.x)["chance"].mean()
            figure.add_trace(go.Scatter(x=chance.index, y=chance.values, mode="lines", name="chance",
                                        legendgroup="chance", showlegend=first,
                                        line=dict(color="black", dash="dash", width=1)), row=r, col=c)
            figure.update_yaxes(title_text=Y_LABELS[metric], range=[-0.02, 1.02], row=r, col=c)
            if r == len(metric_names):
                figure.update_xaxes(title_text=grid.xlabel, row=r, col=c)
    figure.update_xaxes(tickformat="d")
    figure.update_annotations(font_size=11)
    figure.update_layout(title=grid.title, height=330 * len(metric_names) + 140, width=330 * len(columns) + 260,
                         margin=dict(t=150))
    return write_html(figure, path)


def _natural(value):
    """Sort key that puts numbers in numeric order and text after them."""
    try:
        return (0, float(value), "")
    except (TypeError, ValueError):
        return (1, 0.0, str(value))


def _write(grid: Grid, stem: Path) -> list[Path]:
    return [draw_png(grid, stem.with_suffix(".png")), draw_html(grid, stem.with_suffix(".html"))]


# ---- the figures ---------------------------------------------------------------------------------
def _title(what: str, table: pd.DataFrame, mode: str, unit: str) -> str:
    model = ", ".join(sorted(table["model"].fillna("?").astype(str).unique())) if "model" in table else "?"
    counts = table.groupby("split")["sample"].nunique()
    samples = ", ".join(f"{n} {SPLIT_NAMES.get(s, s)}" for s, n in counts.items())
    return (f"{what}\n{model}, {mode} tokens; {samples} {unit}; bands: {CI:.0%} t interval over {unit}; "
            "dashed: chance")


def _summary(table: pd.DataFrame, by) -> pd.DataFrame:
    return summarise(table, by=("split", "sinks", "metric", *by), ci=CI)


# The window's selection and its baselines (experiments.BASELINES), as the legends name them.
BASELINE_LABELS = {"recency": "recency: the last k prefix positions",
                   "random segment": "a random earlier segment's selection",
                   "oracle": "hindsight oracle: the best k positions"}


def _paper(table: pd.DataFrame) -> pd.DataFrame:
    """The rows of the window's selection ("paper"), without the baselines' (a table without `selection` holds no
    others)."""
    return table[table["selection"] == "paper"] if "selection" in table else table


def figure_a(table: pd.DataFrame, mode: str, info: dict) -> Grid:
    table = _paper(table)
    groups = layer_groups(table["layer"])
    grouped = pd.concat([table.assign(hue=table["layer"].map(groups)), table.assign(hue="all layers")])
    summary = _summary(grouped, ("hue", "segment"))
    size = info.get("prompt_segment", "?")
    return Grid(summary, "segment", "hue",
                _title("(a) Each prompt segment votes; does the last one (-1, the observation window) "
                       "agree best with generation?", table, mode, "prompts"),
                f"prompt segment of {size} tokens (-1 = the last: the observation window)", x_ticks=(-1,))


def figure_b(table: pd.DataFrame, mode: str, info: dict) -> Grid:
    summary = _summary(table, ("layer", "segment"))
    size = info.get("gen_segment")
    labels = {w: f"tokens {(w - 1) * size + 1}-{w * size}" if size else f"segment {w}"
              for w in summary["segment"].unique()}
    n = summary["segment"].nunique()
    return Grid(summary, "layer", "segment",
                _title(f"(b) Observation window ({info.get('obs_window', '?')} tokens) vs {n} segments "
                       "of generated tokens", table, mode, "prompts"), "layer", labels)


def figure_b_windows(table: pd.DataFrame, mode: str, info: dict) -> Grid:
    part = table[table["selection"] == "paper"]
    summary = _summary(part, ("layer", "obs_window"))
    labels = {w: f"window of {w}" for w in summary["obs_window"].unique()}
    return Grid(summary, "layer", "obs_window",
                _title("(b) Observation windows of different sizes, all generated tokens "
                       "(paper's selection)", part, mode, "prompts"), "layer", labels)


def figure_b_selection(table: pd.DataFrame, mode: str, info: dict) -> Grid:
    window = info.get("obs_window", 32)
    part = table[table["obs_window"] == window]
    summary = _summary(part, ("layer", "selection"))
    labels = {"paper": "paper: per query head, no pooling", "compressor": "SnapKV compressor: per KV head, max pool 7",
              **BASELINE_LABELS}
    return Grid(summary, "layer", "selection",
                _title(f"(b) The paper's selection vs the compressor's and the baselines of its "
                       f"size, observation window {window}, all generated tokens", part, mode,
                       "prompts"), "layer", labels)


def figure_c(table: pd.DataFrame, mode: str, info: dict) -> Grid:
    table = _paper(table)
    summary = _summary(table, ("layer", "placement"))
    return Grid(summary, "layer", "placement",
                _title("(c) Question before vs after the document: observation window vs "
                       "the answer", table, mode, "documents"), "layer", PLACEMENTS)


def figure_d(table: pd.DataFrame, mode: str, info: dict) -> Grid:
    table = table.assign(hue=table["comparison"] + ", " + table["voters"])
    summary = _summary(table, ("layer", "hue"))
    columns, notes = [], {}
    for split in sorted(summary["split"].unique(), key=lambda s: SPLITS_ORDER.get(s, 9)):
        kept, excluded = (table[(table.split == split) & (table.sinks == s)] for s in ("kept", "excluded"))
        same = len(kept) == len(excluded) and np.array_equal(kept[metrics.PARTS].to_numpy(),
                                                             excluded[metrics.PARTS].to_numpy())
        columns.append((split, "kept"))
        if same:  # no document position is a sink: the second panel would repeat the first
            notes[(split, "kept")] = "sinks excluded: the same (no document position is a sink)"
        else:
            columns.append((split, "excluded"))
    labels = {"different questions, all rows": "different questions (question + answer rows): the paper's H",
              "different questions, alternate rows": "different questions, alternate rows (A even vs B odd)",
              "same question, alternate rows": "same question, alternate rows (even vs odd): control",
              "question vs recency, all rows": "a question vs recency (the document's last k positions)",
              "question vs random segment, all rows": "a question vs a random document segment's selection"}
    return Grid(summary, "layer", "hue",
                _title("(d) Selections over one document made by different questions vs by one "
                       "question", table, mode, "documents"), "layer", labels, notes, columns)


def figure_a_baselines(table: pd.DataFrame, mode: str, info: dict) -> Grid:
    """(a) per layer: the last segment's selection (the observation window) against the baselines of its size."""
    window = table[(table["selection"] == "paper") & (table["segment"] == -1)]
    part = pd.concat([window, table[table["selection"] != "paper"]])
    summary = _summary(part, ("layer", "selection"))
    labels = {"paper": "the last prompt segment (the observation window)", **BASELINE_LABELS}
    return Grid(summary, "layer", "selection",
                _title("(a) The last prompt segment's selection vs the baselines of its size, "
                       "on the common prefix", table, mode, "prompts"), "layer", labels)


def figure_c_baselines(table: pd.DataFrame, mode: str, info: dict) -> Grid:
    """(c) per layer, both placements pooled: the observation window's selection against the baselines of its size."""
    summary = _summary(table, ("layer", "selection"))
    labels = {"paper": "observation window (paper's selection)", **BASELINE_LABELS}
    return Grid(summary, "layer", "selection",
                _title("(c) The observation window vs the baselines of its size, both "
                       "question placements pooled", table, mode, "documents"), "layer", labels)


SPLITS_ORDER = {"dev": 0, "heldout": 1}


def head_figure(table: pd.DataFrame, mode: str, info: dict):
    """Per-head recall (sinks excluded) per layer, pooled over prompts and generation segments: one dot per head,
    the layer's pooled value as a line. Returns (matplotlib Figure, plotly Figure)."""
    import plotly.express as px
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    part = table[(table.metric == "recall") & (table.sinks == "excluded")]
    heads = summarise(part, by=("split", "layer", "head"))
    layers = summarise(part, by=("split", "layer"))
    splits = sorted(heads["split"].unique(), key=lambda s: SPLITS_ORDER.get(s, 9))
    title = _title("Per-head recall (sinks excluded) of the observation window's selection, all generated tokens",
                   table, mode, "prompts").replace("; bands: 95% t interval over prompts", "")
    figure = Figure(figsize=(6.5 * len(splits) + 1.5, 4.6), layout="constrained")
    axes = figure.subplots(1, len(splits), squeeze=False, sharey=True)[0]
    n_heads = heads["head"].nunique()
    for ax, split in zip(axes, splits):
        h, lay = heads[heads.split == split], layers[layers.split == split]
        offset = (h["head"] - (n_heads - 1) / 2) * 0.6 / max(1, n_heads)
        for head in sorted(h["head"].unique()):  # heads are categories: one colour each, named in the legend
            one = h["head"] == head
            ax.scatter(h["layer"][one] + offset[one], h["value"][one], color=f"C{int(head) % 10}", s=12,
                       label=f"query head {head}")
        ax.plot(lay["layer"], lay["value"], color="black", linewidth=1, label="layer (all heads pooled)")
        ax.plot(lay["layer"], lay["chance"], "k--", linewidth=1, label="chance")
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("layer")
        ax.set_ylabel("recall (attention mass share)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(SPLIT_NAMES.get(split, split), fontsize=9)
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="outside right center", fontsize=8)
    figure.suptitle(_wrap(title, int(figure.get_figwidth() * 13)), fontsize=10)
    html = px.scatter(heads.assign(head=heads["head"].astype(str)), x="layer", y="value", color="head",
                      facet_col="split", hover_data=["chance", "support"], title=title.replace("\n", "<br>"),
                      labels={"value": "recall (attention mass share)"})
    return figure, html


FIGURES = {"a": ("a", figure_a), "b": ("b", figure_b), "b_windows": ("b_variants", figure_b_windows),
           "b_selection": ("b_variants", figure_b_selection), "c": ("c", figure_c), "d": ("d", figure_d),
           "a_baselines": ("a", figure_a_baselines), "c_baselines": ("c", figure_c_baselines)}
BASELINE_FIGURES = ("a_baselines", "c_baselines")  # drawn only from tables that hold the baselines (an oracle)


def draw_findings(data_dir, figures_dir) -> list[Path]:
    """Every findings figure (figures/findings_<name>.png/.html, `_<mode>` added for modes other than generated)
    from the tables in data_dir that exist."""
    data_dir, figures_dir = Path(data_dir), Path(figures_dir)
    info, written, tables = read_run(data_dir), [], read_tables(data_dir)
    for name, (table_name, make) in [*FIGURES.items(), ("heads", ("b", None))]:
        if table_name not in tables:
            continue
        table = tables[table_name]
        if name in BASELINE_FIGURES and ("selection" not in table or "oracle" not in set(table["selection"])):
            continue
        if "sample" not in table or "split" not in table:
            raise ValueError(f"{data_dir / f'findings_{table_name}.csv'} has no sample and split columns: it "
                             "predates the intervals; rerun `snapkv-lab figures --recompute --only findings`")
        for mode, part in table.groupby("mode"):
            stem = figures_dir / (f"findings_{name}" + ("" if mode == "generated" else f"_{mode}"))
            if make is None:
                png, html = head_figure(part, mode, info)
                write_png(png, stem.with_suffix(".png"), dpi=100)
                written += [stem.with_suffix(".png"), write_html(html, stem.with_suffix(".html"))]
            else:
                written += _write(make(part, mode, info), stem)
    return written
