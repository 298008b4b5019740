"""HeadKV (Fu et al. 2024, arXiv 2410.19258): head-level budgets from how much each head retrieves.

Retrieval heads copy from the context; the others can live on a few positions. HeadKV shares one budget across every
head of every layer by a per-head importance score, then each head keeps its own top positions by a scorer (SnapKV
in the paper) plus the observation window. The official code (FYYFU/HeadKV at 3ec9653, headkv/snapkv_utils.py,
ReasonSnapKVCluster.__init__) with b = base_capacity - window, the per-head prefix budget of the uniform method:

    p = s / sum(s);  p = p ** temp / sum(p ** temp)            over all L x H (layer, head) scores s
    pool = (b // beta) * L * H;  floor = b - b // beta         (L: the layers compressed; sliding ones keep their own)
    capacity[l, h] = round(p[l, h] * pool + floor)            prefix positions, the window besides

and head h of layer l keeps its top capacity[l, h] positions (a head whose capacity passes its prefix keeps the whole
prefix: the rest of its share is unused, as in the official slicing). Its scripts run beta = 1.005 and temp = 1
(head_start_llama3.sh), which hands almost the whole budget to the scores, and its LongBench run sets SnapKV's window
to 8, kernel 7, max pooling (run_longbench.py:217-226 at 0862a09, over ReasonSnapKVCluster's own default window of 32):
the default inner policy here, SnapKV(window_size=8). With the former default window of 32 the label reads
HeadKV(policy=SnapKV(window_size=32)).

The scores here are Wu et al.'s retrieval scores measured on the model itself (`snapkv_lab.retrieval_heads`, cached
per model): the paper's HeadKV-R. Its HeadKV-R2 adds reasoning needles to the detection
(retrieval_head_detection_r2.py), which the lab does not run. The official code selects per query head over keys
repeated for each (Llama-3's 4 query heads per KV head hold 4 copies); here, as for AdaKV, a KV head ranks by its query
heads' mean votes (SnapKV's GQA reduction) and keeps the mean of their capacities, so the total is the same and the GQA
saving stays real.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..core.hooks import attention_modules
from ..core.models import sliding_layers
from . import retrieval_heads
from .base import ADDED_LATER, LayerBudget, Policy
from .snapkv import SnapKV
from .wrapper import Wrapper


def model_head_scores(model, tokenizer, label: str) -> torch.Tensor:
    """(layers, query heads) the model's retrieval scores (`retrieval_heads.retrieval_score_grid`), one row per layer,
    NaN on the sliding-window layers: the compressor leaves them their own bounded cache, so the budget that heads
    share is the other layers' alone (Gemma 3's retrieval heads sit in its global layers, and counting the sliding
    ones would hand those heads a share no cache pays for)."""
    scores = retrieval_heads.retrieval_score_grid(model, tokenizer).clone()
    if scores.shape[0] != len(attention_modules(model)):
        raise ValueError(f"{label}: retrieval scores for {scores.shape[0]} layers, the model has "
                         f"{len(attention_modules(model))}")
    scores[sliding_layers(model)] = float("nan")
    return scores


def head_shares(scores: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """(L, H) scores -> (L, H) shares of the pooled budget, summing to 1: normalised, raised to `temperature`,
    normalised again (the official order)."""
    scores = scores.double()
    if scores.isnan().all() or not scores.nan_to_num(0.0).sum() > 0:
        raise ValueError("HeadKV shares its budget by retrieval scores, and every head scored 0 or none was measured "
                         "(the model copied no needle token)")
    shares = scores.nan_to_num(0.0) / scores.nan_to_num(0.0).sum()
    shares = shares ** temperature
    return shares / shares.sum()


def head_capacities(shares: torch.Tensor, prefix_budget: int, beta: float, heads: int | None = None) -> torch.Tensor:
    """(L, H) shares and the uniform per-head prefix budget b -> (L, H) long prefix positions per head:
    round(share * (b // beta) * heads + b - b // beta), heads the number sharing the pool (default L * H)."""
    pooled = prefix_budget // beta
    heads = shares.numel() if heads is None else heads
    return torch.round(shares * (pooled * heads) + (prefix_budget - pooled)).long()


def redistributed(capacities: torch.Tensor, shares: torch.Tensor, room: int, sharing: torch.Tensor) -> torch.Tensor:
    """(L, H) capacities with each head held to `room` positions (its prefix) and what the capped heads cannot use
    handed to the heads with room left, in proportion to their shares (equally where those shares are all 0), until
    none is over: water-filling. The total is min(capacities' total, room x heads sharing), exact in integers (largest
    remainders, ties to the first head). sharing: (L, H) bool, the heads of the layers that share the pool."""
    wanted = capacities.double().where(sharing, torch.zeros((), dtype=torch.double))
    total = min(int(wanted.sum()), room * int(sharing.sum()))
    held = wanted.clone()
    full = torch.zeros_like(sharing)
    while bool((held > room).any()):
        over = held > room
        excess = float((held[over] - room).sum())
        held[over] = room
        full |= over
        free = sharing & ~full
        if not bool(free.any()):
            break
        weights = shares.double().where(free, torch.zeros((), dtype=torch.double))
        weights = weights if float(weights.sum()) > 0 else free.double()
        held += excess * weights / weights.sum()
    counts = held.floor()
    order = (held - counts).flatten().argsort(descending=True, stable=True)
    counts.view(-1)[order[:total - int(counts.sum())]] += 1
    return counts.long()


@dataclass
class HeadKV(Wrapper):
    """Per-head prefix budgets from retrieval scores, shared across all layers, over `policy`'s ranking (by default
    SnapKV with the official run's 8-token window). beta: how much of each head's budget is pooled (b // beta of it; the
    official 1.005 pools almost all); temperature: the exponent on the normalised scores (1: proportional).
    redistribute: our variant (see the field). The scores are measured on the model at the first prefill
    (`retrieval_heads`: needle prompts, so the first use of a model costs about ten captures)."""

    # The official LongBench run's SnapKV (FYYFU/HeadKV at 0862a09, run_longbench.py:217-226): window 8, kernel 7,
    # max pooling; ReasonSnapKVCluster's own default window (32) is overridden there.
    policy: Policy = field(default_factory=lambda: SnapKV(window_size=8))
    beta: float = 1.005
    temperature: float = 1.0
    # Our variant: what a head cannot use (its share beyond its prefix) goes to the heads with room, so the cache
    # holds the budget it is labelled with (the official slicing wastes it): budget-matched comparisons.
    redistribute: bool = field(default=False, metadata={ADDED_LATER: True})

    def __post_init__(self):
        super().__post_init__()
        if self.per_query_head:
            raise ValueError("HeadKV's budgets are per head and the cache stores ragged budgets per KV head: "
                             "per_query_head=True is not supported")
        if not self.beta >= 1:
            raise ValueError(f"beta must be at least 1 (b // beta of each head's budget is pooled), got {self.beta!r}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be positive, got {self.temperature!r}")

    def prepare(self, model, tokenizer) -> None:
        super().prepare(model, tokenizer)
        scores = model_head_scores(model, tokenizer, self.label)
        compressed = ~scores.isnan().all(-1)  # layers whose heads share the pool (not sliding)
        self._pooled_heads = int(compressed.sum()) * scores.shape[1]
        self._sharing = compressed[:, None].expand_as(scores)
        self._shares = head_shares(scores, self.temperature) if self._pooled_heads else torch.zeros_like(scores)

    def head_budgets(self, scores, budget: LayerBudget) -> list[int]:
        shares = getattr(self, "_shares", None)
        if shares is None:
            raise RuntimeError(f"{self.label}: the model was not prepared (policy.prepare(model, tokenizer)), so its "
                               "heads' retrieval scores are unknown")
        uniform = Policy.head_budgets(self, scores, budget)  # b per row, whatever the inner
        prefix = self.prefix_len(budget)
        capacities = head_capacities(shares, uniform[0], self.beta, self._pooled_heads)  # (layers, query heads)
        if self.redistribute:  # among the rows the cache holds (KV heads: their query heads' mean), exactly
            def grouped(t):
                return t.view(t.shape[0], len(uniform), -1)

            capacities = redistributed(grouped(capacities).double().mean(-1), grouped(shares).mean(-1), prefix,
                                       grouped(self._sharing).all(-1))
        capacities = capacities[budget.layer]
        if len(uniform) != capacities.numel():  # one row per KV head: the mean of its query heads'
            capacities = torch.round(capacities.view(len(uniform), -1).double().mean(-1)).long()
        return capacities.clamp(max=prefix).tolist()
