"""Baselines that read no attention: recency with attention sinks, and chance."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import AttentionCall, Policy


@dataclass
class StreamingLLM(Policy):
    """StreamingLLM (Xiao et al. 2023, arXiv 2309.17453): `sinks` first tokens plus the most recent ones (the
    kept tail and the most recent prefix positions together: the same set whatever kept_tail)."""

    sinks: int = 4

    scores_query_heads: ClassVar[bool] = False

    def score(self, call: AttentionCall):
        recency = torch.arange(call.n_keys, dtype=torch.float32, device=call.key.device)
        recency[: self.sinks] = math.inf
        return recency.expand(call.key.shape[0], -1)


@dataclass
class RandomKeep(Policy):
    """Uniformly random prefix positions, a different draw per layer and KV head (reproducible by seed): the chance
    level beside every method. layer_seeds=False draws every layer from `seed` alone, as kvpress's RandomPress
    (random_press.py: a generator seeded with `seed` at each call), so every layer keeps the same positions."""

    seed: int = 0
    layer_seeds: bool = True

    scores_query_heads: ClassVar[bool] = False

    def score(self, call: AttentionCall):
        generator = torch.Generator().manual_seed(self.seed * 100_003 + call.layer if self.layer_seeds else self.seed)
        return torch.rand(call.key.shape[0], call.n_keys, generator=generator).to(call.key.device)
