"""ChunkKV (Liu et al. 2025, arXiv 2502.00299, "ChunkKV: Semantic-Preserving KV Cache Compression"): keep
whole chunks of consecutive tokens, ranked by the scores an inner policy gives their tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import with_window
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

    def keep(self, scores: torch.Tensor, n_tokens: int, kv_heads: int, layer: int, n_layers: int) -> torch.Tensor:
        prefix_len = n_tokens - self.window_size
        ranked = self.ranked(scores, prefix_len, kv_heads)  # (rows, prefix_len)
        position = torch.arange(prefix_len, device=ranked.device)
        chunk = position // self.chunk_size  # (prefix_len,) the chunk of each position
        sums = ranked.new_zeros(ranked.shape[0], int(chunk[-1]) + 1).index_add_(1, chunk, ranked)
        means = sums / torch.bincount(chunk).to(sums)  # (rows, n_chunks)
        rank = means.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)  # 0: the best chunk of its row
        # One integer per position, smaller first: its chunk's rank, then its place inside the chunk.
        order = rank[:, chunk] * self.chunk_size + position % self.chunk_size  # (rows, prefix_len), distinct per row
        k = self.layer_budget(n_tokens, layer, n_layers) - self.window_size
        picked = order.topk(k, dim=-1, largest=False).indices.sort(dim=-1).values
        return with_window(picked, prefix_len, n_tokens)
