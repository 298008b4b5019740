"""Policies applied one after another: kvpress 0.5.5's ComposedPress (kvpress/presses/composed_press.py:11-65), each
press's hook run on what the press before it left in the cache (:59-63), the compression ratios multiplying
(:62-64). No paper: kvpress's own wrapper ("e.g. sequence + dimension compression").

Ours, `Composed(policy=SnapKV(), before=(stage_1, ..., stage_k))`: each stage of `before` keeps its own capacity of
what the stage before it kept, then `policy` keeps the wrapper's capacity of what the last stage kept. Every
capacity counts positions of the prompt (kvpress's ratios r_1, r_2 are our capacities n (1 - r_1) and
n (1 - r_1)(1 - r_2)). A later stage scores an AttentionCall cut to what its KV head still holds, in position
order (as a cache holds it): its keys and values only, every query of the call (slots counted among the held keys),
so an attention scorer's softmax runs over the held keys alone, as kvpress's does over its pruned keys.

Two differences by kvpress's construction, where the result depends on order (docs/faithfulness.md): kvpress's
pruned cache holds the kept keys in top-k order, not position order (scorer_press.py:103-107 gather by
`topk(...).indices`), so a later press reading positions (SnapKV's window: the last window_size keys; pooling
along neighbours) reads them shuffled; and a later press that re-projects queries from hidden states (SnapKV) reads
the unpruned hidden states with the unpruned rotary embeddings. Presses that read keys and values alone (KNorm,
KeyDiff, ...) are unaffected: the peer row composes SnapKV then KNorm.

kvpress refuses AdaKVPress and KVzipPress inside (:50-53); ours refuses stages that score after the prefill (KVzip,
Surprisal, ...: their scores come from the whole cache) or add their scores up over prompt chunks (H2O).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from .base import NO_POSITION, AttentionCall, LayerBudget, Policy
from .wrapper import Wrapper


def held_call(call: AttentionCall, held: torch.Tensor, head: int) -> AttentionCall:
    """`call` cut to KV head `head` and its held key positions `held` (m,) ascending: its query heads, key and value
    (1, m, d); each query row's slot the last held key at or before its own (-1: none yet)."""
    group = call.query.shape[0] // call.key.shape[0]
    slots = torch.searchsorted(held, call.slots.to(held.device), right=True) - 1
    return AttentionCall(call.query[head * group:(head + 1) * group], call.key[head:head + 1, held],
                         call.value[head:head + 1, held], slots, call.attention, call.module, call.layer,
                         call.n_layers, call.positions)


@dataclass
class Composed(Wrapper):
    """`before`'s stages, each keeping its own capacity of what the one before kept, then `policy` (SnapKV by
    default) at the wrapper's capacity of what they kept. No stages: `policy` itself."""

    before: tuple = field(default_factory=tuple)

    def __post_init__(self):
        self.before = tuple(self.before)  # a list (from JSON) reads as the tuple it stands for
        super().__post_init__()
        for stage in (*self.before, self.policy):
            if not isinstance(stage, Policy) or stage.needs or stage.accumulates or stage.layers_share_budget or \
                    not stage.capacity_sets_entries or stage.per_query_head:
                raise TypeError("Composed runs each stage on what the stage before kept, from the prefill's "
                                f"attention calls: {getattr(stage, 'name', stage)!r} cannot be a stage (scored after "
                                "the prefill, added up over prompt chunks, a budget of its own across layers, or per "
                                "query head)")
        for stage in self.before:
            if stage.capacity is None:
                raise ValueError(f"each stage of `before` keeps its own capacity: {stage.label} has none")

    @property
    def voters(self) -> int:
        return max(stage.voters for stage in (*self.before, self.policy))

    accumulates = False

    @property
    def scoring_key(self) -> str:
        return f"Composed[{', '.join(stage.label for stage in self.before)}][{self.policy.scoring_key}]"

    def _differences(self, default: Policy, skip) -> list[str]:
        """As every policy's, with the stages written by their labels."""
        parts = super()._differences(default, (*skip, "before"))
        if "before" in skip or self.before == getattr(default, "before", None):
            return parts
        return [*parts, f"before=({', '.join(stage.label for stage in self.before)})"]

    def tail(self, budget: int) -> int:
        return 0 if self.before else self.policy.tail(budget)  # the last stage's tail is among what it holds

    def score(self, call: AttentionCall) -> torch.Tensor:
        """(rows, n) the last stage's scores of the positions the stages before it kept (per KV head), -inf
        elsewhere; the stages' scores clamped above -inf so that -inf means evicted."""
        kv_heads, n = call.key.shape[0], call.n_keys
        held = torch.arange(n, device=call.key.device).expand(kv_heads, -1)
        for stage in self.before:
            budget = LayerBudget(n, 1, call.layer, call.n_layers, stage.budget(n) or n)
            held = [row[stage_kept(stage, stage.score(held_call(call, row, head)), budget, len(row))]
                    for head, row in enumerate(held)]
        if not self.before:
            return self.policy.score(call)
        last = [self.policy.score(held_call(call, row, head)) for head, row in enumerate(held)]
        out = torch.full((kv_heads * last[0].shape[0], n), -math.inf, device=call.key.device)
        rows = last[0].shape[0]
        for head, (row, scores) in enumerate(zip(held, last, strict=True)):
            out[head * rows:(head + 1) * rows, row] = scores.float().clamp(min=torch.finfo(torch.float32).min)
        return out

    def kept_mask(self, scores: torch.Tensor, budget: LayerBudget) -> torch.Tensor:
        """(kv_heads, n) bool: what the last stage keeps per KV head, at the layer's budget, of what it holds."""
        rows = scores.shape[0] // budget.kv_heads
        mask = torch.zeros(budget.kv_heads, budget.tokens, dtype=torch.bool, device=scores.device)
        capacity = self.policy.layer_budget(budget)
        for head in range(budget.kv_heads):
            own = scores[head * rows:(head + 1) * rows]
            held = (own > -math.inf).any(0).nonzero().flatten()
            at = LayerBudget(len(held), 1, budget.layer, budget.n_layers, capacity)
            mask[head, held[stage_kept(self.policy, own[:, held], at, len(held))]] = True
        return mask

    def ranked(self, scores, budget: LayerBudget) -> torch.Tensor:
        if not self.before:
            return self.policy.ranked(scores, budget)
        kept = self.kept_mask(scores, budget)
        return torch.full(kept.shape, -math.inf, device=kept.device).masked_fill(kept, math.inf)

    def head_budgets(self, scores, budget: LayerBudget) -> list[int]:
        if not self.before:
            return self.policy.head_budgets(scores, budget)
        return self.kept_mask(scores, budget).sum(-1).tolist()


def stage_kept(stage: Policy, scores: torch.Tensor, budget: LayerBudget, m: int) -> torch.Tensor:
    """The indices among m held positions that `stage` keeps of them at `budget.capacity` positions (all of them when
    that covers them): scores (rows, m) its scores of those positions, ranked for one KV head."""
    if budget.capacity >= m:
        return torch.arange(m, device=scores.device)
    if budget.capacity <= stage.tail(budget.capacity):
        raise ValueError(f"Composed: {stage.name} keeps {budget.capacity} positions, no more than "
                         f"{stage.tail_setting(budget.capacity)}")
    kept = stage.keep(scores, dataclasses.replace(budget, tokens=m))[0]
    return kept[kept != NO_POSITION]
