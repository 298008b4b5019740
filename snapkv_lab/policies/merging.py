"""Merging: evicted values folded into their most similar kept neighbour instead of dropped, over any scorer.

NVIDIA kvpress 0.5.5's MergingPress (kvpress/presses/merging_press.py), a method of kvpress's own ("inspired by"
Token Merging, Bolya et al., ICLR 2023, arXiv 2210.09461, and D2O, Wan et al. 2024, arXiv 2406.13035; no paper or
code of its own): kvpress is its official code, and our defaults are its. The inner policy chooses the kept positions
as it would to evict; then, per KV head, each evicted position e finds the kept position t whose key is the most
cosine-similar (post-RoPE keys, norms clamped at 1e-6: merging_press.py:137-140), and every kept value v_t that
receives any weight becomes

    v_t' = (v_t + sum_e w_e v_e) / (1 + sum_e w_e),   w_e = max(cos_e, 0) * ||v_e|| / (||v_e|| + ||v_t|| + 1e-6)

(:153-174; ||v_t|| the kept value's own norm before merging). similarity_threshold drops merges below that cosine
(:143); merge_fraction < 1 keeps only the most similar share of those that pass (the (1 - fraction) quantile over the
head's evicted positions, :145-151). Keys are never changed, so RoPE positions stay right. The cache then holds the
kept positions alone, the merged values among them (compression.engine.merged_values): the bytes of an eviction.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from .base import NO_POSITION, Policy
from .decoding import EvictsWhileDecoding
from .snapkv import SnapKV
from .wrapper import Wrapper, policy_chain

EPS = 1e-6  # merging_press.py's _EPS: the clamp of key norms, and the value-norm denominator's guard


@dataclass
class Merging(Wrapper):
    """`policy` (SnapKV by default) chooses what is kept; each evicted value is folded into the kept value of its most
    similar key (see module doc). similarity_threshold: in [0, 1], the least cosine that merges (kvpress's default
    0.0); merge_fraction: in (0, 1], the share of passing evicted positions, most similar first, that merge (1.0)."""

    keeps_inner_selection: ClassVar[bool] = True
    policy: Policy = field(default_factory=SnapKV)
    similarity_threshold: float = 0.0
    merge_fraction: float = 1.0

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.similarity_threshold <= 1.0:
            raise ValueError(f"similarity_threshold must lie in [0, 1], got {self.similarity_threshold!r}")
        if not 0.0 < self.merge_fraction <= 1.0:
            raise ValueError(f"merge_fraction must lie in (0, 1], got {self.merge_fraction!r}")
        if self.per_query_head:
            raise ValueError("Merging rewrites the values of KV heads: per_query_head=True is not supported")
        for inner in policy_chain(self.policy):
            if isinstance(inner, Merging):
                raise ValueError("Merging wraps a policy that merges already: its values would be merged twice")
            if isinstance(inner, EvictsWhileDecoding) and inner.interval is not None:
                raise ValueError(f"{inner.name} evicts while decoding (interval={inner.interval}), which Merging does "
                                 f"not merge: wrap {inner.name}(interval=None)")

    def merge(self, key: torch.Tensor, value: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        """key, value (kv_heads, n, head_dim), kept (kv_heads, k) positions (NO_POSITION padding) -> (kv_heads, n,
        head_dim) the values, the kept positions' merged (in float32, stored in value's dtype), the others as they
        were. Heads may keep different counts (AdaKV): each head merges over its own."""
        merged = value.clone()
        for head, row in enumerate(kept):
            held = row[row != NO_POSITION]
            evicted = torch.ones(key.shape[1], dtype=torch.bool, device=key.device)
            evicted[held] = False
            gone = evicted.nonzero().flatten()
            if not len(gone) or not len(held):
                continue
            unit = key[head].float()
            unit = unit / unit.norm(dim=-1, keepdim=True).clamp(min=EPS)
            similarity, target = (unit[gone] @ unit[held].T).max(dim=-1)  # (evicted,): the nearest kept key
            passes = similarity >= self.similarity_threshold
            if self.merge_fraction < 1.0 and passes.any():
                cut = similarity.masked_fill(~passes, float("-inf")).quantile(1.0 - self.merge_fraction)
                passes &= similarity >= cut
            values = value[head].float()
            kept_values, gone_values = values[held], values[gone]
            gone_norm = gone_values.norm(dim=-1)
            weight = similarity.clamp(min=0) * passes * gone_norm / (gone_norm + kept_values.norm(dim=-1)[target] + EPS)
            total = torch.zeros(len(held), device=key.device).index_add_(0, target, weight)
            added = torch.zeros_like(kept_values).index_add_(0, target, weight[:, None] * gone_values)
            folded = ((kept_values + added) / (1.0 + total)[:, None]).to(value.dtype)
            merged[head, held] = torch.where(total[:, None] > 0, folded, value[head, held])
        return merged
