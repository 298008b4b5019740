"""KNorm (Devoto et al. 2024, arXiv 2406.11430, "A Simple and Effective L2 Norm-Based Strategy for KV Cache
Compression"): keys with a low L2 norm draw high attention, so they are the ones kept."""

from __future__ import annotations

from dataclasses import dataclass

from .base import AttentionCall, Policy


@dataclass
class KNorm(Policy):
    """Keep the keys of lowest L2 norm, per KV head. Reads no attention (works with any attention kernel).

    score: (kv_heads, n_keys) = -||k_j||_2 of the post-RoPE keys (RoPE rotates pairs of dimensions, so it
    leaves the norm unchanged). The window is kept as for every policy; the paper keeps none.
    """

    def score(self, call: AttentionCall):
        return -call.key.float().norm(dim=-1)
