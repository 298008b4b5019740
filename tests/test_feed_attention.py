"""core.feed_attention against the attention written out: softmax(q.k * scaling) over every cached key and the fed
keys up to each query's own, and log-sum-exps over the named key sets, from the logits directly."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from snapkv_lab.core.attention import AttentionSettings
from snapkv_lab.core.feed_attention import attention_by_parts, by_parts_supported


def written_out(query, key, value, scaling):
    """(logits (heads, m, n + m) with -inf after each query's own position, output (m, heads, d))."""
    heads, m, _ = query.shape
    group, n = heads // key.shape[0], key.shape[1] - m
    keys, values = key.repeat_interleave(group, 0), value.repeat_interleave(group, 0)
    logits = query @ keys.mT * scaling
    logits[..., n:] = logits[..., n:].masked_fill(torch.ones(m, m, dtype=torch.bool).triu(1), -math.inf)
    return logits, (torch.softmax(logits, -1) @ values).transpose(0, 1)


@pytest.mark.parametrize("kv_heads", [1, 3, 6])
def test_output_and_log_sum_exps_equal_the_written_out_attention(kv_heads):
    generator = torch.Generator().manual_seed(kv_heads)
    heads, n, m, dim, scaling = 6, 50, 17, 16, 0.3
    query = torch.randn(m, heads, dim, generator=generator).transpose(0, 1)  # strided, as a layer hands it over
    key, value = (torch.randn(kv_heads, n + m, dim, generator=generator) for _ in range(2))
    subset = torch.zeros(n, dtype=torch.bool)
    subset[:3] = subset[20:35] = True
    output, lse_subset, lse_own = attention_by_parts(query, key, value, subset, scaling)
    logits, expected = written_out(query, key, value, scaling)
    torch.testing.assert_close(output, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse_subset, logits[..., :n][..., subset].logsumexp(-1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse_own, logits[..., n:].logsumexp(-1), atol=1e-5, rtol=1e-5)
    # the backend's own call (transformers' sdpa: a boolean mask over the cache and the feed) agrees too
    mask = torch.ones(m, n + m, dtype=torch.bool).tril(n)
    group = heads // kv_heads
    backend = F.scaled_dot_product_attention(query[None], key.repeat_interleave(group, 0)[None],
                                             value.repeat_interleave(group, 0)[None], attn_mask=mask, scale=scaling)
    torch.testing.assert_close(output, backend[0].transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_an_empty_or_whole_subset():
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(4, 5, 8, generator=generator)
    key, value = (torch.randn(2, 12, 8, generator=generator) for _ in range(2))
    logits, expected = written_out(query, key, value, 0.5)
    for subset in (torch.zeros(7, dtype=torch.bool), torch.ones(7, dtype=torch.bool)):
        output, lse_subset, _ = attention_by_parts(query, key, value, subset, 0.5)
        torch.testing.assert_close(output, expected, atol=1e-5, rtol=1e-5)
        inside = logits[..., :7][..., subset].logsumexp(-1) if subset.any() else torch.full((4, 5), -math.inf)
        torch.testing.assert_close(lse_subset, inside, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="subset must be a"):
        attention_by_parts(query, key, value, torch.ones(12, dtype=torch.bool), 0.5)


def test_supported_only_where_the_kernel_computes_the_layer():
    query = torch.zeros(2, 3, 4)
    assert by_parts_supported(query, AttentionSettings(scaling=0.5))
    assert not by_parts_supported(query.double(), AttentionSettings(scaling=0.5))
    assert not by_parts_supported(query, AttentionSettings(scaling=0.5, softcap=50.0))
    assert not by_parts_supported(query, AttentionSettings(scaling=0.5, sliding_window=8))
