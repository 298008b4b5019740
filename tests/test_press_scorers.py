"""kvpress's own presses that the lab adds (ObservedAttention, ...): kept positions vs each press's rule written plainly
from its kvpress 0.5.5 source or its paper, over transformers' eager attention maps and the model's own cache, on the
tiny random Llama."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import eager_twin, make_tiny_llama
from reference import assert_same_selection, kv_heads

import snapkv_lab as C
from snapkv_lab.compression.shared import SharedPrefill

CAPACITY, N = 40, 96


@pytest.fixture(scope="module")
def tiny_run():
    """A tiny random Llama (peaked attention: init 0.3), two prompts of N tokens, and its eager run over them."""
    model = make_tiny_llama(initializer_range=0.3)
    ids = torch.randint(2, 256, (2, N), generator=torch.Generator().manual_seed(31))
    with torch.no_grad():
        out = eager_twin(model)(ids, output_attentions=True, use_cache=True)
    return model, ids, out


def group_mean(scores, kv):
    """(batch, heads, n) -> (batch, kv, n): the mean over each KV head's query heads."""
    return scores.reshape(scores.shape[0], kv, -1, scores.shape[-1]).mean(dim=2)


# ------------------------------------------------------------------------------------------ ObservedAttention

def ref_observed_attention(out, capacity, kv):
    """kvpress 0.5.5 ObservedAttentionPress.score (presses/observed_attention_press.py:46-51): the eager attention
    summed over the queries, divided by arange(n, 0, -1) (the queries that see each key), averaged per GQA group; the
    top n_kept of every position (ScorerPress.compress, scorer_press.py:95-98)."""
    kept, scores = [], []
    for attn in out.attentions:  # (batch, heads, n, n)
        n = attn.shape[-1]
        score = group_mean(attn.sum(2) / torch.arange(n, 0, -1), kv)
        kept.append(score.topk(capacity, dim=-1).indices.sort(dim=-1).values)
        scores.append(score)
    return kept, scores


def test_observed_attention_matches_kvpress(tiny_run, byte_tokenizer):
    model, ids, out = tiny_run
    result = C.generate(model, byte_tokenizer, ids, policy=C.ObservedAttention(capacity=CAPACITY), max_new_tokens=1)
    assert_same_selection(result.kept_indices, *ref_observed_attention(out, CAPACITY, kv_heads(model.config)), 0)
    # not H2O at prefill: the mean over the queries that see a position ranks late positions higher than the sum does
    h2o = C.generate(model, byte_tokenizer, ids, policy=C.H2O(capacity=CAPACITY, kept_tail=0, interval=None),
                     max_new_tokens=1)
    assert any(not torch.equal(a, b) for a, b in zip(result.kept_indices, h2o.kept_indices, strict=True))


def test_observed_attention_over_a_context_then_a_question_is_one_prefill(byte_tokenizer):
    """The running sums and counts carry across prompt chunks over a full cache: the same scores as one prefill; a
    cache compacted between chunks (a live chunked prefill) is refused, its slots no longer tell their positions."""
    model = make_tiny_llama(initializer_range=0.3)
    ids = torch.randint(2, 256, (1, 100), generator=torch.Generator().manual_seed(32))
    policy = C.ObservedAttention(capacity=CAPACITY)
    state = SharedPrefill.run(model, byte_tokenizer, ids[:, :60], [policy]).extend(ids[:, 60:]).state(policy)
    whole = C.generate(model, byte_tokenizer, ids, policy=policy, max_new_tokens=1)
    for layer, kept in enumerate(whole.kept_indices):
        assert torch.equal(state.kept_indices[layer], kept), layer
    with pytest.raises(NotImplementedError, match="compacted"):
        C.generate(model, byte_tokenizer, ids, policy=policy, max_new_tokens=1, prefill_chunk=48)


# ------------------------------------------------------------------------------------------------------ Finch

def ref_finch(out, capacity, window, kv, normalize=True):
    """FINCH as kvpress 0.5.5's FinchPress (the authors' code, presses/finch_press.py): the window's eager attention
    over the context, row of the query at index i multiplied by i (:73-76), averaged over the window and each GQA
    group (:79-81); the window padded with max + 1 (:84), the top n_kept of all."""
    kept, scores = [], []
    for attn in out.attentions:  # (batch, heads, n, n)
        n = attn.shape[-1]
        weights = attn[:, :, -window:, : n - window]
        if normalize:
            weights = weights * torch.arange(n - window, n)[None, None, :, None]
        score = group_mean(weights.mean(dim=-2), kv)
        padded = torch.nn.functional.pad(score, (0, window), value=float(score.max()) + 1)
        kept.append(padded.topk(capacity, dim=-1).indices.sort(dim=-1).values)
        scores.append(score)
    return kept, scores


@pytest.mark.parametrize("window,normalize", [(12, True), (8, False)])
def test_finch_matches_its_official_code(window, normalize, tiny_run, byte_tokenizer):
    model, ids, out = tiny_run
    policy = C.Finch(capacity=CAPACITY, window_size=window, normalize_scores=normalize)
    result = C.generate(model, byte_tokenizer, ids, policy=policy, max_new_tokens=1)
    assert_same_selection(result.kept_indices, *ref_finch(out, CAPACITY, window, kv_heads(model.config), normalize),
                          window)
    if not normalize:  # without the weights it is SnapKV without pooling over the same window
        snap = C.generate(model, byte_tokenizer, ids, policy=C.SnapKVNoPooling(capacity=CAPACITY, window_size=window),
                          max_new_tokens=1)
        assert all(torch.equal(a, b) for a, b in zip(result.kept_indices, snap.kept_indices, strict=True))


# ---------------------------------------------------------------------------------------- EntropyGatedChunkKV

def ref_entropy_gated(out, capacity, window, kv, chunk=10, low=4, kernel=7):
    """kvpress 0.5.5's EntropyGatedChunkKVPress.compress (presses/entropy_gated_chunkkv_press.py:71-160) over an inner
    SnapKVPress-style score written from the eager maps (window mean, max-pooled, GQA mean, the window padded with
    max + 1): summed over heads; per chunk its mean and normalised entropy; chunks by mean, those at or above the
    median mean with entropy under the median cut to their `low` best; the rest of the budget to the best left."""
    kept = []
    for attn in out.attentions:
        n = attn.shape[-1]
        votes = attn[:1, :, -window:, : n - window].mean(dim=2)
        votes = group_mean(torch.nn.functional.max_pool1d(votes, kernel, stride=1, padding=kernel // 2), kv)
        score = torch.nn.functional.pad(votes, (0, window), value=float(votes.max()) + 1)[0].sum(0)  # (n,)
        chunks = [list(range(start, min(start + chunk, n))) for start in range(0, n, chunk)]
        means = torch.tensor([float(score[c].mean()) for c in chunks])
        entropies = []
        for c in chunks:
            s = score[c] - min(float(score[c].min()), 0.0)
            p = s / (s.sum() + 1e-8)
            entropies.append(0.0 if len(c) == 1 else min(max(float(-(p * (p + 1e-8).log()).sum()) / math.log(len(c)),
                                                              0.0), 1.0))
        entropies = torch.tensor(entropies)
        mean_cut, entropy_cut = means.median(), entropies.median()  # torch's median: the lower middle value
        chosen, left = set(), capacity
        for i in sorted(range(len(chunks)), key=lambda i: -means[i]):
            if left <= 0:
                break
            c = chunks[i]
            take = min(len(c), left)
            if means[i] >= mean_cut and entropies[i] < entropy_cut:
                take = min(take, low)
            chosen |= set(sorted(c, key=lambda p: -float(score[p]))[:take])
            left -= take
        rest = sorted((p for p in range(n) if p not in chosen), key=lambda p: -float(score[p]))
        chosen |= set(rest[:left])
        kept.append(torch.tensor(sorted(chosen)))
    return kept


def test_entropy_gated_chunkkv_matches_kvpress(tiny_run, byte_tokenizer):
    model, ids, out = tiny_run
    window = 8
    # no pooling: max pooling makes plateaus of equal scores, whose order inside a chunk any tie-break may settle
    policy = C.EntropyGatedChunkKV(policy=C.SnapKVNoPooling(window_size=window), capacity=CAPACITY)
    result = C.generate(model, byte_tokenizer, ids[:1], policy=policy, max_new_tokens=1)
    reference = ref_entropy_gated(out, CAPACITY, window, kv_heads(model.config), kernel=1)
    for layer, (mine, ref) in enumerate(zip(result.kept_indices, reference, strict=True)):
        assert mine.shape == (1, 2, CAPACITY), layer  # exactly the budget, one selection for both KV heads
        assert torch.equal(mine[0, 0], ref) and torch.equal(mine[0, 1], ref), layer
    chunkkv = C.generate(model, byte_tokenizer, ids[:1], policy=C.ChunkKV(policy=C.SnapKVNoPooling(window_size=window),
                                                                         capacity=CAPACITY), max_new_tokens=1)
    assert any(not torch.equal(a[..., :CAPACITY - 10], b[..., :CAPACITY - 10])
               for a, b in zip(result.kept_indices, chunkkv.kept_indices))  # the gate cut some chunk
    with pytest.raises(ValueError, match="low_entropy_chunk_size"):
        C.EntropyGatedChunkKV(chunk_size=4)


# ----------------------------------------------------------------------------------------------------- KVgrad

def ref_kvgrad(model, tokenizer, ids, *, sinks, start, protected, suffix, chunk_size):
    """(layers, kv_heads, n) KVgrad scores as kvpress 0.5.5's KVgradPress (presses/kvgrad_press.py:171-272): each
    chunk's feed (KVzip's official protocol, test_kvzip.official_feeds) runs over a copy of the eager cache with
    gradients; Phi = sum ||h||^2 of the last decoder layer's output (:195-197); per layer A, the feed's eager attention
    renormalised over [sinks, chunk, feed] (:287-313), the chunk's columns, times ||v W_O^h||_2 (:315-323), times
    ||dPhi / d(attention output)|| at each feed token (:262-264), max over the feed and each KV head's query heads."""
    from test_kvzip import official_feeds

    eager, n = eager_twin(model), ids.shape[1]
    config = model.config
    kv, heads = config.num_key_value_heads, config.num_attention_heads
    d = config.hidden_size // heads
    with torch.no_grad():
        cache = eager(ids, use_cache=True).past_key_values
    scores = torch.zeros(config.num_hidden_layers, kv, n)
    lo = start
    for chunk, feed in official_feeds(tokenizer, ids[0, start:].tolist(), suffix, chunk_size):
        m, hi = len(feed), lo + len(chunk)
        outputs, last = {}, []

        def keep(module, args, output):
            output[0].retain_grad()
            outputs[module.layer_idx] = output[0]

        hooks = [block.self_attn.register_forward_hook(keep) for block in eager.model.layers]
        hooks.append(eager.model.layers[-1].register_forward_hook(lambda module, args, output: last.append(output)))
        for p in eager.parameters():
            p.requires_grad_(False)
        embedded = eager.model.embed_tokens(torch.tensor([feed])).detach().requires_grad_()
        out = eager(inputs_embeds=embedded, past_key_values=copy.deepcopy(cache), output_attentions=True,
                    position_ids=torch.arange(n, n + m)[None])
        last[0].square().sum().backward()
        for hook in hooks:
            hook.remove()
        columns = [*range(sinks), *range(lo, hi), *range(n, n + m)]
        for layer, attention in enumerate(out.attentions):
            probs = attention[0].detach()[..., columns]
            probs = (probs / probs.sum(-1, keepdim=True))[..., sinks:sinks + hi - lo]  # (heads, m, chunk)
            values = cache.layers[layer].values[0, :, lo:hi]  # (kv, chunk, d)
            weight = eager.model.layers[layer].self_attn.o_proj.weight
            norms = torch.stack([(values[h // (heads // kv)] @ weight[:, h * d:(h + 1) * d].T).norm(dim=-1)
                                 for h in range(heads)])  # (heads, chunk)
            gradient = outputs[layer].grad[0].norm(dim=-1)  # (m,)
            best = (probs * norms[:, None, :] * gradient[None, :, None]).amax(1)
            scores[layer, :, lo:hi] = best.view(kv, -1, hi - lo).amax(1)
        lo = hi
    scores[..., :protected] = math.inf
    return scores


def test_kvgrad_matches_kvpress():
    """With a chat template (the byte tokenizer's, test_kvzip), sinks=2, chunks of 16 over 40 context tokens; the later
    chunks' instruction as KVzip's official code words it (kvpress drops a space: repeat_prompts, the peer row's)."""
    from test_kvzip import TEMPLATE_HEAD, TEMPLATE_TAIL, TemplateTokenizer, our_scores, text_ids

    model, tokenizer = make_tiny_llama(initializer_range=0.3), TemplateTokenizer()
    head = len(TEMPLATE_HEAD)
    ids = torch.cat([torch.tensor([list(TEMPLATE_HEAD)]),
                     torch.randint(2, 256, (1, 40), generator=torch.Generator().manual_seed(33))], 1)
    policy = C.KVgrad(chunk_size=16, sinks=2, repeat_prompts="official")
    ours = our_scores(policy, model, tokenizer, ids)
    reference = ref_kvgrad(model, tokenizer, ids, sinks=2, start=head, protected=2,
                           suffix=text_ids(tokenizer, TEMPLATE_TAIL), chunk_size=16)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-4)
    kvzip = our_scores(C.KVzip(chunk_size=16, sinks=2, repeat_prompts="official"), model, tokenizer, ids)
    assert not torch.allclose(ours[..., head:], kvzip[..., head:])  # not KVzip's scores
    assert all(p.requires_grad for p in model.parameters())  # the weights left as they were
