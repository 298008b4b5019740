"""span_effects against a plain computation written here: a forward over a cache with the span's keys and values
cut out of every layer (transformers' own DynamicCache, positions kept), the answer teacher-forced, KL and log-prob
from the two forwards' logits."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from conftest import ByteTokenizer, make_tiny_llama
from transformers import DynamicCache

from snapkv_lab.compression.span_effects import default_spans, span_effects

N = 96


@pytest.fixture(scope="module")
def model():
    return make_tiny_llama(initializer_range=0.3, num_hidden_layers=3)


def ids(n, seed):
    return torch.randint(2, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def plain_logprobs(model, context, fed, cut=None, layers=None):
    """Log-probabilities after each fed token over the context's cache with positions [start, end) removed from the
    given layers (all when None): the cut is real, each layer's keys and values sliced. The decoder runs layer by
    layer as LlamaModel.forward does (transformers' modeling_llama), each layer with a mask of its own length: all
    its cached slots visible, the fed tokens causal."""
    cache = DynamicCache(config=model.config)
    model(context, cache=cache, use_cache=True)
    if cut is not None:
        keep = torch.ones(context.shape[1], dtype=torch.bool)
        keep[cut[0]:cut[1]] = False
        for i, layer in enumerate(cache.layers):
            if layers is None or i in layers:
                layer.keys, layer.values = layer.keys[:, :, keep], layer.values[:, :, keep]
    n, m = context.shape[1], fed.shape[1]
    positions = torch.arange(n, n + m)[None]
    inner = model.model
    hidden = inner.embed_tokens(fed)
    rotary = inner.rotary_emb(hidden, position_ids=positions)
    causal = torch.ones(m, m, dtype=torch.bool).tril()
    for i, decoder_layer in enumerate(inner.layers):
        held = cache.layers[i].keys.shape[-2]
        mask = torch.cat([torch.ones(m, held, dtype=torch.bool), causal], 1)[None, None]
        hidden = decoder_layer(hidden, attention_mask=mask, position_embeddings=rotary, position_ids=positions,
                               cache=cache, use_cache=True)
    return F.log_softmax(model.lm_head(inner.norm(hidden)).float(), -1)


def expected_row(model, context, question, answer, cut, layers=None):
    fed = torch.cat([question, answer[:, :-1]], 1)
    full, evicted = plain_logprobs(model, context, fed), plain_logprobs(model, context, fed, cut, layers)
    full, evicted = full[:, -answer.shape[1]:], evicted[:, -answer.shape[1]:]
    kl = float((full.exp() * (full - evicted)).sum(-1).mean())
    delta = float(evicted.gather(-1, answer[..., None]).sum() - full.gather(-1, answer[..., None]).sum())
    changed = bool((evicted.argmax(-1) != answer).any())
    return kl, delta, changed


def test_every_block_equals_a_forward_over_a_cache_with_the_block_cut_out(model):
    context, question, answer = ids(N, 0), ids(6, 1), ids(5, 2)
    table = span_effects(model, ByteTokenizer(), context, question[0].tolist(), answer=answer[0].tolist(), block=16,
                         batch_size=4, progress=False)
    assert list(zip(table.start, table.end)) == default_spans(N, 16) == [(s, s + 16) for s in range(0, N, 16)]
    for row in table.itertuples():
        kl, delta, changed = expected_row(model, context, question, answer, (row.start, row.end))
        assert row.kl == pytest.approx(kl, abs=1e-5) and row.logprob_delta == pytest.approx(delta, abs=1e-4)
        assert row.answer_changed == changed
    assert table.kl.gt(0).all()  # a random model's answer depends on every block a little


def test_spans_given_and_layers_chosen_equal_the_plain_cut_of_those_layers(model):
    context, question, answer = ids(N, 3), ids(4, 4), ids(3, 5)
    spans = [(0, 1), (10, 40), (95, 96)]
    table = span_effects(model, ByteTokenizer(), context, question[0].tolist(), answer=answer[0].tolist(),
                         spans=spans, layers=[1], progress=False)
    for row, cut in zip(table.itertuples(), spans, strict=True):
        kl, delta, _ = expected_row(model, context, question, answer, cut, layers={1})
        assert row.kl == pytest.approx(kl, abs=1e-5) and row.logprob_delta == pytest.approx(delta, abs=1e-4)


def test_the_default_answer_is_the_full_caches_greedy_one_and_nothing_evicted_changes_nothing(model):
    context, question = ids(N, 6), ids(5, 7)
    table = span_effects(model, ByteTokenizer(), context, question[0].tolist(), spans=[(0, 0 + 1)], max_new_tokens=4,
                         heads=[], progress=False)  # no KV head chosen: nothing is hidden
    assert table.kl.abs().max() < 1e-6 and not table.answer_changed.any()


def test_query_aware_leaves_the_first_answer_token_alone_and_bad_spans_are_refused(model):
    context, question, answer = ids(N, 8), ids(5, 9), ids(1, 10)
    aware = span_effects(model, ByteTokenizer(), context, question[0].tolist(), answer=answer[0].tolist(),
                         query_aware=True, block=32, progress=False)
    assert (aware.kl == 0).all() and (aware.logprob_delta == 0).all()  # a one-token answer comes from the prefill
    with pytest.raises(ValueError, match="spans are"):
        span_effects(model, ByteTokenizer(), context, "q", spans=[(90, 120)], progress=False)
    with pytest.raises(ValueError, match="spans are"):  # a float span is not cut to whole positions silently
        span_effects(model, ByteTokenizer(), context, "q", spans=[(0.5, 3.7)], progress=False)
    # a layer or KV head the model does not have hides nothing: refused, not a row of zeros
    layers, kv_heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    for subset, match in ((dict(layers=[layers]), "layers are"), (dict(layers=[-1]), "layers are"),
                          (dict(heads=[kv_heads]), "heads are"), (dict(heads=[-1]), "heads are")):
        with pytest.raises(ValueError, match=match):
            span_effects(model, ByteTokenizer(), context, "q", block=32, progress=False, **subset)
    with pytest.raises(ValueError, match="the context, question and answer"):  # past the model's 1024 positions
        span_effects(model, ByteTokenizer(), ids(1020, 8), "q", answer=[5, 6, 7, 8], block=32, progress=False)
    with pytest.raises(ValueError, match="question is empty"):
        span_effects(model, ByteTokenizer(), context, [], block=32, progress=False)
    for bad in (dict(batch_size=0), dict(max_new_tokens=0)):
        with pytest.raises(ValueError, match="positive whole number"):
            span_effects(model, ByteTokenizer(), context, "q", block=32, progress=False, **bad)


def test_every_kv_head_chosen_is_the_whole_layer_and_a_sliding_model_runs():
    """heads=[all KV heads] hides what heads=None hides; on Gemma 3's layout (sliding layers holding their last
    positions) evicting a span the sliding layers no longer hold changes only what the full layers read."""
    from families import FAMILIES

    model = FAMILIES["gemma3-sliding"]()
    context, question, answer = ids(40, 11), ids(3, 12), ids(3, 13)
    run = dict(answer=answer[0].tolist(), spans=[(0, 8), (32, 40)], progress=False)
    every = span_effects(model, ByteTokenizer(), context, question[0].tolist(), **run)
    heads = span_effects(model, ByteTokenizer(), context, question[0].tolist(), heads=list(range(2)), **run)
    assert every[["kl", "logprob_delta"]].to_numpy() == pytest.approx(heads[["kl", "logprob_delta"]].to_numpy())
    full_only = span_effects(model, ByteTokenizer(), context, question[0].tolist(), layers=[1], **run)
    # (0, 8) is out of the sliding layers' window (16 - 1 slots): hiding it there changes nothing
    assert every.kl[0] == pytest.approx(full_only.kl[0], abs=1e-6) and every.kl[1] != pytest.approx(full_only.kl[1])


class KnownAnswer:
    """A hand-built probe whose answer changes exactly when every span of `needed` is evicted together (a fact told
    twice: either copy alone still answers), so the minimal evicting set is known."""

    def __init__(self, needed):
        self.needed, self.forwards, self.seen = set(needed), 0, []

    def effects(self, sets, layers=None, heads=None):
        self.forwards += 1
        self.seen.append(len(sets))
        return [dict(kl=float(len(s)), logprob_delta=-1.0, answer_changed=self.needed <= set(s)) for s in sets]


def test_the_minimal_set_search_finds_the_two_blocks_the_answer_needs_within_its_budget():
    from snapkv_lab.compression.span_search import minimal_evicting_set

    a, b, c, d = (0, 8), (8, 16), (16, 24), (24, 32)
    effects = pd.DataFrame(dict(start=[s for s, _ in (c, a, d, b)], end=[e for _, e in (c, a, d, b)],
                                kl=[0.5, 0.9, 0.7, 0.1]))  # ranked a, d, c, b: b, needed, comes last
    probe = KnownAnswer({a, b})
    found = minimal_evicting_set(probe, effects, budget=10, batch_size=2)
    assert found.changed and sorted(found.spans) == [a, b] and found.forwards == probe.forwards <= 10
    assert max(probe.seen) <= 2  # never more sets per forward than batch_size
    starved = minimal_evicting_set(KnownAnswer({a, b}), effects, budget=1, batch_size=2)
    assert not starved.changed and starved.forwards == 1 and starved.spans == [a, d]


def test_the_pruning_tries_every_member_in_batches_before_calling_a_set_minimal():
    """Ten spans, all needed but the top-ranked one: pruning tries the weakest first, so the one member that can go
    is the last of its round, past the first batch. Each round goes on batch by batch until a member can be dropped
    or every one was tried; a budget that ends a round first leaves the set not `minimal`."""
    from snapkv_lab.compression.span_search import minimal_evicting_set

    spans = [(8 * i, 8 * i + 8) for i in range(10)]
    effects = pd.DataFrame(dict(start=[s for s, _ in spans], end=[e for _, e in spans],
                                kl=[10.0 - i for i in range(10)]))  # ranked in order: spans[0] strongest
    found = minimal_evicting_set(KnownAnswer(set(spans[1:])), effects, budget=16, batch_size=4)
    assert found.changed and sorted(found.spans) == spans[1:] and found.minimal
    starved = minimal_evicting_set(KnownAnswer(set(spans[1:])), effects, budget=4, batch_size=4)
    assert starved.changed and len(starved.spans) == 10 and not starved.minimal


def test_the_search_and_the_localisation_run_on_a_model(model):
    from snapkv_lab.compression.span_effects import EvictionProbe, probe_spans
    from snapkv_lab.compression.span_search import head_effects, layer_effects, minimal_evicting_set

    context, question, answer = ids(N, 14), ids(4, 15), ids(3, 16)
    probe = EvictionProbe.prefilled(model, ByteTokenizer(), context, question[0].tolist(), answer=answer[0].tolist())
    effects = probe_spans(probe, default_spans(N, 32), progress=False)
    everything = probe.effects([[(0, N)]])[0]
    found = minimal_evicting_set(probe, effects, budget=4)
    assert found.changed == everything["answer_changed"] or found.forwards == 4
    layers = layer_effects(probe, [(0, 32)])
    assert list(layers.layer) == [0, 1, 2] and layers.kl.ge(0).all()
    alone = probe.effects([[(0, 32)]], layers=[1])[0]
    assert layers.kl[1] == pytest.approx(alone["kl"])
    heads = head_effects(probe, [(0, 32)], layer=1)
    assert list(heads.kv_head) == [0, 1] and heads.kl.sum() > 0


def test_the_gradient_estimate_is_kvgrads_score_written_out(model):
    """position_attribution against KVgrad's formula computed here from a teacher-forced trace of the same tokens
    (attention and ||W_O^h v|| from capture(values=True)) and the gradient of log p(answer) with respect to each
    layer's attention output, taken by torch.autograd.grad over a plain forward."""
    import snapkv_lab
    from snapkv_lab.compression.span_effects import EvictionProbe
    from snapkv_lab.compression.span_gradients import gradient_effects, position_attribution

    context, question, answer = ids(40, 17), ids(3, 18), ids(3, 19)
    probe = EvictionProbe.prefilled(model, ByteTokenizer(), context, question[0].tolist(), answer=answer[0].tolist())
    scores = position_attribution(probe)

    fed = torch.cat([question, answer[:, :-1]], 1)
    trace = snapkv_lab.capture(model, ByteTokenizer(), context, continuation=fed[0], values=True, progress=False)
    outputs = {}
    hooks = [layer.self_attn.register_forward_hook(lambda m, a, out, i=i: outputs.__setitem__(i, out[0]))
             for i, layer in enumerate(model.model.layers)]
    try:
        logits = model(torch.cat([context, fed], 1)).logits[0, -answer.shape[1]:]
    finally:
        for hook in hooks:
            hook.remove()
    objective = F.log_softmax(logits.float(), -1).gather(-1, answer[0, :, None]).sum()
    grads = torch.autograd.grad(objective, [outputs[i] for i in range(3)])
    n, probes = 40, fed.shape[1]
    expected = torch.zeros(n)
    for i in range(3):
        attention = trace.attention(i, queries=slice(n, n + probes), keys=slice(0, n))  # (heads, probes, n)
        norm = grads[i][0, n:].norm(dim=-1)  # (probes,)
        per_head = (attention * norm[None, :, None]).amax(1) * trace.value_norms[i][:, :n]
        expected += per_head.view(2, 2, n).amax(1).sum(0).detach()
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=1e-3)
    table = gradient_effects(probe, [(0, 20), (20, 40)])
    assert table.attribution.tolist() == pytest.approx([float(expected[:20].sum()), float(expected[20:].sum())],
                                                       rel=1e-3)
