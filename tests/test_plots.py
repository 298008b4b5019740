"""Notebook views of a trace: what they draw is the trace's own attention, reduced only by block maxima."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import ByteTokenizer, make_tiny_llama

from snapkv_lab import capture
from snapkv_lab.views import plots


@pytest.fixture(scope="module")
def trace():
    return capture(make_tiny_llama(), ByteTokenizer(), torch.arange(3, 83), max_new_tokens=6, stop_at_eos=False,
                   progress=False)


def test_block_max_keeps_every_maximum():
    matrix = torch.rand(10, 7)
    pooled, rows, cols = plots.block_max(matrix, 4, 3)
    assert (rows, cols) == (3, 3) and pooled.shape == (4, 3)
    assert float(pooled[1, 2]) == float(matrix[3:6, 6:7].max())
    assert float(pooled.max()) == float(matrix.max())


def test_heatmap_shows_the_trace_attention(trace):
    small = plots.attention_heatmap(trace, 1, 2)  # 86 tokens: no pooling
    torch.testing.assert_close(torch.tensor(small.data[0].z), trace.attention(1, heads=2)[0])
    pooled = plots.attention_heatmap(trace, 1, 2, max_cells=20)
    assert torch.tensor(pooled.data[0].z).shape == (18, 18) and "max over 5 x 5 blocks" in pooled.layout.title.text


def test_window_attention_is_the_mean_window_row(trace):
    window = plots.window_attention(trace, window=8)
    start = trace.prompt_len - 8
    expected = trace.attention(0, queries=slice(start, trace.prompt_len), keys=slice(0, start)).mean(dim=(0, 1))
    torch.testing.assert_close(window[0], expected)
    with pytest.raises(ValueError, match="leaves no prompt"):
        plots.window_attention(trace, window=trace.prompt_len)


def test_spotlight_lists_the_most_attended_tokens(trace):
    query = trace.prompt_len
    weights = plots.token_attention(trace, query)
    top = int(torch.argmax(weights[1:])) + 1
    page = plots.spotlight(trace, query, top=3).data
    assert f"{top:>6} " in page and page.count("darkorange") == 3


def test_spotlight_opens_on_its_top_tokens(trace):
    """The first box holds the top tokens with their context only, so they are in view; the whole prompt follows."""
    query = trace.prompt_len
    weights = plots.token_attention(trace, query)
    top = (torch.argsort(weights[1:], descending=True)[:3] + 1).tolist()
    page = plots.spotlight(trace, query, top=3, context=2).data
    excerpts, whole = page.split("<details>")
    shown = [int(i) for i in re.findall(r'<span title="(\d+): ', excerpts)]
    assert set(top) <= set(shown) and len(shown) <= 3 * 5 and shown == sorted(shown)
    assert all(any(abs(i - t) <= 2 for t in top) for i in shown)  # nothing but the context of the top tokens
    assert [int(i) for i in re.findall(r'<span title="(\d+): ', whole)] == list(range(trace.prompt_len))
    assert "<details>" not in plots.spotlight(trace, query, top=3, context=None).data
