"""SimLayerKV (Zhang et al. 2024, arXiv 2410.13846, "SimLayerKV: A Simple Framework for Layer-Level KV Cache
Reduction"): a "lazy" layer, whose last query pays nearly all its attention to the first tokens and the most recent
ones, keeps only those; every other layer keeps its whole prompt."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..core.attention import attention_column_sums
from ..core.checks import check_int
from .base import AttentionCall, LayerBudget, Policy


@dataclass
class SimLayerKV(Policy):
    """SimLayerKV-decode, as the authors' code and kvpress's SimLayerKVPress run it after the prefill.

    Official code (sail-sg/SimLayerKV @ ff6c198, LongBench/SimLayerKV_attention_llama.py:160-162, and
    LongBench/SimLayerKV_llama.py @ 5a627a7, LlamaModel.forward): at the first decode step, a layer whose new query's
    attention (averaged over query heads) to the 4 first keys plus the last 1024 keys of its cache exceeds the
    threshold keeps cache[:4] and cache[-1024:]; the threshold is 0.9 for Llama-3 (pred.py @ 85afc94, the
    `'llama3' in out_path` branch; 0.65 Llama-2, 0.8 Mistral, 0.85 Qwen). kvpress 0.5.5 (simlayerkv_press.py:56-70,
    116-118) makes it a prefill decision: the last prompt query plays the new token's part, its softmax over every
    key (itself included) summed over the first `n_initial` keys and the `n_recent` keys before it, and a lazy layer
    keeps the first n_initial and the last n_recent - 1 prompt positions, so that with the next token it holds
    n_initial + n_recent, as the official cache does. Ours is that prefill decision.

    capacity: the positions a lazy layer keeps per head, its `sinks` first and its last `capacity - sinks` (default
        4 + 1023: with the next token, the official 4 + 1024); a busy layer keeps its whole prompt, so the cache holds
        more than the capacity wherever a layer is not lazy (`capacity_sets_entries` is False: the entries are
        counted against the full cache). The lazy test reads the `capacity - sinks + 1` keys before the last query
        (kvpress's n_recent), and a prompt of at most capacity + 2 tokens is left whole (kvpress: k_len <=
        n_initial + n_recent + n_last).
    lazy_threshold: a layer is lazy when that attention share exceeds it (the authors' Llama-3 value, 0.9; kvpress's
        default 1.0 compresses nothing and is refused here: name the model's value).
    sinks: the first positions a lazy layer keeps (n_initial, 4).
    score: (heads, n_keys) the last query's attention to every key (under the layer's own softmax settings).
    """

    capacity: int | float | None = 1027
    kept_tail: int | None = None  # the lazy layers' recent positions: capacity - sinks
    lazy_threshold: float = 0.9
    sinks: int = 4

    capacity_sets_entries: ClassVar[bool] = False

    def __post_init__(self):
        if self.kept_tail is not None:
            raise ValueError("SimLayerKV's lazy layers keep their sinks and their last capacity - sinks positions: set "
                             "capacity and sinks, not kept_tail")
        check_int("sinks", self.sinks, 1)
        if isinstance(self.lazy_threshold, bool) or not isinstance(self.lazy_threshold, (int, float)) or \
                not 0 <= self.lazy_threshold < 1:
            raise ValueError(f"lazy_threshold must be a number in [0, 1) (an attention share; 1 would find no layer "
                             f"lazy), got {self.lazy_threshold!r}")
        if self.per_query_head:
            raise ValueError("SimLayerKV keeps one set of positions per layer: per_query_head=True contradicts it")
        if isinstance(self.capacity, int) and self.capacity <= self.sinks:
            raise ValueError(f"capacity ({self.capacity}) must exceed sinks ({self.sinks}): a lazy layer keeps its "
                             "sinks and at least one recent position")
        super().__post_init__()

    @property
    def voters(self) -> int:
        return 1

    def tail(self, budget: int) -> int:
        return budget - self.sinks

    def tail_setting(self, budget: int) -> str:
        return f"the recent positions (capacity less {self.sinks} sinks)"

    def budget(self, n_tokens: int) -> int | None:
        budget = super().budget(n_tokens)
        if budget is not None and budget <= self.sinks:
            raise ValueError(f"capacity {self.capacity} of a {n_tokens}-token prompt keeps {budget} positions, no more "
                             f"than the sinks ({self.sinks}); use a larger ratio or a token budget.")
        return None if budget is None or n_tokens <= budget + 2 else budget

    def score(self, call: AttentionCall):
        return attention_column_sums(call.query[:, -1:], call.key, call.attention.scaling, call.slots[-1:],
                                     **call.attention.options())

    def lazy(self, scores: torch.Tensor, budget: LayerBudget) -> bool:
        """Whether the layer is lazy. scores: (heads, n) the last query's attention; averaged over heads, its share on
        the sinks and on the `budget.capacity - sinks + 1` positions before the last one, against the threshold."""
        share = scores.float().mean(0)
        n, recent = budget.tokens, budget.capacity - self.sinks + 1
        return float(share[: self.sinks].sum() + share[n - 1 - recent: n - 1].sum()) > self.lazy_threshold

    def keep(self, scores: torch.Tensor, budget: LayerBudget) -> torch.Tensor:
        """(kv_heads, kept) the same positions in every head: the sinks and the last capacity - sinks in a lazy layer,
        all n in a busy one."""
        n = budget.tokens
        positions = torch.arange(n, device=scores.device)
        if self.lazy(scores, budget):
            positions = torch.cat([positions[: self.sinks], positions[n - self.tail(budget.capacity):]])
        return positions.expand(budget.kv_heads, -1)
