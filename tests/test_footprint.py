"""The KV footprint over a generation (compression.footprint) against traces of cache sizes written down by hand."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_llama

import snapkv_lab as C
from snapkv_lab.compression import answer, generate, prefill
from snapkv_lab.compression.footprint import Footprint

PROMPT = list(range(2, 22))  # 20 token ids
LAYERS_X_KV_HEADS = 2 * 2  # the tiny llama: 2 layers, 2 KV heads
NEW = 10


def traced(policy, byte_tokenizer):
    """10 new tokens (none an end token) after the 20-token prompt under `policy`: the result's footprint."""
    model = make_tiny_llama()
    ids = torch.tensor([PROMPT])
    state, logits, seconds = prefill(model, byte_tokenizer, ids, policy)
    result, = answer(model, byte_tokenizer, state, logits, ids, [None], [None], prefill_seconds=seconds,
                     max_new_tokens=NEW, min_new_tokens=NEW)
    assert result.token_ids.shape[1] == NEW
    return result.footprint


def test_decoding_eviction_sawtooth_by_hand(byte_tokenizer):
    # StreamingLLM keeps 8 of the 20 prompt positions per KV head; every 4 decode steps each layer is cut back to 8.
    # Held per KV head as token t is predicted: t=0 after the prefill 8; steps 1-3 append (9, 10, 11); step 4 appends
    # the 12th and evicts back to 8; and so on.
    per_head = [8, 9, 10, 11, 8, 9, 10, 11, 8, 9]
    footprint = traced(C.DecodingEviction(policy=C.StreamingLLM(kept_tail=2), capacity=8, interval=4), byte_tokenizer)
    assert footprint.held == [[LAYERS_X_KV_HEADS * h for h in per_head]]
    assert footprint.integral == LAYERS_X_KV_HEADS * 93 and footprint.peak == LAYERS_X_KV_HEADS * 11
    # fp32 keys and values, head_dim 16: 2 x 16 x 4 bytes per entry
    assert footprint.bytes_integral == 128 * footprint.integral and footprint.bytes_peak == 128 * footprint.peak


def test_full_cache_grows_by_one_entry_per_head_and_step(byte_tokenizer):
    footprint = traced(C.FullCache(), byte_tokenizer)
    assert footprint.held == [[LAYERS_X_KV_HEADS * (20 + t) for t in range(NEW)]]
    assert footprint.integral == LAYERS_X_KV_HEADS * (20 * 10 + 45) and footprint.peak == LAYERS_X_KV_HEADS * 29


def test_every_step_eviction_and_a_prompt_left_whole(byte_tokenizer):
    # H2O cuts back to its budget at every step: 8 held between steps, whatever the step
    assert traced(C.H2O(capacity=8), byte_tokenizer).held == [[LAYERS_X_KV_HEADS * 8] * NEW]
    # kvpress's DecodingPress alone: the prompt whole (20), growing, cut back to the target 8 at step 4
    per_head = [20, 21, 22, 23, 8, 9, 10, 11, 8, 9]
    footprint = traced(C.DecodingEviction(policy=C.StreamingLLM(kept_tail=2), target=8, interval=4), byte_tokenizer)
    assert footprint.held == [[LAYERS_X_KV_HEADS * h for h in per_head]] and footprint.peak == LAYERS_X_KV_HEADS * 23


def test_a_batch_row_keeps_its_own_steps_and_the_footprint_refuses_a_batch(byte_tokenizer):
    model = make_tiny_llama()
    result = generate(model, byte_tokenizer, [PROMPT, PROMPT[5:]], max_new_tokens=4)
    rows = result.rows()
    for row, n in zip(rows, (20, 15), strict=True):
        steps = row.token_ids.shape[1]
        assert row.footprint.held == [[LAYERS_X_KV_HEADS * (n + t) for t in range(steps)]]
    with pytest.raises(ValueError, match="split the batch"):
        _ = result.footprint.integral
    assert Footprint([[3, 5]], [10, 20]).columns() == dict(footprint_integral=8, footprint_peak=5,
                                                           footprint_bytes_integral=30, footprint_bytes_peak=20)


def test_questions_decoded_as_one_batch_each_count_their_own_entries(byte_tokenizer):
    # two questions of 3 and 6 tokens over one 20-token context: stacked left-padded, the pads never counted
    model = make_tiny_llama()
    results = generate(model, byte_tokenizer, PROMPT, question=[[30, 31, 32], [40, 41, 42, 43, 44, 45]],
                       max_new_tokens=4)
    for result, m in zip(results, (3, 6), strict=True):
        steps = result.token_ids.shape[1]
        assert result.footprint.held == [[LAYERS_X_KV_HEADS * (20 + m + t) for t in range(steps)]]


def test_bytes_follow_the_storage_a_quantized_cache_holds_fewer_bytes_per_entry(byte_tokenizer):
    # KIVI at 2 bits over every position: the same entries as the full cache, each in fewer bytes than fp32's 128
    footprint = traced(C.KIVI(policy=C.SnapKV(window_size=4), capacity=None, key_bits=2, value_bits=2, group_size=8,
                              residual_length=8),
                       byte_tokenizer)
    assert footprint.held == [[LAYERS_X_KV_HEADS * (20 + t) for t in range(NEW)]]
    assert all(0 < b < 128 * h for b, h in zip(footprint.bytes, footprint.held[0], strict=True))
