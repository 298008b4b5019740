"""TOVA (Oren et al. 2024, arXiv 2401.06104, "Transformers are Multi-State RNNs"): keep what the last token attends
to."""

from __future__ import annotations

from dataclasses import dataclass

from ..core.attention import attention_column_sums
from .base import AttentionCall, Policy
from .decoding import EvictsWhileDecoding


@dataclass
class TOVA(EvictsWhileDecoding, Policy):
    """Token Omission Via Attention, as its paper and code define it (schwartz-lab-NLP/TOVA, src/tova_cache.py,
    TOVACache.reduce): a position's score is the last query's softmax attention to it, averaged over all the layer's
    query heads, so one selection serves every KV head of the layer; the top `capacity` positions are kept, the
    last token competing like any other (no kept tail), at prefill and again at every decode step (interval 1).

    score: (heads, n_keys), the last query's probabilities over every key it sees (itself included, under the layer's
    own scaling, sliding window and soft-cap).
    Variants, named in the label: per_layer=False averages per GQA group instead, one selection per KV head;
    kept_tail=1 protects the last token (kvpress's TOVAPress); interval=None compresses once, after prefill
    (kvpress's protocol).
    """

    kept_tail: int = 0
    per_layer: bool = True
    interval: int | None = 1

    def __post_init__(self):
        super().__post_init__()
        if self.per_layer and self.per_query_head:
            raise ValueError("TOVA(per_layer=True) keeps one selection per layer: per_query_head=True contradicts it")
        self.check_interval()

    @property
    def voters(self) -> int:
        return 1

    def score(self, call: AttentionCall):
        scores = attention_column_sums(call.query[:, -1:], call.key, call.attention.scaling, call.slots[-1:],
                                       **call.attention.options())
        return scores.mean(0, keepdim=True).expand_as(scores) if self.per_layer else scores
