"""Each chunk of the prompt compressed alone, over any scorer: kvpress 0.5.5's ChunkPress
(kvpress/presses/chunk_press.py:14-94, "based on FINCH", Corallo & Papotti 2024, TACL). No paper of its own.

kvpress tiles the keys from position 0 in chunks of `chunk_length` (1024), the last one shorter (:77), and for each
chunk calls its press's `score` on that chunk's hidden states, keys and values alone (:78-85): a chunk's scores
never see another chunk (SnapKV's window is the chunk's own last queries, over the chunk's keys, the window padded
to max + 1). Each chunk keeps its top max(1, int(L (1 - ratio))) positions per KV head (:86-88); so every part of
the prompt keeps the same share, where one selection over the prompt may take its whole budget from one region.

Ours, `PerChunk(policy, chunk_size=1024)`: the inner policy scores each chunk from an AttentionCall cut to that
chunk (its queries, keys, values; slots counted from the chunk's start), and its own pipeline (pooling, GQA
reduction, kept tail) keeps floor(B L / n) positions of a chunk of L tokens (B the layer's budget, n the prompt;
kvpress's int(L (1 - ratio)) where B = n (1 - ratio)), at least 1. Two cases kvpress leaves to chance are decided:
a chunk whose share is no larger than the inner policy's kept tail keeps its last `share` positions (kvpress's
SnapKV gives the whole window max + 1, and top-k breaks that tie as it will); a last chunk shorter than the inner
policy's voters (SnapKV's window), which cannot be scored alone, joins the chunk before it.

Not the lab's `prefill_chunk` (compression.compressor): there the prompt is *fed* in chunks and the cache cut back
to the whole budget after each, every chunk's queries attending to what is held of the earlier ones, and the held
positions competing again; here one prefill, every chunk scored on its own keys and held to its own share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..core.checks import check_int
from .base import AttentionCall, LayerBudget, whole_prompt
from .wrapper import Wrapper, refuse_own_allocation


@dataclass
class PerChunk(Wrapper):
    """The prompt tiled in chunks of `chunk_size` tokens from position 0, each scored and kept alone by `policy`
    (SnapKV by default) at its share of the budget."""

    chunk_size: int = 1024  # kvpress's chunk_length default (chunk_press.py:35)

    def __post_init__(self):
        super().__post_init__()
        check_int("chunk_size", self.chunk_size, 1)
        if self.policy.needs:
            raise TypeError(f"PerChunk scores each chunk from its own attention call, and {self.policy.name} scores "
                            "after the prefill (its `needs`): it cannot be wrapped")
        refuse_own_allocation(self, "gives each chunk its share of a uniform budget", "PerChunk(SnapKV)")
        if self.chunk_size < self.policy.voters:
            raise ValueError(f"chunk_size ({self.chunk_size}) must hold {self.policy.name}'s {self.policy.voters} "
                             "voting queries: each chunk is scored by its own")

    @property
    def voters(self) -> int:
        return 0  # every query of the prompt: each chunk votes with its own

    @property
    def scoring_key(self) -> str:
        return f"PerChunk({self.chunk_size})[{self.policy.scoring_key}]"  # the inner scores, chunk by chunk

    def tail(self, budget: int) -> int:
        return 0  # every chunk keeps its own tail, inside its share (ranked)

    def bounds(self, n_tokens: int) -> list[tuple[int, int]]:
        """(start, end) of each chunk of an n-token prompt: tiles of chunk_size from 0, a last one shorter than the
        inner policy's voters joined to the one before it."""
        starts = list(range(0, n_tokens, self.chunk_size))
        if len(starts) > 1 and n_tokens - starts[-1] < self.policy.voters:
            starts.pop()
        return list(zip(starts, [*starts[1:], n_tokens], strict=True))

    def score(self, call: AttentionCall) -> torch.Tensor:
        whole_prompt(call, self.name)
        chunks = [self.policy.score(AttentionCall(
            call.query[:, start:end], call.key[:, start:end], call.value[:, start:end], call.slots[start:end] - start,
            call.attention, call.module, call.layer, call.n_layers, call.positions[start:end]))
            for start, end in self.bounds(call.n_keys)]
        rows = max(chunk.shape[0] for chunk in chunks)  # a scorer may give one row for every head
        return torch.cat([chunk.expand(rows, -1) for chunk in chunks], dim=-1)

    def kept_mask(self, scores: torch.Tensor, budget: LayerBudget) -> torch.Tensor:
        """(rows, n) bool: the positions each row keeps, chunk by chunk (module doc)."""
        capacity = self.policy.layer_budget(budget)
        masks = []
        for start, end in self.bounds(budget.tokens):
            length = end - start
            share = max(1, capacity * length // budget.tokens)
            at = LayerBudget(length, budget.kv_heads, budget.layer, budget.n_layers, share)
            if share >= length:
                kept = torch.arange(length).expand(self.ranked_rows(scores, budget), -1)
            elif share <= self.policy.tail(share):
                kept = torch.arange(length - share, length).expand(self.ranked_rows(scores, budget), -1)
            else:
                kept = self.policy.keep(scores[:, start:end], at)
            mask = torch.zeros(kept.shape[0], length, dtype=torch.bool, device=scores.device)
            masks.append(mask.scatter(1, kept.clamp(min=0).to(scores.device), kept.to(scores.device) >= 0))
        return torch.cat(masks, dim=-1)

    def ranked(self, scores, budget: LayerBudget) -> torch.Tensor:
        """+inf where a chunk keeps a position, -inf elsewhere: (rows, n), every position ranked (no common tail)."""
        kept = self.kept_mask(scores, budget)
        return torch.full(kept.shape, -math.inf, device=kept.device).masked_fill(kept, math.inf)

    def head_budgets(self, scores, budget: LayerBudget) -> list[int]:
        return self.kept_mask(scores, budget).sum(-1).tolist()
