"""The attention-free scorers, KeyDiff, LagKV and Q-Filters: kept positions vs each method written plainly from its
paper or official code, over the keys and values transformers' eager twin caches (and, for Q-Filters, queries
rebuilt from the q_proj outputs and transformers' own RoPE), on the tiny random Llama and on SmolLM2."""

from __future__ import annotations

import pytest
import torch
from conftest import eager_twin, make_tiny_llama
from reference import assert_same_selection
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import snapkv_lab as C
from snapkv_lab.policies.query_filters import query_filters


def tiny():
    return make_tiny_llama(initializer_range=0.3)


def eager_cache(model, ids):
    """Per layer the post-RoPE keys and values (batch, kv_heads, n, head_dim) of transformers' eager twin."""
    with torch.no_grad():
        layers = eager_twin(model)(ids, use_cache=True).past_key_values.layers
    return [layer.keys for layer in layers], [layer.values for layer in layers]


def top_ascending(scores, k):
    return scores.topk(k, dim=-1).indices.sort(dim=-1).values


# ------------------------------------------------------------------------------------------------- KeyDiff

def ref_keydiff(keys, capacity):
    """The paper's score (arXiv 2504.15364, eq. of the anchor): the anchor is the average of the unit-normalised keys,
    a key's score its cosine similarity to the anchor, and the most similar are evicted: keep the `capacity` least
    similar, per KV head."""
    kept, scores = [], []
    for layer in keys:  # (batch, kv_heads, n, d)
        unit = layer / layer.norm(dim=-1, keepdim=True)
        anchor = unit.mean(dim=2, keepdim=True)
        similarity = (unit * (anchor / anchor.norm(dim=-1, keepdim=True))).sum(dim=-1)
        kept.append(top_ascending(-similarity, capacity))
        scores.append(-similarity)
    return kept, scores


@pytest.mark.parametrize("n, capacity", [(96, 40), (150, 30)])
def test_keydiff_keeps_the_keys_least_like_the_anchor(n, capacity, byte_tokenizer):
    model = tiny()
    ids = torch.randint(2, 256, (2, n), generator=torch.Generator().manual_seed(n))
    result = C.generate(model, byte_tokenizer, ids, policy=C.KeyDiff(capacity=capacity), max_new_tokens=2)
    keys, _ = eager_cache(model, ids)
    assert_same_selection(result.kept_indices, *ref_keydiff(keys, capacity), 0)


# --------------------------------------------------------------------------------------------------- LagKV

def ref_lag_score(states, start, lag, partitions):
    """The authors' `_get_states_score` (LagKV lag_kv.py), one head at a time: (n, d) states -> per judged partition p
    (lag,) the softmax over p of the std over channels of p's states min-max normalised by partition p + 1's."""
    out = []
    for p in range(partitions):
        judged = states[start + p * lag: start + (p + 1) * lag]
        reference = states[start + (p + 1) * lag: start + (p + 2) * lag]
        low, high = reference.min(dim=0).values, reference.max(dim=0).values
        out.append(torch.softmax(((judged - low) / (high - low)).std(dim=-1), dim=0))
    return out


def ref_lagkv(keys, values, capacity, sinks, lag):
    """The authors' `_compress_algo` at one compression of the whole prompt (the prefill), with its ratio replaced by
    the budget: the sinks, every judged partition's best `share` tokens by key score + value score (one more for
    each of the latest partitions while the budget has some left), and the tail (the last whole partition and the
    rest); per KV head."""
    kept = []
    for layer_keys, layer_values in zip(keys, values):
        batch, kv_heads, n, _ = layer_keys.shape
        partitions = (n - sinks) // lag - 1
        end = sinks + partitions * lag
        spare = capacity - sinks - (n - end)
        share, extra = divmod(spare, partitions)
        rows = []
        for b in range(batch):
            for h in range(kv_heads):
                key_scores = ref_lag_score(layer_keys[b, h], sinks, lag, partitions)
                value_scores = ref_lag_score(layer_values[b, h], sinks, lag, partitions)
                chosen = list(range(sinks))
                for p, (k, v) in enumerate(zip(key_scores, value_scores)):
                    take = share + (p >= partitions - extra)
                    chosen += (sinks + p * lag + (k + v).topk(take).indices).tolist()
                rows.append(sorted(chosen) + list(range(end, n)))
        kept.append(torch.tensor(rows).view(batch, kv_heads, -1))
    return kept


@pytest.mark.parametrize("capacity",
                         [4 + 20 + 11 * 8, 4 + 20 + 11 * 8 + 5, 4 + 20 + 11])  # even shares, 5 left over, 1 each
def test_lagkv_keeps_each_partitions_best_tokens_as_its_official_code(capacity, byte_tokenizer):
    """200 tokens, 4 sinks, lag 16: 12 whole partitions after the sinks, the last one (and 4 more tokens) the tail,
    11 judged partitions."""
    model = tiny()
    ids = torch.randint(2, 256, (2, 200), generator=torch.Generator().manual_seed(5))
    policy = C.LagKV(capacity=capacity, sinks=4, lag_size=16)
    result = C.generate(model, byte_tokenizer, ids, policy=policy, max_new_tokens=2)
    keys, values = eager_cache(model, ids)
    for layer, (mine, ref) in enumerate(zip(result.kept_indices, ref_lagkv(keys, values, capacity, 4, 16))):
        assert torch.equal(mine, ref), f"layer {layer}: {(mine == ref).float().mean():.1%} agree"


def test_lagkv_without_a_judged_partition_keeps_sinks_and_the_most_recent(byte_tokenizer):
    """Below sinks + 2 * lag tokens there is nothing to judge: the sinks and the latest positions (kvpress's fallback),
    never the whole cache under the label; a budget smaller than sinks + tail keeps the tail's latest positions."""
    model = tiny()
    ids = torch.randint(2, 256, (1, 90), generator=torch.Generator().manual_seed(6))
    short = C.generate(model, byte_tokenizer, ids, policy=C.LagKV(capacity=30), max_new_tokens=1)  # 90 < 16 + 256
    expected = torch.tensor(list(range(16)) + list(range(76, 90)))
    assert all(torch.equal(kept[0, h], expected) for kept in short.kept_indices for h in range(2))
    ids = torch.randint(2, 256, (1, 120), generator=torch.Generator().manual_seed(7))
    tight = C.generate(model, byte_tokenizer, ids, policy=C.LagKV(capacity=20, sinks=4, lag_size=16), max_new_tokens=1)
    expected = torch.tensor(list(range(4)) + list(range(104, 120)))  # tail = 116..119 and 100..115: its latest 16
    assert all(torch.equal(kept[0, h], expected) for kept in tight.kept_indices for h in range(2))


# ----------------------------------------------------------------------------------------------- Q-Filters

def ref_query_directions(model, ids):
    """Per layer (kv_heads, d): the first right singular vector (torch.linalg.svd) of the matrix of a KV head's
    queries, its query heads' rows stacked, signed so that their mean projection is positive. The queries are rebuilt
    from q_proj's outputs (a forward hook) and transformers' own RoPE (rotary_emb, apply_rotary_pos_emb)."""
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    d = config.hidden_size // heads
    projected = {}
    hooks = [block.self_attn.q_proj.register_forward_hook(lambda m, a, out, i=i:
                                                          projected.setdefault(i, []).append(out))
             for i, block in enumerate(model.model.layers)]
    with torch.no_grad():
        for row in ids:
            model(row[None], use_cache=False)
    for hook in hooks:
        hook.remove()
    directions = []
    for layer in range(config.num_hidden_layers):
        queries = []
        for row, out in zip(ids, projected[layer]):
            q = out.view(1, -1, heads, d).transpose(1, 2)  # (1, heads, n, d) before RoPE
            cos, sin = model.model.rotary_emb(q, torch.arange(row.numel())[None])
            q, _ = apply_rotary_pos_emb(q, q, cos, sin)
            queries.append(q[0])
        q = torch.cat(queries, dim=1).double()  # (heads, tokens, d)
        per_kv = []
        for h in range(kv_heads):
            group = q[h * heads // kv_heads:(h + 1) * heads // kv_heads].reshape(-1, d)
            u = torch.linalg.svd(group, full_matrices=False).Vh[0]
            per_kv.append(u * torch.sign(group.mean(dim=0) @ u))
        directions.append(torch.stack(per_kv))
    return directions


def test_query_filters_are_the_main_signed_direction_of_the_queries(byte_tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("SNAPKV_LAB_CACHE", str(tmp_path))
    from snapkv_lab.tasks.corpus import haystack_ids

    model = tiny()
    filters = query_filters(model, byte_tokenizer, tokens=512, sequence=256)
    ids = torch.tensor(haystack_ids(byte_tokenizer, 512, source="pydoc")).view(2, 256)
    for layer, ref in enumerate(ref_query_directions(model, ids)):
        torch.testing.assert_close(filters[layer].double(), ref, atol=1e-4, rtol=0)
    # read back from the cache
    assert torch.equal(query_filters(model, byte_tokenizer, tokens=512, sequence=256), filters)
    assert len(list((tmp_path / "query_filters").iterdir())) == 1


@pytest.mark.slow
def test_the_shipped_filters_are_read_for_the_bundled_model_and_point_as_measured_ones(smollm, tmp_path, monkeypatch):
    """SmolLM2's filters at the defaults (8192 tokens) ship in the package (scripts/ship_calibrations.py): an empty
    cache folder reads them, no forward run, nothing written; filters measured here over the calibration's first 1024
    tokens point the same way in every (layer, KV head) (cosine > 0.98; 0.995 at least when shipped)."""
    from snapkv_lab.policies import query_filters as module

    model, tokenizer = smollm
    monkeypatch.setenv("SNAPKV_LAB_CACHE", str(tmp_path))
    with monkeypatch.context() as patch:
        patch.setattr(module, "intercept_attention", lambda *a, **k: pytest.fail("the shipped filters were not read"))
        shipped = query_filters(model, tokenizer)
    assert not (tmp_path / "query_filters").exists()
    config = model.config
    assert shipped.shape == (config.num_hidden_layers, config.num_key_value_heads, config.head_dim)
    measured = query_filters(model, tokenizer, tokens=1024, cache=False)
    assert float((shipped * measured).sum(-1).min()) > 0.98


def test_qfilters_keeps_the_keys_furthest_along_the_query_direction(byte_tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("SNAPKV_LAB_CACHE", str(tmp_path))
    model = tiny()
    ids = torch.randint(2, 256, (2, 120), generator=torch.Generator().manual_seed(8))
    policy = C.QFilters(capacity=40, calibration_tokens=512)
    result = C.generate(model, byte_tokenizer, ids, policy=policy, max_new_tokens=2)
    filters = query_filters(model, byte_tokenizer, tokens=512)
    keys, _ = eager_cache(model, ids)
    scores = [(layer * filters[i][None, :, None]).sum(dim=-1) for i, layer in enumerate(keys)]
    assert_same_selection(result.kept_indices, [top_ascending(s, 40) for s in scores], scores, 0)


def test_qfilters_inside_compress_needs_a_tokenizer_once(byte_tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("SNAPKV_LAB_CACHE", str(tmp_path))
    model = make_tiny_llama(seed=3)
    ids = torch.randint(2, 256, (1, 80), generator=torch.Generator().manual_seed(9))
    policy = C.QFilters(capacity=20, calibration_tokens=256)
    with pytest.raises(ValueError, match="tokenizer"):
        with C.compress(model, policy):
            pass
    with C.compress(model, policy, tokenizer=byte_tokenizer) as state:
        model(ids, past_key_values=state.cache)
    assert state.cache.get_seq_length() == 20


# ------------------------------------------------------------------------------------------------- SmolLM2

@pytest.mark.slow
@pytest.mark.parametrize("name", ["KeyDiff", "LagKV"])
def test_attention_free_kept_positions_match_their_references_smollm(name, smollm):
    """The defaults on a 600-token essay prompt at 256 positions per head."""
    from snapkv_lab.tasks.corpus import haystack_ids

    model, tokenizer = smollm
    ids = torch.tensor([haystack_ids(tokenizer, 600, start=3)])
    result = C.generate(model, tokenizer, ids, policy=C.POLICIES[name](capacity=256), max_new_tokens=1)
    keys, values = eager_cache(model, ids)
    if name == "KeyDiff":
        assert_same_selection(result.kept_indices, *ref_keydiff(keys, 256), 0)
    else:  # 16 sinks, lag 128: 4 whole partitions, 3 judged, the tail 456..599; 96 positions shared 32 each
        for layer, (mine, ref) in enumerate(zip(result.kept_indices, ref_lagkv(keys, values, 256, 16, 128))):
            assert torch.equal(mine, ref), layer


def test_qfilters_prepared_under_inference_mode_score_a_plain_forward(byte_tokenizer, tmp_path, monkeypatch):
    """Filters calibrated inside generate (inference mode) must serve a later forward that autograd tracks."""
    monkeypatch.setenv("SNAPKV_LAB_CACHE", str(tmp_path))
    model = make_tiny_llama(seed=4)
    ids = torch.randint(2, 256, (1, 80), generator=torch.Generator().manual_seed(10))
    policy = C.QFilters(capacity=20, calibration_tokens=256)
    C.generate(model, byte_tokenizer, ids, policy=policy, max_new_tokens=1)
    with C.compress(model, policy) as state:
        model(ids, past_key_values=state.cache)
    assert state.cache.get_seq_length() == 20


@pytest.mark.parametrize("wrapper", ["AdaKV", "ChunkKV", "CriticalKV", "DecodingEviction"])
def test_wrapped_attention_free_scorers_are_prepared_through_their_wrapper(wrapper, byte_tokenizer, tmp_path,
                                                                           monkeypatch):
    """A wrapper hands `prepare` to the policy it wraps (unprepared, QFilters refuses to score): the wrapped scorer
    runs on a model it has never met and the cache is cut to the budget."""
    monkeypatch.setenv("SNAPKV_LAB_CACHE", str(tmp_path))
    model = make_tiny_llama(seed=5)
    ids = torch.randint(2, 256, (1, 120), generator=torch.Generator().manual_seed(11))
    policy = C.POLICIES[wrapper](policy=C.QFilters(calibration_tokens=256), capacity=40)
    result = C.generate(model, byte_tokenizer, ids, policy=policy, max_new_tokens=2)
    assert result.cache_lengths == [40, 40]  # per head on average (AdaKV's heads differ), each layer
