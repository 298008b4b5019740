"""kvpress's own presses that the lab adds (ObservedAttention, ...): kept positions vs each press's rule written plainly
from its kvpress 0.5.5 source or its paper, over transformers' eager attention maps and the model's own cache, on the
tiny random Llama."""

from __future__ import annotations

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
