"""kvpress 0.5.5's wrappers around any press, as lab wrappers: kept positions vs each wrapper's rule written plainly
from kvpress's code (cited per reference) over transformers' eager attention and the model's own cache, on the tiny
random Llama (3 layers, 4 query heads on 2 KV heads)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_llama
from reference import reference_kept

import snapkv_lab as C

WINDOW, N = 8, 96


@pytest.fixture(scope="module")
def tiny_ids():
    model = make_tiny_llama(initializer_range=0.3, num_hidden_layers=3)
    return model, torch.randint(2, 256, (1, N), generator=torch.Generator().manual_seed(21))


def kept_sets(kept) -> list[list[set]]:
    """Per layer, per KV head: the set of kept positions (batch row 0, NO_POSITION padding left out)."""
    return [[{int(p) for p in row if p >= 0} for row in layer[0]] for layer in kept]


# ------------------------------------------------------------------------------------------------- PerLayer

def test_per_layer_keeps_each_layers_budget_as_kvpress(tiny_ids, byte_tokenizer):
    """kvpress's PerLayerCompressionPress (per_layer_compression_press.py:60-65) runs its press in layer l at
    compression_ratios[l]: here SnapKV, written from the eager maps (tests/reference.py), at 60, 24 and 40 of 96."""
    model, ids = tiny_ids
    capacities = (60, 0.25, None)  # the last layer keeps the wrapper's capacity
    policy = C.PerLayer(capacity=40, policy=C.SnapKV(window_size=WINDOW), layer_capacities=capacities)
    result = C.generate(model, byte_tokenizer, ids, policy=policy, max_new_tokens=1)
    for layer, capacity in enumerate((60, 24, 40)):
        ref, _ = reference_kept(model, ids, WINDOW, capacity, pooling="max", kernel=7)
        assert kept_sets([result.kept_indices[layer]]) == kept_sets([ref[layer]]), layer
    assert [k.shape[-1] for k in result.kept_indices] == [60, 24, 40]


def test_per_layer_refuses_what_it_cannot_honour(tiny_ids, byte_tokenizer):
    model, ids = tiny_ids
    with pytest.raises(TypeError, match="sets budgets of its own"):
        C.PerLayer(policy=C.PyramidKV())
    with pytest.raises(ValueError, match=r"layer_capacities\[1\].*must exceed window_size"):
        C.PerLayer(policy=C.SnapKV(window_size=WINDOW), layer_capacities=(40, 8, 40))
    with pytest.raises(ValueError, match="ratio must lie in"):
        C.PerLayer(layer_capacities=(0.5, 1.5))
    with pytest.raises(ValueError, match="2 layer_capacities for a model of 3 layers"):
        C.generate(model, byte_tokenizer, ids, policy=C.PerLayer(policy=C.SnapKV(window_size=WINDOW),
                                                                 layer_capacities=(40, 40)), max_new_tokens=1)


def test_per_layer_leaves_a_layer_whole_where_its_capacity_covers_the_prompt(tiny_ids, byte_tokenizer):
    model, ids = tiny_ids
    policy = C.PerLayer(capacity=40, policy=C.SnapKV(window_size=WINDOW), layer_capacities=(None, 500, None))
    result = C.generate(model, byte_tokenizer, ids, policy=policy, max_new_tokens=1)
    assert [k.shape[-1] for k in result.kept_indices] == [40, N, 40]
    assert kept_sets([result.kept_indices[1]]) == [[set(range(N))] * 2]


# ------------------------------------------------------------------------------------------------- PerChunk

def ref_chunk_snapkv(attn, start, end, window, share, kv_heads, kernel=7):
    """kvpress's ChunkPress over SnapKV for one chunk (chunk_press.py:76-88): SnapKV's score of the chunk's keys
    alone, by its own last `window` queries; a softmax over the chunk's keys is the full causal softmax renormalised
    over them (every key a chunk's query sees from the chunk's start on). attn: (batch, heads, n, n) eager maps.
    Returns (batch, kv_heads, share) the kept positions, sorted: the top share - window by max-pooled votes averaged
    per GQA group, and the window (kvpress pads it with max + 1, snapkv_press.py:103)."""
    rows = attn[:, :, end - window:end, start:end]
    rows = rows / rows.sum(-1, keepdim=True)
    votes = rows[..., : end - start - window].sum(2)  # (batch, heads, chunk prefix)
    votes = torch.nn.functional.max_pool1d(votes, kernel, stride=1, padding=kernel // 2)
    votes = votes.reshape(votes.shape[0], kv_heads, -1, votes.shape[-1]).mean(2)
    top = votes.topk(share - window, dim=-1).indices + start
    return torch.cat([top, torch.arange(end - window, end).expand(*top.shape[:2], -1)], -1).sort(-1).values


def test_per_chunk_scores_and_keeps_each_chunk_alone(tiny_ids, byte_tokenizer):
    """96 tokens in chunks of 40: [0, 40) and [40, 80) keep 48 * 40 // 96 = 20 each by SnapKV over their own keys;
    [80, 96)'s share, 8, is no more than the window: its last 8 positions."""
    from reference import eager_attentions

    model, ids = tiny_ids
    policy = C.PerChunk(capacity=48, policy=C.SnapKV(window_size=WINDOW), chunk_size=40)
    result = C.generate(model, byte_tokenizer, ids, policy=policy, max_new_tokens=1)
    for layer, attn in enumerate(eager_attentions(model, ids)):
        ref = torch.cat([ref_chunk_snapkv(attn, 0, 40, WINDOW, 20, 2), ref_chunk_snapkv(attn, 40, 80, WINDOW, 20, 2),
                         torch.arange(88, 96).expand(1, 2, -1)], -1)
        assert kept_sets([result.kept_indices[layer]]) == kept_sets([ref]), layer
    whole = C.generate(model, byte_tokenizer, ids, policy=C.SnapKV(capacity=48, window_size=WINDOW), max_new_tokens=1)
    assert kept_sets(result.kept_indices) != kept_sets(whole.kept_indices)  # chunks are not the whole prompt


def test_per_chunk_joins_a_last_chunk_too_short_to_vote_and_refuses_what_it_cannot_score(tiny_ids, byte_tokenizer):
    assert C.PerChunk(policy=C.SnapKV(window_size=WINDOW), chunk_size=45).bounds(96) == [(0, 45), (45, 96)]
    assert C.PerChunk(policy=C.SnapKV(window_size=WINDOW), chunk_size=44).bounds(96) == [(0, 44), (44, 88), (88, 96)]
    assert C.PerChunk(policy=C.KNorm(), chunk_size=45).bounds(96) == [(0, 45), (45, 90), (90, 96)]
    with pytest.raises(TypeError, match="scores after the prefill"):
        C.PerChunk(policy=C.KVzip(allocation="uniform"))
    with pytest.raises(ValueError, match="must hold SnapKV's 32 voting queries"):
        C.PerChunk(chunk_size=16)
    model, ids = tiny_ids
    with pytest.raises(NotImplementedError, match="prefilled in one call"):
        C.generate(model, byte_tokenizer, ids, policy=C.PerChunk(capacity=48, policy=C.KNorm(), chunk_size=40),
                   max_new_tokens=1, prefill_chunk=48)


# ------------------------------------------------------------------------------------------------- Composed

def test_composed_runs_each_stage_on_what_the_one_before_kept(tiny_ids, byte_tokenizer):
    """kvpress's ComposedPress([SnapKVPress, KnormPress]) (composed_press.py:59-63): SnapKV (from the eager maps) keeps
    48 of 96, then KNorm, the keys of lowest L2 norm in the model's own cache, 24 of those 48 per KV head."""
    from test_scorers import eager_run

    model, ids = tiny_ids
    policy = C.Composed(capacity=24, policy=C.KNorm(), before=(C.SnapKV(capacity=48, window_size=WINDOW),))
    result = C.generate(model, byte_tokenizer, ids, policy=policy, max_new_tokens=1)
    first, _ = reference_kept(model, ids, WINDOW, 48, pooling="max", kernel=7)
    keys = eager_run(model, ids)["keys"]
    for layer, (held, key) in enumerate(zip(first, keys, strict=True)):
        norms = key[0].gather(1, held[0][..., None].expand(-1, -1, key.shape[-1])).norm(dim=-1)  # (kv_heads, 48)
        ref = held[0].gather(1, (-norms).topk(24, dim=-1).indices)
        assert kept_sets([result.kept_indices[layer]]) == kept_sets([ref[None]]), layer
    assert [k.shape[-1] for k in result.kept_indices] == [24] * 3


def test_composed_refuses_stages_it_cannot_chain(tiny_ids, byte_tokenizer):
    with pytest.raises(TypeError, match="cannot be a stage"):
        C.Composed(policy=C.KNorm(), before=(C.KVzip(capacity=48),))
    with pytest.raises(TypeError, match="cannot be a stage"):
        C.Composed(policy=C.H2O())
    with pytest.raises(ValueError, match="keeps its own capacity"):
        C.Composed(before=(C.KNorm(capacity=None),))
    assert C.Composed(capacity=40).label == "Composed@40"  # no stages before: SnapKV itself
