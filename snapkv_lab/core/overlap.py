"""Overlap between a selection of prefix positions and where attention actually goes.

Every metric here is a ratio numerator / support per (layer, head, segment), reported with its chance
level: the expected numerator if the selection were a uniformly random set of the same size over the
same eligible positions. Tables are tidy (one row per layer, head, segment, metric, sinks) and keep the
numerator, the chance numerator and the support, so that pooling over heads or layers stays exact:
value = sum(numerator) / sum(support). A cell whose support is below `min_support` is NaN: undefined,
never 0 or 1.

Metrics (attn: (heads, rows, prefix) softmax attention of generated rows over the prefix; sel: (heads,
prefix) bool mask of the selection):
- "hit_rate": the paper's H (v1 eqs. 7-8). Positions a row attends to above theta (0.05); the share of
  them inside the selection, pooled over the scored rows. support = positions above theta.
- "recall": theta-free. The share of a row's prefix attention mass that falls on the selection,
  averaged over rows. support = rows.
- "coarse": the original code's coarse variant. Positions whose mean attention over the generated rows
  and over the voters is above 0.005; overlap = |gen & obs| / |gen|. support = |gen|.
- "overlap": H(M_A, M_B) = |A & B| / |A| between two selections. support = |A|.

Sinks: with sinks="excluded", the sink positions leave both the selection and the attention. They are
defined once per prompt (`SinkRule.mask` on the attention of *all* its generated rows over the whole
prompt): the first `SinkRule.first` tokens, and any position taking at least `SinkRule.share` of the
attention in every generated row (per head). Every segment of that prompt uses the same set. A finding
that only holds with sinks kept is about the sink.

Intervals: `summarise(..., ci=0.95)` and `difference` give t intervals over samples (prompts or documents, the
`sample` column) of the pooled ratio and of a paired difference (`core.ratio_intervals`); a percentile bootstrap over
the samples (`method="percentile"`, `RESAMPLES` replicates) is kept only to compare: over 4-8 prompts it undercovers.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from . import ratio_intervals as intervals
from .moved import renamed

THETA = 0.05
COARSE_THRESHOLD = 0.005
MIN_SUPPORT = 5
RESAMPLES = 2000  # bootstrap replicates: the percentile interval's ends move by about 0.005 between seeds
COLUMNS = ["layer", "head", "segment", "metric", "sinks", "numerator", "chance_numerator", "support", "value", "chance"]
PARTS = ["numerator", "chance_numerator", "support"]
RENAMED = "2026-11-26"  # the findings' windows became segments (findings.legacy), and these keywords with them


@dataclass(frozen=True)
class SinkRule:
    """Which prompt positions count as attention sinks."""

    first: int = 4  # the first tokens (BOS, chat-template header): sinks in nearly every head
    share: float = 0.2  # or a position taking at least this share of attention in every reference row

    def mask(self, attn: torch.Tensor) -> torch.Tensor:
        """attn (heads, rows, positions) -> (heads, positions) bool, True at sinks.

        Position 0 of `attn` must be prompt position 0 (the first tokens are counted from it). Pass the
        attention of all of a prompt's generated rows, so that every segment of the prompt shares one set.
        """
        sinks = (attn >= self.share).all(dim=1)
        sinks[:, : self.first] = True
        return sinks


def _ratio(numerator, chance_numerator, support, min_support) -> tuple[torch.Tensor, torch.Tensor]:
    undefined = support < min_support
    value = (numerator / support.clamp(min=1e-12)).masked_fill(undefined, float("nan"))
    chance = (chance_numerator / support.clamp(min=1e-12)).masked_fill(undefined, float("nan"))
    return value, chance


def _chance_rate(selected: torch.Tensor, eligible: torch.Tensor) -> torch.Tensor:
    """(heads,) share of the eligible positions that the selection holds."""
    return (selected & eligible).sum(-1).double() / eligible.sum(-1).clamp(min=1).double()


def hit_rate(attn, selected, *, theta=THETA, eligible=None) -> dict[str, torch.Tensor]:
    """Paper hit rate parts per head: numerator, chance_numerator, support, each (heads,).

    attn (heads, rows, prefix); selected, eligible (heads, prefix) bool (eligible: positions that count).
    Counts are exact integers (held in float64).
    """
    return _hit_rate_parts((attn > theta).sum(dim=1, dtype=torch.float64), selected, eligible)


def _hit_rate_parts(above: torch.Tensor, selected, eligible=None) -> dict[str, torch.Tensor]:
    """hit_rate from above (heads, prefix): per position, the number of rows attending to it above theta."""
    eligible = torch.ones_like(selected) if eligible is None else eligible
    above = above.double()
    support = (above * eligible).sum(-1)
    hits = (above * (selected & eligible)).sum(-1)
    return dict(numerator=hits, chance_numerator=support * _chance_rate(selected, eligible), support=support)


def attention_recall(attn, selected, *, eligible=None) -> dict[str, torch.Tensor]:
    """Share of each row's eligible prefix mass on the selection, summed over rows (support = rows)."""
    eligible = torch.ones_like(selected) if eligible is None else eligible
    masks = torch.stack([eligible, selected & eligible], dim=-1).to(attn.dtype)  # (heads, prefix, 2)
    mass, on_selection = torch.bmm(attn, masks).unbind(-1)  # (heads, rows) each
    return _recall_parts(mass, on_selection, _chance_rate(selected, eligible))


def _recall_parts(mass: torch.Tensor, on_selection: torch.Tensor, chance_rate: torch.Tensor) -> dict[str, torch.Tensor]:
    """recall from each row's eligible mass and its mass on the selection, (heads, rows) each."""
    share = on_selection.double() / mass.double().clamp(min=1e-12)
    rows = torch.full_like(share[:, 0], share.shape[1])
    return dict(numerator=share.sum(-1), chance_numerator=rows * chance_rate, support=rows)


def selection_overlap(a, b, *, eligible=None) -> dict[str, torch.Tensor]:
    """H(M_A, M_B) = |A & B| / |A| per head; a, b (heads, prefix) bool. Chance: B random of the same size."""
    eligible = torch.ones_like(a) if eligible is None else eligible
    a, b = a & eligible, b & eligible
    support = a.sum(-1).double()
    return dict(numerator=(a & b).sum(-1).double(), chance_numerator=support * _chance_rate(b, eligible),
                support=support)


@renamed(RENAMED, attn_window="attn_voters")
def coarse_overlap(attn_generated, attn_voters, *, threshold=COARSE_THRESHOLD,
                   eligible=None) -> dict[str, torch.Tensor]:
    """Positions with mean attention above `threshold` over the generated rows vs over the voters' rows."""
    generated = attn_generated.mean(1) > threshold
    observed = attn_voters.mean(1) > threshold
    return selection_overlap(generated, observed, eligible=eligible)


def to_mask(indices: torch.Tensor, prefix_len: int) -> torch.Tensor:
    """(heads, k) positions -> (heads, prefix_len) bool, on the device of `indices`."""
    mask = torch.zeros(indices.shape[0], prefix_len, dtype=torch.bool, device=indices.device)
    return mask.scatter_(1, indices, True)


def metric_rows(parts: dict[str, torch.Tensor], *, metric, sinks, min_support=MIN_SUPPORT, **columns) -> list[dict]:
    """One tidy row per head from a metric's parts; `columns` (layer, segment, ...) go first in every row."""
    value, chance = _ratio(parts["numerator"], parts["chance_numerator"], parts["support"], min_support)
    lists = {name: parts[name].tolist() for name in PARTS}
    value, chance = value.tolist(), chance.tolist()
    return [dict(columns, head=h, metric=metric, sinks=sinks,
                 **{name: lists[name][h] for name in PARTS}, value=value[h], chance=chance[h])
            for h in range(len(value))]


@renamed(RENAMED, windows="segments")
def selection_vs_generation(attn, selections: dict, *, sinks, segments: dict | None = None, observed=None, theta=THETA,
                            min_support=MIN_SUPPORT, **columns) -> list[dict]:
    """hit_rate, recall (and coarse, given `observed`) of selections against segments of generated rows, sinks kept
    and excluded: one row per (segment, selection, metric, sinks variant, head).

    attn: (heads, generated rows, prefix) attention of the generated rows over the prefix;
    selections: {label: (heads, prefix) bool}; segments: {label: slice of attn's rows} (default {None: all});
    sinks: (heads, prefix) bool, the prompt's sinks (`SinkRule.mask` of all its generated rows, cut to the prefix);
    observed: (heads, voters, prefix) attention of the voters (the observation window), for "coarse" (one per selection:
    it does not depend on the selection). Rows get segment=<segments key>, selection=<selections key> and `columns`.
    The attention is reduced once per call (counts above theta, row masses on every mask), so scoring many
    selections costs little more than one.
    """
    segments = {None: slice(None)} if segments is None else segments
    eligible = {"kept": torch.ones_like(sinks), "excluded": ~sinks}
    labels = list(selections)
    masks = [eligible[e] & selections[s] for e in eligible for s in labels] + list(eligible.values())
    masses = torch.bmm(attn, torch.stack(masks, dim=-1).to(attn.dtype))  # (heads, rows, masks)
    above = attn > theta
    observed_above = None if observed is None else observed.mean(1) > COARSE_THRESHOLD
    rows = []
    for segment, rows_of_segment in segments.items():
        counts = above[:, rows_of_segment].sum(dim=1, dtype=torch.float64)  # (heads, prefix)
        segment_masses = masses[:, rows_of_segment]
        generated_above = None if observed is None else attn[:, rows_of_segment].mean(1) > COARSE_THRESHOLD
        for e, (variant, allowed) in enumerate(eligible.items()):
            mass = segment_masses[..., len(masks) - len(eligible) + e]
            # coarse_overlap, with both means taken once per segment
            coarse = None if observed is None else selection_overlap(generated_above, observed_above, eligible=allowed)
            for s, label in enumerate(labels):
                selected = selections[label]
                common = dict(columns, segment=segment, selection=label, sinks=variant, min_support=min_support)
                rows += metric_rows(_hit_rate_parts(counts, selected, allowed), metric="hit_rate", **common)
                rows += metric_rows(_recall_parts(mass, segment_masses[..., e * len(labels) + s],
                                                  _chance_rate(selected, allowed)), metric="recall", **common)
                if coarse is not None:
                    rows += metric_rows(coarse, metric="coarse", **common)
    return rows


@renamed(RENAMED, windows="segments")
def hindsight_oracle(attn, reference, *, sinks, segments: dict | None = None, theta=THETA, min_support=MIN_SUPPORT,
                     **columns) -> list[dict]:
    """The hindsight oracle: per head, the k eligible prefix positions (k: as many as the reference selection holds)
    that score best against the scored rows' own attention. hit_rate and recall both add up over positions (a
    position's count of rows above theta; its share of each row's eligible mass, summed over rows), so the best set is
    the top k of those sums: an upper bound that no selection of k positions can pass, sinks kept or excluded. Rows as
    `selection_vs_generation`'s, with selection="oracle" (no coarse rows: coarse does not depend on a selection).

    attn: (heads, generated rows, prefix); reference: (heads, prefix) bool, the selection whose size the oracle takes;
    sinks: (heads, prefix) bool; segments as there.
    """
    segments = {None: slice(None)} if segments is None else segments
    rows = []
    for segment, rows_of_segment in segments.items():
        block = attn[:, rows_of_segment].double()
        counts = (block > theta).sum(dim=1, dtype=torch.float64)  # (heads, prefix)
        for variant, allowed in (("kept", torch.ones_like(sinks)), ("excluded", ~sinks)):
            size = torch.minimum(reference.sum(-1), allowed.sum(-1))  # (heads,)
            eligible_mass = (block * allowed[:, None]).sum(-1, keepdim=True).clamp(min=1e-12)
            shares = (block * allowed[:, None] / eligible_mass).sum(1)  # (heads, prefix): summed over rows
            chance_rate = size.double() / allowed.sum(-1).clamp(min=1).double()
            common = dict(columns, segment=segment, selection="oracle", sinks=variant, min_support=min_support)
            for metric, weights in (("hit_rate", counts), ("recall", shares)):
                weights = weights.masked_fill(~allowed, 0)
                support = weights.sum(-1) if metric == "hit_rate" else torch.full_like(chance_rate, block.shape[1])
                best = _top_sums(weights, size)
                rows += metric_rows(dict(numerator=best, chance_numerator=support * chance_rate, support=support),
                                    metric=metric, **common)
    return rows


def _top_sums(weights: torch.Tensor, size: torch.Tensor) -> torch.Tensor:
    """(heads, n) non-negative weights, (heads,) counts -> (heads,) the sum of each head's `size` largest weights."""
    cumulative = torch.cat([torch.zeros_like(weights[:, :1]), weights.sort(-1, descending=True).values.cumsum(-1)], -1)
    return cumulative.gather(1, size.long()[:, None]).squeeze(1)


# ---- pooling and intervals -------------------------------------------------------------------------
# interval methods: core.ratio_intervals' t interval; the percentile bootstrap, for comparison
METHODS = ("t", "percentile")


def _check_method(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")


def _per_unit(table: pd.DataFrame, by: list[str], unit: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """numerator and support summed per group and unit: two (groups, units) frames indexed by `by`, NaN where a group
    lacks a unit."""
    if unit not in table:
        raise ValueError(f"intervals run over the {unit!r} column, which this table lacks (columns: {list(table)})")
    sums = table.groupby([*by, unit], dropna=False, sort=True)[["numerator", "support"]].sum()
    return sums["numerator"].unstack(unit), sums["support"].unstack(unit)


def summarise(table: pd.DataFrame, by=("layer", "segment", "metric", "sinks"), min_support=MIN_SUPPORT, *,
              ci: float | None = None, method: str = "t", resamples: int = RESAMPLES, seed: int = 0,
              unit: str = "sample") -> pd.DataFrame:
    """Pool a tidy metric table over the other columns (heads, samples): value = sum(num) / sum(support).

    Adds `defined` (support >= min_support) and `n_cells`; undefined values are NaN.
    ci (e.g. 0.95) adds `ci_low`, `ci_high`, `se` and `n_samples` over the samples (distinct values of the `unit`
    column) in each group. method "t" (default): the t interval of the pooled ratio over the samples
    (`core.ratio_intervals`: linearised, n - 1 degrees of freedom; with equal supports the t interval of the per-sample
    values, cut to [0, 1] as every metric here is a share), NaN for an undefined value or fewer than 2 samples.
    method "percentile": the percentile interval over
    `resamples` bootstrap replicates of the samples, drawn with numpy's default_rng(seed), replicates whose pooled
    support is below min_support left out (kept to show that it undercovers; `se` is then NaN).
    """
    _check_method(method)
    by = list(by)
    grouped = table.groupby(by, dropna=False, sort=True)
    out = grouped[PARTS].sum()
    out["n_cells"] = grouped.size()
    out["defined"] = out["support"] >= min_support
    out["value"] = (out["numerator"] / out["support"]).where(out["defined"])
    out["chance"] = (out["chance_numerator"] / out["support"]).where(out["defined"])
    if ci is not None:
        if method == "t":
            numerator, support = _per_unit(table, by, unit)
            ratio, residual = intervals.linearised(numerator.to_numpy(), support.to_numpy())
            se, n = intervals.standard_error(residual)
            low, high = intervals.t_interval(ratio, se, n, ci)
            low, high = np.clip(low, 0, 1), np.clip(high, 0, 1)  # every metric here is a share: its interval too
            index = numerator.index
            out["se"] = pd.Series(se, index=index).reindex(out.index).where(out["defined"])
            out["n_samples"] = pd.Series(n, index=index).reindex(out.index)
            out["ci_low"] = pd.Series(low, index=index).reindex(out.index).where(out["defined"])
            out["ci_high"] = pd.Series(high, index=index).reindex(out.index).where(out["defined"])
        else:
            replicates, n_samples = _bootstrap(table, by, unit, resamples=resamples, seed=seed, min_support=min_support)
            out["se"], out["n_samples"] = np.nan, n_samples.reindex(out.index)
            low, high = _percentiles(replicates.reindex(out.index).to_numpy(), ci)
            out["ci_low"], out["ci_high"] = low, high
    return out.reset_index()


def difference(table: pd.DataFrame, between: tuple[str, object, object], by=("layer", "metric", "sinks"),
               min_support=MIN_SUPPORT, *, ci: float = 0.95, method: str = "t", resamples: int = RESAMPLES,
               seed: int = 0, unit: str = "sample") -> pd.DataFrame:
    """value(a) - value(b) per group, paired over samples: between = (column, a, b).

    Only samples present on both sides count. method "t" (default): the t interval of the paired difference
    (`core.ratio_intervals`: each sample's linearised residual on side a minus its residual on side b; with equal
    supports the t interval of the per-sample differences), with `se` and `p`, the two-sided t test of a zero difference
    (n - 1 degrees of freedom). method "percentile": each bootstrap replicate draws samples once and pools both
    sides over the same draw; its percentile interval (`se` and `p` NaN).
    Returns the `by` columns, value_a, value_b, difference, ci_low, ci_high, se, p, n_samples.
    """
    _check_method(method)
    column, a, b = between
    by = [c for c in by if c != column]
    sides = {}
    for label, level in (("a", a), ("b", b)):
        part = table[table[column] == level]
        if part.empty:
            raise ValueError(f"no rows with {column} == {level!r}; it holds {sorted(table[column].unique())}")
        sides[label] = part
    common = set(sides["a"][unit]) & set(sides["b"][unit])
    sides = {label: part[part[unit].isin(common)] for label, part in sides.items()}
    point = {label: summarise(part, by, min_support).set_index(by)["value"] for label, part in sides.items()}
    index = point["a"].index.intersection(point["b"].index)
    out = pd.DataFrame(dict(value_a=point["a"].reindex(index), value_b=point["b"].reindex(index)), index=index)
    out["difference"] = out["value_a"] - out["value_b"]
    if method == "t":
        residuals = {}
        for label, part in sides.items():
            numerator, support = _per_unit(part, by, unit)
            residuals[label] = pd.DataFrame(intervals.linearised(numerator.to_numpy(), support.to_numpy())[1],
                                            index=numerator.index, columns=numerator.columns)
        units = residuals["a"].columns.intersection(residuals["b"].columns)
        paired = (residuals["a"].reindex(index=index, columns=units)
                  - residuals["b"].reindex(index=index, columns=units))
        se, n = intervals.standard_error(paired.to_numpy())
        estimate = out["difference"].to_numpy()
        out["ci_low"], out["ci_high"] = intervals.t_interval(estimate, se, n, ci)
        out["se"], out["p"], out["n_samples"] = se, intervals.t_test(estimate, se, n), n
    else:
        replicates = {}
        for label, part in sides.items():
            replicates[label], n_samples = _bootstrap(part, by, unit, resamples=resamples, seed=seed,
                                                      min_support=min_support)
        low, high = _percentiles(
            replicates["a"].reindex(index).to_numpy() - replicates["b"].reindex(index).to_numpy(), ci)
        out["ci_low"], out["ci_high"], out["se"], out["p"] = low, high, np.nan, np.nan
        out["n_samples"] = n_samples.reindex(index)
    return out.reset_index()


def _bootstrap(table: pd.DataFrame, by: list[str], unit: str, *, resamples: int, seed: int,
               min_support: float) -> tuple[pd.DataFrame, pd.Series]:
    """Bootstrap replicates of the pooled ratio: ((groups, resamples) DataFrame indexed by `by`, samples per group).

    Groups holding the same samples share one draw, so a replicate is one resampling of the prompts applied
    to every statistic, and two tables over the same samples (see `difference`) get the same draws.
    """
    numerator, support = _per_unit(table, by, unit)
    present = support.notna().to_numpy()
    replicates = np.full((len(support), resamples), np.nan)
    patterns: dict[bytes, list[int]] = {}
    for row, pattern in enumerate(present):
        patterns.setdefault(pattern.tobytes(), []).append(row)
    for rows in patterns.values():
        columns = np.flatnonzero(present[rows[0]])
        counts = resample_counts(len(columns), resamples, seed)  # (resamples, samples)
        pooled_numerator = numerator.to_numpy()[np.ix_(rows, columns)] @ counts.T
        pooled_support = support.to_numpy()[np.ix_(rows, columns)] @ counts.T
        with np.errstate(divide="ignore", invalid="ignore"):
            replicates[rows] = np.where(pooled_support >= min_support, pooled_numerator / pooled_support, np.nan)
    index = support.index
    return pd.DataFrame(replicates, index=index), pd.Series(present.sum(1), index=index)


def resample_counts(n_samples: int, resamples: int, seed: int) -> np.ndarray:
    """(resamples, n_samples) how often each sample is drawn in each replicate: replicate r draws
    default_rng(seed).integers(0, n_samples, (resamples, n_samples))[r], n_samples draws with replacement."""
    draws = np.random.default_rng(seed).integers(0, n_samples, size=(resamples, n_samples))
    counts = np.zeros((resamples, n_samples))
    np.add.at(counts, (np.arange(resamples)[:, None], draws), 1)
    return counts


def _percentiles(replicates: np.ndarray, ci: float) -> tuple[np.ndarray, np.ndarray]:
    """(groups, resamples) -> the (1 - ci) / 2 and (1 + ci) / 2 quantiles per group, NaN where none is defined."""
    if not 0 < ci < 1:
        raise ValueError(f"ci must lie in (0, 1), got {ci}")
    if replicates.size == 0:
        return np.array([]), np.array([])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN groups: undefined, reported as NaN
        low, high = np.nanquantile(replicates, [(1 - ci) / 2, (1 + ci) / 2], axis=1)
    return low, high
