"""attention_coverage against a plain loop-by-loop computation from trace.attention, and its properties."""

from __future__ import annotations

import pytest
import torch
from conftest import ByteTokenizer, make_tiny_llama

import snapkv_lab
from snapkv_lab import AdaKV, DecodingEviction, FullCache, SnapKV, attention_coverage, capture, generate
from snapkv_lab.core.overlap import SinkRule

PROMPT = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
          "The secret code is 7319. What is the secret code? ")  # 130 bytes: 130 tokens of the byte tokenizer
NEW_TOKENS = 8


def reference(trace, kept_indices, sink_rule=SinkRule()):
    """{(layer, head, sinks): (kept, coverage, oracle, chance)}, one position and one row at a time."""
    n_prompt, heads = trace.prompt_len, trace.n_heads
    out = {}
    for entry, layer in enumerate(trace.layers):
        rows_of_layer = kept_indices[entry][0]  # batch row 0: (kv_heads or heads, k)
        group = heads // rows_of_layer.shape[0]
        for h in range(heads):
            attn = trace.attention(layer, heads=h, queries=trace.generated, keys=trace.prompt)[0].tolist()
            kept_set = {p for p in rows_of_layer[h // group].tolist() if 0 <= p < n_prompt}
            sinks = {p for p in range(n_prompt)
                     if p < sink_rule.first or all(row[p] >= sink_rule.share for row in attn)}
            for label in ("kept", "excluded"):
                eligible = [p for p in range(n_prompt) if label == "kept" or p not in sinks]
                kept_here = [p for p in eligible if p in kept_set]
                shares = []  # per generated row: {position: its share of the row's eligible prompt mass}
                for row in attn:
                    total = sum(row[p] for p in eligible)
                    shares.append({p: row[p] / total for p in eligible})
                coverage = sum(sum(s[p] for p in kept_here) for s in shares) / len(shares)
                summed = {p: sum(s[p] for s in shares) for p in eligible}
                best = sorted(eligible, key=lambda p: summed[p], reverse=True)[: len(kept_here)]
                oracle = sum(sum(s[p] for p in best) for s in shares) / len(shares)
                out[layer, h, label] = (len(kept_here), coverage, oracle, len(kept_here) / len(eligible))
    return out


@pytest.fixture(scope="module")
def tiny_runs():
    tokenizer = ByteTokenizer()
    model = make_tiny_llama(initializer_range=0.3)
    trace = capture(model, tokenizer, PROMPT, max_new_tokens=NEW_TOKENS, stop_at_eos=False, progress=False)
    runs = {}
    for name, policy in [("SnapKV", SnapKV(capacity=40, window_size=8)),
                         ("AdaKV", AdaKV(policy=SnapKV(window_size=8), capacity=40)),
                         ("SnapKV per query head", SnapKV(capacity=40, window_size=8, per_query_head=True)),
                         ("FullCache", FullCache())]:
        runs[name] = generate(model, tokenizer, PROMPT, policy=policy, max_new_tokens=NEW_TOKENS)
    return trace, runs


def check_against_reference(table, trace, kept_indices):
    expected = reference(trace, kept_indices)
    assert len(table) == len(expected) == trace.n_layers * trace.n_heads * 2
    for row in table.itertuples():
        kept, coverage, oracle, chance = expected[row.layer, row.head, row.sinks]
        assert row.kv_head == row.head // (trace.n_heads // trace.n_kv_heads)
        assert row.kept == kept
        assert row.coverage == pytest.approx(coverage, abs=1e-5)
        assert row.oracle == pytest.approx(oracle, abs=1e-5)
        assert row.chance == pytest.approx(chance)


@pytest.mark.parametrize("name", ["SnapKV", "AdaKV", "SnapKV per query head"])
def test_matches_the_loop_reference(tiny_runs, name):
    trace, runs = tiny_runs
    run = runs[name]
    table = attention_coverage(trace, run)
    check_against_reference(table, trace, run.kept_indices)
    assert list(table.columns[:9]) == ["layer", "head", "kv_head", "sinks", "kept", "eligible", "coverage", "oracle",
                                       "chance"]
    if name == "AdaKV":  # ragged: the heads keep different numbers of positions (the -1 padding is ignored)
        assert (run.kept_indices[0][0] == -1).any() and table[table.sinks == "kept"].kept.nunique() > 1
    # Excluding sinks drops at least the first SinkRule.first positions from the eligible set.
    excluded = table[table.sinks == "excluded"]
    assert (excluded.eligible <= trace.prompt_len - SinkRule().first).all()
    assert (table.coverage <= table.oracle + 1e-6).all() and (table.oracle <= 1 + 1e-6).all()
    assert table.coverage.notna().all()


def test_list_of_kept_indices_equals_the_result(tiny_runs):
    trace, runs = tiny_runs
    run = runs["SnapKV"]
    assert attention_coverage(trace, run).equals(attention_coverage(trace, run.kept_indices))
    assert snapkv_lab.attention_coverage is attention_coverage


def test_layers_of_kv_head_and_of_query_head_sets_mix(tiny_runs):
    # per_query_head on a model with sliding layers: compressed layers hold one set per query head, the others one per
    # KV head. Each query head reads its KV head's set: the same table as with every layer expanded to query heads.
    trace, runs = tiny_runs
    kept = runs["SnapKV"].kept_indices  # (1, 2 KV heads, k) per layer
    mixed = [kept[0], kept[1].repeat_interleave(2, dim=1)]
    expanded = [rows.repeat_interleave(2, dim=1) for rows in kept]
    assert attention_coverage(trace, mixed).equals(attention_coverage(trace, expanded))
    assert attention_coverage(trace, mixed).equals(attention_coverage(trace, kept))


def test_full_cache_covers_everything(tiny_runs):
    trace, runs = tiny_runs
    table = attention_coverage(trace, runs["FullCache"])
    assert (table.kept == table.eligible).all()
    assert table.coverage.to_numpy() == pytest.approx(1.0, abs=1e-5)
    assert table.oracle.to_numpy() == pytest.approx(1.0, abs=1e-5)
    assert (table.chance == 1.0).all()


def test_oracle_positions_reach_the_oracle(tiny_runs):
    """Keeping exactly the oracle's positions (built here from the plain attention) gives coverage == oracle;
    keeping the k least-attended positions gives less."""
    trace, runs = tiny_runs
    k, heads = 12, trace.n_heads
    best, worst = [], []
    for layer in trace.layers:
        attn = trace.attention(layer, queries=trace.generated, keys=trace.prompt)  # (heads, generated, prompt)
        summed = (attn / attn.sum(-1, keepdim=True)).sum(1)  # sinks kept: every prompt position eligible
        best.append(summed.topk(k, dim=-1).indices[None])  # (1 batch, heads, k): one row per query head
        worst.append((-summed).topk(k, dim=-1).indices[None])
    table = attention_coverage(trace, best).query("sinks == 'kept'")
    assert (table.kept == k).all() and table.chance.to_numpy() == pytest.approx(k / trace.prompt_len)
    assert table.coverage.to_numpy() == pytest.approx(table.oracle.to_numpy(), abs=1e-5)
    low = attention_coverage(trace, worst).query("sinks == 'kept'")
    assert (low.coverage.to_numpy() < table.oracle.to_numpy() - 1e-3).all()
    assert len(table) == trace.n_layers * heads


def test_generated_positions_are_ignored(tiny_runs):
    """Eviction while decoding holds generated positions: they are not prompt and do not count as kept."""
    trace, runs = tiny_runs
    run = runs["SnapKV"]
    extra = [torch.cat([rows, torch.full_like(rows[..., :3], trace.prompt_len + 2)], dim=-1)
             for rows in run.kept_indices]
    assert attention_coverage(trace, extra).equals(attention_coverage(trace, run.kept_indices))


def test_decoding_eviction_keeps_some_generated_positions(byte_tokenizer):
    model = make_tiny_llama(initializer_range=0.3)
    prompt = PROMPT[:60]
    trace = capture(model, byte_tokenizer, prompt, max_new_tokens=20, stop_at_eos=False, progress=False)
    run = generate(model, byte_tokenizer, prompt, max_new_tokens=20,
                   policy=DecodingEviction(policy=SnapKV(window_size=8), capacity=24, interval=8))
    assert any((rows >= trace.prompt_len).any() for rows in run.kept_indices)
    check_against_reference(attention_coverage(trace, run), trace, run.kept_indices)


def test_refusals(tiny_runs, byte_tokenizer):
    trace, runs = tiny_runs
    run = runs["SnapKV"]
    with pytest.raises(ValueError, match="layers"):
        attention_coverage(trace, run.kept_indices[:1])
    with pytest.raises(ValueError, match="shape"):
        attention_coverage(trace, [rows[:, :1] for rows in run.kept_indices])  # 1 row: neither 2 KV nor 4 heads
    with pytest.raises(ValueError, match="shape"):  # batch sizes that differ between layers
        attention_coverage(trace, [run.kept_indices[0], run.kept_indices[1].expand(2, -1, -1)])
    other = generate(make_tiny_llama(initializer_range=0.3), byte_tokenizer, PROMPT[:-5],
                     policy=SnapKV(capacity=40, window_size=8), max_new_tokens=2)
    with pytest.raises(ValueError, match="not the trace's"):
        attention_coverage(trace, other)
    prompt_only = snapkv_lab.AttentionTrace(
        token_ids=trace.token_ids[: trace.prompt_len], tokens=trace.tokens[: trace.prompt_len],
        prompt_len=trace.prompt_len,
        queries=[q[:, : trace.prompt_len] for q in trace.queries], keys=[k[:, : trace.prompt_len] for k in trace.keys],
        attention_settings=trace.attention_settings, layers=trace.layers)
    with pytest.raises(ValueError, match="no generated rows"):
        attention_coverage(prompt_only, run.kept_indices)


@pytest.mark.slow
def test_smollm_snapkv_and_adakv(smollm):
    from snapkv_lab.tasks.corpus import haystack_ids

    model, tokenizer = smollm
    ids = haystack_ids(tokenizer, 500)
    ids = torch.tensor([ids])
    trace = capture(model, tokenizer, ids, max_new_tokens=16, progress=False)
    for policy in (SnapKV(capacity=128, window_size=16), AdaKV(policy=SnapKV(window_size=16), capacity=128)):
        run = generate(model, tokenizer, ids, policy=policy, max_new_tokens=16)
        table = attention_coverage(trace, run)
        assert len(table) == trace.n_layers * trace.n_heads * 2
        assert (table.coverage <= table.oracle + 1e-6).all()
        # Layers 2.. : SnapKV's kept positions hold more of the generation's attention than chance.
        later = table[(table.layer >= 2) & (table.sinks == "excluded")]
        assert later.coverage.mean() > later.chance.mean()
        # Spot-check one late layer's heads against the loop reference (a few heads keep it fast).
        layer = trace.layers[-1]
        attn = trace.attention(layer, queries=trace.generated, keys=trace.prompt)
        group = trace.n_heads // run.kept_indices[0].shape[1]
        for h in (0, trace.n_heads - 1):
            kept = torch.zeros(trace.prompt_len, dtype=torch.bool)
            rows = run.kept_indices[-1][0, h // group]
            kept[rows[(rows >= 0) & (rows < trace.prompt_len)]] = True
            share = attn[h] / attn[h].sum(-1, keepdim=True)
            row = table[(table.layer == layer) & (table["head"] == h) & (table.sinks == "kept")].iloc[0]
            assert row.coverage == pytest.approx(float(share[:, kept].sum(-1).mean()), abs=1e-5)


def test_coverage_figure_draws_one_line_set_per_policy(tiny_runs):
    import pandas as pd

    from snapkv_lab.views.plots import coverage_figure

    trace, runs = tiny_runs
    single = coverage_figure(attention_coverage(trace, runs["SnapKV"]))
    assert [t.name for t in single.data] == ["coverage", "oracle", "chance"]
    table = pd.concat([attention_coverage(trace, runs[name]).assign(policy=name) for name in ("SnapKV", "AdaKV")])
    figure = coverage_figure(table, sinks="kept")
    assert len(figure.data) == 6 and figure.data[3].name == "AdaKV coverage"
    kept = table[(table.policy == "AdaKV") & (table.sinks == "kept")]
    assert list(figure.data[3].y) == pytest.approx(kept.groupby("layer").coverage.mean().tolist())
    with pytest.raises(ValueError, match="no rows"):
        coverage_figure(table, sinks="both")


def test_span_attention_against_a_loop(tiny_runs):
    from snapkv_lab.views.coverage import span_attention

    trace, runs = tiny_runs
    run, span = runs["SnapKV"], (20, 35)
    table = span_attention(trace, span, run)
    assert len(table) == trace.n_layers * trace.n_heads
    assert (table.span_kept_share <= table.span_share + 1e-6).all() and (table.span_share <= 1 + 1e-6).all()
    sink_rule = SinkRule()
    for row in table.itertuples():
        attn = trace.attention(row.layer, heads=row.head, queries=trace.generated, keys=trace.prompt)[0]
        sinks = (attn >= sink_rule.share).all(0)
        sinks[: sink_rule.first] = True
        share = attn * ~sinks
        share = share / share.sum(-1, keepdim=True)
        kept = {p for p in run.kept_indices[trace.layers.index(row.layer)][0, row.kv_head].tolist()}
        in_kept = torch.tensor([p in kept for p in range(trace.prompt_len)])
        assert row.span_share == pytest.approx(share[:, span[0]:span[1]].sum(-1).mean().item(), abs=1e-5)
        assert row.span_kept_share == pytest.approx(
            (share * in_kept)[:, span[0]:span[1]].sum(-1).mean().item(), abs=1e-5)
        assert row.span_kept == pytest.approx(in_kept[span[0]:span[1]].float().mean().item())
    full = span_attention(trace, span, runs["FullCache"])
    assert full.span_kept_share.to_numpy() == pytest.approx(full.span_share.to_numpy(), abs=1e-5)
    assert (full.span_kept == 1).all()
    assert "span_kept" not in span_attention(trace, span).columns
    with pytest.raises(ValueError, match="span"):
        span_attention(trace, (5, 5))


def test_coverage_summary_and_layer_spread(tiny_runs):
    import pandas as pd

    from snapkv_lab.views.coverage import coverage_summary, layer_spread

    trace, runs = tiny_runs
    table = pd.concat([attention_coverage(trace, runs[n]).assign(policy=n) for n in ("SnapKV", "AdaKV", "FullCache")])
    summary = coverage_summary(table)
    assert list(summary.index) == ["SnapKV", "AdaKV", "FullCache"]
    assert summary.loc["FullCache", "coverage"] == pytest.approx(1.0, abs=1e-5)
    excluded = table[(table.sinks == "excluded") & (table.policy == "SnapKV")]
    assert summary.loc["SnapKV", "coverage"] == pytest.approx(excluded.coverage.mean())
    assert (summary.loc["SnapKV", "coverage_of_oracle"]
            == pytest.approx(excluded.coverage.mean() / excluded.oracle.mean()))
    spread = layer_spread(table)
    assert sorted(spread.index) == sorted(trace.layers)
    assert spread.spread.is_monotonic_decreasing
    assert (spread.highest == "FullCache").all()  # coverage 1 everywhere: nothing beats the full cache
    layer = spread.index[0]
    means = excluded[excluded.layer == layer].coverage.mean()
    assert spread.loc[layer, "SnapKV"] == pytest.approx(means)
    assert spread.loc[layer, "spread"] == pytest.approx(spread.loc[layer, ["SnapKV", "AdaKV", "FullCache"]].max()
                                                        - spread.loc[layer, ["SnapKV", "AdaKV", "FullCache"]].min())
    with pytest.raises(ValueError, match="two"):
        layer_spread(table[table.policy == "SnapKV"])
