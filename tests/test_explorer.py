"""The explorer draws the trace's own attention: exact at full zoom, plain block maxima when pooled; its widget
and Python state agree; a saved trace opens lazily, reading only the layers drawn."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import ByteTokenizer, make_tiny_llama

from snapkv_lab import capture
from snapkv_lab.core.trace import AttentionTrace, LazyLayers
from snapkv_lab.views.explorer import explore


@pytest.fixture(scope="module")
def trace():
    return capture(make_tiny_llama(), ByteTokenizer(), torch.arange(300) % 240 + 3, max_new_tokens=8, stop_at_eos=False,
                   progress=False)


def test_full_zoom_shows_exact_attention_and_tokens(trace):
    ex = explore(trace, layer=1, head=2, max_cells=64, progress=False)
    assert ex.block == 8 and ex.drawn().shape == (39, 39)  # 308 tokens in 8-token blocks
    ex.zoom(rows=slice(250, 300), cols=slice(200, 260))
    assert ex.block == 1
    np.testing.assert_allclose(ex.drawn(), trace.attention(1, heads=2, queries=slice(250, 300),
                                                           keys=slice(200, 260))[0].numpy(), atol=1e-6)
    axis = ex.figure().layout.xaxis
    assert list(axis.tickvals) == list(range(200, 260)) and axis.ticktext[0] == f"200 {trace.tokens[200]}"


def test_pooled_views_are_block_maxima_and_means(trace):
    ex = explore(trace, layer=0, head="mean", max_cells=40, progress=False).zoom(rows=slice(100, 308),
                                                                                 cols=slice(0, 200))
    tile = ex.tile
    exact = trace.attention(0).mean(0)[tile.rows.start:tile.rows.stop, tile.cols.start:tile.cols.stop]
    expected_max = F.max_pool2d(exact[None, None], tile.block, ceil_mode=True)[0, 0]
    np.testing.assert_allclose(ex.drawn(), expected_max.numpy(), atol=1e-6)
    counts = F.avg_pool2d(torch.ones_like(exact)[None, None], tile.block, ceil_mode=True, divisor_override=1)[0, 0]
    sums = F.avg_pool2d(exact[None, None], tile.block, ceil_mode=True, divisor_override=1)[0, 0]
    np.testing.assert_allclose(ex.show(stat="mean").drawn(), (sums / counts).numpy(), atol=1e-6)
    assert "mean over 8 x 8-token blocks" in ex.figure().layout.title.text


def test_kept_strip_is_the_kept_share_of_each_block(trace):
    torch.manual_seed(1)
    kept = [torch.randperm(trace.prompt_len)[:70].reshape(1, 1, 70).expand(1, trace.n_kv_heads, 70).clone()
            for _ in trace.layers]
    kept[1][0, 1] = torch.arange(70)  # KV head 1 keeps the first 70 positions
    ex = explore(trace, layer=1, head=3, kept=kept, max_cells=64, progress=False)  # head 3 reads KV head 1
    strip = ex.figure().data[1]
    mask = torch.zeros(trace.n_tokens)
    mask[:70] = 1
    expected = F.avg_pool1d(mask[None, None], 8, ceil_mode=True)[0, 0] * 8 / torch.tensor(
        [min(8, trace.n_tokens - s) for s in range(0, trace.n_tokens, 8)])
    np.testing.assert_allclose(np.asarray(strip.z[0]), expected.numpy(), atol=1e-6)
    assert ex.show(kept=False).figure().data[1].visible is False
    with pytest.raises(ValueError, match="no kept positions"):
        explore(trace, progress=False).show(kept=True)


def test_widget_follows_zoom_pickers_and_clicks(trace):
    ex = explore(trace, layer=0, head=0, max_cells=64, spans={"question": (280, 300)}, progress=False)
    widget = ex.widget
    figure = ex._figure
    with figure.batch_update():  # what a drag in the browser sends: both ranges at once
        figure.layout.xaxis.range = [9.5, 49.5]
        figure.layout.yaxis.range = [89.5, 39.5]
    assert (ex.tile.rows, ex.tile.cols, ex.block) == (range(40, 90), range(10, 50), 1)
    np.testing.assert_allclose(np.asarray(figure.data[0].z), ex.drawn())
    assert figure.layout.xaxis.ticktext[0] == f"10 {trace.tokens[10]}"
    ex._layer_picker.value = 1
    assert ex.layer == 1 and ex.tile.rows == range(40, 90)
    ex._head_picker.value = "mean"
    np.testing.assert_allclose(ex.drawn(),
                               trace.attention(1, queries=slice(40, 90), keys=slice(10, 50)).mean(0).numpy(),
                               atol=1e-6)
    ex.click(301)
    assert ex.spotlit == 301 and "token 301" in ex._spotlight.value
    names = {shape.name for shape in figure.layout.shapes}
    assert {"observation window", "sinks", "question"} <= names
    ex._toggles["sinks"].value = False
    assert "sinks" not in {shape.name for shape in figure.layout.shapes}
    assert widget is ex.widget


def test_heads_grid_opens_the_clicked_head(trace):
    ex = explore(trace, layer=0, head=0, progress=False)
    ex.widget._repr_mimebundle_()
    ex._mode.value = "heads grid"
    grid = ex.heads_grid()
    assert ex.widget.children[1].children == (grid.widget,)
    assert len(grid.table) == trace.n_layers * trace.n_heads
    grid.select(1, 3)  # what a click on the cell does
    assert (ex.layer, ex.head, ex._mode.value) == (1, 3, "map")
    np.testing.assert_allclose(ex.drawn(), explore(trace, layer=1, head=3, progress=False).drawn())


def test_bad_state_is_refused(trace):
    with pytest.raises(ValueError, match="was not captured"):
        explore(trace, layer=9, progress=False)
    ex = explore(trace, progress=False)
    with pytest.raises(ValueError, match="head must be"):
        ex.select(head=trace.n_heads)
    with pytest.raises(ValueError, match="unknown overlays"):
        ex.show(needle=True)
    with pytest.raises(ValueError, match="outside the trace"):
        ex.click(trace.n_tokens)


def test_a_saved_trace_opens_lazily(trace, tmp_path):
    path = trace.save(tmp_path / "trace.safetensors")
    lazy = AttentionTrace.load(path, lazy=True)
    assert isinstance(lazy.queries, LazyLayers) and lazy.queries._loaded == {}
    assert (lazy.n_heads, lazy.n_kv_heads, lazy.head_dim) == (trace.n_heads, trace.n_kv_heads, trace.head_dim)
    ex = explore(path, layer=1, head=2, progress=False)
    assert list(ex.trace.queries._loaded) == [1] and list(ex.trace.keys._loaded) == [1]  # only the layer drawn
    np.testing.assert_allclose(ex.drawn(), explore(trace, layer=1, head=2, progress=False).drawn())


def test_saved_tiles_open_every_head_without_its_pass(trace, tmp_path):
    from snapkv_lab.views.tiles import AttentionTiles

    path = AttentionTiles(trace, progress=False).precompute(layers=[1]).save(tmp_path / "tiles.safetensors")
    ex = explore(trace, layer=1, head=3, tiles=path, progress=False)
    assert ex.tiles._stored and (1, 3) in ex.tiles._bases  # read from the file, not recomputed
    np.testing.assert_allclose(ex.drawn(), explore(trace, layer=1, head=3, progress=False).drawn())


def test_html_export_holds_the_overview_and_zoom_levels(trace, tmp_path):
    ex = explore(trace, layer=1, head=0, max_cells=64, progress=False)
    path = ex.to_html(tmp_path / "view.html")
    page = path.read_text()
    assert "snapkv-lab-trace-view" in page and "overview" in page and "zoom 1" in page
    assert '<script src="http' not in page and "plotly.js v" in page  # plotly.js is inlined: it opens offline
    assert ex.tile.rows == range(trace.n_tokens)  # exporting leaves the view where it was


def test_positions_and_heads_come_in_any_usual_form(trace):
    ex = explore(trace, layer=np.int64(1), head=torch.tensor(2), progress=False)
    expected = trace.attention(1, heads=2, queries=slice(250, 300), keys=slice(200, 260))[0].numpy()
    for rows, cols in ((slice(250, 300), slice(200, 260)), (range(250, 300), range(200, 260)),
                       ((250, 300), (200, 260))):
        np.testing.assert_allclose(ex.zoom(rows=rows, cols=cols).drawn(), expected, atol=1e-6)
    with pytest.raises(TypeError, match="consecutive"):
        ex.zoom(rows=[1, 5, 9])


def test_causal_strip_is_each_blocks_span_effect(trace):
    from snapkv_lab import span_effects

    ids = trace.token_ids[:trace.prompt_len][None]
    effects = span_effects(make_tiny_llama(), ByteTokenizer(), ids[:, :256], ids[:, 256:], block=64, max_new_tokens=2,
                           progress=False)
    ex = explore(trace, layer=1, head=0, effects=effects, max_cells=64, progress=False)  # 8-token blocks
    strip = np.asarray(ex.figure().data[1].z[0], dtype=float)
    per_position = np.repeat(effects.kl.to_numpy(), 64)  # blocks of 64 = 8 drawn blocks of 8 each
    np.testing.assert_allclose(strip[:32], per_position.reshape(32, 8).mean(1))
    assert np.isnan(strip[32:]).all()  # the question and the generated tokens are in no span
    assert ex.figure().layout.yaxis3.visible and ex.show(effects=False).figure().data[1].visible is False
    delta = explore(trace, layer=1, effects=effects, effect="logprob_delta", max_cells=64, progress=False)
    assert delta.figure().data[1].colorscale[0][1] != ex.figure().data[1].colorscale[0][1]  # diverging scale
    with pytest.raises(ValueError, match="lacks"):
        explore(trace, effects=effects.drop(columns="kl"), progress=False)
    with pytest.raises(ValueError, match="another prompt"):
        explore(trace, effects=effects.assign(end=effects.end + 400), progress=False)
    with pytest.raises(ValueError, match="no span effects"):
        explore(trace, max_cells=64, progress=False).show(effects=True)
