"""SnapKV (Li et al. 2024, arXiv 2404.14469): the observation window votes for the prefix positions to keep."""

from __future__ import annotations

from dataclasses import dataclass

from ..selection import window_votes
from .base import AttentionCall, Policy


@dataclass
class SnapKV(Policy):
    """SnapKV: votes of the last `window_size` prompt queries over the prefix, max-pooled (kernel 7)."""

    pooling: str | None = "max"
    kernel_size: int = 7

    def score(self, call: AttentionCall):
        if call.query.shape[1] < self.window_size:
            raise ValueError(f"the last prompt chunk ({call.query.shape[1]} tokens) must hold the whole observation "
                             f"window ({self.window_size} tokens)")
        return window_votes(call.query[:, -self.window_size:], call.key, call.attention.scaling,
                            call.positions[-self.window_size:], call.n_keys, **call.attention.options())


@dataclass
class SnapKVNoPooling(SnapKV):
    """SnapKV without pooling: the paper's ablation (keeps isolated high-vote tokens, fragments of facts)."""

    pooling: str | None = None
    kernel_size: int = 1
