"""What policies that wrap another policy share (AdaKV, ChunkKV, CriticalKV, DecodingEviction).

The wrapper's budget is the one that counts: its capacity, window_size and per_query_head are copied onto the
inner policy (SnapKV's observation window is then the kept window, as in SnapKV alone; window_size left at None
takes the inner policy's own). The inner policy's pooling, kernel_size and gqa stay its own. A wrapper changes one
step of the inner policy's pipeline (see base): AdaKV the budgets per head, ChunkKV and CriticalKV the ranking;
every other step, scoring included (extra forward passes too, e.g. KVzip's, and the final hidden states Surprisal
reads), is the inner policy's. So wrappers compose with any scorer and with each other:
CriticalKV(policy=AdaKV(policy=SnapKV())) is kvpress's CriticalAdaKV.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from .base import AttentionCall, FullCache, Policy
from .snapkv import SnapKV

SHARED = ("capacity", "window_size", "per_query_head")  # set on the inner policy by the wrapper


def _inner(name: str) -> property:
    """A wrapper's read-only attribute that is its inner policy's."""
    return property(lambda self: getattr(self.policy, name), doc=f"The inner policy's `{name}`.")


@dataclass
class Wrapper(Policy):
    """Base of wrappers: `policy` scores, the subclass decides what is kept from its ranking."""

    policy: Policy = field(default_factory=SnapKV)
    window_size: int | None = None  # None: the inner policy's own window

    def __post_init__(self):
        if not isinstance(self.policy, Policy) or isinstance(self.policy, FullCache):
            raise TypeError(f"{self.name} wraps a scoring policy (SnapKV, H2O, KVzip, AdaKV(...), ...), got {self.policy!r}")
        if self.window_size is None:
            self.window_size = self.policy.window_size
        super().__post_init__()
        if self.pooling is not None or self.kernel_size != 1 or self.gqa != "mean":
            raise ValueError(f"{self.name} ranks positions by its inner policy's pooling and GQA reduction: set them on "
                             f"the inner policy ({self.policy.name}(pooling=..., gqa=...)), not on {self.name}")
        self.policy = dataclasses.replace(self.policy, **{name: getattr(self, name) for name in SHARED})

    # Everything the inner policy decides about scoring is the wrapper's too.
    accumulates = _inner("accumulates")
    scores_after_prefill = _inner("scores_after_prefill")
    reads_final_hidden = _inner("reads_final_hidden")
    scores_query_heads = _inner("scores_query_heads")
    voters = _inner("voters")
    scoring_key = _inner("scoring_key")

    def score(self, call: AttentionCall):
        return self.policy.score(call)

    def prompt_scores(self, model, tokenizer, ids: torch.Tensor, cache) -> dict[int, torch.Tensor]:
        return self.policy.prompt_scores(model, tokenizer, ids, cache)

    def prepare(self, model, tokenizer) -> None:
        self.policy.prepare(model, tokenizer)

    def window(self, budget: int) -> int:
        return self.policy.window(budget)

    def layer_budget(self, n_tokens: int, layer: int, n_layers: int) -> int:
        return self.policy.layer_budget(n_tokens, layer, n_layers)  # same capacity: a per-layer budget carries over

    def ranked(self, scores, n_tokens, kv_heads, layer, n_layers):
        return self.policy.ranked(scores, n_tokens, kv_heads, layer, n_layers)

    def head_budgets(self, scores, n_tokens, kv_heads, layer, n_layers):
        return self.policy.head_budgets(scores, n_tokens, kv_heads, layer, n_layers)

    def _inner_settings(self) -> str:
        """The inner policy as written: its name and the settings the wrapper does not set for it, e.g.
        `SnapKV(kernel_size=5)` or `AdaKV(policy=KNorm)`."""
        inner = self.policy
        defaults = type(inner)(**{name: getattr(inner, name) for name in SHARED})
        settings = inner._settings_against(defaults) if isinstance(inner, Wrapper) else \
            ", ".join(inner._differences(defaults, SHARED))
        return f"{inner.name}({settings})" if settings else inner.name

    def _settings_against(self, default: Wrapper) -> str:
        parts = [f"policy={self._inner_settings()}"] if type(self.policy) is not type(default.policy) or \
            self._inner_settings() != default._inner_settings() else []
        skip = ("capacity", "policy") + (("window_size",) if self.window_size == self.policy_default_window() else ())
        parts += self._differences(default, skip=skip)
        return ", ".join(parts)

    def policy_default_window(self) -> int | None:
        """The window the inner policy's class keeps by default (what window_size=None resolves to)."""
        return type(self.policy)().window_size

    def _settings(self) -> str:
        return self._settings_against(type(self)())
