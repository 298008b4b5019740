"""Why SnapKV loses needles at a 25% budget: its design choices one at a time, and the other methods, on the dev
needles, each run explained by the attention it kept (`snapkv-lab needle --suites ablations`).

Every run of the ablation table carries, besides its answer, what `coverage.attention_coverage` and
`coverage.span_attention` measure against a full-cache capture of the same prompt and answer:

    coverage, oracle, chance   share of the answer's prompt attention on the kept positions, on the best fixed set
                               of that size, and k / prompt (sinks excluded; mean over layers and query heads)
    value_attention            share of the answer's prompt attention on the needle value's tokens
    value_attention_kept       the part of it on kept value tokens (<= value_attention)
"""

from __future__ import annotations

import pandas as pd
import torch

from ..compression.kept import kept_mask
from ..core.capture import capture
from ..policies import TOVA, AdaKV, ChunkKV, CriticalKV, ExpectedAttention, KNorm, PyramidKV, SnapKV, StreamingLLM
from ..tasks.needles import Context, Query
from ..views.coverage import GenerationAttention, attention_coverage, sinks_rows, span_attention
from .intervals import accuracy_intervals

ABLATION_LENGTH = 4000
ABLATION_CAPACITY = 1024  # 25% of the prompt
ABLATION_SAMPLES = 1  # haystacks per needle depth (the needle grid's first, a dev needle): 5 prompts per cell
# New tokens per answer, and of the full-cache capture the runs are explained by: a 7-digit value is 7 tokens, and a
# wrong answer is wrong by then (24, the grid's, would double the decoding of 40 runs per context).
ANSWER_TOKENS = 12

# axis -> setting -> policy. SnapKV's defaults (window 32, max pooling with kernel 7, GQA mean, one selection per
# KV head) appear once on every axis: the run is shared, the table repeats it per axis.
# The observation window's axis is the `windows` suite (data/pressure_windows.csv, the same needles and budget).
AXES: dict[str, dict[str, object]] = {
    "kernel": {str(k): SnapKV(kernel_size=k) for k in (1, 3, 7, 15, 31)},
    "pooling": {"max": SnapKV(), "avg": SnapKV(pooling="avg")},
    "gqa": {"mean": SnapKV(), "max": SnapKV(gqa="max")},
    "layout": {"per KV head": SnapKV(), "per query head": SnapKV(per_query_head=True)},
    # H2O and random keep find no needle at 1024 of 4000 in the needle grid: left out here. So is KVzip: its
    # reconstruction pass costs 5-8 prefills (two per context, both modes); notebook 04 runs it on one needle.
    "method": {p.name: p for p in (SnapKV(), PyramidKV(), AdaKV(), TOVA(), KNorm(), ChunkKV(), CriticalKV(),
                                   ExpectedAttention(), StreamingLLM())},
}


def ablation_policies() -> list:
    """Every distinct policy of AXES (by scorer_label), in order of first appearance."""
    return list({p.scorer_label: p for settings in AXES.values() for p in settings.values()}.values())


def coverage_describer(model, tokenizer):
    """A `run_retrieval(describe=...)` function: coverage columns (module doc) of each run, from one full-cache
    capture per question (its prompt and greedy answer), made when the question is first described."""
    reduced: dict[int, GenerationAttention] = {}

    def describe(context: Context, query: Query, state, n_compressed: int) -> dict:
        if id(query) not in reduced:
            prompt = torch.tensor([context.context_ids + query.question_ids], device=model.device)
            reduced.clear()  # one question at a time
            trace = capture(model, tokenizer, prompt, max_new_tokens=ANSWER_TOKENS, progress=False)
            reduced[id(query)] = GenerationAttention(trace)
        attention = reduced[id(query)]
        kept = kept_mask(state, attention.trace.prompt_len, whole_from=n_compressed)
        covered = sinks_rows(attention_coverage(attention, kept), "excluded")
        on_value = span_attention(attention, query.value_span, kept)
        return dict(coverage=covered.coverage.mean(), oracle=covered.oracle.mean(), chance=covered.chance.mean(),
                    value_attention=on_value.span_share.mean(), value_attention_kept=on_value.span_kept_share.mean())

    return describe


def ablation_table(table: pd.DataFrame) -> pd.DataFrame:
    """Found / asked with Wilson intervals (both grades), mean value tokens kept and coverage columns, per axis,
    setting and mode; the full cache's row on top of each axis and mode."""
    means = ["value_kept", "coverage", "oracle", "chance", "value_attention", "value_attention_kept"]
    rows = []
    for axis, settings in AXES.items():
        for setting, policy in [("full cache", None), *settings.items()]:
            for mode in ("query-aware", "query-agnostic"):
                part = table[table["mode"] == "full"] if policy is None else \
                    table[(table.policy == policy.scorer_label) & (table["mode"] == mode)]
                if part.empty:
                    continue
                found = accuracy_intervals(part.assign(group=0), by=("group",)).iloc[0].drop("group")
                rows.append(dict(axis=axis, setting=setting, mode=mode, **found,
                                 **{c: part[c].mean() for c in means if c in part}))
    return pd.DataFrame(rows)


PREDICTORS = {
    "coverage": "share of the answer's prompt attention on kept positions (sinks excluded)",
    "coverage_of_oracle": "coverage / oracle: the share of the best same-size set's coverage reached",
    "value_kept": "fraction of the needle value's tokens kept (mean over layers and KV heads)",
    "value_served": "share of the answer's attention to the needle value that falls on kept value tokens",
}


def retrieval_predictors(table: pd.DataFrame, grade: str = "correct") -> pd.DataFrame:
    """Does a run's coverage predict whether it retrieves the needle? Over the compressed runs of `table`, per
    predictor of PREDICTORS: found and missed runs, each group's mean, and the AUC, the probability that a
    found run scores higher than a missed one (ties count half; 0.5 is chance, 1 perfect separation)."""
    runs = table[table["mode"] != "full"].assign(
        coverage_of_oracle=lambda t: t.coverage / t.oracle if "oracle" in t else float("nan"),
        value_served=lambda t: t.value_attention_kept / t.value_attention if "value_attention" in t else float("nan"))
    found = runs[grade].astype(bool)
    rows = []
    for name in PREDICTORS:
        values = runs[name].astype(float)
        ok = values.notna()
        ranks = values[ok].rank()  # average ranks for ties: the Mann-Whitney U with half credit
        n_found, n_missed = int(found[ok].sum()), int((~found[ok]).sum())
        u = ranks[found[ok]].sum() - n_found * (n_found + 1) / 2
        auc = u / (n_found * n_missed) if n_found and n_missed else float("nan")
        rows.append(dict(predictor=name, found=n_found, missed=n_missed, mean_found=values[ok & found].mean(),
                         mean_missed=values[ok & ~found].mean(), auc=auc))
    return pd.DataFrame(rows)
