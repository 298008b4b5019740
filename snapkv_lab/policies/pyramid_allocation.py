"""PyramidKV's per-layer budgets over any scorer: the allocation of PyramidKV (Cai et al. 2024, arXiv 2406.02069)
without its scorer (SnapKV's votes), so that allocation and scoring can be compared apart.

Each layer keeps `pyramid_layer_budget` positions per head (policies.pyramidkv: the official integers of
Zefan-Cai/KVCache-Factory pyramidkv/pyramidkv_utils.py, PyramidKVCluster.update_kv, or kvpress's floats under
schedule="kvpress"), the kept tail the inner scorer's own, the positions the inner scorer's top ones in that layer.
PyramidAllocation(policy=SnapKV(window_size=8)) keeps what PyramidKV() keeps.

Totals. kvpress's schedule holds layers x budget to rounding (under half a position per layer and head). The
official integer step (largest - smallest) // (layers - 1) is floored, so its layers hold a little more than the
uniform total: up to (layers - 1) / 2 positions more per layer and head (0.1% of a 4k prompt at ratio 0.5 on
SmolLM2), and its flat fallback (a prompt shorter than twice the prefix budget: every compression ratio under 0.5
where the kept tail is small) is the uniform allocation itself. A budget-matched comparison at every ratio takes
schedule="kvpress".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..core.checks import check_int
from .base import LayerBudget
from .pyramidkv import SCHEDULES, pyramid_layer_budget
from .wrapper import Wrapper, refuse_own_allocation


@dataclass
class PyramidAllocation(Wrapper):
    """Per-layer budgets decreasing linearly with depth (PyramidKV's, beta its steepness), each layer ranked by
    `policy` (SnapKV by default) as under the uniform allocation at that layer's budget."""

    beta: int = 20
    schedule: str = "paper"

    def __post_init__(self):
        super().__post_init__()
        check_int("beta", self.beta, 1)
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        refuse_own_allocation(self, "shares the uniform budget between layers", "PyramidAllocation(SnapKV); a "
                              "per-head allocation within each pyramid layer is written outside, "
                              "AdaKV(PyramidAllocation(...))")

    def layer_budget(self, budget: LayerBudget) -> int:
        return pyramid_layer_budget(budget, self.policy.tail(budget.capacity), self.beta, self.schedule)

    def _at_layer(self, budget: LayerBudget) -> LayerBudget:
        """The budget as the inner policy sees it: the uniform allocation at this layer's pyramid budget."""
        return dataclasses.replace(budget, capacity=self.layer_budget(budget))

    def ranked(self, scores, budget: LayerBudget):
        return self.policy.ranked(scores, self._at_layer(budget))

    def head_budgets(self, scores, budget: LayerBudget) -> list[int]:
        return self.policy.head_budgets(scores, self._at_layer(budget))
