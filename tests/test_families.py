"""The family matrix: capture and SnapKV compression on a tiny random model of every family in
tests/families.py, each checked against an oracle (eager output_attentions, plain greedy generate, the
model's own cache, a plain SnapKV reference)."""

from __future__ import annotations

import pytest
import torch
from conftest import eager_twin
from families import FAMILIES, make, sliding_layers
from reference import assert_same_selection, eager_maps, kv_heads, reference_kept
from transformers import DynamicCache, GPT2Config

import snapkv_lab

N, WINDOW, CAPACITY, NEW = 64, 8, 40, 12  # prompt tokens exceed the sliding window (16) and the capacity
CAPTURE_ATOL, EXACT_ATOL = 3e-5, 1e-6  # see the two capture tests


def prompt(batch: int = 1, seed: int = 1) -> torch.Tensor:
    return torch.randint(2, 256, (batch, N), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def model(request):
    """One model per family for the whole module (parametrised module fixtures run family by family)."""
    return FAMILIES[request.param]()


def snapkv():
    return snapkv_lab.SnapKV(capacity=CAPACITY, window_size=WINDOW)


def full_layers(model) -> list[int]:
    return [i for i in range(model.config.num_hidden_layers) if i not in sliding_layers(model.config)]


def assert_trace_matches_eager(trace, model, atol):
    assert (trace.n_tokens, trace.n_layers) == (N + 6, model.config.num_hidden_layers)
    for layer, reference in enumerate(eager_maps(model, trace.token_ids)):
        torch.testing.assert_close(trace.attention(layer), reference, atol=atol, rtol=0,
                                   msg=lambda m: f"layer {layer}: {m}")


def test_capture_matches_eager_output_attentions(model, byte_tokenizer):
    """Greedy capture under the model's own backend (sdpa; Gemma 2 has only eager) against eager maps over the
    same tokens. Not bit-exact: sdpa, and decode steps (one row at a time), round differently from one eager
    forward, about 1e-6 relative per layer, which the peaked attention of these random weights amplifies to at
    most 1.2e-5 in layer 2 (measured over 6 prompts, sdpa or eager). CAPTURE_ATOL = 3e-5 leaves 2.5x margin;
    a wrong scaling, mask or cap errs by 1e-2 and more. The next test is the exact one."""
    trace = snapkv_lab.capture(model, byte_tokenizer, prompt()[0], max_new_tokens=6, stop_at_eos=False, progress=False)
    assert_trace_matches_eager(trace, model, CAPTURE_ATOL)


def test_teacher_forced_eager_capture_is_exact(model, byte_tokenizer):
    """The same token ids in one eager forward: the recomputed maps equal eager's (0.0 measured everywhere)."""
    ids = prompt()[0]
    continuation = torch.randint(2, 256, (6,), generator=torch.Generator().manual_seed(9))
    trace = snapkv_lab.capture(eager_twin(model), byte_tokenizer, ids, continuation=continuation, progress=False)
    assert_trace_matches_eager(trace, model, EXACT_ATOL)


def test_budget_covering_the_prompt_is_plain_greedy(model, byte_tokenizer):
    ids = prompt(seed=2)
    result = snapkv_lab.generate(model, byte_tokenizer, ids, policy=snapkv_lab.SnapKV(capacity=N, window_size=WINDOW),
                                 max_new_tokens=NEW)
    plain = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                           eos_token_id=None)
    assert torch.equal(result.token_ids, plain[:, N:])


def test_cache_lengths_after_prefill(model, byte_tokenizer):
    """Full-attention layers hold `capacity` positions; sliding layers what the model's own bounded cache
    (DynamicCache(config=...)) holds after the same prefill, and kept_indices names those last positions."""
    ids = prompt(seed=3)
    own = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, past_key_values=own, use_cache=True)
    own_lengths = [layer.keys.shape[-2] for layer in own.layers]
    sliding = sliding_layers(model.config)
    assert {i for i, length in enumerate(own_lengths) if length < N} == sliding  # the helper agrees with transformers

    result = snapkv_lab.generate(model, byte_tokenizer, ids, policy=snapkv(), max_new_tokens=2)
    expected = [own_lengths[i] if i in sliding else CAPACITY for i in range(model.config.num_hidden_layers)]
    assert result.cache_lengths == expected
    for layer in sliding:
        last = torch.arange(N - own_lengths[layer], N).expand(1, kv_heads(model.config), -1)
        assert torch.equal(result.kept_indices[layer], last)


def test_kept_positions_match_eager_reference(model, byte_tokenizer):
    ids = prompt(batch=2, seed=4)
    result = snapkv_lab.generate(model, byte_tokenizer, ids, policy=snapkv(), max_new_tokens=2)
    ref_kept, ref_scores = reference_kept(model, ids, WINDOW, CAPACITY, pooling="max", kernel=7)
    full = full_layers(model)
    assert_same_selection([result.kept_indices[i] for i in full], [ref_kept[i] for i in full],
                          [ref_scores[i] for i in full], WINDOW, layers=full)


def test_model_generate_matches_own_loop(model, byte_tokenizer):
    ids = prompt(batch=2, seed=5)
    ours = snapkv_lab.generate(model, byte_tokenizer, ids, policy=snapkv(), max_new_tokens=NEW)
    with snapkv_lab.compress(model, snapkv()) as state:
        theirs = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=state.cache,
                                max_new_tokens=NEW, do_sample=False, eos_token_id=None)
    assert torch.equal(theirs[:, N:], ours.token_ids)
    assert sorted(state.kept_indices) == list(range(model.config.num_hidden_layers))  # every layer went through it
    assert all(torch.equal(state.kept_indices[i], kept) for i, kept in enumerate(ours.kept_indices))


def test_attention_outside_the_registry_is_refused(byte_tokenizer):
    """GPT-2 under eager with reorder_and_upcast_attn computes attention in a method of its own, not through
    transformers' attention-function registry: nothing can be captured or compressed, and both must say so
    instead of returning an empty trace or a full cache."""
    model = make(GPT2Config, attn="eager", reorder_and_upcast_attn=True)
    with pytest.raises(RuntimeError, match="attention-function registry"):
        snapkv_lab.capture(model, byte_tokenizer, prompt()[0], max_new_tokens=1, progress=False)
    refused = "without calling an attention function from transformers' registry"
    with pytest.raises(RuntimeError, match=refused):
        snapkv_lab.generate(model, byte_tokenizer, prompt(), policy=snapkv(), max_new_tokens=1)
    # The one-prefill engines (compare, the pressure runner, a scorer that scores after the prefill) refuse it too,
    # instead of the full cache labelled SnapKV@40 (cache_length 64 of 64, kv_ratio 1.0).
    with pytest.raises(RuntimeError, match=refused):
        snapkv_lab.compare(model, byte_tokenizer, [prompt()], policies=[snapkv()], max_new_tokens=1, progress=False)
    for extra_pass in (snapkv_lab.KVzip(capacity=40), snapkv_lab.Surprisal(capacity=40, kept_tail=8)):
        with pytest.raises(RuntimeError, match=refused):
            snapkv_lab.generate(model, byte_tokenizer, prompt(), policy=extra_pass, max_new_tokens=1)
    from snapkv_lab.pressure import Context, Query, run_retrieval

    ids = prompt()[0].tolist()
    context = Context(ids[:-8], [Query(ids[-8:], "x", (0, 4), (0, 4), {})], {"task": "test"})
    with pytest.raises(RuntimeError, match=refused):
        run_retrieval(model, byte_tokenizer, [context], policies=[snapkv()], capacities=(40,), progress=False)
