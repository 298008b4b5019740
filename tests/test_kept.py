"""kept.kept_mask, the one answer to "what did this policy keep", against plain loops over kept positions."""

from __future__ import annotations

import pytest
import torch
from conftest import ByteTokenizer, make_tiny_llama

from snapkv_lab import AdaKV, SnapKV, attention_coverage, capture, generate
from snapkv_lab.compression import SharedPrefill
from snapkv_lab.compression.kept import kept_mask
from snapkv_lab.pressure.runner import kept_fraction


def plain_mask(kept_indices, n_tokens, batch=0, whole_from=None):
    """Nested lists [layer][row][position], one position at a time; a layer with fewer rows serves its groups."""
    rows = max(layer.shape[1] for layer in kept_indices)
    out = []
    for layer in kept_indices:
        group = rows // layer.shape[1]
        out.append([[p in set(layer[batch][r // group].tolist()) or (whole_from is not None and p >= whole_from)
                     for p in range(n_tokens)] for r in range(rows)])
    return out


def test_hand_built_layers_padding_generated_positions_and_mixed_rows():
    per_query_head = torch.tensor([[[0, 1], [2, -1], [3, 9], [1, 2]]])  # 4 query heads; -1 pads, 9 was generated
    per_kv_head = torch.tensor([[[0, 4], [5, 3]]])  # 2 KV heads, each serving 2 query heads
    mask = kept_mask([per_query_head, per_kv_head], 6)
    assert mask.shape == (2, 4, 6) and mask.dtype == torch.bool
    assert mask.tolist() == plain_mask([per_query_head, per_kv_head], 6)
    assert mask[1, 1].tolist() == [True, False, False, False, True, False]  # query head 1 reads KV head 0's set
    assert kept_mask([per_kv_head], 6, whole_from=4)[0].tolist() == [[True, False, False, False, True, True],
                                                                      [False, False, False, True, True, True]]
    with pytest.raises(ValueError, match="no layer"):
        kept_mask([], 6)


@pytest.fixture(scope="module")
def run():
    """(model, tokenizer, ids of 2 prompts, their AdaKV result): built once for the module."""
    model, tokenizer = make_tiny_llama(initializer_range=0.3), ByteTokenizer()
    ids = torch.randint(2, 256, (2, 90), generator=torch.Generator().manual_seed(4))
    policy = AdaKV(policy=SnapKV(window_size=8), capacity=40)
    return model, tokenizer, ids, generate(model, tokenizer, ids, policy=policy, max_new_tokens=3)


def test_a_result_its_list_and_its_state_give_one_mask_per_batch_row(run):
    model, tokenizer, ids, result = run
    for batch in (0, 1):
        mask = kept_mask(result, 90, batch)
        assert mask.tolist() == plain_mask(result.kept_indices, 90, batch)
        assert torch.equal(mask, kept_mask(result.kept_indices, 90, batch))
    assert not torch.equal(kept_mask(result, 90, 0), kept_mask(result, 90, 1))  # each row its own selection
    assert kept_mask(result, 90).sum(-1).float().mean() == pytest.approx(40, abs=0.5)  # AdaKV: 40 a head on average
    policy = SnapKV(capacity=40, window_size=8)
    state = SharedPrefill.run(model, tokenizer, ids[:1], [policy]).state(policy)
    mask = kept_mask(state, 90)
    assert (mask.sum(-1) == 40).all()
    span = (30, 50)  # the pressure tables' kept share is the mask's mean over the span
    plain = [row[30:50] for layer in plain_mask([state.kept_indices[i] for i in sorted(state.kept_indices)], 90)
             for row in layer]
    assert kept_fraction(state, span) == pytest.approx(sum(map(sum, plain)) / (len(plain) * 20))


def test_coverage_takes_a_mask_and_agrees_with_the_positions_it_came_from(run):
    model, tokenizer, ids, _ = run
    prompt = ids[:1]
    result = generate(model, tokenizer, prompt, policy=SnapKV(capacity=40, window_size=8), max_new_tokens=4)
    trace = capture(model, tokenizer, prompt, max_new_tokens=4, stop_at_eos=False, progress=False)
    by_mask = attention_coverage(trace, kept_mask(result, trace.prompt_len))
    assert by_mask.equals(attention_coverage(trace, result))
    everything = attention_coverage(trace, kept_mask(result, trace.prompt_len, whole_from=0))
    assert (everything.kept == everything.eligible).all()
    with pytest.raises(ValueError, match="kept mask has shape"):
        attention_coverage(trace, kept_mask(result, trace.prompt_len - 1))
