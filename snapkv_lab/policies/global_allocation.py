"""KVzip's global allocation over any scorer: one selection of budget x layers x KV heads positions over every layer's
and head's scores together, so that layers and heads keep different counts (Kim et al. 2025, arXiv 2505.23416).

The official KVzip (snu-mllab/KVzip @5d84729, attention/score.py:88-102, `--level pair`) thresholds the scores of all
layers and heads at their int(N ratio) - 1-th largest; kvpress's KVzipPress(layerwise=False) (kvzip_press.py:384-387)
takes one top count over them and counts each layer's share. Here, as kvpress and KVzip's own `allocation="global"`:
the top budget x layers x KV heads prefix positions over every row of every layer (each row's kept tail on top), so
the cache holds exactly the uniform allocation's entries. GlobalAllocation(policy=KVzip(allocation="uniform")) keeps
what KVzip() keeps.

What it assumes: that the inner scorer's values mean the same in every layer. KVzip's are attention probabilities
(each position's largest, over the reconstruction), which its authors compare across layers; for another scorer
(a key norm, a window's votes) comparing layers is this wrapper's premise, not its authors' (kvpress offers the global
selection for KVzip alone), and the study (docs/scorer_allocation.md) reports what follows from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import LayerBudget, Policy, top_positions
from .wrapper import Wrapper, refuse_own_allocation


def keep_globally(policy: Policy, scores: dict[int, torch.Tensor], budget: LayerBudget) -> dict[int, torch.Tensor]:
    """{layer: (rows, widest) kept positions} of one batch row's {layer: (rows, n)} scores: one top count of every
    layer's summed `head_budgets` over the stacked `ranked` prefixes of all layers, each row then keeping its share by
    `top_positions` (its top positions, the kept tail, NO_POSITION padding). Every layer's prefix is as long (one
    budget and tail for all)."""
    layers = sorted(scores)
    ranked = torch.stack([policy.ranked(scores[i], budget.at(i)) for i in layers])  # (layers, rows, prefix)
    total = sum(sum(policy.head_budgets(scores[i], budget.at(i))) for i in layers)
    rows = ranked.shape[0] * ranked.shape[1]
    counts = torch.bincount(ranked.flatten().topk(total).indices // ranked.shape[-1], minlength=rows)
    counts = counts.view(len(layers), -1).tolist()
    return {i: top_positions(ranked[j], counts[j], budget.tokens) for j, i in enumerate(layers)}


@dataclass
class GlobalAllocation(Wrapper):
    """The uniform total shared by every layer and KV head of the model by `policy`'s scores (SnapKV by default): one
    selection over all of them (module doc). Compressed once the whole prompt is prefilled (every layer's scores are
    needed), so it runs in `generate` and `compare`, not inside `model.generate`."""

    layers_share_budget: ClassVar[bool] = True

    def __post_init__(self):
        super().__post_init__()
        if self.per_query_head:
            raise ValueError("GlobalAllocation allocates among KV heads: per_query_head=True is not supported")
        refuse_own_allocation(self, "chooses every layer's and head's count from the scores",
                              "GlobalAllocation(SnapKV)")

    def keep_layers(self, scores: dict[int, torch.Tensor], budget: LayerBudget) -> dict[int, torch.Tensor]:
        return keep_globally(self, scores, budget)
