"""The findings' baselines beside chance: recency, a random earlier segment and the hindsight oracle, each checked
against a reference written from its definition (brute force over every set of that size for the oracle; transformers'
eager attention for the random segment's votes)."""

from __future__ import annotations

import itertools

import pandas as pd
import pytest
import torch
from conftest import ByteTokenizer, eager_twin, make_tiny_llama

from snapkv_lab import capture
from snapkv_lab.core.overlap import SinkRule, attention_recall, hindsight_oracle, hit_rate, to_mask
from snapkv_lab.findings.experiments import (
    BASELINES,
    earlier_segment_mask,
    findings_tables,
    generation_consistency,
    prompt_segments,
    question_dependence,
    recency_mask,
    segment_starts,
)


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_llama()


@pytest.fixture(scope="module")
def trace(tiny):
    return capture(tiny, ByteTokenizer(), torch.arange(3, 203), max_new_tokens=24, stop_at_eos=False, progress=False)


def test_oracle_is_the_best_set_by_brute_force():
    """On 8 positions, every set of 3: the oracle's numerator is the best hit rate and the best recall any of them
    gets (the metrics as written from the paper, `hit_rate` and `attention_recall`), sinks kept and excluded."""
    torch.manual_seed(0)
    heads, rows, prefix, k = 2, 6, 8, 3
    attn = torch.distributions.Dirichlet(torch.full((prefix + 2,), 0.3)).sample((heads, rows))[..., :prefix]
    sinks = torch.zeros(heads, prefix, dtype=torch.bool)
    sinks[:, 0] = True
    reference = to_mask(torch.tensor([[1, 4, 6], [0, 2, 3]]), prefix)
    table = pd.DataFrame(hindsight_oracle(attn, reference, sinks=sinks, theta=0.1, min_support=1, layer=0))
    for (variant, metric), part in table.groupby(["sinks", "metric"]):
        eligible = None if variant == "kept" else ~sinks
        for head in range(heads):
            best = 0.0
            for subset in itertools.combinations(range(prefix), k):
                mask = to_mask(torch.tensor([subset] * heads), prefix)
                parts = (hit_rate(attn, mask, theta=0.1, eligible=eligible) if metric == "hit_rate"
                         else attention_recall(attn, mask, eligible=eligible))
                best = max(best, parts["numerator"][head].item())
            assert part.set_index("head").loc[head, "numerator"] == pytest.approx(best, rel=1e-6), (
                variant, metric, head)


def test_recency_and_segment_starts():
    reference = to_mask(torch.tensor([[0, 5, 7], [1, 2, 3]]), 10)
    assert recency_mask(reference).nonzero()[:, 1].tolist() == [7, 8, 9, 7, 8, 9]
    starts = segment_starts(5, 9, 50, seed=0)
    assert min(starts) >= 5 and max(starts) <= 9 and starts == segment_starts(5, 9, 50, seed=0)
    with pytest.raises(ValueError, match="no room"):
        segment_starts(10, 9, 1, seed=0)


def test_earlier_segment_votes_only_on_what_it_precedes(tiny, trace):
    """The random segment's selection equals the top k of transformers' eager attention of its rows, summed, over the
    positions before it."""
    start, length, k, layer, head = 90, 8, 7, 1, 2
    mask = earlier_segment_mask(trace, layer, start, length, k, (0, 180))
    with torch.no_grad():
        attn = eager_twin(tiny)(trace.token_ids[None], output_attentions=True).attentions[layer][0, head]
    expected = set(attn[start:start + length, :start].sum(0).topk(k).indices.tolist())
    assert set(mask[head].nonzero()[:, 0].tolist()) == expected and not mask[:, start:].any()


def test_baseline_rows_in_every_findings_table(trace):
    """(a), (b), (c)'s tables hold recency, random segment and oracle beside the window's selection, of its size;
    the oracle bounds every selection of that size; (a)'s random segment is the mean of its earlier segments."""
    b = generation_consistency(trace, obs_window=8, gen_segment=8, n_gen_segments=3, selection=["paper", "compressor"],
                               baselines=BASELINES)
    assert set(b["selection"]) == {"paper", "compressor", "recency", "random segment", "oracle"}
    assert set(b.loc[b.metric == "coarse", "selection"]) == {"paper", "compressor"}
    keys = ["layer", "head", "segment", "metric", "sinks"]
    scored = b[b.metric != "coarse"].pivot_table(index=keys, columns="selection", values="numerator")
    assert (scored["oracle"].to_numpy()[:, None] >= scored.drop(columns="oracle").to_numpy() - 1e-9).all()
    chance = b[b.metric != "coarse"].pivot_table(index=keys, columns="selection", values="chance_numerator")
    kept = chance.xs("kept", level="sinks")  # every selection keeps as many positions: one chance level, sinks kept
    assert (kept.sub(kept["paper"], axis=0).abs() < 1e-9).all(axis=None)

    a = prompt_segments(trace, segment=16, n_prompt_segments=4, baselines=True, sample="p")
    assert (set(a["selection"]) == {"paper", "recency", "oracle"}
            and a.loc[a.selection != "paper", "segment"].isna().all())
    raw = {"ab": pd.concat([a.assign(table="a"), b.assign(table="b", sample="p")])
           .assign(split="dev", mode="generated")}
    pooled = findings_tables(raw, obs_window=8)["a"]
    random = pooled[pooled.selection == "random segment"].set_index(["layer", "metric", "sinks"])
    earlier = pooled[(pooled.selection == "paper") & (pooled.segment < -1)].groupby(["layer", "metric", "sinks"])
    assert random["numerator"].to_numpy() == pytest.approx(earlier["numerator"].mean().reindex(random.index).to_numpy())


def test_question_dependence_baselines(trace):
    """(d): a question's selection against recency (the document's last k positions) and against random segments."""
    d = question_dependence([trace, trace], (10, 150), [150, 150], sample="doc", baselines=BASELINES,
                            sink_rule=SinkRule(first=0, share=1.1))
    assert {"question vs recency", "question vs random segment"} <= set(d["comparison"])
    recency = d[(d.comparison == "question vs recency") & (d.sinks == "kept") & (d.pair == "q0-recency")]
    k = 7  # 5% of the 140 document positions
    for layer in trace.layers:
        votes = trace.column_sums(layer, queries=slice(150, trace.n_tokens))[:, 10:150]
        top = votes.topk(k).indices
        expected = (top >= 140 - k).sum(-1).double() / k
        assert recency[recency.layer == layer].sort_values("head")["value"].tolist() == pytest.approx(expected.tolist())
