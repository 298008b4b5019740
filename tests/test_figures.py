"""The figures registry: which sets `make_figures` recomputes and draws."""

import pytest

from snapkv_lab import figures  # the old path: figure_sets and figure_files together
from snapkv_lab.app.figure_sets import make_figures
from snapkv_lab.core.figure_files import FigureSet


@pytest.fixture
def fake_sets(monkeypatch, tmp_path):
    calls = []
    sets = {
        name: FigureSet(name=name, recompute=lambda options, name=name: calls.append(("recompute", name, options)),
                        draw=lambda data, out, name=name: (calls.append(("draw", name, data, out))
                                                           or [out / f"{name}.png"]),
                        recompute_by_default=name != "slow")
        for name in ("quick", "slow")
    }
    monkeypatch.setattr(figures, "load_figure_sets", lambda: sets)
    return calls


def test_plain_recompute_skips_long_sets_but_draws_them(fake_sets, tmp_path, capsys):
    written = make_figures(tmp_path, tmp_path / "figs", recompute=True, options={"samples": 2})
    assert [c[:2] for c in fake_sets] == [("recompute", "quick"), ("draw", "quick"), ("draw", "slow")]
    assert fake_sets[0][2] == {"samples": 2, "data_dir": tmp_path, "recipes_path": tmp_path / "prompt_recipes.json"}
    assert [p.name for p in written] == ["quick.png", "slow.png"]
    assert "--recompute --only slow" in capsys.readouterr().err


def test_naming_a_long_set_recomputes_it(fake_sets, tmp_path):
    make_figures(tmp_path, tmp_path, recompute=True, only=["slow"])
    assert [c[:2] for c in fake_sets] == [("recompute", "slow"), ("draw", "slow")]


def test_redraw_only_and_unknown_names(fake_sets, tmp_path):
    make_figures(tmp_path, tmp_path)
    assert [c[:2] for c in fake_sets] == [("draw", "quick"), ("draw", "slow")]
    with pytest.raises(ValueError, match="unknown figure sets"):
        make_figures(tmp_path, tmp_path, only=["nope"])


def test_each_model_has_its_own_folders_and_a_plain_redraw_draws_every_model(fake_sets, tmp_path):
    """Another model than the default recomputes into data/<model>/ and figures/<model>/ (the recipes stay the
    shared data/prompt_recipes.json); a plain redraw draws the default model's tables and every model folder's."""
    data, figs = tmp_path / "data", tmp_path / "figs"
    make_figures(data, figs, recompute=True, only=["quick"], options={"model": "gemma3-270m"})  # an alias
    assert fake_sets == [("recompute", "quick", {"model": "gemma3-270m", "data_dir": data / "gemma-3-270m",
                                                 "recipes_path": data / "prompt_recipes.json"}),
                         ("draw", "quick", data / "gemma-3-270m", figs / "gemma-3-270m")]
    fake_sets.clear()
    (data / "gemma-3-270m").mkdir(parents=True)
    (data / "gemma-3-270m" / "findings_a.csv").write_text("x\n1\n")
    (data / "cells").mkdir()  # not a model's folder: it holds no table
    make_figures(data, figs, only=["quick"])
    assert [c[2:] for c in fake_sets] == [(data, figs), (data / "gemma-3-270m", figs / "gemma-3-270m")]
    fake_sets.clear()
    make_figures(data, figs, only=["quick"], options={"model": "SmolLM2-135M-Instruct"})  # the default, by name
    assert [c[2:] for c in fake_sets] == [(data, figs)]
    assert figures.folder_name("meta-llama/Llama-3.1-8B") == "meta-llama--Llama-3.1-8B"


def test_html_figures_are_reproducible(tmp_path):
    import plotly.express as px

    figure = px.line(x=[1, 2, 3], y=[0.2, 0.5, 0.4])
    first = figures.write_html(figure, tmp_path / "a.html").read_bytes()
    assert figures.write_html(figure, tmp_path / "a.html").read_bytes() == first  # no random div id
    assert b'id="a"' in first


def test_html_figures_load_plotly_from_beside_them(tmp_path):
    """No CDN (a blank page offline): one plotly.min.js beside the pages, loaded by a relative script tag without
    integrity/crossorigin attributes (those block a local script under file://)."""
    import re

    import plotly.express as px

    for name in ("a", "b"):
        figures.write_html(px.line(x=[1, 2], y=[3, 4]), tmp_path / f"{name}.html")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.html", "b.html", "plotly.min.js"]
    page = (tmp_path / "a.html").read_text()
    assert re.findall(r"<script[^>]*src=[^>]*>", page) == ['<script charset="utf-8" src="plotly.min.js">']
    assert "cdn" not in page.lower() and "https://" not in page and len(page) < 100_000
    assert (tmp_path / "plotly.min.js").read_text().startswith("/**")  # the library itself
    # a model's folder inside it loads the parent's copy instead of writing a second one
    (tmp_path / "model").mkdir()
    figures.write_html(px.line(x=[1, 2], y=[3, 4]), tmp_path / "model" / "c.html")
    assert sorted(p.name for p in (tmp_path / "model").iterdir()) == ["c.html"]
    assert re.findall(r"<script[^>]*src=[^>]*>", (tmp_path / "model" / "c.html").read_text()) == [
        '<script charset="utf-8" src="../plotly.min.js">']


def test_png_is_a_palette_image_that_looks_like_matplotlibs(tmp_path):
    import io

    import numpy as np
    from matplotlib.figure import Figure
    from PIL import Image

    fig = Figure(figsize=(4, 3))
    ax = fig.subplots()
    ax.imshow(np.linspace(0, 1, 400).reshape(20, 20), cmap="viridis")
    ax.plot([0, 19], [0, 19], color="red", linestyle="--")
    ax.set_title("a heatmap and a line")
    path = figures.write_png(fig, tmp_path / "f.png", dpi=80)

    written = Image.open(path)
    assert written.mode == "P" and len(written.getcolors(1024)) <= 256
    reference = io.BytesIO()
    fig.savefig(reference, format="png", dpi=80)
    drawn = np.asarray(Image.open(reference).convert("RGB"), dtype=float)
    quantised = np.asarray(written.convert("RGB"), dtype=float)
    assert quantised.shape == drawn.shape
    # of 255 per channel; the max is what the red line's few pixels keep (median cut moved them 108)
    assert np.abs(quantised - drawn).mean() < 1.0 and np.abs(quantised - drawn).max() < 32
    assert path.stat().st_size < reference.getbuffer().nbytes
