"""ChunkKV (Liu et al. 2025, arXiv 2502.00299, "ChunkKV: Semantic-Preserving KV Cache Compression"): keep
whole chunks of consecutive tokens, ranked by the scores an inner policy gives their tokens.

No code of the authors' own was found beside kvpress's ChunkKVPress, which the paper's first author contributed
(kvpress PR #51): it is the reference here (kvpress 0.5.5, presses/chunkkv_press.py, ChunkKVPress.compress, lines
62-125). The prompt, observation window included, is cut into chunks of `chunk_size` tokens from position 0 (the last
one shorter); a chunk's score is the mean over its tokens of the inner scores summed over the KV heads, so one set of
chunks serves every head; the best max(1, int(n_chunks * B / n)) chunks are kept whole (B the budget), the kept tail's
chunks first (kvpress's inner SnapKV gives its window, the tail, the maximum score + 1; here +inf). Keeping whole chunks
keeps up to chunk_size - 1 positions fewer than B. Chunks of 10 tokens, the paper's setting (kvpress defaults to 20).

Variants, named in the label: per_head=True chooses chunks per KV head (each its own ranking); exact_budget=True cuts
the chunks over the prefix alone, the kept tail apart, and cuts the last chunk to fit, so every head keeps exactly B.
The paper's layer-wise index reuse is not applied.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..core.checks import check_int
from .base import LayerBudget, top_positions
from .wrapper import Wrapper


@dataclass
class ChunkKV(Wrapper):
    """Whole chunks by the mean of the inner policy's (pooled, GQA-reduced) scores of their tokens (see module doc)."""

    chunk_size: int = 10
    per_head: bool = False
    exact_budget: bool = False

    def __post_init__(self):
        super().__post_init__()
        check_int("chunk_size", self.chunk_size, 1)

    @property
    def keeps_by_ranking(self) -> bool:
        return True  # `ranked` is the chunk order: a wrapper ranking by it takes chunks best first

    def _chunk_order(self, ranked: torch.Tensor) -> torch.Tensor:
        """(rows, length) scores -> (rows, length) long, distinct per row: the order in which positions are taken,
        best chunk first (the mean of its scores; +inf ones first), positions inside a chunk in order."""
        rows = ranked if self.per_head else ranked.sum(0, keepdim=True).expand_as(ranked)
        length = rows.shape[-1]
        position = torch.arange(length, device=rows.device)
        chunk = position // self.chunk_size  # (length,) the chunk of each position
        sums = rows.new_zeros(rows.shape[0], int(chunk[-1]) + 1).index_add_(1, chunk, rows)
        means = sums / torch.bincount(chunk).to(sums)  # (rows, n_chunks)
        rank = means.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)  # 0: the best chunk of its row
        return rank[:, chunk] * self.chunk_size + position % self.chunk_size

    def ranked(self, scores, budget: LayerBudget) -> torch.Tensor:
        """(rows, prefix_len) the negated order of the prefix's positions by chunk (exact_budget's ranking, and what a
        wrapper around ChunkKV ranks by)."""
        return -self._chunk_order(self.policy.ranked(scores, budget)).float()

    def keep(self, scores: torch.Tensor, budget: LayerBudget) -> torch.Tensor:
        if self.exact_budget:
            return super().keep(scores, budget)
        n_tokens = budget.tokens
        inner = self.policy.ranked(scores, budget)  # (rows, prefix_len)
        whole = torch.cat([inner, inner.new_full((inner.shape[0], n_tokens - inner.shape[-1]), math.inf)], dim=-1)
        order = self._chunk_order(whole)  # (rows, n_tokens)
        n_chunks = -(-n_tokens // self.chunk_size)
        kept_chunks = max(1, n_chunks * self.layer_budget(budget) // n_tokens)
        taken = order < kept_chunks * self.chunk_size  # (rows, n_tokens): positions of the best kept_chunks chunks
        counts = taken.sum(-1).tolist()
        # Positions as scores, so that top_positions lists each row's taken ones (and pads rows that took fewer).
        ranked = torch.where(taken, -torch.arange(n_tokens, device=taken.device, dtype=torch.float32), -math.inf)
        return top_positions(ranked, counts, n_tokens)
