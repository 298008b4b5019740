"""KNorm (Devoto et al. 2024, arXiv 2406.11430, "A Simple and Effective L2 Norm-Based Strategy for KV Cache
Compression"): keys with a low L2 norm draw high attention, so they are the ones kept."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .base import AttentionCall, Policy


@dataclass
class KNorm(Policy):
    """Keep the keys of lowest L2 norm, per KV head. Reads no attention (works with any attention kernel).

    score: (kv_heads, n_keys) = -||k_j||_2 of the post-RoPE keys (RoPE rotates pairs of dimensions, so it
    leaves the norm unchanged). No kept tail: as the paper and kvpress's KnormPress, every position competes, the last
    ones included; kept_tail=w keeps the last w tokens besides (our variant, named in the label).
    """

    kept_tail: int = 0

    scores_query_heads: ClassVar[bool] = False

    def score(self, call: AttentionCall):
        return -call.key.float().norm(dim=-1)
