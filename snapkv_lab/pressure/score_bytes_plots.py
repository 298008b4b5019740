"""The score-against-bytes figure set (`snapkv-lab figures --only score-bytes`): the share of needles found against
the share of the full cache's bytes held, one colour per axis of compression, from the table of score_bytes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from ..core.figure_files import FigureSet, register, write_html, write_png
from ..views.palette import LINE_COLOURS
from .intervals import accuracy_intervals
from .score_bytes import AXES, SAMPLES, TABLE, read_table

SUMMARY = "score_bytes_summary.csv"
FIGURE = "score_bytes"
COLOURS = dict(zip(AXES, ["#000000", *LINE_COLOURS[:len(AXES) - 1]], strict=True))
MODE_ORDER = ("query-aware", "query-agnostic")


def summary(table: pd.DataFrame) -> pd.DataFrame:
    """Per mode (the full cache's rows, mode "full", shown in each) and policy (label; `policy`, its scorer label
    without the capacity, names a curve over budgets): needles asked and found (the suite's
    grade, `correct`), the share found with its Wilson 95% interval, the mean, least and most bytes_share, and the
    mean kv_bytes and kv_share (the share of KV entries, positions, held) over the needles. Ordered by mode, then by
    bytes held."""
    full = table[table["mode"] == "full"]
    modes = [m for m in MODE_ORDER if m in set(table["mode"])]
    rows = pd.concat([table[table["mode"] != "full"], *(full.assign(mode=m) for m in modes)], ignore_index=True)
    by = ["mode", "label", "short", "axis", "policy"]
    counts = accuracy_intervals(rows, by=by).rename(columns=dict(correct="found", correct_low="low",
                                                                 correct_high="high"))
    counts["share_found"] = counts.found / counts.asked
    sizes = rows.groupby(by, sort=False).agg(bytes_share=("bytes_share", "mean"),
                                             bytes_share_min=("bytes_share", "min"),
                                             bytes_share_max=("bytes_share", "max"), kv_bytes=("kv_bytes", "mean"),
                                             kv_share=("kv_share", "mean"))
    out = counts.merge(sizes.reset_index(), on=by)
    out["mode"] = pd.Categorical(out["mode"], modes, ordered=True)
    columns = [*by, "asked", "found", "share_found", "low", "high", "bytes_share", "bytes_share_min",
               "bytes_share_max", "kv_bytes", "kv_share"]
    return out.sort_values(["mode", "bytes_share"], ascending=[True, False])[columns].reset_index(drop=True)


def markdown(table: pd.DataFrame) -> str:
    """The summary as the docs show it: per mode, each policy's axis, bytes held (share of the full cache's, mean
    [least, most] over the needles; MiB), KV entries' share (positions) and needles found [Wilson 95%], by bytes."""
    points = summary(table)
    lines = []
    for mode in points["mode"].cat.categories:
        lines += [f"**{mode}**", "", "| policy | axis | bytes held: share [least, most] | MiB | positions held | "
                  "needles found [Wilson 95%] |", "|---|---|---|---:|---:|---|"]
        for r in points[points["mode"] == mode].itertuples():
            lines.append(f"| {r.short} | {r.axis} | {r.bytes_share:.3f} [{r.bytes_share_min:.3f}, "
                         f"{r.bytes_share_max:.3f}] | {r.kv_bytes / 2**20:.1f} | {r.kv_share:.3f} | "
                         f"{r.found}/{r.asked} [{r.low:.2f}, {r.high:.2f}] |")
        lines.append("")
    return "\n".join(lines).rstrip()


def _label_lifts(points: pd.DataFrame, decade_per_char: float = 0.009) -> list[int]:
    """Per point, how many lines below its marker its label goes: the lowest line that no earlier label overlapping
    it in x (a label runs right of its point, about `decade_per_char` of a decade of the log axis per character) and
    near it in y (within 0.05) takes, so that labels of neighbouring points do not overprint."""
    x, y = np.log10(points.bytes_share.to_numpy()), points.share_found.to_numpy()
    ends = x + decade_per_char * points.short.str.len().to_numpy()
    lifts: list[int] = []
    for i in range(len(x)):
        taken = {lifts[j] for j in range(i) if abs(y[j] - y[i]) < 0.05 and x[j] < ends[i] and x[i] < ends[j]}
        lifts.append(min(set(range(len(taken) + 1)) - taken))
    return lifts


def score_bytes_figure(table: pd.DataFrame, stem: Path) -> list[Path]:
    """One panel per mode: each policy a point at (its mean share of the full cache's bytes, log scale; its share of
    needles found) with the Wilson 95% interval, coloured by axis and labelled; PNG and an interactive HTML."""
    from matplotlib.figure import Figure
    from plotly.subplots import make_subplots

    points = summary(table)
    modes = list(points["mode"].cat.categories)
    needles = table.groupby(["depth", "sample"]).ngroups
    title = (f"{table.model.iloc[0]}: needles found against KV bytes held, {needles} needle{'s' * (needles > 1)} of "
             f"{int(table.length.iloc[0])} tokens (Wilson 95%)")
    figure = Figure(figsize=(8 * len(modes), 7), layout="constrained")
    panels = np.atleast_1d(figure.subplots(1, len(modes), sharey=True))
    interactive = make_subplots(rows=1, cols=len(modes), subplot_titles=modes, shared_yaxes=True)
    for col, (panel, mode) in enumerate(zip(panels, modes, strict=True), start=1):
        part = points[points["mode"] == mode]
        for name in AXES:
            group = part[part.axis == name]
            if group.empty:
                continue
            errors = [group.share_found - group.low, group.high - group.share_found]
            panel.errorbar(group.bytes_share, group.share_found, yerr=errors, fmt="*" if name == "full" else "o",
                           color=COLOURS[name], label=name, markersize=9 if name == "full" else 6, capsize=2,
                           alpha=0.85)
            for _, curve in group.groupby("policy"):  # one policy over budgets: a thin line
                if len(curve) > 1:
                    ordered = curve.sort_values("bytes_share")
                    panel.plot(ordered.bytes_share, ordered.share_found, color=COLOURS[name], lw=0.8, alpha=0.5)
            interactive.add_scatter(
                x=group.bytes_share, y=group.share_found, mode="markers", name=name, legendgroup=name,
                showlegend=col == 1, marker=dict(color=COLOURS[name], size=10, symbol="star" if name == "full" else 0),
                error_y=dict(type="data", symmetric=False, array=errors[1], arrayminus=errors[0]), text=group.short,
                customdata=np.stack([group.label, group.found, group.asked, group.kv_bytes / 2**20], axis=-1),
                hovertemplate="%{text}<br>%{customdata[0]}<br>bytes %{x:.3f} of the full cache's "
                              "(%{customdata[3]:.2f} MiB)<br>found %{customdata[1]} of %{customdata[2]}<extra></extra>",
                row=1, col=col)
        for row, lift in zip(part.itertuples(), _label_lifts(part), strict=True):
            panel.annotate(row.short, (row.bytes_share, row.share_found), fontsize=6.5, xytext=(4, 3 - 8 * lift),
                           textcoords="offset points", color=COLOURS[row.axis])
        panel.set_xscale("log")
        panel.set_xlim(right=1.6)  # room for the full cache's label
        panel.set_title(mode, fontsize=10)
        panel.set_xlabel("KV bytes held, share of the full cache's (mean over needles; log scale)")
        panel.set_ylim(-0.15, 1.05)  # room for the labels of points at 0
        panel.grid(alpha=0.3)
        interactive.update_xaxes(type="log", title_text="KV bytes held, share of the full cache's", row=1, col=col)
    panels[0].set_ylabel("share of needles found (Wilson 95%)")
    handles, names = panels[0].get_legend_handles_labels()
    figure.legend(handles, names, title="axis", fontsize=8, loc="outside right center")
    figure.suptitle(title, fontsize=10)
    interactive.update_yaxes(title_text="share of needles found", range=[-0.05, 1.05], row=1, col=1)
    interactive.update_layout(title=title, height=600, width=650 * len(modes), legend_title_text="axis")
    png = write_png(figure, stem.with_suffix(".png"))
    return [png, write_html(interactive, stem.with_suffix(".html"))]


def draw(data_dir, figures_dir) -> list[Path]:
    """SUMMARY in data_dir and the figure in figures_dir, from TABLE (nothing where it is missing)."""
    path = Path(data_dir) / TABLE
    if not path.is_file():
        return []
    table = read_table(path)
    summary(table).to_csv(Path(data_dir) / SUMMARY, index=False, float_format="%.6g")
    return score_bytes_figure(table, Path(figures_dir) / FIGURE)


def recompute(options: dict) -> None:
    """Run (resume) the study for options' model into its data folder: the dev needles, `samples` per depth."""
    from ..core.models import load_model
    from .score_bytes import study

    model, tokenizer = load_model(options.get("model"))
    study(model, tokenizer, options.get("data_dir", "data"), samples=options.get("samples") or SAMPLES)


register(FigureSet(name="score-bytes", recompute=recompute, draw=draw, recompute_by_default=False))
