"""The compressor: kept indices vs a plain eager reference, cache lengths, identity below capacity,
positions after compression, model.generate vs our own loop, batches and clear errors."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_tiny_llama
from reference import assert_same_selection, reference_kept

import snapkv_lab as sl
from snapkv_lab.core.inputs import left_pads as refuse_padding  # the compressor refuses what left_pads refuses

WINDOW, CAPACITY = 8, 40


def tiny(attn="sdpa"):
    # A larger init than the default 0.02 gives peaked attention, so votes are not near-uniform ties.
    return make_tiny_llama(attn, initializer_range=0.3)


@pytest.mark.parametrize("pooling,kernel,per_query_head,gqa", [("max", 7, False, "mean"), (None, 1, False, "mean"),
                                                              ("max", 5, True, "mean"), ("max", 7, False, "max"),
                                                              ("avg", 15, False, "mean")])
def test_kept_indices_match_eager_reference(pooling, kernel, per_query_head, gqa, byte_tokenizer):
    model = tiny()
    ids = torch.randint(2, 256, (2, 96), generator=torch.Generator().manual_seed(1))
    policy = sl.SnapKV(capacity=CAPACITY, window_size=WINDOW, pooling=pooling, kernel_size=kernel,
                      per_query_head=per_query_head, gqa=gqa)
    result = sl.generate(model, byte_tokenizer, ids, policy=policy, max_new_tokens=2)
    ref_kept, ref_scores = reference_kept(model, ids, WINDOW, CAPACITY, pooling=pooling, kernel=kernel,
                                          per_query_head=per_query_head, gqa=gqa)
    assert_same_selection(result.kept_indices, ref_kept, ref_scores, WINDOW)


def test_fact_kernel_policy_is_snapkv_pooled_over_a_fact(byte_tokenizer):
    """The registered small-budget policy keeps what the eager reference keeps with a 31-token max-pool kernel."""
    model = tiny()
    ids = torch.randint(2, 256, (1, 96), generator=torch.Generator().manual_seed(2))
    result = sl.generate(model, byte_tokenizer, ids, policy=sl.SnapKVFactKernel(capacity=CAPACITY, window_size=WINDOW),
                         max_new_tokens=2)
    ref_kept, ref_scores = reference_kept(model, ids, WINDOW, CAPACITY, pooling="max", kernel=31)
    assert_same_selection(result.kept_indices, ref_kept, ref_scores, WINDOW)
    narrow, _ = reference_kept(model, ids, WINDOW, CAPACITY, pooling="max", kernel=7)
    assert any(not torch.equal(a, b) for a, b in zip(ref_kept, narrow))  # the kernel changes what is kept here


@pytest.mark.slow
def test_kept_indices_match_eager_reference_smollm(smollm):
    from snapkv_lab.tasks.corpus import haystack_ids

    model, tokenizer = smollm
    ids = torch.tensor([haystack_ids(tokenizer, 600, start=3)])
    policy = sl.SnapKV(capacity=256, window_size=32)
    result = sl.generate(model, tokenizer, ids, policy=policy, max_new_tokens=1)
    ref_kept, ref_scores = reference_kept(model, ids, 32, 256, pooling="max", kernel=7)
    assert_same_selection(result.kept_indices, ref_kept, ref_scores, 32)
    assert result.cache_lengths == [256] * model.config.num_hidden_layers


@pytest.mark.parametrize("policy", [sl.SnapKV(capacity=CAPACITY, window_size=WINDOW),
                                    sl.SnapKVNoPooling(capacity=CAPACITY, window_size=WINDOW),
                                    sl.H2O(capacity=CAPACITY, kept_tail=WINDOW, interval=None),
                                    sl.StreamingLLM(capacity=CAPACITY, kept_tail=WINDOW),
                                    sl.RandomKeep(capacity=CAPACITY, kept_tail=WINDOW),
                                    sl.SnapKV(capacity=0.5, window_size=WINDOW)],
                         ids=lambda p: p.label)
def test_cache_length_after_prefill_equals_capacity(policy, byte_tokenizer):
    model = tiny()
    ids = torch.randint(2, 256, (1, 90), generator=torch.Generator().manual_seed(2))
    result = sl.generate(model, byte_tokenizer, ids, policy=policy, max_new_tokens=3)
    budget = policy.budget(90)
    assert result.cache_lengths == [budget] * model.config.num_hidden_layers
    for kept in result.kept_indices:
        assert kept.shape == (1, model.config.num_key_value_heads, budget)
        assert torch.equal(kept, kept.sort(dim=-1).values)
        assert all(row.unique().numel() == budget for row in kept.reshape(-1, budget))  # no position kept twice
        assert int(kept.max()) < 90
        assert torch.equal(kept[0, 0, -WINDOW:], torch.arange(90 - WINDOW, 90))
    assert result.kv_bytes == 2 * 2 * model.config.num_key_value_heads * budget * 16 * 4  # 2 layers x (K, V) fp32


def test_a_result_prints_in_one_line(byte_tokenizer):
    ids = torch.randint(2, 256, (1, 90), generator=torch.Generator().manual_seed(2))
    policy = sl.SnapKV(capacity=40, window_size=WINDOW)
    line = repr(sl.generate(tiny(), byte_tokenizer, ids, policy=policy, max_new_tokens=3))
    assert "\n" not in line and "tensor" not in line and len(line) < 300, line
    assert line.startswith(f"GenerationResult({policy.label}: a 90-token prompt, 40 cache positions per layer"), line
    assert "3 new tokens" in line


def test_text_is_text_and_a_chat_models_tokenizer_is_told_once(byte_tokenizer, monkeypatch):
    """A str prompt is tokenised as is (the documented default), never silently wrapped in a chat template; a
    tokenizer that has a template gets one notice saying how to ask for a chat turn."""
    import warnings

    from snapkv_lab.core import inputs

    monkeypatch.setattr(inputs, "_RAW_TEXT_NOTICED", set())
    model = make_tiny_llama()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no template: nothing to say
        plain = sl.generate(model, byte_tokenizer, "hi", max_new_tokens=2)
    assert plain.prompt_ids.tolist() == [list(b"hi")]
    monkeypatch.setattr(byte_tokenizer, "chat_template", "{{ messages }}", raising=False)
    with pytest.warns(UserWarning, match="without .*chat template.*'role': 'user'.*once"):
        chat = sl.generate(model, byte_tokenizer, "hi", max_new_tokens=2)
    assert chat.prompt_ids.tolist() == plain.prompt_ids.tolist()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        sl.generate(model, byte_tokenizer, "hi", max_new_tokens=2)


@pytest.mark.parametrize("capacity", [64, 100])
def test_capacity_at_or_above_prompt_is_identical_to_uncompressed(capacity, byte_tokenizer):
    model = tiny()
    ids = torch.randint(2, 256, (1, 64), generator=torch.Generator().manual_seed(3))
    result = sl.generate(model, byte_tokenizer, ids, policy=sl.SnapKV(capacity=capacity, window_size=WINDOW),
                         max_new_tokens=20)
    plain = model.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None)[:, 64:]
    assert torch.equal(result.token_ids, plain)
    assert result.cache_lengths == [64, 64]
    assert torch.equal(result.kept_indices[0], torch.arange(64).expand(1, 2, -1))


def test_compression_changes_generation(byte_tokenizer):
    """The other tests would pass vacuously if compression had no effect."""
    model = tiny()
    ids = torch.randint(2, 256, (1, 120), generator=torch.Generator().manual_seed(4))
    full = sl.generate(model, byte_tokenizer, ids, max_new_tokens=20)
    small = sl.generate(model, byte_tokenizer, ids, policy=sl.StreamingLLM(capacity=16, kept_tail=4), max_new_tokens=20)
    assert torch.equal(full.token_ids[:, 0], small.token_ids[:, 0])  # the first token comes from the full prefill
    assert not torch.equal(full.token_ids, small.token_ids)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_positions_after_compression_match_masked_full_cache(attn, byte_tokenizer):
    """StreamingLLM keeps the same positions in every head, so decoding on its compressed cache must equal
    decoding on the full cache with the dropped positions masked out: same RoPE positions, same softmax."""
    model = tiny(attn)
    n, policy = 100, sl.StreamingLLM(capacity=30, kept_tail=WINDOW, sinks=4)
    ids = torch.randint(2, 256, (1, n), generator=torch.Generator().manual_seed(5))
    result = sl.generate(model, byte_tokenizer, ids, policy=policy, max_new_tokens=12)
    visible = torch.zeros(n, dtype=torch.long)
    visible[result.kept_indices[0][0, 0]] = 1
    with torch.no_grad():
        out = model(ids, use_cache=True)
        cache, token, tokens = out.past_key_values, out.logits[:, -1].argmax(-1), []
        for step in range(12):
            tokens.append(token)
            mask = torch.cat([visible, torch.ones(step + 1, dtype=torch.long)])[None]
            out = model(token[:, None], past_key_values=cache, attention_mask=mask,
                        position_ids=torch.tensor([[n + step]]))
            token = out.logits[:, -1].argmax(-1)
    assert torch.equal(result.token_ids, torch.stack(tokens, 1))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("per_query_head", [False, True])
def test_model_generate_matches_own_loop(attn, per_query_head, byte_tokenizer):
    model = tiny(attn)
    ids = torch.randint(2, 256, (2, 80), generator=torch.Generator().manual_seed(6))
    policy = sl.SnapKV(capacity=CAPACITY, window_size=WINDOW, per_query_head=per_query_head)
    ours = sl.generate(model, byte_tokenizer, ids, policy=policy, max_new_tokens=16)
    with sl.compress(model, policy) as state:
        theirs = model.generate(ids, past_key_values=state.cache, max_new_tokens=16, do_sample=False, eos_token_id=None)
    assert torch.equal(theirs[:, 80:], ours.token_ids)
    assert all(torch.equal(state.kept_indices[i], ours.kept_indices[i]) for i in range(2))
    assert model.model.layers[0].self_attn.num_key_value_groups == 2  # restored after the per-query-head layout


def test_per_query_head_layout_costs_group_times_the_memory(byte_tokenizer):
    model = tiny()
    ids = torch.randint(2, 256, (1, 80), generator=torch.Generator().manual_seed(7))
    per_kv = sl.generate(model, byte_tokenizer, ids, policy=sl.SnapKV(capacity=CAPACITY, window_size=WINDOW),
                         max_new_tokens=4)
    per_q = sl.generate(model, byte_tokenizer, ids,
                        policy=sl.SnapKV(capacity=CAPACITY, window_size=WINDOW, per_query_head=True), max_new_tokens=4)
    assert per_q.kept_indices[0].shape == (1, 4, CAPACITY)
    assert per_q.kv_bytes == 2 * per_kv.kv_bytes  # 4 query heads share 2 KV heads


def test_equal_length_batch_matches_single_prompts(byte_tokenizer):
    model = tiny()
    prompts = ["the cat sat on the mat and looked at the dog " * 2, "a quick brown fox jumps over lazy dogs again " * 2]
    assert len(prompts[0]) == len(prompts[1])
    policy = sl.SnapKV(capacity=CAPACITY, window_size=WINDOW)
    batch = sl.generate(model, byte_tokenizer, prompts, policy=policy, max_new_tokens=10)
    for b, prompt in enumerate(prompts):
        single = sl.generate(model, byte_tokenizer, prompt, policy=policy, max_new_tokens=10)
        assert torch.equal(batch.token_ids[b], single.token_ids[0])
        assert torch.equal(batch.kept_indices[1][b], single.kept_indices[1][0])
    assert isinstance(batch.text, list) and isinstance(single.text, str)


def test_query_agnostic_mode(byte_tokenizer):
    model = tiny()
    context = torch.randint(2, 256, (1, 90), generator=torch.Generator().manual_seed(8))
    question = torch.randint(2, 256, (12,), generator=torch.Generator().manual_seed(9))
    agnostic = sl.generate(model, byte_tokenizer, context, question=question,
                          policy=sl.SnapKV(capacity=CAPACITY, window_size=WINDOW), max_new_tokens=8)
    assert agnostic.cache_lengths == [CAPACITY] * 2  # the question is appended after the snapshot
    assert int(agnostic.kept_indices[0].max()) == 89
    # Capacity above the context: the chunked prefill equals the one-piece prompt.
    untouched = sl.generate(model, byte_tokenizer, context, question=question, policy=sl.SnapKV(capacity=200),
                            max_new_tokens=8)
    whole = sl.generate(model, byte_tokenizer, torch.cat([context[0], question])[None], max_new_tokens=8)
    assert torch.equal(untouched.token_ids, whole.token_ids)


@pytest.mark.parametrize("kwargs,message", [
    (dict(window_size=64, capacity=32), "window_size \\(64\\) must be smaller than capacity \\(32\\)"),
    (dict(window_size=32, capacity=32), "must be smaller than capacity"),
    (dict(kernel_size=6), "kernel_size must be a positive odd int"),
    (dict(kernel_size=0), "kernel_size must be a positive odd int"),
    (dict(capacity=1.5), "ratio must lie in"),
    (dict(capacity=-3), "capacity must be a positive int"),
    (dict(window_size=0), "window_size must be at least 1"),
    (dict(window_size=-1), "window_size must be at least 1"),
    (dict(kept_tail=-1), "kept_tail must be a non-negative int"),
    (dict(kept_tail=40, capacity=40), "kept tail \\(40 tokens\\) must be smaller than capacity \\(40\\)"),
    (dict(pooling="median"), "pooling must be one of"),
    (dict(gqa="sum"), "gqa must be one of"),
])
def test_bad_parameters_get_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        sl.SnapKV(**kwargs)


def test_ratio_too_small_for_the_kept_tail_is_refused(byte_tokenizer):
    with pytest.raises(ValueError, match="no more than the kept tail \\(32\\)"):
        sl.generate(tiny(), byte_tokenizer, torch.randint(2, 256, (1, 100)),
                    policy=sl.SnapKV(capacity=0.2, window_size=32))


def test_padding_other_than_on_the_left_is_refused(byte_tokenizer):
    """Left-padded batches are taken (tests/test_batches.py); pads anywhere else would sit between a row's tokens."""
    model = tiny()
    ids = torch.randint(2, 256, (2, 60))
    mask = torch.ones_like(ids)
    mask[1, -10:] = 0  # right padding
    with pytest.raises(NotImplementedError, match="only left padding"):
        with sl.compress(model, sl.SnapKV(capacity=CAPACITY, window_size=WINDOW)) as state:
            model.generate(ids, attention_mask=mask, past_key_values=state.cache, max_new_tokens=2, do_sample=False)


def test_padded_id_tensors_are_padded_batches(byte_tokenizer):
    """A (batch, n) tensor holding the tokenizer's pad token is a padded batch, by the rule model.generate infers a
    padding mask with (a pad token that is not the EOS token): left padding is taken, pads elsewhere refused."""
    model = tiny()

    class PaddingTokenizer(type(byte_tokenizer)):
        pad_token_id = 1

    ids = torch.randint(2, 256, (2, 60), generator=torch.Generator().manual_seed(11))
    padded = ids.clone()
    padded[1, -10:] = 1  # right padding
    policy = sl.SnapKV(capacity=CAPACITY, window_size=WINDOW)
    for run in (lambda t: sl.generate(model, PaddingTokenizer(), t, policy=policy, max_new_tokens=2),
                lambda t: sl.compare(model, PaddingTokenizer(), [t], policies=[policy], max_new_tokens=2,
                                     progress=False)):
        with pytest.raises(NotImplementedError, match="only left padding"):
            run(padded)
    assert sl.generate(model, PaddingTokenizer(), ids, policy=policy, max_new_tokens=2).token_ids.shape == (2, 2)


def test_decode_speed_is_nan_when_nothing_was_decoded(byte_tokenizer):
    """One definition of decode_ms_per_token: the mean decode step; an answer of one token has none (NaN, not 0)."""
    from snapkv_lab.pressure import Context, Query, run_retrieval

    model = tiny()
    ids = torch.randint(2, 256, (1, 70), generator=torch.Generator().manual_seed(12))
    one = sl.generate(model, byte_tokenizer, ids, max_new_tokens=1)
    assert math.isnan(one.decode_ms_per_token)
    table = sl.compare(model, byte_tokenizer, [ids], policies=[sl.FullCache()], max_new_tokens=1, progress=False)
    assert table.decode_ms_per_token.isna().all() and "no decode step" in table._repr_html_()
    context = Context(ids[0, :60].tolist(), [Query(ids[0, 60:].tolist(), "x", (0, 4), (0, 4), {})], {"task": "test"})
    rows = run_retrieval(model, byte_tokenizer, [context], policies=[policy_snap()], capacities=(40,), max_new_tokens=1,
                         progress=False)
    assert rows.decode_ms_per_token.isna().all()
    assert sl.generate(model, byte_tokenizer, ids, max_new_tokens=3).decode_ms_per_token > 0


def policy_snap():
    return sl.SnapKV(capacity=CAPACITY, window_size=WINDOW)


def test_model_called_without_the_compressor_cache_is_refused():
    model = tiny()
    with pytest.raises(RuntimeError, match="past_key_values=state.cache"):
        with sl.compress(model, sl.SnapKV(capacity=CAPACITY, window_size=WINDOW)):
            model(torch.randint(2, 256, (1, 60)))


def test_a_prefill_that_bypasses_the_registry_is_refused(byte_tokenizer):
    """A model whose attention never reaches the hook must not pass for a compressed run. Here the cache is
    filled by a twin that the compressor does not intercept, as a model with its own attention code would."""
    model, twin = tiny(), tiny()
    ids = torch.randint(2, 256, (1, 60), generator=torch.Generator().manual_seed(10))
    with pytest.raises(RuntimeError, match="without calling an attention function from transformers' registry"):
        with sl.compress(model, sl.SnapKV(capacity=CAPACITY, window_size=WINDOW)) as state:
            twin(ids, past_key_values=state.cache, use_cache=True)


def test_zero_new_tokens_and_overlong_runs_are_refused(byte_tokenizer):
    model = tiny()
    with pytest.raises(ValueError, match="max_new_tokens must be a positive int"):
        sl.generate(model, byte_tokenizer, torch.randint(2, 256, (1, 60)), max_new_tokens=0)
    with pytest.raises(ValueError, match="needs 1030 positions, but .* handles at most 1024"):
        sl.generate(model, byte_tokenizer, torch.randint(2, 256, (1, 1000)), max_new_tokens=30)


def test_prompt_lookup_decoding_is_refused_on_a_compressed_cache(byte_tokenizer):
    """Draft tokens are placed by the cache length, which compression shortened: refused, not wrong."""
    model = tiny()
    ids = torch.tensor([list(range(10, 40)) * 3])  # repeats, so prompt lookup finds drafts
    with pytest.raises(NotImplementedError, match="assisted and prompt-lookup decoding are not supported"):
        with sl.compress(model, sl.SnapKV(capacity=CAPACITY, window_size=WINDOW)) as state:
            model.generate(ids, past_key_values=state.cache, max_new_tokens=8, do_sample=False,
                           prompt_lookup_num_tokens=3)


def test_flash_style_two_dimensional_padding_masks_give_the_pads():
    """flash_attention_2 receives the (batch, n) padding mask itself, not a 4-D one."""
    from snapkv_lab.core.inputs import left_pads

    assert left_pads(torch.ones(2, 7, dtype=torch.long)) is None
    assert left_pads(torch.tensor([[1] * 7, [0, 0] + [1] * 5])).tolist() == [0, 2]
    with pytest.raises(NotImplementedError, match="only left padding"):
        refuse_padding(torch.tensor([[1] * 7, [1] * 5 + [0, 0]]))


def test_sliding_window_mask_is_not_taken_for_padding(byte_tokenizer):
    """A prompt longer than a sliding window hides old keys from late rows: that is not padding."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=16, initializer_range=0.3)
    for attn in ("eager", "sdpa"):
        config._attn_implementation = attn
        model = MistralForCausalLM(config).eval()
        ids = torch.randint(2, 256, (1, 60), generator=torch.Generator().manual_seed(11))
        with pytest.warns(UserWarning, match="every layer of this model uses sliding-window attention"):
            result = sl.generate(model, byte_tokenizer, ids, policy=sl.SnapKV(capacity=CAPACITY, window_size=WINDOW),
                                max_new_tokens=4)
        # Every layer is a sliding layer: each keeps its own last sliding_window - 1 positions.
        assert result.cache_lengths == [15, 15]
        assert torch.equal(result.kept_indices[0][0, 0], torch.arange(45, 60))
        plain = model.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=None)[:, 60:]
        assert torch.equal(result.token_ids, plain)
        # compare and the extra-pass path warn alike (one shared prefill, no compress() around it)
        with pytest.warns(UserWarning, match="every layer of this model uses sliding-window attention"):
            sl.compare(model, byte_tokenizer, [ids], policies=[sl.SnapKV(capacity=CAPACITY, window_size=WINDOW)],
                       max_new_tokens=2, progress=False)
        with pytest.warns(UserWarning, match="every layer of this model uses sliding-window attention"):
            sl.generate(model, byte_tokenizer, ids, policy=sl.Surprisal(capacity=CAPACITY, kept_tail=WINDOW),
                        max_new_tokens=2)


def test_a_prompt_within_the_budget_is_not_compressed_though_sliding_layers_hold_less(byte_tokenizer):
    """`CompressionState.compressed`, which an answer's row records (AnswerRun.compressed: its fact_kept is 1 when
    false) and the needle budget audit rebuilds: false for a prompt within the policy's budget and for the full cache,
    though a sliding layer holds only its window (64 tokens over a window of 16); true over the budget."""
    from families import FAMILIES

    from snapkv_lab.compression.shared import SharedPrefill

    model = FAMILIES["gemma3-sliding"]()
    ids = torch.randint(2, 256, (1, 64), generator=torch.Generator().manual_seed(0))
    within, over = sl.SnapKV(capacity=80, window_size=8), sl.SnapKV(capacity=24, window_size=8)
    shared = SharedPrefill.run(model, byte_tokenizer, ids, [within, over])
    states = {policy.capacity: shared.state(policy) for policy in (within, over)}
    full = shared.state(sl.FullCache())
    assert min(int(kept.shape[-1]) for kept in full.kept_indices.values()) < 64  # a sliding layer's window
    assert not states[80].compressed(64) and not full.compressed(64)
    assert states[24].compressed(64)
