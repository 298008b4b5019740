"""H2O (Zhang et al. 2023, arXiv 2306.14048): heavy hitters by accumulated attention, plus the recent tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..core.attention import attention_column_sums
from .base import AttentionCall, Policy
from .decoding import EvictsWhileDecoding


@dataclass
class H2O(EvictsWhileDecoding, Policy):
    """Heavy-Hitter Oracle, as its paper and code define it (FMInference/H2O, h2o_hf/utils_real_drop/modify_llama.py,
    H2OKVCache_LayerWise): each position's score is the attention all queries so far paid it, summed (the prompt's
    queries at prefill, then every generated one: the running score is never reset); the cache keeps the heavy
    hitters, the top half of the budget by score, and the recent half, the last tokens; at every decode step (interval
    1) the layer is cut back to the budget, so it never holds more than budget + 1.

    kept_tail: None (default) splits the budget in halves as the paper (heavy_ratio = recent_ratio); an int
    keeps that many recent tokens and gives the rest to heavy hitters. interval: decode steps between evictions;
    None compresses once, after prefill (kvpress's protocol for prefill-only presses).
    Scores are per query head and averaged over each KV head's query heads (the paper's models have no GQA).
    Costs one extra pass of attention over the prompt (every prompt query's row).
    """

    kept_tail: int | None = None
    interval: int | None = 1

    accumulates: ClassVar[bool] = True

    def __post_init__(self):
        super().__post_init__()
        self.check_interval()

    def tail(self, budget: int) -> int:
        return budget - budget // 2 if self.kept_tail is None else self.kept_tail

    def score(self, call: AttentionCall):
        return attention_column_sums(call.query, call.key, call.attention.scaling, call.slots,
                                     **call.attention.options())

