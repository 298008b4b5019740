"""What every compression policy shares: its budget, what it scores, and how scores become kept positions.

A policy scores the prompt's key positions once, at prefill, and keeps `capacity` of them per KV head:
the top-ranked prefix positions plus its kept tail, the last `tail(budget)` prompt tokens (always kept; SnapKV's
tail is its observation window, the `window_size` queries that vote). The pipeline, each step a method that a policy
may override, `budget` a LayerBudget (the prompt's length, the KV heads, the layer, the policy's budget in tokens):

    policy.score(call: AttentionCall) -> (heads or kv_heads, n_keys) float32, higher kept first; None: keep all
    policy.prompt_scores(prompt: Prompt) -> {layer: (1, rows, n)}: scores made after the prefill (see `needs`)
    policy.ranked(scores, budget)       -> (kv_heads or heads, prefix) the scores of the prefix as ranked: pooled
                                           along positions, combined over each KV head's query heads
    policy.head_budgets(scores, budget) -> (rows,) how many prefix positions each row keeps (uniform by default)
    policy.keep(scores, budget)         -> (rows, kept) sorted positions: each row's top prefix positions, the tail
    policy.keep_layers({layer: scores}, budget) -> {layer: kept}: every layer at once (budgets shared across layers)
    policy.merge(key, value, kept)      -> (kv_heads, n, head_dim) values with the evicted folded into the kept ones
                                           (merging policies); None (the default): eviction, values unchanged
    policy.rekey(key, kept, module)     -> (kv_heads, n, head_dim) keys with the kept ones rewritten (KeyRerotation:
                                           re-rotated to contiguous positions); None (the default): keys unchanged

`AttentionCall` holds what the attention call had (queries, keys, values, the module, the layer's own softmax
settings): a scorer reads what it needs and ignores the rest. A policy that needs more than one attention call
declares it in `needs` (the prefill's final hidden states, the prompt's last queries, a pass of more tokens over the
cache, a drafted answer); the engine (snapkv_lab.compression) provides it in a `Prompt` after the prefill and calls
`prompt_scores`. A score of +inf marks a protected position (attention sinks): it is always kept and is left out of
pooling, so it never spreads to its neighbours. Policies with budgets that vary by layer override `layer_budget`;
by head, `head_budgets` (rows keeping fewer positions than the widest are padded with NO_POSITION, and the layer is
stored ragged: see compression.layers.HeadwiseLayer).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ..core.attention import AttentionSettings
from ..core.checks import check_int
from ..core.selection import GQA_REDUCTIONS, POOLINGS, pool_votes, votes_per_kv_head
from .storage import Storage

SELECTION = ("pooling", "kernel_size", "gqa", "per_query_head")  # applied to scores by `keep`, with the budget
# A field's metadata flag: added after results were stored, with the former behaviour as its default, so that
# policy_config leaves it out at that default and the stored grid cells keep their keys.
ADDED_LATER = "added_later"
NO_POSITION = -1  # fills the kept positions of heads that keep fewer than the layer's widest head
_ABSENT = object()  # a field the default being compared with lacks: always a difference
# What a policy may need beyond the prefill's attention calls (`Policy.needs`; the engine provides each in a Prompt).
NEEDS = ("final_hidden", "last_queries", "feed", "draft", "layer_inputs")


@dataclass
class AttentionCall:
    """One batch row of one attention call, as a scorer sees it.

    query: (heads, rows, head_dim) post-RoPE queries of the call's new tokens (or, while decoding, the recent
        generated queries a scorer votes with).
    key, value: (kv_heads, n_keys, head_dim) the layer's whole cache so far (post-RoPE keys), one key per cache slot.
    slots: (rows,) the cache slot of each query row: row i sees the key slots 0..slots[i] (causal masks).
    positions: (rows,) the token position of each query row (what RoPE rotated it by). Equal to `slots` at
        prefill; larger once a compressed cache holds fewer slots than the tokens seen.
    attention: the layer's scaling, sliding window and soft-cap, so scores see the model's own softmax.
    module: the attention module (its projections, config, layer_idx); n_layers: layers in the model.
    carry: state a scorer keeps across the successive calls of one prompt in this layer and batch row (prompt
        chunks: a context, then a question), e.g. running query statistics. Fresh for every prompt; the
        scorer replaces its entries, never mutates them in place (forks of a prefill share them).
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    slots: torch.Tensor
    attention: AttentionSettings
    module: object
    layer: int
    n_layers: int
    positions: torch.Tensor | None = None
    carry: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.positions is None:
            self.positions = self.slots

    @property
    def n_keys(self) -> int:
        return self.key.shape[1]


class WholePromptOnly(NotImplementedError):
    """A policy that scores the whole prompt from one attention call was handed a call with fewer queries than keys (a
    prompt chunk after the first, a question fed after its context). A prefill shared by several policies records the
    refusal for that policy alone (compression.recorder), so that the others, and this one's state before the split,
    still build; its state over the split prompt is built from that prompt fed again in one call
    (compression.shared.SharedPrefill.serving). The live compressor, one policy, raises it."""


def whole_prompt(call: AttentionCall, name: str) -> None:
    """Refuse (WholePromptOnly) a call that does not hold a query for every cached key."""
    if call.query.shape[1] != call.n_keys:
        raise WholePromptOnly(f"{name} scores the whole prompt from one attention call: it must be prefilled in one "
                              f"call (as kvpress scores a prefill), and this call has {call.query.shape[1]} queries "
                              f"over {call.n_keys} keys (a chunked prefill, or a question fed after its context)")


@dataclass(frozen=True)
class LayerBudget:
    """What a policy's selection in one layer is told besides the scores (`Policy.ranked`, `head_budgets`, `keep`).

    tokens: the prompt positions scored (n). kv_heads: the layer's KV heads. layer, n_layers: which layer, of how
    many. capacity: positions kept per head on average, the policy's `budget(tokens)` (prefix picks and kept tail).
    `keep_layers` reads every layer's with `at(layer)`."""

    tokens: int
    kv_heads: int
    layer: int
    n_layers: int
    capacity: int

    def at(self, layer: int) -> LayerBudget:
        return dataclasses.replace(self, layer=layer)


@dataclass
class Prompt:
    """One prompt after its prefill, as a policy that scores after the prefill reads it (`Policy.prompt_scores`).
    The engine (compression.shared.SharedPrefill) fills in what the policy declares in `Policy.needs`; the rest is None.

    ids: (1, n) the prompt's tokens. cache: the full cache after its prefill (read it, never write it).
    final_hidden: (1, n, hidden_size) the decoder's final hidden states over the prompt ("final_hidden").
    last_queries: {layer: (query (heads, voters, head_dim), slots (voters,), AttentionSettings)} the prompt's last
        `voters` post-RoPE queries of every full-attention layer ("last_queries").
    feed(ids, positions, on_call): run `ids` (1, m) at `positions` (1, m) over a fork of `cache` (the cache itself
        unchanged), `on_call(module, query, key, value, settings)` seeing every attention call ("feed": KVzip's
        reconstruction); where on_call returns a tensor (1, m, heads, head_dim), that is the call's attention output
        (computed with its scores), else the backend computes it.
    draft(policy, scores, tokens) -> {layer: (heads, k, head_dim)}: compress `cache` by `policy` from its
        {layer: (1, rows, n)} scores, decode up to `tokens` greedy tokens over it from the prefill's own next token
        (stopping at an end of answer), and hand back the post-RoPE queries of the k tokens fed ("draft": Lookahead
        Q-Cache's pseudo queries).
    layer_inputs: {layer: (1, n, hidden_size)} every attention layer's input hidden states over the prompt (after
        the decoder layer's input norm), what a trained scorer reads ("layer_inputs": KVzap, FastKVzip).
    surprisal() -> (1, n): the model's surprisal at each prompt token, from `final_hidden` (given with it:
        policies.surprisal.token_surprisal), paid once per prompt; a prompt extended from another (a context, then its
        question) pays only its new tokens' (Surprisal).
    """

    model: object
    tokenizer: object
    ids: torch.Tensor
    cache: object
    final_hidden: torch.Tensor | None = None
    last_queries: dict | None = None
    feed: Callable | None = None
    draft: Callable | None = None
    layer_inputs: dict | None = None
    surprisal: Callable | None = None

    @property
    def n_tokens(self) -> int:
        return self.ids.shape[1]


KEPT_TAIL_RENAMED = "2026-11-26"  # window_size, where it named the last tokens kept by right, became kept_tail


def has_observation_window(policy) -> bool:
    """Whether a policy class (or policy) has `window_size`, an observation window of its own (SnapKV's family)."""
    return any(f.name == "window_size" for f in dataclasses.fields(policy))


class _PolicyCalls(type):
    """What a policy class's call checks before its dataclass __init__ (which cannot see which keywords were given).

    `window_size` as it was before the kept tail had its own name (KEPT_TAIL_RENAMED), where the class has no
    observation window of its own, warning (DeprecationWarning): TOVA(window_size=1) is TOVA(kept_tail=1), and a
    wrapper's window was its inner policy's (AdaKV(window_size=64) is AdaKV(policy=SnapKV(window_size=64))), as
    policies.upgrade_config reads stored configs.

    A wrapper's budget is its own (policies.wrapper): an inner policy given a budget of its own and no budget on the
    wrapper (ThinK(policy=SnapKV(capacity=51))) is refused, since the wrapper would silently replace it by its default.
    """

    def __call__(cls, *args, **keywords):
        fields = {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
        if "window_size" in keywords and not has_observation_window(cls):
            keywords = dict(keywords)
            value = keywords.pop("window_size")
            warnings.warn(f"{cls.__name__}(): the keyword 'window_size' is now named 'kept_tail' (since "
                          f"{KEPT_TAIL_RENAMED}; window_size is the observation window of SnapKV's family, a "
                          "wrapper's that of its inner policy)", DeprecationWarning, stacklevel=2)
            if "policy" in fields:
                inner = keywords.get("policy") or fields["policy"].default_factory()
                renamed = "window_size" if has_observation_window(inner) else "kept_tail"
                keywords["policy"] = dataclasses.replace(inner, **{renamed: value})
            elif "kept_tail" in keywords:
                raise TypeError(f"{cls.__name__}() got both 'window_size' and 'kept_tail', one keyword under its name "
                                f"before {KEPT_TAIL_RENAMED} and today's: pass 'kept_tail' alone")
            else:
                keywords["kept_tail"] = value
        inner = keywords.get("policy")
        built = super().__call__(*args, **keywords)  # its own refusals first (a policy that cannot be wrapped)
        if "policy" in fields and "capacity" not in keywords and isinstance(inner, Policy):
            inner_default = {f.name: f.default for f in dataclasses.fields(inner)}.get("capacity")
            if inner.capacity not in (fields["capacity"].default, inner_default):
                raise ValueError(f"{cls.__name__} keeps its own budget and sets it on the policy it wraps: give it "
                                 f"capacity={inner.capacity!r} ({cls.__name__}(policy={type(inner).__name__}(...), "
                                 f"capacity={inner.capacity!r})), not {type(inner).__name__}")
        return built


@dataclass
class Policy(metaclass=_PolicyCalls):
    """Base policy: keep `capacity` positions per KV head after prefill (see module doc).

    capacity: total positions kept per head (prefix picks + kept tail), as tokens (int), or as a ratio of
        the prompt (float in (0, 1)); None keeps everything. Prompts at or below it are left untouched.
    kept_tail: the last prompt tokens, always kept, outside the scores; 0 keeps none. None is allowed where a
        policy derives its tail from something else (`tail`): SnapKV's family keeps its observation window
        (`window_size`, the voters), H2O the recent half of its budget. The base default 32 is the lab's baselines'
        (StreamingLLM, RandomKeep, Surprisal: SnapKV's tail, for comparison); each published method sets its authors'.
    per_query_head: False (default) pools the scores of each GQA group and keeps one selection per KV
        head, so a GQA cache really shrinks. True reproduces the official SnapKV code: the KV heads are
        repeated and each query head keeps its own selection, a cache of `heads / kv_heads` times more
        bytes (3x on SmolLM2, 4x on Mistral-7B). Refused by scorers that score KV heads, not query heads.
    """

    capacity: int | float | None = 1024
    kept_tail: int | None = 32
    per_query_head: bool = False
    pooling: str | None = None  # selection.pool_votes over positions, before the GQA reduction
    kernel_size: int = 1
    gqa: str = "mean"  # how a KV head's query heads' pooled scores combine into its one selection: "mean" or "max"
    # True: scores of successive prompt chunks add up (accumulated attention); False: the last chunk's stand.
    accumulates: ClassVar[bool] = False
    # What scoring needs beyond the prefill's attention calls, among NEEDS (see `Prompt`); a policy that needs any
    # scores after the prefill (`prompt_scores`), never inside a layer's attention call.
    needs: ClassVar[frozenset[str]] = frozenset()
    # False: `score` gives one row per KV head (or one row shared by all heads), so per_query_head has no meaning.
    scores_query_heads: ClassVar[bool] = True
    # True: each layer's budget depends on every layer's scores (CAKE), so the cache is compressed once the whole
    # prompt is prefilled, from the scores its attention calls recorded, never layer by layer as the prefill runs.
    layers_share_budget: ClassVar[bool] = False
    # False: what the cache holds is the method's own decision, not its capacity (SimLayerKV keeps every position of a
    # layer it finds busy, DMS what scores above its threshold): its entries are counted against the full cache.
    capacity_sets_entries: ClassVar[bool] = True

    @property
    def budget_in_scores(self) -> bool:
        """True where `score` reads the budget (Compactor's blending, CAM's and DuoAttention's sinks), so that policies
        differing only in budget score differently and never share a score table (`score_table`, `scoring_key`)."""
        return False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _read_old_budget_arguments(cls)

    def __post_init__(self):
        if self.kept_tail is None:  # allowed where `tail` derives it (SnapKV: its window; H2O: the recent half)
            if type(self).tail is Policy.tail:
                raise ValueError(f"{self.name} needs an int kept_tail, got None")
        else:
            check_int("kept_tail", self.kept_tail)
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {self.pooling!r}")
        if self.gqa not in GQA_REDUCTIONS:
            raise ValueError(f"gqa must be one of {GQA_REDUCTIONS}, got {self.gqa!r}")
        if not (isinstance(self.kernel_size, int) and self.kernel_size >= 1 and self.kernel_size % 2):
            raise ValueError(f"kernel_size must be a positive odd int (pooling keeps positions centred), got "
                             f"{self.kernel_size!r}")
        if self.per_query_head and not self.scores_query_heads:
            raise ValueError(f"{self.name} scores KV heads (or positions), not query heads: per_query_head=True would "
                             "only repeat one selection per query head")
        if isinstance(self.capacity, float):
            if not 0 < self.capacity < 1:
                raise ValueError(f"a capacity ratio must lie in (0, 1), got {self.capacity}")
        elif self.capacity is not None:
            check_int("capacity", self.capacity, 1, why=", a ratio in (0, 1) or None")
            if self.tail(self.capacity) >= self.capacity:
                raise ValueError(
                    f"{self.tail_setting(self.capacity)} must be smaller than capacity ({self.capacity}): the cache "
                    "keeps the whole tail plus at least one selected prefix position."
                )

    @property
    def name(self) -> str:
        return type(self).__name__

    @property
    def scores_after_prefill(self) -> bool:
        """Whether scoring needs more than the prefill's attention calls (`needs`): then it runs after the prefill."""
        return bool(self.needs)

    @property
    def storage(self) -> Storage | None:
        """What of each kept position the cache holds (ThinK's key channels, KIVI's bits), None: every channel in
        full precision (policies.storage)."""
        return None

    @property
    def reads_final_hidden(self) -> bool:
        """Whether the prefill must keep the decoder's final hidden states for this policy (Surprisal,
        LookaheadQCache)."""
        return "final_hidden" in self.needs

    @property
    def reads_layer_inputs(self) -> bool:
        """Whether the prefill must keep every attention layer's input hidden states for this policy (KVzap)."""
        return "layer_inputs" in self.needs

    @property
    def compresses_after_prefill(self) -> bool:
        """Whether the cache can only be compressed after the whole prefill (scores from the whole prompt, or one
        selection across layers): such a policy runs in `generate` and `compare`, never inside `model.generate`."""
        return self.scores_after_prefill or self.selects_across_layers

    @property
    def selects_across_layers(self) -> bool:
        """Whether `keep_layers` makes one selection over every layer's and KV head's scores (KVzip's and FastKVzip's
        allocation="global", KVCompose, CAKE, GlobalAllocation), so that layers and heads keep different counts, rather
        than each layer by `keep`."""
        return self.layers_share_budget

    @property
    def keeps_by_ranking(self) -> bool:
        """Whether `keep` keeps each row's top positions by `ranked` (Policy.keep), so that a wrapper ranking by this
        policy's `ranked` keeps by its rule; False where `keep` follows a rule that `ranked` does not carry
        (EntropyGatedChunkKV's entropy gate). ChunkKV's `ranked` is its chunk order."""
        return type(self).keep is Policy.keep

    @property
    def voters(self) -> int:
        """How many of the last queries `score` votes with (SnapKV: its observation window; TOVA: the last one), or
        `prompt_scores` reads after the prefill (LookaheadQCache's draft window); 0 when it reads none of them, or all
        of a chunk's (accumulated attention). A prompt chunk shorter than this is scored with the previous chunks' last
        queries in front (compression.recorder)."""
        return 0

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
    def score_table(self) -> str:
        """The key of this policy's scores in a recorder (compression.recorder): its scorer_label, so that policies
        differing only in budget share one table; its label, budget included, where its scores read the budget
        (`budget_in_scores`)."""
        return self.label if self.budget_in_scores else self.scorer_label

    @property
    def label(self) -> str:
        """Identity for tables: name, every non-default parameter, budget. Two configurations never share one."""
        return self.scorer_label if self.capacity is None else f"{self.scorer_label}@{self.capacity}"

    @property
    def scoring_key(self) -> str:
        """The scorer alone: policies with equal keys score identically, since the budget, pooling, GQA reduction
        and layout act after scoring (in `keep`), and a subclass that only changes those defaults (FactKV of KVzip)
        scores as the class that defines the scoring. Lets scores made after the prefill be shared between such
        variants; a policy whose scores read its budget (`budget_in_scores`) adds it."""
        scorer = next(c for c in type(self).__mro__ if "score" in vars(c) or "prompt_scores" in vars(c))
        settings = self._differences(scorer(), skip=("capacity", *SELECTION))
        if self.budget_in_scores:
            settings.append(f"capacity={self.capacity!r}")
        return f"{scorer.__name__}({', '.join(settings)})" if settings else scorer.__name__

    def budget(self, n_tokens: int) -> int | None:
        """Positions kept per head on average for an n-token prompt, or None when the prompt is left untouched."""
        if self.capacity is None:
            return None
        budget = math.floor(self.capacity * n_tokens) if isinstance(self.capacity, float) else self.capacity
        if n_tokens <= budget:
            return None
        if budget <= self.tail(budget):
            raise ValueError(
                f"capacity ratio {self.capacity} of a {n_tokens}-token prompt keeps {budget} positions, no more than "
                f"the kept tail ({self.tail(budget)}); use a larger ratio or a token budget."
            )
        return budget

    def layer_budget_of(self, n_tokens: int, kv_heads: int, n_layers: int) -> LayerBudget | None:
        """The LayerBudget of an n-token prompt (at layer 0: `at(layer)` for another), None when it fits."""
        capacity = self.budget(n_tokens)
        return None if capacity is None else LayerBudget(n_tokens, kv_heads, 0, n_layers, capacity)

    def prepare(self, model, tokenizer) -> None:
        """Make what scoring needs from the model itself before its first prefill (QFilters: its query directions,
        calibrated once per model and cached). Called by every entry point (generate, compress, compare's shared
        prefill); tokenizer may be None (compress), which such a policy refuses only if nothing is cached yet."""

    def tail(self, budget: int) -> int:
        """The kept tail under a budget of `budget` positions: the last prompt tokens always kept (H2O: its recent
        half; SnapKV: its observation window)."""
        return self.kept_tail

    def tail_setting(self, budget: int) -> str:
        """The kept tail under `budget`, named by the setting that makes it, for messages."""
        return f"the kept tail ({self.tail(budget)} tokens)"

    def layer_budget(self, budget: LayerBudget) -> int:
        """Positions kept per head in `budget.layer` (the same in every layer unless a policy says otherwise)."""
        return budget.capacity

    def decode_window(self, n_tokens: int) -> tuple[int, int] | None:
        """(sinks, recent) for a policy whose heads that kept less than their whole n-token prompt go on as a rolling
        window after the prefill (DuoAttention's streaming heads): at every later call such a head sees its first
        `sinks` positions, the `recent` positions before the call's first token, and the call's own tokens; None (the
        default) when what the prefill kept stays (the engine: compression.layers.RollingWindow)."""
        return None

    def score(self, call: AttentionCall) -> torch.Tensor | None:
        """(heads or kv_heads, n_keys) float32 scores of the key positions, higher kept first; +inf: always kept."""
        raise NotImplementedError

    def prompt_scores(self, prompt: Prompt) -> dict[int, torch.Tensor]:
        """{layer: (1, rows, n)} float32 scores of one prompt made after its prefill, for a policy that `needs` more
        than the prefill's attention calls (KVzip, Surprisal, LookaheadQCache)."""
        raise NotImplementedError(f"{self.name} scores at the prefill's attention calls (`score`)")

    def prefix_len(self, budget: LayerBudget) -> int:
        """Positions before the kept tail of `budget.layer`, among which the budget is chosen."""
        return budget.tokens - self.tail(self.layer_budget(budget))

    def ranked(self, scores: torch.Tensor, budget: LayerBudget) -> torch.Tensor:
        """The prefix's scores as `keep` ranks them, (kv_heads, or heads if per_query_head, prefix_len) float32: pooled
        along positions (protected +inf positions left out of the pooling, then restored), then combined over
        each KV head's query heads with `gqa`."""
        pooled = scores[:, : self.prefix_len(budget)].float()
        if self.pooling is not None and self.kernel_size > 1:
            protected = pooled == math.inf
            pooled = pool_votes(pooled.masked_fill(protected, 0.0), self.pooling, self.kernel_size).masked_fill(
                protected, math.inf)
        rows = self._reduce_to(pooled, budget.kv_heads)
        return pooled if rows is None else votes_per_kv_head(pooled, rows, self.gqa)

    def head_budgets(self, scores: torch.Tensor, budget: LayerBudget) -> list[int]:
        """How many prefix positions each row of `ranked` keeps (the same for every row unless a policy says
        otherwise): a list of ints, one per row."""
        layer_budget = self.layer_budget(budget)
        return [layer_budget - self.tail(layer_budget)] * self.ranked_rows(scores, budget)

    def ranked_rows(self, scores: torch.Tensor, budget: LayerBudget) -> int:
        """The rows `ranked` gives for `scores`: the KV heads, or each row of scores where they are not reduced."""
        return scores.shape[0] if self._reduce_to(scores, budget.kv_heads) is None else budget.kv_heads

    def keep(self, scores: torch.Tensor, budget: LayerBudget) -> torch.Tensor:
        """Kept positions (kv_heads, or heads if per_query_head, widest) long: each row its top `head_budgets`
        prefix positions by `ranked` (ascending), then the kept tail, then NO_POSITION padding when rows keep
        different counts."""
        return top_positions(self.ranked(scores, budget), self.head_budgets(scores, budget), budget.tokens)

    def keep_layers(self, scores: dict[int, torch.Tensor], budget: LayerBudget) -> dict[int, torch.Tensor]:
        """{layer: kept} for every layer of `scores` ({layer: (rows, n_keys)}, one batch row), each by `keep`. A policy
        whose budgets are shared across layers (KVzip) overrides this; the live compressor, which sees one layer at
        a time, refuses such a policy."""
        return {layer: self.keep(layer_scores, budget.at(layer)) for layer, layer_scores in scores.items()}

    def merge(self, key: torch.Tensor, value: torch.Tensor, kept: torch.Tensor) -> torch.Tensor | None:
        """(kv_heads, n, head_dim) `value` with the kept positions' values rewritten by what the evicted positions
        fold into them, for a policy that merges instead of evicting (Merging); None, the default, leaves every value
        as it is. key, value: one batch row's layer, (kv_heads, n, head_dim) post-RoPE keys and values; kept:
        (kv_heads, k) the positions `keep` chose, NO_POSITION after a head's last. The engine then stores the kept
        positions alone, from these values (compression.engine.merged_values), so a merged cache holds no more
        bytes than an evicted one."""
        return None

    def rekey(self, key: torch.Tensor, kept: torch.Tensor, module) -> torch.Tensor | None:
        """(kv_heads, n, head_dim) `key` with the kept positions' keys rewritten, for a policy that changes the keys it
        keeps (KeyRerotation: re-rotated to contiguous positions); None, the default, leaves every key as it is. The
        keys' counterpart of `merge`, with its arguments (key: one batch row's layer, its own slots; kept: (kv_heads,
        k), NO_POSITION after a head's last) and the layer's attention `module` (its RoPE); the engine stores the kept
        positions from these keys (compression.engine.rekeyed)."""
        return None

    def _reduce_to(self, scores: torch.Tensor, kv_heads: int) -> int | None:
        """The KV heads to reduce `scores`' rows onto, or None to keep one selection per row."""
        return None if self.per_query_head or scores.shape[0] == kv_heads else kv_heads


# The pipeline's methods and where their LayerBudget stands among their arguments (after the scores or first). Before
# 2026-11-28 they took (n_tokens, kv_heads, layer, n_layers) (`layer_budget` and `prefix_len`: (n_tokens, layer,
# n_layers); `keep_layers`: (n_tokens, kv_heads, n_layers)): a call written so still runs, with a DeprecationWarning.
_BUDGET_ARGUMENT = {"layer_budget": 0, "prefix_len": 0, "ranked": 1, "head_budgets": 1, "keep": 1, "keep_layers": 1}


def _read_old_budget_arguments(cls) -> None:
    """Let each pipeline method `cls` defines take its former arguments too (see _BUDGET_ARGUMENT)."""
    for name, at in _BUDGET_ARGUMENT.items():
        method = vars(cls).get(name)
        if method is None or getattr(method, "_reads_old_arguments", False):
            continue

        @functools.wraps(method)
        def reading(self, *args, _method=method, _name=name, _at=at, **kwargs):
            if len(args) > _at and isinstance(args[_at], int):
                args = (*args[:_at], _old_budget(self, _name, args[_at:]))
            return _method(self, *args, **kwargs)

        reading._reads_old_arguments = True
        setattr(cls, name, reading)


def _old_budget(policy: Policy, name: str, old: tuple) -> LayerBudget:
    warnings.warn(f"{policy.name}.{name} takes a LayerBudget now, not (n_tokens, kv_heads, layer, n_layers)",
                  DeprecationWarning, stacklevel=4)
    if name in ("layer_budget", "prefix_len"):
        (n_tokens, layer, n_layers), kv_heads = old, 0
    elif name == "keep_layers":
        (n_tokens, kv_heads, n_layers), layer = old, 0
    else:
        n_tokens, kv_heads, layer, n_layers = old
    return LayerBudget(n_tokens, kv_heads, layer, n_layers, policy.budget(n_tokens))


_read_old_budget_arguments(Policy)


def top_positions(ranked: torch.Tensor, budgets: list[int], n_tokens: int) -> torch.Tensor:
    """(rows, prefix) ranked scores and one prefix budget per row -> (rows, widest) long: each row's top budget
    prefix positions ascending, then the kept tail prefix..n_tokens-1, then NO_POSITION padding."""
    prefix = ranked.shape[-1]
    widest = max(budgets)
    picked = ranked.topk(widest, dim=-1).indices if widest else ranked.new_zeros(ranked.shape[0], 0, dtype=torch.long)
    tail = torch.arange(prefix, n_tokens, device=ranked.device)
    if all(b == widest for b in budgets):
        return with_tail(picked.sort(dim=-1).values, prefix, n_tokens)
    rows = [torch.cat([picked[r, :b].sort().values, tail, picked.new_full((widest - b,), NO_POSITION)])
            for r, b in enumerate(budgets)]
    return torch.stack(rows)


def prefix_share(ratio: float, prefix_budget: int, tail: int) -> int:
    """kvpress's share int(ratio * B) of a head's whole budget B = prefix_budget + tail, as prefix positions: its
    scorers give the kept tail the maximum score, so the tail takes the first `tail` of the share (AdaKVPress's
    safeguard, CriticalKVPress's first stage)."""
    return max(0, int(ratio * (prefix_budget + tail)) - tail)


def with_tail(picked: torch.Tensor, prefix_len: int, n_tokens: int) -> torch.Tensor:
    """(rows, k) picked prefix positions, then the kept tail's positions prefix_len..n_tokens-1: (rows, k + tail)."""
    tail = torch.arange(prefix_len, n_tokens, device=picked.device).expand(picked.shape[0], -1)
    return torch.cat([picked, tail], dim=-1)


def budget_past_sinks(policy: Policy, n_tokens: int) -> int | None:
    """`policy.budget(n_tokens)` through Policy's own rule, refused where it holds no more than the policy's n_sink
    sinks (which it always keeps): such a budget leaves it no position to choose."""
    budget = Policy.budget(policy, n_tokens)
    if budget is not None and budget <= policy.n_sink:
        raise ValueError(f"{type(policy).__name__} always keeps its n_sink = {policy.n_sink} sinks: a budget of "
                         f"{budget} positions for a {n_tokens}-token prompt leaves none to choose")
    return budget


@dataclass
class FullCache(Policy):
    """No compression (the reference)."""

    capacity: int | float | None = None

    def score(self, call):
        return None
