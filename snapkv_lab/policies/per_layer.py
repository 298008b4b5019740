"""A budget of its own for each layer, over any scorer: kvpress 0.5.5's PerLayerCompressionPress
(kvpress/presses/per_layer_compression_press.py:19-74), which sets its inner press's compression_ratio to
`compression_ratios[module.layer_idx]` for each layer's hook (:60-65). No paper: kvpress's own wrapper.

Ours: `PerLayer(policy, layer_capacities=(c_0, ..., c_{L-1}))`, one capacity per layer in the lab's units (an int in
tokens, a float share of the prompt in (0, 1)), or None for a layer that keeps the wrapper's own `capacity`. Layer l
keeps what `policy` keeps at capacity c_l, the inner policy's kept tail included (kvpress's ratio r_l is our share
1 - r_l, its n_kept = max(1, int(n (1 - r_l))) our int n_kept). A layer whose capacity covers the prompt keeps it
whole. With no layer_capacities (the default) every layer keeps `capacity`: the inner policy itself.

kvpress's press must be a ScorerPress, set only through compression_ratio (:50-57); ours refuses an inner policy with
budgets of its own per layer or head (PyramidKV, AdaKV, ...), which it would override.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from ..core.checks import check_int
from .base import LayerBudget
from .wrapper import Wrapper, refuse_own_allocation


@dataclass
class PerLayer(Wrapper):
    """Each layer l keeps `layer_capacities[l]` positions per head (the wrapper's `capacity` where None), chosen by
    `policy` (SnapKV by default) as under the uniform allocation at that budget."""

    layer_capacities: tuple | None = None

    def __post_init__(self):
        if self.layer_capacities is not None:  # a list (from JSON) reads as the tuple it stands for
            self.layer_capacities = tuple(self.layer_capacities)
        super().__post_init__()
        refuse_own_allocation(self, "sets each layer's budget", "PerLayer(SnapKV, layer_capacities=...)")
        for layer, capacity in enumerate(self.layer_capacities or ()):
            if isinstance(capacity, float):
                if not 0 < capacity < 1:
                    raise ValueError(f"layer_capacities[{layer}]: a capacity ratio must lie in (0, 1), got {capacity}")
            elif capacity is not None:
                check_int(f"layer_capacities[{layer}]", capacity, 1, why=", a ratio in (0, 1) or None")
                if self.tail(capacity) >= capacity:
                    raise ValueError(f"layer_capacities[{layer}] ({capacity}) must exceed "
                                     f"{self.policy.tail_setting(capacity)}: a layer keeps its whole tail plus at "
                                     "least one chosen position")

    def _layer_positions(self, layer: int, n_tokens: int) -> int | None:
        """Positions layer `layer` keeps per head of an n-token prompt, None where its capacity covers it."""
        capacity = self.capacity if self.layer_capacities is None else self.layer_capacities[layer]
        capacity = self.capacity if capacity is None else capacity
        if capacity is None:
            return None
        kept = math.floor(capacity * n_tokens) if isinstance(capacity, float) else capacity
        if kept >= n_tokens:
            return None
        if kept <= self.tail(kept):
            raise ValueError(f"PerLayer: layer {layer}'s capacity {capacity} of a {n_tokens}-token prompt keeps {kept} "
                             f"positions, no more than {self.policy.tail_setting(kept)}")
        return kept

    def budget(self, n_tokens: int) -> int | None:
        """The mean of the layers' budgets (what kvpress reports as the press's compression ratio, :67-70), None when
        every layer's capacity covers the prompt; with no layer_capacities, the wrapper's own."""
        if self.layer_capacities is None:
            return super().budget(n_tokens)
        kept = [self._layer_positions(layer, n_tokens) for layer in range(len(self.layer_capacities))]
        if all(k is None for k in kept):
            return None
        return round(sum(n_tokens if k is None else k for k in kept) / len(kept))

    def layer_budget(self, budget: LayerBudget) -> int:
        if self.layer_capacities is None:
            return self.policy.layer_budget(budget)
        if len(self.layer_capacities) != budget.n_layers:
            raise ValueError(f"PerLayer has {len(self.layer_capacities)} layer_capacities for a model of "
                             f"{budget.n_layers} layers")
        kept = self._layer_positions(budget.layer, budget.tokens)
        return budget.tokens if kept is None else kept

    def _at_layer(self, budget: LayerBudget) -> LayerBudget:
        """The budget as the inner policy sees it: the uniform allocation at this layer's budget."""
        return dataclasses.replace(budget, capacity=self.layer_budget(budget))

    def ranked(self, scores, budget: LayerBudget):
        at = self._at_layer(budget)
        if at.capacity == budget.tokens:  # a whole layer: every position ranked, none of them a tail
            return scores.new_zeros(self.ranked_rows(scores, budget), budget.tokens, dtype=torch.float32)
        return self.policy.ranked(scores, at)

    def head_budgets(self, scores, budget: LayerBudget) -> list[int]:
        at = self._at_layer(budget)
        if at.capacity == budget.tokens:
            return [budget.tokens] * self.ranked_rows(scores, budget)
        return self.policy.head_budgets(scores, at)
