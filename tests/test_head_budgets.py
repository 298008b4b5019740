"""HeadKV against a plain reference written from its official code (FYYFU/HeadKV at 3ec9653, headkv/snapkv_utils.py,
ReasonSnapKVCluster: the capacities in __init__, the per-head top-k plus window in update_kv) over transformers'
eager attention maps, with retrieval scores handed to it."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from conftest import ByteTokenizer, make_tiny_llama
from reference import eager_attentions
import snapkv_lab as C
from snapkv_lab.policies import headkv

WINDOW, CAPACITY, N = 8, 40, 96


def official_capacities(scores: list[list[float]], base_capacity: int, window: int, beta: float, temp: float):
    """ReasonSnapKVCluster.__init__, line by line: scores normalised, raised to temp, normalised; a pool of
    (b // beta) per head shared by them; each head gets round(share * pool + b - b // beta)."""
    b = base_capacity - window
    flat = [s for layer in scores for s in layer]
    total = sum(flat)
    shares = [(s / total) ** temp for s in flat]
    shares = [s / sum(shares) for s in shares]
    pool = (b // beta) * len(flat)
    floor = b - b // beta
    caps = [round(s * pool + floor) for s in shares]  # torch.round: half to even, as Python's round
    width = len(scores[0])
    return [caps[i:i + width] for i in range(0, len(caps), width)]


def official_kept(model, ids, capacities):
    """Per layer (kv_heads, widest) kept positions, -1 padded: SnapKV's window votes (the mean of the last WINDOW rows
    of the eager maps over the prefix, max-pooled with kernel 7) per query head, each KV head ranking by its query
    heads' mean vote and keeping the mean of their capacities (the official's per query head, reduced as the lab's
    GQA-aware SnapKV and AdaKV reduce), its top positions, then the window."""
    prefix = ids.shape[1] - WINDOW
    kept = []
    for layer, attn in enumerate(eager_attentions(model, ids)):  # (1, heads, n, n)
        votes = F.max_pool1d(attn[0, :, -WINDOW:, :prefix].mean(1)[:, None], 7, stride=1, padding=3)[:, 0]
        kv = model.config.num_key_value_heads
        votes = votes.view(kv, -1, prefix).mean(1)
        caps = torch.round(torch.tensor(capacities[layer], dtype=torch.float64).view(kv, -1).mean(1))
        rows = []
        for head_votes, cap in zip(votes, caps.long().clamp(max=prefix).tolist()):
            top = head_votes.topk(cap).indices.sort().values
            rows.append(torch.cat([top, torch.arange(prefix, ids.shape[1])]))
        widest = max(len(r) for r in rows)
        kept.append(torch.stack([F.pad(r, (0, widest - len(r)), value=-1) for r in rows]))
    return kept


@pytest.mark.parametrize("beta,temperature", [(1.005, 1.0), (2.0, 1.0), (1.2, 2.0)])
def test_capacities_are_the_official_allocation(beta, temperature):
    scores = [[0.0, 0.4, 0.1, 0.05], [0.3, 0.0, 0.02, 0.9], [0.01, 0.2, 0.0, 0.0]]
    expected = official_capacities(scores, CAPACITY, WINDOW, beta, temperature)
    shares = headkv.head_shares(torch.tensor(scores), temperature)
    assert headkv.head_capacities(shares, CAPACITY - WINDOW, beta).tolist() == expected
    assert abs(sum(map(sum, expected)) - 12 * (CAPACITY - WINDOW)) <= 12 / 2  # the uniform total, up to rounding


@pytest.mark.parametrize("beta", [1.005, 1.5])
def test_each_head_keeps_its_top_positions_under_its_capacity(beta):
    model = make_tiny_llama(initializer_range=0.3)  # peaked attention: few ties among votes
    scores = torch.tensor([[0.05, 0.6, 0.0, 0.2], [0.3, 0.1, 0.45, 0.0]], dtype=torch.float64)
    headkv._SCORES[model] = scores
    ids = torch.randint(2, 256, (1, N), generator=torch.Generator().manual_seed(3))
    policy = C.HeadKV(capacity=CAPACITY, window_size=WINDOW, beta=beta)
    state_kept = C.generate(model, ByteTokenizer(), ids, policy=policy, max_new_tokens=1).kept_indices
    capacities = official_capacities(scores.tolist(), CAPACITY, WINDOW, beta, 1.0)
    for layer, reference in enumerate(official_kept(model, ids, capacities)):
        assert torch.equal(state_kept[layer][0], reference), layer
    held = torch.cat([(k[0] >= 0).sum(-1) for k in state_kept])  # per head, every layer
    assert held.max() > CAPACITY > held.min()  # the budget moved between heads and layers


def test_kv_bytes_stay_within_the_uniform_budget():
    model = make_tiny_llama()
    headkv._SCORES[model] = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 3.0]], dtype=torch.float64)
    ids = torch.randint(2, 256, (1, N), generator=torch.Generator().manual_seed(4))
    run = C.generate(model, ByteTokenizer(), ids, policy=C.HeadKV(capacity=CAPACITY, window_size=WINDOW), max_new_tokens=1)
    uniform = C.generate(model, ByteTokenizer(), ids, policy=C.SnapKV(capacity=CAPACITY, window_size=WINDOW),
                         max_new_tokens=1)
    # b = 32: 31 of it pooled over 8 heads (248), a floor of 1. Query heads: layer 0 head 0 gets round(248 / 4 + 1) = 63,
    # layer 1 head 3 round(3 * 248 / 4 + 1) = 187, the others 1. KV heads keep their pair's mean: layer 0 32 and 1,
    # layer 1 1 and 94, which passes its 88-position prefix: it keeps the prefix, the rest of its share is lost
    # (as officially), so the cache holds less than the uniform budget.
    held = [int((k[0] >= 0).sum()) for k in run.kept_indices]
    assert held == [32 + 1 + 2 * WINDOW, 1 + 88 + 2 * WINDOW]
    assert run.kv_bytes < uniform.kv_bytes


def test_a_model_whose_heads_score_nothing_is_refused():
    model = make_tiny_llama()
    headkv._SCORES[model] = torch.zeros(2, 4, dtype=torch.float64)
    ids = torch.randint(2, 256, (1, N), generator=torch.Generator().manual_seed(5))
    with pytest.raises(ValueError, match="retrieval scores"):
        C.generate(model, ByteTokenizer(), ids, policy=C.HeadKV(capacity=CAPACITY, window_size=WINDOW), max_new_tokens=1)
    with pytest.raises(ValueError, match="beta"):
        C.HeadKV(capacity=CAPACITY, beta=0.5)
    with pytest.raises(ValueError, match="per_query_head"):
        C.HeadKV(capacity=CAPACITY, per_query_head=True)
    assert math.isclose(float(headkv.head_shares(torch.tensor([[1.0, float("nan")]])).sum()), 1.0)
