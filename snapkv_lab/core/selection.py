"""SnapKV selection: vote with an observation window, pool, keep the top-k prefix positions per head.

One code path serves analysis (on a saved AttentionTrace) and compression (on live tensors during
prefill), so the two can never disagree:

    votes = window_votes(query_window, key, scaling, window_positions, prefix_len)   # (heads, prefix)
    indices = select(votes, k, pooling="max", kernel_size=7, kv_heads=None)           # (heads, k) sorted

`select_from_trace(trace, layer, voters, ...)` is the same on a trace.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import reduce

from .attention import attention_column_sums

# The paper's observation experiments keep the top 5% of the prefix per head (p = 0.05): the findings' share, and the
# default of every per-head statistic that reads a selection (views.heads).
TOP_P = 0.05
POOLINGS = (None, "max", "avg")
GQA_REDUCTIONS = ("mean", "max")


def window_votes(query_window, key, scaling, window_positions, prefix_len: int, **options) -> torch.Tensor:
    """SnapKV votes (heads, prefix_len) float32: each window query's softmax attention, summed over the window.

    query_window: (heads, window, head_dim); key: (kv_heads, n_keys, head_dim); window_positions: (window,).
    Softmax runs over every key a window query sees (the window's own earlier tokens included); only the
    first prefix_len columns are kept, as in the paper. options: kv_index, softcap, ... (attention_row_blocks).
    """
    return attention_column_sums(query_window, key, scaling, window_positions, **options)[:, :prefix_len]


def pool_votes(votes: torch.Tensor, pooling: str | None = "max", kernel_size: int = 7) -> torch.Tensor:
    """1-D pooling along positions, stride 1, padding kernel_size // 2: (..., n) -> (..., n)."""
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    if pooling is None or kernel_size == 1:
        return votes
    if kernel_size < 1 or kernel_size % 2 == 0:
        raise ValueError(f"kernel_size must be a positive odd number, got {kernel_size}")
    flat = votes.reshape(-1, 1, votes.shape[-1])
    pool = F.max_pool1d if pooling == "max" else F.avg_pool1d
    return pool(flat, kernel_size, stride=1, padding=kernel_size // 2).reshape(votes.shape)


def votes_per_kv_head(votes: torch.Tensor, n_kv_heads: int, how: str = "mean") -> torch.Tensor:
    """(heads, n) -> (kv_heads, n): one score per KV head from the query heads that share it."""
    if how not in GQA_REDUCTIONS:
        raise ValueError(f"GQA reduction must be one of {GQA_REDUCTIONS}, got {how!r}")
    return reduce(votes, "(kv group) n -> kv n", how, kv=n_kv_heads)


def topk_count(k: int | float, prefix_len: int) -> int:
    """k as a count (int) or a fraction of the prefix (float in (0, 1]): floor(k * prefix_len), at least 1."""
    if isinstance(k, float):
        if not 0 < k <= 1:
            raise ValueError(f"a fractional k must lie in (0, 1], got {k}")
        return max(1, math.floor(k * prefix_len))
    if not 0 < k <= prefix_len:
        raise ValueError(f"k={k} positions cannot be chosen from a prefix of {prefix_len}")
    return int(k)


def select(votes: torch.Tensor, k: int | float, *, pooling: str | None = "max", kernel_size: int = 7,
           kv_heads: int | None = None, gqa: str = "mean") -> torch.Tensor:
    """Top-k prefix positions per head, sorted ascending: (heads, n) votes -> (heads or kv_heads, k) long.

    kv_heads: None keeps one selection per query head (analysis default); an int first pools the
    scores onto the KV heads with `gqa` ("mean" or "max"), as a GQA-aware compressor needs.
    Pooling is applied before the GQA reduction, per query head.
    """
    scores = pool_votes(votes, pooling, kernel_size)
    if kv_heads is not None:
        scores = votes_per_kv_head(scores, kv_heads, gqa)
    count = topk_count(k, scores.shape[-1])
    return torch.topk(scores, count, dim=-1).indices.sort(dim=-1).values


def select_from_trace(trace, layer: int, voters: slice, k: int | float, *, prefix_len: int | None = None,
                      pooling: str | None = None, kernel_size: int = 7, kv_heads: int | None = None,
                      gqa: str = "mean") -> torch.Tensor:
    """`select` with the votes of the query rows `voters` (a slice of consecutive token positions) of a trace.

    prefix_len defaults to the voters' first position: they vote on what precedes them. A smaller prefix_len votes
    on a common prefix (several blocks of voters compared); a larger one would let the voters vote on their own
    positions, which they attend to by construction, and is refused.
    Pooling defaults to None here (the observation experiments vote without pooling).
    """
    if not isinstance(voters, slice) or voters.step not in (None, 1):
        raise TypeError(f"voters must be a slice of consecutive token positions, got {voters!r}")
    rows = range(trace.n_tokens)[voters]
    if len(rows) == 0:
        raise ValueError(f"voters {voters} hold no token of the trace ({trace.n_tokens} tokens)")
    prefix_len = rows.start if prefix_len is None else prefix_len
    if prefix_len <= 0:
        raise ValueError(f"voters {voters} leave no prefix to vote on")
    if prefix_len > rows.start:
        raise ValueError(f"prefix_len {prefix_len} reaches into the voters {voters} (starting at {rows.start}): "
                         "voters cannot vote on their own positions")
    votes = trace.column_sums(layer, queries=voters)[:, :prefix_len]
    return select(votes, k, pooling=pooling, kernel_size=kernel_size, kv_heads=kv_heads, gqa=gqa)
