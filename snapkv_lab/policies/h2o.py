"""H2O (Zhang et al. 2023, arXiv 2306.14048): heavy hitters by accumulated attention."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..attention import attention_column_sums
from .base import AttentionCall, Policy


@dataclass
class H2O(Policy):
    """Heavy hitters: attention accumulated over all prompt queries, kept once after prefill. Costs one
    extra pass of attention over the prompt. Wrap it in `DecodingEviction` to evict while decoding too,
    as in the paper."""

    accumulates: ClassVar[bool] = True

    def score(self, call: AttentionCall):
        return attention_column_sums(call.query, call.key, call.attention.scaling, call.positions,
                                     **call.attention.options())
