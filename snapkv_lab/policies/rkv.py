"""R-KV (Cai et al. 2025, arXiv 2505.24133, "Redundancy-aware KV Cache Compression for Reasoning Models"): keep what
the last queries attend to and what is not a near-copy of another key, evicting while decoding.

Reasoning models repeat themselves, so their caches hold many near-identical keys. The official code (Zefan-Cai/R-KV,
rkv/compression/r1_kv.py R1KV._compute_scores and update_kv, rkv/utils.py compute_attention_scores and
cal_similarity) scores each cached key k_j, per KV head, as

    attention  = maxpool_7( mean over the last W queries of softmax over the keys before them of max_g q.k / sqrt(d) )
                 (the logits of a KV head's query heads reduced by their max before the softmax)
    redundancy = softmax_j( mean_i cos'(k_i, k_j) )   cos' the keys' cosine similarity with the diagonal zeroed and,
                 in each row i, the entry of the last key j whose similarity passes 0.5 zeroed too (the latest copy
                 is spared)
    score      = lambda * attention - (1 - lambda) * redundancy      (lambda = 0.07)

and keeps the top budget - W keys plus the last W. Its defaults: W = 8, kernel 7, lambda 0.07, threshold 0.5,
retain_direction "last", and an eviction each time 128 more tokens have been decoded (`buffer`), back to the budget.

Here: the same scores (`score`), the prompt compressed at prefill as by every policy, then every `interval` (128)
decode steps each layer cut back to the budget with the last W generated queries as the voters (the lab's eviction
while decoding, as for H2O and TOVA). Differences, named: the official evicts once the cache holds budget + buffer
and the decoded count crosses a multiple of the buffer, so a prompt under the budget is not cut at the first
boundary here either, but the schedule counts decode steps from the prefill; the softmax uses the model's own
attention scaling (and soft-cap), where the official divides by sqrt(head_dim). The similarity is computed in blocks
of rows, never as one n x n matrix per head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from einops import rearrange

from ..core.attention import attention_logits
from .base import AttentionCall
from .decoding import EvictsWhileDecoding
from .snapkv import SnapKV

RETAIN_DIRECTIONS = ("last", "first")
ROW_BLOCK = 1024  # rows of the similarity matrix held at once


def redundancy(keys: torch.Tensor, threshold: float = 0.5, retain: str = "last") -> torch.Tensor:
    """(kv_heads, n, d) keys -> (kv_heads, n) float32: each key's redundancy, the softmax over keys of its mean cosine
    similarity to the others, each row sparing its last (or first) key above `threshold`."""
    unit = keys.float() / (keys.float().norm(dim=-1, keepdim=True) + 1e-8)
    n = keys.shape[1]
    columns = torch.zeros(keys.shape[0], n, dtype=torch.float32, device=keys.device)
    index = torch.arange(n, device=keys.device)
    for start in range(0, n, ROW_BLOCK):
        rows = slice(start, min(start + ROW_BLOCK, n))
        similarity = torch.einsum("hid,hjd->hij", unit[:, rows], unit)  # (kv_heads, block, n)
        similarity[:, index[rows] - start, index[rows]] = 0.0
        above = similarity > threshold
        if retain == "last":
            spared = torch.where(above, index, torch.zeros_like(index)).amax(-1)
        else:  # the official takes the minimum over the row, 0 wherever a key is not above the threshold
            spared = torch.where(above, index, torch.zeros_like(index)).amin(-1)
        similarity.scatter_(-1, spared.unsqueeze(-1), 0.0)
        columns += similarity.sum(1)
    return (columns / n).softmax(-1)


@dataclass
class RKV(EvictsWhileDecoding, SnapKV):
    """R-KV's scores and eviction while decoding (see module doc). window_size: the last queries that vote, kept as
    SnapKV keeps its window (8); kernel_size: the max-pooling of the attention before the redundancy is mixed in
    (7); mix_lambda: the attention's weight (0.07); threshold and retain_direction: the similarity above which a key
    counts as a copy, and which copy a row spares; interval: decode steps between evictions (the official buffer,
    128; None compresses once, after prefill).

    score: (kv_heads, n_keys) the final scores of the keys before the window (0 over the window, kept by right).
    """

    pooling: str | None = None  # the attention is pooled inside `score`, before the redundancy is subtracted
    kernel_size: int = 7
    window_size: int = 8
    mix_lambda: float = 0.07
    threshold: float = 0.5
    retain_direction: str = "last"
    interval: int | None = 128

    scores_query_heads: ClassVar[bool] = False

    def __post_init__(self):
        super().__post_init__()
        if self.pooling is not None:
            raise ValueError(f"{self.name} max-pools the attention inside its score (kernel_size), before the "
                             "redundancy is subtracted: pooling must stay None")
        if not 0 <= self.mix_lambda <= 1:
            raise ValueError(f"mix_lambda must lie in [0, 1], got {self.mix_lambda!r}")
        if self.retain_direction not in RETAIN_DIRECTIONS:
            raise ValueError(f"retain_direction must be one of {RETAIN_DIRECTIONS}, got {self.retain_direction!r}")
        self.check_interval()

    def score(self, call: AttentionCall):
        query, slots = self.window_queries(call)
        window, prefix = self.window_size, call.n_keys - self.window_size
        logits = attention_logits(query, call.key, call.attention.scaling, slots, last=prefix,
                                  **call.attention.options())  # (heads, W, prefix)
        kv_heads = call.key.shape[0]
        grouped = rearrange(logits, "(kv g) q k -> kv g q k", kv=kv_heads).amax(1)  # a KV head's max logit
        attention = F.max_pool1d(grouped.softmax(-1).mean(1), self.kernel_size, stride=1,
                                 padding=self.kernel_size // 2)  # (kv_heads, prefix)
        repeated = redundancy(call.key, self.threshold, self.retain_direction)[:, :prefix]
        final = self.mix_lambda * attention - (1 - self.mix_lambda) * repeated
        return torch.cat([final, final.new_zeros(kv_heads, window)], dim=-1)
