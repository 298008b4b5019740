"""CAKE (Qin et al. 2025, arXiv 2503.12491, "Cascading and Adaptive KV Cache Eviction with Layer Preferences"):
budgets across layers from how dispersed each layer's attention is, and an eviction indicator that counts how much
a position's attention shifts.

The official code (antgroup/cakekv; read in its fork qtris123/cakekv, cake/model/modify_llama.py lines 106-134,
cake/cake_cache.py CakeprefillKVCache, cake/utils.py adjust_budgets) reads, in each layer, the softmax attention A of
the last W prompt queries (the observation window, 32) over every key, causal inside the window, and computes

    H_l = -sum(A[..., :-W] * log(A[..., :-W] + 1e-10))     spatial dispersion: entropy over heads, rows and prefix keys
    V_l = sum over heads and prefix keys of var_rows(A[..., :-W])
                                                           temporal shift: the unbiased variance over the W rows
    P_l = H_l ** (1 / tau1) * V_l ** (1 / tau2)            the layer's preference
                                                           (tau1 = tau2 = 1: its script's default)
    I   = mean_rows(A) + gamma * var_rows(A)               eviction indicator per query head and key (gamma = 200)

I is cut to the prefix, average-pooled over 5 positions and averaged over each KV head's query heads. Once every
layer is prefilled, the layers share (B - W) * L prefix positions (B the capacity, L the layers) in proportion to P_l,
made integers and capped at each layer's prefix by `adjust_budgets` (below, as the official), and layer l keeps its
top budget_l positions by I plus the window.

Differences, named: the official leaves a prompt of up to B + W tokens uncompressed; here, as for every policy, a
prompt above B is compressed. Preferences that are all 0 or not finite (a window attending only to itself) share the
budget equally, where the official code would divide by zero. The official code also evicts while decoding, each
layer back to its budget by the last query's pooled attention (CakeDecodingKVCache_LayerWise); here the kept set is
fixed after the prefill, as for the lab's prefill-time policies (no wrapper, DecodingEviction included, takes CAKE:
its per-layer budgets would replace CAKE's allocation).
The cascading variant (`--cascading`, budgets recomputed as each layer arrives) is not implemented: its scripts
default to the non-cascading allocation reproduced here. Sliding-window layers keep their own cache and take no
share. The budgets need every layer's scores, so the cache is compressed after the prefill (`generate`, `compare`),
never inside `model.generate`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from ..core.attention import attention_probs
from .base import AttentionCall, LayerBudget, top_positions
from .snapkv import SnapKV


def adjust_budgets(budgets: list[float], total: int, prefix_len: int) -> list[int]:
    """The official integer budgets (cake/utils.py adjust_budgets): truncate, cap each at the prefix and spread the
    excess evenly over the layers below it (the remainder to the first of them), then add or remove the difference
    to `total` evenly, again the remainder first (adding over layers below the prefix, removing over layers above 1)."""
    out = np.array(budgets, dtype=int)
    excess = np.maximum(out - prefix_len, 0)
    out = np.minimum(out, prefix_len)
    if excess.sum() > 0:
        room = out < prefix_len
        if room.sum() > 0:
            out[room] += excess.sum() // room.sum()
            out[np.where(room)[0][:excess.sum() % room.sum()]] += 1
    difference = total - out.sum()
    if difference != 0:
        open_ = out < prefix_len if difference > 0 else out > 1
        if open_.sum() > 0:
            step = np.sign(difference)
            out[open_] += step * (abs(difference) // open_.sum())
            out[np.where(open_)[0][:abs(difference) % open_.sum()]] += step
    return out.tolist()


@dataclass
class CAKE(SnapKV):
    """CAKE's layer budgets and eviction indicator (see module doc); the observation window is SnapKV's (32 queries
    vote and are kept).

    score: (heads + 1, n_keys): the indicator per query head, then one row holding the layer's preference P_l
    (`layer_preference`); `ranked` reads the indicator rows, `keep_layers` both.
    """

    pooling: str | None = "avg"
    kernel_size: int = 5
    tau1: float = 1.0
    tau2: float = 1.0
    gamma: float = 200.0

    # Every layer's preference sets each layer's budget: compressed once the whole prompt is prefilled.
    layers_share_budget: ClassVar[bool] = True

    def __post_init__(self):
        super().__post_init__()
        for name in ("tau1", "tau2"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.gamma < 0:
            raise ValueError(f"gamma must be non-negative, got {self.gamma!r}")

    def score(self, call: AttentionCall):
        query, slots = self.window_queries(call)
        probs = attention_probs(query, call.key, call.attention.scaling, slots,
                                **call.attention.options())  # (heads, W, n_keys)
        indicator = probs.mean(1) + self.gamma * probs.var(1)
        preference = self.layer_preference(probs[..., :call.n_keys - self.window_size])
        return torch.cat([indicator, indicator.new_full((1, call.n_keys), preference)])

    def layer_preference(self, prefix_probs: torch.Tensor) -> float:
        """P_l from the window's attention over the prefix, (heads, W, prefix)."""
        entropy = -(prefix_probs * torch.log(prefix_probs + 1e-10)).sum()
        shift = prefix_probs.var(1).sum()
        return float(entropy ** (1 / self.tau1) * shift ** (1 / self.tau2))

    def ranked(self, scores, budget: LayerBudget):
        return super().ranked(scores[:-1], budget)

    def head_budgets(self, scores, budget: LayerBudget):
        return super().head_budgets(scores[:-1], budget)

    def layer_budgets(self, preferences: list[float], n_tokens: int) -> list[int]:
        """Each layer's prefix budget from the layers' preferences, the total (B - W) x layers."""
        budget = self.budget(n_tokens)
        tail = self.tail(budget)
        total = (budget - tail) * len(preferences)
        shares = [p / sum(preferences) * total for p in preferences] if sum(preferences) > 0 and \
            all(math.isfinite(p) for p in preferences) else [total / len(preferences)] * len(preferences)
        return [min(b, n_tokens - tail) for b in adjust_budgets(shares, total, n_tokens - tail)]

    def keep_layers(self, scores: dict[int, torch.Tensor], budget: LayerBudget) -> dict[int, torch.Tensor]:
        layers = sorted(scores)
        budgets = self.layer_budgets([float(scores[i][-1, 0]) for i in layers], budget.tokens)
        ranked = {i: self.ranked(scores[i], budget.at(i)) for i in layers}
        return {i: top_positions(ranked[i], [b] * ranked[i].shape[0], budget.tokens) for i, b in zip(layers, budgets)}
