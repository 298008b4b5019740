"""Surprisal: kept positions vs the rule written plainly from the model's own logits (tiny random Llama)."""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_llama
from reference import assert_same_selection
import snapkv_lab as sl
import snapkv_lab.policies.surprisal as surprisal

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
    """(k + window,) positions: the prefix's top scores after a plain max over each position's neighbours."""
    scores = scores.clone()
    scores[:sinks] = torch.finfo(scores.dtype).max
    prefix = n - window
    pooled = torch.tensor([scores[max(0, i - kernel // 2):min(prefix, i + kernel // 2 + 1)].max() for i in range(prefix)])
    top = pooled.topk(capacity - window).indices.sort().values
    return torch.cat([top, torch.arange(prefix, n)]), pooled


def test_token_surprisal_equals_the_loss_of_every_position(monkeypatch):
    model = make_tiny_llama(initializer_range=0.3)
    ids = torch.randint(2, 256, (1, N), generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(surprisal, "CHUNK", 10)  # several chunks, the last one short
    with torch.no_grad():
        mine = surprisal.token_surprisal(model, ids)
    torch.testing.assert_close(mine[0], reference_surprisal(model, ids), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("kernel", [1, 5, 31])
def test_kept_positions_match_the_plain_rule(kernel, byte_tokenizer):
    model = make_tiny_llama(initializer_range=0.3)
    ids = torch.randint(2, 256, (1, N), generator=torch.Generator().manual_seed(kernel))
    policy = sl.Surprisal(capacity=CAPACITY, window_size=WINDOW, kernel_size=kernel)
    result = sl.generate(model, byte_tokenizer, ids, policy=policy, max_new_tokens=2)
    ref, pooled = reference_kept(reference_surprisal(model, ids), N, WINDOW, CAPACITY, kernel, policy.sinks)
    kv_heads = model.config.num_key_value_heads
    assert all(torch.equal(kept[0, 0], kept[0, h]) for kept in result.kept_indices for h in range(kv_heads))  # one set
    assert set(range(policy.sinks)) <= set(result.kept_indices[0][0, 0].tolist())
    layers = len(result.kept_indices)
    assert_same_selection([k[0, :1] for k in result.kept_indices], [ref[None]] * layers,
                          [torch.cat([pooled, torch.zeros(WINDOW)])[None]] * layers, WINDOW)


def test_refuses_per_query_head_and_negative_sinks():
    with pytest.raises(ValueError, match="one set serves every head"):
        sl.Surprisal(per_query_head=True)
    with pytest.raises(ValueError, match="sinks must be a non-negative int"):
        sl.Surprisal(sinks=-1)
