"""SnapKV (Li et al. 2024, arXiv 2404.14469): the observation window votes for the prefix positions to keep."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..core.checks import check_int
from ..core.selection import window_votes
from .base import ADDED_LATER, AttentionCall, Policy


@dataclass
class SnapKV(Policy):
    """SnapKV: votes of the last `window_size` prompt queries over the prefix, max-pooled (kernel 7).

    window_size: the observation window, the last prompt queries that vote (the authors' name and their LongBench
        value, 32). kept_tail: None (default) keeps the window itself, as the paper and its code do; an int keeps
        that many last tokens instead (our variant, named in the label).
    score: (heads, n_keys) the window's attention averaged over its queries (the paper sums them: the same ranking;
    the mean is the scale of kvpress's and the AdaKV/CriticalKV authors' SnapKV, on which CriticalKV's epsilon is
    set)."""

    # Left out of stored configs at None: before it existed, `window_size` named the voters and the kept tail both.
    kept_tail: int | None = field(default=None, metadata={ADDED_LATER: True})
    pooling: str | None = "max"
    kernel_size: int = 7
    window_size: int = 32

    def __post_init__(self):
        check_int("window_size", self.window_size, 1, kind="at least 1",
                  why=f" ({self.name} votes with its observation window)")
        super().__post_init__()

    def tail(self, budget: int) -> int:
        return self.window_size if self.kept_tail is None else self.kept_tail

    def tail_setting(self, budget: int) -> str:
        return f"window_size ({self.window_size})" if self.kept_tail is None else super().tail_setting(budget)

    @property
    def voters(self) -> int:
        return self.window_size

    def window_queries(self, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor]:
        """The observation window's queries (heads, window_size, head_dim) and their cache slots (window_size,)."""
        if call.query.shape[1] < self.window_size:
            raise ValueError(f"the last prompt chunk ({call.query.shape[1]} tokens) must hold the whole observation "
                             f"window ({self.window_size} tokens)")
        return call.query[:, -self.window_size:], call.slots[-self.window_size:]

    def score(self, call: AttentionCall):
        query, slots = self.window_queries(call)
        return window_votes(query, call.key, call.attention.scaling, slots, call.n_keys,
                            **call.attention.options()) / self.window_size


@dataclass
class SnapKVNoPooling(SnapKV):
    """SnapKV without pooling: the paper's ablation (keeps isolated high-vote tokens, fragments of facts)."""

    pooling: str | None = None
    kernel_size: int = 1


FACT_TOKENS = 31  # about one sentence of SmolLM2 tokens: the needle sentences are 20-25; odd, so pooling stays centred


@dataclass
class SnapKVFactKernel(SnapKV):
    """SnapKV with a pooling kernel as long as a fact sentence (31 tokens), so that a vote peak anywhere in a
    fact keeps all of it: the small-budget setting founded on the ablations (docs/pressure.md, "Why compression fails").

    Measured on SmolLM2-135M at 1024 of 4000 tokens, query-aware: SnapKV's votes peak on a few tokens of the
    needle; kernel 7 keeps fragments of its 7-digit value and the answer is a corrupted number. Whether a run
    retrieves the needle follows the share of the answer's needle-value attention its kept positions serve (AUC
    0.95), not its overall coverage (0.74); the kernel raises that share from 0.68 (kernel 7) to 0.98 (kernel
    31) while lowering overall coverage. Kernel 31 finds 15/15 dev and 10/10 held-out needles (default: 2/15).
    Query-agnostic it does not help: the context's last tokens do not vote for the needle at all.
    """

    kernel_size: int = FACT_TOKENS
