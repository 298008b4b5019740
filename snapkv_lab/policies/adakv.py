"""AdaKV (Feng et al. 2024, arXiv 2407.11550): head-wise adaptive budgets over any scorer.

Heads differ in how concentrated their attention is: a few positions serve a focused head, a diffuse one
needs many. AdaKV keeps a layer's total prefix budget kv_heads * (B - W) but lets the heads compete for it:
one top-k over all heads' scores together. A safeguard first grants each head its own top
floor(alpha * (B - W)) positions, so that no head is starved (alpha_safeguard = 0.2, as the paper's
Ada-SnapKV and kvpress). Heads then keep different counts: rows are padded with NO_POSITION and the
compressor stores the layer ragged (compression.layers.HeadwiseLayer), so the saving is real.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import NO_POSITION, with_window
from .wrapper import Wrapper


@dataclass
class AdaKV(Wrapper):
    """Head-adaptive budgets over `policy`'s scores (SnapKV by default), ranked as the policy's own keep ranks
    them (its pooling, the GQA mean). keep returns (kv_heads, widest) positions: each row the head's picked
    prefix positions (ascending), the window, then NO_POSITION padding.
    """

    alpha_safeguard: float = 0.20

    def __post_init__(self):
        super().__post_init__()
        if self.per_query_head:
            raise ValueError("AdaKV allocates among KV heads: per_query_head=True is not supported")
        if not 0 <= self.alpha_safeguard <= 1:
            raise ValueError(f"alpha_safeguard must lie in [0, 1], got {self.alpha_safeguard!r}")

    def keep(self, scores: torch.Tensor, n_tokens: int, kv_heads: int, layer: int, n_layers: int) -> torch.Tensor:
        prefix_len = n_tokens - self.window_size
        per_head = self.layer_budget(n_tokens, layer, n_layers) - self.window_size  # the uniform share
        pooled = self.ranked(scores, prefix_len, kv_heads)  # (kv_heads, prefix_len)
        # Safeguard: every head's own top alpha * share are taken before the heads compete.
        safe = pooled.topk(int(self.alpha_safeguard * per_head), dim=-1).indices
        pooled = pooled.scatter(-1, safe, float("inf"))
        chosen = pooled.flatten().topk(kv_heads * per_head).indices  # one top-k over all heads together
        picked = torch.zeros(kv_heads * prefix_len, dtype=torch.bool, device=scores.device)
        picked[chosen] = True
        rows = [row.nonzero().flatten() for row in picked.view(kv_heads, prefix_len)]  # ascending per head
        widest = max(len(row) for row in rows)
        return torch.stack([torch.cat([with_window(row[None], prefix_len, n_tokens)[0],
                                       row.new_full((widest - len(row),), NO_POSITION)]) for row in rows])
