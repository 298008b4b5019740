"""PyramidKV (Cai et al. 2024, arXiv 2406.02069): SnapKV scoring, budgets shrinking from bottom to top layer.

Lower layers spread their attention widely and higher ones focus on few tokens ("pyramidal information
funnelling"), so the bottom layer keeps the most positions and the top one the fewest, on a straight line
whose mean is the capacity. With B the average budget, W the window and beta the steepness:

    smallest prefix budget  b_min = (B - W) / beta        (top layer)
    largest                 b_max = 2 (B - W) - b_min     (bottom layer; b_min + b_max = 2 (B - W))
    layer l of L            W + round(b_max - l (b_max - b_min) / (L - 1))

b_max is capped at the prefix length (then b_min = 2 (B - W) - b_max), as in the paper's code and kvpress.
"""

from __future__ import annotations

from dataclasses import dataclass

from .snapkv import SnapKV


@dataclass
class PyramidKV(SnapKV):
    """SnapKV votes (max-pooled), per-layer budgets decreasing linearly with depth, averaging `capacity`."""

    beta: int = 20

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.beta, int) or self.beta < 1:
            raise ValueError(f"beta must be an int >= 1, got {self.beta!r}")

    def layer_budget(self, n_tokens: int, layer: int, n_layers: int) -> int:
        budget = self.budget(n_tokens)
        prefix_budget, prefix_len = budget - self.window_size, n_tokens - self.window_size
        smallest = prefix_budget / self.beta
        largest = 2 * prefix_budget - smallest
        if largest > prefix_len:  # the bottom layer cannot keep more than the whole prefix
            largest, smallest = prefix_len, 2 * prefix_budget - prefix_len
        if n_layers == 1 or smallest < 1:  # no room for a slope (kvpress also falls back to a uniform budget)
            return budget
        step = (largest - smallest) / (n_layers - 1)
        return self.window_size + round(largest - layer * step)
