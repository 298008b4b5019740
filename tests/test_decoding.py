"""Eviction while decoding (H2O as in its paper) against a plain reference written from the paper with
transformers' eager attention; compress once, ask many. KVzip's tests: test_kvzip.py."""

from __future__ import annotations

import pytest
import torch
from conftest import eager_twin, make_tiny_llama
from reference import assert_same_selection, eager_attentions, top_with_tail

import snapkv_lab

N, WINDOW, CAPACITY, INTERVAL, NEW = 48, 4, 20, 5, 24


def ids(seed=0, n=N, batch=1):
    return torch.randint(2, 256, (batch, n), generator=torch.Generator().manual_seed(seed))


def masked_step(eager, cache, token: torch.Tensor, position: int, held: list[int], **options):
    """One decode step of the eager twin at `position`, every cached position outside `held` hidden by a
    (1, 1, 1, position + 1) mask (one layer, one KV head: the references evict by masking)."""
    mask = torch.full((1, 1, 1, position + 1), float("-inf"))
    mask[..., held] = 0
    with torch.no_grad():
        return eager(token.view(1, 1), past_key_values=cache, attention_mask=mask,
                     position_ids=torch.tensor([[position]]), use_cache=True, **options)


def h2o_reference(model, prompt: torch.Tensor, capacity: int) -> tuple[list[int], list[int]]:
    """H2O as its official code evicts (FMInference/H2O @ac75c2a, h2o_hf/utils_real_drop/modify_llama.py,
    H2OKVCache_LayerWise): hh_size = recent_size = capacity / 2 (the scripts' heavy_ratio = recent_ratio); every
    attention call adds the attention each cached position received (summed over the call's queries) to its running
    score, the prompt's at prefill included (_update_hh_score, lines 317-326); then, while the cache holds more than
    the budget, it keeps the hh_size best scores among all but the last recent_size positions, and those last ones
    (__call__, lines 258-287). The official code is MHA (one score row per head); here one KV head serves 4 query
    heads, whose rows are averaged. A one-layer model, so that a (1, 1, 1, n) mask can hide what was evicted.
    Returns (tokens, positions held after the last step)."""
    heavy, recent = capacity // 2, capacity - capacity // 2
    eager = eager_twin(model)
    with torch.no_grad():
        out = eager(prompt, output_attentions=True, use_cache=True)
    n = prompt.shape[1]
    score = dict(enumerate(out.attentions[0][0].sum(1).mean(0).tolist()))  # position -> running score

    def evict(held):
        older, last = held[:-recent], held[-recent:]
        return sorted(sorted(older, key=lambda p: -score[p])[:heavy]) + last

    held = evict(list(range(n)))
    cache, token, tokens = out.past_key_values, out.logits[0, -1].argmax(), []
    for step in range(NEW):
        tokens.append(int(token))
        if step == NEW - 1:
            break
        position = n + step
        held.append(position)
        out = masked_step(eager, cache, token, position, held, output_attentions=True)
        probs = out.attentions[0][0, :, 0].mean(0)  # (position + 1,)
        for p in held:
            score[p] = score.get(p, 0.0) + float(probs[p])
        held = evict(held)  # every step: the cache holds capacity + 1 during the call, capacity after it
        token = out.logits[0, -1].argmax()
    return tokens, held


def test_h2o_matches_its_official_eviction(byte_tokenizer):
    model = make_tiny_llama(initializer_range=0.3, num_hidden_layers=1, num_key_value_heads=1)
    prompt = ids(3)
    policy = snapkv_lab.H2O(capacity=CAPACITY)  # the paper's defaults: half heavy hitters, half recent, every step
    ref_tokens, ref_held = h2o_reference(model, prompt, CAPACITY)
    run = snapkv_lab.generate(model, byte_tokenizer, prompt, policy=policy, max_new_tokens=NEW)
    assert run.token_ids[0].tolist() == ref_tokens
    assert run.kept_indices[0][0, 0].tolist() == ref_held and len(ref_held) == CAPACITY
    assert max(ref_held) >= N  # generated tokens were kept, prompt tokens evicted: eviction really happened
    once = snapkv_lab.generate(model, byte_tokenizer, prompt, policy=snapkv_lab.H2O(capacity=CAPACITY, interval=None),
                               max_new_tokens=NEW)
    assert once.kept_indices[0].max() < N and once.kept_indices[0].shape[-1] == CAPACITY  # compressed once
    with snapkv_lab.compress(model, policy) as state:  # model.generate under compress evicts the same way
        model.generate(prompt, attention_mask=torch.ones_like(prompt), past_key_values=state.cache, max_new_tokens=NEW,
                       do_sample=False, eos_token_id=None)
    assert state.kept_indices[0][0, 0].tolist() == ref_held


def test_decoding_eviction_scores_at_token_positions(byte_tokenizer):
    """A scorer inside DecodingEviction sees its voters at their token positions, not at their cache slots:
    ExpectedAttention un-rotates each query by the position RoPE gave it. Checked by recording what it is handed."""
    model = make_tiny_llama(initializer_range=0.3)
    prompt = ids(8)
    seen = []
    original = snapkv_lab.ExpectedAttention.score

    def spy(self, call):
        seen.append((call.slots.tolist(), call.positions.tolist(), call.n_keys))
        return original(self, call)

    policy = snapkv_lab.DecodingEviction(policy=snapkv_lab.ExpectedAttention(), capacity=CAPACITY, kept_tail=WINDOW,
                                         interval=8)
    snapkv_lab.ExpectedAttention.score = spy
    try:
        snapkv_lab.generate(model, byte_tokenizer, prompt, policy=policy, max_new_tokens=26)
    finally:
        snapkv_lab.ExpectedAttention.score = original
    decode = [s for s in seen if s[2] < N]  # the evictions (the prefill scores all N keys)
    assert decode, "no eviction happened"
    for slots, positions, n_keys in decode:
        assert slots == list(range(n_keys - len(slots), n_keys))  # the newest cache slots
        assert positions[-1] > n_keys and positions == list(range(positions[0], positions[0] + len(positions)))
    assert decode[0][1] == list(range(N, N + 8))  # the 8 tokens fed since prefill (the first at position N)


def test_eviction_bounds_the_cache_under_model_generate(byte_tokenizer):
    model = make_tiny_llama(initializer_range=0.3)
    prompt = ids(4, batch=2)
    policy = snapkv_lab.DecodingEviction(policy=snapkv_lab.SnapKV(window_size=WINDOW), capacity=CAPACITY, interval=8)
    assert policy.label == "DecodingEviction(policy=SnapKV(window_size=4), interval=8)@20"
    with snapkv_lab.compress(model, policy) as state:
        model.generate(prompt, attention_mask=torch.ones_like(prompt), past_key_values=state.cache, max_new_tokens=40,
                       do_sample=False, eos_token_id=None)
    assert all(CAPACITY <= layer.keys.shape[-2] < CAPACITY + 8 for layer in state.cache.layers)
    ours = snapkv_lab.generate(model, byte_tokenizer, prompt, policy=policy, max_new_tokens=40)
    assert all(torch.equal(state.kept_indices[i], kept) for i, kept in enumerate(ours.kept_indices))
    with pytest.raises(ValueError, match="interval"):
        snapkv_lab.DecodingEviction(policy=snapkv_lab.SnapKV(window_size=WINDOW), capacity=CAPACITY, interval=2)


def test_compress_once_ask_many(byte_tokenizer):
    """Several questions on one compressed context: each answer equals a separate query-agnostic run."""
    model = make_tiny_llama(initializer_range=0.3)
    prompt = ids(6, n=80)
    questions = [ids(7 + i, n=6 + i)[0].tolist() for i in range(3)]
    policy = snapkv_lab.SnapKV(capacity=CAPACITY, window_size=WINDOW)
    many = snapkv_lab.generate(model, byte_tokenizer, prompt, policy=policy, question=questions, max_new_tokens=8)
    assert len(many) == 3
    for question, run in zip(questions, many, strict=True):
        alone = snapkv_lab.generate(model, byte_tokenizer, prompt, policy=policy, question=question, max_new_tokens=8)
        assert torch.equal(run.token_ids, alone.token_ids)
        assert all(torch.equal(a, b) for a, b in zip(run.kept_indices, alone.kept_indices, strict=True))
    assert len({tuple(run.token_ids[0].tolist()) for run in many}) > 1  # the questions were really asked
    with pytest.raises(ValueError, match="one sequence"):
        snapkv_lab.generate(model, byte_tokenizer, prompt, policy=policy, question=torch.tensor([questions[0][:6]] * 2))


@pytest.mark.slow
def test_h2o_matches_reference_smollm(smollm):
    """On the real model (30 layers, 9 query / 3 KV heads), 600 tokens of essay: H2O = attention summed over all
    prompt rows, the mean over a KV head's query heads, from eager output_attentions."""
    from snapkv_lab.tasks.corpus import haystack_ids

    model, tokenizer = smollm
    n, budget = 600, 200
    prompt = torch.tensor([haystack_ids(tokenizer, n, start=5)])
    kv_heads = model.config.num_key_value_heads
    scores = [a.sum(2).reshape(1, kv_heads, -1, n).mean(2) for a in eager_attentions(model, prompt)]
    run = snapkv_lab.generate(model, tokenizer, prompt, policy=snapkv_lab.H2O(capacity=budget), max_new_tokens=1)
    window = budget - budget // 2  # H2O's recent half (FMInference/H2O: heavy_ratio = recent_ratio)
    reference = [top_with_tail(s[..., : n - window], budget - window, n) for s in scores]
    assert_same_selection(run.kept_indices, reference, [s[..., : n - window] for s in scores], window)


def test_decoding_eviction_held_to_a_share_of_the_tokens_seen(byte_tokenizer):
    """target_ratio (kvpress's CompressionRatioDecodingPress, kvpress 0.5.5 presses/compression_ratio_decoding_press.py
    :41-48, with DecodingPress's schedule, decoding_press.py:136-170): every `interval` decode calls the cache is cut to
    floor(seen * ratio) positions, seen = the current token's position + 1, so it grows with the answer. Written plainly
    with KNorm inside (each eviction keeps the keys of lowest norm among those held, no kept tail), on a one-layer,
    one-KV-head model whose evicted positions a (1, 1, 1, n) mask hides."""
    model = make_tiny_llama(initializer_range=0.3, num_hidden_layers=1, num_key_value_heads=1)
    prompt, ratio, interval = ids(5), 0.5, 4
    eager = eager_twin(model)
    with torch.no_grad():
        out = eager(prompt, use_cache=True)
    cache, token, tokens = out.past_key_values, out.logits[0, -1].argmax(), []

    def lowest_norms(held, k):
        norms = cache.layers[0].keys[0, 0].norm(dim=-1)
        return sorted(sorted(held, key=lambda p: float(norms[p]))[:k])

    held, steps = lowest_norms(list(range(N)), int(N * ratio)), 0
    for step in range(NEW):
        tokens.append(int(token))
        if step == NEW - 1:
            break
        position = N + step
        held.append(position)
        out = masked_step(eager, cache, token, position, held)
        steps += 1
        target = int((position + 1) * (1 - ratio))  # kvpress: max(1, int(seen * (1 - target_compression_ratio)))
        if steps >= interval and len(held) > target:
            held, steps = lowest_norms(held, target), 0
            evicted_to = list(held)  # kept_indices: the positions held after the run's last eviction
        token = out.logits[0, -1].argmax()
    policy = snapkv_lab.DecodingEviction(policy=snapkv_lab.KNorm(), capacity=ratio, interval=interval,
                                         target_ratio=ratio)
    assert policy.label == "DecodingEviction(policy=KNorm, interval=4, target_ratio=0.5)@0.5"
    run = snapkv_lab.generate(model, byte_tokenizer, prompt, policy=policy, max_new_tokens=NEW)
    assert run.token_ids[0].tolist() == tokens
    assert run.kept_indices[0][0, 0].tolist() == evicted_to
    assert len(evicted_to) > int(N * ratio)  # the cache grew with the answer, as a fixed target would not
    with pytest.raises(ValueError, match="not both"):
        snapkv_lab.DecodingEviction(policy=snapkv_lab.KNorm(), capacity=0.5, target=20, target_ratio=0.5)
