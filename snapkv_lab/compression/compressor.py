"""Applying a policy to a live transformers cache: `compress`, and the hook callback behind it.

`compress` wraps the model's attention function with `intercept_attention`. At the prefill call of each
layer the callback scores, selects and swaps the layer's cache for one holding the kept positions. The
layer's own attention still runs on the full keys it was handed, so the prefill logits (and the first
generated token) are those of the full cache, as in the paper. Later calls of a compressed layer are
routed by `attend`: ragged (head-wise) layers get `headwise_attention`; a mask sized for another layer's
length (per-layer budgets under eager) is rebuilt for this one. A policy that evicts while decoding
(`DecodingEviction`) sees every decode call.

Positions stay right after the cache shrinks because nothing downstream derives them from the cache
length: `generate` passes position ids explicitly, and `model.generate` in transformers 5.x counts
positions from the prompt's own position ids (checked token for token in the tests).

Padded batches (prompts of different lengths, left-padded; the pads are read off the prefill's mask, `left_pads`):
each row is scored on its own tokens only (`attention_calls` slices off its pads), with budgets from its own
length, so its kept positions are those of its batch-1 run, and pads never vote nor are kept. Rows keeping
different counts are left-filled with NO_POSITION slots (layers.padded_layer); every later call over a
full-attention layer gets a mask rebuilt from the layer's slot positions (pads and fill hidden). Eviction while
decoding runs one tracker per row, on the row's own slots.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from ..core.attention import AttentionSettings
from ..core.hooks import intercept_attention
from ..core.inputs import PADDING_REFUSED, left_pads
from ..policies.base import NO_POSITION, AttentionCall, FullCache, Policy
from ..policies.decoding import prefill_seeds, seeded
from ..core.timing import SectionTimer
from .layers import (CompressedLayer, HeadwiseLayer, compressed_layer, gather_kv, headwise_attention, held_positions,
                     hidden_future, padded_layer, slot_positions, stack_rows)


def refuse_padding(attention_mask) -> None:
    """Refuse a padded prefill (where a path cannot take one). Any unpadded causal or sliding-window mask lets every
    token see itself; a pad token is hidden from every row, its own included. flash_attention_2 gets the 2-D
    padding mask itself."""
    if left_pads(attention_mask) is not None:
        raise NotImplementedError("padded batches are not supported here: " + PADDING_REFUSED)


def attention_calls(module, query, key, value, slots, settings, n_layers, positions=None, lead=None, shift=None):
    """One AttentionCall per batch row of an attention call's (batch, heads, rows, head_dim) tensors; slots and
    positions (rows,) as AttentionCall's (positions default to the slots, as at prefill).

    A padded batch: lead (batch,) the leading slots of each row that hold none of its tokens (its pads, or fill
    slots), cut off the row's keys and query rows so that the row's call is its batch-1 call (its slots counted
    after them); shift (batch,) each row's pads, subtracted from its positions (default: lead)."""
    if lead is None:
        return [AttentionCall(query[b], key[b], value[b], slots, settings, module, module.layer_idx, n_layers, positions)
                for b in range(query.shape[0])]
    positions = slots if positions is None else positions
    shift = lead if shift is None else shift
    calls = []
    for b in range(query.shape[0]):
        drop = int(lead[b])
        first = int((slots < drop).sum())  # query rows on dropped slots (slots ascend)
        calls.append(AttentionCall(query[b][:, first:], key[b][:, drop:], value[b][:, drop:], slots[first:] - drop,
                                   settings, module, module.layer_idx, n_layers, positions[first:] - int(shift[b])))
    return calls


def row_kept(policy: Policy, scores: list, lengths: list[int], kv_heads: int, layer: int, n_layers: int) -> list:
    """Per batch row of a padded batch, (heads, k_b) the positions it keeps: by `keep` over its own length, or all
    of them where its prompt fits the budget (as its batch-1 run keeps them); rows as many as the widest's."""
    rows = [policy.keep(s, n, kv_heads, layer, n_layers) if policy.budget(n) is not None else None
            for s, n in zip(scores, lengths, strict=True)]
    return all_where_none(rows, lengths, kv_heads)


def all_where_none(rows: list, lengths: list[int], kv_heads: int) -> list:
    """rows with each None (a row whose prompt fits) replaced by all its positions, as many rows as the others'."""
    heads = max((r.shape[0] for r in rows if r is not None), default=kv_heads)
    return [torch.arange(n).expand(heads, -1) if r is None else r for r, n in zip(rows, lengths, strict=True)]


def refuse_unseen_layers(cache: DynamicCache, seen, sliding, label: str, stacklevel: int = 3) -> None:
    """Raise if a layer filled `cache` without its attention calls reaching our hook (`seen`: layer indices that did),
    since the run would be uncompressed under a compressed label; warn if every seen layer is a sliding-window layer
    (`sliding`), which the compressor leaves to its own bounded cache."""
    missed = [i for i, layer in enumerate(cache.layers) if layer.is_initialized and i not in seen]
    if missed:
        raise RuntimeError(
            f"layers {missed} filled the cache without calling an attention function from transformers' registry, "
            f"so {label} could not compress them (this model's attention bypasses "
            "ALL_ATTENTION_FUNCTIONS). The run would be uncompressed: refused."
        )
    if seen and set(seen) <= set(sliding):
        warnings.warn(f"every layer of this model uses sliding-window attention, which the compressor leaves to its "
                      f"own bounded cache: {label} compressed nothing", stacklevel=stacklevel)


def stack_kept(kept: list[torch.Tensor]) -> torch.Tensor:
    """Per batch row (heads, k_b) kept positions -> (batch, heads, max k_b), NO_POSITION-padded."""
    widest = max(k.shape[-1] for k in kept)
    return torch.stack([F.pad(k, (0, widest - k.shape[-1]), value=NO_POSITION) for k in kept])


def _visible_mask(like: torch.Tensor | None, query: torch.Tensor, n_keys: int, module,
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
                 evicted=None, **kwargs):
    """Compute one attention call over `cache`'s layer: see the module doc. pads (batch,): a padded batch's left
    pads: every call after the prefill over a full-attention layer then masks the slots holding no token.
    evicted: (batch, heads, slots) the slot positions of this call's keys when the layer evicted some of them in
    this call (the call still attends them all, as an unpadded one does)."""
    layer = cache.layers[module.layer_idx] if module.layer_idx < len(cache.layers) else None
    # The prefill call that has just swapped in a HeadwiseLayer still attends the full keys it was handed
    # (they outnumber the layer's appended tokens, which are none yet): only later calls read the ragged cache.
    if isinstance(layer, HeadwiseLayer) and key.shape[-2] == layer.keys.shape[-2]:
        return headwise_attention(layer, query, AttentionSettings.of_call(module, kwargs)), None
    if evicted is not None and evicted.shape[-1] == key.shape[-2]:
        attention_mask = _visible_mask(attention_mask, query, key.shape[-2], module, evicted[:, 0] < 0)
    elif (pads is not None and layer is not None and not getattr(layer, "is_sliding", False)
            and query.shape[-2] < key.shape[-2] == layer.keys.shape[-2]):
        # Transformers' mask is sized and filled for the first layer's slots; this layer's pads and fill slots are
        # where its positions are NO_POSITION. (The prefill's own call, all keys new, keeps transformers' mask.)
        hidden = slot_positions(layer, pads)[:, 0] < 0  # a row's pads and fill are the same slots in every head
        attention_mask = _visible_mask(attention_mask, query, key.shape[-2], module, hidden)
    elif attention_mask is not None and attention_mask.ndim == 4 and attention_mask.shape[-1] != key.shape[-2]:
        attention_mask = _visible_mask(attention_mask, query, key.shape[-2], module)
    return function(module, query, key, value, attention_mask, **kwargs)


@dataclass
class CompressionState:
    """What `compress` yields: the cache to pass to the model, and what compression did.

    kept_indices[layer]: (batch, kv_heads, kept) token positions the layer's cache holds, sorted; after prefill
    the kept prompt positions, and with eviction while decoding, those held at the end (generated tokens
    included). Ragged (head-wise) layers pad each head's row with NO_POSITION (-1). Sliding-window layers are
    not compressed: they keep their own bounded cache (the model's last `sliding_window - 1` positions).
    seeds[layer]: (batch, kv_heads, kept) the prefill scores of the held positions, for a policy that evicts while
    decoding by accumulated scores (H2O): its running scores start there.
    """

    policy: Policy
    cache: DynamicCache
    n_layers: int
    kept_indices: dict[int, torch.Tensor] = field(default_factory=dict)
    timer: SectionTimer | None = None  # scoring, selecting and gathering: the compressor's own overhead
    sliding_layers: list[int] = field(default_factory=list)  # left uncompressed although the prompt exceeds the budget
    seeds: dict[int, torch.Tensor] = field(default_factory=dict)
    # Chunked prefill: the prompt comes in calls of at most this many tokens, each cut back to the budget
    # (`_prefill_chunk`) until a call of one token (model.generate's first decode step) or `end_prefill`.
    prefill_chunk: int | None = None
    _groups: dict = field(default_factory=dict)  # attention module -> its original num_key_value_groups
    _trackers: dict = field(default_factory=dict)  # layer -> the policy's eviction tracker while decoding
    _seen: dict = field(default_factory=dict)  # layer -> prompt tokens fed so far (chunked prefill)
    _carry: dict = field(default_factory=dict)  # (layer, batch row) -> AttentionCall.carry across chunks
    _accumulated: dict = field(default_factory=dict)  # layer -> (batch, rows, held) summed scores of held slots
    _checked: bool = False
    # (batch,) each row's left pads in a padded batch (read off the prefill's mask), None when no row is padded.
    pads: torch.Tensor | None = None
    _evicted: dict = field(default_factory=dict)  # layer -> slot positions its current call attends (before eviction)

    def __post_init__(self):
        self.prefilling_chunks = self.prefill_chunk is not None

    @property
    def selection_seconds(self) -> float:
        return 0.0 if self.timer is None else self.timer.seconds

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        layer = module.layer_idx
        if self.prefilling_chunks and self._seen and query.shape[2] == 1:
            self.end_prefill()  # model.generate's first decode step: its chunks are over
        if self.prefilling_chunks:
            if not self._seen and left_pads(attention_mask) is not None:
                raise NotImplementedError("a chunked prefill of a padded batch is not supported (each row's chunks "
                                          "would start at different positions): prefill it whole, or row by row")
            if query.shape[2] > self.prefill_chunk:
                raise ValueError(f"a prompt call of {query.shape[2]} tokens under prefill_chunk={self.prefill_chunk}: "
                                 f"feed the prompt in chunks (model.generate(..., prefill_chunk_size={self.prefill_chunk}))")
            self._prefill_chunk(module, query, key, value, kwargs)
            return
        if layer in self.kept_indices:  # prefill done: a decode step or an appended question
            if key.shape[1] == query.shape[1] and getattr(module, "num_key_value_groups", 1) > 1:
                self._groups[module] = module.num_key_value_groups  # one KV head per query head from now on
                module.num_key_value_groups = 1
            self._decode_step(module, query, key, value, kwargs)
            return
        if layer >= len(self.cache.layers) or not self.cache.layers[layer].is_initialized:
            raise RuntimeError("the model was not called with this compressor's cache: pass past_key_values=state.cache")
        if key.shape[2] != query.shape[2]:
            raise RuntimeError("the compressor's cache must start empty (the prefill compresses the whole prompt)")
        if not self.kept_indices:  # the mask is the same for every layer: one check (one host sync) per prefill
            self.pads = left_pads(attention_mask)
        kv_heads, n = key.shape[1], key.shape[2]
        settings = AttentionSettings.of_call(module, kwargs)
        if self.pads is not None:
            self._padded_prefill(module, query, key, value, settings)
            return
        compresses = self.policy.budget(n) is not None
        if settings.sliding_window is not None and compresses:
            self.sliding_layers.append(layer)
        seeds_needed = seeded(self.policy)
        if settings.sliding_window is not None or not (compresses or seeds_needed):
            self.kept_indices[layer] = held_positions(self.cache.layers[layer], n)
            return
        self.timer = self.timer or SectionTimer(key.device)
        with self.timer.section():
            calls = attention_calls(module, query, key, value, torch.arange(n), settings, self.n_layers)
            scores = [self.policy.score(call) for call in calls]
            if compresses:
                kept = stack_kept([self.policy.keep(s, n, kv_heads, layer, self.n_layers) for s in scores])
                self.cache.layers[layer] = compressed_layer(key, value, kept)
            else:
                kept = held_positions(self.cache.layers[layer], n)
            self.kept_indices[layer] = kept
            if seeds_needed:
                self.seeds[layer] = prefill_seeds(scores, kept)

    def _padded_prefill(self, module, query, key, value, settings) -> None:
        """The prefill call of a padded batch's layer: each row scored on its own tokens (see module doc)."""
        layer, kv_heads, n = module.layer_idx, key.shape[1], key.shape[2]
        lengths = (n - self.pads).tolist()
        compresses = any(self.policy.budget(length) is not None for length in lengths)
        if settings.sliding_window is not None and compresses:
            self.sliding_layers.append(layer)
        held = held_positions(self.cache.layers[layer], n, self.pads)
        if settings.sliding_window is not None or not (compresses or seeded(self.policy)):
            self.kept_indices[layer] = held
            return
        self.timer = self.timer or SectionTimer(key.device)
        with self.timer.section():
            calls = attention_calls(module, query, key, value, torch.arange(n), settings, self.n_layers, lead=self.pads)
            scores = [self.policy.score(call) for call in calls]
            rows = row_kept(self.policy, scores, lengths, kv_heads, layer, self.n_layers)
            if compresses:
                self.cache.layers[layer], self.kept_indices[layer] = padded_layer(key, value, rows, self.pads)
            else:
                self.kept_indices[layer] = held
            if seeded(self.policy):  # left-filled as the layer's slots
                self.seeds[layer] = stack_rows([prefill_seeds([s], r[None])[0] for s, r in zip(scores, rows)], True, 0.0)

    def _prefill_chunk(self, module, query, key, value, kwargs) -> None:
        """One prompt chunk of a chunked prefill: the layer's held slots then the chunk's tokens, scored with the
        chunk's queries (voters: its last ones) and cut back to the budget. Slots are ranked in cache order (kept
        positions ascending), so pooling and windows act on slot neighbours; accumulated scores of held slots carry
        over from chunk to chunk."""
        layer, rows, n_keys = module.layer_idx, query.shape[2], key.shape[2]
        seen = self._seen.get(layer, 0)
        self._seen[layer] = seen + rows
        cache_layer = self.cache.layers[layer]
        settings = AttentionSettings.of_call(module, kwargs)
        if settings.sliding_window is not None:  # its own bounded cache
            if self.policy.budget(seen + rows) is not None and layer not in self.sliding_layers:
                self.sliding_layers.append(layer)
            self.kept_indices[layer] = held_positions(cache_layer, seen + rows)
            return
        slot_positions = (cache_layer.positions if isinstance(cache_layer, CompressedLayer)
                          else held_positions(cache_layer, seen + rows))  # (batch, kv_heads, n_keys)
        compresses = self.policy.budget(n_keys) is not None
        if not (compresses or self.policy.accumulates or seeded(self.policy)):
            self.kept_indices[layer] = slot_positions
            return
        self.timer = self.timer or SectionTimer(key.device)
        with self.timer.section():
            calls = attention_calls(module, query, key, value, torch.arange(n_keys - rows, n_keys), settings,
                                    self.n_layers, positions=torch.arange(seen, seen + rows))
            for b, call in enumerate(calls):
                call.carry = self._carry.setdefault((layer, b), {})
            scores = [self.policy.score(call) for call in calls]
            if self.policy.accumulates and layer in self._accumulated:
                held = self._accumulated[layer]
                scores = [s + F.pad(h, (0, n_keys - h.shape[-1])) for s, h in zip(scores, held, strict=True)]
            kept = (stack_kept([self.policy.keep(s, n_keys, key.shape[1], layer, self.n_layers) for s in scores])
                    if compresses else torch.arange(n_keys).expand(*key.shape[:2], -1))
            if bool((kept == NO_POSITION).any()):
                raise NotImplementedError(f"{self.policy.label}: head-wise budgets under a chunked prefill are not "
                                          "supported (a ragged cache layer cannot take the next chunk)")
            positions = slot_positions.gather(-1, kept)
            if compresses:
                self.cache.layers[layer] = CompressedLayer(gather_kv(key, kept), gather_kv(value, kept), positions,
                                                           seen + rows)
            self.kept_indices[layer] = positions
            if self.policy.accumulates:
                self._accumulated[layer] = torch.stack([
                    s.gather(-1, k.repeat_interleave(s.shape[0] // k.shape[0], 0)) for s, k in zip(scores, kept)])
            if seeded(self.policy):
                self.seeds[layer] = prefill_seeds(scores, kept)

    def end_prefill(self) -> None:
        """Close a chunked prefill: later calls are decode steps or an appended question, as after one prefill."""
        self.prefilling_chunks = False
        self._carry.clear()
        self._accumulated.clear()

    def _decode_step(self, module, query, key, value, kwargs) -> None:
        """Let a policy that evicts while decoding see the call, and evict when it says so."""
        tracker_for = getattr(self.policy, "tracker", None)
        layer = module.layer_idx
        cache_layer = self.cache.layers[layer]
        if tracker_for is None or getattr(cache_layer, "is_sliding", False):
            return
        if isinstance(cache_layer, HeadwiseLayer):
            raise NotImplementedError(f"{self.policy.label}: eviction while decoding over head-wise budgets is not supported")
        if not isinstance(cache_layer, CompressedLayer):  # the prompt fitted: every position so far, in order
            n = cache_layer.keys.shape[-2]
            cache_layer = self.cache.layers[layer] = CompressedLayer(
                cache_layer.keys, cache_layer.values, held_positions(cache_layer, n, self.pads), n, pads=self.pads)
        if self.pads is not None:
            self._padded_decode_step(module, query, key, value, kwargs, cache_layer, tracker_for)
            return
        rows = query.shape[2]
        if layer not in self._trackers:  # the first call after prefill: the cache holds the prompt, then this call's
            self._trackers[layer] = tracker_for(layer, self.n_layers, cache_layer.seen - rows, self.seeds.get(layer))
        if self._trackers[layer] is None:
            return
        settings = AttentionSettings.of_call(module, kwargs)
        n = key.shape[2]
        calls = attention_calls(module, query, key, value, torch.arange(n - rows, n), settings, self.n_layers,
                                positions=torch.arange(cache_layer.seen - rows, cache_layer.seen))
        slots = self._trackers[layer].step(calls)
        if slots is not None:
            cache_layer.evict(slots)
            self.kept_indices[layer] = cache_layer.positions

    def _padded_decode_step(self, module, query, key, value, kwargs, cache_layer: CompressedLayer, tracker_for) -> None:
        """`_decode_step` of a padded batch: one tracker per row, each seeing the row's own slots (its fill slots cut
        off) as its batch-1 run's tracker sees them; rows that evict keep their picks, the others all their slots."""
        layer, rows, n = module.layer_idx, query.shape[2], key.shape[2]
        fill = (cache_layer.positions[:, 0] < 0).sum(-1).tolist()  # leading slots holding no token, per row
        if layer not in self._trackers:
            prompt = (cache_layer.seen - rows - self.pads).tolist()
            seeds = self.seeds.get(layer)
            self._trackers[layer] = [
                tracker_for(layer, self.n_layers, length, None if seeds is None else seeds[b:b + 1, :, fill[b]:])
                for b, length in enumerate(prompt)]
        trackers = self._trackers[layer]
        if all(t is None for t in trackers):
            return
        settings = AttentionSettings.of_call(module, kwargs)
        calls = attention_calls(module, query, key, value, torch.arange(n - rows, n), settings, self.n_layers,
                                positions=torch.arange(cache_layer.seen - rows, cache_layer.seen), lead=fill,
                                shift=self.pads)
        picked = [None if t is None else t.step([call]) for t, call in zip(trackers, calls, strict=True)]
        if all(p is None for p in picked):
            return
        heads = cache_layer.keys.shape[1]
        slots = [torch.arange(fill[b], n).expand(heads, -1) if p is None else p[0] + fill[b] for b, p in enumerate(picked)]
        self._evicted[layer] = cache_layer.positions  # this call still attends every slot: its mask needs them
        cache_layer.evict(stack_rows(slots, left=True))
        self.kept_indices[layer] = cache_layer.positions

    def attend(self, function, module, query, key, value, attention_mask, **kwargs):
        evicted = self._evicted.pop(module.layer_idx, None)
        return attend_cache(self.cache, function, module, query, key, value, attention_mask, pads=self.pads,
                            evicted=evicted, **kwargs)

    def check_prefill_seen(self) -> None:
        """Raise if the model filled the cache without its attention calls reaching the compressor; warn if
        every layer is a sliding-window layer, so the policy compressed nothing. Runs once per prefill."""
        if self._checked:
            return
        self._checked = bool(self.kept_indices)
        refuse_unseen_layers(self.cache, self.kept_indices, self.sliding_layers, self.policy.label, stacklevel=4)

    def restore(self) -> None:
        for module, groups in self._groups.items():
            module.num_key_value_groups = groups


@contextmanager
def applied(model, state: CompressionState):
    """Run `model` inside the block with `state` seeing (and routing) every attention call."""
    try:
        with intercept_attention(model, state, attend=state.attend):
            yield state
    finally:
        state.restore()


def refuse_after_prefill(policy: Policy, consequence: str) -> None:
    """Refuse a policy that compresses only after the whole prefill (`Policy.compresses_after_prefill`) where the
    cache is compressed as the prefill runs; `consequence` ends the message."""
    if policy.scores_after_prefill:
        reason = ("scores after the prefill, from the whole prompt's cache or final hidden states (a reconstruction "
                  "forward or the output head over every position)")
    elif policy.layers_share_budget:
        reason = "compresses after the prefill: each layer's budget depends on every layer's scores"
    else:
        return
    raise NotImplementedError(f"{policy.label} {reason}, which {consequence}")


def check_chunking(policy: Policy, prefill_chunk: int) -> None:
    """Refuse a chunked prefill that has no meaning for `policy` (see `compress`)."""
    if not isinstance(prefill_chunk, int) or isinstance(prefill_chunk, bool) or prefill_chunk < 2:
        raise ValueError(f"prefill_chunk must be an int of at least 2 tokens, got {prefill_chunk!r}")
    if isinstance(policy.capacity, float):
        raise ValueError(f"{policy.label}: a capacity ratio of a prompt fed in chunks is unknown until its last chunk: "
                         "give a token budget, or use snapkv_lab.generate(..., prefill_chunk=N), which knows the prompt")
    if policy.per_query_head:
        raise NotImplementedError(f"{policy.label}: per_query_head caches under a chunked prefill are not supported")
    if prefill_chunk < policy.voters:
        raise ValueError(f"prefill_chunk={prefill_chunk} is shorter than the {policy.voters} last queries "
                         f"{policy.label} votes with: each chunk's own voters must fit in it")


@contextmanager
def compress(model, policy: Policy | None = None, prefill_chunk: int | None = None, tokenizer=None):
    """Compress the prompt's cache with `policy` at the next prefill inside the block.

        with compress(model, SnapKV(capacity=1024)) as state:
            model.generate(input_ids, past_key_values=state.cache, max_new_tokens=32)
        state.kept_indices[layer]  # (batch, kv_heads, kept), sorted ascending

    The cache must start empty and be passed to the model. A left-padded batch (model.generate(ids,
    attention_mask=mask)) is compressed row by row as each row's batch-1 run (see the module doc); padding elsewhere,
    assisted and prompt-lookup decoding are refused. Any attribute patched for the per-query-head layout is restored on exit.
    Policies that compress only after the whole prefill (`compresses_after_prefill`: KVzip and Surprisal score from
    the whole prompt, LookaheadQCache from an answer drafted after it, CAKE's layer budgets need every layer's scores) cannot run inside one forward: use `generate`.

    prefill_chunk=N: compress as you go. The prompt is fed in chunks of at most N tokens
    (`model.generate(..., prefill_chunk_size=N)`, or `snapkv_lab.generate(..., prefill_chunk=N)`), and after each
    chunk every layer is cut back to the budget, so the cache never holds more than capacity + N positions per
    head, whatever the prompt's length. What the scores mean then: each chunk's queries score the held slots and
    the chunk (SnapKV: the chunk's last window_size queries vote, so N must hold them); accumulated scores (H2O) add
    up over chunks for the slots still held; pooling acts on slot neighbours (the kept positions in order); budgets
    that depend on the prompt's length (PyramidKV) are computed from the slots held plus the chunk. Later tokens
    see only what earlier chunks kept, so their keys differ from an unchunked prefill's: the two agree exactly when
    one chunk covers the prompt. Refused: capacity ratios (the prompt's length is unknown here), extra scoring
    passes over the whole prompt (KVzip, Surprisal, LookaheadQCache), per_query_head, and head-wise budgets (AdaKV, at the first
    compression). A call of one token ends the chunks (model.generate's first decode step).

    tokenizer: needed only by a policy calibrated on the model (QFilters) whose calibration is not cached yet.
    """
    policy = policy or FullCache()
    refuse_after_prefill(policy, "cannot run inside model.generate's prefill: use snapkv_lab.generate")
    if prefill_chunk is not None:
        check_chunking(policy, prefill_chunk)
    policy.prepare(model, tokenizer)
    state = CompressionState(policy, DynamicCache(config=model.config), model.config.num_hidden_layers,
                             prefill_chunk=prefill_chunk)
    with applied(model, state):
        yield state
    state.check_prefill_seen()
