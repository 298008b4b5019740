"""What policies that wrap another policy's scorer share (ChunkKV, CriticalKV, AdaKV, DecodingEviction).

The wrapper's budget is the one that counts: its capacity, window_size and per_query_head are copied onto
the inner policy (SnapKV's observation window is then the kept window, as in SnapKV alone). The inner
policy's pooling, kernel_size and gqa stay its own: `ranked` applies them as the inner `keep` would.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from ..selection import pool_votes, votes_per_kv_head
from .base import AttentionCall, Policy
from .snapkv import SnapKV

SHARED = ("capacity", "window_size", "per_query_head")  # set on the inner policy by the wrapper


@dataclass
class Wrapper(Policy):
    """Base of wrappers: `policy` scores, the subclass decides what is kept from its ranking."""

    policy: Policy = field(default_factory=SnapKV)

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.policy, Policy) or isinstance(self.policy, Wrapper):
            raise TypeError(f"{self.name} wraps a scoring policy (SnapKV, H2O, TOVA, ...), got {self.policy!r}")
        if self.policy.extra_passes:
            raise ValueError(f"{self.name} cannot wrap {self.policy.name}, which scores with extra forward passes")
        if self.pooling is not None or self.kernel_size != 1 or self.gqa != "mean":
            raise ValueError(f"{self.name} ranks positions by its inner policy's pooling and GQA reduction: set them on "
                             f"the inner policy ({self.policy.name}(pooling=..., gqa=...)), not on {self.name}")
        self.policy = dataclasses.replace(self.policy, **{name: getattr(self, name) for name in SHARED})

    @property
    def accumulates(self) -> bool:  # scores of prompt chunks add up exactly when the inner ones do
        return self.policy.accumulates

    def score(self, call: AttentionCall):
        return self.policy.score(call)

    def layer_budget(self, n_tokens: int, layer: int, n_layers: int) -> int:
        return self.policy.layer_budget(n_tokens, layer, n_layers)  # same capacity: a per-layer budget carries over

    def _inner_settings(self) -> str:
        """The inner policy by the settings the wrapper does not set for it, e.g. `SnapKV(kernel_size=5)`."""
        inner = self.policy
        settings = ", ".join(inner._differences(type(inner)(**{name: getattr(inner, name) for name in SHARED}), SHARED))
        return f"{inner.name}({settings})" if settings else inner.name

    def _settings(self) -> str:
        default = type(self)()
        parts = [f"policy={self._inner_settings()}"] if type(self.policy) is not type(default.policy) or \
            self._inner_settings() != default._inner_settings() else []
        parts += self._differences(default, skip=("capacity", "policy"))
        return ", ".join(parts)

    def ranked(self, scores: torch.Tensor, prefix_len: int, kv_heads: int) -> torch.Tensor:
        """The inner policy's scores (heads or kv_heads, n) of the prefix as its `keep` ranks them: pooled along
        positions, then combined over each KV head's query heads (its `gqa`) unless per_query_head: (rows, prefix_len)."""
        pooled = pool_votes(scores[:, :prefix_len], self.policy.pooling, self.policy.kernel_size)
        rows = self.policy._reduce_to(pooled, kv_heads)
        return pooled if rows is None else votes_per_kv_head(pooled, rows, self.policy.gqa)
