"""CAKE against a plain reference written from its official code (antgroup/cakekv, read in the fork qtris123/cakekv:
cake/model/modify_llama.py lines 106-134 for the preference and the indicator, cake/cake_cache.py
CakeprefillKVCache.__call__ and evcit_layer_kvcache for the eviction, cake/utils.py adjust_budgets for the integer
budgets), over transformers' eager attention maps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import make_tiny_llama
from reference import eager_attentions, kv_heads

import snapkv_lab as C
from snapkv_lab.policies.cake import adjust_budgets

WINDOW, CAPACITY, N = 8, 40, 120


def official_adjust(budgets, total, prefix_len):
    """adjust_budgets, step by step in plain Python: truncate; cap at the prefix, the excess shared by the layers
    below it (remainder to the first ones); then the difference to the total shared the same way, added over layers
    below the prefix or taken from layers above 1."""
    out = [int(b) for b in budgets]
    excess = sum(max(b - prefix_len, 0) for b in out)
    out = [min(b, prefix_len) for b in out]
    if excess:
        room = [i for i, b in enumerate(out) if b < prefix_len]
        for j, i in enumerate(room):
            out[i] += excess // len(room) + (1 if j < excess % len(room) else 0)
    difference = total - sum(out)
    if difference:
        open_ = [i for i, b in enumerate(out) if (b < prefix_len if difference > 0 else b > 1)]
        sign = 1 if difference > 0 else -1
        for j, i in enumerate(open_):
            out[i] += sign * (abs(difference) // len(open_) + (1 if j < abs(difference) % len(open_) else 0))
    return out


def test_integer_budgets_as_the_official_adjust_budgets():
    # hand-worked: [10, 50, 3] capped at 40 gives 10 back, 5 to each layer below; 63 is 3 over 60: one from each
    assert adjust_budgets([10.7, 50.2, 3.1], 60, 40) == [14, 39, 7]
    # the excess is spread once: [50, 38, 2] capped at 40 gives 10 back, 5 to each layer below, which lifts the second
    # past its prefix; a layer keeps at most its prefix, so 3 of the 90 go unused (evaluation.audit.BUDGET_DEPARTURES)
    assert adjust_budgets([50.0, 38.0, 2.0], 90, 40) == official_adjust([50.0, 38.0, 2.0], 90, 40) == [40, 43, 7]
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        layers = int(torch.randint(2, 9, (1,), generator=generator))
        prefix = int(torch.randint(20, 200, (1,), generator=generator))
        total = int(torch.randint(layers, layers * prefix, (1,), generator=generator))
        weights = torch.rand(layers, generator=generator) ** 4
        shares = (weights / weights.sum() * total).tolist()
        assert adjust_budgets(shares, total, prefix) == official_adjust(shares, total, prefix)


def official_cake(model, ids, capacity, window, tau1=1.0, tau2=1.0, gamma=200.0):
    """Each layer's kept positions (batch, kv_heads, budget_l + window) as the official code keeps them."""
    n, layers = ids.shape[1], model.config.num_hidden_layers
    preferences, indicators = [], []
    for attn in eager_attentions(model, ids):
        weights = attn[:, :, -window:, :]  # the window's softmax over every key, causal inside the window
        prefix = weights[..., :-window]
        entropy = -torch.sum(prefix * torch.log(prefix + 1e-10))
        variance = torch.var(prefix, dim=-2).sum(0).sum(0).sum(0)
        preferences.append(float(entropy ** (1 / tau1) * variance ** (1 / tau2)))
        indicator = (weights.mean(dim=-2) + gamma * weights.var(dim=-2))[:, :, :-window]
        indicator = F.avg_pool1d(indicator, kernel_size=5, padding=2, stride=1)
        groups = indicator.reshape(ids.shape[0], kv_heads(model.config), -1, n - window)
        indicators.append(groups.mean(dim=-2))
    total = (capacity - window) * layers
    budgets = official_adjust([p / sum(preferences) * total for p in preferences], total, n - window)
    kept = []
    for indicator, budget in zip(indicators, budgets, strict=True):
        top = indicator.topk(min(budget, n - window), dim=-1).indices.sort(dim=-1).values
        kept.append(torch.cat([top, torch.arange(n - window, n).expand(*top.shape[:-1], -1)], dim=-1))
    return kept, budgets, preferences


@pytest.mark.parametrize("tau1,tau2,gamma", [(1.0, 1.0, 200.0), (1.6, 0.4, 0.0)])
def test_kept_positions_and_layer_budgets_equal_the_official(tau1, tau2, gamma, byte_tokenizer):
    model = make_tiny_llama(initializer_range=0.3, num_hidden_layers=4)
    ids = torch.randint(2, 256, (1, N), generator=torch.Generator().manual_seed(31))
    policy = C.CAKE(capacity=CAPACITY, window_size=WINDOW, tau1=tau1, tau2=tau2, gamma=gamma)
    run = C.generate(model, byte_tokenizer, ids, policy=policy, max_new_tokens=2)
    kept, budgets, preferences = official_cake(model, ids, CAPACITY, WINDOW, tau1, tau2, gamma)
    assert len(set(budgets)) > 1 and sum(budgets) == (CAPACITY - WINDOW) * 4  # the layers really differ
    assert [k.shape[-1] - WINDOW for k in run.kept_indices] == budgets
    for layer, (mine, ref) in enumerate(zip(run.kept_indices, kept, strict=True)):
        assert torch.equal(mine, ref), layer
    assert sum(run.cache_lengths) == CAPACITY * 4  # the layers share exactly the budget of a uniform cache


def test_cake_compresses_after_the_prefill_and_refuses_what_cannot_hold_its_budgets(byte_tokenizer):
    model = make_tiny_llama(initializer_range=0.3, num_hidden_layers=2)
    policy = C.CAKE(capacity=CAPACITY, window_size=WINDOW)
    with pytest.raises(NotImplementedError, match="every layer's scores"):
        with C.compress(model, policy):
            pass
    with pytest.raises(NotImplementedError, match="every layer's scores"):
        C.generate(model, byte_tokenizer, torch.randint(2, 256, (1, N)), policy=policy, prefill_chunk=32)
    with pytest.raises(TypeError, match="cannot be wrapped"):
        C.AdaKV(policy=policy)
    with pytest.raises(ValueError, match="tau1 must be positive"):
        C.CAKE(tau1=0)
    assert C.CAKE(capacity=CAPACITY).label == "CAKE@40" and C.CAKE().tail(1024) == 32
