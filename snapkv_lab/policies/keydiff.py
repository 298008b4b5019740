"""KeyDiff (Park et al. 2025, arXiv 2504.15364, "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context
LLM Inference in Resource-Constrained Environments"): keys that point away from the average key are the ones
attention needs, so the cache keeps the most distinctive keys. Reads no attention weights, so it fits a
FlashAttention serving stack."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch.nn.functional as F

from .base import AttentionCall, Policy


@dataclass
class KeyDiff(Policy):
    """Keep the keys least similar to the anchor, the mean of the cache's unit-normalised keys, per KV head.

    score: (kv_heads, n_keys) = -cos(k_j, mean_i k_i / ||k_i||), post-RoPE keys of everything cached (kvpress 0.5.5
    presses/keydiff_press.py, lines 45-46). No kept tail and no sinks, as the paper: every position competes;
    kept_tail=w keeps the last w tokens besides (our variant, named in the label).

    The paper evicts block by block while the prompt is read (its "block prompt processing"): that is
    `generate(..., prefill_chunk=block)`, where each chunk's scores are taken over the slots held plus the chunk, so
    the anchor is the mean of what is cached at that moment, as in the paper. Without prefill_chunk the whole prompt
    is scored at once (kvpress's KeyDiffPress alone).
    """

    kept_tail: int = 0

    scores_query_heads: ClassVar[bool] = False

    def score(self, call: AttentionCall):
        keys = call.key.float()
        anchor = F.normalize(keys, dim=-1).mean(dim=1, keepdim=True)  # (kv_heads, 1, head_dim)
        return -F.cosine_similarity(keys, anchor, dim=-1)
