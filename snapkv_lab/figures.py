"""`snapkv-lab figures`: every figure of the project, drawn from the tidy tables saved in data/.

A figure set is a pair of functions: `recompute(options)` runs the model and writes its tables into
data/, `draw(data_dir, figures_dir)` reads them and writes PNG (for papers) and HTML (plotly) files.
Modules register their sets at import; `make_figures` draws them all, recomputing first if asked.
"""

from __future__ import annotations

import importlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# The figure sets by name: the module whose import registers the set (it calls `register`) and what the set
# draws. A plain table, so that `snapkv-lab figures --help` lists the names without importing torch.
FIGURE_MODULES = {
    "findings": ("snapkv_lab.experiments", "the paper's four observations (a)-(d), generated and teacher-forced"),
    "pressure": ("snapkv_lab.pressure", "needle grid heatmaps, accuracy vs budget, RULER-style suite, lines ablation"),
}


@dataclass
class FigureSet:
    name: str
    recompute: Callable[[dict], None]  # options (model, samples, window sizes, data_dir, ...) -> writes tables
    draw: Callable[[Path, Path], list[Path]]  # (data_dir, figures_dir) -> files written
    # False for a set whose recompute takes far longer than the rest (the needle grid): a plain
    # `--recompute` then redraws it from its committed tables, and naming it in `only` reruns it.
    recompute_by_default: bool = True


FIGURE_SETS: dict[str, FigureSet] = {}


def write_html(figure, path: Path) -> Path:
    """A plotly figure as a small HTML page that renders offline: plotly.js is written once beside it
    (plotly.min.js in the same folder, loaded by a relative script tag; no CDN, which leaves a blank page
    without network). The div id is the file's name, not a random one, so that redrawing unchanged tables
    leaves the file unchanged."""
    figure.write_html(path, include_plotlyjs="directory", div_id=Path(path).stem)
    return Path(path)


def register(figure_set: FigureSet) -> FigureSet:
    FIGURE_SETS[figure_set.name] = figure_set
    return figure_set


def load_figure_sets() -> dict[str, FigureSet]:
    for module, _ in FIGURE_MODULES.values():
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as err:
            if err.name != module:  # a real missing dependency, not a module not written yet
                raise
    return FIGURE_SETS


def make_figures(data_dir="data", figures_dir="figures", *, recompute: bool = False, only=None,
                 options: dict | None = None) -> list[Path]:
    """Draw every registered figure set (or those named in `only`); recompute their tables first if asked.

    With recompute, a set with recompute_by_default=False is rerun only when `only` names it.
    """
    sets = load_figure_sets()
    unknown = set(only or []) - set(sets)
    if unknown:
        raise ValueError(f"unknown figure sets {sorted(unknown)}; known: {sorted(sets)}")
    data_dir, figures_dir = Path(data_dir), Path(figures_dir)
    figures_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, figure_set in sets.items():
        if only and name not in only:
            continue
        if recompute and (figure_set.recompute_by_default or name in (only or [])):
            figure_set.recompute({**(options or {}), "data_dir": data_dir})
        elif recompute:
            print(f"{name}: redrawn from its tables in {data_dir}/ (its recompute is long: name it to rerun, "
                  f"--recompute --only {name})", file=sys.stderr)
        # Drawing every set takes tens of seconds: say so, rather than go silent at the end of a long run.
        print(f"{name}: drawing its figures into {figures_dir}/ ...", file=sys.stderr, flush=True)
        began = time.perf_counter()
        files = figure_set.draw(data_dir, figures_dir)
        print(f"{name}: {len(files)} files in {time.perf_counter() - began:.0f} s", file=sys.stderr, flush=True)
        written += files
    return written
