"""EntropyGatedChunkKV (NVIDIA kvpress 0.5.5's own EntropyGatedChunkKVPress, "based on ChunkKV", arXiv 2502.00299):
ChunkKV keeps or drops whole chunks; a chunk whose score comes from one token spends a whole chunk of slots on it. This
variant measures how evenly each chunk's scores spread (their normalised entropy): an important but spiky chunk keeps
only its best few tokens, and the slots saved go to further chunks.

No paper or code beside kvpress: its press is the reference (presses/entropy_gated_chunkkv_press.py,
EntropyGatedChunkKVPress.compress, lines 71-160), its defaults ours: chunks of 10, spiky chunks cut to 4 tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..core.checks import check_int
from .base import LayerBudget
from .wrapper import Wrapper

EPSILON = 1e-8  # kvpress's, entropy_gated_chunkkv_press.py:12


@dataclass
class EntropyGatedChunkKV(Wrapper):
    """Chunks of the inner policy's scores, summed over the KV heads, taken best mean first, every head alike; a chunk
    at or above the median mean with an entropy below the median keeps its `low_entropy_chunk_size` best tokens only; a
    budget left after the chunks is filled by the best tokens left. Keeps exactly the budget (kvpress, :134-142).

    The inner scores are those kvpress's inner press gives: the kept tail (SnapKV's window) and protected positions
    (+inf: sinks) score the largest finite score + 1, as kvpress's presses pad their windows (snapkv_press.py:103), so
    that they weigh in a chunk's mean and entropy as there. Medians are torch.median's (the lower middle value), as
    kvpress's (:116-117). The tail is not kept by right: its chunks are taken first, a spiky one cut as any other.
    """

    chunk_size: int = 10
    low_entropy_chunk_size: int = 4

    def __post_init__(self):
        super().__post_init__()
        check_int("low_entropy_chunk_size", self.low_entropy_chunk_size, 1)
        if self.chunk_size <= self.low_entropy_chunk_size:
            raise ValueError(f"chunk_size ({self.chunk_size}) must exceed low_entropy_chunk_size "
                             f"({self.low_entropy_chunk_size}): a spiky chunk is cut to fewer tokens than a chunk")

    def keep(self, scores: torch.Tensor, budget: LayerBudget) -> torch.Tensor:
        inner = self.policy.ranked(scores, budget)  # (rows, prefix)
        rows, n = inner.shape[0], budget.tokens
        finite = inner[torch.isfinite(inner)]
        top = float(finite.max()) + 1 if finite.numel() else 1.0
        whole = torch.cat([inner, inner.new_full((rows, n - inner.shape[-1]), math.inf)], dim=-1)
        token = whole.masked_fill(whole == math.inf, top).sum(0)  # (n,): one score per position, every head's
        return self._gated(token, self.layer_budget(budget)).expand(rows, -1)

    def _gated(self, token: torch.Tensor, budget: int) -> torch.Tensor:
        """(n,) position scores, a budget -> (budget,) the kept positions, ascending."""
        n, size = token.shape[0], self.chunk_size
        bounds = [(start, min(start + size, n)) for start in range(0, n, size)]
        means, entropy = self._chunk_stats(token)
        high = (means >= means.median()).tolist()
        spiky = (entropy < entropy.median()).tolist()
        keep = torch.zeros(n, dtype=torch.bool, device=token.device)
        left = budget
        for chunk in torch.argsort(means, descending=True).tolist():
            if left <= 0:
                break
            a, b = bounds[chunk]
            take = min(b - a, left, self.low_entropy_chunk_size if high[chunk] and spiky[chunk] else b - a)
            keep[a + token[a:b].topk(take).indices if take < b - a else slice(a, b)] = True
            left -= take
        if left > 0:  # spiky chunks cut short may leave slots: the best positions not yet kept fill them
            rest = (~keep).nonzero().flatten()
            keep[rest[token[rest].topk(min(left, rest.numel())).indices]] = True
        return keep.nonzero().flatten()

    def _chunk_stats(self, token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(n,) position scores -> (n_chunks,) each chunk's mean score and the entropy of its scores as a distribution
        (shifted up to 0 where some are negative) over log(its length), in [0, 1]; 0 for a one-token last chunk
        (kvpress, :91-112): the whole chunks as rows of one view, the shorter last one apart."""
        size = self.chunk_size
        whole = token.shape[0] // size * size
        means, entropy = [], []
        for block in (token[:whole].view(-1, size), token[whole:].view(1, -1)):
            if block.numel() == 0:
                continue
            means.append(block.mean(dim=1))
            if block.shape[1] == 1:
                entropy.append(block.new_zeros(1))
                continue
            shifted = block - block.amin(dim=1, keepdim=True).clamp(max=0.0)
            p = shifted / (shifted.sum(dim=1, keepdim=True) + EPSILON)
            entropy.append((-(p * (p + EPSILON).log()).sum(dim=1) / math.log(block.shape[1])).clamp(0.0, 1.0))
        return torch.cat(means), torch.cat(entropy)
