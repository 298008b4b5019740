"""Chunked prefill, compressing as it goes (`generate(..., prefill_chunk=N)`, `compress(..., prefill_chunk=N)`): the
cache never holds more than capacity + N positions per head; one chunk covering the prompt is the unchunked run,
for every registered policy that takes chunks; where the definitions coincide over several chunks (positions
chosen by position alone, or by keys no attention has touched) the kept positions are the unchunked ones; the
combinations without a meaning are refused with a reason."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_llama

import snapkv_lab
from snapkv_lab.compression.generation import chunk_sizes, forward

N, NEW, CHUNK = 160, 6, 48
NAMES = sorted(snapkv_lab.POLICIES)
# No meaning under chunks: a pass over the whole prompt (KVzip, KVgrad, Surprisal, LookaheadQCache's drafted answer),
# head-wise budgets (ragged layers: AdaKV, HeadKV, LUKV), budgets shared across layers (CAKE, GlobalAllocation), a mean
# over the queries that saw each position (ObservedAttention: a compacted cache's slots no longer tell their positions),
# a prefill's every key position and query (LeverageScore, NonCausalAttn, Compactor), a trained scorer over the whole
# prompt's layer inputs (KVzap, FastKVzip), packed storage (ThinK, KIVI), each chunk scored alone by its own queries
# (PerChunk), blocks simulated over one prefill call (Blockwise: the real block-wise prefill is this chunked one).
REFUSED = {"KVzip", "Surprisal", "AdaKV", "HeadKV", "CAKE", "LookaheadQCache", "GlobalAllocation", "ObservedAttention",
           "KVgrad", "LeverageScore", "NonCausalAttn", "Compactor", "KVzap", "FastKVzip", "ThinK", "KIVI", "PerChunk",
           "Blockwise", "KVCompose", "LUKV"}


def prompt(seed=0, n=N):
    return torch.randint(2, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def build(name, capacity=0.25, **settings):
    cls = snapkv_lab.POLICIES[name]
    return cls() if name == "FullCache" else cls(capacity=capacity, **settings)


@pytest.fixture(scope="module")
def model():
    return make_tiny_llama(initializer_range=0.3, num_hidden_layers=3)


def test_chunk_sizes_end_on_a_whole_chunk():
    assert chunk_sizes(160, 48) == [16, 48, 48, 48]
    assert chunk_sizes(96, 48) == [48, 48]
    assert chunk_sizes(30, 48) == [30]


@pytest.mark.parametrize("name", NAMES)
def test_one_chunk_covering_the_prompt_is_the_unchunked_run(name, model, byte_tokenizer):
    policy = build(name)
    if name in REFUSED:
        with pytest.raises(NotImplementedError):
            snapkv_lab.generate(model, byte_tokenizer, prompt(), policy=policy, max_new_tokens=NEW, prefill_chunk=CHUNK)
        return
    whole = snapkv_lab.generate(model, byte_tokenizer, prompt(), policy=policy, max_new_tokens=NEW)
    covered = snapkv_lab.generate(model, byte_tokenizer, prompt(), policy=policy, max_new_tokens=NEW, prefill_chunk=N)
    assert torch.equal(covered.token_ids, whole.token_ids)
    assert covered.cache_lengths == whole.cache_lengths and covered.policy.label == policy.label
    for a, b in zip(covered.kept_indices, whole.kept_indices, strict=True):
        assert torch.equal(a, b)


# SimLayerKV's busy layers and DMS above its threshold hold what they choose, not their capacity:
# tests/test_layerwise.py
@pytest.mark.parametrize("name", sorted(n for n in set(NAMES) - REFUSED - {"FullCache"}
                                        if snapkv_lab.POLICIES[n].capacity_sets_entries))
def test_the_cache_never_holds_more_than_capacity_plus_a_chunk(name, model):
    capacity = 40
    ids = prompt(seed=2)
    lengths = []
    with torch.inference_mode(), snapkv_lab.compress(model, build(name, capacity=capacity),
                                                     prefill_chunk=CHUNK) as state:
        start = 0
        for size in chunk_sizes(N, CHUNK):
            forward(model, ids[:, start:start + size], state.cache, start)
            start += size
            lengths.append(max(layer.keys.shape[-2] for layer in state.cache.layers))
        state.end_prefill()
    assert max(lengths) <= capacity + CHUNK
    budgets = [int((k[0, 0] >= 0).sum()) for k in (state.kept_indices[i] for i in sorted(state.kept_indices))]
    assert lengths[-1] <= capacity + CHUNK and max(budgets) < N
    for kept in state.kept_indices.values():  # token positions, not cache slots: beyond the held slots' count
        assert int(kept.max()) > capacity + CHUNK and int(kept.max()) < N and torch.equal(kept, kept.sort(-1).values)


def test_streaming_llm_keeps_the_same_positions_in_chunks(model, byte_tokenizer):
    """Sinks plus the most recent: a choice by position alone, the same whatever the chunks."""
    policy = snapkv_lab.StreamingLLM(capacity=40, kept_tail=8)
    whole = snapkv_lab.generate(model, byte_tokenizer, prompt(seed=3), policy=policy, max_new_tokens=NEW)
    chunked = snapkv_lab.generate(model, byte_tokenizer, prompt(seed=3), policy=policy, max_new_tokens=NEW,
                                  prefill_chunk=32)
    expected = torch.cat([torch.arange(4), torch.arange(N - 36, N)])
    for a, b in zip(chunked.kept_indices, whole.kept_indices, strict=True):
        assert torch.equal(a[0, 0, :40], expected) and torch.equal(b[0, 0, :40], expected)


def test_knorm_keeps_the_unchunked_positions_in_the_first_layer(model, byte_tokenizer):
    """The first layer's keys are the tokens' own (no attention before them), so the lowest key norms of the whole
    prefix are never evicted by an earlier chunk: a global top-k survives every partial top-k. Deeper layers see
    only what was kept, so they may differ."""
    policy = snapkv_lab.KNorm(capacity=40, kept_tail=8)
    ids = prompt(seed=4)
    whole = snapkv_lab.generate(model, byte_tokenizer, ids, policy=policy, max_new_tokens=1)
    chunked = snapkv_lab.generate(model, byte_tokenizer, ids, policy=policy, max_new_tokens=1, prefill_chunk=32)
    assert torch.equal(chunked.kept_indices[0], whole.kept_indices[0])
    # and by the definition itself: the 32 smallest key norms of layer 0 over the prefix, then the window
    attention = model.model.layers[0].self_attn
    hidden = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids))
    keys = attention.k_proj(hidden).view(1, N, 2, 16).transpose(1, 2)  # (1, kv_heads, n, d) before RoPE
    cos, sin = model.model.rotary_emb(hidden, torch.arange(N)[None])
    rotated = keys * cos[:, None] + torch.cat([-keys[..., 8:], keys[..., :8]], -1) * sin[:, None]
    norms = rotated.norm(dim=-1)[0, :, :N - 8]
    expected = torch.cat([(-norms).topk(32, dim=-1).indices.sort(-1).values, torch.arange(N - 8, N).expand(2, -1)], -1)
    assert torch.equal(whole.kept_indices[0][0, :, :40], expected)


def test_model_generate_feeds_the_chunks_itself(model, byte_tokenizer):
    ids = prompt(seed=5, n=144)  # whole chunks: model.generate puts a remainder last, snapkv_lab.generate first
    policy = snapkv_lab.SnapKV(capacity=40, window_size=8)
    ours = snapkv_lab.generate(model, byte_tokenizer, ids, policy=policy, max_new_tokens=NEW, prefill_chunk=CHUNK)
    with snapkv_lab.compress(model, policy, prefill_chunk=CHUNK) as state:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=state.cache, max_new_tokens=NEW,
                             do_sample=False, eos_token_id=None, prefill_chunk_size=CHUNK)
    assert torch.equal(out[:, 144:], ours.token_ids)
    assert torch.equal(state.kept_indices[1][..., :40], ours.kept_indices[1][..., :40])


def test_chunks_change_what_later_layers_keep(model, byte_tokenizer):
    """Not a no-op: with several chunks, later tokens see only what earlier chunks kept."""
    policy = snapkv_lab.SnapKV(capacity=40, window_size=8)
    whole = snapkv_lab.generate(model, byte_tokenizer, prompt(seed=6), policy=policy, max_new_tokens=1)
    chunked = snapkv_lab.generate(model, byte_tokenizer, prompt(seed=6), policy=policy, max_new_tokens=1,
                                  prefill_chunk=32)
    assert any(not torch.equal(a, b) for a, b in zip(chunked.kept_indices, whole.kept_indices, strict=True))


@pytest.mark.parametrize("policy, chunk, error, match", [
    (snapkv_lab.SnapKV(capacity=0.25), 48, ValueError, "ratio"),
    (snapkv_lab.SnapKV(capacity=40, window_size=32), 16, ValueError, "votes with"),
    (snapkv_lab.SnapKV(capacity=40, window_size=8, per_query_head=True), 48, NotImplementedError, "per_query_head"),
    (snapkv_lab.KVzip(capacity=40), 48, NotImplementedError, "scores after the prefill"),
    (snapkv_lab.SnapKV(capacity=40, window_size=8), 1, ValueError, "at least 2"),
])
def test_compress_refuses_chunks_without_a_meaning(policy, chunk, error, match, model):
    with pytest.raises(error, match=match), snapkv_lab.compress(model, policy, prefill_chunk=chunk):
        pass


def test_a_call_longer_than_the_chunk_is_refused(model):
    with pytest.raises(ValueError, match="prefill_chunk_size=32"), torch.inference_mode(), \
            snapkv_lab.compress(model, snapkv_lab.SnapKV(capacity=40, window_size=8), prefill_chunk=32) as state:
        forward(model, prompt(), state.cache, 0)
