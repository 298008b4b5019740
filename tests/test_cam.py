"""CAM (CaM, ICML 2024) against references written from its official code (zyxxmu/cam @ df5e076,
cam_hf/utils_hh/modify_llama_cam.py): the merge on a hand-worked case, and a whole decode on a tiny random model."""

from __future__ import annotations

import pytest
import torch
from conftest import eager_twin, make_tiny_llama

import snapkv_lab
from snapkv_lab.policies.cam import merge_next_leaver

N, START, RECENT, NEW, SEED = 40, 3, 12, 16, 123


def test_merge_by_hand():
    """Two heads, five slots, head_dim 1, merge_budget 2, the next leaver at slot 1. Head 0: A_1 = 0.4 over the mean
    (0.2 + 0.2 + 0.1) / 3 of the slots after it: p = 2.4, clamped to 1, so slots 2 and 3 gain v_1 / 2 = 1.
    Head 1: A_1 = 0, p = 0: nothing moves. A head whose window has no attention at all: 0 / 0 = nan -> 0."""
    value = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0], [10.0, 20.0, 30.0, 40.0, 50.0],
                          [7.0, 7.0, 7.0, 7.0, 7.0]])[..., None]
    attention = torch.tensor([[0.1, 0.4, 0.2, 0.2, 0.1], [0.5, 0.0, 0.2, 0.2, 0.1], [1.0, 0.0, 0.0, 0.0, 0.0]])
    merged = merge_next_leaver(value.double(), attention.double(), leaver=1, merge_budget=2)
    expected = torch.tensor([[1.0, 2.0, 4.0, 5.0, 5.0], [10.0, 20.0, 30.0, 40.0, 50.0], [7.0, 7.0, 7.0, 7.0, 7.0]])
    assert torch.equal(merged[..., 0], expected.double())
    assert value[0, 2, 0] == 3.0  # the input is left as it was


def local_cam_mask(values: torch.Tensor, attention: torch.Tensor, recent_budget: int, draws: list) -> None:
    """modify_llama_cam.py:23-35, on (1, heads, T, head_dim) values in place; attention (heads, T) this step's
    weights. The slice ends at T + 1 as the official one (one past the end: the new token is the last averaged)."""
    merge_budget = 32
    t = attention.shape[-1]
    mean = attention[:, t - recent_budget + 2:t + 1].mean(-1)
    probability = attention[:, t - recent_budget + 1] / mean
    probability[torch.isnan(probability)] = 0
    mask = torch.bernoulli(probability.clamp(min=0, max=1))
    draws.append(mask)
    share = values[0, :, t - recent_budget + 1].clone() * mask[:, None] / merge_budget
    values[0, :, t - recent_budget + 2:t - recent_budget + merge_budget + 2] += share[:, None]


def cam_reference(model, prompt: torch.Tensor, start: int, recent: int, new: int):
    """LlamaAttention_cam.forward (modify_llama_cam.py:79-171) on a one-layer model: the full cache never shrinks;
    the prefill attends everything and builds the next mask (lines 141-148: the first `start` and the last `recent`
    of the next call's keys); each decode call attends what that mask shows, then local_cam_mask merges into the
    cache's values (line 153, after the output) and the next mask drops the window's oldest.
    Returns (tokens, positions visible after the last call, the cache's values, the Bernoulli draws)."""
    eager = eager_twin(model)
    n = prompt.shape[1]
    with torch.no_grad():
        out = eager(prompt, use_cache=True)
    cache, token, tokens, draws = out.past_key_values, out.logits[0, -1].argmax(), [], []

    def shown(length):  # the mask built by a call over `length` keys, for the next call (length + 1 keys)
        return list(range(start)) + list(range(length + 1 - recent, length + 1))

    visible = shown(n)
    for step in range(new):
        tokens.append(int(token))
        if step == new - 1:
            break
        keys = n + step + 1
        mask = torch.full((1, 1, 1, keys), torch.finfo(torch.float64).min, dtype=torch.float64)
        mask[..., visible] = 0
        with torch.no_grad():
            out = eager(token.view(1, 1), past_key_values=cache, attention_mask=mask,
                        position_ids=torch.tensor([[keys - 1]]), output_attentions=True, use_cache=True)
        local_cam_mask(cache.layers[0].values, out.attentions[0][0, :, 0], recent, draws)
        visible = shown(keys)
        token = out.logits[0, -1].argmax()
    held = [p for p in visible if p < n + new - 1]
    return tokens, held, cache.layers[0].values[0], torch.stack(draws)


@pytest.fixture(scope="module")
def mha_model():
    """One layer (a mask of shape (1, 1, 1, n) hides what was evicted), MHA as the official Llama-1 code, float64."""
    return make_tiny_llama(initializer_range=0.3, num_hidden_layers=1, num_key_value_heads=4).double()


def test_cam_matches_its_official_code(mha_model):
    prompt = torch.randint(2, 256, (1, N), generator=torch.Generator().manual_seed(5))
    torch.manual_seed(SEED)
    ref_tokens, ref_held, ref_values, draws = cam_reference(mha_model, prompt, START, RECENT, NEW)
    assert 0 < draws.sum() < draws.numel()  # some tokens merged, some dropped: the draws decide
    policy = snapkv_lab.CAM(capacity=START + RECENT - 1, sinks=START)  # official cache_budget = capacity + 1
    torch.manual_seed(SEED)
    with snapkv_lab.compress(mha_model, policy) as state:
        out = mha_model.generate(prompt, attention_mask=torch.ones_like(prompt), past_key_values=state.cache,
                                 max_new_tokens=NEW, do_sample=False, eos_token_id=None)
    assert out[0, N:].tolist() == ref_tokens
    held = state.kept_indices[0][0]
    assert held.tolist() == [ref_held] * 4 and max(ref_held) >= N
    values = state.cache.layers[0].values[0]
    torch.testing.assert_close(values, ref_values[:, ref_held], rtol=1e-10, atol=1e-12)
    plain = snapkv_lab.CAM(capacity=START + RECENT - 1, sinks=START, merge_budget=10**6)  # shares of ~0
    torch.manual_seed(SEED)
    with snapkv_lab.compress(mha_model, plain) as unmerged:
        mha_model.generate(prompt, attention_mask=torch.ones_like(prompt), past_key_values=unmerged.cache,
                           max_new_tokens=NEW, do_sample=False, eos_token_id=None)
    assert (unmerged.cache.layers[0].values[0] - values).abs().max() > 1e-3  # the merges changed the values


def test_cam_defaults_and_refusals():
    policy = snapkv_lab.CAM(capacity=20)
    assert (policy.sink_count(20), policy.tail(20), policy.merge_budget, policy.interval) == (10, 10, 32, 1)
    assert snapkv_lab.CAM(capacity=20, sinks=4, merge_budget=8).label == "CAM(sinks=4, merge_budget=8)@20"
    with pytest.raises(ValueError, match="recent window"):
        snapkv_lab.CAM(capacity=20, sinks=20)
    assert snapkv_lab.CAM(capacity=20, kept_tail=4).sink_count(20) == 16  # the recent window set, the sinks the rest
    with pytest.raises(ValueError, match="one of sinks and kept_tail"):
        snapkv_lab.CAM(capacity=20, kept_tail=4, sinks=2)
    with pytest.raises(ValueError, match="merge_budget"):
        snapkv_lab.CAM(capacity=20, merge_budget=0)
