"""KVzip against a reference written from its official code (snu-mllab/KVzip @5d84729, cited as file:line) and
kvpress 0.5.5's KVzipPress (kvpress/presses/kvzip_press.py:line), with transformers' eager attention as the oracle
of every attention probability."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
from conftest import ByteTokenizer, eager_twin, make_tiny_llama

import snapkv_lab
from snapkv_lab.compression.shared import SharedPrefill
from snapkv_lab.policies import NO_POSITION, kvzip
from snapkv_lab.policies.kvzip import REPEAT_NEXT_BY, reconstruction_feeds

N = 64
SMOLLM_HEAD = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
               "<|im_start|>user\n")
SMOLLM_TAIL = "<|im_end|>\n<|im_start|>assistant\n"


class TemplateTokenizer(ByteTokenizer):
    """The byte tokenizer with a chat template: a system turn, then each message in role tags."""

    chat_template = "tags"

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=False):
        text = "<sys>be brief</sys>" + "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)
        return text + ("<bot>" if add_generation_prompt else "")


TEMPLATE_HEAD, TEMPLATE_TAIL = b"<sys>be brief</sys><user>", "</user><bot>"


def random_ids(seed=0, n=N, batch=1):
    return torch.randint(2, 256, (batch, n), generator=torch.Generator().manual_seed(seed))


def text_ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def official_feeds(tokenizer, context: list[int], suffix: list[int], chunk_size: int):
    """[(chunk, feed)] as model/wrapper.py builds them: chunk_fn (:18-37) cuts the context every chunk_size tokens;
    self_task (:197-221) feeds chunk 0 after "\\n\\nRepeat the previous context exactly." and chunk i after
    "\\n\\nRepeat the part of the previous context exactly, starting with " + chunk i-1's last 8 tokens, each followed
    by the template's postfix and the chunk."""
    chunks = [context[i:i + chunk_size] for i in range(0, len(context), chunk_size)]
    feeds = []
    for i, chunk in enumerate(chunks):
        if i == 0:
            instruction = text_ids(tokenizer, "\n\nRepeat the previous context exactly.")
        else:
            instruction = text_ids(tokenizer, "\n\nRepeat the part of the previous context exactly, starting with ")
            instruction += chunks[i - 1][-8:]
        feeds.append((chunk, instruction + suffix + chunk))
    return feeds


def reference_scores(model, tokenizer, ids, *, sinks: int, start: int, protected: int, suffix: list[int],
                     chunk_size: int, skip=()) -> torch.Tensor:
    """(layers, kv_heads, n) KVzip's scores of one prompt ids (1, n), written from attention/score.py:36-65: each
    chunk's feed runs over the full cache at the positions after the prompt (the cache is cut back after each,
    wrapper.py:133-146, so its length n is where the feed starts); q.k over [the first `sinks` keys, the chunk, the
    feed (causal)] only, softmax, the chunk's columns, max over the feed's queries and each KV head's query heads.
    The restricted softmax is eager's full softmax renormalised over those keys (the same ratios of exponentials).
    The first `protected` positions score +inf; positions never reconstructed score 0 (kvpress, kvzip_press.py:239-248).
    Layers in `skip` (sliding ones, whose cache holds a window) are left at 0."""
    eager, n = eager_twin(model), ids.shape[1]
    kv_heads = model.config.num_key_value_heads
    with torch.no_grad():
        cache = eager(ids, use_cache=True).past_key_values
    scores = torch.zeros(model.config.num_hidden_layers, kv_heads, n)
    lo = start
    for chunk, feed in official_feeds(tokenizer, ids[0, start:].tolist(), suffix, chunk_size):
        m, hi = len(feed), lo + len(chunk)
        with torch.no_grad():
            attentions = eager(torch.tensor([feed]), past_key_values=copy.deepcopy(cache), output_attentions=True,
                               position_ids=torch.arange(n, n + m)[None]).attentions
        columns = [*range(sinks), *range(lo, hi), *range(n, n + m)]
        for layer, attention in enumerate(attentions):
            if layer in skip:
                continue
            probs = attention[0][..., columns]  # (heads, m, keys): the future feed keys are already 0 (causal)
            probs = probs / probs.sum(-1, keepdim=True)
            best = probs[..., sinks:sinks + hi - lo].amax(1)  # (heads, chunk): max over the feed's queries
            scores[layer, :, lo:hi] = best.view(kv_heads, -1, hi - lo).amax(1)  # max over each KV head's group
        lo = hi
    scores[..., :protected] = math.inf
    return scores


def prefilled(model, tokenizer, ids):
    return SharedPrefill.run(model, tokenizer, ids, []).prompt()


def our_scores(policy, model, tokenizer, ids) -> torch.Tensor:
    """(layers, kv_heads, n) of batch row 0."""
    with torch.no_grad():
        scores = policy.prompt_scores(prefilled(model, tokenizer, ids))
    return torch.stack([scores[layer][0] for layer in sorted(scores)])


def kept_sets(kept_indices) -> list[list[set[int]]]:
    """Per layer, per KV head of batch row 0, the kept positions."""
    return [[set(row[row != NO_POSITION].tolist()) for row in kept[0]] for kept in kept_indices]


def assert_top_count(kept, reference: torch.Tensor, pools, total: int):
    """`kept` (per layer, per head sets) keeps exactly `total` positions, chosen by score: none of them scores below
    a position left out of its pool (pools: lists of (layer, head) rows that share one top count), within 1e-5."""
    assert sum(len(s) for row in kept for s in row) == total
    for pool in pools:
        inside = [float(reference[l, h, p]) for l, h in pool for p in kept[l][h]]
        outside = [float(reference[l, h, p]) for l, h in pool for p in range(reference.shape[-1])
                   if p not in kept[l][h]]
        if outside:
            assert min(inside) >= max(outside) - 1e-5


def test_scores_match_the_official_reconstruction_over_several_chunks(monkeypatch):
    """A base model (no chat template): the first 4 tokens stand in for the system prompt, the suffix is the official
    fallback "\\n\\nAnswer: " (model/template.py:26-29); 60 context tokens in chunks of 16 (the last one shorter),
    each chunk's feed scored in blocks of a few rows too (as long prompts are)."""
    model, tokenizer = make_tiny_llama(initializer_range=0.3), ByteTokenizer()
    ids = random_ids(5)
    policy = snapkv_lab.KVzip(chunk_size=16)
    ours = our_scores(policy, model, tokenizer, ids)
    monkeypatch.setattr(kvzip, "BLOCK_ELEMENTS", 1000)  # feeds of 64-100 tokens: 2-3 rows of 4 heads per block
    torch.testing.assert_close(our_scores(policy, model, tokenizer, ids), ours, atol=1e-6, rtol=1e-5)
    # the backend's attention and the restricted softmax (where the fused kernel's parts do not apply) agree
    monkeypatch.setattr(kvzip, "by_parts_supported", lambda query, settings: False)
    torch.testing.assert_close(our_scores(policy, model, tokenizer, ids), ours, atol=1e-6, rtol=1e-5)
    reference = reference_scores(model, tokenizer, ids, sinks=4, start=4, protected=4,
                                 suffix=text_ids(tokenizer, "\n\nAnswer: "), chunk_size=16)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-4)
    whole = our_scores(snapkv_lab.KVzip(), model, tokenizer, ids)  # one chunk: other chunks' keys join the softmax
    assert not torch.allclose(whole[..., 4:], ours[..., 4:], atol=1e-3)
    torch.testing.assert_close(whole, reference_scores(model, tokenizer, ids, sinks=4, start=4, protected=4,
                                                       suffix=text_ids(tokenizer, "\n\nAnswer: "), chunk_size=2000),
                               atol=1e-5, rtol=1e-4)


def test_scores_use_the_layers_own_softmax_and_skip_sliding_layers():
    """Gemma 2: logits scaled by query_pre_attn_scalar ** -0.5 (not head_dim's) and soft-capped, as its attention
    computes them (the official code divides by sqrt(head_dim), score.py:57); sliding layers are never compressed,
    so not scored."""
    from families import FAMILIES, sliding_layers

    model, tokenizer = FAMILIES["gemma2-softcap"](), ByteTokenizer()
    ids = random_ids(4)
    with torch.no_grad():
        scores = snapkv_lab.KVzip(chunk_size=24).prompt_scores(prefilled(model, tokenizer, ids))
    full = [layer for layer in range(3) if layer not in sliding_layers(model.config)]
    assert sorted(scores) == full and full
    reference = reference_scores(model, tokenizer, ids, sinks=4, start=4, protected=4,
                                 suffix=text_ids(tokenizer, "\n\nAnswer: "), chunk_size=24,
                                 skip=sliding_layers(model.config))
    for layer in full:
        torch.testing.assert_close(scores[layer][0], reference[layer], atol=1e-5, rtol=1e-4)


def test_feeds_quote_the_previous_chunk():
    """Chunk boundaries as chunk_fn and self_task cut them (wrapper.py:18-37, :197-221), with literal expectations:
    chunks of 5 (shorter than the 8 quoted tokens: the whole previous chunk is quoted), then of 10."""
    tokenizer, context = ByteTokenizer(), torch.arange(100, 123)[None]
    suffix = list(b"|S|")
    feeds = reconstruction_feeds(tokenizer, context, suffix, 5)
    assert [(start, end) for start, end, _ in feeds] == [(0, 5), (5, 10), (10, 15), (15, 20), (20, 23)]
    assert feeds[0][2][0].tolist() == list(b"\n\nRepeat the previous context exactly.|S|") + list(range(100, 105))
    assert feeds[2][2][0].tolist() == (list(b"\n\nRepeat the part of the previous context exactly, starting with ")
                                       + list(range(105, 110)) + suffix + list(range(110, 115)))
    feeds = reconstruction_feeds(tokenizer, context, suffix, 10)
    assert feeds[2][2][0].tolist()[-3 - len(suffix) - 8:] == list(range(112, 120)) + suffix + [120, 121, 122]
    kvpress = reconstruction_feeds(tokenizer, context, suffix, 5, REPEAT_NEXT_BY["kvpress"])
    assert kvpress[2][2][0].tolist() == (list(b"\n\nRepeat the part of the previous context exactly, starting with")
                                         + list(range(105, 110)) + suffix + list(range(110, 115)))
    first = reconstruction_feeds(tokenizer, context, suffix, 5)[0][2]
    assert torch.equal(kvpress[0][2], first)  # the first chunk's instruction is the same in both


def test_the_chat_template_head_is_the_system_prompt():
    """A prompt that starts with the template's head: the head is kept whole in every layer and head, is the softmax's
    sink keys and is left out of the reconstruction; the suffix is the template's end of a user turn."""
    model, tokenizer = make_tiny_llama(initializer_range=0.3), TemplateTokenizer()
    head = len(TEMPLATE_HEAD)
    ids = torch.cat([torch.tensor([list(TEMPLATE_HEAD)]), random_ids(6, n=40)], 1)
    policy = snapkv_lab.KVzip(chunk_size=16)
    reference = reference_scores(model, tokenizer, ids, sinks=head, start=head, protected=head,
                                 suffix=text_ids(tokenizer, TEMPLATE_TAIL), chunk_size=16)
    torch.testing.assert_close(our_scores(policy, model, tokenizer, ids), reference, atol=1e-5, rtol=1e-4)
    run = snapkv_lab.generate(model, tokenizer, ids, policy=dataclasses.replace(policy, capacity=40), max_new_tokens=2)
    assert all(set(range(head)) <= kept for row in kept_sets(run.kept_indices) for kept in row)
    other = torch.cat([torch.tensor([list(TEMPLATE_HEAD)]), random_ids(6, n=40)], 1)
    other[0, 3] = 7  # a prompt that does not start with the head: its first 4 tokens are the system prompt
    assert policy.layout(tokenizer, other).protected == 4
    with pytest.raises(ValueError, match="separate batches"):
        policy.layout(tokenizer, torch.cat([ids, other]))


def test_int_sinks_follow_kvpress():
    """sinks=2 with a template head of 25 tokens, as KVzipPress(n_sink=2): the first 2 tokens are kept (:376) and are
    the softmax's sink keys (:307-308), the reconstruction starts after the head (:193, :236), and the head's other
    tokens are never scored (0), so evicted first."""
    model, tokenizer = make_tiny_llama(initializer_range=0.3), TemplateTokenizer()
    head = len(TEMPLATE_HEAD)
    ids = torch.cat([torch.tensor([list(TEMPLATE_HEAD)]), random_ids(7, n=40)], 1)
    policy = snapkv_lab.KVzip(chunk_size=16, sinks=2)
    ours = our_scores(policy, model, tokenizer, ids)
    reference = reference_scores(model, tokenizer, ids, sinks=2, start=head, protected=2,
                                 suffix=text_ids(tokenizer, TEMPLATE_TAIL), chunk_size=16)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-4)
    assert bool((ours[..., 2:head] == 0).all())
    run = snapkv_lab.generate(model, tokenizer, ids, policy=dataclasses.replace(policy, capacity=30), max_new_tokens=2)
    for row in kept_sets(run.kept_indices):
        for kept in row:
            assert {0, 1} <= kept and not kept & set(range(2, head))
    assert policy.scorer_label == "KVzip(chunk_size=16, sinks=2)"


@pytest.mark.parametrize("window", [0, 6])
def test_global_budget_is_one_top_count_over_layers_and_heads(window):
    """allocation="global" (official `--level pair`, args.py:12-16; kvpress layerwise=False): one selection of
    budget x layers x KV heads over every layer's and head's scores (kvpress kvzip_press.py:384-387), the window
    kept on top; heads and layers keep different counts, the cache holds exactly the budget on average."""
    model, tokenizer = make_tiny_llama(initializer_range=0.3, num_hidden_layers=3), ByteTokenizer()
    ids, budget = random_ids(8, n=96), 30
    reference = reference_scores(model, tokenizer, ids, sinks=4, start=4, protected=4,
                                 suffix=text_ids(tokenizer, "\n\nAnswer: "), chunk_size=2000)
    policy = snapkv_lab.KVzip(capacity=budget, kept_tail=window)
    run = snapkv_lab.generate(model, tokenizer, ids, policy=policy, max_new_tokens=2)
    kept = kept_sets(run.kept_indices)
    window_positions = set(range(96 - window, 96))
    rows = [(layer, head) for layer in range(3) for head in range(2)]
    assert all(window_positions | set(range(4)) <= kept[l][h] for l, h in rows)
    chosen = [[s - window_positions for s in row] for row in kept]
    assert_top_count(chosen, reference[..., :96 - window], [rows], (budget - window) * len(rows))
    assert len({len(kept[l][h]) for l, h in rows}) > 1  # non-uniform across heads and layers
    assert run.kv_bytes == pytest.approx(budget / 96 * snapkv_lab.generate(model, tokenizer, ids,
                                                                           max_new_tokens=1).kv_bytes)


def test_uniform_allocation_keeps_the_budget_per_head():
    """allocation="uniform" (official `pair-uniform`, score.py:104-120): each layer and KV head its own top budget."""
    model, tokenizer = make_tiny_llama(initializer_range=0.3, num_hidden_layers=3), ByteTokenizer()
    ids, budget = random_ids(8, n=96), 30
    reference = reference_scores(model, tokenizer, ids, sinks=4, start=4, protected=4,
                                 suffix=text_ids(tokenizer, "\n\nAnswer: "), chunk_size=2000)
    policy = snapkv_lab.KVzip(capacity=budget, allocation="uniform")
    assert policy.label == "KVzip(allocation='uniform')@30" and policy.scoring_key == "KVzip"
    run = snapkv_lab.generate(model, tokenizer, ids, policy=policy, max_new_tokens=2)
    kept = kept_sets(run.kept_indices)
    rows = [(layer, head) for layer in range(3) for head in range(2)]
    assert all(len(kept[l][h]) == budget for l, h in rows)
    assert_top_count(kept, reference, [[row] for row in rows], budget * len(rows))


def test_adakv_over_kvzip_is_head_adaptive_per_layer():
    """AdaKV(policy=KVzip(allocation="uniform")): each layer keeps budget x KV heads positions, shared among its heads
    by KVzip's scores; with alpha_safeguard=0, one top count per layer (kvpress KVzipPress(layerwise=True),
    kvzip_press.py:380-382)."""
    model, tokenizer = make_tiny_llama(initializer_range=0.3, num_hidden_layers=3), ByteTokenizer()
    ids, budget = random_ids(9, n=96), 30
    reference = reference_scores(model, tokenizer, ids, sinks=4, start=4, protected=4,
                                 suffix=text_ids(tokenizer, "\n\nAnswer: "), chunk_size=2000)
    uniform = snapkv_lab.KVzip(allocation="uniform")
    run = snapkv_lab.generate(model, tokenizer, ids, max_new_tokens=2,
                              policy=snapkv_lab.AdaKV(policy=uniform, capacity=budget, alpha_safeguard=0.0))
    kept = kept_sets(run.kept_indices)
    layers = [[(layer, head) for head in range(2)] for layer in range(3)]
    assert_top_count(kept, reference, layers, budget * 6)
    assert all(sum(len(kept[l][h]) for l, h in pool) == 2 * budget for pool in layers)
    assert any(len(kept[l][0]) != len(kept[l][1]) for l in range(3))  # head-adaptive
    safeguarded = snapkv_lab.generate(model, tokenizer, ids, max_new_tokens=2,
                                      policy=snapkv_lab.AdaKV(policy=uniform, capacity=budget))
    assert all(len(s) >= int(0.2 * budget) for row in kept_sets(safeguarded.kept_indices) for s in row)


def test_a_wrapper_carries_the_global_selection_whole_or_refuses_it():
    """KVzip's one selection across layers: the wrappers that keep what their inner policy keeps (Merging,
    KeyRerotation) and the storage wrappers (KIVI, ThinK: each ragged head stored packed) keep exactly KVzip's
    positions, head counts that differ included; every wrapper that ranks or budgets by itself refuses it, where they
    once gave it a uniform budget under an unchanged label; over KVzip(allocation="uniform") KIVI keeps
    KVzip-uniform's."""
    model, tokenizer = make_tiny_llama(initializer_range=0.3, num_hidden_layers=3), ByteTokenizer()
    ids, budget = random_ids(10, n=96), 30

    def kept(policy):
        return kept_sets(snapkv_lab.generate(model, tokenizer, ids, policy=policy, max_new_tokens=1).kept_indices)

    alone = kept(snapkv_lab.KVzip(capacity=budget))
    assert len({len(s) for row in alone for s in row}) > 1  # global: rows keep different counts
    for wrapper in (snapkv_lab.Merging, snapkv_lab.KeyRerotation, snapkv_lab.KIVI, snapkv_lab.ThinK):
        assert kept(wrapper(policy=snapkv_lab.KVzip(), capacity=budget)) == alone, wrapper.__name__
    for wrapper in (snapkv_lab.AdaKV, snapkv_lab.ChunkKV, snapkv_lab.CriticalKV, snapkv_lab.PyramidAllocation):
        with pytest.raises(TypeError, match="would silently replace"):
            wrapper(policy=snapkv_lab.KVzip(), capacity=budget)
    uniform = snapkv_lab.KVzip(allocation="uniform", capacity=budget)
    assert kept(snapkv_lab.KIVI(policy=uniform, key_bits=4, value_bits=4, capacity=budget)) == kept(uniform)


def test_parameters_are_checked_and_labelled():
    assert snapkv_lab.KVzip().label == "KVzip@1024" and snapkv_lab.KVzip(capacity=0.3).label == "KVzip@0.3"
    assert snapkv_lab.KVzip(chunk_size=2048).label == "KVzip(chunk_size=2048)@1024"
    assert snapkv_lab.KVzip(kept_tail=8).scoring_key == "KVzip"  # the window acts after scoring
    for bad in (dict(chunk_size=0), dict(sinks=-1), dict(allocation="layer"), dict(per_query_head=True)):
        with pytest.raises(ValueError):
            snapkv_lab.KVzip(**bad)
    model, tokenizer = make_tiny_llama(initializer_range=0.3), TemplateTokenizer()
    ids = torch.cat([torch.tensor([list(TEMPLATE_HEAD)]), random_ids(6, n=40)], 1)
    with pytest.raises(ValueError, match="protected positions"):  # a 25-token system prompt in a 20-token budget
        snapkv_lab.generate(model, tokenizer, ids, policy=snapkv_lab.KVzip(capacity=20), max_new_tokens=1)


@pytest.mark.slow
def test_smollm_chat_prompt_reconstruction_and_scores(smollm):
    """SmolLM2 (30 layers, 9 query / 3 KV heads), a chat prompt of 600 tokens of essay: the system prompt is the
    template's head, the feeds are the official prompts in its chat template token by token, and the scores equal the
    reference from eager attention over 3 chunks of 256."""
    from snapkv_lab.core.framing import framed_ids
    from snapkv_lab.tasks.corpus import haystack_ids

    model, tokenizer = smollm
    ids, _ = framed_ids(tokenizer, [], [("context", haystack_ids(tokenizer, 600, start=5))])
    policy = snapkv_lab.KVzip(chunk_size=256)
    layout = policy.layout(tokenizer, ids)
    assert tokenizer.decode(ids[0, :layout.start]) == SMOLLM_HEAD and layout.protected == layout.sinks == layout.start
    feeds = reconstruction_feeds(tokenizer, ids[:, layout.start:], layout.suffix, 256)
    context = ids[0, layout.start:].tolist()
    expected = official_feeds(tokenizer, context, text_ids(tokenizer, SMOLLM_TAIL), 256)
    assert [feed[0].tolist() for _, _, feed in feeds] == [feed for _, feed in expected] and len(feeds) == 3
    assert tokenizer.decode(feeds[1][2][0]) == ("\n\nRepeat the part of the previous context exactly, starting with "
                                                + tokenizer.decode(context[248:256]) + SMOLLM_TAIL
                                                + tokenizer.decode(context[256:512]))
    reference = reference_scores(model, tokenizer, ids, sinks=layout.start, start=layout.start,
                                 protected=layout.start, suffix=layout.suffix, chunk_size=256)
    torch.testing.assert_close(our_scores(policy, model, tokenizer, ids), reference, atol=2e-5, rtol=1e-3)
    budget = 200
    run = snapkv_lab.generate(model, tokenizer, ids, policy=dataclasses.replace(policy, capacity=budget),
                              max_new_tokens=1)
    kept = kept_sets(run.kept_indices)
    rows = [(layer, head) for layer in range(30) for head in range(3)]
    assert_top_count(kept, reference, [rows], budget * len(rows))
    assert all(set(range(layout.start)) <= kept[l][h] for l, h in rows)
