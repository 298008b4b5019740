"""A compressed cache in use: what the prefill kept, the phase its caller is in, and every later attention call.

The caller states the phase (`Phase`): the prefill (one forward holds the whole prompt), the prefill in chunks (every
forward is a prompt chunk until `end_prefill`), and after the prefill (decode steps, or a question appended to the
compressed context). During a prefill, calls go to the live compressor at work (compressor.compress); after it, a
policy that evicts while decoding (`Policy.tracker`: H2O, TOVA, DecodingEviction, R-KV) sees each call and evicts.

Later calls of a compressed layer are computed by `attend_cache`: ragged (head-wise) layers by `headwise_attention`;
a mask sized for another layer's length (per-layer budgets under eager) is rebuilt for this one; a padded batch's
pads and fill slots are masked by the layer's own slot positions (NO_POSITION); a layer that keeps one KV head per
query head (per_query_head) is attended with the module's GQA repeat turned off for the call.
"""

from __future__ import annotations

import dataclasses
import enum
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from ..core.attention import AttentionSettings
from ..core.hooks import intercept_attention
from ..core.timing import SectionTimer
from ..policies.base import Policy
from .engine import attention_calls
from .layers import (
    CompressedLayer,
    HeadwiseLayer,
    fork,
    headwise_attention,
    held_positions,
    hidden_future,
    slot_positions,
    stack_rows,
)


class Phase(enum.Enum):
    """Where a compression state's caller is: each attention call is read as its phase says, never by its shape."""

    PREFILL = "the prefill"  # one forward holds the whole prompt; it ends with that forward
    PREFILL_CHUNKS = "the prefill in chunks"  # every forward is a prompt chunk, until end_prefill()
    DECODE = "after the prefill"  # decode steps, or a question appended to the compressed context


@dataclass
class CompressionState:
    """A compressed cache, what compression kept, and the phase of its run.

    cache: the cache to pass to the model. kept_indices[layer]: (batch, kv_heads, kept) token positions the layer's
    cache holds, sorted; after prefill the kept prompt positions, and with eviction while decoding, those held at the
    end (generated tokens included). Ragged (head-wise) layers pad each head's row with NO_POSITION (-1).
    Sliding-window layers are not compressed: they keep their own bounded cache (the model's last
    `sliding_window - 1` positions); sliding_layers lists those that kept more than the budget would.
    seeds[layer]: (batch, kv_heads, kept) the prefill scores of the held positions, for a policy that evicts while
    decoding by accumulated scores (H2O): its running scores start there. pads: (batch,) each row's left pads in a
    padded batch, None when no row is padded. timer: the compressor's own time (scoring, selecting, gathering).
    live: the live compressor while a prefill runs (compressor.LivePrefill); eviction: eviction while decoding.
    """

    policy: Policy
    cache: DynamicCache
    kept_indices: dict[int, torch.Tensor] = field(default_factory=dict)
    sliding_layers: list[int] = field(default_factory=list)
    seeds: dict[int, torch.Tensor] = field(default_factory=dict)
    pads: torch.Tensor | None = None
    timer: SectionTimer | None = None
    phase: Phase = Phase.DECODE
    live: object | None = None
    eviction: Eviction | None = None

    @property
    def n_layers(self) -> int:
        return len(self.cache.layers)

    @property
    def selection_seconds(self) -> float:
        return 0.0 if self.timer is None else self.timer.seconds

    def compressed(self, n_tokens: int) -> bool:
        """Whether the policy compressed an n_tokens prompt: some layer beyond the sliding ones (which keep the model's
        own cache) holds its selection, and the prompt is over the policy's budget (within it, the prompt is kept
        whole)."""
        return bool(set(self.kept_indices) - set(self.sliding_layers)) and self.policy.budget(n_tokens) is not None

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        if self.phase is Phase.DECODE:
            self._after_prefill(module, query, key, value, kwargs)
        else:
            self.live(module, query, key, value, attention_mask, kwargs)

    def end_prefill(self) -> None:
        """The prefill is over: later calls are decode steps or an appended question. Checks that the model's
        attention calls reached the compressor (a run would be uncompressed under a compressed label otherwise)."""
        if self.phase is not Phase.DECODE:
            self.phase = Phase.DECODE
            self.live.finish()
            self.live = None

    def fork(self) -> CompressionState:
        """A state over a fork of this cache (no copy), for one more question on the same compressed context: what
        the prefill kept, none of what later calls did (eviction's trackers start afresh)."""
        return dataclasses.replace(self, cache=fork(self.cache), kept_indices=dict(self.kept_indices), timer=None,
                                   eviction=None)

    def _after_prefill(self, module, query, key, value, kwargs) -> None:
        """A policy that evicts while decoding sees the call, and evicts when it says so."""
        cache_layer = self.cache.layers[module.layer_idx]
        if getattr(self.policy, "tracker", None) is None or getattr(cache_layer, "is_sliding", False):
            return
        if isinstance(cache_layer, HeadwiseLayer):
            raise NotImplementedError(f"{self.policy.label}: eviction while decoding over head-wise budgets "
                                      "is not supported")
        if not isinstance(cache_layer, CompressedLayer):  # the prompt fitted: every position so far, in order
            n = cache_layer.keys.shape[-2]
            cache_layer = self.cache.layers[module.layer_idx] = CompressedLayer(
                cache_layer.keys, cache_layer.values, held_positions(cache_layer, n, self.pads), n, pads=self.pads)
        self.eviction = self.eviction or Eviction(self.policy)
        self.eviction.step(self, module, query, key, value, cache_layer, AttentionSettings.of_call(module, kwargs))

    def attend(self, function, module, query, key, value, attention_mask, **kwargs):
        output = attend_cache(self.cache, function, module, query, key, value, attention_mask, pads=self.pads,
                              after_prefill=self.phase is Phase.DECODE, **kwargs)
        if self.eviction is not None and module.layer_idx in self.eviction.pending:  # the call attended every slot
            cache_layer = self.cache.layers[module.layer_idx]
            cache_layer.evict(*self.eviction.pending.pop(module.layer_idx))
            self.kept_indices[module.layer_idx] = cache_layer.positions
        return output


@dataclass
class Eviction:
    """Eviction while decoding: one tracker (`policy.tracker`) per layer and batch row, each seeing the row's own
    slots (its fill slots cut off) as its batch-1 run's tracker sees them; rows that evict keep their picks, the
    others all their slots. pending[layer]: ((batch, heads, k) the slots the layer keeps, and the values they are
    gathered from: (batch, heads, slots, head_dim) where a tracker merged what leaves (CAM), else None), evicted once
    the call that chose them has attended every slot it was handed (`CompressionState.attend`): a merge changes the
    cache the next calls read, never the call that decided it, as CAM's official code merges after the output."""

    policy: Policy
    trackers: dict[int, list] = field(default_factory=dict)
    pending: dict[int, torch.Tensor] = field(default_factory=dict)

    def step(self, state: CompressionState, module, query, key, value, cache_layer: CompressedLayer,
             settings: AttentionSettings) -> None:
        layer, rows, n = module.layer_idx, query.shape[2], key.shape[2]
        pads = [0] * query.shape[0] if state.pads is None else state.pads.tolist()
        fill = (cache_layer.positions[:, 0] < 0).sum(-1).tolist()  # leading slots holding no token, per row
        if layer not in self.trackers:  # the first call after prefill: the cache holds the prompt, then this call's
            seeds = state.seeds.get(layer)
            self.trackers[layer] = [
                self.policy.tracker(layer, state.n_layers, cache_layer.seen - rows - pads[b],
                                    None if seeds is None else seeds[b:b + 1, :, fill[b]:]) for b in range(len(pads))]
        trackers = self.trackers[layer]
        if all(t is None for t in trackers):
            return
        calls = attention_calls(module, query, key, value, torch.arange(n - rows, n), settings, state.n_layers,
                                positions=torch.arange(cache_layer.seen - rows, cache_layer.seen), lead=fill,
                                shift=pads)
        picked = [None if t is None else t.step([call]) for t, call in zip(trackers, calls, strict=True)]
        if all(p is None for p in picked):
            return
        heads = cache_layer.keys.shape[1]
        slots = [torch.arange(fill[b], n).expand(heads, -1) if p is None else p[0] + fill[b]
                 for b, p in enumerate(picked)]
        merged = [None if t is None else t.merged for t in trackers]
        values = None if all(m is None for m in merged) else value.clone()
        for b, rows_merged in enumerate(merged):
            if rows_merged is not None:
                values[b, :, fill[b]:] = rows_merged
        self.pending[layer] = (stack_rows(slots, left=True), values)


def visible_mask(like: torch.Tensor | None, query: torch.Tensor, n_keys: int, module,
                  hidden_slots: torch.Tensor | None = None) -> torch.Tensor:
    """A causal mask in the style of `like` (bool: True visible; float: 0 visible; None: the style of the model's
    attention, float under eager) for the last `rows` of n_keys keys, every earlier key visible but `hidden_slots`
    (batch, n_keys) (a padded batch's pads and fill slots): (batch, 1, rows, n_keys)."""
    rows = query.shape[-2]
    hidden = hidden_future(rows, n_keys, query.device)[None, None]
    if hidden_slots is not None:
        hidden = hidden | hidden_slots.to(query.device)[:, None, None, :]
    eager = getattr(module.config, "_attn_implementation", None) == "eager"
    dtype = like.dtype if like is not None else (query.dtype if eager else torch.bool)
    mask = ~hidden if dtype == torch.bool else torch.zeros(hidden.shape, dtype=dtype, device=query.device).masked_fill(
        hidden, torch.finfo(dtype).min)
    return mask.expand(query.shape[0], 1, rows, n_keys)


def attend_cache(cache: DynamicCache, function, module, query, key, value, attention_mask, *, pads=None,
                 after_prefill: bool = True, **kwargs):
    """Compute one attention call over `cache`'s layer: see the module doc. pads (batch,): a padded batch's left
    pads: every call after the prefill over a full-attention layer then masks the slots holding no token.
    after_prefill: False for a prefill call, which attends the keys it was handed (the layer the compressor may have
    just swapped in is read by later calls only); a prompt chunk's mask is still resized to its layer's slots."""
    layer = cache.layers[module.layer_idx] if module.layer_idx < len(cache.layers) else None
    if after_prefill and isinstance(layer, HeadwiseLayer):
        return headwise_attention(layer, query, AttentionSettings.of_call(module, kwargs)), None
    window = getattr(layer, "window", None) if after_prefill else None
    if after_prefill and (pads is not None or window is not None) and layer is not None and \
            not getattr(layer, "is_sliding", False):
        # Transformers' mask is sized and filled for the first layer's slots; this layer's pads and fill slots are
        # where its positions are NO_POSITION.
        positions = slot_positions(layer, pads)
        hidden = positions[:, 0] < 0  # a row's pads and fill are the same slots in every head
        if window is not None:  # a dense layer's heads keep equal counts: a row's heads all roll, or none does
            hidden = hidden | window.hidden(positions, positions[:, 0, -query.shape[-2]])[:, 0]
        attention_mask = visible_mask(attention_mask, query, key.shape[-2], module, hidden)
    elif attention_mask is not None and attention_mask.ndim == 4 and attention_mask.shape[-1] != key.shape[-2]:
        attention_mask = visible_mask(attention_mask, query, key.shape[-2], module)
    if after_prefill and isinstance(layer, CompressedLayer) and layer.groups > 1:
        # one KV head per query head (per_query_head): the keys are repeated already, so the call must not repeat them
        groups, module.num_key_value_groups = module.num_key_value_groups, 1
        try:
            return function(module, query, key, value, attention_mask, **kwargs)
        finally:
            module.num_key_value_groups = groups
    return function(module, query, key, value, attention_mask, **kwargs)


@contextmanager
def applied(model, state: CompressionState):
    """Run `model` inside the block with `state` seeing (and routing) every attention call."""
    with intercept_attention(model, state, attend=state.attend):
        yield state
