"""Compression while decoding: long generations (reasoning-style answers) outgrow any prefill budget.

Three policies cut each full-attention layer back to a target while decoding, every `interval` decode steps:
H2O and TOVA as their papers define them (every step, the budget kept fixed), and `DecodingEviction(policy,
interval, target)`, kvpress's DecodingPress, around any other scorer. At each eviction the layer keeps `target`
positions per KV head, its kept tail's last positions and the rest by the scorer's scores over the cache:

- accumulating scorers (H2O) add up, step by step, the attention every generated token pays to each cached
  position, on top of what the prefill gave it (seeded from the prefill's scores, as H2O's code keeps one running
  score per position from the prompt on);
- the others score the cache with the queries generated since the last eviction as the voters (SnapKV takes the
  last `window_size` of them, TOVA the last one, ExpectedAttention their statistics), each at its own token position.

After eviction the cache holds prompt and generated positions; `kept_indices` lists the token positions held at
the end of the run, `cache_lengths` still the lengths right after prefill.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from ..core.attention import attention_column_sums
from ..core.checks import check_int
from ..core.selection import votes_per_kv_head
from .base import ADDED_LATER, AttentionCall, LayerBudget, Policy, top_positions
from .decoding_merge import merge_into_next_kept
from .snapkv import SnapKV
from .wrapper import Wrapper, refuse_own_allocation

MERGE_BUDGET = 32  # kvpress's CAMPress merge_budget (cam_press.py:65)


class EvictsWhileDecoding:
    """What a policy that evicts while decoding tells the compressor (mixed into H2O, TOVA, DecodingEviction)."""

    interval: int | None  # decode steps between evictions; None: compress once, after prefill

    def eviction_scorer(self) -> Policy:
        """The policy whose scores rank the cache at each eviction."""
        return self

    def eviction_target(self, n_prompt: int) -> int | None:
        """Positions per KV head after each eviction: the budget (a capacity ratio: of the prompt)."""
        if self.capacity is None:
            return None
        return self.capacity if isinstance(self.capacity, int) else int(self.capacity * n_prompt)

    def eviction_ratio(self) -> float | None:
        """The share of the tokens seen so far that each eviction keeps, where the target grows with them; None: the
        fixed `eviction_target`."""
        return None

    def check_interval(self) -> None:
        if self.interval is None:
            return
        check_int("interval", self.interval, 1, optional=True)
        scorer = self.eviction_scorer()
        if self.interval < scorer.voters:
            raise ValueError(f"{scorer.name} votes with the last {scorer.voters} generated queries: interval "
                             f"({self.interval}) must be at least that")

    def tracker(self, layer: int, n_layers: int, n_prompt: int, seeds: torch.Tensor | None) -> EvictionTracker | None:
        """A fresh per-layer tracker for a run after an n_prompt-token prompt, or None when nothing is evicted.
        seeds: (batch, kv_heads, slots) the accumulated prefill scores of the slots held (accumulating scorers)."""
        target = self.eviction_target(n_prompt)
        if self.interval is None or target is None:
            return None
        scorer = dataclasses.replace(self.eviction_scorer(), capacity=target)
        return EvictionTracker(scorer, self.interval, layer, n_layers, scores=list(seeds) if seeds is not None else [],
                               ratio=self.eviction_ratio())


def seeded(policy: Policy) -> bool:
    """Whether `policy` evicts while decoding by accumulated scores, which go on from the prefill's (H2O)."""
    return (isinstance(policy, EvictsWhileDecoding) and policy.interval is not None
            and policy.eviction_scorer().accumulates)


def prefill_seeds(scores: list[torch.Tensor], held: torch.Tensor) -> torch.Tensor:
    """(batch, kv_heads, k) the prefill scores per KV head (the GQA mean) of the positions `held` (batch, kv_heads, k),
    for a `seeded` policy. scores: per batch row (rows, n)."""
    kv_heads = held.shape[1]
    return torch.stack([(s if s.shape[0] == kv_heads else votes_per_kv_head(s, kv_heads)).gather(-1, k)
                        for s, k in zip(scores, held, strict=True)])


@dataclass
class DecodingEviction(EvictsWhileDecoding, Wrapper):
    """`policy` at prefill (SnapKV by default), then every `interval` decode steps each layer cut back to `target`
    positions per KV head by `policy`'s scores over the cache: kvpress's DecodingPress after the same scorer at
    prefill, as its PrefillDecodingPress pairs them (DecodingPress alone leaves the prompt whole, which under a
    compression ratio would be the full cache until the first eviction). Until `interval` tokens are generated it
    answers as `policy`. merging="cam" is kvpress's CAMPress (policies.decoding_merge): one kept set for every KV head,
    the best-scored evicted values merged into the kept ones after them instead of dropped."""

    policy: Policy = field(default_factory=SnapKV)
    interval: int = 32
    target: int | None = None  # positions per KV head after each eviction; None: the capacity (a ratio: of the prompt)
    # The share of the tokens seen so far (prompt and generated) each eviction keeps, floor(seen * target_ratio), as
    # kvpress's CompressionRatioDecodingPress (1 - its target_compression_ratio); None: the fixed target above.
    target_ratio: float | None = field(default=None, metadata={ADDED_LATER: True})
    # "cam": kvpress's CAMPress (policies.decoding_merge): one kept set for all KV heads, and the best-scored evicted
    # values merged into the `merge_budget` kept positions after them, by the attention summed over decode calls;
    # None: evicted values are dropped (DecodingPress). Not named `merge`, which is Policy's prefill merge hook.
    merging: str | None = field(default=None, metadata={ADDED_LATER: True})
    merge_budget: int = field(default=MERGE_BUDGET, metadata={ADDED_LATER: True})

    def __post_init__(self):
        super().__post_init__()
        if self.per_query_head:
            raise NotImplementedError("DecodingEviction keeps one selection per KV head: per_query_head is not "
                                      "supported")
        if isinstance(self.policy, EvictsWhileDecoding) and self.policy.interval is not None:
            raise ValueError(f"{self.policy.name} evicts while decoding itself (interval={self.policy.interval}): "
                             f"set its interval, or wrap {self.policy.name}(interval=None)")
        if self.interval is None:
            raise ValueError("DecodingEviction needs an interval (use the inner policy alone to compress once)")
        self.check_interval()
        tail = self.tail(self.target) if self.target is not None else None
        if self.target is not None and self.target <= tail:
            raise ValueError(f"target ({self.target}) must exceed the kept tail ({tail})")
        if self.target_ratio is not None:
            if self.target is not None:
                raise ValueError("give target (a fixed size) or target_ratio (a share of the tokens seen), not both")
            if not 0 < self.target_ratio < 1:
                raise ValueError(f"target_ratio must lie in (0, 1), got {self.target_ratio!r}")
        if self.merging not in (None, "cam"):
            raise ValueError(f"merging must be None (evict) or 'cam' (kvpress's CAMPress), got {self.merging!r}")
        check_int("merge_budget", self.merge_budget, 1)
        if self.merging is None and self.merge_budget != MERGE_BUDGET:
            raise ValueError("merge_budget sizes the windows of merging='cam': set merging='cam' too")
        if self.merging is not None:
            refuse_own_allocation(self, "with merging='cam' keeps one set for every KV head",
                                  "DecodingEviction(policy=KNorm(), merging='cam')")

    def eviction_scorer(self) -> Policy:
        return self.policy

    def eviction_target(self, n_prompt: int) -> int | None:
        if self.target_ratio is not None:
            return max(1, math.floor(n_prompt * self.target_ratio))
        return self.target if self.target is not None else super().eviction_target(n_prompt)

    def eviction_ratio(self) -> float | None:
        return self.target_ratio

    def tracker(self, layer: int, n_layers: int, n_prompt: int, seeds: torch.Tensor | None) -> EvictionTracker | None:
        evicting = super().tracker(layer, n_layers, n_prompt, seeds)
        if evicting is None or self.merging is None:
            return evicting
        return CamPressTracker(**vars(evicting), merge_budget=self.merge_budget)


@dataclass
class EvictionTracker:
    """One layer's decode-time state: the policy's running scores (or the recent queries that vote) and the steps
    since the last eviction."""

    policy: Policy  # capacity = the target
    interval: int
    layer: int
    n_layers: int
    steps: int = 0
    scores: list = field(default_factory=list)  # per batch row: (kv_heads, slots) accumulated attention
    recent: list = field(default_factory=list)  # per batch row: (heads, rows, head_dim) queries since the last eviction
    recent_positions: torch.Tensor | None = None  # (rows,) their token positions
    merged: torch.Tensor | None = None  # (kv_heads, slots, head_dim) values the last eviction gathers from (CAM)
    ratio: float | None = None  # each eviction keeps floor(seen * ratio) (EvictsWhileDecoding.eviction_ratio)

    def step(self, calls: list[AttentionCall]) -> torch.Tensor | None:
        """See one decode call (one AttentionCall per batch row, keys = every cached slot, the new tokens last);
        return the slots to keep (batch, kv_heads, target), or None between evictions. A policy that merges what
        leaves (CAM) sets `merged` at an eviction: the values the kept slots are gathered from."""
        self.merged = None
        self.steps += calls[0].query.shape[1]
        if self.policy.accumulates:
            for b, call in enumerate(calls):
                new = votes_per_kv_head(self.policy.score(call), call.key.shape[0])  # GQA mean
                old = self.scores[b] if b < len(self.scores) else torch.zeros_like(new[:, :0])
                total = torch.nn.functional.pad(old, (0, new.shape[-1] - old.shape[-1])) + new
                self.scores[b:b + 1] = [total]
        else:
            # The queries since the last eviction, at most `interval` of them (interval >= the policy's voters).
            self.recent = [(torch.cat([self.recent[b], c.query], 1) if self.recent else c.query)[:, -self.interval:]
                           for b, c in enumerate(calls)]
            positions = calls[0].positions
            positions = positions if self.recent_positions is None else torch.cat([self.recent_positions, positions])
            self.recent_positions = positions[-self.interval:]
        n_slots = calls[0].n_keys
        if self.steps < self.interval:
            return None
        policies = [self.policy if self.ratio is None else self._at_ratio(call) for call in calls]
        if any(n_slots <= policy.capacity for policy in policies):
            return None
        self.steps = 0
        kept = []
        for b, (call, policy) in enumerate(zip(calls, policies, strict=True)):
            if self.policy.accumulates:
                scores = self.scores[b]
            else:
                voters = self.recent[b]
                rows = voters.shape[1]
                scores = self.policy.score(dataclasses.replace(
                    call, query=voters, slots=torch.arange(n_slots - rows, n_slots), positions=self.recent_positions,
                    carry={}))
            budget = LayerBudget(n_slots, call.key.shape[0], self.layer, self.n_layers, policy.budget(n_slots))
            kept.append(self.keep(policy, scores, budget))
        if self.policy.accumulates:
            self.scores = [s.gather(-1, k) for s, k in zip(self.scores, kept, strict=True)]
        else:
            self.recent, self.recent_positions = [], None
        return torch.stack(kept)

    def keep(self, policy: Policy, scores: torch.Tensor, budget: LayerBudget) -> torch.Tensor:
        """One row's kept slots at an eviction, (kv_heads, target): the policy's own choice."""
        return policy.keep(scores, budget)

    def _at_ratio(self, call: AttentionCall) -> Policy:
        """The scorer at this eviction's target: floor(seen * ratio) positions per KV head, seen the tokens of the
        row so far, its last call's token included (kvpress: max(position_ids) + 1,
        compression_ratio_decoding_press.py:41-48)."""
        seen = int(call.positions[-1]) + 1
        return dataclasses.replace(self.policy, capacity=max(1, math.floor(seen * self.ratio)))


@dataclass
class CamPressTracker(EvictionTracker):
    """A layer's decode-time state under DecodingEviction(merging="cam"), kvpress's CAMPress
    (policies.decoding_merge): EvictionTracker's, with one kept set for every KV head, and each KV head's attention
    summed over the decode calls (`attention`), from which each eviction merges the best-scored evicted values into
    the kept ones (`merged`)."""

    merge_budget: int = MERGE_BUDGET
    attention: list = field(default_factory=list)  # per batch row: (kv_heads, slots) in the values' dtype
    ranking: torch.Tensor | None = None  # (prefix,) the score shared by the KV heads at the last `keep`

    def step(self, calls: list[AttentionCall]) -> torch.Tensor | None:
        for b, call in enumerate(calls):  # the call's last query only, whatever its length (cam_press.py:259-265)
            probabilities = attention_column_sums(call.query[:, -1:], call.key, call.attention.scaling,
                                                  call.slots[-1:], **call.attention.options())
            new = votes_per_kv_head(probabilities, call.key.shape[0]).to(call.value.dtype)
            old = self.attention[b] if b < len(self.attention) else new[:, :0]
            self.attention[b:b + 1] = [torch.nn.functional.pad(old, (0, new.shape[-1] - old.shape[-1])) + new]
        since = self.steps + calls[0].query.shape[1]  # the steps since the last eviction, this call's included
        kept = super().step(calls)
        if kept is None:
            return None
        (call,) = calls  # one batch row: the engine runs a tracker per row
        self.merged = merge_into_next_kept(call.value, self.attention[0], self.ranking, kept[0, 0], since,
                                           self.merge_budget)
        self.attention = [a.gather(-1, k) for a, k in zip(self.attention, kept, strict=True)]
        return kept

    def keep(self, policy: Policy, scores: torch.Tensor, budget: LayerBudget) -> torch.Tensor:
        """The top slots by the policy's ranking averaged over the KV heads (cam_press.py:142, :154-155), then its kept
        tail, the same for every KV head."""
        self.ranking = policy.ranked(scores, budget).mean(0)
        picked = top_positions(self.ranking[None], policy.head_budgets(scores, budget)[:1], budget.tokens)
        return picked.expand(budget.kv_heads, -1)
