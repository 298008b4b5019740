"""Batches of prompts of different lengths (left-padded inside): every row is scored on its own tokens, compressed
by its own budget and decoded greedily as its batch-1 run: the same tokens, kept positions per layer, cache
lengths and text, for every registered policy, in generate, compare, query-agnostic mode and model.generate under
compress. Pads are never kept, never vote and never count in a budget."""

from __future__ import annotations

import pytest
import torch
from conftest import build_with_tail, make_tiny_llama

import snapkv_lab
from snapkv_lab.core.inputs import encode_batch

LENGTHS, NEW = (150, 97, 160), 6
NAMES = sorted(snapkv_lab.POLICIES)
EOS = (0,)  # the byte tokenizer's


def prompts(seed=0, lengths=LENGTHS):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 256, (n,), generator=generator) for n in lengths]


def build(name, capacity):
    """A tail of 8: a 25% budget of the 97-token row (24) must exceed the kept tail."""
    return build_with_tail(name, 8, capacity=capacity)


@pytest.fixture(scope="module")
def model():
    return make_tiny_llama(initializer_range=0.3, num_hidden_layers=3)


def assert_rows_equal_their_batch_one_runs(batched, singles):
    rows = batched.rows(EOS)
    assert len(rows) == len(singles)
    for row, single in zip(rows, singles, strict=True):
        assert torch.equal(row.token_ids, single.token_ids) and row.text == single.text
        assert row.cache_lengths == single.cache_lengths
        assert torch.equal(row.prompt_ids, single.prompt_ids)
        for a, b in zip(row.kept_indices, single.kept_indices, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("capacity", [0.25, 100])  # 100: the 97-token row fits and keeps all, the others compress
@pytest.mark.parametrize("name", NAMES)
def test_batched_rows_equal_their_batch_one_runs(name, capacity, model, byte_tokenizer):
    policy = build(name, capacity)
    rows = prompts()
    if policy.storage is not None and policy.storage.packs:  # ThinK, KIVI: refused over a padded batch (packed.py)
        with pytest.raises(NotImplementedError, match="padded batch"):
            snapkv_lab.generate(model, byte_tokenizer, [r.tolist() for r in rows], policy=policy, max_new_tokens=NEW)
        return
    batched = snapkv_lab.generate(model, byte_tokenizer, [r.tolist() for r in rows], policy=policy, max_new_tokens=NEW)
    singles = [snapkv_lab.generate(model, byte_tokenizer, r[None], policy=policy, max_new_tokens=NEW) for r in rows]
    assert_rows_equal_their_batch_one_runs(batched, singles)
    for kept in batched.kept_indices:  # no pad slot is ever kept: every kept position lies in its own row
        for b, n in enumerate(LENGTHS):
            assert int(kept[b].max()) < n + NEW


def test_eviction_while_decoding_runs_per_row(model, byte_tokenizer):
    """DecodingEviction evicts every 4 steps: each row's tracker sees its own slots, as in its batch-1 run."""
    policy = snapkv_lab.DecodingEviction(capacity=0.25, kept_tail=8, interval=8,
                                         policy=snapkv_lab.SnapKV(window_size=8))
    rows = prompts(seed=1)
    batched = snapkv_lab.generate(model, byte_tokenizer, [r.tolist() for r in rows], policy=policy, max_new_tokens=20)
    singles = [snapkv_lab.generate(model, byte_tokenizer, r[None], policy=policy, max_new_tokens=20) for r in rows]
    assert_rows_equal_their_batch_one_runs(batched, singles)
    assert any(int(k.max()) >= min(LENGTHS) for k in singles[1].kept_indices)  # generated positions held: it evicted


def test_query_agnostic_batch(model, byte_tokenizer):
    policy = snapkv_lab.SnapKV(capacity=0.25, window_size=8)
    rows, question = prompts(seed=2), [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    batched = snapkv_lab.generate(model, byte_tokenizer, [r.tolist() for r in rows], policy=policy,
                                  max_new_tokens=NEW, question=question)
    singles = [snapkv_lab.generate(model, byte_tokenizer, r[None], policy=policy, max_new_tokens=NEW, question=question)
               for r in rows]
    assert_rows_equal_their_batch_one_runs(batched, singles)


@pytest.mark.parametrize("name", ["SnapKV", "AdaKV", "KVzip", "H2O"])
def test_compare_on_a_batch(name, model, byte_tokenizer):
    """One shared prefill of the padded batch: one table row per prompt, each its batch-1 run."""
    policy = build(name, 0.25)
    rows = prompts(seed=3)
    table = snapkv_lab.compare(model, byte_tokenizer, [[r.tolist() for r in rows]], policies=[policy],
                               max_new_tokens=NEW, progress=False)
    assert list(table.prompt) == ["0/0", "0/1", "0/2"]
    for i, r in enumerate(rows):
        single = snapkv_lab.generate(model, byte_tokenizer, r[None], policy=policy, max_new_tokens=NEW)
        run = table.results[i]
        assert table.answer[i] == single.text and torch.equal(run.token_ids, single.token_ids)
        assert table.prompt_tokens[i] == len(r) and run.cache_lengths == single.cache_lengths
        assert all(torch.equal(a, b) for a, b in zip(run.kept_indices, single.kept_indices, strict=True))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_model_generate_under_compress_takes_a_padded_batch(attn, byte_tokenizer):
    model = make_tiny_llama(attn, initializer_range=0.3, num_hidden_layers=3)
    policy = snapkv_lab.SnapKV(capacity=40, window_size=8)
    rows = prompts(seed=4)
    batch = encode_batch(byte_tokenizer, [r.tolist() for r in rows])
    with snapkv_lab.compress(model, policy) as state:
        out = model.generate(batch.ids, attention_mask=batch.mask, past_key_values=state.cache, max_new_tokens=NEW,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    n = batch.ids.shape[1]
    for b, r in enumerate(rows):
        single = snapkv_lab.generate(model, byte_tokenizer, r[None], policy=policy, max_new_tokens=NEW)
        cut = single.token_ids.shape[1]
        assert torch.equal(out[b:b + 1, n:n + cut], single.token_ids)
        assert torch.equal(state.kept_indices[1][b, :, :40], single.kept_indices[1][0])


def test_sliding_window_layers_keep_their_own_pads_masked(byte_tokenizer):
    """Gemma 3 with sliding layers around a full one: the sliding layers keep their bounded caches (pads masked by
    the model's own padding mask), the full layer is compressed per row."""
    from families import FAMILIES

    model = FAMILIES["gemma3-sliding"]()
    policy = snapkv_lab.SnapKV(capacity=24, window_size=8)
    rows = prompts(seed=5, lengths=(40, 12, 33))  # the 12-token row fits the budget and the sliding window
    batched = snapkv_lab.generate(model, byte_tokenizer, [r.tolist() for r in rows], policy=policy, max_new_tokens=NEW)
    singles = [snapkv_lab.generate(model, byte_tokenizer, r[None], policy=policy, max_new_tokens=NEW) for r in rows]
    assert_rows_equal_their_batch_one_runs(batched, singles)


def test_a_tensor_padded_with_the_pad_token_is_a_padded_batch(model, byte_tokenizer):
    class PaddingTokenizer(type(byte_tokenizer)):
        pad_token_id = 1

    rows = prompts(seed=6, lengths=(60, 50))
    ids = torch.stack([rows[0], torch.cat([torch.ones(10, dtype=torch.long), rows[1]])])
    policy = snapkv_lab.SnapKV(capacity=40, window_size=8)
    batched = snapkv_lab.generate(model, PaddingTokenizer(), ids, policy=policy, max_new_tokens=NEW)
    singles = [snapkv_lab.generate(model, PaddingTokenizer(), r[None], policy=policy, max_new_tokens=NEW) for r in rows]
    assert_rows_equal_their_batch_one_runs(batched, singles)
    right = ids.flip(1)  # pads last
    with pytest.raises(NotImplementedError, match="only left padding"):
        snapkv_lab.generate(model, PaddingTokenizer(), right, policy=policy, max_new_tokens=NEW)


def test_chunked_prefill_of_a_padded_batch_is_refused(model, byte_tokenizer):
    rows = [r.tolist() for r in prompts(seed=7)]
    with pytest.raises(NotImplementedError, match="chunked prefill of a padded batch"):
        snapkv_lab.generate(model, byte_tokenizer, rows, policy=snapkv_lab.SnapKV(capacity=40, window_size=8),
                            prefill_chunk=48)
    batch = encode_batch(byte_tokenizer, rows)
    with pytest.raises(NotImplementedError, match="chunked prefill of a padded batch"):
        with snapkv_lab.compress(model, snapkv_lab.SnapKV(capacity=40, window_size=8), prefill_chunk=48) as state:
            model.generate(batch.ids, attention_mask=batch.mask, past_key_values=state.cache, max_new_tokens=2,
                           do_sample=False, prefill_chunk_size=48)


def ask_one_by_one(monkeypatch):
    """Answer several questions the old way, one fork after the other, to compare the batched answers with."""
    from snapkv_lab.compression import generation

    monkeypatch.setattr(generation, "answers_batched", lambda state, extras: False)


@pytest.mark.parametrize("capacity", [0.25, 400])  # 400: the prompt fits, its layers stay uncompressed
@pytest.mark.parametrize("name", NAMES)
def test_several_questions_decode_as_one_batch(name, capacity, model, byte_tokenizer, monkeypatch):
    """Compress once, ask many: the questions (of different lengths) decode together as one left-filled batch (dense
    and head-wise layers), each answer and kept positions equal to asking it on its own fork, for every policy."""
    from snapkv_lab.compression import generation

    policy = build(name, capacity)
    context = prompts(seed=7, lengths=(150,))[0][None]
    questions = [q.tolist() for q in prompts(seed=8, lengths=(5, 11, 3))]
    calls = []
    monkeypatch.setattr(generation, "batched_answers",
                        lambda *args, real=generation.batched_answers: calls.append(1) or real(*args))
    many = snapkv_lab.generate(model, byte_tokenizer, context, policy=policy, question=questions, max_new_tokens=NEW)
    ask_one_by_one(monkeypatch)
    alone = snapkv_lab.generate(model, byte_tokenizer, context, policy=policy, question=questions, max_new_tokens=NEW)
    for together, single in zip(many, alone, strict=True):
        assert torch.equal(together.token_ids, single.token_ids) and together.text == single.text
        assert together.cache_lengths == single.cache_lengths
        assert all(torch.equal(a, b) for a, b in zip(together.kept_indices, single.kept_indices, strict=True))
    assert len({tuple(run.token_ids[0].tolist()) for run in many}) > 1  # the questions were really asked
    one_by_one = getattr(policy, "tracker", None) is not None or (policy.storage is not None and policy.storage.packs)
    assert bool(calls) == (not one_by_one)  # eviction while decoding, pruned or quantized storage: one by one


def test_several_questions_batch_over_sliding_layers(byte_tokenizer, monkeypatch):
    """Gemma 3's sliding layers hold each row's own last tokens: batched answers equal one-by-one answers, with the
    context longer than the sliding window and shorter than it."""
    from families import FAMILIES

    model = FAMILIES["gemma3-sliding"]()
    policy = snapkv_lab.SnapKV(capacity=24, window_size=8)
    questions = [q.tolist() for q in prompts(seed=9, lengths=(4, 9))]
    for n in (40, 10):
        context = prompts(seed=10, lengths=(n,))[0][None]
        many = snapkv_lab.generate(model, byte_tokenizer, context, policy=policy, question=questions,
                                   max_new_tokens=NEW)
        with monkeypatch.context() as patch:
            ask_one_by_one(patch)
            alone = snapkv_lab.generate(model, byte_tokenizer, context, policy=policy, question=questions,
                                        max_new_tokens=NEW)
        for together, single in zip(many, alone, strict=True):
            assert torch.equal(together.token_ids, single.token_ids)
