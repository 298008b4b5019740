"""Figures of the retrieval-head tables (the figure set "heads"): the layer x head grid of Wu et al.'s retrieval
score, as an interactive page (`heads.heads_grid_figure`) and a PNG."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from ..core.figure_files import write_html, write_png
from ..policies.retrieval_heads import layer_head_grid
from ..views.heads import heads_grid_figure


def draw_retrieval_heads(table: pd.DataFrame, figures_dir: Path) -> list[Path]:
    """figures_dir/retrieval_heads.html and .png from a `retrieval_heads` table; returns the paths."""
    from matplotlib.figure import Figure

    figures_dir.mkdir(parents=True, exist_ok=True)
    html = write_html(heads_grid_figure(table, "retrieval_score"), figures_dir / "retrieval_heads.html")
    grid = layer_head_grid(table, "retrieval_score")
    layers, heads = grid.shape
    figure = Figure(figsize=(max(6.5, 2.5 + 0.45 * heads), 2 + 0.18 * layers))
    axes = figure.subplots()
    image = axes.imshow(np.ma.masked_invalid(grid.to_numpy(dtype=float)), aspect="auto", origin="lower", cmap="viridis",
                        vmin=0, vmax=max(1.0, float(np.nanmax(grid.to_numpy(dtype=float), initial=0.0))),
                        interpolation="nearest")
    axes.set_xticks(range(heads), [str(h) for h in grid.columns])
    axes.set_yticks(range(0, layers, max(1, layers // 10)))
    axes.set_xlabel("query head (heads sharing a KV head are adjacent)")
    axes.set_ylabel("layer")
    figure.colorbar(image, ax=axes, label="retrieval score")
    scored = int((grid.to_numpy(dtype=float) > 0).sum())
    axes.set_title(f"Retrieval heads (Wu et al.): the share of copy steps whose\ntop-attended key is the copied token; "
                   f"{int(table.prompts.iloc[0])} needle prompts answered,\n"
                   f"{int(table.copy_steps.iloc[0])} copy steps; {scored} of {layers * heads} heads score above 0",
                   fontsize=9)
    figure.tight_layout()
    png = figures_dir / "retrieval_heads.png"
    write_png(figure, png, dpi=100)
    return [html, png]


def draw_head_types(table: pd.DataFrame, figures_dir: Path) -> Path:
    """figures_dir/findings_b_head_types.png from `head_types.findings_by_head_type`: per split, each metric and sinks
    rule for retrieval heads and the others, with 95% intervals over prompts and the chance level."""
    from matplotlib.figure import Figure

    splits = sorted(table.split.unique())
    groups = table[["metric", "sinks"]].drop_duplicates().sort_values(["metric", "sinks"]).itertuples(index=False)
    groups = list(groups)
    figure = Figure(figsize=(11, 3.6 * len(splits)))
    for row, (split, axes) in enumerate(zip(splits, figure.subplots(len(splits), 1, squeeze=False)[:, 0])):
        part = table[table.split == split].set_index(["head_type", "metric", "sinks"])
        for offset, (kind, colour) in zip((-0.18, 0.18), (("retrieval", "tab:red"), ("other", "tab:blue"))):
            cells = [part.loc[(kind, g.metric, g.sinks)] for g in groups]
            x = np.arange(len(groups)) + offset
            value = np.array([c.value for c in cells])
            errors = np.array([[c.value - c.ci_low for c in cells], [c.ci_high - c.value for c in cells]])
            heads = int(cells[0].n_heads)
            axes.bar(x, value, width=0.34, color=colour, alpha=0.75, label=f"{kind} heads ({heads})")
            axes.errorbar(x, value, yerr=errors, fmt="none", ecolor="black", capsize=3, linewidth=1)
            axes.scatter(x, [c.chance for c in cells], marker="_", s=300, color="black",
                         label="chance" if kind == "retrieval" else None, zorder=3)
        axes.set_xticks(range(len(groups)), [f"{g.metric}\nsinks {g.sinks}" for g in groups])
        axes.set_ylim(0, 1.05)
        axes.set_ylabel("value")
        axes.set_title(f"{split} prompts", fontsize=10)
        if row == 0:
            axes.legend(loc="lower left", fontsize=8)
    figure.suptitle("Finding (b) by head type: SnapKV's window selection vs the generation's attention, retrieval "
                    "heads (score > 0.1) and the others\n95% intervals over prompts; the difference is paired over "
                    "the same prompts (docs/explorer.md)", fontsize=10)
    figure.tight_layout()
    path = figures_dir / "findings_b_head_types.png"
    write_png(figure, path, dpi=100)
    return path
