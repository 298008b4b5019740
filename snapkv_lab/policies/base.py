"""What every compression policy shares: its budget, the attention call it scores, and how scores become
kept positions.

A policy scores the prompt's key positions once, at prefill, and keeps `capacity` of them per KV head:
the top-scored prefix positions plus the last `window_size` prompt tokens (always kept). One method each:

    policy.score(call: AttentionCall) -> (heads or kv_heads, n_keys) float32, higher kept first; None: keep all

`AttentionCall` holds what the attention call had (queries, keys, values, the module, the layer's own
softmax settings): a scorer reads what it needs and ignores the rest. `Policy.keep` turns scores into
kept positions with `selection.select` (pooling, GQA reduction, top-k), the very function the attention
analysis uses. Policies with budgets that vary by layer override `layer_budget`; by head, `keep` (kept
positions padded with -1, stored ragged: see compression.layers.HeadwiseLayer).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..attention import AttentionSettings
from ..selection import GQA_REDUCTIONS, POOLINGS, select

SELECTION = ("pooling", "kernel_size", "gqa", "per_query_head")  # applied to scores by `keep`, with the budget
NO_POSITION = -1
_ABSENT = object()  # a field the default being compared with lacks: always a difference  # fills the kept positions of heads that keep fewer than the layer's widest head


@dataclass
class AttentionCall:
    """One batch row of one attention call at prefill, as a scorer sees it.

    query: (heads, rows, head_dim) post-RoPE queries of the call's new tokens, at `positions` (rows,) (CPU).
    key, value: (kv_heads, n_keys, head_dim) the layer's whole cache so far (post-RoPE keys).
    attention: the layer's scaling, sliding window and soft-cap, so scores see the model's own softmax.
    module: the attention module (its projections, config, layer_idx); n_layers: layers in the model.
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    positions: torch.Tensor
    attention: AttentionSettings
    module: object
    layer: int
    n_layers: int

    @property
    def n_keys(self) -> int:
        return self.key.shape[1]


@dataclass
class Policy:
    """Base policy: keep `capacity` positions per KV head after prefill (see module doc).

    capacity: total positions kept per head (prefix picks + window), as tokens (int), or as a ratio of
        the prompt (float in (0, 1)); None keeps everything. Prompts at or below it are left untouched.
    window_size: the last prompt tokens, always kept (and, for SnapKV, the voters).
    per_query_head: False (default) pools the scores of each GQA group and keeps one selection per KV
        head, so a GQA cache really shrinks. True reproduces the official SnapKV code: the KV heads are
        repeated and each query head keeps its own selection, a cache of `heads / kv_heads` times more
        bytes (3x on SmolLM2, 4x on Mistral-7B).
    """

    capacity: int | float | None = 1024
    window_size: int = 32
    per_query_head: bool = False
    pooling: str | None = None  # selection.pool_votes over positions, before the GQA reduction
    kernel_size: int = 1
    gqa: str = "mean"  # how a KV head's query heads' pooled scores combine into its one selection: "mean" or "max"
    # True: scores of successive prompt chunks add up (accumulated attention); False: the last chunk's stand.
    accumulates: ClassVar[bool] = False
    # Extra forward passes over the prompt that scoring needs (0: the prefill's own attention calls suffice).
    extra_passes: ClassVar[int] = 0

    def __post_init__(self):
        if not isinstance(self.window_size, int) or self.window_size < 1:
            raise ValueError(f"window_size must be a positive int, got {self.window_size!r}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {self.pooling!r}")
        if self.gqa not in GQA_REDUCTIONS:
            raise ValueError(f"gqa must be one of {GQA_REDUCTIONS}, got {self.gqa!r}")
        if not isinstance(self.kernel_size, int) or self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be a positive odd int (pooling keeps positions centred), got {self.kernel_size!r}")
        if isinstance(self.capacity, float):
            if not 0 < self.capacity < 1:
                raise ValueError(f"a capacity ratio must lie in (0, 1), got {self.capacity}")
        elif self.capacity is not None:
            if not isinstance(self.capacity, int) or self.capacity < 1:
                raise ValueError(f"capacity must be a positive int, a ratio in (0, 1) or None, got {self.capacity!r}")
            if self.window_size >= self.capacity:
                raise ValueError(
                    f"window_size ({self.window_size}) must be smaller than capacity ({self.capacity}): the cache keeps "
                    "the whole observation window plus at least one selected prefix position."
                )

    @property
    def name(self) -> str:
        return type(self).__name__

    def _settings(self) -> str:
        """Every parameter but the capacity that differs from the class default, as `k=v, ...`."""
        return ", ".join(self._differences(type(self)(), skip=("capacity",)))

    def _differences(self, default: Policy, skip) -> list[str]:
        """`name=value` of every field outside `skip` whose value differs from `default`'s."""
        return [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                if f.name not in skip and getattr(self, f.name) != getattr(default, f.name, _ABSENT)]

    @property
    def scorer_label(self) -> str:
        """The policy without its budget: equal labels, equal scores (a score table's key)."""
        settings = self._settings()
        return f"{self.name}({settings})" if settings else self.name

    @property
    def label(self) -> str:
        """Identity for tables: name, every non-default parameter, budget. Two configurations never share one."""
        return self.scorer_label if self.capacity is None else f"{self.scorer_label}@{self.capacity}"

    @property
    def scoring_key(self) -> str:
        """The scorer alone: policies with equal keys score identically, since the budget, pooling, GQA reduction
        and layout act after scoring (in `keep`), and a subclass that only changes those defaults (FactKV of KVzip)
        scores as the class that defines the scoring. Lets extra scoring passes be shared between such variants."""
        scorer = next(c for c in type(self).__mro__ if "score" in vars(c) or "prompt_scores" in vars(c))
        settings = ", ".join(self._differences(scorer(), skip=("capacity", *SELECTION)))
        return f"{scorer.__name__}({settings})" if settings else scorer.__name__

    def budget(self, n_tokens: int) -> int | None:
        """Positions kept per head on average for an n-token prompt, or None when the prompt is left untouched."""
        if self.capacity is None:
            return None
        budget = math.floor(self.capacity * n_tokens) if isinstance(self.capacity, float) else self.capacity
        if n_tokens <= budget:
            return None
        if budget <= self.window_size:
            raise ValueError(
                f"capacity ratio {self.capacity} of a {n_tokens}-token prompt keeps {budget} positions, no more than "
                f"window_size ({self.window_size}); use a larger ratio or a token budget."
            )
        return budget

    def layer_budget(self, n_tokens: int, layer: int, n_layers: int) -> int:
        """Positions kept per head in `layer` (the same in every layer unless a policy says otherwise)."""
        return self.budget(n_tokens)

    def score(self, call: AttentionCall) -> torch.Tensor | None:
        """(heads or kv_heads, n_keys) float32 scores of the key positions, higher kept first."""
        raise NotImplementedError

    def keep(self, scores: torch.Tensor, n_tokens: int, kv_heads: int, layer: int, n_layers: int) -> torch.Tensor:
        """Kept positions (kv_heads, or heads if per_query_head, budget) long, sorted ascending: the top prefix
        positions by pooled scores, then the window. Call only when budget(n) is not None."""
        budget = self.layer_budget(n_tokens, layer, n_layers)
        prefix_len = n_tokens - self.window_size
        picked = select(scores[:, :prefix_len], budget - self.window_size, pooling=self.pooling,
                        kernel_size=self.kernel_size, kv_heads=self._reduce_to(scores, kv_heads), gqa=self.gqa)
        return with_window(picked, prefix_len, n_tokens)

    def _reduce_to(self, scores: torch.Tensor, kv_heads: int) -> int | None:
        """The `kv_heads` argument of `select`: None keeps one selection per row of `scores`."""
        return None if self.per_query_head or scores.shape[0] == kv_heads else kv_heads


def with_window(picked: torch.Tensor, prefix_len: int, n_tokens: int) -> torch.Tensor:
    """(rows, k) picked prefix positions, then the window's positions prefix_len..n_tokens-1: (rows, k + window)."""
    window = torch.arange(prefix_len, n_tokens, device=picked.device).expand(picked.shape[0], -1)
    return torch.cat([picked, window], dim=-1)


@dataclass
class FullCache(Policy):
    """No compression (the reference)."""

    capacity: int | float | None = None

    def score(self, call):
        return None
