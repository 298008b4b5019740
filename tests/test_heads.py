"""head_table against plain loops over transformers' eager attention maps, a hand-built trace whose retrieval score
is known exactly, and the grid: its z is the table's column and a selected cell reaches on_select."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import ByteTokenizer, make_tiny_llama
from plotly.callbacks import Points
from reference import eager_maps

from snapkv_lab import capture
from snapkv_lab.core.attention import AttentionSettings
from snapkv_lab.core.trace import AttentionTrace
from snapkv_lab.views import heads
from snapkv_lab.views.heads import head_table, heads_grid, heads_grid_figure

OPTIONS = dict(sinks=4, local=16, obs_window=32, capacity=0.05)


@pytest.fixture(scope="module")
def model():
    return make_tiny_llama(initializer_range=0.3)


def traced(model, prompt, **options):
    """A trace and its eager maps, per layer (heads, n, n) as nested lists."""
    trace = capture(model, ByteTokenizer(), prompt, stop_at_eos=False, progress=False, **options)
    return trace, [m.tolist() for m in eager_maps(model, trace.token_ids)]


@pytest.fixture(scope="module")
def tiny(model):
    """A greedy trace of a 200-token prompt and 24 generated tokens."""
    return traced(model, torch.arange(3, 203), max_new_tokens=24)


@pytest.fixture(scope="module")
def few_tokens(model):
    """200 prompt tokens and 24 teacher-forced ones, all drawn from 4 token ids: a random head's top key often
    holds the emitted token, so retrieval hits happen (a greedy random model copies, but never by attention)."""
    ids = torch.randint(3, 7, (224,), generator=torch.Generator().manual_seed(0))
    return traced(model, ids[:200], continuation=ids[200:])


def plain_shares(attn, rows, sinks, local):
    """[(sink_share, locality)] per head, one row and one key at a time."""
    out = []
    for head in attn:
        sink = sum(sum(head[p][k] for k in range(sinks)) for p in rows) / len(rows)
        near = sum(sum(head[p][k] for k in range(max(0, p - local + 1), p + 1)) for p in rows) / len(rows)
        out.append((sink, near))
    return out


def plain_window_recall(attn, prompt_len, n, obs_window, capacity):
    """[recall] per head: top-k of plain vote sums, then each generated row's share of its prefix mass on them."""
    prefix = prompt_len - obs_window
    k = max(1, math.floor(capacity * prefix))
    out = []
    for head in attn:
        votes = [sum(head[r][p] for r in range(prefix, prompt_len)) for p in range(prefix)]
        kept = sorted(range(prefix), key=votes.__getitem__, reverse=True)[:k]
        shares = [sum(head[r][p] for p in kept) / sum(head[r][:prefix]) for r in range(prompt_len, n)]
        out.append(sum(shares) / len(shares))
    return out


def plain_retrieval(attn, ids, prompt_len, span):
    """(copy steps, [hits] per head): row r emits ids[r + 1]; a hit is an argmax key in the span holding it."""
    start, end = span
    steps, hits = 0, [0] * len(attn)
    for r in range(prompt_len - 1, len(ids) - 1):
        if ids[r + 1] not in ids[start:end]:
            continue
        steps += 1
        for h, head in enumerate(attn):
            top = max(range(r + 1), key=head[r].__getitem__)
            hits[h] += start <= top < end and ids[top] == ids[r + 1]
    return steps, hits


@pytest.mark.parametrize("span", [None, (100, 200)])
@pytest.mark.parametrize("which", ["tiny", "few_tokens"])
def test_every_column_matches_plain_loops_over_eager_attention(request, which, span):
    trace, maps = request.getfixturevalue(which)
    table = head_table(trace, span=span, **OPTIONS)
    ids = trace.token_ids.tolist()
    generated = range(trace.prompt_len, trace.n_tokens)
    assert list(table.columns) == heads.COLUMNS and len(table) == trace.n_layers * trace.n_heads
    assert list(zip(table.layer, table["head"])) == [(layer, h) for layer in trace.layers for h in range(trace.n_heads)]
    assert (table.kv_head == table["head"] // 2).all() and (table.rows == trace.n_generated).all()
    for layer, attn in zip(trace.layers, maps):
        mine = table[table.layer == layer]
        shares = plain_shares(attn, generated, OPTIONS["sinks"], OPTIONS["local"])
        np.testing.assert_allclose(mine.sink_share, [s for s, _ in shares], atol=1e-5)
        np.testing.assert_allclose(mine.locality, [near for _, near in shares], atol=1e-5)
        recall = plain_window_recall(attn, trace.prompt_len, trace.n_tokens, OPTIONS["obs_window"], OPTIONS["capacity"])
        np.testing.assert_allclose(mine.window_recall, recall, atol=1e-5)
        steps, hits = plain_retrieval(attn, ids, trace.prompt_len, span or (0, trace.prompt_len))
        assert steps > 0 and (mine.copy_steps == steps).all()
        assert mine.retrieval_hits.tolist() == hits and (which == "tiny" or sum(hits) > 0)
        np.testing.assert_allclose(mine.retrieval_score, np.array(hits) / steps)


def test_given_and_default_prompt_rows(tiny, monkeypatch):
    """Scattered rows, blocks cut small (many pieces), and a prompt-only trace averaging its last prompt rows."""
    trace, maps = tiny
    monkeypatch.setattr(heads, "BLOCK_ELEMENTS", 4 * 3 * 40)  # pieces of a few rows, however the rows lie
    scattered = [2, 5, 90, 91, 150, 221]
    table = head_table(trace, queries=scattered, **OPTIONS)
    assert (table.rows == len(scattered)).all()
    for layer, attn in zip(trace.layers, maps):
        shares = plain_shares(attn, scattered, OPTIONS["sinks"], OPTIONS["local"])
        np.testing.assert_allclose(table[table.layer == layer][["sink_share", "locality"]], shares, atol=1e-5)
        recall = plain_window_recall(attn, trace.prompt_len, trace.n_tokens, OPTIONS["obs_window"], OPTIONS["capacity"])
        np.testing.assert_allclose(table[table.layer == layer].window_recall, recall, atol=1e-5)

    n = trace.prompt_len
    prompt_only = AttentionTrace(token_ids=trace.token_ids[:n], tokens=trace.tokens[:n], prompt_len=n,
                                 queries=[q[:, :n] for q in trace.queries], keys=[k[:, :n] for k in trace.keys],
                                 attention_settings=trace.attention_settings, layers=trace.layers)
    monkeypatch.setattr(heads, "PROMPT_ROWS", 50)
    table = head_table(prompt_only, **OPTIONS)
    assert (table.rows == 50).all() and (table.copy_steps == 0).all() and (table.retrieval_hits == 0).all()
    assert table.window_recall.isna().all() and table.retrieval_score.isna().all()
    for layer, attn in zip(trace.layers, maps):
        shares = plain_shares(attn, range(n - 50, n), OPTIONS["sinks"], OPTIONS["local"])
        np.testing.assert_allclose(table[table.layer == layer][["sink_share", "locality"]], shares, atol=1e-5)


def hand_built_trace() -> AttentionTrace:
    """One layer, 2 heads on 1 KV head; key p is the unit vector e_p, so a query 50 * e_t attends to key t alone
    (the rest share about 1e-21). Prompt 1 5 20 21 22 6 7 8, generated 20 21 9 20: rows 7, 8, 9, 10 emit
    20, 21, 9, 20. Head 0 looks at the copied token at rows 7 and 8, and at token 5 at row 10; head 1 looks at
    the sink (row 7), at 20 in the needle while 21 is emitted (row 8), at the emitted 20 at a generated position
    (row 10): no hit."""
    ids = [1, 5, 20, 21, 22, 6, 7, 8, 20, 21, 9, 20]
    n = len(ids)
    targets = [[0] * n, [0] * n]
    targets[0][7], targets[0][8], targets[0][10] = 2, 3, 1
    targets[1][7], targets[1][8], targets[1][10] = 0, 2, 8
    queries = 50 * torch.eye(n)[torch.tensor(targets)]  # (heads, n, n)
    return AttentionTrace(token_ids=torch.tensor(ids), tokens=[str(i) for i in ids], prompt_len=8, queries=[queries],
                          keys=[torch.eye(n)[None]], attention_settings=[AttentionSettings(scaling=1.0)], layers=[0])


@pytest.mark.parametrize("span, steps, hits, per_step, per_span", [
    ((2, 6), 3, [2, 0], [2 / 3, 0], [2 / 4, 0]),  # the needle 20 21 22 6: rows 7, 8, 10 copy
    (None, 3, [2, 0], [2 / 3, 0], [2 / 8, 0]),  # the whole prompt: 9 is no copy
    ((3, 5), 1, [1, 0], [1, 0], [1 / 2, 0]),  # 21 22: only row 8 copies
    ((5, 8), 0, [0, 0], [math.nan, math.nan], [0, 0]),  # 6 7 8: nothing copied
])
def test_retrieval_score_of_a_hand_built_trace(span, steps, hits, per_step, per_span):
    trace = hand_built_trace()
    table = head_table(trace, span=span, sinks=1, local=3)
    assert (table.copy_steps == steps).all() and table.retrieval_hits.tolist() == hits
    np.testing.assert_allclose(table.retrieval_score, per_step)
    np.testing.assert_allclose(head_table(trace, span=span, retrieval_norm="span").retrieval_score, per_span)
    # Generated rows 8..11 of head 1 look at 2, 0, 8, 0: half on the sink, one in its last 3 keys (row 10 at 8).
    assert table.sink_share[1] == pytest.approx(0.5) and table.locality[1] == pytest.approx(0.25)
    assert table.window_recall.isna().all()  # 4 generated rows, a prompt shorter than the observation window


def test_options_are_checked(tiny):
    trace, _ = tiny
    with pytest.raises(ValueError, match="not a non-empty range of prompt positions"):
        head_table(trace, span=(100, trace.prompt_len + 1))
    with pytest.raises(ValueError, match="retrieval_norm must be one of"):
        head_table(trace, retrieval_norm="needle")
    with pytest.raises(ValueError, match="local and obs_window >= 1"):
        head_table(trace, local=0)


@pytest.fixture(scope="module")
def table(tiny):
    return head_table(tiny[0], **OPTIONS)


def test_figure_z_is_the_table_column(table):
    for metric in heads.METRICS:
        figure = heads_grid_figure(table, metric)
        expected = table.pivot(index="layer", columns="head", values=metric).to_numpy(dtype=float)
        np.testing.assert_array_equal(np.array(figure.data[0].z, dtype=float), expected)
        assert list(figure.data[0].y) == [0, 1] and list(figure.data[0].x) == [0, 1, 2, 3]
        assert figure.layout.title.text.startswith(f"{metric}: {heads.METRICS[metric]}")
        assert all(column in figure.data[0].hovertemplate for column in heads.COLUMNS[2:])
    with pytest.raises(ValueError, match="metric must be one of"):
        heads_grid_figure(table, "rows")


def test_a_retrieval_heads_table_draws_as_a_grid_and_a_figure_set(tmp_path):
    """retrieval_heads' columns (not a head_table's) draw: the page's grid is the table's score, hover names its
    columns; the "heads" figure set writes the page and a PNG from data_dir's table, and nothing without one."""
    from snapkv_lab.findings.heads_study import TABLE, draw

    layers, n_heads = 3, 4
    rng = np.random.default_rng(0)
    table = pd.DataFrame(dict(layer=np.repeat(np.arange(layers), n_heads), head=np.tile(np.arange(n_heads), layers),
                              kv_head=np.tile(np.arange(n_heads) // 2, layers), prompts=7, copy_steps=40,
                              retrieval_hits=rng.integers(0, 40, layers * n_heads)))
    table["retrieval_score"] = table.retrieval_hits / table.copy_steps
    figure = heads_grid_figure(table, "retrieval_score")
    np.testing.assert_array_equal(np.array(figure.data[0].z, dtype=float),
                                  table.retrieval_score.to_numpy().reshape(layers, n_heads))
    assert "prompts" in figure.data[0].hovertemplate and "sink_share" not in figure.data[0].hovertemplate
    assert draw(tmp_path, tmp_path / "figures") == []
    table.to_csv(tmp_path / TABLE, index=False)
    written = draw(tmp_path, tmp_path / "figures")
    assert [p.name for p in written] == ["retrieval_heads.html", "retrieval_heads.png"]
    assert all(p.stat().st_size > 1000 for p in written)


def test_grid_selects_heads_and_switches_metrics(table):
    calls = []
    grid = heads_grid(table, metric="window_recall", on_select=lambda layer, head: calls.append((layer, head)))
    assert grid.selected is None and grid.widget.children[1] is grid.figure
    grid.select(1, 3)
    assert calls == [(1, 3)] and grid.selected == (1, 3) and "layer 1, head 3" in grid.label.value
    # A click as the browser reports it: the cell's x (head) and y (layer).
    grid.figure.data[0]._dispatch_on_click(Points(point_inds=[[0, 2]], xs=[2], ys=[0], trace_index=0), None)
    assert calls[-1] == (0, 2) and grid.selected == (0, 2)
    with pytest.raises(ValueError, match="no layer 5, head 0"):
        grid.select(5, 0)
    grid.picker.value = "sink_share"
    expected = table.pivot(index="layer", columns="head", values="sink_share").to_numpy()
    np.testing.assert_array_equal(np.array(grid.figure.data[0].z, dtype=float), expected)
    assert grid.metric == "sink_share" and grid.figure.layout.title.text.startswith("sink_share")
    assert "application/vnd.jupyter.widget-view+json" in grid._repr_mimebundle_()


def test_grid_of_a_trace_computes_its_table(tiny):
    trace, _ = tiny
    grid = heads_grid(trace, metric="locality", local=8)
    np.testing.assert_array_equal(grid.table.locality, head_table(trace, local=8).locality)
    assert grid.table.attrs["options"]["local"] == 8
    with pytest.raises(TypeError, match="need a trace"):
        heads_grid(grid.table, local=8)
