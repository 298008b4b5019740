"""Views of an AttentionTrace for notebooks: heatmaps, a per-token spotlight, window attention (the interactive
map is `explorer.explore`).

Only reduced arrays reach plotly (at most `max_cells` per side): a long map is max-pooled into blocks,
so a block's colour is the strongest attention inside it and nothing sharp disappears.
"""

from __future__ import annotations

import html

import numpy as np
import plotly.graph_objects as go
import torch
import torch.nn.functional as F

from ..core.trace import positions


def block_max(matrix: torch.Tensor, max_rows: int, max_cols: int) -> tuple[torch.Tensor, int, int]:
    """(rows, cols) -> (<= max_rows, <= max_cols) by max over blocks; returns the map and the block sizes."""
    row_block = -(-matrix.shape[0] // max_rows)
    col_block = -(-matrix.shape[1] // max_cols)
    pooled = F.max_pool2d(matrix[None, None], (row_block, col_block), ceil_mode=True)[0, 0]
    return pooled, row_block, col_block


def attention_heatmap(trace, layer: int, head: int, *, queries=None, keys=None, max_cells: int = 512,
                      quantile: float = 0.99) -> go.Figure:
    """Plotly heatmap of one head's attention over a block (default: the whole map, max-pooled).

    The colour scale stops at the `quantile` of the block so that the attention sink (often > 0.5)
    does not wash out the rest; hover shows the exact (pooled) value.
    """
    rows = positions(queries, trace.n_tokens)
    cols = positions(keys, trace.n_tokens)
    block = trace.attention(layer, heads=head, queries=rows, keys=cols)[0].cpu()  # plotly reads host memory
    pooled, rb, cb = block_max(block, max_cells, max_cells)
    zmax = float(torch.quantile(pooled[pooled > 0].float(), quantile)) if (pooled > 0).any() else 1.0
    figure = go.Figure(go.Heatmap(
        z=pooled.numpy(), x=cols[::cb].numpy(), y=rows[::rb].numpy(), zmin=0, zmax=zmax, colorscale="Viridis",
        hovertemplate="query %{y}<br>key %{x}<br>p %{z:.4f}<extra></extra>"))
    figure.add_hline(y=trace.prompt_len - 0.5, line=dict(color="white", dash="dot", width=1))
    title = f"layer {layer}, head {head} (KV head {head // (trace.n_heads // trace.n_kv_heads)})"
    if rb > 1 or cb > 1:
        title += f": max over {rb} x {cb} blocks"
    figure.update_layout(title=title, xaxis_title="key position", yaxis_title="query position",
                         yaxis_autorange="reversed", width=650, height=600)
    return figure


def token_attention(trace, query: int, *, layers=None, heads=None, keys=None) -> torch.Tensor:
    """Attention of token `query` over `keys` (default: the prompt), averaged over layers and heads: (n_keys,)."""
    cols = positions(trace.prompt if keys is None else keys, trace.n_tokens)
    layers = trace.layers if layers is None else list(np.atleast_1d(layers))
    rows = [trace.attention(layer, heads=heads, queries=query, keys=cols)[:, 0].mean(0) for layer in layers]
    return torch.stack(rows).mean(0).cpu()


def spotlight(trace, query: int, *, layers=None, heads=None, skip_first: int = 1, top: int = 20,
              context: int | None = 8):
    """Which prompt tokens token `query` attends to: its top tokens in their context, bars, and the whole prompt.

    Averages over the given layers and heads. The first `skip_first` positions (the attention sink)
    are greyed out and left out of the colour scale, or they would take all the colour.
    context: tokens shown on each side of each of the `top` strongest tokens. The prompt opens as these
    excerpts (prompt order, gaps marked "…"), so the strongest tokens are in view however long the prompt is;
    the whole prompt follows, folded. context=None opens the whole prompt instead.
    Returns an IPython HTML object.
    """
    from IPython.display import HTML

    weights = token_attention(trace, query, layers=layers, heads=heads)
    scale = float(weights[skip_first:].max()) or 1.0
    order = (torch.argsort(weights[skip_first:], descending=True)[:top] + skip_first).tolist()
    rank = {position: r + 1 for r, position in enumerate(order)}

    def token(i: int) -> str:
        w = float(weights[i])
        style = "color:#999" if i < skip_first else f"background:rgba(255,140,0,{min(1.0, w / scale):.2f})"
        if i in rank:
            style += ";font-weight:bold"
        title = f"{i}: {w:.4f}" + (f" (top {rank[i]})" if i in rank else "")
        return f'<span title="{title}" style="{style}">{html.escape(trace.tokens[i])}</span>'

    box = '<div style="max-height:300px;overflow:auto;border:1px solid #ddd;padding:4px;white-space:pre-wrap">{}</div>'
    whole = box.format("".join(token(i) for i in range(trace.prompt_len)))
    if context is None:
        prompt = whole
    else:
        shown = sorted({j for i in order for j in range(max(0, i - context), min(trace.prompt_len, i + context + 1))})
        gap = '<span style="color:#888"> … </span>'
        pieces = [(gap if k and i != shown[k - 1] + 1 else "") + token(i) for k, i in enumerate(shown)]
        pieces = (([gap] if shown and shown[0] > 0 else []) + pieces
                  + ([gap] if shown and shown[-1] < trace.prompt_len - 1 else []))
        prompt = (f"<div>the top {len(order)} tokens (bold) with {context} tokens of context each:</div>"
                  + box.format("".join(pieces))
                  + f"<details><summary>the whole prompt ({trace.prompt_len} tokens)</summary>{whole}</details>")
    bars = "".join(
        f'<div style="font-family:monospace;white-space:pre">{i:>6} '
        f'<span style="display:inline-block;background:darkorange;'
        f'width:{300 * float(weights[i]) / scale:.0f}px">&nbsp;</span>'
        f' {float(weights[i]):.4f} {html.escape(repr(trace.tokens[i]))}</div>' for i in order)
    label = html.escape(repr(trace.tokens[query]))
    return HTML(
        f"<div><b>token {query} {label}</b> over the prompt (mean of "
        f"{len(trace.layers) if layers is None else len(np.atleast_1d(layers))} "
        f"layers, {'all' if heads is None else len(np.atleast_1d(heads))} heads; first {skip_first} grey)</div>"
        f"{prompt}<div><b>top {top}</b></div>{bars}")


def window_attention(trace, window: int = 32, *, layers=None) -> torch.Tensor:
    """Head-averaged attention of the last `window` prompt tokens over the prompt before them.

    Returns (n_layers, prompt_len - window): per layer, the window's column sums averaged over heads
    and divided by the window size (each row of the result sums to at most 1).
    """
    if window >= trace.prompt_len:
        raise ValueError(f"window {window} leaves no prompt before it (prompt has {trace.prompt_len} tokens)")
    start = trace.prompt_len - window
    layers = trace.layers if layers is None else layers
    return torch.stack([trace.column_sums(layer, queries=slice(start, trace.prompt_len))[:, :start].mean(0) / window
                        for layer in layers]).cpu()


def window_attention_figure(trace, window: int = 32, *, layers=None, max_cols: int = 1024) -> go.Figure:
    """Heatmap (layers x prompt positions, max-pooled) of `window_attention`, log colour scale."""
    layers = trace.layers if layers is None else layers
    pooled, _, cb = block_max(window_attention(trace, window, layers=layers), len(layers), max_cols)
    figure = go.Figure(go.Heatmap(
        z=np.log10(pooled.clamp(min=1e-6).numpy()), x=np.arange(0, pooled.shape[1]) * cb, y=layers,
        colorscale="Magma", colorbar=dict(title="log10 p"),
        hovertemplate="layer %{y}<br>position %{x}<br>log10 p %{z:.2f}<extra></extra>"))
    figure.update_layout(title=f"Attention of the last {window} prompt tokens over the prompt (mean over heads)",
                         xaxis_title="prompt position", yaxis_title="layer", width=900, height=450)
    return figure


def coverage_figure(table, *, sinks: str = "excluded") -> go.Figure:
    """Coverage and oracle per layer (mean over heads), with chance, from an `attention_coverage` table.

    One colour per policy when the table has a `policy` column (e.g. tables of several runs concatenated
    with a policy label): coverage solid, oracle dashed, chance dotted. `sinks` picks the table's variant
    ("excluded" or "kept"): the two are never averaged together.
    """
    from .coverage import sinks_rows

    rows = sinks_rows(table, sinks)
    groups = rows.groupby("policy", sort=False) if "policy" in rows.columns else [(None, rows)]
    palette = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"]
    figure = go.Figure()
    for i, (policy, part) in enumerate(groups):
        means = part.groupby("layer", sort=True)[["coverage", "oracle", "chance"]].mean()  # NaN heads are skipped
        colour = palette[i % len(palette)]
        for column, dash in (("coverage", "solid"), ("oracle", "dash"), ("chance", "dot")):
            name = column if policy is None else f"{policy} {column}"
            figure.add_trace(go.Scatter(x=means.index, y=means[column], mode="lines+markers", name=name,
                                        legendgroup=str(policy), line=dict(color=colour, dash=dash),
                                        hovertemplate=f"{name}<br>layer %{{x}}<br>%{{y:.3f}}<extra></extra>"))
    figure.update_layout(title=f"Share of the generation's prompt attention on the kept positions (sinks {sinks}, "
                               "mean over heads)", xaxis_title="layer", yaxis_title="share of prompt attention",
                         yaxis_range=[0, 1.02], width=900, height=450)
    return figure
