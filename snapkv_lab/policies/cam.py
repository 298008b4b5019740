"""CaM, Cache Merging (Zhang et al., "CaM: Cache Merging for Memory-efficient LLMs Inference", ICML 2024,
openreview LCTmppB165): while decoding, a token about to leave the cache is not simply dropped: its value is added,
with a probability set by its attention, to the values of the tokens after it.

Official code (zyxxmu/cam @ df5e076, cam_hf/utils_hh/modify_llama_cam.py; the file is unchanged at fc80e64): a
StreamingLLM cache of `start_budget` first tokens and a `recent_budget` window (LlamaAttention_cam.forward, lines
124-156; the run scripts' start_ratio = recent_ratio = 0.1 of the prompt, run_helm.py:132-133), one token leaving the
window per decode step. At each step, after the attention output is computed with the values as they were,
local_cam_mask (lines 23-35), per head, takes the window's second-oldest token x (the one leaving after the next
step; the oldest leaves now, merged one step earlier), its attention A_x from this step's query, and

    p = clamp(A_x / mean(A over the window's tokens after x, the new token included), 0, 1)   (nan -> 0)
    m ~ Bernoulli(p)
    v_j += m * v_x / merge_budget   for the merge_budget (32) tokens after x (fewer where the window ends)

Here the cache really shrinks: after prefill each layer holds `sinks` first and `capacity - sinks` last prompt
positions (the official code's prefill mask: start_budget + recent_budget - 1, the step's token making the
recent_budget), and each decode step, after its attention, merges as above and evicts what the window left. So
capacity counts what the cache holds between steps (as H2O's here); the official cache_budget = capacity + 1.
`sinks` None: half of that step's cache, (capacity + 1) // 2, the scripts' start_ratio = recent_ratio. A call of
several tokens (an appended question) merges the one token next to leave, by its last query's attention.

GQA: the official code is MHA; here the attention is the mean over each KV head's query heads, one draw per KV head.

kvpress 0.5.5's CAMPress (kvpress/presses/cam_press.py) is another method under this name, not a setting of this
policy: `DecodingEviction(merging="cam")` (policies.decoding_merge; docs/faithfulness.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..core.attention import attention_column_sums
from ..core.checks import check_int
from ..core.selection import votes_per_kv_head
from .base import AttentionCall, Policy
from .decoding import EvictionTracker, EvictsWhileDecoding

MERGE_BUDGET = 32  # local_cam_mask's merge_budget (modify_llama_cam.py:24)


def merge_next_leaver(value: torch.Tensor, attention: torch.Tensor, leaver: int, merge_budget: int) -> torch.Tensor:
    """local_cam_mask on a physical cache: value (kv_heads, n, head_dim), attention (kv_heads, n) this step's
    probabilities; slot `leaver` (the next to leave) is added, by a Bernoulli draw per head (torch's global
    generator, as the official code), divided by merge_budget, into the merge_budget slots after it.
    Returns new (kv_heads, n, head_dim) values; `value` is left as it was."""
    merged = value.clone()
    if leaver >= value.shape[1] - 1:  # no token after it: nothing to merge into
        return merged
    probability = attention[:, leaver] / attention[:, leaver + 1:].mean(-1)
    # official: nan -> 0, inf -> 1; drawn in the model's dtype, as the official attention weights are
    draw = torch.bernoulli(torch.nan_to_num(probability, nan=0.0).clamp(0, 1).to(value.dtype))
    share = value[:, leaver] * draw[:, None] / merge_budget
    merged[:, leaver + 1: leaver + 1 + merge_budget] += share[:, None]
    return merged


@dataclass
class CAM(EvictsWhileDecoding, Policy):
    """CaM as its official code runs it (see module doc): a StreamingLLM cache of `sinks` first positions and the
    last ones, `capacity` in all; every `interval` decode steps (1, the official) each layer evicts back to capacity,
    the next token to leave merged into the `merge_budget` tokens after it with probability clamp(A_x / mean A, 0, 1).
    sinks: None, half the step's cache ((capacity + 1) // 2, the official start_ratio = recent_ratio), or the rest
    of the budget when kept_tail (the recent window) is set; set one of the two."""

    kept_tail: int | None = None  # the recent window; None: capacity - sinks
    sinks: int | None = None
    merge_budget: int = MERGE_BUDGET
    interval: int | None = 1

    scores_query_heads: ClassVar[bool] = False

    def __post_init__(self):
        check_int("sinks", self.sinks, 1, optional=True)
        check_int("merge_budget", self.merge_budget, 1)
        if self.kept_tail is not None and self.sinks is not None:
            raise ValueError("CAM's budget is its sinks plus its recent window (kept_tail): set one of sinks and "
                             "kept_tail, the other is the rest of the budget")
        if self.per_query_head:
            raise ValueError("CAM keeps one window per KV head: per_query_head=True is not supported")
        super().__post_init__()
        self.check_interval()

    @property
    def budget_in_scores(self) -> bool:
        return self.sinks is None  # the sinks on top of the scores are a share of the budget

    def sink_count(self, budget: int) -> int:
        """The first positions kept under a budget of `budget` positions."""
        if self.sinks is not None:
            return self.sinks
        return (budget + 1) // 2 if self.kept_tail is None else budget - self.kept_tail

    def tail(self, budget: int) -> int:
        if self.kept_tail is not None:
            return self.kept_tail
        if self.sink_count(budget) >= budget:
            raise ValueError(f"sinks ({self.sinks}) must leave a recent window in a budget of {budget} positions")
        return budget - self.sink_count(budget)

    def tail_setting(self, budget: int) -> str:
        return f"the recent window (capacity - sinks = {self.tail(budget)})"

    def score(self, call: AttentionCall):
        """Recency, the first `sinks` on top: with the recent window as the kept tail, the sinks are the picks."""
        recency = torch.arange(call.n_keys, dtype=torch.float32, device=call.key.device)
        budget = self.budget(call.n_keys)
        recency[: self.sink_count(budget) if budget is not None else 0] = float("inf")
        return recency.expand(call.key.shape[0], -1)

    def tracker(self, layer: int, n_layers: int, n_prompt: int, seeds: torch.Tensor | None):
        target = self.eviction_target(n_prompt)
        if self.interval is None or target is None:
            return None
        return CamTracker(dataclasses.replace(self, capacity=target), self.interval, layer, n_layers)


@dataclass
class CamTracker(EvictionTracker):
    """A CAM layer's decode-time state: the window's eviction (EvictionTracker's), and at each eviction the merged
    values the kept slots are gathered from (`merged`)."""

    def step(self, calls: list[AttentionCall]) -> torch.Tensor | None:
        kept = super().step(calls)
        if kept is None:
            return None
        (call,) = calls  # one batch row: the engine runs a tracker per row
        n, budget = call.n_keys, self.policy.capacity
        probabilities = attention_column_sums(call.query[:, -1:], call.key, call.attention.scaling, call.slots[-1:],
                                              **call.attention.options())  # (heads, n): the last query's row
        attention = votes_per_kv_head(probabilities, call.key.shape[0])
        leaver = self.policy.sink_count(budget) + (n - budget)  # the window's oldest slot that stays
        self.merged = merge_next_leaver(call.value, attention, leaver, self.policy.merge_budget)
        return kept
