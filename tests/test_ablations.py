"""The ablation suite: its coverage columns against attention_coverage of a fresh generate + capture, its table."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from conftest import make_tiny_llama

import snapkv_lab as sl
from snapkv_lab.coverage import sinks_rows  # the old path binds snapkv_lab.coverage, which the test reads
from snapkv_lab.pressure import Context, Query, run_retrieval
from snapkv_lab.pressure.ablations import (
    ANSWER_TOKENS,
    AXES,
    ablation_policies,
    ablation_table,
    coverage_describer,
    retrieval_predictors,
)

WINDOW, CAPACITY = 8, 40


def _context(g):
    context = torch.randint(2, 256, (100,), generator=g).tolist()
    question = torch.randint(2, 256, (10,), generator=g).tolist()
    return Context(context, [Query(question, "7", (40, 50), (44, 47))], dict(task="unit", length=110))


@pytest.mark.parametrize("mode", ["query-aware", "query-agnostic"])
def test_coverage_columns_match_a_fresh_generate_and_capture(mode, byte_tokenizer):
    model = make_tiny_llama("sdpa", initializer_range=0.3)
    ctx = _context(torch.Generator().manual_seed(5))
    query = ctx.queries[0]
    policy = sl.SnapKV(window_size=WINDOW, capacity=CAPACITY)
    table = run_retrieval(model, byte_tokenizer, [ctx], policies=[policy], capacities=(CAPACITY,), modes=(mode,),
                          max_new_tokens=4, progress=False, describe=coverage_describer(model, byte_tokenizer))
    row = table[table["mode"] == mode].iloc[0]
    full = table[table["mode"] == "full"].iloc[0]

    prompt = torch.tensor([ctx.context_ids + query.question_ids])
    n_context, n = len(ctx.context_ids), prompt.shape[1]
    trace = sl.capture(model, byte_tokenizer, prompt, max_new_tokens=ANSWER_TOKENS, progress=False)
    if mode == "query-aware":
        kept = sl.generate(model, byte_tokenizer, prompt, policy=policy, max_new_tokens=1).kept_indices
    else:  # the context compressed alone; the question appended in full afterwards
        context_kept = sl.generate(model, byte_tokenizer, prompt[:, :n_context], policy=policy, max_new_tokens=1,
                                   question=query.question_ids).kept_indices
        kept = [torch.cat([k, torch.arange(n_context, n).expand(*k.shape[:2], -1)], dim=-1) for k in context_kept]
    expected = sinks_rows(sl.attention_coverage(trace, kept), "excluded")
    value = sl.coverage.span_attention(trace, query.value_span, kept)
    assert row.coverage == pytest.approx(expected.coverage.mean(), abs=1e-6)
    assert row.oracle == pytest.approx(expected.oracle.mean(), abs=1e-6)
    assert row.chance == pytest.approx(expected.chance.mean(), abs=1e-6)
    assert row.value_attention_kept == pytest.approx(value.span_kept_share.mean(), abs=1e-6)
    assert row.value_attention == pytest.approx(full.value_attention, abs=1e-6)
    assert row.coverage < row.oracle <= 1
    assert (full.coverage == pytest.approx(1.0, abs=1e-5)
            and full.value_attention_kept == pytest.approx(full.value_attention))


def test_ablation_table_counts_each_axis_with_the_shared_default():
    policies = ablation_policies()
    assert len({p.scorer_label for p in policies}) == len(policies)
    rows = [dict(policy="FullCache", mode="full", correct=True, exact=True, value_kept=1.0)] * 5
    for p in policies:
        for mode in ("query-aware", "query-agnostic"):
            found = p.scorer_label == "SnapKV(kernel_size=31)" and mode == "query-aware"
            rows += [dict(policy=p.scorer_label, mode=mode, correct=found or i == 0, exact=found, value_kept=0.5)
                     for i in range(5)]
    table = ablation_table(pd.DataFrame(rows))
    kernel = table[(table.axis == "kernel") & (table["mode"] == "query-aware")].set_index("setting")
    assert list(kernel.index) == ["full cache", "1", "3", "7", "15", "31"]
    assert kernel.loc["31", "correct"] == 5 and kernel.loc["7", "correct"] == 1 and kernel.loc["7", "exact"] == 0
    low, high = sl.pressure.wilson(1, 5)
    assert (kernel.loc["7", "correct_low"], kernel.loc["7", "correct_high"]) == pytest.approx((low, high))
    # SnapKV's defaults are one run, repeated on every axis it belongs to
    defaults = table[table.setting.isin(["7", "max", "mean", "per KV head", "SnapKV"])]
    assert set(defaults.axis) == {"kernel", "pooling", "gqa", "layout", "method"}
    assert set(table.axis) == set(AXES)


def test_retrieval_predictors_auc_against_pairs():
    g = torch.Generator().manual_seed(0)
    found = torch.rand(30, generator=g) < 0.4
    table = pd.DataFrame(dict(policy="SnapKV", mode="query-aware", correct=found.numpy(),
                              coverage=torch.rand(30, generator=g).numpy(), oracle=1.0,
                              value_kept=(found.float() + torch.rand(30, generator=g)).numpy(),
                              value_attention=1.0, value_attention_kept=torch.rand(30, generator=g).numpy()))
    table = pd.concat([table, pd.DataFrame([dict(policy="FullCache", mode="full", correct=True, coverage=1.0)])])
    predictors = retrieval_predictors(table).set_index("predictor")
    runs = table[table["mode"] != "full"]
    for column in ("coverage", "value_kept"):
        yes, no = runs[runs.correct][column].to_numpy(), runs[~runs.correct][column].to_numpy()
        pairs = [(a > b) + 0.5 * (a == b) for a in yes for b in no]
        assert predictors.loc[column, "auc"] == pytest.approx(sum(pairs) / len(pairs))
        assert predictors.loc[column, "found"] == len(yes) and predictors.loc[column, "missed"] == len(no)
    assert predictors.loc["value_kept", "auc"] > 0.9  # built to separate
