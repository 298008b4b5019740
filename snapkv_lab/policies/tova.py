"""TOVA (Oren et al. 2024, arXiv 2401.06104, "Transformers are Multi-State RNNs"): keep what the last token attends to."""

from __future__ import annotations

from dataclasses import dataclass

from ..attention import attention_column_sums
from .base import AttentionCall, Policy


@dataclass
class TOVA(Policy):
    """Token Omission Via Attention: scores are the softmax attention of the last prompt query alone.

    score: (heads, n_keys), the last query's probabilities over every key it sees (itself included, under the
    layer's own scaling, sliding window and soft-cap); `keep` averages them over each KV head's query heads.

    Differences from the paper and kvpress: TOVA evicts one token per decoding step and keeps no window;
    here it scores once after prefill (as kvpress's TOVAPress does), and keeps `window_size` last tokens
    (default 1: the last token, which kvpress also forces in). kvpress averages over *all* query heads and
    keeps one selection per layer; here the heads are averaged per KV head group, one selection per KV
    head (the paper's per-layer choice is the special case of one KV head).
    """

    window_size: int = 1

    def score(self, call: AttentionCall):
        last = call.positions[-1:]  # (1,) the last prompt token's position: the only voter
        return attention_column_sums(call.query[:, -1:], call.key, call.attention.scaling, last,
                                     **call.attention.options())
