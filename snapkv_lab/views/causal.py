"""How much of the answer's eviction effect a policy's kept positions protect: coverage on the causal side.

    effects = span_effects(model, tokenizer, context, question)     # per block: KL of evicting it
    run = generate(model, tokenizer, context, question=question, policy=SnapKV(capacity=0.25))
    causal_coverage(effects, run)        # {"coverage": ..., "oracle": ..., "chance": ..., "kept_share": ...}

Where `attention_coverage` asks how much of the generation's attention the kept positions would serve, this asks
how much of what the answer needs they keep. Each span's effect (its KL, or any non-negative column of the
span_effects table) is protected in proportion to the share of its KV entries the policy keeps (over layers and
heads); effects are taken as additive over spans, a first-order reading that span_effects' pairs can check:
- coverage = sum over spans of effect x kept share of the span / total effect;
- oracle = the same for the best set of as many entries, filled greedily by effect per position (the exact
  maximum of this additive coverage over sets of that size: a fractional knapsack);
- chance = kept entries / all entries: what a random set of that size protects in expectation.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from ..compression.kept import kept_mask


def causal_coverage(effects: pd.DataFrame, kept, *, effect: str = "kl", n_tokens: int | None = None) -> dict:
    """{"coverage", "oracle", "chance", "kept_share", "total_effect"} of the kept positions against `effects` (a
    span_effects table over disjoint spans of the context). kept: a GenerationResult, a CompressionState after its
    prefill, kept_indices, or a (layers, heads, n) bool mask of kept context positions; n_tokens: the context's
    length (default: the last span's end)."""
    if effects.empty:
        raise ValueError("effects holds no span")
    values = effects[effect].to_numpy(dtype=float)
    if np.isnan(values).any() or (values < 0).any():
        raise ValueError(f"the {effect!r} column has negative or missing effects: coverage needs a non-negative "
                         "measure (kl)")
    n = int(effects.end.max()) if n_tokens is None else n_tokens
    spans = effects[["start", "end"]].sort_values("start").to_numpy()
    if (spans[:, 0] < 0).any() or (spans[:, 1] <= spans[:, 0]).any() or (spans[1:, 0] < spans[:-1, 1]).any() or \
            spans[:, 1].max() > n:
        raise ValueError(f"effects' spans must be disjoint (start, end) positions within the {n}-token context: an "
                         "overlap would count one position's effect twice, in the coverage and the oracle")
    mask = kept if isinstance(kept, torch.Tensor) else kept_mask(kept, n)
    if mask.shape[-1] < n:
        raise ValueError(f"the kept mask covers {mask.shape[-1]} positions, fewer than the {n}-token context")
    share = mask[..., :n].float().mean(dim=tuple(range(mask.ndim - 1)))  # (n,) kept share of each position
    lengths = (effects.end - effects.start).to_numpy(dtype=float)
    span_share = [float(share[s:e].mean()) for s, e in zip(effects.start, effects.end, strict=True)]
    total = values.sum()
    kept_entries = float(share.sum())  # in positions' worth of entries
    # the oracle fills the same number of positions with the spans of the largest effect per position
    room, protected = kept_entries, 0.0
    for index in sorted(range(len(values)), key=lambda i: values[i] / lengths[i], reverse=True):
        take = min(room, lengths[index])
        protected += values[index] * take / lengths[index]
        room -= take
        if room <= 0:
            break
    coverage = float((values * span_share).sum() / total) if total > 0 else float("nan")
    return dict(coverage=coverage, oracle=protected / total if total > 0 else float("nan"), chance=kept_entries / n,
                kept_share=kept_entries / n, total_effect=float(total))


def policies_against_effects(model, tokenizer, context, question, effects: pd.DataFrame, policies, *,
                             trace=None, max_new_tokens: int = 16) -> pd.DataFrame:
    """One row per policy, each compressing `context` alone and answering `question` after it (query-agnostic, as
    span_effects feeds it): its answer, causal coverage, oracle and chance (causal_coverage against `effects`), and
    with `trace` (the full cache's: the context as its prompt, the question and answer teacher-forced after it) its
    attention coverage of those rows over layers and heads, sinks excluded (views.coverage)."""
    from ..compression.generation import generate
    from .coverage import attention_coverage, coverage_summary

    ids = context if isinstance(context, torch.Tensor) else torch.tensor([context])
    rows = []
    for policy in policies:
        run = generate(model, tokenizer, ids, policy=policy, question=question, max_new_tokens=max_new_tokens)
        row = dict(policy=policy.label, answer=run.text, **causal_coverage(effects, run, n_tokens=ids.shape[1]))
        if trace is not None:
            summary = coverage_summary(attention_coverage(trace, run).assign(policy=policy.label)).iloc[0]
            row.update(attention_coverage=summary.coverage, attention_oracle=summary.oracle)
        rows.append(row)
    return pd.DataFrame(rows)


def span_effects_figure(effects: pd.DataFrame, *, column: str = "kl", marked: tuple[int, int] | None = None,
                        kept: dict | None = None):
    """A plotly bar per span of its effect (`column`), the spans whose eviction changes the answer in a darker
    colour; `marked` (start, end) shaded (a needle); kept: {label: GenerationResult or kept mask} drawn as each
    policy's kept share per span on a second axis."""
    import plotly.graph_objects as go

    middle = (effects.start + effects.end) / 2
    colours = ["#7a1f5c" if changed else "#c9a3bd" for changed in effects.get("answer_changed", [False] * len(effects))]
    figure = go.Figure(go.Bar(x=middle, y=effects[column], width=(effects.end - effects.start) * 0.9,
                              marker_color=colours, name=f"{column} of evicting the span (dark: answer changes)"))
    for label, held in (kept or {}).items():
        n = int(effects.end.max())
        mask = held if isinstance(held, torch.Tensor) else kept_mask(held, n)
        share = mask[..., :n].float().mean(dim=tuple(range(mask.ndim - 1)))
        spans = [float(share[s:e].mean()) for s, e in zip(effects.start, effects.end, strict=True)]
        figure.add_trace(go.Scatter(x=middle, y=spans, mode="lines", name=f"{label}: kept share", yaxis="y2"))
    if marked is not None:
        figure.add_vrect(x0=marked[0], x1=marked[1], fillcolor="gold", opacity=0.35, line_width=0)
    figure.update_layout(xaxis_title="context position", yaxis_title=column, height=420,
                         yaxis2=dict(title="kept share", overlaying="y", side="right", range=[0, 1.05]),
                         legend=dict(orientation="h", y=-0.25))
    return figure
