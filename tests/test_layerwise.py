"""Layer-level and threshold budgets (issue 54): SimLayerKV's lazy layers and DMS's threshold, against references
written from the authors' code and kvpress 0.5.5's, on the tiny random Llama; their KV entries counted as held."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_llama
from reference import eager_attentions

import snapkv_lab as C

N, LAYERS = 96, 6


@pytest.fixture(scope="module")
def model():
    # A larger init than the default 0.02 gives peaked attention, so layers differ in where their last query looks.
    return make_tiny_llama(initializer_range=0.3, num_hidden_layers=LAYERS)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(2, 256, (1, N), generator=torch.Generator().manual_seed(7))


# ----------------------------------------------------------------------------------------------- SimLayerKV


def simlayerkv_shares(attentions, sinks: int, recent: int) -> list[float]:
    """Per layer, the attention the last prompt query pays, averaged over all query heads, to the `sinks` first keys
    and to the `recent` keys before itself: kvpress's SimLayerKVPress.is_lazy (simlayerkv_press.py:65-69, n_last=1,
    whose window attention drops the query's own key, snapkv_press.py:66), the official decode-time test
    (sail-sg/SimLayerKV SimLayerKV_attention_llama.py:160-162) moved onto the last prompt token."""
    shares = []
    for attn in attentions:
        row = attn[0, :, -1, :-1].mean(0)  # (n - 1,) its own key left out
        shares.append(float(row[:sinks].sum() + row[-recent:].sum()))
    return shares


def simlayerkv_kept(share: float, threshold: float, n: int, sinks: int, recent: int) -> list[int]:
    """A lazy layer keeps keys[:sinks] and keys[-recent + 1:] (simlayerkv_press.py:116-117, n_last=1), a busy one
    all."""
    if share <= threshold:
        return list(range(n))
    return list(range(sinks)) + list(range(n - recent + 1, n))


def test_simlayerkv_keeps_what_the_official_lazy_test_keeps(model, ids, byte_tokenizer):
    capacity, sinks = 40, 4
    recent = capacity - sinks + 1  # kvpress's n_recent for this capacity
    shares = simlayerkv_shares(eager_attentions(model, ids), sinks, recent)
    ordered = sorted(shares)
    threshold = (ordered[LAYERS // 2 - 1] + ordered[LAYERS // 2]) / 2  # half the layers lazy, half busy
    policy = C.SimLayerKV(capacity=capacity, lazy_threshold=threshold)
    run = C.generate(model, byte_tokenizer, ids, policy=policy, max_new_tokens=1)
    lazy = 0
    for layer, (kept, share) in enumerate(zip(run.kept_indices, shares, strict=True)):
        expected = simlayerkv_kept(share, threshold, N, sinks, recent)
        lazy += len(expected) < N
        assert kept[0].tolist() == [expected, expected], layer  # every KV head the same positions
    assert lazy == LAYERS // 2
    # held as kept: lazy layers their capacity, busy ones their prompt, counted against the full cache
    kv_heads = model.config.num_key_value_heads
    assert run.kv_entries == kv_heads * (lazy * capacity + (LAYERS - lazy) * N)
    assert run.entries.budget_share == 1.0 and not run.entries.over_budget
    assert run.kv_share == pytest.approx(run.kv_entries / (kv_heads * LAYERS * N))
    assert policy.label == f"SimLayerKV(lazy_threshold={threshold!r})@40"


def test_simlayerkv_leaves_a_prompt_too_short_for_its_test_whole(model, byte_tokenizer):
    # kvpress compresses only k_len > n_initial + n_recent + n_last = capacity + 2 (simlayerkv_press.py:105-111)
    policy = C.SimLayerKV(capacity=40, lazy_threshold=0.0)  # every layer lazy wherever it is tested
    assert policy.budget(42) is None and policy.budget(43) == 40
    short = C.generate(model, byte_tokenizer, torch.arange(2, 44)[None], policy=policy, max_new_tokens=1)
    assert all(kept.shape[-1] == 42 for kept in short.kept_indices)


@pytest.mark.parametrize("settings, message", [
    (dict(lazy_threshold=1.0), "lazy_threshold must be a number in"),
    (dict(lazy_threshold=True), "lazy_threshold must be a number in"),
    (dict(sinks=0), "sinks must be a positive int"),
    (dict(capacity=4), "must exceed sinks"),
    (dict(kept_tail=8), "not kept_tail"),
    (dict(per_query_head=True), "one set of positions per layer"),
])
def test_simlayerkv_refuses_bad_settings(settings, message):
    with pytest.raises(ValueError, match=message):
        C.SimLayerKV(**settings)


# ----------------------------------------------------------------------------------------------- DMS


def dms_kept(attentions, window: int, kernel: int, sliding: int, threshold: float, kv_heads: int) -> list:
    """Per layer, per KV head, the positions kvpress's DMSPress keeps over SnapKVPress's scores (dms_press.py:96-118:
    the first n - sliding_window scores, evicted where below the threshold), SnapKVPress's scores written from the
    eager maps (snapkv_press.py:91-103: the window's attention averaged over its queries, avg-pooled, averaged over each
    GQA group, the window padded with the maximum plus one)."""
    kept = []
    for attn in attentions:
        n = attn.shape[-1]
        votes = attn[0, :, -window:, : n - window].mean(1)
        votes = torch.nn.functional.avg_pool1d(votes[:, None], kernel, 1, kernel // 2)[:, 0]
        votes = votes.view(kv_heads, -1, n - window).mean(1)
        scores = torch.nn.functional.pad(votes, (0, window), value=float(votes.max()) + 1)
        kept.append([[p for p in range(n) if p >= n - sliding or scores[h, p] >= threshold] for h in range(kv_heads)])
    return kept, scores


def test_dms_keeps_what_its_threshold_keeps(model, ids, byte_tokenizer):
    window, kernel, sliding = 8, 5, 16
    kv_heads = model.config.num_key_value_heads
    attentions = eager_attentions(model, ids)
    _, last = dms_kept(attentions, window, kernel, sliding, 0.0, kv_heads)
    threshold = float(last[:, : N - sliding].median())  # about half of the last layer's evictable positions go
    expected, _ = dms_kept(attentions, window, kernel, sliding, threshold, kv_heads)
    inner = C.SnapKV(pooling="avg", kernel_size=kernel, window_size=window)
    policy = C.DMS(policy=inner, threshold=threshold, sliding_window=sliding)
    run = C.generate(model, byte_tokenizer, ids, policy=policy, max_new_tokens=1)
    counts = set()
    for layer, (kept, want) in enumerate(zip(run.kept_indices, expected, strict=True)):
        for head in range(kv_heads):
            row = kept[0, head]
            assert row[row >= 0].tolist() == want[head], (layer, head)
            counts.add(len(want[head]))
    assert len(counts) > 1  # heads and layers keep what their scores decide, not one budget
    held = sum(len(head) for layer in expected for head in layer)
    assert run.kv_entries == held and run.kv_share == pytest.approx(held / (kv_heads * LAYERS * N))
    assert run.entries.budget_share == 1.0 and not run.entries.over_budget
    assert policy.label.startswith("DMS(policy=SnapKV(pooling='avg', kernel_size=5, window_size=8), threshold=")
    # the cap (our variant): at most 10 positions outside the sliding window, the highest-scoring ones
    capped = C.generate(model, byte_tokenizer, ids, policy=C.DMS(policy=inner, threshold=threshold,
                                                                 sliding_window=sliding, capacity=10), max_new_tokens=1)
    assert all(int((k[0, h] >= 0).sum()) == min(len(want[h]), 10 + sliding)
               for k, want in zip(capped.kept_indices, expected, strict=True) for h in range(kv_heads))


@pytest.mark.parametrize("settings, message", [
    (dict(threshold=None), "threshold must be a finite number"),
    (dict(threshold=float("nan")), "threshold must be a finite number"),
    (dict(sliding_window=-1), "sliding_window must be a non-negative int"),
])
def test_dms_refuses_bad_settings(settings, message):
    with pytest.raises(ValueError, match=message):
        C.DMS(**settings)
