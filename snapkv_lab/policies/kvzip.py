"""KVzip (Kim et al. 2025, arXiv 2505.23416): query-agnostic scores from reconstructing the context."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..attention import AttentionSettings, attention_column_max
from ..hooks import intercept_attention
from ..selection import votes_per_kv_head
from ..tokens import encode
from .base import Policy

REPEAT = "\n\nRepeat the previous context exactly.\n"


@dataclass
class KVzip(Policy):
    """After the context's prefill the model is asked to repeat the context and fed it again (teacher
    forcing) over a copy of the full cache; a position's score is the largest attention any reconstruction
    query pays it, over the queries and the query heads of its KV head. It needs no question, so one
    compressed context serves any. Cost: one extra forward over the context (plus the instruction), paid
    in selection_seconds; the reconstruction's keys double the cache while it runs."""

    extra_passes: ClassVar[int] = 1
    scores_query_heads: ClassVar[bool] = False  # the largest attention over each KV head's query heads

    def prompt_scores(self, model, tokenizer, ids: torch.Tensor, cache) -> dict[int, torch.Tensor]:
        """{layer: (batch, kv_heads, n)} for ids (batch, n) already prefilled into `cache` (left unchanged)."""
        from ..compression.layers import fork  # compression imports policies: import at call time

        n = ids.shape[1]
        instruction = torch.tensor(encode(tokenizer, REPEAT), device=ids.device).expand(ids.shape[0], -1)
        feed = torch.cat([instruction, ids], dim=1)
        scores: dict[int, torch.Tensor] = {}

        def record(module, query, key, value, attention_mask, **kwargs):
            settings = AttentionSettings.of_call(module, kwargs)
            if settings.sliding_window is not None:
                return  # never compressed
            positions = torch.arange(key.shape[2] - query.shape[2], key.shape[2])
            per_row = [attention_column_max(q, k, settings.scaling, positions, **settings.options())[:, :n]
                       for q, k in zip(query, key, strict=True)]  # each (heads, n)
            kv_heads = key.shape[1]
            scores[module.layer_idx] = torch.stack([votes_per_kv_head(s, kv_heads, "max") for s in per_row])

        positions = torch.arange(n, n + feed.shape[1], device=ids.device)[None]
        with intercept_attention(model, record):
            model(feed, past_key_values=fork(cache), position_ids=positions, use_cache=True, logits_to_keep=1)
        return scores
