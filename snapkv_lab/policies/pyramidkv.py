"""PyramidKV (Cai et al. 2024, arXiv 2406.02069): SnapKV scoring, budgets shrinking from bottom to top layer.

Lower layers spread their attention widely and higher ones focus on few tokens ("pyramidal information
funnelling"), so the bottom layer keeps the most positions and the top one the fewest, on a straight line. With B
the capacity (window included), W the window, n the prompt, L layers and beta the steepness, the official code
(Zefan-Cai/KVCache-Factory, pyramidkv/pyramidkv_utils.py, PyramidKVCluster.update_kv) computes in integers:

    smallest prefix budget  b_min = (B - W) // beta                       (top layer)
    largest                 b_max = 2 (B - W) - b_min                     (bottom layer)
    capped at the prefix    if b_max >= n - W: b_max = n - W, b_min = 2 (B - W) - b_max
    layer l                 W + b_max - l * ((b_max - b_min) // (L - 1))
    flat fallback           n < 2 (B - W): every layer keeps B (SnapKV's budget)

The floor of the step makes the layers keep on average a little more than B (up to (L - 1) / 2 positions more per
layer); the sum is not held at exactly L * B. schedule="kvpress" is kvpress's PyramidKVPress.get_layer_budget
instead: the same line over the whole budget in floats (b_min = B / beta, b_max = 2B - b_min, capped at n - W),
each layer round(b_max - l * step) positions with the window inside them, and a flat budget B whenever not
(n >= b_max >= b_min >= W).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.checks import check_int
from .base import LayerBudget
from .snapkv import SnapKV

SCHEDULES = ("paper", "kvpress")


@dataclass
class PyramidKV(SnapKV):
    """SnapKV votes (max-pooled, kernel 7), per-layer budgets decreasing linearly with depth; the observation window
    of the paper's code (8 tokens, KVCache-Factory run_longbench.py)."""

    window_size: int = 8
    beta: int = 20
    schedule: str = "paper"

    def __post_init__(self):
        super().__post_init__()
        check_int("beta", self.beta, 1)
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")

    def layer_budget(self, budget: LayerBudget) -> int:
        return pyramid_layer_budget(budget, self.tail(budget.capacity), self.beta, self.schedule)


def pyramid_layer_budget(budget: LayerBudget, tail: int, beta: int, schedule: str = "paper") -> int:
    """Positions kept per head in `budget.layer` (the kept tail of `tail` tokens included) on PyramidKV's line from
    the uniform budget `budget.capacity` (module doc): the official integers (schedule "paper") or kvpress's floats
    ("kvpress"). PyramidKV and PyramidAllocation (the same budgets over any scorer) both read it."""
    n_tokens, layer, n_layers, capacity = budget.tokens, budget.layer, budget.n_layers, budget.capacity
    if n_layers == 1:
        return capacity
    if schedule == "kvpress":
        return _kvpress_budget(capacity, tail, n_tokens, layer, n_layers, beta)
    prefix_budget, prefix_len = capacity - tail, n_tokens - tail
    if n_tokens < 2 * prefix_budget:
        return capacity
    smallest = prefix_budget // beta
    largest = 2 * prefix_budget - smallest
    if largest >= prefix_len:
        largest, smallest = prefix_len, 2 * prefix_budget - prefix_len
    return tail + largest - layer * ((largest - smallest) // (n_layers - 1))


def _kvpress_budget(budget: int, tail: int, n_tokens: int, layer: int, n_layers: int, beta: int) -> int:
    smallest = budget / beta
    largest = 2 * budget - smallest
    if largest >= n_tokens - tail:
        largest = n_tokens - tail
        smallest = 2 * budget - largest
    if not n_tokens >= largest >= smallest >= tail:
        return budget
    return round(largest - layer * (largest - smallest) / (n_layers - 1))
