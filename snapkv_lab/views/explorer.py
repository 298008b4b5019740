"""explore(): move through a long trace's attention like a map. An overview of one layer and head (or the mean of
its heads) pooled to screen resolution; drag a rectangle to zoom and the view recomputes that block at the
resolution it now needs (`tiles.AttentionTiles`), down to exact per-token values with the tokens on both axes.

    ex = snapkv_lab.explore(trace, layer=14, head=3, kept=run, spans={"needle": (1200, 1230)},
                            effects=span_effects(model, tokenizer, context, question))
    ex                                      # the widget, in a notebook
    ex.zoom(rows=slice(3000, 3100), cols=slice(0, 4096))
    ex.drawn()                              # the 2-D array drawn now: block maxima, or exact values at block 1
    ex.to_html("trace.html")                # overview and zoom levels, one offline file

Overlays, each toggled: a policy's kept positions (a strip above the map: the kept share of each block of key
positions, for the head's KV head), the causal side beside attention (`effects=`, a span_effects table of the trace's
prompt: a second strip, each block of key positions coloured by the effect on the answer of evicting the span that
holds it, its `kl` or `logprob_delta`), the observation window (the last `window` prompt rows and the keys they vote
on), the sinks (the first `sinks` keys) and named spans. A click on a row shows its spotlight over the prompt.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import numpy as np
import plotly.graph_objects as go
import torch

from ..core.trace import AttentionTrace
from .tiles import HEAD_MEAN, AttentionTiles, as_head, as_span, cell_counts, pool_blocks

LABELLED_TOKENS = 64  # at block 1 and at most this many tokens per side, the axes show the tokens' text
STATS = ("max", "mean")


def _token_label(trace, position: int) -> str:
    text = trace.tokens[position].replace("\n", "\\n")
    return f"{position} {text[:12]}"


class Explorer:
    """The state of a map view and the widget that draws it; every widget action has a Python method.

    trace: an AttentionTrace, or the path of a saved one (read lazily: only the layers drawn are loaded).
    kept: a GenerationResult of the same prompt (`generate(..., policy=...)`, or a `compare` row's:
        `table.result(prompt, policy_label)`), or its kept_indices (one (batch, kv_heads or heads, k) tensor per
        trace layer), for the kept-positions strip.
    window: the observation window drawn by its overlay (the last `window` prompt rows).
    sinks: the first positions drawn as sinks. spans: {name: (start, end)} position ranges drawn as bands.
    effects: a span_effects table (start, end and the `effect` column) of this trace's prompt, for the causal strip:
        a position takes the effect of the span holding it (span_effects evicts whole spans), a drawn block the mean
        over its positions; positions in no span (the question, the generated tokens) are blank.
    effect: the column drawn, "kl" (nats, >= 0) or "logprob_delta" (log p(answer) lost: <= 0 where evicting hurts).
    tiles: an AttentionTiles of this trace, or the path of one saved (`AttentionTiles.save`, e.g. after `precompute`
        where the trace was captured): every head in it opens without its exact pass.
    max_cells: the most cells a view draws per side. stat: "max" (block maxima: nothing sharp disappears) or
        "mean" (block means) for pooled views.
    """

    def __init__(self, trace, layer: int | None = None, head: int | str = 0, *, kept=None, window: int = 32,
                 sinks: int = 4, spans: dict | None = None, max_cells: int = 512, stat: str = "max",
                 tiles=None, progress: bool = True, effects=None, effect: str = "kl"):
        if not isinstance(trace, AttentionTrace):
            trace = AttentionTrace.load(trace, lazy=True)
        self.trace = trace
        if tiles is None or isinstance(tiles, AttentionTiles):
            self.tiles = tiles or AttentionTiles(trace, progress=progress)
        else:
            self.tiles = AttentionTiles.load(trace, tiles, progress=progress)
        self.max_cells = max_cells
        self.window, self.sinks, self.spans = window, sinks, dict(spans or {})
        self.kept = None if kept is None else self._kept_masks(kept)
        self.effect = effect
        self.effects = None if effects is None else self._effect_columns(effects, effect)
        self.overlays = {"kept": kept is not None, "effects": effects is not None, "window": True, "sinks": True,
                         "spans": bool(self.spans)}
        self._check_stat(stat)
        self.stat = stat
        self.layer = trace.layers[0] if layer is None else int(layer)
        self.head = as_head(head)
        self._check_head(self.layer, self.head)
        self.rows, self.cols = range(trace.n_tokens), range(trace.n_tokens)
        self.spotlit: int | None = None
        self._grid = None
        self.redraw_seconds: float | None = None
        self._widget = None
        self._draw()

    # ---- state, from Python ------------------------------------------------------------------
    def zoom(self, rows=None, cols=None) -> "Explorer":
        """Show query rows `rows` x key columns `cols` (slices, ranges or (start, stop) pairs of positions; None:
        all). The view snaps them outwards to its block."""
        self.rows, self.cols = as_span(rows, self.trace.n_tokens), as_span(cols, self.trace.n_tokens)
        self._draw()
        return self

    def overview(self) -> "Explorer":
        return self.zoom()

    def select(self, layer: int | None = None, head: int | str | None = None) -> "Explorer":
        """Show another layer and/or head (head "mean": the mean of the layer's heads), keeping the rectangle."""
        layer = self.layer if layer is None else int(layer)
        head = self.head if head is None else as_head(head)
        self._check_head(layer, head)
        self.layer, self.head = layer, head
        self._draw()
        return self

    def show(self, stat: str | None = None, **overlays: bool) -> "Explorer":
        """Switch the pooled statistic ("max" or "mean") and overlays on or off, e.g. show(kept=False, sinks=True).
        The tile in view holds both statistics: nothing is recomputed, only redrawn."""
        if stat is not None:
            self._check_stat(stat)
            self.stat = stat
        unknown = set(overlays) - set(self.overlays)
        if unknown:
            raise ValueError(f"unknown overlays {sorted(unknown)}; the overlays are {sorted(self.overlays)}")
        if overlays.get("kept") and self.kept is None:
            raise ValueError("no kept positions to draw: pass kept=<GenerationResult or kept_indices> to explore()")
        if overlays.get("effects") and self.effects is None:
            raise ValueError("no span effects to draw: pass effects=<a span_effects table of the prompt> to explore()")
        self.overlays.update(overlays)
        if self._widget is not None:
            self._sync_widget()
        return self

    @property
    def block(self) -> int:
        """Tokens per drawn cell side (1: exact values)."""
        return self.tile.block

    def drawn(self, stat: str | None = None) -> np.ndarray:
        """The 2-D array drawn now, (row cells, col cells): block maxima (or means) of the exact probabilities,
        the exact probabilities themselves at block 1. Cell (i, j) covers positions tile.rows[i*block:(i+1)*block]
        x tile.cols[j*block:(j+1)*block]."""
        stat = self.stat if stat is None else stat
        self._check_stat(stat)
        return getattr(self.tile, stat).numpy()

    def click(self, row: int) -> "Explorer":
        """What a click on a row does: the spotlight of that query token over the prompt, beside the map."""
        if not 0 <= row < self.trace.n_tokens:
            raise ValueError(f"row {row} is outside the trace's 0..{self.trace.n_tokens - 1}")
        self.spotlit = row
        if self._widget is not None:
            self._spotlight.value = self.spotlight_html(row)
        return self

    def heads_grid(self, **head_table_options):
        """Heads at a glance (`heads.heads_grid`: sink share, locality, window recall, retrieval score per layer x
        head), computed on first use; selecting a cell opens that head in this explorer."""
        from .heads import heads_grid

        if self._grid is None or head_table_options:
            self._grid = heads_grid(self.trace, on_select=self._open_head, **head_table_options)
        return self._grid

    def _open_head(self, layer: int, head: int) -> None:
        self.select(layer=layer, head=head)
        if self._widget is not None:
            self._mode.value = "map"

    def spotlight_html(self, row: int) -> str:
        from .plots import spotlight

        heads = None if self.head == HEAD_MEAN else self.head
        return spotlight(self.trace, row, layers=self.layer, heads=heads).data

    # ---- drawing -----------------------------------------------------------------------------
    def _draw(self) -> None:
        start = time.perf_counter()
        self.tile = self.tiles.view(self.layer, self.head, self.rows, self.cols, max_cells=self.max_cells)
        if self._widget is not None:
            self._sync_widget()
        self.redraw_seconds = time.perf_counter() - start

    def figure(self) -> go.Figure:
        """The current view as a static plotly figure."""
        figure = go.Figure()
        for trace in self._traces():
            figure.add_trace(trace)
        figure.update_layout(**self._layout())
        return figure

    def _title(self) -> str:
        tile = self.tile
        head = "mean of heads" if self.head == HEAD_MEAN else f"head {self.head}"
        scale = "exact" if tile.block == 1 else f"{self.stat} over {tile.block} x {tile.block}-token blocks"
        return (f"layer {self.layer}, {head}: rows {tile.rows.start}-{tile.rows.stop - 1}, "
                f"keys {tile.cols.start}-{tile.cols.stop - 1} ({scale})")

    def _centres(self, span: range) -> np.ndarray:
        block = self.tile.block
        starts = np.arange(span.start, span.stop, block)
        return (starts + np.minimum(starts + block, span.stop) - 1) / 2

    def _traces(self) -> list:
        tile = self.tile
        z = self.drawn()
        positive = z[z > 0]
        zmax = float(np.quantile(positive, 0.99)) if positive.size else 1.0
        heatmap = go.Heatmap(z=z, x=self._centres(tile.cols), y=self._centres(tile.rows), zmin=0, zmax=zmax,
                             colorscale="Viridis", name="attention", xaxis="x", yaxis="y",
                             hovertemplate="query %{y}<br>key %{x}<br>p %{z:.4g}<extra></extra>")
        traces = [heatmap]
        if self.kept is not None:
            traces.append(go.Heatmap(z=[self._kept_share()], x=self._centres(tile.cols), y=["kept"], zmin=0, zmax=1,
                                     colorscale="Greys", reversescale=False, showscale=False, name="kept",
                                     xaxis="x", yaxis="y2", visible=self.overlays["kept"],
                                     hovertemplate="keys %{x}<br>kept share %{z:.2f}<extra></extra>"))
        if self.effects is not None:
            values = self._effect_blocks()
            diverging = self.effect == "logprob_delta"
            bound = float(np.nanmax(np.abs(self.effects))) if np.isfinite(self.effects).any() else 1.0
            traces.append(go.Heatmap(z=[values], x=self._centres(tile.cols), y=[self.effect], showscale=False,
                                     zmin=-bound if diverging else 0, zmax=bound or 1.0,
                                     colorscale="RdBu" if diverging else "Magenta", name="span effects",
                                     xaxis="x", yaxis="y3", visible=self.overlays["effects"],
                                     hovertemplate=f"keys %{{x}}<br>{self.effect} of evicting %{{z:.4g}}"
                                                   "<extra></extra>"))
        return traces

    def _axis(self, span: range, reverse: bool = False) -> dict:
        """An axis over `span`; the y axis is reversed through its range (row 0 at the top, as in a matrix)."""
        ends = [span.start - 0.5, span.stop - 0.5]
        axis = dict(range=ends[::-1] if reverse else ends, tickmode="auto", tickvals=None, ticktext=None)
        if self.tile.block == 1 and len(span) <= LABELLED_TOKENS:
            axis.update(tickmode="array", tickvals=list(span), ticktext=[_token_label(self.trace, p) for p in span])
        return axis

    def _layout(self) -> dict:
        tile = self.tile
        kept = self.kept is not None and self.overlays["kept"]
        effects = self.effects is not None and self.overlays["effects"]
        top = 1.0 - 0.07 * (kept + effects)  # each strip shown takes 0.05 of the height and a 0.02 gap
        return dict(title=dict(text=self._title(), font=dict(size=13)), width=760, height=720, dragmode="zoom",
                    xaxis=dict(self._axis(tile.cols), title="key position", constrain="domain"),
                    yaxis=dict(self._axis(tile.rows, reverse=True), title="query position",
                               domain=[0, top if kept or effects else 1.0]),
                    yaxis2=dict(domain=[top + 0.02, top + 0.07] if kept else [0.95, 1.0], visible=kept,
                                fixedrange=True, showticklabels=True),
                    yaxis3=dict(domain=[1.0 - 0.05, 1.0] if effects else [0.95, 1.0], visible=effects,
                                fixedrange=True, showticklabels=True),
                    shapes=self._shapes(), margin=dict(l=130, b=110, t=50))

    def _shapes(self) -> list[dict]:
        trace, shapes = self.trace, []
        line = dict(type="line", xref="x domain", x0=0, x1=1, yref="y", y0=trace.prompt_len - 0.5,
                    y1=trace.prompt_len - 0.5, line=dict(color="white", dash="dot", width=1))
        shapes.append(line)
        if self.overlays["window"] and 0 < self.window < trace.prompt_len:
            start = trace.prompt_len - self.window
            shapes.append(dict(type="rect", xref="x", yref="y", x0=-0.5, x1=start - 0.5, y0=start - 0.5,
                               y1=trace.prompt_len - 0.5, line=dict(color="red", width=2), name="observation window"))
        if self.overlays["sinks"] and self.sinks > 0:
            shapes.append(dict(type="rect", xref="x", yref="y domain", x0=-0.5, x1=self.sinks - 0.5, y0=0, y1=1,
                               line=dict(color="orange", width=1), fillcolor="orange", opacity=0.25, name="sinks"))
        if self.overlays["spans"]:
            for name, (start, end) in self.spans.items():
                shapes.append(dict(type="rect", xref="x", yref="y domain", x0=start - 0.5, x1=end - 0.5, y0=0, y1=1,
                                   line=dict(color="cyan", width=1), fillcolor="cyan", opacity=0.2, name=name))
        return shapes

    def _kept_masks(self, kept) -> torch.Tensor:
        from .coverage import kept_mask_for

        return kept_mask_for(self.trace, kept)  # (layers, kv_heads or heads, prompt) bool

    def _kept_share(self) -> np.ndarray:
        """The share of each drawn block of key positions that the policy kept for this head (its KV head's
        set), or for the head mean the mean over heads; generated positions are never "kept" (they were fed)."""
        trace, tile = self.trace, self.tile
        masks = self.kept[trace.layers.index(self.layer)].float()  # (rows, prompt)
        per_head = masks[torch.arange(trace.n_heads) // (trace.n_heads // masks.shape[0])]
        kept = per_head.mean(0) if self.head == HEAD_MEAN else per_head[self.head]
        columns = torch.zeros(trace.n_tokens)
        columns[: trace.prompt_len] = kept
        sums = pool_blocks(columns[None, tile.cols.start: tile.cols.stop], 1, tile.block, "sum")[0]
        return (sums / cell_counts(tile.cols, tile.block)).numpy()

    def _effect_columns(self, effects, effect: str) -> np.ndarray:
        """(n_tokens,) each position's effect: that of the span holding it, NaN outside every span; checked."""
        missing = {"start", "end", effect} - set(effects.columns)
        if missing:
            raise ValueError(f"effects must be a span_effects table with start, end and {effect!r}; it lacks "
                             f"{sorted(missing)}")
        if len(effects) and (effects.end.max() > self.trace.prompt_len or effects.start.min() < 0):
            raise ValueError(f"the effects' spans reach position {int(effects.end.max())}, past the trace's "
                             f"{self.trace.prompt_len}-token prompt: they are another prompt's")
        columns = np.full(self.trace.n_tokens, np.nan)
        for start, end, value in zip(effects.start, effects.end, effects[effect], strict=True):
            columns[int(start):int(end)] = value
        return columns

    def _effect_blocks(self) -> np.ndarray:
        """The mean effect over each drawn block of key positions (NaN where no position of it lies in a span)."""
        tile, block = self.tile, self.tile.block
        part = self.effects[tile.cols.start:tile.cols.stop]
        padded = np.full(-(-len(part) // block) * block, np.nan)
        padded[:len(part)] = part
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a block outside every span: NaN, drawn blank
            return np.nanmean(padded.reshape(-1, block), axis=1)

    # ---- checks ------------------------------------------------------------------------------
    def _check_head(self, layer, head) -> None:
        if layer not in self.trace.layers:
            raise ValueError(f"layer {layer} was not captured; the trace holds layers {self.trace.layers}")
        self.tiles.query_heads(head)

    @staticmethod
    def _check_stat(stat) -> None:
        if stat not in STATS:
            raise ValueError(f"stat must be one of {STATS}, got {stat!r}")

    # ---- the widget --------------------------------------------------------------------------
    @property
    def widget(self):
        """The ipywidgets view (built on first use): pickers, overlay toggles, the map and the spotlight."""
        if self._widget is None:
            self._build_widget()
        return self._widget

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)

    def _build_widget(self) -> None:
        import ipywidgets as widgets

        trace = self.trace
        self._layer_picker = widgets.Dropdown(options=trace.layers, value=self.layer, description="layer",
                                              layout=widgets.Layout(width="160px"))
        self._head_picker = widgets.Dropdown(options=[*range(trace.n_heads), HEAD_MEAN], value=self.head,
                                             description="head", layout=widgets.Layout(width="160px"))
        self._stat_picker = widgets.ToggleButtons(options=STATS, value=self.stat, description="blocks",
                                                  style=dict(button_width="60px"))
        self._toggles = {name: widgets.Checkbox(value=on, description=name, indent=False,
                                                layout=widgets.Layout(width="90px"),
                                                disabled=(name == "kept" and self.kept is None)
                                                or (name == "effects" and self.effects is None))
                         for name, on in self.overlays.items()}
        reset = widgets.Button(description="overview", layout=widgets.Layout(width="100px"))
        self._mode = widgets.ToggleButtons(options=["map", "heads grid"], value="map", style=dict(button_width="90px"))
        self._figure = go.FigureWidget(self.figure())
        self._status = widgets.HTML()
        self._spotlight = widgets.HTML("<i>click a row of the map for its spotlight over the prompt</i>",
                                       layout=widgets.Layout(width="480px", max_height="720px", overflow="auto"))
        self._syncing = False

        self._layer_picker.observe(lambda change: self.select(layer=change["new"]), names="value")
        self._head_picker.observe(lambda change: self.select(head=change["new"]), names="value")
        self._stat_picker.observe(lambda change: self.show(stat=change["new"]), names="value")
        for name, box in self._toggles.items():
            box.observe(lambda change, name=name: self.show(**{name: change["new"]}), names="value")
        reset.on_click(lambda _: self.overview())
        self._figure.layout.on_change(self._on_relayout, "xaxis.range", "yaxis.range")
        self._figure.data[0].on_click(self._on_click)
        controls = widgets.HBox([self._mode, self._layer_picker, self._head_picker, self._stat_picker, reset])
        map_view = widgets.VBox([widgets.HBox(list(self._toggles.values())), self._status,
                                 widgets.HBox([self._figure, self._spotlight])])
        body = widgets.Box([map_view])

        def switch(change):
            body.children = [map_view if change["new"] == "map" else self.heads_grid().widget]
        self._mode.observe(switch, names="value")
        self._widget = widgets.VBox([controls, body])
        self._sync_widget()

    def _sync_widget(self) -> None:
        """Put the current state into the widget: pickers, the heatmap's data and axes, the status line."""
        self._syncing = True
        try:
            self._layer_picker.value, self._head_picker.value = self.layer, self.head
            self._stat_picker.value = self.stat
            for name, box in self._toggles.items():
                box.value = self.overlays[name]
            layout = self._layout()
            with self._figure.batch_update():
                for old, new in zip(self._figure.data, self._traces()):
                    old.update(z=new.z, x=new.x, y=new.y, zmax=new.zmax, visible=new.visible)
                self._figure.update_layout(**layout)
            seconds = "" if self.redraw_seconds is None else f"last redraw {self.redraw_seconds:.2f} s; "
            self._status.value = (f"<small>{seconds}{self.tile.max.shape[0]} x {self.tile.max.shape[1]} cells of "
                                  f"{self.tile.block} token{'s' if self.tile.block > 1 else ''}; drag to zoom, "
                                  "click a row for its spotlight</small>")
        finally:
            self._syncing = False

    def _on_relayout(self, layout, x_range, y_range) -> None:
        if self._syncing or x_range is None or y_range is None:
            return
        n = self.trace.n_tokens
        low_x, high_x = sorted(x_range)
        low_y, high_y = sorted(y_range)
        cols = slice(max(0, int(np.ceil(low_x))), min(n, int(np.floor(high_x)) + 1))
        rows = slice(max(0, int(np.ceil(low_y))), min(n, int(np.floor(high_y)) + 1))
        if cols.stop > cols.start and rows.stop > rows.start:
            self.zoom(rows=rows, cols=cols)

    def _on_click(self, _trace, points, _state) -> None:
        if points.ys:
            self.click(int(round(points.ys[0] - (self.tile.block - 1) / 2)))

    # ---- sharing -----------------------------------------------------------------------------
    def to_html(self, path, zooms: list[tuple[slice, slice]] | None = None) -> Path:
        """A static, offline HTML file of this layer and head: the overview and a few zoom levels, picked with
        buttons (plotly.js is inlined: no kernel, no network). zooms: (rows, cols) slices; by default squares
        ending at the prompt's end, each 8x smaller, down to exact values."""
        zooms = self._default_zooms() if zooms is None else zooms
        state = (self.rows, self.cols)
        levels = []
        try:
            for rows, cols in [(None, None), *zooms]:
                self.zoom(rows=rows, cols=cols)
                layout = self._layout()
                levels.append((self._traces(), layout))
        finally:
            self.rows, self.cols = state
            self._draw()
        figure = go.Figure()
        per_level = len(levels[0][0])
        for i, (traces, _) in enumerate(levels):
            for trace in traces:
                trace.visible = i == 0 and trace.visible is not False
                figure.add_trace(trace)
        buttons = []
        for i, (_, layout) in enumerate(levels):
            visible = [j // per_level == i for j in range(len(figure.data))]
            change = {"title.text": layout["title"]["text"], "xaxis.range": layout["xaxis"]["range"],
                      "yaxis.range": layout["yaxis"]["range"], "xaxis.tickmode": layout["xaxis"]["tickmode"],
                      "yaxis.tickmode": layout["yaxis"]["tickmode"], "xaxis.tickvals": layout["xaxis"]["tickvals"],
                      "yaxis.tickvals": layout["yaxis"]["tickvals"], "xaxis.ticktext": layout["xaxis"]["ticktext"],
                      "yaxis.ticktext": layout["yaxis"]["ticktext"]}
            label = "overview" if i == 0 else f"zoom {i}: {len(range(self.trace.n_tokens)[zooms[i - 1][0]])} rows"
            buttons.append(dict(label=label, method="update", args=[{"visible": visible}, change]))
        figure.update_layout(**levels[0][1])
        # The level buttons under the map: above it they ran into the title.
        figure.update_layout(updatemenus=[dict(type="buttons", direction="right", x=0, y=-0.14, xanchor="left",
                                               yanchor="top", buttons=buttons)], margin=dict(b=110))
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        figure.write_html(path, include_plotlyjs=True, full_html=True,
                          div_id="snapkv-lab-trace-view", config=dict(displaylogo=False))
        return path

    def _default_zooms(self) -> list[tuple[slice, slice]]:
        end = self.trace.prompt_len
        zooms, side = [], end // 8
        while side >= 32:
            zooms.append((slice(end - side, end), slice(end - side, end)))
            side //= 8
        zooms.append((slice(max(0, end - 32), end), slice(max(0, end - 32), end)))
        return zooms

    def __repr__(self) -> str:
        return f"Explorer({self._title()})"


def explore(trace, layer: int | None = None, head: int | str = 0, **options) -> Explorer:
    """An Explorer of `trace` (an AttentionTrace or a saved trace's path) at `layer` and `head`; see Explorer."""
    return Explorer(trace, layer, head, **options)

