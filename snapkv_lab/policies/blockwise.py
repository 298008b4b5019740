"""Block-wise selection over one prefill, over any scorer: kvpress 0.5.5's BlockPress (kvpress/presses/block_press.py),
which "simulates block prompt processing described in the KeyDiff paper" (Park et al. 2025, arXiv 2504.15364). No paper
of its own: kvpress is its code, and our defaults are its.

kvpress keeps, per KV head, the first n_kept positions (n_kept = the budget), then for each block of `block_size`
positions from n_kept on (:71-75) scores the kept positions and the block together with its press, on their keys,
values and hidden states alone (:76-92), and keeps the top n_kept of them (:93-94): a position evicted early never
comes back, and every score sees only what is held at that moment, as a cache filled block by block would. All keys
come from one full forward (the docstring's warning, :21-22): a real block-wise prefill, whose later blocks are
computed over the compressed cache, is `generate(..., prefill_chunk=block)` (KeyDiff's docs).

Ours, `Blockwise(policy=KeyDiff(), block_size=128)`: the same loop, each step scored by the inner policy on an
AttentionCall cut to the KV head's held keys and the block (Composed's `held_call`: every query of the prompt, each
seeing the held keys up to its own position), kept by the inner policy's own selection at the budget. What is kept
depends on the budget while scoring, so the budget is part of the scorer: its `score_table` (the recorder's key) carries
the capacity, and a shared prefill records one score table per budget (each the kept set, +inf kept and -inf evicted),
never one shared across budgets. The prompt is scored in one attention call (a chunked prefill is refused: it is the
real block-wise prefill). kvpress's press re-reads hidden states gathered per KV head (:79-87), which a query-reading
scorer turns into queries of mixed positions; ours hands it the prompt's own queries, so only key-reading scorers
(KeyDiff, KNorm) are compared with kvpress (benchmarks/kvpress_peer.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..core.checks import check_int
from .base import AttentionCall, LayerBudget, Policy, whole_prompt
from .composed import held_call, stage_kept
from .keydiff import KeyDiff
from .wrapper import Wrapper, refuse_own_allocation


@dataclass
class Blockwise(Wrapper):
    """`policy` (KeyDiff by default: the paper whose block processing this simulates) keeps the budget, block after
    block of `block_size` positions, from what it held before and the block (see module doc)."""

    policy: Policy = field(default_factory=KeyDiff)
    block_size: int = 128  # kvpress's default (block_press.py:35)

    def __post_init__(self):
        super().__post_init__()
        check_int("block_size", self.block_size, 1)
        if self.policy.needs or self.policy.accumulates:
            raise TypeError(f"Blockwise scores each block from the prefill's attention call, and {self.policy.name} "
                            "scores after the prefill or adds its scores up over calls: it cannot be wrapped")
        refuse_own_allocation(self, "holds one budget per KV head", "Blockwise(KeyDiff)")
        if self.per_query_head:
            raise ValueError("Blockwise selects per KV head: per_query_head=True is not supported")

    accumulates = False

    @property
    def voters(self) -> int:
        return 0  # every query of the prompt: a block's scorer reads what it needs among them

    @property
    def budget_in_scores(self) -> bool:
        return True  # the scores are the kept set at the budget

    @property
    def scoring_key(self) -> str:
        return f"Blockwise({self.block_size}, {self.capacity!r})[{self.policy.scoring_key}]"

    def tail(self, budget: int) -> int:
        return 0  # the inner policy's tail is among what it holds at each block

    def score(self, call: AttentionCall) -> torch.Tensor:
        """(kv_heads, n) +inf at the positions each KV head holds after the last block, -inf elsewhere (0 everywhere
        when the budget covers the prompt)."""
        kv_heads, n = call.key.shape[0], call.n_keys
        whole_prompt(call, self.name)
        capacity = self.budget(n)
        if capacity is None:
            return call.key.new_zeros(kv_heads, n, dtype=torch.float32)
        at = LayerBudget(n, 1, call.layer, call.n_layers, capacity)
        held = [torch.arange(capacity, device=call.key.device) for _ in range(kv_heads)]
        for start in range(capacity, n, self.block_size):
            block = torch.arange(start, min(start + self.block_size, n), device=call.key.device)
            for head in range(kv_heads):
                candidates = torch.cat([held[head], block])
                scores = self.policy.score(held_call(call, candidates, head))
                held[head] = candidates[stage_kept(self.policy, scores, at, len(candidates))]
        out = torch.full((kv_heads, n), -math.inf, device=call.key.device)
        for head, row in enumerate(held):
            out[head, row] = math.inf
        return out

    def ranked(self, scores, budget: LayerBudget) -> torch.Tensor:
        return scores.float()

    def head_budgets(self, scores, budget: LayerBudget) -> list[int]:
        return [budget.capacity] * scores.shape[0]
