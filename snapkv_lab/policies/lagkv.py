"""LagKV (Liang et al. 2025, arXiv 2504.04704, "LagKV: Lag-Relative Information of the KV Cache Tells Which Tokens
Are Important"): each partition of the cache is judged against the partition after it (its lag), from the keys
and values alone. Reads no attention weights, so it fits a FlashAttention serving stack."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..core.checks import check_int
from .base import AttentionCall, Policy

TAIL = 2.0  # tail scores lie in (TAIL, TAIL + 1): above every partition's, below the sinks' +inf


@dataclass
class LagKV(Policy):
    """Sinks, whole partitions' best tokens, and the tail, per KV head.

    The authors' scheme (AI-Lab-China-Merchants-Bank/LagKV, lag_kv.py, `_get_states_score` and `_compress_algo`):
    after the first `sinks` positions the cache is cut into partitions of `lag_size`; the last whole partition and
    what follows it (the tail) are always kept, and every earlier partition p is scored against partition p + 1:
    each channel of p's keys is min-max normalised by p + 1's per-channel min and max, a token's score is the
    softmax over the partition of the channels' standard deviation, and the key and value scores add up
    (`value_weight` is the official score_v_ratio). Each partition keeps its best tokens.

    A budget instead of the official per-partition ratio: the positions the budget leaves after the sinks and the
    tail are shared equally by the scored partitions (kvpress's LagKVPress does the same, ranking within each
    partition, lagkv_press.py lines 77-78); the ones left over by the division go to the latest partitions. Below
    sinks + 2 * lag_size tokens there is no scored partition (the official code does not compress then): the sinks
    and the most recent positions are kept (kvpress's fallback, lines 55-63), and a budget smaller than sinks + tail
    keeps the tail's most recent positions. Defaults: the authors' (sink 16, lag 128: their transformers
    custom_generate "CMB-AI-LAB/lagkv_cache"); kvpress uses 4 sinks. The official cache compresses again while
    decoding, each time two new partitions have come; here the kept set is fixed after the prefill, as for every
    policy of the lab that does not evict while decoding.
    """

    kept_tail: int = 0
    sinks: int = 16
    lag_size: int = 128
    value_weight: float = 1.0

    scores_query_heads: ClassVar[bool] = False

    def __post_init__(self):
        super().__post_init__()
        check_int("sinks", self.sinks)
        check_int("lag_size", self.lag_size, 2)

    def score(self, call: AttentionCall):
        kv_heads, n, _ = call.key.shape
        lag, sinks = self.lag_size, min(self.sinks, n)
        scored = max(0, (n - sinks) // lag - 1)  # partitions with a next one to be judged against
        end = sinks + scored * lag
        scores = torch.empty(kv_heads, n, device=call.key.device)
        scores[:, :sinks] = math.inf
        tail = n - end
        scores[:, end:] = TAIL + torch.arange(1, tail + 1, device=scores.device) / (tail + 1)  # the most recent first
        if scored:
            span = slice(sinks, end + lag)
            lagged = (lag_scores(call.key[:, span].float(), lag)
                      + self.value_weight * lag_scores(call.value[:, span].float(), lag))
            # (kv_heads, scored, lag): 0 the worst of its partition
            rank = lagged.argsort(dim=-1).argsort(dim=-1).float()
            # a tie of ranks: the later partition
            later = torch.arange(scored, device=scores.device)[:, None] / (scored + 1)
            scores[:, sinks:end] = ((rank + later) / lag).reshape(kv_heads, -1)
        return scores


def lag_scores(states: torch.Tensor, lag: int) -> torch.Tensor:
    """(kv_heads, (p + 1) * lag, head_dim) keys or values -> (kv_heads, p, lag): each token of partitions 0..p-1,
    min-max normalised per channel by the next partition's range, as the softmax over its partition of the
    channels' standard deviation (LagKV's lag-relative score)."""
    parts = states.unflatten(1, (-1, lag))  # (kv_heads, p + 1, lag, head_dim)
    reference, judged = parts[:, 1:], parts[:, :-1]
    low, high = reference.amin(dim=2, keepdim=True), reference.amax(dim=2, keepdim=True)
    return ((judged - low) / (high - low)).std(dim=-1).softmax(dim=-1)
