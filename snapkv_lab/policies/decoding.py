"""Compression while decoding: long generations (reasoning-style answers) outgrow any prefill budget.

`DecodingEviction(policy, interval, target)` compresses the prompt with `policy` at prefill, then every
`interval` decode steps cuts each full-attention layer back to `target` positions per KV head (default:
the capacity), keeping the last `window_size` tokens and the rest by the policy's scores over the cache:

- accumulating policies (H2O) add up, step by step, the attention every generated token pays to each
  cached position, as in H2O's paper (the accumulation starts at zero after prefill; the prompt
  positions still held got there by their prefill scores);
- the others score the cache with the last `window_size` generated queries as the voters (SnapKV's
  observation window, moved to the end of the generation), so `interval` must be >= window_size.

After eviction the cache holds prompt and generated positions; `kept_indices` lists the token positions
held at the end of the run, `cache_lengths` still the lengths right after prefill.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from ..selection import votes_per_kv_head
from .base import AttentionCall, Policy
from .h2o import H2O
from .wrapper import Wrapper


@dataclass
class DecodingEviction(Wrapper):
    """`policy` at prefill (H2O by default), then every `interval` decode steps each layer evicted down to `target`."""

    policy: Policy = field(default_factory=H2O)
    interval: int = 16
    target: int | None = None  # positions per KV head after each eviction; None: the capacity (a ratio: of the prompt)

    def __post_init__(self):
        super().__post_init__()
        if self.per_query_head:
            raise NotImplementedError("DecodingEviction keeps one selection per KV head: per_query_head is not supported")
        if not isinstance(self.interval, int) or self.interval < 1:
            raise ValueError(f"interval must be a positive int, got {self.interval!r}")
        if not self.policy.accumulates and self.interval < self.window_size:
            raise ValueError(f"{self.policy.name} votes with the last window_size ({self.window_size}) generated queries: "
                             f"interval ({self.interval}) must be at least that")
        if self.target is not None and self.target <= self.window_size:
            raise ValueError(f"target ({self.target}) must exceed window_size ({self.window_size})")

    def keep(self, scores, n_tokens, kv_heads, layer, n_layers):
        return self.policy.keep(scores, n_tokens, kv_heads, layer, n_layers)

    def tracker(self, layer: int, n_layers: int, n_prompt: int) -> EvictionTracker | None:
        """A fresh per-layer tracker for a run after an n_prompt-token prompt (the compressor holds one per
        layer), or None when nothing is to be evicted (no capacity and no target)."""
        target = self.target
        if target is None and self.capacity is not None:
            target = self.capacity if isinstance(self.capacity, int) else max(self.window_size + 1, int(self.capacity * n_prompt))
        if target is None:
            return None
        return EvictionTracker(dataclasses.replace(self.policy, capacity=target), self.interval, layer, n_layers)


@dataclass
class EvictionTracker:
    """One layer's decode-time state: the policy's running scores (or voters) and the steps since eviction."""

    policy: Policy  # capacity = the target
    interval: int
    layer: int
    n_layers: int
    steps: int = 0
    scores: list = field(default_factory=list)  # per batch row: (kv_heads, slots) accumulated attention
    voters: list = field(default_factory=list)  # per batch row: (heads, <= window_size, head_dim) recent queries

    def step(self, calls: list[AttentionCall]) -> torch.Tensor | None:
        """See one decode call (one AttentionCall per batch row, keys = every cached slot, the new tokens last);
        return the slots to keep (batch, kv_heads, target), or None between evictions."""
        self.steps += calls[0].query.shape[1]
        if self.policy.accumulates:
            for b, call in enumerate(calls):
                new = votes_per_kv_head(self.policy.score(call), call.key.shape[0])  # GQA mean
                old = self.scores[b] if b < len(self.scores) else torch.zeros_like(new[:, :0])
                total = torch.nn.functional.pad(old, (0, new.shape[-1] - old.shape[-1])) + new
                self.scores[b:b + 1] = [total]
        else:
            self.voters = [torch.cat([self.voters[b], c.query], 1)[:, -self.policy.window_size:] if b < len(self.voters)
                           else c.query[:, -self.policy.window_size:] for b, c in enumerate(calls)]
        n_slots = calls[0].n_keys
        if self.steps < self.interval or n_slots <= self.policy.capacity:
            return None
        self.steps = 0
        kept = []
        for b, call in enumerate(calls):
            if self.policy.accumulates:
                scores = self.scores[b]
            else:
                voters = self.voters[b]
                scores = self.policy.score(dataclasses.replace(call, query=voters, positions=torch.arange(n_slots - voters.shape[1], n_slots)))
            kept.append(self.policy.keep(scores, n_slots, call.key.shape[0], self.layer, self.n_layers))
        if self.policy.accumulates:
            self.scores = [s.gather(-1, k) for s, k in zip(self.scores, kept, strict=True)]
        return torch.stack(kept)

