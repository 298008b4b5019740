"""Surprisal: kept positions vs the rule written plainly from the model's own logits (tiny random Llama): the
logits of a plain second forward, which Surprisal no longer runs (it reads the prefill's final hidden states)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import make_tiny_llama
from reference import assert_same_selection

import snapkv_lab as sl
import snapkv_lab.policies.surprisal as surprisal
from snapkv_lab.compression.shared import SharedPrefill
from snapkv_lab.policies.base import Prompt

WINDOW, CAPACITY, N = 8, 40, 96


def reference_surprisal(model, ids):
    """(n,) -log p(token i | tokens < i) from the full logits of one forward, one position at a time; 0 at 0."""
    with torch.no_grad():
        logits = model(ids).logits[0].float()  # (n, vocab)
    out = torch.zeros(ids.shape[1])
    for i in range(1, ids.shape[1]):
        out[i] = -torch.log_softmax(logits[i - 1], dim=-1)[ids[0, i]]
    return out


def reference_kept(scores, n, window, capacity, kernel, sinks):
    """(k + window,) positions: exactly the `sinks` first positions, then the prefix's top scores after a plain max over
    each position's neighbours among the other positions (a sink lends its place, not its score), then the window.
    Also the pooled scores, the sinks at +inf."""
    prefix = n - window
    pooled = torch.tensor([max((float(scores[j])
                                for j in range(max(sinks, i - kernel // 2), min(prefix, i + kernel // 2 + 1))),
                               default=0.0) if i >= sinks else float("inf") for i in range(prefix)])
    top = pooled.topk(capacity - window).indices.sort().values
    return torch.cat([top, torch.arange(prefix, n)]), pooled


@pytest.mark.parametrize("split", [None, 60], ids=["one prefill", "context then question"])
def test_token_surprisal_from_the_prefill_equals_the_loss_of_every_position(split, monkeypatch, byte_tokenizer):
    """The hidden states the prefill keeps (of both chunks, context then question) give every position's loss."""
    model = make_tiny_llama(initializer_range=0.3)
    ids = torch.randint(2, 256, (1, N), generator=torch.Generator().manual_seed(0))
    # several chunks of 10 rows (the tiny vocabulary's rows are short), the last one short
    monkeypatch.setattr(surprisal, "LOGIT_ELEMENTS", 10 * model.get_output_embeddings().weight.shape[0])
    policies = [sl.Surprisal(capacity=CAPACITY, kept_tail=WINDOW)]
    shared = SharedPrefill.run(model, byte_tokenizer, ids, policies) if split is None else \
        SharedPrefill.run(model, byte_tokenizer, ids[:, :split], policies).extend(ids[:, split:])
    assert shared.final_hidden.shape == (1, N, model.config.hidden_size)
    with torch.no_grad():
        mine = surprisal.token_surprisal(model, shared.final_hidden, ids)
    torch.testing.assert_close(mine[0], reference_surprisal(model, ids), atol=1e-4, rtol=1e-5)


def test_token_surprisal_caps_the_logits_as_the_model_does(byte_tokenizer):
    """Gemma 2 soft-caps its logits (final_logit_softcapping; a cap of 2 bends the tiny model's): so does the score."""
    from families import GEMMA_SCALE, GQA, make
    from transformers import Gemma2Config

    model = make(Gemma2Config, attn="eager", final_logit_softcapping=2.0, **GEMMA_SCALE, **GQA)
    ids = torch.randint(2, 256, (1, N), generator=torch.Generator().manual_seed(4))
    hidden = SharedPrefill.run(model, byte_tokenizer, ids, [sl.Surprisal()]).final_hidden
    with torch.no_grad():
        mine = surprisal.token_surprisal(model, hidden, ids)
    torch.testing.assert_close(mine[0], reference_surprisal(model, ids), atol=1e-4, rtol=1e-5)


def test_scores_without_a_second_forward(byte_tokenizer):
    """generate with Surprisal runs the decoder once per token, as the full cache does: the prefill, then one step."""
    model = make_tiny_llama(initializer_range=0.3)
    ids = torch.randint(2, 256, (1, N), generator=torch.Generator().manual_seed(1))
    calls = []
    handle = model.get_decoder().register_forward_hook(lambda module, args, output: calls.append(output[0].shape[1]))
    try:
        sl.generate(model, byte_tokenizer, ids, policy=sl.Surprisal(capacity=CAPACITY, kept_tail=WINDOW),
                    max_new_tokens=2)
    finally:
        handle.remove()
    assert calls == [N, 1]


def test_only_prefills_with_a_reader_keep_the_final_hidden_states(byte_tokenizer):
    model = make_tiny_llama(initializer_range=0.3)
    ids = torch.randint(2, 256, (1, N), generator=torch.Generator().manual_seed(2))
    snapkv = sl.SnapKV(capacity=CAPACITY, window_size=WINDOW)
    assert SharedPrefill.run(model, byte_tokenizer, ids, [snapkv]).extend(ids[:, :5]).final_hidden is None
    wrapped = sl.AdaKV(policy=sl.Surprisal(), capacity=CAPACITY, kept_tail=WINDOW)
    assert wrapped.reads_final_hidden
    assert SharedPrefill.run(model, byte_tokenizer, ids, [snapkv, wrapped]).final_hidden.shape[1] == N
    with pytest.raises(ValueError, match="final hidden states of the prefill"):  # a cache no prefill left them on
        sl.Surprisal().prompt_scores(Prompt(model, byte_tokenizer, ids, model(ids, use_cache=True).past_key_values))


@pytest.mark.parametrize("kernel", [1, 5, 31])
def test_kept_positions_match_the_plain_rule(kernel, byte_tokenizer):
    model = make_tiny_llama(initializer_range=0.3)
    ids = torch.randint(2, 256, (1, N), generator=torch.Generator().manual_seed(kernel))
    policy = sl.Surprisal(capacity=CAPACITY, kept_tail=WINDOW, kernel_size=kernel)
    result = sl.generate(model, byte_tokenizer, ids, policy=policy, max_new_tokens=2)
    ref, pooled = reference_kept(reference_surprisal(model, ids), N, WINDOW, CAPACITY, kernel, policy.sinks)
    kv_heads = model.config.num_key_value_heads
    assert all(torch.equal(kept[0, 0], kept[0, h]) for kept in result.kept_indices for h in range(kv_heads))  # one set
    assert set(range(policy.sinks)) <= set(result.kept_indices[0][0, 0].tolist())
    layers = len(result.kept_indices)
    finite = torch.cat([pooled.nan_to_num(posinf=1e9), torch.zeros(WINDOW)])[None]  # ties are compared on scores
    assert_same_selection([k[0, :1] for k in result.kept_indices], [ref[None]] * layers, [finite] * layers, WINDOW)


@pytest.mark.parametrize("kernel", [1, 31])
def test_kept_positions_of_context_then_question_match_the_plain_rule(kernel, byte_tokenizer):
    """Query-aware: the context, then the question in a second chunk on the same cache; the scores cover both,
    as one plain forward over context + question gives them."""
    model = make_tiny_llama(initializer_range=0.3)
    ids = torch.randint(2, 256, (1, N), generator=torch.Generator().manual_seed(10 + kernel))
    policy = sl.Surprisal(capacity=CAPACITY, kept_tail=WINDOW, kernel_size=kernel)
    state = SharedPrefill.run(model, byte_tokenizer, ids[:, :70], [policy]).extend(ids[:, 70:]).state(policy)
    ref, pooled = reference_kept(reference_surprisal(model, ids), N, WINDOW, CAPACITY, kernel, policy.sinks)
    kept = [state.kept_indices[layer][0, :1] for layer in sorted(state.kept_indices)]
    finite = torch.cat([pooled.nan_to_num(posinf=1e9), torch.zeros(WINDOW)])[None]
    assert_same_selection(kept, [ref[None]] * len(kept), [finite] * len(kept), WINDOW)
    if kernel == 1:  # no ties: the very same positions
        assert all(torch.equal(k[0], ref) for k in kept)


def test_a_context_and_its_questions_pay_the_output_head_once_per_token(byte_tokenizer):
    """Query-agnostic, then two different questions fed after the same context (query-aware): each prompt's surprisal is
    the plain one of its own tokens, and the output head reads each context position once over the three prompts (a
    question pays its own tokens' rows only, the second question's not taken from the first's)."""
    model = make_tiny_llama(initializer_range=0.3)
    ids = torch.randint(2, 256, (1, N), generator=torch.Generator().manual_seed(3))
    other = torch.randint(2, 256, (1, N - 70), generator=torch.Generator().manual_seed(4))
    context = SharedPrefill.run(model, byte_tokenizer, ids[:, :70], [sl.Surprisal()])
    prompts = [(context, ids[:, :70]), (context.extend(ids[:, 70:]), ids),
               (context.extend(other), torch.cat([ids[:, :70], other], 1))]
    references = [reference_surprisal(model, tokens) for _, tokens in prompts]
    rows = []
    head = model.get_output_embeddings()
    handle = head.register_forward_hook(lambda module, args, output: rows.append(args[0].shape[1]))
    try:
        for (prefill, _), reference in zip(prompts, references, strict=True):
            torch.testing.assert_close(prefill.prompt().surprisal()[0], reference, atol=1e-4, rtol=1e-5)
            assert torch.equal(prefill.prompt().surprisal(), prefill.prompt().surprisal())  # kept, not recomputed
    finally:
        handle.remove()
    assert rows == [69, N - 70, N - 70]  # row i predicts token i + 1: the context's last row is the question's first


def test_keeps_exactly_its_sinks_however_wide_the_pooling(byte_tokenizer):
    """The sinks are kept, and pooling does not spread their forced top score to their neighbours: with a 31-token
    kernel and every score zero but one token's, the rest of the budget goes to that token's neighbourhood."""
    model = make_tiny_llama(initializer_range=0.3)
    ids = torch.randint(2, 256, (1, N), generator=torch.Generator().manual_seed(3))
    policy = sl.Surprisal(capacity=CAPACITY, kept_tail=WINDOW)
    prompt = SharedPrefill.run(model, byte_tokenizer, ids, [policy]).prompt()
    flat = torch.zeros(1, N)
    flat[:, 50] = 1.0  # one surprising token: its 31 neighbours rank next, the sinks' neighbours do not
    scores = policy.prompt_scores(dataclasses.replace(prompt, surprisal=lambda: flat))  # as the engine gave them
    kept = policy.keep(scores[0][0], N, model.config.num_key_value_heads, 0, 2)[0].tolist()
    assert kept[:policy.sinks] == list(range(policy.sinks)) and kept[-WINDOW:] == list(range(N - WINDOW, N))
    picked = kept[policy.sinks:-WINDOW]  # the budget left after sinks and window: 28 of the 31 tied positions
    assert len(picked) == CAPACITY - WINDOW - policy.sinks and set(picked) <= set(range(50 - 15, 50 + 16))


def test_refuses_per_query_head_and_negative_sinks():
    with pytest.raises(ValueError, match="scores KV heads \\(or positions\\), not query heads"):
        sl.Surprisal(per_query_head=True)
    with pytest.raises(ValueError, match="sinks must be a non-negative int"):
        sl.Surprisal(sinks=-1)
