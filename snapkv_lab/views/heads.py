"""Heads at a glance: per-head summary statistics of an AttentionTrace, and a layer x head grid of any of them.

    table = head_table(trace)                       # one row per (layer, query head)
    heads_grid_figure(table, "sink_share")          # plotly heatmap, layers on y, heads on x
    grid = heads_grid(trace, on_select=show)        # the same with a metric picker; a click calls show(layer, head)

Every statistic is recomputed blockwise from the trace's queries and keys (`trace.attention`, `row_topk`,
`column_sums`): no (tokens x tokens) map is ever whole, only blocks of at most `attention.BLOCK_ELEMENTS`
probabilities. The definitions are those of `head_table`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import torch

from ..core.attention import BLOCK_ELEMENTS
from ..core.overlap import MIN_SUPPORT, attention_recall, to_mask
from ..core.selection import TOP_P, select_from_trace
from ..core.trace import positions
from ..policies.retrieval_heads import copy_steps, layer_head_grid, retrieval_hits

if TYPE_CHECKING:  # plotly is imported where a figure is drawn: HeadKV and DuoAttention read head scores without it
    import plotly.graph_objects as go

COLUMNS = ["layer", "head", "kv_head", "rows", "sink_share", "locality", "window_recall", "copy_steps",
           "retrieval_hits", "retrieval_score"]
# The grid's metrics, each with the few words its figure's title gives.
METRICS = {
    "retrieval_score": "share of copy steps whose top-attended key is the copied token (Wu et al. 2024)",
    "retrieval_hits": "copy steps whose top-attended key is the copied token",
    "window_recall": "generated rows' prefix attention on the observation window's top-p selection",
    "sink_share": "attention on the first tokens",
    "locality": "attention on the most recent tokens",
}
# With retrieval_norm="span" the score is no longer a share of copy steps.
SPAN_SCORE = "copy steps whose top-attended key is the copied token, per span position (the official normalisation)"
PROMPT_ROWS = 512  # rows averaged by default when a trace has no generated token: the last ones of the prompt
NORMALISATIONS = ("copy_steps", "span")


def head_table(trace, *, queries=None, sinks: int = 4, local: int = 64, obs_window: int = 32,
               capacity: int | float = TOP_P, span: tuple[int, int] | None = None,
               retrieval_norm: str = "copy_steps") -> pd.DataFrame:
    """One row per (layer, query head) of the trace, with COLUMNS; kv_head = head // (heads // kv_heads).

    rows: how many query rows sink_share and locality average: `queries` (anything `snapkv_lab.core.trace.positions`
        takes; default the generated rows, or with no generated token the last min(512, prompt_len) rows).
    sink_share: mean over those rows of the attention on keys 0 .. sinks-1.
    locality: mean over those rows of the attention on the last `local` keys, k with p - local < k <= p for
        the row at position p (the row's own key included; near the start this band holds the sinks too).
    window_recall: the findings' observation-window recall (experiments.generation_consistency, "paper"
        selection, sinks kept, one window of all generated rows): the last `obs_window` prompt rows vote
        (column sums, no pooling) on the prefix before them, each query head keeps its top `capacity`
        positions (a count, or a fraction of the prefix as the findings' TOP_P; `selection.select_from_trace`),
        and the value is the mean over generated rows of the share of the row's attention over that prefix
        that falls on the kept positions (`metrics.attention_recall`). NaN, as in the findings, with fewer
        than metrics.MIN_SUPPORT generated rows (none included), or with no prefix (prompt_len <= obs_window).
    Retrieval (Wu et al. 2024, "Retrieval Head Mechanistically Explains Long-Context Factuality"; official
    code nightdessert/Retrieval_Head, retrieval_head_detection.py at commit 3ac171a: `retrieval_calculate`
    lines 221-229 (topk(1) of the whole attention row at 224, the needle and token test at 226, += 1 / needle
    length at 227), `decode` lines 235-246, the prefill without the last prompt token lines 289-290, the
    ROUGE filter and the mean over tests lines 298-300):
        span = (start, end): the prompt positions start..end-1 searched (the needle; default the whole prompt).
        The row at position r emits token token_ids[r + 1] (the argmax of its logits; with a teacher-forced
        trace, the forced token), so the generated tokens are emitted by rows prompt_len-1 .. n_tokens-2, the
        first by the last prompt row (the official code prefills all but the last prompt token, then decodes
        from it, so it scores that step too).
        copy_steps: emitted tokens whose id occurs in the span (the same count for every head).
        retrieval_hits: copy steps at which the head's top-attended key (argmax over every key the row sees,
            as the official topk(1) of the whole row) lies in the span and holds the emitted token id.
        retrieval_score: with retrieval_norm="copy_steps" (default), hits / copy_steps, NaN without copy
            steps: the share of the copying this head did. The official score adds 1 / (end - start) per
            hit, i.e. hits / span length (retrieval_norm="span"); the two agree when the model copies the
            whole span once, token by token. The official code scores up to 50 decoded tokens, stops at a
            newline, keeps only answers with ROUGE-1 recall > 50 and averages the score over needle tests;
            pooling several traces is the caller's (sum hits over sum copy_steps, or average per trace).
    Returns a DataFrame ordered by layer then head; `table.attrs["options"]` records the parameters.
    """
    span = (0, trace.prompt_len) if span is None else tuple(span)
    _check_options(trace, sinks, local, obs_window, span, retrieval_norm)
    rows = _default_rows(trace) if queries is None else positions(queries, trace.n_tokens)
    if rows.numel() == 0:
        raise ValueError("queries selects no row of the trace")
    steps, emitted = copy_steps(trace, span)
    heads = torch.arange(trace.n_heads)
    tables = []
    for layer in trace.layers:
        sink_share, locality = sink_and_local_shares(trace, layer, rows, sinks, local)
        hits = retrieval_hits(trace, layer, steps, emitted, span)
        tables.append(pd.DataFrame(dict(
            layer=layer, head=heads.numpy(), kv_head=(heads // (trace.n_heads // trace.n_kv_heads)).numpy(),
            rows=rows.numel(), sink_share=sink_share.numpy(), locality=locality.numpy(),
            window_recall=window_recall(trace, layer, obs_window, capacity).numpy(), copy_steps=steps.numel(),
            retrieval_hits=hits.numpy())))
    table = pd.concat(tables, ignore_index=True)
    per = table["copy_steps"] if retrieval_norm == "copy_steps" else pd.Series(span[1] - span[0], table.index)
    table["retrieval_score"] = (table["retrieval_hits"] / per).where(per > 0)  # no copy step: undefined
    table.attrs["options"] = dict(sinks=sinks, local=local, obs_window=obs_window, capacity=capacity, span=span,
                                  retrieval_norm=retrieval_norm)
    return table[COLUMNS]


def _check_options(trace, sinks, local, obs_window, span, retrieval_norm) -> None:
    if sinks < 0 or local < 1 or obs_window < 1:
        raise ValueError(f"sinks must be >= 0, local and obs_window >= 1; got {sinks}, {local}, {obs_window}")
    if not 0 <= span[0] < span[1] <= trace.prompt_len:
        raise ValueError(f"span {span} is not a non-empty range of prompt positions (0..{trace.prompt_len})")
    if retrieval_norm not in NORMALISATIONS:
        raise ValueError(f"retrieval_norm must be one of {NORMALISATIONS}, got {retrieval_norm!r}")


def _default_rows(trace) -> torch.Tensor:
    if trace.n_generated:
        return positions(trace.generated, trace.n_tokens)
    return torch.arange(trace.prompt_len - min(PROMPT_ROWS, trace.prompt_len), trace.prompt_len)


def _pieces(rows: torch.Tensor, heads: int, extra: int) -> Iterator[torch.Tensor]:
    """Consecutive pieces of the sorted rows (n,) whose keys, from `extra` before the first row to the last
    row, make a (heads, piece, keys) block within BLOCK_ELEMENTS; a single row always makes a piece."""
    values, start = rows.tolist(), 0
    for end in range(1, len(values) + 1):
        if end == len(values) or heads * (end + 1 - start) * (values[end] - values[start] + extra) > BLOCK_ELEMENTS:
            yield rows[start:end]
            start = end


def sink_and_local_shares(trace, layer: int, rows: torch.Tensor, sinks: int, local: int):
    """Mean over `rows` (n,) of each head's attention on keys 0..sinks-1 and on its last `local` keys:
    two (heads,) float64 tensors (see head_table)."""
    rows = rows.sort().values
    sink_sum = torch.zeros(trace.n_heads, dtype=torch.float64)
    local_sum = torch.zeros(trace.n_heads, dtype=torch.float64)
    for piece in _pieces(rows, trace.n_heads, sinks + local):
        # Only the sink keys and the piece's local bands are materialised, however long the rows are.
        keys = torch.cat([torch.arange(min(sinks, trace.n_tokens)),
                          torch.arange(max(0, int(piece[0]) - local + 1), int(piece[-1]) + 1)]).unique()
        probs = trace.attention(layer, queries=piece, keys=keys).double().cpu()  # (heads, piece, keys)
        band = (keys[None] > piece[:, None] - local) & (keys[None] <= piece[:, None])  # (piece, keys)
        sink_sum += probs[..., keys < sinks].sum(dim=(1, 2))
        local_sum += (probs * band).sum(dim=(1, 2))
    return sink_sum / rows.numel(), local_sum / rows.numel()


def window_recall(trace, layer: int, obs_window: int = 32, capacity: int | float = TOP_P) -> torch.Tensor:
    """(heads,) float64: the findings' observation-window recall of every query head (see head_table)."""
    prefix_len = trace.prompt_len - obs_window
    if trace.n_generated < MIN_SUPPORT or prefix_len <= 0:
        return torch.full((trace.n_heads,), float("nan"), dtype=torch.float64)
    kept = select_from_trace(trace, layer, slice(prefix_len, trace.prompt_len), capacity)  # (heads, k), no pooling
    selected = to_mask(kept, prefix_len)
    rows = positions(trace.generated, trace.n_tokens)
    numerator = torch.zeros(trace.n_heads, dtype=torch.float64, device=selected.device)
    for piece in rows.split(max(1, BLOCK_ELEMENTS // (trace.n_heads * prefix_len))):
        numerator += attention_recall(trace.attention(layer, queries=piece, keys=slice(0, prefix_len)),
                                      selected)["numerator"]
    return (numerator / rows.numel()).cpu()


# ---- the grid --------------------------------------------------------------------------------------------
def heads_grid_figure(table: pd.DataFrame, metric: str = "retrieval_score") -> go.Figure:
    """Heatmap of one metric of a `head_table` or a `retrieval_heads` table: layers on y, heads on x; hover shows
    every column of the cell.

    The colour scale runs from 0 to at least 1 (the shares' range), so that grids of one metric compare;
    NaN cells (undefined) are left blank.
    """
    import plotly.graph_objects as go

    if metric not in METRICS:
        raise ValueError(f"metric must be one of {list(METRICS)}, got {metric!r}")
    z = layer_head_grid(table, metric)
    shown = [c for c in table.columns if c not in ("layer", "head")]  # a head_table's or retrieval_heads' columns
    custom = np.stack([layer_head_grid(table, c).to_numpy(dtype=float) for c in shown],
                      axis=-1)  # (layers, heads, columns)
    lines = [f"{c} %{{customdata[{i}]:.4f}}" if table[c].dtype.kind == "f" else f"{c} %{{customdata[{i}]}}"
             for i, c in enumerate(shown)]
    high = np.nanmax(z.to_numpy(), initial=1.0)
    figure = go.Figure(go.Heatmap(
        z=z.to_numpy(), x=z.columns.to_numpy(), y=z.index.to_numpy(), customdata=custom, zmin=0, zmax=max(1.0, high),
        colorscale="Viridis", colorbar=dict(title=metric),
        hovertemplate="layer %{y}, head %{x}<br>" + "<br>".join(lines) + "<extra></extra>"))
    options = table.attrs.get("options")
    words = (SPAN_SCORE if metric == "retrieval_score" and (options or {}).get("retrieval_norm") == "span"
             else METRICS[metric])
    subtitle = "" if options is None else "<br><sup>" + ", ".join(f"{k}={v}" for k, v in options.items()) + "</sup>"
    figure.update_layout(title=f"{metric}: {words}{subtitle}", xaxis_title="head", yaxis_title="layer",
                         width=max(450, 40 + 22 * z.shape[1]), height=max(350, 120 + 18 * z.shape[0]))
    return figure


class HeadsGrid:
    """A metric picker over `heads_grid_figure` in a plotly FigureWidget; clicking a cell selects its head.

    widget: the ipywidgets VBox shown in a notebook (this object displays as it); selected: the last
    (layer, head) selected, or None; metric: the metric shown. Needs a live kernel to react to clicks.
    """

    def __init__(self, table: pd.DataFrame, metric: str = "retrieval_score",
                 on_select: Callable[[int, int], None] | None = None):
        import ipywidgets as widgets
        import plotly.graph_objects as go

        self.table, self.on_select, self.selected = table, on_select, None
        self.picker = widgets.Dropdown(options=list(METRICS), value=metric, description="metric")
        self.label = widgets.Label("click a cell to select its head")
        self.figure = go.FigureWidget(heads_grid_figure(table, metric))
        self.figure.data[0].on_click(self._clicked)
        self.picker.observe(self._redraw, names="value")
        self.widget = widgets.VBox([widgets.HBox([self.picker, self.label]), self.figure])

    @property
    def metric(self) -> str:
        return self.picker.value

    def select(self, layer: int, head: int) -> None:
        """What a click on cell (layer, head) does: remember it, say it, and call on_select(layer, head)."""
        if not ((self.table["layer"] == layer) & (self.table["head"] == head)).any():
            raise ValueError(f"the table has no layer {layer}, head {head}")
        self.selected = (layer, head)
        self.label.value = f"selected: layer {layer}, head {head}"
        if self.on_select is not None:
            self.on_select(layer, head)

    def _clicked(self, trace, points, state) -> None:
        if points.xs:  # a click beside the cells reports no point
            self.select(int(points.ys[0]), int(points.xs[0]))

    def _redraw(self, change) -> None:
        new = heads_grid_figure(self.table, change["new"])
        heatmap = new.data[0]
        with self.figure.batch_update():
            self.figure.data[0].update(z=heatmap.z, zmax=heatmap.zmax, colorbar=heatmap.colorbar)
            self.figure.layout.title = new.layout.title

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)


def heads_grid(trace_or_table, *, metric: str = "retrieval_score", on_select: Callable[[int, int], None] | None = None,
               **head_table_options) -> HeadsGrid:
    """`HeadsGrid` of a `head_table` (given, or computed from a trace with `head_table_options`)."""
    if isinstance(trace_or_table, pd.DataFrame):
        if head_table_options:
            raise TypeError(f"head_table options {sorted(head_table_options)} need a trace, not a table")
        return HeadsGrid(trace_or_table, metric, on_select)
    return HeadsGrid(head_table(trace_or_table, **head_table_options), metric, on_select)
