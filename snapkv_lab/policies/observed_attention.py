"""Observed attention (NVIDIA kvpress's ObservedAttentionPress, "related to H2O", arXiv 2306.14048): keep the
positions the prompt's queries attended to most, on average over the queries that could see them.

Not H2O at prefill: H2O ranks by the attention summed over the queries (h2o.py), which favours early positions, seen
by more queries; this press divides each position's sum by the number of queries that see it, n - j for position j of
an n-token prompt (kvpress 0.5.5, presses/observed_attention_press.py, ObservedAttentionPress.score, lines 46-51), and
keeps no recent half: every position competes (ScorerPress.compress, scorer_press.py:95-98). So it is its own policy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.attention import attention_column_sums
from .base import AttentionCall, Policy


@dataclass
class ObservedAttention(Policy):
    """Each position's attention from every prompt query that sees it, averaged over those queries; the mean over each
    KV head's query heads ranks it (kvpress averages each GQA group, observed_attention_press.py:51).

    score: (heads, n_keys) = sum_i a_ij / #{i : i >= j}, i over the prompt's queries so far. A prompt fed in chunks
    (a context, then a question) keeps the running sums and counts (AttentionCall.carry), so its scores are those of
    one prefill of the whole. No kept tail (kvpress's, the defaults); kept_tail=w keeps the last w tokens besides (our
    variant, named in the label). Costs one extra pass of attention over the prompt (every prompt query's row).
    """

    kept_tail: int = 0

    def score(self, call: AttentionCall):
        sums = attention_column_sums(call.query, call.key, call.attention.scaling, call.slots,
                                     **call.attention.options())  # (heads, n_keys)
        seen = (call.slots[:, None] >= torch.arange(call.n_keys, device=call.slots.device)).sum(0)  # (n_keys,)
        held = call.carry.get("sums")
        if held is not None:
            if held.shape[-1] != call.n_keys - call.query.shape[1]:
                raise NotImplementedError(
                    f"{self.name} averages each position's attention over every query that saw it: a cache compacted "
                    "between prompt chunks no longer says which position each slot holds (feed the prompt whole, or "
                    "its chunks over a full cache: SharedPrefill.extend)")
            sums = sums + torch.nn.functional.pad(held, (0, call.n_keys - held.shape[-1]))
            seen = seen + torch.nn.functional.pad(call.carry["seen"], (0, call.n_keys - held.shape[-1]))
        call.carry.update(sums=sums, seen=seen)  # new tensors: forks of a prefill share the old ones
        return sums / seen.clamp(min=1)
