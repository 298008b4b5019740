"""Finding (e): does a kept set's attention coverage predict its causal coverage? From the every-policy study's table
(views.causal_study: one row per needle prompt, mode and policy).

On the prompts the full cache answers, per mode:
- per prompt, Spearman's rank correlation across the policies between attention coverage (sinks kept: the same
  context positions the causal side scores) and causal coverage; pooled as the mean over prompts with its 95% t
  interval over prompts (core.ratio_intervals: the prompt is the unit), the two-sided t test of 0 and TOST of
  |rho| < RHO_MARGIN; the Spearman of all rows pooled beside it (descriptive: rows of one prompt are not independent);
- per policy, its causal coverage, the causal oracle of as many entries and chance, with t intervals over prompts, and
  its gap to the oracle (oracle - coverage, paired by prompt) with TOST of |gap| < the findings' EQUIVALENCE_MARGIN.

Verdict, fixed before the study ran (2026-11-30): attention coverage *predicts* causal coverage where the mean
per-prompt rho's 95% interval lies above 0; it *does not* where TOST shows |rho| < RHO_MARGIN at level ALPHA;
*inverted* where the interval lies below 0; else *not shown either way*. A policy *sits at the oracle* where its gap
is shown inside +-EQUIVALENCE_MARGIN by TOST; a failure to reject is not that.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from scipy import stats

from ..core.ratio_intervals import linearised, standard_error, t_interval, t_test, tost
from .report import ALPHA, CI, EQUIVALENCE_MARGIN

# The margin of "no relation", fixed on 2026-11-30 before the study's rows existed: Cohen's (1988) boundary between a
# small and a medium correlation. A mean rank correlation shown inside +-0.3 is taken as no practical prediction.
RHO_MARGIN = 0.3


def share_interval(values: np.ndarray) -> dict:
    """mean_interval of per-prompt shares, its interval cut to [0, 1] as every share's is (overlap.summarise)."""
    out = mean_interval(values)
    return dict(out, ci_low=max(out["ci_low"], 0.0), ci_high=min(out["ci_high"], 1.0))


def mean_interval(values: np.ndarray, margin: float | None = None) -> dict:
    """The mean of per-prompt values (NaN: absent) with its CI t interval, the t test of 0 and, with a margin, the
    TOST p of |mean| < margin: the t interval of the per-unit values (linearised with equal supports)."""
    values = np.asarray(values, float)[None]
    estimate, residual = linearised(values, np.where(np.isnan(values), np.nan, 1.0))
    se, n = standard_error(residual)
    low, high = t_interval(estimate, se, n, CI)
    out = dict(value=float(estimate[0]), ci_low=float(low[0]), ci_high=float(high[0]), n=int(n[0]),
               p=float(t_test(estimate, se, n)[0]))
    if margin is not None:
        out["tost_p"] = float(tost(estimate, se, n, margin)[0])
    return out


def answered(table: pd.DataFrame) -> pd.DataFrame:
    """The rows of the prompts the full cache answers (the primary analysis); none is an error, not an empty verdict."""
    rows = table[table.full_correct.astype(bool)]
    if rows.empty:
        raise ValueError(f"the full cache answers none of the table's {table.prompt.nunique()} prompts: "
                         "no primary analysis to run")
    return rows


def per_prompt_rho(table: pd.DataFrame, x: str = "attention_coverage", y: str = "coverage") -> pd.DataFrame:
    """Spearman's rho across policies, one row per (mode, prompt): mode, prompt, rho, policies (those with both
    values). NaN where a side is constant (no ranking to compare)."""
    rows = []
    for (mode, prompt), part in table.groupby(["mode", "prompt"], sort=True):
        part = part[[x, y]].dropna()
        constant = part[x].nunique() < 2 or part[y].nunique() < 2
        rho = np.nan if constant else stats.spearmanr(part[x], part[y]).statistic
        rows.append(dict(mode=mode, prompt=prompt, rho=rho, policies=len(part)))
    return pd.DataFrame(rows)


def verdict(rho: dict) -> str:
    """The rule of the module doc, on a mean_interval of per-prompt rhos with RHO_MARGIN."""
    if rho["ci_low"] > 0:
        return "predicts"
    if rho["ci_high"] < 0:
        return "inverted"
    if rho.get("tost_p", np.nan) < ALPHA:
        return "does not predict"
    return "not shown either way"


def relation(table: pd.DataFrame, x: str = "attention_coverage") -> pd.DataFrame:
    """Per mode (and both modes, each prompt's mean rho over them): the mean per-prompt rho [CI], p, TOST p, verdict,
    and the pooled Spearman over all rows (descriptive), on the answered prompts. x: the attention measure
    (attention_coverage, sinks kept as on the causal side; attention_coverage_no_sinks, the secondary)."""
    table = answered(table)
    rhos = per_prompt_rho(table, x)
    both = rhos.groupby("prompt", as_index=False).rho.mean().assign(mode="both modes")
    out = []
    for mode, part in pd.concat([rhos, both]).groupby("mode", sort=False):
        summary = mean_interval(part.rho.to_numpy(), RHO_MARGIN)
        # a correlation lies in [-1, 1]: the t interval is cut there (its tests are not)
        summary.update(ci_low=max(summary["ci_low"], -1.0), ci_high=min(summary["ci_high"], 1.0))
        rows = table if mode == "both modes" else table[table["mode"] == mode]
        pooled = stats.spearmanr(rows[x], rows.coverage, nan_policy="omit")
        out.append(dict(mode=mode, **summary, verdict=verdict(summary), pooled_rho=float(pooled.statistic),
                        rows=len(rows)))
    return pd.DataFrame(out)


def per_policy(table: pd.DataFrame) -> pd.DataFrame:
    """Per (mode, policy) on the answered prompts: causal coverage, oracle, chance, attention coverage (means with t
    intervals over prompts), the gap to the oracle with its TOST p against EQUIVALENCE_MARGIN, the needle's kept share
    and the answers the policy gets right (of the prompts)."""
    out = []
    for (mode, policy), part in answered(table).groupby(["mode", "policy"], sort=False):
        causal = share_interval(part.coverage.to_numpy())
        attention = share_interval(part.attention_coverage.to_numpy())
        gap = mean_interval((part.oracle - part.coverage).to_numpy(), EQUIVALENCE_MARGIN)
        out.append(dict(mode=mode, policy=policy, coverage=causal["value"], coverage_low=causal["ci_low"],
                        coverage_high=causal["ci_high"], oracle=part.oracle.mean(), chance=part.chance.mean(),
                        attention_coverage=attention["value"], attention_low=attention["ci_low"],
                        attention_high=attention["ci_high"], gap=gap["value"], gap_low=gap["ci_low"],
                        gap_high=gap["ci_high"], gap_tost_p=gap["tost_p"], needle_kept=part.needle_kept.mean(),
                        correct=int(part.correct.sum()), prompts=len(part)))
    return pd.DataFrame(out)


def _p(p: float) -> str:
    return "n/a" if np.isnan(p) else f"{p:.2g}"


def _cell(value, low, high) -> str:
    return f"{value:.2f}" + ("" if np.isnan(low) else f" [{low:.2f}, {high:.2f}]")


def markdown(table: pd.DataFrame) -> str:
    """Finding (e)'s generated block: the relation per mode, then each policy's row per mode."""
    every = table.prompt.nunique()
    prompts = answered(table).prompt.nunique()
    lines = [f"{prompts} of {every} needle prompts answered by the full cache (the primary analysis); "
             f"{table.policy.nunique()} policies at ratio {table.ratio.iloc[0]:g}. Spearman's rho across policies "
             f"between attention coverage and causal coverage, per prompt, then its mean over prompts "
             f"[95% t interval]; TOST of |rho| < {RHO_MARGIN}:", "",
             "| attention side | mode | mean per-prompt rho | p (rho = 0) | TOST p | verdict | "
             "pooled rho (all rows, descriptive) |", "|---|---|---|---|---|---|---|"]
    measures = {"sinks kept (primary)": "attention_coverage", "sinks excluded": "attention_coverage_no_sinks"}
    for label, x in measures.items():
        for row in relation(table, x).itertuples():
            lines.append(f"| {label} | {row.mode} | {_cell(row.value, row.ci_low, row.ci_high)} (n {row.n}) | "
                         f"{_p(row.p)} | {_p(row.tost_p)} | {row.verdict} | {row.pooled_rho:.2f} ({row.rows} rows) |")
    policies = per_policy(table)
    wide = {mode: part.set_index("policy") for mode, part in policies.groupby("mode", sort=False)}
    modes = [mode for mode in ("query-agnostic", "query-aware") if mode in wide]
    lines += ["", "Per policy, means over the answered prompts [95% t interval]: causal coverage (share of the "
              "answer's eviction effect kept) / its causal oracle of as many entries; attention coverage of the same "
              "kept set; the needle's kept share; answers right. Sorted by query-agnostic causal coverage; chance is "
              f"the kept share ({policies.chance.median():.2f} median).", "",
              "| policy | " + " | ".join(f"{m}: causal / oracle | attention | needle kept | right" for m in modes)
              + " |", "|---" * (1 + 4 * len(modes)) + "|"]
    order = wide[modes[0]].sort_values("coverage", ascending=False).index
    for policy in order:
        cells = []
        for mode in modes:
            if policy not in wide[mode].index:
                cells += ["", "", "", ""]
                continue
            r = wide[mode].loc[policy]
            cells += [f"{_cell(r.coverage, r.coverage_low, r.coverage_high)} / {r.oracle:.2f}",
                      _cell(r.attention_coverage, r.attention_low, r.attention_high), f"{r.needle_kept:.2f}",
                      f"{r.correct}/{r.prompts}"]
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    at_oracle = policies[policies.gap_tost_p < ALPHA]
    lines += ["", f"Shown within ±{EQUIVALENCE_MARGIN} of the causal oracle (TOST, level {ALPHA}): "
              + (", ".join(f"{r.policy} ({r.mode})" for r in at_oracle.itertuples()) or "none") + "."]
    return "\n".join(lines)
