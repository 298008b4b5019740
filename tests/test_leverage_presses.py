"""Compactor and its two halves, LeverageScore and NonCausalAttn (arXiv 2507.08143; kvpress 0.5.5's presses by the
paper's author), CUR (CurDKV) and Cap (CAPKV), kvpress 0.5.5's leverage-style scorers: kept positions vs each score
written plainly from the paper's equations and kvpress's code, over the pre-RoPE keys k_proj gives (a forward hook on
the eager twin, as kvpress re-projects the hidden states), the post-RoPE queries rebuilt with transformers' own RoPE,
and the eager twin's cached keys and values, on the tiny random Llama. Random sketches are drawn as the policies
document (a generator seeded with seed * 100_003 + layer)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import eager_twin, make_tiny_llama
from reference import assert_same_selection, top_with_tail
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import snapkv_lab as C


def tiny():
    return make_tiny_llama(initializer_range=0.3)


def distinct_ids(n, seed):
    """(2, n) token ids without repeats in a row: a repeated token has the same pre-RoPE key in layer 0, an exact
    tie."""
    generator = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(254, generator=generator)[:n] + 2 for _ in range(2)])


def projections(model, ids):
    """Per layer (pre-RoPE keys (batch, kv_heads, n, d), post-RoPE queries (batch, heads, n, d), cached keys, values
    (batch, kv_heads, n, d), pre-RoPE queries) of transformers' eager twin: keys and queries from k_proj / q_proj of
    each layer's input."""
    twin = eager_twin(model)
    config = model.config
    d = config.hidden_size // config.num_attention_heads
    inputs = {}
    hooks = [block.self_attn.register_forward_hook(lambda m, a, kw, out, i=i: inputs.update({i: kw["hidden_states"]}),
                                                   with_kwargs=True) for i, block in enumerate(twin.model.layers)]
    with torch.no_grad():
        layers = twin(ids, use_cache=True).past_key_values.layers
        for hook in hooks:
            hook.remove()
        b, n = ids.shape
        cos, sin = twin.model.rotary_emb(inputs[0], torch.arange(n)[None].expand(b, -1))
        out = []
        for i, block in enumerate(twin.model.layers):
            pre_keys = block.self_attn.k_proj(inputs[i]).view(b, n, -1, d).transpose(1, 2)
            pre_queries = block.self_attn.q_proj(inputs[i]).view(b, n, -1, d).transpose(1, 2)
            queries, _ = apply_rotary_pos_emb(pre_queries, pre_queries, cos, sin)
            out.append((pre_keys, queries, layers[i].keys, layers[i].values, pre_queries))
    return out


def ref_leverage(pre_keys, layer, k, seed=0, ridge=1e-2):
    """(batch, kv_heads, n) ridge leverage diag(X (X^T X + ridge I)^-1 X^T) of X = centred keys @ Phi, float64, Phi
    (d x k) N(0, 1/k) per KV head (the paper's right sketch; kvpress leverage_press.py:75-100)."""
    kv_heads, d = pre_keys.shape[1], pre_keys.shape[-1]
    phi = torch.randn(kv_heads, d, k, generator=torch.Generator().manual_seed(seed * 100_003 + layer)) / math.sqrt(k)
    x = (pre_keys.double() - pre_keys.double().mean(dim=-2, keepdim=True)) @ phi.double()
    gram = x.transpose(-2, -1) @ x + ridge * torch.eye(k, dtype=torch.float64)
    hat = x @ torch.linalg.solve(gram, x.transpose(-2, -1))  # (batch, kv_heads, n, n)
    return hat.diagonal(dim1=-2, dim2=-1).clamp_min(0)


def zscore(scores):
    """Per batch row: over its heads and positions, unbiased std (kvpress's z-score of one prompt)."""
    flat = scores.flatten(1)
    return (scores - flat.mean(1).view(-1, 1, 1)) / flat.std(1).view(-1, 1, 1)


def ref_non_causal(queries, keys, values, chunk_size, mask_padding=False):
    """(batch, kv_heads, n): kvpress's NonCausalAttnPress (non_causal_attention_press.py:75-127) one chunk at a time.
    Inside a chunk every query sees every key (unscaled q.k, softmax); the last chunk, shorter by p, is padded as
    kvpress pads it: p zero keys of logit -1e-9 in every query's softmax, and p zero queries whose logits are 0 on the
    chunk's keys (so ~1/chunk_size each); mask_padding: no padding at all (the last chunk alone). Column sums, mean
    per GQA group, times ||v||, mean over 3 neighbours (zero padded)."""
    b, heads, n, _ = queries.shape
    group = heads // keys.shape[1]
    keys = keys.repeat_interleave(group, 1)
    received = torch.zeros(b, heads, n, dtype=torch.float64)
    for start in range(0, n, chunk_size):
        end = min(start + chunk_size, n)
        pad = 0 if mask_padding else chunk_size - (end - start)
        logits = queries[:, :, start:end].double() @ keys[:, :, start:end].double().transpose(-2, -1)
        padded = torch.cat([logits, torch.full((b, heads, end - start, pad), -1e-9, dtype=torch.float64)], -1)
        received[..., start:end] += torch.softmax(padded, -1)[..., : end - start].sum(-2)
        if pad:  # the padded queries: logits 0 on real keys, -1e-9 on padded ones
            row = torch.softmax(torch.tensor([0.0] * (end - start) + [-1e-9] * pad, dtype=torch.float64), 0)
            received[..., start:end] += pad * row[: end - start]
    grouped = received.view(b, -1, group, n).mean(2) * values.double().norm(dim=-1)
    return torch.nn.functional.avg_pool1d(grouped, 3, stride=1, padding=1)


@pytest.mark.parametrize("n, capacity, k", [(96, 40, 8), (150, 30, 48)])
def test_leverage_keeps_the_keys_of_highest_leverage(n, capacity, k, byte_tokenizer):
    model = tiny()
    ids = distinct_ids(n, n)
    result = C.generate(model, byte_tokenizer, ids, policy=C.LeverageScore(capacity=capacity, sketch_dimension=k),
                        max_new_tokens=2)
    scores = [ref_leverage(pre_keys, layer, k) for layer, (pre_keys, *_) in enumerate(projections(model, ids))]
    assert_same_selection(result.kept_indices, [top_with_tail(s, capacity, n) for s in scores], scores, 0)


@pytest.mark.parametrize("n, capacity, chunk, mask", [(96, 40, 32, False), (150, 30, 64, False), (150, 30, 64, True)])
def test_non_causal_keeps_the_keys_their_chunk_attends_to(n, capacity, chunk, mask, byte_tokenizer):
    model = tiny()
    ids = distinct_ids(n, n)
    policy = C.NonCausalAttn(capacity=capacity, chunk_size=chunk, mask_padding=mask)
    result = C.generate(model, byte_tokenizer, ids, policy=policy, max_new_tokens=2)
    scores = [ref_non_causal(queries, keys, values, chunk, mask)
              for _, queries, keys, values, _ in projections(model, ids)]
    assert_same_selection(result.kept_indices, [top_with_tail(s, capacity, n) for s in scores], scores, 0)


@pytest.mark.parametrize("n, capacity, chunk", [(96, 40, 32), (150, 30, 64)])
def test_compactor_blends_leverage_and_attention_between_its_sinks_and_tail(n, capacity, chunk, byte_tokenizer):
    """kvpress's CompactorPress (compactor_press.py:117-136): both scores on positions 8..n-4 only, each z-scored there,
    blended with the compression ratio 1 - capacity / n; the 8 first and 4 last positions kept."""
    model = tiny()
    ids = distinct_ids(n, n + 1)
    policy = C.Compactor(capacity=capacity, chunk_size=chunk, sketch_dimension=8)
    result = C.generate(model, byte_tokenizer, ids, policy=policy, max_new_tokens=2)
    scores = []
    for layer, (pre_keys, queries, keys, values, _) in enumerate(projections(model, ids)):
        inner = slice(8, n - 4)
        leverage = zscore(ref_leverage(pre_keys[:, :, inner], layer, 8))
        attention = zscore(ref_non_causal(queries[:, :, inner], keys[:, :, inner], values[:, :, inner], chunk))
        blended = (1 - capacity / n) * leverage + attention
        scores.append(torch.nn.functional.pad(blended, (8, 0), value=math.inf))  # the prefix: sinks, then the rest
    assert_same_selection(result.kept_indices, [top_with_tail(s, capacity - 4, n) for s in scores], scores, 4)


def test_scores_of_a_compressed_cache_are_refused(byte_tokenizer):
    """Pre-RoPE keys need every key's position and the attention every key's own query: a chunked prefill that
    compresses between chunks is refused, as kvpress scores a prefill only."""
    model = tiny()
    ids = distinct_ids(120, 3)[:1]
    for policy in (C.LeverageScore(capacity=30), C.NonCausalAttn(capacity=30), C.Compactor(capacity=30)):
        with pytest.raises(NotImplementedError, match="prefill"):
            C.generate(model, byte_tokenizer, ids, policy=policy, max_new_tokens=1, prefill_chunk=40)


def test_a_shared_prefill_serves_a_whole_prompt_scorer_query_aware_from_one_call_over_the_whole_prompt(byte_tokenizer):
    """Fed a question after its context, a prefill shared with NonCausalAttn (which scores the whole prompt from one
    call) serves every other policy as if NonCausalAttn were not there, and NonCausalAttn's query-agnostic state from
    the context alone. Its query-aware state is kvpress's query-aware press: the kvpress reference over context and
    question prefilled together, each chunk of 64 seeing itself whole. That prompt is fed again once, for every
    policy that refused the split."""
    from snapkv_lab.compression import SharedPrefill
    from snapkv_lab.compression.generation import answer_runs, run_states

    model = tiny()
    ids = distinct_ids(120, 3)[:1]
    context, question = ids[:, :100], ids[:, 100:]
    non_causal, snapkv = C.NonCausalAttn(capacity=30, chunk_size=64), C.SnapKV(capacity=30, window_size=8)
    shared = SharedPrefill.run(model, byte_tokenizer, context, [non_causal, snapkv])
    aware = shared.extend(question)
    without = SharedPrefill.run(model, byte_tokenizer, context, [snapkv]).extend(question).state(snapkv)
    for layer, kept in without.kept_indices.items():  # the other policy's state as if NonCausalAttn were not there
        assert kept.shape[-1] == 30 and torch.equal(aware.state(snapkv).kept_indices[layer], kept)
    assert aware.serving(snapkv) is aware and shared.serving(non_causal) is shared
    refed = aware.serving(non_causal)
    assert refed is not aware and refed.refed and aware.serving(non_causal) is refed  # fed again once
    assert torch.equal(refed.ids, ids)

    runs = {(policy.name, mode): (prompt, state) for _, policy, mode, prompt, state in
            run_states(shared, [question], [non_causal], ["query-aware", "query-agnostic"])}
    assert set(runs) == {("FullCache", "full"), ("NonCausalAttn", "query-agnostic"), ("NonCausalAttn", "query-aware")}
    agnostic, whole = ([ref_non_causal(q, k, v, 64) for _, q, k, v, _ in projections(model, x)] for x in (context, ids))
    for (prompt, state), scores, n in ((runs["NonCausalAttn", "query-agnostic"], agnostic, 100),
                                       (runs["NonCausalAttn", "query-aware"], whole, 120)):
        assert prompt.n_tokens == n
        kept = [state.kept_indices[layer] for layer in range(len(scores))]
        assert_same_selection(kept, [top_with_tail(s, 30, n) for s in scores], scores, 0)
    assert runs["NonCausalAttn", "query-aware"][0].refed
    # Its answer is the live compressor's over the whole prompt, fed in one call (kvpress's query-aware run).
    answered, = answer_runs(model, byte_tokenizer, shared, [question], [non_causal], ["query-aware"],
                            max_new_tokens=6, full=False)
    live = C.generate(model, byte_tokenizer, ids, policy=non_causal, max_new_tokens=6)
    assert torch.equal(answered.token_ids, live.token_ids)


def ref_cur(keys, values, n_sink=4, w=16, start_aligned=True):
    """(batch, kv_heads, n) CurDKV's kv_product scores (kvpress cur_press.py:43-70), one window at a time: each squared
    norm's share of its window of w (from position 0, or ending at the last position), the product normalised over
    the positions, the sinks at +inf (kvpress: 1, above every share)."""
    n = keys.shape[2]
    first = 0 if start_aligned else n % w - w if n % w else 0
    shares = []
    for energy in (keys.double().square().sum(-1), values.double().square().sum(-1)):
        share = torch.empty_like(energy)
        for s in range(first, n, w):
            window = slice(max(s, 0), s + w)
            share[..., window] = energy[..., window] / energy[..., window].sum(-1, keepdim=True)
        shares.append(share)
    scores = shares[0] * shares[1]
    scores = scores / scores.sum(-1, keepdim=True)
    scores[..., :n_sink] = math.inf
    return scores


@pytest.mark.parametrize("n, capacity, aligned", [(96, 40, "start"), (150, 30, "start"), (150, 30, "end")])
def test_cur_keeps_the_tokens_of_highest_local_key_and_value_energy(n, capacity, aligned, byte_tokenizer):
    model = tiny()
    ids = distinct_ids(n, n + 2)
    policy = C.CUR(capacity=capacity, window_alignment=aligned)
    result = C.generate(model, byte_tokenizer, ids, policy=policy, max_new_tokens=2)
    scores = [ref_cur(keys, values, start_aligned=aligned == "start")
              for _, _, keys, values, _ in projections(model, ids)]
    assert_same_selection(result.kept_indices, [top_with_tail(s, capacity, n) for s in scores], scores, 0)


def ref_cap(model, keys, values, pre_queries, n_sink=4, tau=5.0, future=512, epsilon=1e-6):
    """(batch, kv_heads, n) CAPKV as kvpress's CapPress (cap_press.py:101-295), float64: per query head the mean of
    the pre-RoPE queries after the sinks, times the mean over the next `future` positions of Llama's rotation matrices
    cos I + sin J (J the half-split quarter turn); w = exp(tau (cos(anchor, k) - max)); score w * v^T (I + sum (w + eps)
    v v^T)^-1 v, the GQA group's mean; the sinks +inf."""
    b, heads, n, d = pre_queries.shape
    cos, sin = model.model.rotary_emb(pre_queries, torch.arange(n, n + future)[None])
    half = d // 2
    turn = torch.zeros(d, d, dtype=torch.float64)
    turn[half:, :half], turn[:half, half:] = torch.eye(half), -torch.eye(half)
    eye = torch.eye(d, dtype=torch.float64)
    rotation = (cos[0].double()[:, :, None] * eye + sin[0].double()[:, :, None] * turn).mean(0)
    anchor = pre_queries[:, :, n_sink:].double().mean(2) @ rotation.T  # (b, heads, d)
    group = heads // keys.shape[1]
    k = keys[:, :, n_sink:].double().repeat_interleave(group, 1)
    v = values[:, :, n_sink:].double().repeat_interleave(group, 1)
    cosine = torch.nn.functional.cosine_similarity(k, anchor[:, :, None], dim=-1)
    w = torch.exp(tau * (cosine - cosine.amax(-1, keepdim=True)))
    capacity = eye + torch.einsum("bhm,bhmd,bhme->bhde", w + epsilon, v, v)
    leverage = torch.einsum("bhmd,bhmd->bhm", v, torch.linalg.solve(capacity, v.transpose(-2, -1)).transpose(-2, -1))
    scores = (w * leverage).view(b, keys.shape[1], group, -1).mean(2)
    return torch.nn.functional.pad(scores, (n_sink, 0), value=math.inf)


@pytest.mark.parametrize("n, capacity", [(96, 40), (150, 30)])
def test_cap_keeps_the_aligned_values_of_highest_capacity_leverage(n, capacity, byte_tokenizer):
    model = tiny()
    ids = distinct_ids(n, n + 3)
    result = C.generate(model, byte_tokenizer, ids, policy=C.Cap(capacity=capacity), max_new_tokens=2)
    with torch.no_grad():
        scores = [ref_cap(model, keys, values, pre_queries)
                  for _, _, keys, values, pre_queries in projections(model, ids)]
    assert_same_selection(result.kept_indices, [top_with_tail(s, capacity, n) for s in scores], scores, 0)
