"""DMS as kvpress runs it without its trained evictors (Łańcucki et al. 2025, arXiv 2506.05345, "Inference-Time
Hyper-Scaling with KV Cache Compression"): every position that has left a sliding window of recent tokens and scores
below a threshold is evicted, so each head keeps as many as its scores decide, not a budget."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ..core.checks import check_int
from .base import LayerBudget, Policy, top_positions
from .snapkv import SnapKV
from .wrapper import Wrapper


@dataclass
class DMS(Wrapper):
    """kvpress 0.5.5's DMSPress (dms_press.py:84-118), the dense-prefill version without the paper's trained eviction
    neurons (the faithful model is nvidia/Qwen3-8B-DMS-8x; NVIDIA/Model-Optimizer experimental/dms): `policy` scores
    the prompt, the last `sliding_window` positions are protected, and every earlier position whose score (the inner
    policy's ranking: pooled, GQA-reduced, as it ranks for its own budget) is below `threshold` is evicted, per KV head;
    the heads keep different counts (a head-wise layer, as AdaKV's). The prefill only: kvpress's decoding=True
    (eviction while decoding) is not written here.

    threshold: the score below which a position is evicted; always in the label. It lives on the inner policy's
        scale (SnapKV's: attention averaged over its window, about 1/n a position): kvpress has no default (its None
        fails at the first comparison) and the authors' trained evictors need none; ours, 1e-3, is the uniform
        share of a 1000-token prompt's attention, no published value.
    sliding_window: the recent positions never evicted (kvpress's sliding_window_size, 128). The inner policy's own
        kept tail stays protected too (kvpress pads SnapKV's window with the maximum score plus one).
    capacity: None (kvpress's): no cap, a head keeps every position above the threshold. An int or a ratio of the
        prompt caps the positions a head keeps outside the sliding window, the highest-scoring first (our variant,
        named in the label). Either way what the cache holds is the threshold's decision (`capacity_sets_entries`
        False): kv_share reports it, against the full cache.
    """

    policy: Policy = field(default_factory=SnapKV)
    capacity: int | float | None = None
    threshold: float = 1e-3
    sliding_window: int = 128

    capacity_sets_entries: ClassVar[bool] = False

    def __post_init__(self):
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) or \
                not math.isfinite(self.threshold):
            raise ValueError(f"threshold must be a finite number (the score below which DMS evicts), got "
                             f"{self.threshold!r}")
        check_int("sliding_window", self.sliding_window, 0)
        if self.per_query_head:
            raise NotImplementedError("DMS keeps one selection per KV head: per_query_head is not supported")
        super().__post_init__()

    def _settings(self) -> str:
        """The threshold always shows: it is DMS's budget."""
        settings = super()._settings()
        return settings if "threshold=" in settings else ", ".join(filter(None, [f"threshold={self.threshold!r}",
                                                                                  settings]))

    def budget(self, n_tokens: int) -> int | None:
        """Every position may stay: n, or None while the prompt is within the sliding window (kvpress evicts once its
        buffer exceeds the window, dms_press.py:93)."""
        return None if n_tokens <= self.sliding_window else n_tokens

    def cap(self, n_tokens: int) -> int | None:
        """The most positions a head keeps outside the sliding window (None: no cap)."""
        if self.capacity is None:
            return None
        return math.floor(self.capacity * n_tokens) if isinstance(self.capacity, float) else self.capacity

    def head_budgets(self, scores, budget: LayerBudget) -> list[int]:
        return self.above(scores, budget)[1]

    def above(self, scores: torch.Tensor, budget: LayerBudget) -> tuple[torch.Tensor, list[int]]:
        """(rows, n - sliding_window) the evictable positions' scores (+inf where the inner policy keeps its own tail)
        and per row how many it keeps: those at or above the threshold, at most `cap`."""
        n, prefix = budget.tokens, budget.tokens - self.sliding_window
        ranked = self.policy.ranked(scores, budget)
        evictable = ranked.new_full((ranked.shape[0], prefix), math.inf)
        shared = min(prefix, ranked.shape[-1])
        evictable[:, :shared] = ranked[:, :shared]
        counts = (evictable >= self.threshold).sum(-1).tolist()
        cap = self.cap(n)
        return evictable, counts if cap is None else [min(c, cap) for c in counts]

    def keep(self, scores: torch.Tensor, budget: LayerBudget) -> torch.Tensor:
        """(kv_heads, widest): each head's positions at or above the threshold (the highest `cap` of them), then the
        sliding window, NO_POSITION after a head's last."""
        evictable, counts = self.above(scores, budget)
        return top_positions(evictable, counts, budget.tokens)
