"""The figure set "causal": every policy's causal coverage against its attention coverage (views.causal_study's table,
finding (e)), one panel per mode, as a PNG and an interactive page.

    snapkv-lab figures --only causal                        # redraw from data/causal_coverage.csv
    snapkv-lab figures --recompute --only causal            # rerun the study first (long: not in a plain --recompute)
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from ..core.figure_files import FigureSet, register, write_html, write_png
from ..views.causal_study import TABLE, read_table, run_study
from .causal_finding import per_policy, relation

FIGURE = "causal_coverage"


def recompute(options: dict) -> None:
    """Run (or resume) the study of options["model"] into options["data_dir"] (views.causal_study.run_study)."""
    run_study(options.get("model"), options["data_dir"])


def _title(table: pd.DataFrame, mode: str, rho: pd.DataFrame) -> str:
    row = rho.set_index("mode").loc[mode]
    return (f"{mode}: mean per-prompt Spearman {row.value:.2f} [{row.ci_low:.2f}, {row.ci_high:.2f}], "
            f"{row.verdict}")


def draw(data_dir, figures_dir) -> list[Path]:
    """figures_dir/causal_coverage.png and .html, where data_dir holds the study's table."""
    from matplotlib.figure import Figure
    from plotly.subplots import make_subplots

    data_dir, figures_dir = Path(data_dir), Path(figures_dir)
    if not (data_dir / TABLE).exists():
        return []
    table = read_table(data_dir / TABLE)
    if not table.full_correct.any():
        print(f"causal: the full cache answers none of {data_dir / TABLE}'s prompts; nothing to draw", file=sys.stderr)
        return []
    policies, rho = per_policy(table), relation(table)
    modes = [mode for mode in ("query-agnostic", "query-aware") if mode in set(policies["mode"])]
    figures_dir.mkdir(parents=True, exist_ok=True)
    figure = Figure(figsize=(6 * len(modes), 5.4))
    page = make_subplots(rows=1, cols=len(modes), subplot_titles=[_title(table, m, rho) for m in modes])
    for column, (axes, mode) in enumerate(zip(figure.subplots(1, len(modes), squeeze=False)[0], modes, strict=True)):
        part = policies[policies["mode"] == mode]
        axes.errorbar(part.attention_coverage, part.coverage,
                      xerr=[part.attention_coverage - part.attention_low,
                            part.attention_high - part.attention_coverage],
                      yerr=[part.coverage - part.coverage_low, part.coverage_high - part.coverage], fmt="o", ms=4,
                      color="#7a1f5c", ecolor="#c9a3bd", elinewidth=0.8)
        for row in part.itertuples():
            axes.annotate(row.policy.split("@")[0][:18], (row.attention_coverage, row.coverage), fontsize=6,
                          xytext=(2, 2), textcoords="offset points")
        axes.axhline(part.oracle.median(), color="#2a7a2a", lw=0.8, ls="--", label="causal oracle (median)")
        axes.axhline(part.chance.median(), color="grey", lw=0.8, ls=":", label="chance (median)")
        axes.set_xlabel("attention coverage of the kept set (answer rows over the context)")
        axes.set_ylabel("causal coverage (share of the eviction KL kept)")
        axes.set_title(_title(table, mode, rho), fontsize=8)
        axes.legend(fontsize=7, loc="lower right")
        page.add_scatter(x=part.attention_coverage, y=part.coverage, mode="markers", text=part.policy, row=1,
                         col=column + 1, name=mode,
                         error_y=dict(type="data", symmetric=False, array=part.coverage_high - part.coverage,
                                      arrayminus=part.coverage - part.coverage_low),
                         hovertemplate="%{text}<br>attention %{x:.2f}<br>causal %{y:.2f}<extra></extra>")
    figure.suptitle(f"Every policy at ratio {table.ratio.iloc[0]:g}: {table.prompt[table.full_correct].nunique()} "
                    f"answered needle prompts, {table.model.iloc[0]} (95% t intervals over prompts)", fontsize=9)
    figure.tight_layout()
    page.update_layout(height=520, showlegend=False)
    page.update_xaxes(title_text="attention coverage")
    page.update_yaxes(title_text="causal coverage")
    return [write_png(figure, figures_dir / f"{FIGURE}.png"), write_html(page, figures_dir / f"{FIGURE}.html")]


register(FigureSet(name="causal", recompute=recompute, draw=draw, recompute_by_default=False))
