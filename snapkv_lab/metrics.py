"""Overlap between a selection of prefix positions and where attention actually goes.

Every metric here is a ratio numerator / support per (layer, head, window), reported with its chance
level: the expected numerator if the selection were a uniformly random set of the same size over the
same eligible positions. Tables are tidy (one row per layer, head, window, metric, sinks) and keep the
numerator, the chance numerator and the support, so that pooling over heads or layers stays exact:
value = sum(numerator) / sum(support). A cell whose support is below `min_support` is NaN: undefined,
never 0 or 1.

Metrics (attn: (heads, rows, prefix) softmax attention of generated rows over the prefix; sel: (heads,
prefix) bool mask of the selection):
- "hit_rate": the paper's H (v1 eqs. 7-8). Positions a row attends to above theta (0.05); the share of
  them inside the selection, pooled over the window's rows. support = positions above theta.
- "recall": theta-free. The share of a row's prefix attention mass that falls on the selection,
  averaged over rows. support = rows.
- "coarse": the original code's coarse variant. Positions whose mean attention over the window's rows
  is above 0.005, on both sides; overlap = |gen & obs| / |gen|. support = |gen|.
- "overlap": H(M_A, M_B) = |A & B| / |A| between two selections. support = |A|.

Sinks: with sinks="excluded", the sink positions leave both the selection and the attention: the first
`SinkRule.first` tokens, and any position taking at least `SinkRule.share` of the attention in every row
of the reference rows (per head). A finding that only holds with sinks kept is about the sink.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import torch

THETA = 0.05
COARSE_THRESHOLD = 0.005
MIN_SUPPORT = 5
COLUMNS = ["layer", "head", "window", "metric", "sinks", "numerator", "chance_numerator", "support", "value", "chance"]


@dataclass(frozen=True)
class SinkRule:
    """Which prefix positions count as attention sinks."""

    first: int = 4  # the first tokens (BOS, chat-template header): sinks in nearly every head
    share: float = 0.2  # or a position taking at least this share of attention in every reference row

    def mask(self, attn: torch.Tensor) -> torch.Tensor:
        """attn (heads, rows, prefix) -> (heads, prefix) bool, True at sinks."""
        sinks = (attn >= self.share).all(dim=1)
        sinks[:, : self.first] = True
        return sinks


def _ratio(numerator, chance_numerator, support, min_support) -> tuple[torch.Tensor, torch.Tensor]:
    undefined = support < min_support
    value = (numerator / support.clamp(min=1e-12)).masked_fill(undefined, float("nan"))
    chance = (chance_numerator / support.clamp(min=1e-12)).masked_fill(undefined, float("nan"))
    return value, chance


def hit_rate(attn, selected, *, theta=THETA, eligible=None) -> dict[str, torch.Tensor]:
    """Paper hit rate parts per head: numerator, chance_numerator, support, each (heads,).

    attn (heads, rows, prefix); selected, eligible (heads, prefix) bool (eligible: positions that count).
    """
    eligible = torch.ones_like(selected) if eligible is None else eligible
    above = (attn > theta) & eligible[:, None]
    hits = (above & selected[:, None]).sum(dim=(1, 2)).float()
    support = above.sum(dim=(1, 2)).float()
    chance_rate = (selected & eligible).sum(-1).float() / eligible.sum(-1).clamp(min=1).float()
    return dict(numerator=hits, chance_numerator=support * chance_rate, support=support)


def attention_recall(attn, selected, *, eligible=None) -> dict[str, torch.Tensor]:
    """Share of each row's eligible prefix mass on the selection, summed over rows (support = rows)."""
    eligible = torch.ones_like(selected) if eligible is None else eligible
    mass = (attn * eligible[:, None]).sum(-1)
    on_selection = (attn * (selected & eligible)[:, None]).sum(-1)
    share = on_selection / mass.clamp(min=1e-12)
    chance_rate = (selected & eligible).sum(-1).float() / eligible.sum(-1).clamp(min=1).float()
    rows = torch.full_like(chance_rate, attn.shape[1])
    return dict(numerator=share.sum(-1), chance_numerator=rows * chance_rate, support=rows)


def selection_overlap(a, b, *, eligible=None) -> dict[str, torch.Tensor]:
    """H(M_A, M_B) = |A & B| / |A| per head; a, b (heads, prefix) bool. Chance: B random of the same size."""
    eligible = torch.ones_like(a) if eligible is None else eligible
    a, b = a & eligible, b & eligible
    support = a.sum(-1).float()
    chance_rate = b.sum(-1).float() / eligible.sum(-1).clamp(min=1).float()
    return dict(numerator=(a & b).sum(-1).float(), chance_numerator=support * chance_rate, support=support)


def coarse_overlap(attn_generated, attn_window, *, threshold=COARSE_THRESHOLD, eligible=None) -> dict[str, torch.Tensor]:
    """Positions with mean attention above `threshold` over the generated rows vs over the window's rows."""
    generated = attn_generated.mean(1) > threshold
    observed = attn_window.mean(1) > threshold
    return selection_overlap(generated, observed, eligible=eligible)


def to_mask(indices: torch.Tensor, prefix_len: int) -> torch.Tensor:
    """(heads, k) positions -> (heads, prefix_len) bool, on the device of `indices`."""
    mask = torch.zeros(indices.shape[0], prefix_len, dtype=torch.bool, device=indices.device)
    return mask.scatter_(1, indices, True)


def metric_rows(parts: dict[str, torch.Tensor], *, layer, window, metric, sinks, min_support=MIN_SUPPORT) -> list[dict]:
    """One tidy row per head from a metric's parts."""
    value, chance = _ratio(parts["numerator"], parts["chance_numerator"], parts["support"], min_support)
    return [dict(layer=layer, head=h, window=window, metric=metric, sinks=sinks,
                 numerator=float(parts["numerator"][h]), chance_numerator=float(parts["chance_numerator"][h]),
                 support=float(parts["support"][h]), value=float(value[h]), chance=float(chance[h]))
            for h in range(len(value))]


def selection_vs_generation(attn, selected, *, layer, window, observed=None, theta=THETA, sink_rule=SinkRule(),
                            min_support=MIN_SUPPORT) -> list[dict]:
    """hit_rate, recall (and coarse, given `observed`) of one selection, sinks kept and excluded.

    attn: (heads, generated rows, prefix) attention of the generated rows over the prefix;
    selected: (heads, prefix) bool; observed: (heads, window rows, prefix) attention of the voting window.
    Sinks are found on `attn` with `sink_rule`.
    """
    sinks = sink_rule.mask(attn)
    rows = []
    for label, eligible in (("kept", None), ("excluded", ~sinks)):
        common = dict(layer=layer, window=window, sinks=label, min_support=min_support)
        rows += metric_rows(hit_rate(attn, selected, theta=theta, eligible=eligible), metric="hit_rate", **common)
        rows += metric_rows(attention_recall(attn, selected, eligible=eligible), metric="recall", **common)
        if observed is not None:
            rows += metric_rows(coarse_overlap(attn, observed, eligible=eligible), metric="coarse", **common)
    return rows


def summarise(table: pd.DataFrame, by=("layer", "window", "metric", "sinks"), min_support=MIN_SUPPORT) -> pd.DataFrame:
    """Pool a tidy metric table over the other columns (heads, samples): value = sum(num) / sum(support).

    Adds `defined` (support >= min_support) and `n_cells`; undefined values are NaN.
    """
    grouped = table.groupby(list(by), dropna=False, sort=True)
    out = grouped[["numerator", "chance_numerator", "support"]].sum()
    out["n_cells"] = grouped.size()
    out["defined"] = out["support"] >= min_support
    out["value"] = (out["numerator"] / out["support"]).where(out["defined"])
    out["chance"] = (out["chance_numerator"] / out["support"]).where(out["defined"])
    return out.reset_index()
