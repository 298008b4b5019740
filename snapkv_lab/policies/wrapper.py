"""What policies that wrap another policy share (AdaKV, ChunkKV, CriticalKV, DecodingEviction).

The wrapper's budget is the one that counts: its capacity and per_query_head are copied onto the inner policy (an
inner policy given a capacity of its own, with none given to the wrapper, is refused: base._PolicyCalls), and
its kept_tail when set (None, the default, leaves the inner policy's own: SnapKV's is its observation window). The
inner policy's pooling, kernel_size, gqa and observation window (`SnapKV(window_size=64)`) stay its own. A wrapper
changes one step of the inner policy's pipeline (see base): AdaKV the budgets per head, ChunkKV and CriticalKV the
ranking; every other step, scoring included (extra forward passes too, e.g. KVzip's, and the final hidden states
Surprisal reads), is the inner policy's. So wrappers compose with any scorer and with each other:
CriticalKV(policy=AdaKV(policy=SnapKV())) is kvpress's CriticalAdaKV.

The allocation wrappers (PyramidAllocation, GlobalAllocation, DuoAllocation; AdaKV and HeadKV too) move one budget
between layers or heads; those that start from the uniform allocation refuse an inner policy with budgets of its own
(`own_allocation`), which they would silently override.

The wrappers that keep what their inner policy keeps (`keeps_inner_selection`: KIVI, ThinK, Merging, KeyRerotation)
call its own `keep` and `keep_layers`, so its rule is carried whole (ChunkKV's whole chunks; KVzip's, FastKVzip's and
KVCompose's one selection across layers). Every other wrapper ranks and budgets each layer by itself: it ranks by the
inner policy's `ranked` (ChunkKV's is its chunk order) and refuses an inner policy that selects across layers
(`Policy.selects_across_layers`), which it would silently replace (KVzip(allocation="uniform") is the one it can wrap),
or whose `keep` follows a rule its `ranked` does not carry (`Policy.keeps_by_ranking`: EntropyGatedChunkKV's gate).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from .base import AttentionCall, FullCache, LayerBudget, Policy, Prompt
from .snapkv import SnapKV


def _inner(name: str) -> property:
    """A wrapper's read-only attribute that is its inner policy's."""
    return property(lambda self: getattr(self.policy, name), doc=f"The inner policy's `{name}`.")


@dataclass
class Wrapper(Policy):
    """Base of wrappers: `policy` scores, the subclass decides what is kept from its ranking."""

    policy: Policy = field(default_factory=SnapKV)
    kept_tail: int | None = None  # None: the inner policy's own

    # True: this wrapper keeps exactly the positions its inner policy keeps, by the inner policy's own `keep` and
    # `keep_layers` (a selection across layers included), and changes how they are stored (KIVI, ThinK) or what their
    # keys and values hold (Merging, KeyRerotation).
    keeps_inner_selection: ClassVar[bool] = False

    def __post_init__(self):
        if not isinstance(self.policy, Policy) or isinstance(self.policy, FullCache):
            raise TypeError(f"{self.name} wraps a scoring policy (SnapKV, H2O, KVzip, AdaKV(...), ...), got "
                            f"{self.policy!r}")
        if self.policy.layers_share_budget:
            raise TypeError(f"{self.name} keeps each layer's budget as the inner policy's layer_budget gives it, and "
                            f"{self.policy.name} shares its budget across layers from every layer's scores: it cannot "
                            "be wrapped")
        if not self.policy.capacity_sets_entries:
            raise TypeError(f"{self.name} keeps what its budget allows, and {self.policy.name} keeps what it decides "
                            "itself (lazy layers, a threshold), whatever the capacity: it cannot be wrapped")
        if self.pooling is not None or self.kernel_size != 1 or self.gqa != "mean":
            raise ValueError(f"{self.name} ranks positions by its inner policy's pooling and GQA reduction: set them "
                             f"on the inner policy ({self.policy.name}(pooling=..., gqa=...)), not on {self.name}")
        if self.policy.selects_across_layers and not self.keeps_inner_selection:
            raise TypeError(f"{self.name} ranks and budgets each layer by itself, and {self.policy.name} selects "
                            "across layers, which it would silently replace: wrap a per-layer policy "
                            "(KVzip(allocation='uniform'), not KVzip())")
        if not (self.policy.keeps_by_ranking or self.keeps_inner_selection):
            raise TypeError(f"{self.name} ranks by {self.policy.name}'s ranking, which does not carry the rule its "
                            f"keep follows, so that rule would be silently dropped: put {self.policy.name} outermost")
        self.policy = dataclasses.replace(self.policy, **self.shared())
        super().__post_init__()

    def shared(self) -> dict:
        """The settings this wrapper sets on its inner policy: its budget, layout and (when set) kept tail."""
        return dict(capacity=self.capacity, per_query_head=self.per_query_head,
                    **({} if self.kept_tail is None else {"kept_tail": self.kept_tail}))

    # Everything the inner policy decides about scoring is the wrapper's too.
    accumulates = _inner("accumulates")
    needs = _inner("needs")
    scores_query_heads = _inner("scores_query_heads")
    voters = _inner("voters")
    scoring_key = _inner("scoring_key")
    storage = _inner("storage")
    budget_in_scores = _inner("budget_in_scores")

    @property
    def selects_across_layers(self) -> bool:
        return self.policy.selects_across_layers if self.keeps_inner_selection else super().selects_across_layers

    @property
    def keeps_by_ranking(self) -> bool:
        return self.policy.keeps_by_ranking if self.keeps_inner_selection else type(self).keep is Wrapper.keep

    def keep(self, scores: torch.Tensor, budget: LayerBudget) -> torch.Tensor:
        return self.policy.keep(scores, budget) if self.keeps_inner_selection else super().keep(scores, budget)

    def keep_layers(self, scores: dict[int, torch.Tensor], budget: LayerBudget) -> dict[int, torch.Tensor]:
        if self.keeps_inner_selection:
            return self.policy.keep_layers(scores, budget)
        return super().keep_layers(scores, budget)

    def score(self, call: AttentionCall):
        return self.policy.score(call)

    def prompt_scores(self, prompt: Prompt) -> dict[int, torch.Tensor]:
        return self.policy.prompt_scores(prompt)

    def prepare(self, model, tokenizer) -> None:
        self.policy.prepare(model, tokenizer)

    def tail(self, budget: int) -> int:
        return self.policy.tail(budget)

    def layer_budget(self, budget: LayerBudget) -> int:
        return self.policy.layer_budget(budget)  # same capacity: a per-layer budget carries over

    def ranked(self, scores, budget: LayerBudget):
        return self.policy.ranked(scores, budget)

    def head_budgets(self, scores, budget: LayerBudget):
        return self.policy.head_budgets(scores, budget)

    def merge(self, key, value, kept):
        return self.policy.merge(key, value, kept)  # a merging inner policy merges what the wrapper keeps

    def rekey(self, key, kept, module):
        return self.policy.rekey(key, kept, module)  # as merge: an inner policy's keys for what the wrapper keeps

    def decode_window(self, n_tokens: int) -> tuple[int, int] | None:
        # The inner policy's heads roll on (DuoAttention's streaming heads) where the wrapper keeps its selection
        # (KIVI, ThinK, Merging, KeyRerotation): once, they froze silently under the inner policy's label.
        return self.policy.decode_window(n_tokens) if self.keeps_inner_selection else super().decode_window(n_tokens)

    def _inner_settings(self, like: Policy | None = None) -> str:
        """The inner policy as written: its name and its settings that differ from `like`'s (the default wrapper's
        inner policy where it is of the same class, else that class's defaults), the settings the wrapper sets for it
        left out: e.g. `SnapKV(kernel_size=5)`, `AdaKV(policy=KNorm)`, or HeadKV's `SnapKV(window_size=32)` (its
        default inner policy has the official window of 8)."""
        inner, shared = self.policy, self.shared()
        like = like if type(like) is type(inner) else type(inner)()
        defaults = dataclasses.replace(like, **{**shared, "capacity": None})  # skipped below; None fits any window
        settings = inner._settings_against(defaults) if isinstance(inner, Wrapper) else \
            ", ".join(inner._differences(defaults, tuple(shared)))
        return f"{inner.name}({settings})" if settings else inner.name

    def _settings_against(self, default: Wrapper) -> str:
        inner = self._inner_settings(default.policy)
        parts = [f"policy={inner}"] if inner != default._inner_settings(default.policy) else []
        parts += self._differences(default, skip=("capacity", "policy"))
        return ", ".join(parts)

    def _settings(self) -> str:
        return self._settings_against(type(self)())


def policy_chain(policy: Policy) -> Iterator[Policy]:
    """`policy` and every policy it wraps, outermost first."""
    yield policy
    while isinstance(policy, Wrapper):
        policy = policy.policy
        yield policy


def own_allocation(policy: Policy) -> str | None:
    """The name of the policy, `policy` or one it wraps, that sets budgets of its own per layer or per head (PyramidKV,
    AdaKV, HeadKV, DuoAttention, an allocation wrapper, CAKE), or None where every layer and head keeps the uniform
    budget. A selection across layers (KVzip's global one) is not counted here: `Wrapper` refuses it already, unless
    the wrapper keeps it whole (module doc)."""
    for inner in policy_chain(policy):
        base = Wrapper if isinstance(inner, Wrapper) else Policy
        cls = type(inner)
        if cls.layer_budget is not base.layer_budget or cls.head_budgets is not base.head_budgets or \
                inner.layers_share_budget:
            return inner.name
    return None


def refuse_own_allocation(wrapper: Wrapper, does: str, example: str) -> None:
    """TypeError where the policy `wrapper` wraps sets budgets of its own (own_allocation), which `wrapper`, whose
    budgeting `does` says in words, would silently override; `example`: a wrapping that works."""
    owner = own_allocation(wrapper.policy)
    if owner is not None:
        raise TypeError(f"{type(wrapper).__name__} {does}, and {owner} sets budgets of its own, which it would "
                        f"override: wrap the scorer ({example})")
