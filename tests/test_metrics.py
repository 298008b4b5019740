"""Metrics against hand-computed cases; selection against transformers' eager attention."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import eager_twin, make_tiny_llama

from snapkv_lab import capture
from snapkv_lab.core.overlap import (
    SinkRule,
    attention_recall,
    coarse_overlap,
    difference,
    hit_rate,
    metric_rows,
    selection_overlap,
    selection_vs_generation,
    summarise,
    to_mask,
)
from snapkv_lab.core.selection import pool_votes, select, select_from_trace, topk_count, votes_per_kv_head


def one_head(*rows):
    return torch.tensor([rows], dtype=torch.float32)  # (1 head, rows, prefix)


def test_hit_rate_by_hand():
    attn = one_head([0.50, 0.30, 0.10, 0.06, 0.04], [0.02, 0.90, 0.02, 0.03, 0.03])
    selected = torch.tensor([[False, True, False, True, False]])
    parts = hit_rate(attn, selected, theta=0.05)
    # Above theta: row 0 -> {0, 1, 2, 3}, row 1 -> {1}; selected among them: {1, 3} and {1}.
    assert parts["support"].item() == 5 and parts["numerator"].item() == 3
    assert parts["chance_numerator"].item() == pytest.approx(5 * 2 / 5)
    # Excluding position 0 (a sink): support 4, hits 3, chance 2 of 4 eligible.
    eligible = torch.tensor([[False, True, True, True, True]])
    parts = hit_rate(attn, selected, theta=0.05, eligible=eligible)
    assert (parts["numerator"].item(), parts["support"].item()) == (3, 4)
    assert parts["chance_numerator"].item() == pytest.approx(4 * 2 / 4)


def test_recall_by_hand():
    attn = one_head([0.5, 0.3, 0.2], [0.1, 0.1, 0.8])
    selected = torch.tensor([[False, True, True]])
    parts = attention_recall(attn, selected)
    assert parts["numerator"].item() == pytest.approx(0.5 + 0.9)
    assert parts["support"].item() == 2 and parts["chance_numerator"].item() == pytest.approx(2 * 2 / 3)
    # Without position 0: row 0 mass 0.5, all on the selection; row 1 likewise.
    parts = attention_recall(attn, selected, eligible=torch.tensor([[False, True, True]]))
    assert parts["numerator"].item() == pytest.approx(2.0)


def test_overlap_and_coarse_by_hand():
    a = to_mask(torch.tensor([[0, 1, 2]]), 10)
    b = to_mask(torch.tensor([[1, 2, 3]]), 10)
    parts = selection_overlap(a, b)
    assert (parts["numerator"].item(), parts["support"].item()) == (2, 3)
    assert parts["chance_numerator"].item() == pytest.approx(3 * 3 / 10)
    generated = one_head([0.990, 0.006, 0.004], [0.990, 0.008, 0.002])  # mean > 0.005 at {0, 1}
    window = one_head([0.994, 0.003, 0.003], [0.980, 0.002, 0.018])  # mean > 0.005 at {0, 2}
    parts = coarse_overlap(generated, window, threshold=0.005)
    assert (parts["numerator"].item(), parts["support"].item()) == (1, 2)


def test_sink_rule():
    attn = one_head([0.1, 0.6, 0.3], [0.2, 0.5, 0.3], [0.0, 0.8, 0.2])
    assert SinkRule(first=1, share=0.25).mask(attn).tolist() == [[True, True, False]]
    assert SinkRule(first=0, share=0.2).mask(attn).tolist() == [[False, True, True]]


def test_undefined_cells_are_nan_and_pooling_is_exact():
    parts = dict(numerator=torch.tensor([3.0, 0.0]), chance_numerator=torch.tensor([1.0, 0.0]),
                 support=torch.tensor([6.0, 2.0]))
    rows = metric_rows(parts, layer=0, segment=1, metric="hit_rate", sinks="kept", min_support=5)
    assert rows[0]["value"] == 0.5 and math.isnan(rows[1]["value"])
    table = pd.DataFrame(rows + metric_rows(parts, layer=1, segment=1, metric="hit_rate", sinks="kept", min_support=5))
    summary = summarise(table, min_support=5)
    assert summary["value"].tolist() == [3 / 8, 3 / 8] and summary["defined"].all()
    tiny = summarise(table[table["head"] == 1], min_support=5)
    assert tiny["value"].isna().all() and not tiny["defined"].any()


def test_selection_vs_generation_equals_the_metrics_one_by_one():
    """The batched scorer (many selections, windows, both sink variants) against hit_rate, attention_recall and
    coarse_overlap called on each segment's rows alone."""
    generator = torch.Generator().manual_seed(1)
    heads, rows, prefix = 3, 20, 60
    attn = torch.distributions.Dirichlet(torch.full((prefix + 5,), 0.1)).sample((heads, rows))[..., :prefix]
    observed = torch.distributions.Dirichlet(torch.full((prefix + 5,), 0.1)).sample((heads, 7))[..., :prefix]
    selections = {name: torch.rand(heads, prefix, generator=generator) < 0.2 for name in ("x", "y")}
    sinks = torch.rand(heads, prefix, generator=generator) < 0.1
    segments = {1: slice(0, 8), 2: slice(8, 20)}
    table = pd.DataFrame(selection_vs_generation(attn, selections, sinks=sinks, segments=segments, observed=observed,
                                                 layer=3))
    assert len(table) == 2 * 2 * 2 * 3 * heads and set(table["layer"]) == {3}
    for (segment, name, variant, metric), part in table.groupby(["segment", "selection", "sinks", "metric"]):
        block, eligible = attn[:, segments[segment]], None if variant == "kept" else ~sinks
        expected = {"hit_rate": lambda: hit_rate(block, selections[name], eligible=eligible),
                    "recall": lambda: attention_recall(block, selections[name], eligible=eligible),
                    "coarse": lambda: coarse_overlap(block, observed, eligible=eligible)}[metric]()
        for column, values in expected.items():
            assert (part.sort_values("head")[column].tolist()
                    == pytest.approx(values.tolist(), rel=1e-6)), (segment, name, metric)


def plain_bootstrap(numerators, supports, resamples, seed, ci):
    """Percentile interval of sum(num) / sum(support) over samples drawn with replacement, one replicate at a time.
    numerators, supports: per sample, in sample-name order. Draws as the docs of metrics.resample_counts say."""
    draws = np.random.default_rng(seed).integers(0, len(numerators), size=(resamples, len(numerators)))
    ratios = [sum(numerators[i] for i in draw) / sum(supports[i] for i in draw) for draw in draws]
    return np.quantile(ratios, [(1 - ci) / 2, (1 + ci) / 2])


@pytest.fixture
def sampled_table():
    """Two layers x 3 heads x 6 samples of (numerator, support); layer 1 lacks sample s5 (another draw pattern)."""
    generator = np.random.default_rng(7)
    rows = [dict(layer=layer, head=h, sample=f"s{i}", metric="recall", numerator=float(generator.integers(0, 20)),
                 chance_numerator=1.0, support=20.0)
            for layer in (0, 1) for h in range(3) for i in range(6) if not (layer == 1 and i == 5)]
    return pd.DataFrame(rows)


def test_summarise_interval_equals_a_plain_bootstrap(sampled_table):
    summary = summarise(sampled_table, by=("layer",), ci=0.9, method="percentile", resamples=400,
                        seed=3).set_index("layer")
    for layer, part in sampled_table.groupby("layer"):
        per_sample = part.groupby("sample")[["numerator", "support"]].sum()
        low, high = plain_bootstrap(per_sample["numerator"].tolist(), per_sample["support"].tolist(), 400, 3, 0.9)
        assert (summary.loc[layer, "ci_low"], summary.loc[layer, "ci_high"]) == pytest.approx((low, high), rel=1e-12)
        assert summary.loc[layer, "n_samples"] == len(per_sample)
        assert summary.loc[layer, "ci_low"] <= summary.loc[layer, "value"] <= summary.loc[layer, "ci_high"]
    assert summary.loc[0, "ci_low"] < summary.loc[0, "ci_high"]
    # Without a ci the summary is unchanged; a table without samples cannot be bootstrapped.
    assert "ci_low" not in summarise(sampled_table, by=("layer",))
    with pytest.raises(ValueError, match="sample"):
        summarise(sampled_table.drop(columns="sample"), by=("layer",), ci=0.95)


def test_identical_samples_give_a_zero_width_interval(sampled_table):
    same = sampled_table.assign(numerator=5.0)
    summary = summarise(same, by=("layer",), ci=0.95, method="percentile", resamples=200)
    assert (summary["ci_low"] == 0.25).all() and (summary["ci_high"] == 0.25).all()


def test_difference_is_a_paired_bootstrap(sampled_table):
    table = pd.concat([sampled_table.assign(side="a"),
                       sampled_table.assign(side="b", numerator=sampled_table["numerator"] // 2)])
    out = difference(table, ("side", "a", "b"), by=("layer",), ci=0.95, method="percentile", resamples=300,
                     seed=5).set_index("layer")
    for layer, part in sampled_table.groupby("layer"):
        per_sample = part.groupby("sample")[["numerator", "support"]].sum()
        half = (part["numerator"] // 2).groupby(part["sample"]).sum()
        draws = np.random.default_rng(5).integers(0, len(per_sample), size=(300, len(per_sample)))
        num, sup, halves = per_sample["numerator"].to_numpy(), per_sample["support"].to_numpy(), half.to_numpy()
        diffs = [num[d].sum() / sup[d].sum() - halves[d].sum() / sup[d].sum() for d in draws]
        assert ((out.loc[layer, "ci_low"], out.loc[layer, "ci_high"])
                == pytest.approx(tuple(np.quantile(diffs, [0.025, 0.975])), rel=1e-12))
        assert out.loc[layer, "difference"] == pytest.approx(num.sum() / sup.sum() - halves.sum() / sup.sum())
    with pytest.raises(ValueError, match="no rows with side == 'c'"):
        difference(table, ("side", "a", "c"), by=("layer",))


def test_random_selection_hit_rate_matches_chance():
    """Many random selections of k of P positions: the mean hit rate is k / P, as the chance column says."""
    generator = torch.Generator().manual_seed(0)
    heads, rows, prefix, k = 4, 64, 400, 20
    attn = torch.distributions.Dirichlet(torch.full((prefix,), 0.05)).sample((heads, rows))
    rates, chances = [], []
    for _ in range(300):
        scores = torch.rand(heads, prefix, generator=generator)
        parts = hit_rate(attn, to_mask(torch.topk(scores, k).indices, prefix))
        rates.append(parts["numerator"].sum() / parts["support"].sum())
        chances.append(parts["chance_numerator"].sum() / parts["support"].sum())
    assert float(torch.stack(chances).mean()) == pytest.approx(k / prefix)
    assert float(torch.stack(rates).mean()) == pytest.approx(k / prefix, abs=0.01)


def test_select_pooling_gqa_and_k():
    votes = torch.tensor([[0.0, 0.0, 5.0, 0.0, 0.0, 1.0, 0.0, 0.0],
                          [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 4.0]])
    assert select(votes, 1, pooling=None).tolist() == [[2], [7]]
    assert pool_votes(votes[:1], "max", 3).tolist() == [[0.0, 5.0, 5.0, 5.0, 1.0, 1.0, 1.0, 0.0]]
    assert pool_votes(votes[:1], "avg", 3)[0, 1].item() == pytest.approx(5 / 3)
    assert votes_per_kv_head(votes, 1, "mean").tolist() == [votes.mean(0).tolist()]
    assert select(votes, 2, pooling=None, kv_heads=1, gqa="max").tolist() == [[2, 7]]
    assert topk_count(0.05, 100) == 5 and topk_count(0.001, 100) == 1
    with pytest.raises(ValueError, match="odd"):
        pool_votes(votes, "max", 4)
    with pytest.raises(ValueError, match="cannot be chosen"):
        topk_count(9, 8)


def _eager_votes(model, token_ids, layer, window: slice, prefix_len: int) -> torch.Tensor:
    with torch.no_grad():
        attn = eager_twin(model)(token_ids[None], output_attentions=True).attentions[layer][0]
    return attn[:, window, :prefix_len].sum(1)  # (heads, prefix)


def test_selection_equals_eager_reference_tiny(byte_tokenizer):
    model = make_tiny_llama()
    trace = capture(model, byte_tokenizer, torch.arange(3, 103), max_new_tokens=4, stop_at_eos=False, progress=False)
    votes = _eager_votes(model, trace.token_ids, 1, slice(84, 100), 84)
    expected = torch.topk(votes, 8).indices.sort().values
    assert torch.equal(select_from_trace(trace, 1, slice(84, 100), 8), expected)


@pytest.mark.slow
def test_vote_equals_eager_rows_on_real_prompt(smollm):
    from snapkv_lab.tasks.corpus import paul_graham_essays

    model, tokenizer = smollm
    trace = capture(model, tokenizer, paul_graham_essays()["founders"][:1500], max_new_tokens=2, progress=False)
    n = trace.prompt_len
    for layer in (2, 17):
        votes = _eager_votes(model, trace.token_ids, layer, slice(n - 32, n), n - 32)
        torch.testing.assert_close(trace.column_sums(layer, queries=slice(n - 32, n))[:, : n - 32], votes, atol=1e-5,
                                   rtol=0)
        k = topk_count(0.05, n - 32)
        expected = torch.topk(votes, k).indices.sort().values
        got = select_from_trace(trace, layer, slice(n - 32, n), 0.05)
        # Votes that differ by less than the 1e-5 tolerance may swap at the k-th place: allow one swap per head.
        assert all(len(set(g) & set(e)) >= k - 1 for g, e in zip(got.tolist(), expected.tolist()))
