"""The ragged head-wise cache layer on its own: `headwise_attention` against a plain per-head softmax written
here, its bytes, its reserve for appended tokens, and forks sharing it. (Decoding a model through it against
the masked full cache is in test_budgets.py.)"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from snapkv_lab.compression.layers import HeadwiseLayer, cache_bytes, fork, headwise_attention
from snapkv_lab.core.attention import AttentionSettings

BATCH, KV_HEADS, GROUP, N, HEAD_DIM = 2, 3, 2, 40, 8
COUNTS = [[5, 0, 17], [9, 12, 3]]  # kept per (batch row, KV head): ragged, one head empty, row totals 22 and 24


def ragged_kept(seed: int) -> torch.Tensor:
    """(BATCH, KV_HEADS, widest) random ascending positions per head, COUNTS of them, -1 after."""
    g = torch.Generator().manual_seed(seed)
    widest = max(max(row) for row in COUNTS)
    kept = torch.full((BATCH, KV_HEADS, widest), -1)
    for b, row in enumerate(COUNTS):
        for h, count in enumerate(row):
            kept[b, h, :count] = torch.randperm(N, generator=g)[:count].sort().values
    return kept


def random_layer(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    keys, values = (torch.randn(BATCH, KV_HEADS, N, HEAD_DIM, generator=g).to(dtype) for _ in range(2))
    return HeadwiseLayer(keys, values, ragged_kept(seed)), keys, values


def per_head_reference(keys, values, kept, new_keys, new_values, query, scaling, softcap):
    """Each (batch row, query head, row) on its own: its KV head's kept prompt keys, then the appended tokens up
    to the row's own, one softmax; in float64. query: (batch, heads, rows, d), the last rows appended."""
    batch, heads, rows, _ = query.shape
    group, new = heads // keys.shape[1], new_keys.shape[2]
    out = torch.empty(batch, rows, heads, query.shape[-1], dtype=torch.float64)
    for b in range(batch):
        for head in range(heads):
            kv = head // group  # transformers' repeat_kv: query heads kv*group .. kv*group + group - 1
            positions = kept[b, kv][kept[b, kv] >= 0]
            for r in range(rows):
                visible = new - rows + r + 1
                k = torch.cat([keys[b, kv, positions], new_keys[b, kv, :visible]]).double()
                v = torch.cat([values[b, kv, positions], new_values[b, kv, :visible]]).double()
                logits = k @ query[b, head, r].double() * scaling
                if softcap is not None:
                    logits = softcap * torch.tanh(logits / softcap)
                weights = logits.exp() / logits.exp().sum()
                out[b, r, head] = weights @ v
    return out


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_headwise_attention_equals_a_per_head_softmax(softcap):
    """Batch 2 with different ragged selections per row, GQA groups of 2, tokens appended in two calls, then
    three query rows (causal among themselves), with and without a logit soft-cap."""
    layer, keys, values = random_layer(1)
    g = torch.Generator().manual_seed(2)
    new_keys, new_values = (torch.randn(BATCH, KV_HEADS, 5, HEAD_DIM, generator=g) for _ in range(2))
    layer.update(new_keys[:, :, :2], new_values[:, :, :2])
    layer.update(new_keys[:, :, 2:], new_values[:, :, 2:])
    query = torch.randn(BATCH, KV_HEADS * GROUP, 3, HEAD_DIM, generator=g) * 2
    settings = AttentionSettings(scaling=0.7, softcap=softcap)
    out = headwise_attention(layer, query, settings)
    ref = per_head_reference(keys, values, layer.kept, new_keys, new_values, query, 0.7, softcap)
    assert out.shape == (BATCH, 3, KV_HEADS * GROUP, HEAD_DIM) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_headwise_attention_keeps_bf16():
    layer, keys, values = random_layer(3, torch.bfloat16)
    new_keys, new_values = (torch.randn(BATCH, KV_HEADS, 2, HEAD_DIM).bfloat16() for _ in range(2))
    layer.update(new_keys, new_values)
    query = torch.randn(BATCH, KV_HEADS * GROUP, 1, HEAD_DIM).bfloat16()
    out = headwise_attention(layer, query, AttentionSettings(scaling=0.5))
    assert out.dtype == torch.bfloat16
    ref = per_head_reference(keys, values, layer.kept, new_keys, new_values, query, 0.5, None)
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=3e-2)


def test_headwise_layer_bytes_are_its_slots_and_appended_tokens():
    """Kept slots (each row as wide as the fullest: 24 slots) and appended tokens count; the reserve's unused room
    does not, and the reserve grows by doubling, not by one copy per token."""
    layer, _, _ = random_layer(4)
    per_slot = HEAD_DIM * 4 * 2  # K and V, fp32
    assert layer.nbytes() == BATCH * 24 * per_slot
    reserves = set()
    for step in range(40):
        layer.update(*(torch.randn(BATCH, KV_HEADS, 1, HEAD_DIM) for _ in range(2)))
        reserves.add(layer.keys.untyped_storage().data_ptr())
        assert layer.nbytes() == BATCH * 24 * per_slot + BATCH * KV_HEADS * (step + 1) * per_slot
    assert len(reserves) <= 3
    assert layer.keys.untyped_storage().nbytes() < 2 * layer.keys.nbytes  # room of at most as much again
    assert layer.get_seq_length() == 17 + 40 and layer.positions.shape == (BATCH, KV_HEADS, 17 + 40)
    assert torch.equal(layer.positions[..., 17:], torch.arange(N, N + 40).expand(BATCH, KV_HEADS, -1))


def test_forks_decode_apart_and_leave_the_original_unchanged():
    """Forks share the kept slots and the appended tokens without copying; two forks appending different tokens
    (and the original appending a third) never see each other's, although all start from one reserve."""
    layer, keys, values = random_layer(5)
    g = torch.Generator().manual_seed(6)
    first = [torch.randn(BATCH, KV_HEADS, 1, HEAD_DIM, generator=g) for _ in range(2)]
    layer.update(*first)  # the original now holds one appended token and room for more
    cache = DynamicCache()
    cache.layers = [layer]
    before = (layer.keys.clone(), layer.values.clone(), layer.positions.clone(), cache_bytes(cache))
    a, b = fork(cache), fork(cache)
    assert a.layers[0].kept_keys.data_ptr() == layer.kept_keys.data_ptr() == b.layers[0].kept_keys.data_ptr()
    assert a.layers[0].keys.data_ptr() == layer.keys.data_ptr()  # the appended tokens are shared too
    tokens = {name: [torch.randn(BATCH, KV_HEADS, 1, HEAD_DIM, generator=g) for _ in range(2)] for name in "abo"}
    a.layers[0].update(*tokens["a"])
    b.layers[0].update(*tokens["b"])
    query = torch.randn(BATCH, KV_HEADS * GROUP, 1, HEAD_DIM, generator=g)
    settings = AttentionSettings(scaling=0.3)
    for name, forked in (("a", a), ("b", b)):
        new_keys, new_values = (torch.cat([f, t], 2) for f, t in zip(first, tokens[name]))
        assert torch.equal(forked.layers[0].keys, new_keys) and torch.equal(forked.layers[0].values, new_values)
        ref = per_head_reference(keys, values, layer.kept, new_keys, new_values, query, 0.3, None)
        torch.testing.assert_close(headwise_attention(forked.layers[0], query, settings).double(), ref, atol=1e-5,
                                   rtol=1e-5)
    assert torch.equal(layer.keys, before[0]) and torch.equal(layer.values, before[1])
    assert torch.equal(layer.positions, before[2]) and cache_bytes(cache) == before[3]
    layer.update(*tokens["o"])  # the original decodes on: the forks keep their own tokens
    assert (torch.equal(a.layers[0].keys[:, :, -1:], tokens["a"][0])
            and torch.equal(b.layers[0].keys[:, :, -1:], tokens["b"][0]))
    assert torch.equal(layer.keys[:, :, -1:], tokens["o"][0]) and torch.equal(layer.keys[:, :, :1], first[0])


def test_headwise_layer_refuses_per_query_head_selections_and_rebatching():
    keys = torch.randn(1, 2, 10, 4)
    kept = torch.tensor([[[0, 1, -1], [2, 3, 4], [5, -1, -1], [6, 7, 8]]])  # 4 query heads' rows for 2 KV heads
    with pytest.raises(ValueError, match="per KV head"):
        HeadwiseLayer(keys, keys, kept)
    layer = HeadwiseLayer(keys, keys, kept[:, :2])
    with pytest.raises(NotImplementedError, match="batch rows"):
        layer.reorder_cache(torch.tensor([0]))
