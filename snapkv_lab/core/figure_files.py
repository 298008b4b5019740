"""Figure files and figure sets: how every figure of the lab is written, and where.

A figure set is a pair of functions: `recompute(options)` runs the model and writes its tables into data/,
`draw(data_dir, figures_dir)` reads them and writes PNG (for papers) and HTML (plotly) files. The modules of the
studies register their sets at import (`register`); `snapkv-lab figures` (app.figure_sets) draws them all.

Each model has its own tables and figures: the default model's (SmolLM2) in data/ and figures/, any other's in
data/<model>/ and figures/<model>/ (`model_folders`), so that a run on one model never overwrites another's.
Every model shares the prompt recipes of data/prompt_recipes.json.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass
class FigureSet:
    name: str
    # options (model, samples, observation window and segment sizes, data_dir, ...) -> writes tables
    recompute: Callable[[dict], None]
    draw: Callable[[Path, Path], list[Path]]  # (data_dir, figures_dir) -> files written
    # False for a set whose recompute takes far longer than the rest (the needle grid): a plain
    # `--recompute` then redraws it from its committed tables, and naming it in `only` reruns it.
    recompute_by_default: bool = True


FIGURE_SETS: dict[str, FigureSet] = {}


def write_html(figure, path: Path) -> Path:
    """A plotly figure as a small HTML page that renders offline: plotly.js is written once beside it
    (plotly.min.js in the same folder, loaded by a relative script tag; no CDN, which leaves a blank page
    without network). A page in a folder whose parent already holds plotly.min.js (a model's figures/<model>/)
    loads that one, ../plotly.min.js, instead of a second 4.6 MiB copy. The div id is the file's name, not a random
    one, so that redrawing unchanged tables leaves the file unchanged."""
    shared = Path(path).parent.parent / "plotly.min.js"
    figure.write_html(path, include_plotlyjs="../plotly.min.js" if shared.is_file() else "directory",
                      div_id=Path(path).stem)
    return Path(path)


def write_png(figure, path: Path, dpi: int = 110) -> Path:
    """A matplotlib figure as a PNG of at most 256 colours, a third of the size of matplotlib's RGBA file: the
    committed figures travel with every copy of the tree (the device machine takes 64 MiB in all). Pillow's
    maximum-coverage palette, not its median cut, which merged a thin line's few pixels into a neighbouring colour
    (up to 108 of 255 off); on the project's figures no pixel moves more than 21 of 255 in any channel."""
    import io

    from PIL import Image

    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi)
    image = Image.open(buffer).convert("RGB")
    image.quantize(256, method=Image.Quantize.MAXCOVERAGE, dither=Image.Dither.NONE).save(path, optimize=True)
    return Path(path)


def register(figure_set: FigureSet) -> FigureSet:
    FIGURE_SETS[figure_set.name] = figure_set
    return figure_set


def folder_name(model: str) -> str:
    """A model's name as one folder name: a local folder's own name, a Hugging Face id with "--" for "/" (as in the
    hub's own cache)."""
    if Path(str(model)).is_dir():
        return Path(str(model)).resolve().name
    return str(model).strip("/").replace("/", "--")


def model_folders(data_dir, figures_dir, model: str | None) -> tuple[Path, Path]:
    """(tables folder, figures folder) of `model`: data_dir and figures_dir themselves for the default model (None
    or its name), else data_dir/<model> and figures_dir/<model> (bundled models by their short names, local folders by
    their own names: see folder_name)."""
    from .models import DEFAULT_MODEL, model_name

    name = model_name(model)
    if name == DEFAULT_MODEL:
        return Path(data_dir), Path(figures_dir)
    return Path(data_dir) / folder_name(name), Path(figures_dir) / folder_name(name)


def model_data_folders(data_dir) -> list[str]:
    """Names of the other models' folders in data_dir: subfolders holding tables (CSV)."""
    data_dir = Path(data_dir)
    return (sorted(d.name for d in data_dir.iterdir() if d.is_dir() and any(d.glob("*.csv")))
            if data_dir.is_dir() else [])
