"""DuoAttention's head split over any scorer: the allocation of DuoAttention (Xiao et al. 2024, arXiv 2410.10819)
without its positions (sinks and recent tokens), so that allocation and scoring can be compared apart.

The split is DuoAttention's own (policies.duoattention, computed by a DuoAttention of the same budget): the
floor(L K (B - s) / (n - s)) KV heads with the best retrieval scores keep the whole prompt, every other head keeps
s = min(sink_size + recent_size, B) positions, so the cache holds at most the uniform total L K B (less than one
head's share of it unspent: 2% of a 4k prompt's cache at ratio 0.5 on SmolLM2's 90 KV heads). hold_total=True (our
variant, named in the label) spreads that remainder over the streaming heads, a position more for the first ones in
(layer, head) order where it does not divide, so the cache holds exactly the uniform total: the budget-matched
comparison. What differs from DuoAttention: a streaming head's s positions are its kept tail and the
inner scorer's top s - tail prefix positions, not the first sink_size and the last recent_size tokens.
DuoAllocation(policy=StreamingLLM(sinks=128, kept_tail=0)) keeps what DuoAttention() keeps wherever sink_size and
recent_size fit the budget (recency is StreamingLLM's order after its sinks).

The retrieval scores are Wu et al.'s, measured on the model at the first prefill (`retrieval_heads`), as
DuoAttention's and HeadKV's here; the official DuoAttention learns its gates by optimisation instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import LayerBudget
from .duoattention import DuoAttention
from .wrapper import Wrapper, refuse_own_allocation


@dataclass
class DuoAllocation(Wrapper):
    """Full cache for the KV heads with the best retrieval scores, s positions by `policy`'s ranking (SnapKV by
    default) in the others (module doc); sink_size and recent_size only size s, as DuoAttention's."""

    sink_size: int = 128
    recent_size: int = 256
    hold_total: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.per_query_head:
            raise ValueError("DuoAllocation splits KV heads: per_query_head=True is not supported")
        refuse_own_allocation(self, "gives each head the whole prompt or s positions", "DuoAllocation(SnapKV)")
        # the split itself: DuoAttention's, at this budget (it checks sink_size and recent_size)
        self._split = DuoAttention(capacity=self.capacity, sink_size=self.sink_size, recent_size=self.recent_size)

    def prepare(self, model, tokenizer) -> None:
        super().prepare(model, tokenizer)
        self._split.prepare(model, tokenizer)

    def head_budgets(self, scores, budget: LayerBudget) -> list[int]:
        """The whole prefix in the full heads; s (under hold_total, the streaming heads' even share of what the full
        heads leave) less the kept tail, none below 0, in the streaming ones."""
        n, split = budget.tokens, self._split
        full = split.full_head_mask(n)  # (layers, KV heads)
        streaming = torch.full(full.shape, split.streaming_budget(n))
        if self.hold_total:
            open_ = split.sharing_heads() & ~full  # the streaming heads of the compressed layers
            left = int(split.sharing_heads().sum()) * split.budget(n) - int(full.sum()) * n
            share, extra = divmod(left, int(open_.sum()))
            streaming = share + (open_ & (open_.flatten().cumsum(0).view(full.shape) <= extra)).long()
        prefix = self.prefix_len(budget)
        kept = (streaming[budget.layer] - (n - prefix)).clamp(min=0).tolist()
        return [prefix if is_full else k for is_full, k in zip(full[budget.layer].tolist(), kept, strict=True)]
