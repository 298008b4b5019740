"""Merging instead of eviction: the kept positions are the inner policy's, and the cache holds those positions alone
with values merged as kvpress 0.5.5's MergingPress defines them (its official code: the method is kvpress's own),
checked value for value against a reference written per evicted position from its equations; and the engine's hook
(compression.engine.merged_values) that lets a policy rewrite kept values before the layer is built."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import eager_twin, make_tiny_llama

import snapkv_lab
from snapkv_lab.compression import SharedPrefill, cache_bytes
from snapkv_lab.compression.engine import merged_values
from snapkv_lab.policies.base import NO_POSITION

WINDOW, CAPACITY, N = 8, 40, 96


def ref_snapkv_kept(attention: torch.Tensor, window: int, capacity: int, kv_heads: int) -> torch.Tensor:
    """SnapKV's kept positions (kv_heads, capacity) of one batch row from eager maps (heads, n, n): the window's votes
    over the prefix, max-pooled (kernel 7), averaged over each GQA group, the top capacity - window, then the window."""
    n = attention.shape[-1]
    votes = attention[:, -window:, : n - window].sum(dim=1)  # (heads, prefix)
    votes = F.max_pool1d(votes[None], 7, stride=1, padding=3)[0]
    votes = votes.reshape(kv_heads, -1, votes.shape[-1]).mean(dim=1)
    top = votes.topk(capacity - window, dim=-1).indices.sort(dim=-1).values
    return torch.cat([top, torch.arange(n - window, n).expand(kv_heads, -1)], dim=-1)


def ref_merged(keys, values, kept, similarity_threshold=0.0, merge_fraction=1.0, eps=1e-6) -> torch.Tensor:
    """kvpress 0.5.5 MergingPress.merge (kvpress/presses/merging_press.py:100-177), one evicted position at a time, in
    float64. keys, values (kv_heads, n, d) of one batch row; kept (kv_heads, k) positions (NO_POSITION padding) -> per
    head (k_h, d) the kept values after merging: each evicted e picks the kept t of highest cos(k_e, k_t) (norms clamped
    at eps, :137-140); it merges if that cosine is >= similarity_threshold (:143) and, for merge_fraction < 1, >= the
    (1 - fraction) quantile of the head's best cosines, failures counted as -inf (:147-151); its weight is
    max(cos, 0) * |v_e| / (|v_e| + |v_t| + eps) with v_t the kept value before merging (:154-157); a kept value with
    total weight W > 0 becomes (v_t + sum w v_e) / (1 + W) (:163-174), the others stay."""
    threshold, fraction = similarity_threshold, merge_fraction
    keys, values = keys.double(), values.double()
    out = []
    for head in range(keys.shape[0]):
        held = [p for p in kept[head].tolist() if p != NO_POSITION]
        gone = [p for p in range(keys.shape[1]) if p not in held]

        def cosine(a, b):
            return float(a @ b) / (max(float(a.norm()), eps) * max(float(b.norm()), eps))

        best = []  # (evicted position, index of its nearest kept position, cosine)
        for e in gone:
            sims = [cosine(keys[head, e], keys[head, t]) for t in held]
            j = max(range(len(held)), key=lambda i: sims[i])
            best.append((e, j, sims[j]))
        passing = [b for b in best if b[2] >= threshold]
        if fraction < 1 and passing:
            ranked = sorted(s if s >= threshold else -math.inf for _, _, s in best)
            at = (1 - fraction) * (len(ranked) - 1)  # linear interpolation, as torch.quantile
            low, high = ranked[math.floor(at)], ranked[math.ceil(at)]
            assert math.isfinite(low), "the test's settings must keep the quantile among passing cosines"
            cut = low + (high - low) * (at - math.floor(at))
            passing = [b for b in passing if b[2] >= cut]
        added = [torch.zeros(keys.shape[-1], dtype=torch.float64) for _ in held]
        total = [0.0] * len(held)
        for e, j, s in passing:
            v_e, v_t = values[head, e], values[head, held[j]]
            w = max(s, 0.0) * float(v_e.norm()) / (float(v_e.norm()) + float(v_t.norm()) + eps)
            added[j] = added[j] + w * v_e
            total[j] += w
        out.append(torch.stack([(values[head, t] + added[j]) / (1 + total[j]) if total[j] > 0 else values[head, t]
                                for j, t in enumerate(held)]))
    return out


@pytest.fixture(scope="module")
def tiny_run():
    model = make_tiny_llama(initializer_range=0.3)
    ids = torch.randint(2, 256, (2, N), generator=torch.Generator().manual_seed(21))
    with torch.no_grad():  # the maps from the eager twin, the keys and values from the model's own cache
        attentions = eager_twin(model)(ids, output_attentions=True).attentions
        layers = model(ids, use_cache=True).past_key_values.layers
    return model, ids, attentions, [layer.keys for layer in layers], [layer.values for layer in layers]


@pytest.mark.parametrize("settings", [{}, {"merge_fraction": 0.5}, {"similarity_threshold": 0.6}])
def test_merged_values_match_kvpress_equations(settings, tiny_run, byte_tokenizer):
    model, ids, attentions, keys, values = tiny_run
    inner = snapkv_lab.SnapKV(window_size=WINDOW)
    merging = snapkv_lab.Merging(policy=inner, capacity=CAPACITY, **settings)
    evicting = snapkv_lab.SnapKV(window_size=WINDOW, capacity=CAPACITY)
    shared = SharedPrefill.run(model, byte_tokenizer, ids, [merging, evicting])
    merged, plain = shared.state(merging), shared.state(evicting)
    kv_heads = model.config.num_key_value_heads
    changed = 0
    for layer in range(model.config.num_hidden_layers):
        stored = merged.cache.layers[layer]
        for b in range(ids.shape[0]):
            kept = ref_snapkv_kept(attentions[layer][b], WINDOW, CAPACITY, kv_heads)
            assert torch.equal(merged.kept_indices[layer][b], kept), (layer, b)  # the inner policy's positions
            picked = kept[..., None].expand(-1, -1, keys[layer].shape[-1])
            assert torch.equal(stored.keys[b], keys[layer][b].gather(1, picked))  # keys never change
            reference = torch.stack(ref_merged(keys[layer][b], values[layer][b], kept, **settings))
            torch.testing.assert_close(stored.values[b].double(), reference, atol=1e-5, rtol=1e-5)
            changed += int((reference - values[layer][b].double().gather(1, picked)).abs().amax(-1).gt(1e-3).sum())
    assert changed > 0  # merging did change kept values: the comparison above is not of untouched ones
    # Bytes: the kept positions alone, as eviction's (the merged values are counted once, in place of the kept ones).
    assert cache_bytes(merged.cache) == cache_bytes(plain.cache)
    assert [layer.values.shape for layer in merged.cache.layers] == [layer.values.shape for layer in plain.cache.layers]


def test_merging_composes_with_head_wise_budgets(tiny_run, byte_tokenizer):
    """Over AdaKV, heads keep different counts (a ragged layer): each head merges over its own kept set."""
    model, ids, _, keys, values = tiny_run
    policy = snapkv_lab.Merging(policy=snapkv_lab.AdaKV(policy=snapkv_lab.SnapKV(window_size=WINDOW)),
                                capacity=CAPACITY)
    state = SharedPrefill.run(model, byte_tokenizer, ids[:1], [policy]).state(policy)
    layer = state.cache.layers[0]
    kept = state.kept_indices[0][0]
    assert len({int((row >= 0).sum()) for row in kept}) > 1  # heads keep different counts
    reference = ref_merged(keys[0][0], values[0][0], kept)
    for head, stored in enumerate(layer.prompt_values[0]):
        torch.testing.assert_close(stored.double(), reference[head], atol=1e-5, rtol=1e-5)


def test_merged_values_hook_leaves_the_source_cache_alone():
    """engine.merged_values: a new tensor holding each row's merge on its own slots (after its pads); the cache's
    own tensor untouched; a policy that evicts gets the same tensor back."""
    torch.manual_seed(0)
    keys, values = torch.randn(2, 1, 6, 4), torch.randn(2, 1, 6, 4)
    before = values.clone()
    kept = [torch.tensor([[2, 5]]), torch.tensor([[1, 3]])]  # row 1 has 2 pads: its own slots are 2..5
    policy = snapkv_lab.Merging(capacity=2, policy=snapkv_lab.KNorm(kept_tail=1))
    merged = merged_values(policy, keys, values, kept, [0, 2])
    assert torch.equal(values, before)
    assert torch.equal(merged[1, :, :2], values[1, :, :2])  # the pads' slots untouched
    for b, (row, drop) in enumerate(zip(kept, [0, 2])):
        torch.testing.assert_close(merged[b, :, drop:][:, row[0]].double(),
                                   ref_merged(keys[b, :, drop:], values[b, :, drop:], row)[0][None])
    assert merged_values(snapkv_lab.KNorm(capacity=2), keys, values, kept, [0, 2]) is values


def test_merging_refuses_what_it_cannot_merge():
    with pytest.raises(ValueError, match="merge_fraction"):
        snapkv_lab.Merging(merge_fraction=0.0)
    with pytest.raises(ValueError, match="similarity_threshold"):
        snapkv_lab.Merging(similarity_threshold=1.5)
    with pytest.raises(ValueError, match="per_query_head"):
        snapkv_lab.Merging(per_query_head=True)
    with pytest.raises(ValueError, match="merged twice"):
        snapkv_lab.Merging(policy=snapkv_lab.Merging())
    with pytest.raises(ValueError, match="while decoding"):
        snapkv_lab.Merging(policy=snapkv_lab.H2O())
    assert snapkv_lab.Merging(policy=snapkv_lab.H2O(interval=None), merge_fraction=0.75).label == \
        "Merging(policy=H2O(interval=None), merge_fraction=0.75)@1024"
