"""AdaKV (Feng et al. 2024, arXiv 2407.11550): head-wise adaptive budgets over any scorer.

Heads differ in how concentrated their attention is: a few positions serve a focused head, a diffuse one needs
many. AdaKV keeps a layer's total prefix budget kv_heads * b (b = B - W, the kept tail W outside it) but lets the heads
compete for it. The official code (FFY0/AdaKV, adaptive_snapkv/monkeypatch/snapkv_utils.py, lines 303-305 and
445-460) takes one top-k of kv_heads * b over all heads' scores together, counts each head's share c_h, and blends
it with a floor: head h keeps round((1 - alpha) c_h + floor(alpha b)) positions (alpha_safeguard = 0.2, its LongBench
scripts' floor_alpha), so that no head is starved. Heads then keep different counts: rows are padded with
NO_POSITION and the compressor stores the layer ragged (compression.layers.HeadwiseLayer), so the saving is real.

allocation="safeguard" is kvpress 0.5.5's rule instead (AdaKVPress.compress, adakv_press.py lines 64-80): each head's
own top int(alpha B) scores are taken first, counted over the whole budget B, kept tail included (kvpress's inner
scores give the tail the maximum, so the tail takes the first W of them: max(0, int(alpha B) - W) prefix
positions are protected), then the heads compete for the rest of kv_heads * b; a wrapper around it (CriticalKV, as
kvpress's CriticalAdaKV) keeps those safeguard positions first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .base import LayerBudget, prefix_share
from .wrapper import Wrapper

ALLOCATIONS = ("paper", "safeguard")


@dataclass
class AdaKV(Wrapper):
    """Head-adaptive budgets over `policy`'s ranking (SnapKV by default): its pooling, its GQA reduction. keep
    returns (kv_heads, widest) positions: each row the head's picked prefix positions (ascending), the kept tail, then
    NO_POSITION padding."""

    alpha_safeguard: float = 0.20
    allocation: str = "paper"

    def __post_init__(self):
        super().__post_init__()
        if self.per_query_head:
            raise ValueError("AdaKV allocates among KV heads: per_query_head=True is not supported")
        if not 0 <= self.alpha_safeguard <= 1:
            raise ValueError(f"alpha_safeguard must lie in [0, 1], got {self.alpha_safeguard!r}")
        if self.allocation not in ALLOCATIONS:
            raise ValueError(f"allocation must be one of {ALLOCATIONS}, got {self.allocation!r}")

    def _floor(self, scores, budget: LayerBudget) -> int:
        """The prefix positions a head is guaranteed: int(alpha * b), b the inner policy's (uniform) prefix budget per
        head (the official code); under allocation="safeguard", kvpress's int(alpha * B) less the kept tail W."""
        share = min(self.policy.head_budgets(scores, budget))
        if self.allocation == "paper":
            return int(self.alpha_safeguard * share)
        tail = self.policy.tail(self.policy.layer_budget(budget))
        return prefix_share(self.alpha_safeguard, share, tail)

    def ranked(self, scores, budget: LayerBudget) -> torch.Tensor:
        """The inner ranking; under allocation="safeguard", each head's own top floor(alpha b) positions raised to +inf
        (taken before the heads compete, and first by any wrapper around this one)."""
        ranked = self.policy.ranked(scores, budget)
        if self.allocation == "paper":
            return ranked
        safe = ranked.topk(self._floor(scores, budget), dim=-1).indices
        return ranked.scatter(-1, safe, math.inf)

    def head_budgets(self, scores, budget: LayerBudget) -> list[int]:
        """Each head's prefix budget: its count c_h in one top-k of the layer's total over all heads' rankings, under
        allocation="paper" blended as round((1 - alpha) c_h + floor(alpha b))."""
        ranked = self.ranked(scores, budget)  # (kv_heads, prefix)
        total = sum(self.policy.head_budgets(scores, budget))
        chosen = ranked.flatten().topk(total).indices // ranked.shape[-1]
        counts = torch.bincount(chosen, minlength=ranked.shape[0])
        if self.allocation == "safeguard":
            return counts.tolist()
        floor = self._floor(scores, budget)
        return torch.round(counts * (1 - self.alpha_safeguard) + floor).long().tolist()
