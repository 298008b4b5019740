"""R-KV against a plain reference written from its official code (Zefan-Cai/R-KV: rkv/utils.py
compute_attention_scores with pooling="max" and cal_similarity, rkv/compression/r1_kv.py R1KV._compute_scores and
update_kv), on random keys and queries, and end to end: the cache cut back to the budget while decoding."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import make_tiny_llama

import snapkv_lab as C
from snapkv_lab.core.attention import AttentionSettings
from snapkv_lab.policies.base import AttentionCall


def official_similarity(keys, threshold=0.5, retain_direction="last"):
    """cal_similarity for keys (batch, kv_heads, n, d), line by line."""
    n = keys.shape[2]
    k_norm = keys / (keys.norm(dim=-1, keepdim=True) + 1e-8)
    similarity = torch.matmul(k_norm, k_norm.transpose(-1, -2))
    similarity.masked_fill_(torch.eye(n, dtype=torch.bool).view(1, 1, n, n), 0.0)
    indices = torch.where(similarity > threshold, torch.arange(n).view(1, 1, 1, n), torch.zeros(1, dtype=torch.long))
    retain = indices.max(dim=-1)[0] if retain_direction == "last" else indices.min(dim=-1)[0]
    similarity.scatter_(-1, retain.unsqueeze(-1), 0)
    return similarity.mean(dim=-2).softmax(dim=-1)


def official_scores(queries, keys, window=8, kernel=7, mix_lambda=0.07):
    """R1KV._compute_scores for queries (batch, heads, q, d) and keys (batch, kv_heads, n, d)."""
    batch, heads, q_len, d = queries.shape
    kv_heads = keys.shape[1]
    grouped = queries.view(batch, kv_heads, heads // kv_heads, q_len, d)
    logits = torch.matmul(grouped, keys.unsqueeze(2).transpose(3, 4)).max(dim=2).values / math.sqrt(d)
    attention = F.softmax(logits[:, :, -window:, :-window], dim=-1, dtype=torch.float32).mean(dim=-2)
    attention = F.max_pool1d(attention, kernel_size=kernel, padding=kernel // 2, stride=1)
    similarity = official_similarity(keys)[:, :, :-window]
    return attention * mix_lambda - similarity * (1 - mix_lambda)


@pytest.mark.parametrize("copies", [False, True])
def test_scores_equal_the_official(copies):
    generator = torch.Generator().manual_seed(3)
    keys = torch.randn(1, 2, 300, 16, generator=generator)
    if copies:  # near-copies of a few keys, as a reasoning model repeats itself: the redundancy term at work
        keys[:, :, 150:200] = keys[:, :, 50:100] + 0.05 * torch.randn(1, 2, 50, 16, generator=generator)
    queries = torch.randn(1, 6, 300, 16, generator=generator)
    call = AttentionCall(query=queries[0], key=keys[0], value=keys[0], slots=torch.arange(300),
                         attention=AttentionSettings(scaling=1 / math.sqrt(16)), module=None, layer=0, n_layers=1)
    mine = C.RKV(capacity=64).score(call)
    expected = official_scores(queries, keys)[0]
    torch.testing.assert_close(mine[:, :-8], expected, rtol=1e-5, atol=1e-7)
    kept = C.RKV(capacity=64).keep(mine, 300, 2, 0, 1)
    top = expected.topk(64 - 8, dim=-1).indices.sort(dim=-1).values
    assert torch.equal(kept, torch.cat([top, torch.arange(292, 300).expand(2, -1)], dim=-1))


def test_the_cache_is_cut_back_to_the_budget_every_interval(byte_tokenizer):
    model = make_tiny_llama(initializer_range=0.3, num_hidden_layers=2)
    ids = torch.randint(2, 256, (1, 100), generator=torch.Generator().manual_seed(4))
    policy = C.RKV(capacity=40, interval=16)
    run = C.generate(model, byte_tokenizer, ids, policy=policy, max_new_tokens=40)
    assert run.cache_lengths == [40, 40]  # the prompt compressed at prefill
    for kept in run.kept_indices:  # the positions the last eviction kept: the budget, generated positions among them
        assert kept.shape[-1] == 40 and int(kept.max()) >= 100 and len(kept[0, 0].unique()) == 40
    with pytest.raises(ValueError, match="interval"):
        C.RKV(capacity=40, interval=4)  # shorter than the 8 voters
    with pytest.raises(ValueError, match="pooling must stay None"):
        C.RKV(pooling="max")
