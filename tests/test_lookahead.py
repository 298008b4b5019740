"""LookaheadQCache against a plain reference written from its official code (noforit/Lookahead_Q-Cache @74612bd:
pyramidkv/pyramidkv_utils.py SnapKVCluster.update_kv and update_kv_LAQ, pyramidkv/llama_model.py
select_KV_lookahead_stage, select_KV_decoding_stage and LlamaForCausalLM_forward_LAQ), on the tiny random Llama.

The reference shares nothing with the lab's compression code: queries are recomputed from the model's own hidden
states and projections, the draft cache is a dict of gathered tensors, and the lookahead is decoded by an attention
function registered with transformers that reads that dict. The official keeps one selection per query head
(per_query_head=True here); the lab's default keeps one per KV head, and its reference is the official one with the
lab's documented GQA reduction alone changed (kv_heads=...: a KV head ranks by its query heads' mean pooled votes, in
the draft and in the votes, as the lab's SnapKV; docs/faithfulness.md, LookaheadQCache)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import make_tiny_llama
from transformers import AttentionInterface
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

import snapkv_lab as C


def prompt_queries_and_keys(model, ids):
    """Per layer: post-RoPE queries (1, heads, n, d), keys and values repeated per query head (1, heads, n, d), and
    the prefill's last logits (1, vocab), from a plain forward (llama_model.py:3004-3039)."""
    out = model(ids, use_cache=True, output_hidden_states=True)
    positions = torch.arange(ids.shape[1])[None]
    queries, keys, values = [], [], []
    for index, layer in enumerate(model.model.layers):
        attention, hidden = layer.self_attn, layer.input_layernorm(out.hidden_states[index])
        q = attention.q_proj(hidden).view(1, ids.shape[1], -1, attention.head_dim).transpose(1, 2)
        k = attention.k_proj(hidden).view(1, ids.shape[1], -1, attention.head_dim).transpose(1, 2)
        v = attention.v_proj(hidden).view(1, ids.shape[1], -1, attention.head_dim).transpose(1, 2)
        cos, sin = model.model.rotary_emb(hidden, positions)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        groups = attention.num_key_value_groups
        queries.append(q)
        keys.append(repeat_kv(k, groups))
        values.append(repeat_kv(v, groups))
    return queries, keys, values, out.logits[:, -1]


def official_select(query, key, window, capacity, lookahead=0, kernel=7, causal_by_position=False, kv_heads=None):
    """update_kv (lookahead=0, pyramidkv_utils.py:553-596) / update_kv_LAQ (:598-656): kept positions (heads, capacity)
    of the n prompt keys, the voters being the last window + lookahead rows of `query` (1, heads, rows, d).
    causal_by_position: the lookahead rows see every prompt key and the prompt rows their own past (our mask="causal");
    else the official mask over the last keys. kv_heads: one selection per KV head instead, (kv_heads, capacity), by
    the mean of its query heads' pooled votes (the lab's GQA reduction; the official has none)."""
    n, d = key.shape[2], key.shape[3]
    voters = window + lookahead
    weights = torch.matmul(query[..., -voters:, :], key.transpose(2, 3)) / math.sqrt(d)
    if causal_by_position:
        rows = torch.cat([torch.arange(n - window, n), torch.full((lookahead,), n - 1)])
        weights = weights.masked_fill(torch.arange(n)[None] > rows[:, None], torch.finfo(weights.dtype).min)
    else:
        mask = torch.full((voters, voters), torch.finfo(weights.dtype).min)
        condition = torch.arange(voters)
        mask.masked_fill_(condition < (condition + 1).view(voters, 1), 0)
        weights[:, :, -voters:, -voters:] += mask[None, None]
    weights = F.softmax(weights, dim=-1, dtype=torch.float32)
    summed = weights[:, :, -voters:, :n - window].sum(dim=-2)
    pooled = F.max_pool1d(summed, kernel_size=kernel, padding=kernel // 2, stride=1)
    if kv_heads is not None:
        pooled = pooled.view(1, kv_heads, -1, n - window).mean(2)
    picked = pooled.topk(capacity - window, dim=-1).indices[0]
    return torch.cat([picked, torch.arange(n - window, n).expand(picked.shape[0], -1)], dim=-1)


def official_lookahead_queries(model, ids, capacity, lookahead_size=8, lookahead_window=32, kv_heads=None):
    """The queries of the drafted tokens (per layer (1, heads, k, d)), decoded over the draft SnapKV cache
    (select_KV_lookahead_stage, then the loop of LlamaForCausalLM_forward_LAQ); kv_heads: the draft selects per KV head
    (official_select), each query head reading its KV head's kept keys."""
    queries, keys, values, logits = prompt_queries_and_keys(model, ids)
    n = ids.shape[1]
    store = {}
    for layer, (q, k, v) in enumerate(zip(queries, keys, values)):
        kept = official_select(q, k, lookahead_window, capacity, kv_heads=kv_heads)
        kept = kept.repeat_interleave(q.shape[1] // kept.shape[0], dim=0)  # per query head
        index = kept[None, :, :, None].expand(-1, -1, -1, k.shape[-1])
        store[layer] = [k.gather(2, index), v.gather(2, index)]
    drafted = {layer: [] for layer in store}

    def draft_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        layer = module.layer_idx
        drafted[layer].append(query)
        cached_k, cached_v = store[layer]
        new_k, new_v = (repeat_kv(key[:, :, -1:], module.num_key_value_groups),
                        repeat_kv(value[:, :, -1:], module.num_key_value_groups))
        store[layer] = [torch.cat([cached_k, new_k], 2), torch.cat([cached_v, new_v], 2)]
        weights = torch.softmax(torch.matmul(query, store[layer][0].transpose(2, 3)) * scaling, dim=-1)
        return torch.matmul(weights, store[layer][1]).transpose(1, 2).contiguous(), weights

    AttentionInterface.register("laq_reference", draft_attention)
    previous, model.config._attn_implementation = model.config._attn_implementation, "laq_reference"
    try:
        token, fed = logits.argmax(-1), 0
        while fed < lookahead_size:
            out = model(token[:, None], position_ids=torch.tensor([[n + fed]]), use_cache=False)
            fed += 1
            token = out.logits[:, -1].argmax(-1)
            if int(token) == 0:  # the tiny model's EOS
                break
    finally:
        model.config._attn_implementation = previous
    return queries, keys, {layer: torch.cat(rows, dim=2) for layer, rows in drafted.items()}


@pytest.mark.parametrize("window_size", [0, 8])
@pytest.mark.parametrize("mask", ["official", "causal"])
def test_kept_positions_equal_the_official(byte_tokenizer, window_size, mask):
    torch.manual_seed(5)
    model = make_tiny_llama()
    ids = torch.randint(2, 256, (1, 150))
    capacity = 48
    with torch.no_grad():
        queries, keys, drafted = official_lookahead_queries(model, ids, capacity)
    assert all(rows.shape[2] == 8 for rows in drafted.values())  # eight tokens drafted (no EOS on this prompt)
    policy = C.LookaheadQCache(capacity=capacity, window_size=window_size, mask=mask, per_query_head=True)
    result = C.generate(model, byte_tokenizer, ids, policy=policy, max_new_tokens=1)
    for layer, kept in enumerate(result.kept_indices):
        # the voters: the prompt's last window_size queries, then the drafted ones (select_KV_decoding_stage)
        voters = torch.cat([queries[layer][:, :, ids.shape[1] - window_size:], drafted[layer]], dim=2)
        expected = official_select(voters, keys[layer], window_size, capacity, lookahead=8,
                                   causal_by_position=mask == "causal")
        assert torch.equal(kept[0], expected.sort(dim=-1).values), (layer, window_size, mask)


@pytest.mark.parametrize("window_size", [0, 8])
@pytest.mark.parametrize("mask", ["causal", "official"])
def test_the_default_per_kv_head_equals_the_official_with_the_gqa_reduction(byte_tokenizer, window_size, mask):
    """The default (one selection per KV head, mask="causal", LAQ's window 0) and LAQ++'s window 8: the official draft
    and votes, each KV head ranking by its query heads' mean pooled votes in the draft and in the votes."""
    torch.manual_seed(5)
    model = make_tiny_llama()
    ids = torch.randint(2, 256, (1, 150))
    capacity, kv_heads = 48, model.config.num_key_value_heads
    with torch.no_grad():
        queries, keys, drafted = official_lookahead_queries(model, ids, capacity, kv_heads=kv_heads)
        _, _, per_query_head = official_lookahead_queries(model, ids, capacity)
    assert all(rows.shape[2] == 8 for rows in drafted.values())
    assert not torch.allclose(drafted[1], per_query_head[1])  # the draft cache differs from the official layout's
    policy = C.LookaheadQCache(capacity=capacity, window_size=window_size, mask=mask)
    assert not policy.per_query_head and C.LookaheadQCache().mask == "causal" and C.LookaheadQCache().window_size == 0
    result = C.generate(model, byte_tokenizer, ids, policy=policy, max_new_tokens=1)
    for layer, kept in enumerate(result.kept_indices):
        voters = torch.cat([queries[layer][:, :, ids.shape[1] - window_size:], drafted[layer]], dim=2)
        expected = official_select(voters, keys[layer], window_size, capacity, lookahead=8,
                                   causal_by_position=mask == "causal", kv_heads=kv_heads)
        assert kept.shape[1] == kv_heads and torch.equal(kept[0], expected.sort(dim=-1).values), (layer, window_size)


def test_the_draft_is_what_the_lookahead_attends(byte_tokenizer):
    """The drafted queries depend on the draft cache: a larger budget drafts over a different cache, so the votes differ
    (scores are never shared across budgets: scoring_key is the label)."""
    torch.manual_seed(5)
    model = make_tiny_llama()
    ids = torch.randint(2, 256, (1, 150))
    small, large = (C.LookaheadQCache(capacity=c, per_query_head=True) for c in (48, 100))
    assert small.scoring_key != large.scoring_key
    with torch.no_grad():
        _, _, few = official_lookahead_queries(model, ids, 48)
        _, _, many = official_lookahead_queries(model, ids, 100)
    assert not torch.allclose(few[1], many[1])


def test_refusals_are_clear():
    with pytest.raises(ValueError, match="lookahead_window"):
        C.LookaheadQCache(capacity=0.1).budget(300)  # 30 positions: no room beside the draft's window of 32
    with pytest.raises(ValueError, match="mask"):
        C.LookaheadQCache(mask="sideways")
    with pytest.raises(ValueError, match="lookahead_size"):
        C.LookaheadQCache(lookahead_size=0)
    with pytest.raises(ValueError, match="window_size"):
        C.LookaheadQCache(capacity=16, window_size=16)


def test_compress_refuses_it():
    model = make_tiny_llama()
    with pytest.raises(NotImplementedError, match="after the prefill"):
        with C.compress(model, C.LookaheadQCache(capacity=48)):
            pass


@pytest.mark.parametrize("family", ["gemma3-sliding", "gemma2-softcap"])
def test_sliding_layers_and_soft_caps(byte_tokenizer, family):
    """Gemma 3's sliding layers keep their own bounded caches through the draft and after it (only the full layer votes
    and is compressed); Gemma 2's soft-capped logits go through the votes (the layer's own softmax settings)."""
    from families import FAMILIES, sliding_layers

    model = FAMILIES[family]()
    ids = torch.randint(2, 256, (1, 80), generator=torch.Generator().manual_seed(9))
    policy = C.LookaheadQCache(capacity=40, lookahead_window=8, lookahead_size=4)
    result = C.generate(model, byte_tokenizer, ids, policy=policy, max_new_tokens=3)
    full = C.generate(model, byte_tokenizer, ids, max_new_tokens=1)
    sliding = sliding_layers(model.config)
    for layer, kept in enumerate(result.kept_indices):
        if layer in sliding:  # left as the full run leaves it: the model's own window
            assert torch.equal(kept, full.kept_indices[layer])
        else:
            assert kept.shape[-1] == 40 and bool((kept[0].diff(dim=-1) > 0).all())
    assert len(sliding) < len(result.kept_indices)
