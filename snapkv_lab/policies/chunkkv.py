"""ChunkKV (Liu et al. 2025, arXiv 2502.00299, "ChunkKV: Semantic-Preserving KV Cache Compression"): keep
whole chunks of consecutive tokens, ranked by the scores an inner policy gives their tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .wrapper import Wrapper


@dataclass
class ChunkKV(Wrapper):
    """The prefix cut into chunks of `chunk_size` tokens from position 0; chunks ranked by the mean of the inner
    policy's (pooled, GQA-reduced) scores of their tokens, kept best first until the budget, per KV head.

    Exact budget: the last chunk to fit is cut to its first positions, so every head keeps exactly
    budget - window_size prefix positions plus the window (the paper keeps floor(budget / chunk_size) whole
    chunks). The mean ranks full chunks as the paper's sum does, and lets a shorter last chunk compete fairly.
    Differences from kvpress's ChunkKVPress: one selection per KV head (kvpress sums the scores over heads
    and keeps the same chunks in every head); the window is kept apart, outside the chunks; the paper's
    layer-wise index reuse is not applied.
    """

    chunk_size: int = 10

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.chunk_size, int) or self.chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive int, got {self.chunk_size!r}")

    def ranked(self, scores, n_tokens, kv_heads, layer, n_layers) -> torch.Tensor:
        """(rows, prefix_len) float32, the negated order in which positions are kept: best chunk first (by the mean
        of the inner ranking over its tokens), then the positions inside a chunk in order; so the top k are the
        best whole chunks, the last one to fit cut to its first positions."""
        ranked = self.policy.ranked(scores, n_tokens, kv_heads, layer, n_layers)  # (rows, prefix_len)
        prefix_len = ranked.shape[-1]
        position = torch.arange(prefix_len, device=ranked.device)
        chunk = position // self.chunk_size  # (prefix_len,) the chunk of each position
        # Protected positions (+inf) make their chunk's mean +inf: it comes first, whole.
        sums = ranked.new_zeros(ranked.shape[0], int(chunk[-1]) + 1).index_add_(1, chunk, ranked)
        means = sums / torch.bincount(chunk).to(sums)  # (rows, n_chunks)
        rank = means.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)  # 0: the best chunk of its row
        order = rank[:, chunk] * self.chunk_size + position % self.chunk_size  # (rows, prefix_len), distinct per row
        return -order.float()
