"""Cache layers that hold a compressed prompt, and cache surgery (fork, gather, bytes).

Two layouts, both holding only kept positions (no fake keys, no padding kept across steps; a HeadwiseLayer
whose batch rows keep different totals pads the shorter rows, and counts that padding in its bytes):

- `CompressedLayer`: every head keeps the same number of positions: dense (batch, heads, kept, head_dim),
  attended by the model's own attention function (sdpa, flash, eager).
- `HeadwiseLayer`: heads keep different numbers (head-adaptive budgets such as AdaKV): each batch row holds
  its KV heads' kept positions one after the other in one (slots, head_dim) tensor; tokens that arrive after
  compression are dense. `headwise_attention` attends it in one batched computation per call (the compressor
  routes the layer's calls there).

Both record `positions`: the token position of every slot, so that kept indices stay meaningful after
eviction during decoding.

Padded batches (prompts of different lengths, left-padded to the longest): a *position* is a token's index in its
own prompt, a *slot* an index in the cache. Row b's first `pads[b]` prompt slots are pads, so its token at position
p sits at slot p + pads[b] of an uncompressed layer. A compressed layer holds only real tokens; a row keeping fewer
slots than the fullest row is left-filled with slots whose position is NO_POSITION, which every later attention call
masks (state.attend_cache). Each row's positions, and those of the tokens it appends, are its own.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ..core.attention import AttentionSettings
from ..policies.base import NO_POSITION


def gather_kv(tensor: torch.Tensor, kept: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Keep positions of one layer's keys or values.

    tensor: (batch, kv_heads, n, head_dim); kept: (batch, kv_heads or heads, budget).
    With one selection per query head, the KV heads are first repeated as transformers' repeat_kv does.
    Returns (batch, kept heads, budget, head_dim), contiguous (the full tensor can be freed), or written into `out`
    (a view of that shape) and returned.
    """
    if kept.shape[1] != tensor.shape[1]:
        tensor = tensor.repeat_interleave(kept.shape[1] // tensor.shape[1], dim=1)
    return torch.gather(tensor, 2, kept[..., None].expand(-1, -1, -1, tensor.shape[-1]), out=out)


@dataclass(frozen=True)
class RollingWindow:
    """The heads of a layer whose cache rolls after the prefill (`Policy.decode_window`: DuoAttention's streaming
    heads). At every later call such a head sees its first `sinks` positions, the `recent` positions before the
    call's first token and the call's own tokens (causally), as the official cache that appends each token and cuts
    back to sinks + recent; the positions that slid out stay stored, hidden (a ragged cache cannot drop one slot per
    head and step without copying the layer).

    streaming: (batch, kv_heads) bool; sinks, recent: (batch,) long, each batch row's own."""

    streaming: torch.Tensor
    sinks: torch.Tensor
    recent: torch.Tensor

    def hidden(self, positions: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """(batch, kv_heads, slots) True where a streaming head must not see a slot: positions (batch, kv_heads or 1,
        slots) the token position of each slot (NO_POSITION: left to other masks), start (batch,) the position of the
        call's first token."""
        positions = positions.to(self.streaming.device)
        first_recent = (start.to(self.sinks.device) - self.recent)[:, None, None]
        return self.streaming[..., None] & (positions >= self.sinks[:, None, None]) & (positions < first_recent)

    @staticmethod
    def stacked(windows: list[RollingWindow | None]) -> RollingWindow | None:
        """The windows of batch rows as one (stack_forks), None when no row has one."""
        if all(w is None for w in windows):
            return None
        if any(w is None for w in windows):
            raise ValueError("rows of one layer either all roll their window or none does")
        return RollingWindow(*(torch.cat([getattr(w, name) for w in windows])
                               for name in ("streaming", "sinks", "recent")))


_ROLLBACK_REFUSED = (
    "a compressed KV cache cannot be rolled back: assisted and prompt-lookup decoding are not supported "
    "under snapkv_lab.compress (they place draft tokens by the cache length, which compression shortened). "
    "Use plain greedy or sampled generation."
)


class CompressedLayer(DynamicLayer):
    """A full-attention cache layer holding the kept positions of a compressed prompt, then the new tokens.

    positions: (batch, heads, length) token position of every slot. seen: tokens the layer has seen.
    groups > 1: one KV head per query head (the official SnapKV layout): new keys are repeated on arrival.
    Rolling back is refused: assisted and prompt-lookup decoding feed several draft tokens, count their
    positions from the cache length (shorter than the tokens seen) and crop the rejected ones.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, seen: int, groups: int = 1,
                 pads: torch.Tensor | None = None):
        super().__init__()
        self.lazy_initialization(keys, values)
        self.keys, self.values, self.positions, self.seen, self.groups = keys, values, positions, seen, groups
        self.pads = pads  # (batch,) left pads of each row's prompt (a padded batch; see module doc), else None
        self._reserve: _Reserve | None = None
        self.window: RollingWindow | None = None  # heads whose cache rolls after the prefill (set by the engine)

    def update(self, key_states, value_states, *args, **kwargs):
        if self.groups > 1:
            key_states = key_states.repeat_interleave(self.groups, dim=1)
            value_states = value_states.repeat_interleave(self.groups, dim=1)
        new = _new_positions(self.positions, self.seen, key_states.shape[-2], self.pads)
        self.positions = torch.cat([self.positions, new], -1)
        self.seen += key_states.shape[-2]
        # Room for an eighth more (at least 16 tokens) per regrowth: copies amortised, little memory held unused.
        spare = max(16, self.keys.shape[-2] // 8)
        self._reserve, self.keys, self.values = appended(self._reserve, self.keys, self.values, key_states,
                                                         value_states, spare)
        return self.keys, self.values

    def evict(self, kept_slots: torch.Tensor, values: torch.Tensor | None = None) -> None:
        """Keep only the slots `kept_slots` (batch, heads, k) of the layer (eviction while decoding); a slot of -1
        is a fill slot (a row keeping fewer than the fullest), its position NO_POSITION. values: (batch, heads, slots,
        head_dim) to gather the kept values from instead of the layer's own (a policy that merged into them: CAM).
        The kept slots are gathered straight into a new reserve with room past them, so the next token is written
        after them instead of the layer being copied once more; the tensors the layer held before are left as they
        were (a scorer's call may still hold them)."""
        fill = kept_slots < 0
        slots = kept_slots.clamp(min=0)
        kept = slots.shape[-1]
        room = (*slots.shape[:2], kept + max(16, kept // 8), self.keys.shape[-1])
        reserve = _Reserve(self.keys.new_empty(room), self.values.new_empty(room), kept)
        self.keys = gather_kv(self.keys, slots, out=reserve.keys[:, :, :kept])
        self.values = gather_kv(self.values if values is None else values, slots, out=reserve.values[:, :, :kept])
        self._reserve = reserve
        self.positions = self.positions.gather(-1, slots).masked_fill(fill, NO_POSITION)

    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(_ROLLBACK_REFUSED)


def held_positions(layer, n: int, pads: torch.Tensor | None = None) -> torch.Tensor:
    """(batch, kv_heads, held) the positions an uncompressed layer holds after n slots: its last `held` (all of
    them for a full layer, the last sliding_window - 1 for a sliding one). pads (batch,): each row's left pads,
    whose slots get NO_POSITION and shift the row's positions down."""
    held = layer.keys.shape[-2]
    slots = torch.arange(n - held, n, device=layer.keys.device)
    if pads is None:
        return slots.expand(*layer.keys.shape[:2], -1)
    positions = slots - pads.to(slots.device)[:, None]  # (batch, held)
    return positions.masked_fill(positions < 0, NO_POSITION)[:, None].expand(-1, layer.keys.shape[1], -1)


def slot_positions(layer, pads: torch.Tensor | None = None) -> torch.Tensor:
    """(batch, heads, slots) the position of every slot of a layer, NO_POSITION on pads, fill and a head-wise layer's
    slots that a head does not hold."""
    if isinstance(layer, (CompressedLayer, HeadwiseLayer)):
        return layer.positions
    return held_positions(layer, getattr(layer, "cumulative_length", None) or layer.keys.shape[-2], pads)


def hidden_future(rows: int, n_keys: int, device) -> torch.Tensor:
    """(rows, n_keys) bool, True where a key is hidden: the rows are the last `rows` of n_keys tokens, each
    seeing every key up to itself (a causal mask whose earlier keys are all visible)."""
    return torch.ones(rows, n_keys, dtype=torch.bool, device=device).triu(n_keys - rows + 1)


def _new_positions(positions: torch.Tensor, seen: int, count: int, pads: torch.Tensor | None = None) -> torch.Tensor:
    """(batch, heads, count) positions of slots seen..seen+count-1 (each row's own: minus its pads), shaped like
    `positions`."""
    new = torch.arange(seen, seen + count, device=positions.device)
    if pads is not None:
        return (new - pads.to(new.device)[:, None])[:, None].expand(-1, positions.shape[1], -1)
    return new.expand(*positions.shape[:2], -1)


class _Reserve:
    """Room for the tokens a cache layer appends after compression, shared by the layer and its forks.

    keys, values: (batch, kv_heads, capacity, head_dim); `used` slots of them hold tokens. Only a layer whose own
    tokens are the reserve's first `used` slots may write on in place; any other (a fork that another fork has
    already written past, or a layer whose tensors were replaced) copies its tokens into a reserve of its own
    first, so that no two forks ever write into the same room.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, used: int):
        self.keys, self.values, self.used = keys, values, used


def appended(reserve: _Reserve | None, keys: torch.Tensor, values: torch.Tensor, key_states: torch.Tensor,
             value_states: torch.Tensor, spare: int) -> tuple[_Reserve, torch.Tensor, torch.Tensor]:
    """(reserve, keys, values): a layer's keys and values (batch, kv_heads, length, head_dim) with `key_states`
    appended, as views of `reserve`, written into its room where the layer owns it; else copied into a new reserve
    with `spare` slots of room past them. A decode step then writes one token instead of copying the layer, as
    DynamicLayer's concatenation does."""
    length, count = keys.shape[-2], key_states.shape[-2]
    if (reserve is None or reserve.used != length or length + count > reserve.keys.shape[-2]
            or (length and keys.data_ptr() != reserve.keys.data_ptr())
            or (reserve.keys.is_inference() and not torch.is_inference_mode_enabled())):
        room = (*keys.shape[:2], length + count + spare, keys.shape[-1])
        reserve = _Reserve(keys.new_empty(room), values.new_empty(room), length)
        reserve.keys[:, :, :length], reserve.values[:, :, :length] = keys, values
    reserve.keys[:, :, length:length + count] = key_states
    reserve.values[:, :, length:length + count] = value_states
    reserve.used = length + count
    return reserve, reserve.keys[:, :, :length + count], reserve.values[:, :, :length + count]


class HeadwiseLayer(DynamicLayer):
    """Kept prompt positions of different counts per KV head, stored ragged; later tokens dense.

    kept_keys, kept_values: (batch, slots, head_dim): per batch row, every KV head's kept prompt positions, one
        head after the other (each head's in ascending position order). A row keeping fewer than the fullest row
        ends in padding slots; AdaKV's rows share one layer budget, so they have none.
    slot_hidden: (batch, kv_heads, 1, slots) bool, True where a cache slot is not the KV head's own (another
        head's, or padding): the mask that lets one product per batch row serve every head.
    keys, values: (batch, kv_heads, new, head_dim) the tokens appended after compression (every head sees them),
        views of a reserve with room for more: a decode step writes its token instead of copying them all; the
        room doubles when full.
    kept: (batch, kv_heads, widest) the prompt positions, NO_POSITION (-1) after a head's last one.

    nbytes counts the bytes holding keys and values (kept slots, padding slots, appended tokens), as dense
    layers count theirs; the reserve's unused room (at most max(16, the appended tokens) per head, none right
    after prefill) is not counted, since dense layers hold none of it.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, kept: torch.Tensor, pads: torch.Tensor | None = None):
        super().__init__()
        if kept.shape[1] != keys.shape[1]:
            raise ValueError(f"head-wise budgets select per KV head: kept has {kept.shape[1]} heads, "
                             f"the keys {keys.shape[1]} KV heads")
        self.lazy_initialization(keys, values)
        held, rows, slot, slots = _slot_layout(kept)
        # pads (batch,): a padded batch's left pads; position p of row b sits at slot p + pads[b] of `keys`
        self.pads = pads
        slots_of = kept if pads is None else kept + pads.to(kept.device)[:, None, None]
        picked = slots_of.clamp(min=0)[..., None].expand(-1, -1, -1, keys.shape[-1])
        self.kept_keys, self.kept_values = (
            t.new_zeros(t.shape[0], slots, t.shape[-1]).index_put_((rows, slot[held]), t.gather(2, picked)[held])
            for t in (keys, values))
        heads = torch.arange(kept.shape[1], device=keys.device)
        slot_heads = kept.new_full((keys.shape[0], slots), NO_POSITION).index_put_(
            (rows, slot[held]), heads[:, None].expand_as(kept)[held])  # (batch, slots) the KV head of each slot
        self.slot_hidden = slot_heads[:, None, None, :] != heads[:, None, None]
        self.kept, self.seen = kept, keys.shape[-2]
        # Fresh empty tensors, not keys[:, :, :0]: a zero-length view would keep the whole prompt's storage alive.
        self.keys = keys.new_empty(*keys.shape[:2], 0, keys.shape[-1])
        self.values = values.new_empty(*values.shape[:2], 0, values.shape[-1])
        self._reserve: _Reserve | None = None
        # (batch,) leading appended slots that hold no token (`stack_forks`: rows that appended fewer), else None
        self.fill: torch.Tensor | None = None
        self.window: RollingWindow | None = None  # heads whose cache rolls after the prefill (set by the engine)

    def get_seq_length(self) -> int:
        """The longest head's length: what transformers sizes masks by (the compressor builds its own)."""
        return self.kept.shape[-1] + self.keys.shape[-2]

    def update(self, key_states, value_states, *args, **kwargs):
        new = self.keys.shape[-2]
        self._reserve, self.keys, self.values = appended(self._reserve, self.keys, self.values, key_states,
                                                         value_states, max(16, 2 * (new + key_states.shape[-2])))
        self.seen += key_states.shape[-2]
        return self.keys, self.values

    @property
    def positions(self) -> torch.Tensor:
        """(batch, kv_heads, widest + new) position of every slot, NO_POSITION where a head has none."""
        new = _new_positions(self.kept, self.seen - self.keys.shape[-2], self.keys.shape[-2], self.pads)
        if self.fill is not None:
            new = new.masked_fill(self.filled()[:, None], NO_POSITION)
        return torch.cat([self.kept, new], -1)

    def kept_slot_positions(self) -> torch.Tensor:
        """(batch, slots) the token position each kept slot holds (kept_keys' layout), NO_POSITION on padding."""
        held, rows, slot, slots = _slot_layout(self.kept)
        return (self.kept.new_full((self.kept.shape[0], slots), NO_POSITION)
                .index_put_((rows, slot[held]), self.kept[held]))

    def filled(self) -> torch.Tensor:
        """(batch, new) True on the appended slots that hold no token (see `fill`)."""
        return torch.arange(self.keys.shape[-2], device=self.keys.device) < self.fill.to(self.keys.device)[:, None]

    @property
    def prompt_keys(self) -> list[list[torch.Tensor]]:
        """prompt_keys[b][h]: (kept_bh, head_dim) the kept keys of batch row b, KV head h: views, no copy."""
        return self._per_head(self.kept_keys)

    @property
    def prompt_values(self) -> list[list[torch.Tensor]]:
        """prompt_values[b][h]: (kept_bh, head_dim), as prompt_keys."""
        return self._per_head(self.kept_values)

    def _per_head(self, slots: torch.Tensor) -> list[list[torch.Tensor]]:
        counts = (self.kept >= 0).sum(-1).tolist()
        return [[row.narrow(0, start, n) for start, n in zip(accumulate([0, *heads[:-1]]), heads)]
                for row, heads in zip(slots, counts)]

    def nbytes(self) -> int:
        return self.kept_keys.nbytes + self.kept_values.nbytes + self.keys.nbytes + self.values.nbytes

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(_ROLLBACK_REFUSED)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError(_REBATCH_REFUSED)

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError(_REBATCH_REFUSED)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError(_REBATCH_REFUSED)


def _slot_layout(kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Where a HeadwiseLayer stores the kept positions `kept` (batch, kv_heads, widest): each batch row's heads one
    after the other, each head's in order. Returns held (kept >= 0), the batch row of each held position, its slot in
    the row (both (held,) in held's order: `slot[held]`; slot is (batch, kv_heads, widest)) and the widest row's
    slots."""
    held = kept >= 0
    slot = held.flatten(1).cumsum(1).sub_(1).view_as(held)  # a held position's rank within its flattened row
    rows = torch.arange(kept.shape[0], device=kept.device)[:, None, None].expand_as(kept)[held]
    return held, rows, slot, int(held.sum((1, 2)).max())


_REBATCH_REFUSED = ("a head-wise (ragged) compressed cache cannot reorder or select its batch rows (beam search, "
                    "contrastive search): use plain greedy or sampled generation")


def headwise_attention(layer: HeadwiseLayer, query: torch.Tensor, settings: AttentionSettings) -> torch.Tensor:
    """Attention of `query` (batch, heads, rows, head_dim), the last `rows` tokens of the layer, over each head's
    kept prompt positions (all visible) and the tokens since (causal). Returns (batch, rows, heads, head_dim), as
    transformers' attention functions do.

    One product per batch row serves all its heads: every query row scores every cache slot of its row, and the
    slots of other KV heads are masked out before the softmax. That costs kv_heads times the multiply-adds of a
    per-head softmax but reads each key once, in a handful of batched operations whatever the number of heads;
    decoding is bound by reading the cache, not by those multiply-adds. The logits take
    (batch, heads, rows, slots + new) float32, slots being about kv_heads times a head's budget. Precision is
    transformers' eager attention's: products in the model's dtype, softmax in float32.
    """
    batch, heads, rows, head_dim = query.shape
    kv_heads, slots, new = layer.keys.shape[1], layer.kept_keys.shape[1], layer.keys.shape[-2]
    query = query.reshape(batch, kv_heads, heads // kv_heads * rows, head_dim)  # a KV head's query heads, then rows
    logits = torch.cat([
        # (batch, kv_heads, group * rows, slots)
        (query.flatten(1, 2) @ layer.kept_keys.mT).view(batch, kv_heads, -1, slots),
        query @ layer.keys.mT,  # (batch, kv_heads, group * rows, new)
    ], -1).float() * settings.scaling
    if settings.softcap is not None:
        logits = settings.softcap * torch.tanh(logits / settings.softcap)
    logits[..., :slots].masked_fill_(layer.slot_hidden, float("-inf"))
    logits[..., slots:].unflatten(2, (-1, rows)).masked_fill_(hidden_future(rows, new, query.device), float("-inf"))
    if layer.fill is not None:
        logits[..., slots:].masked_fill_(layer.filled()[:, None, None], float("-inf"))
    if layer.window is not None:  # streaming heads: their sinks and recent positions only (RollingWindow)
        appended = layer.positions[..., layer.kept.shape[-1]:]  # (batch, kv_heads, new)
        start = appended[:, 0, -rows]
        logits[..., :slots].masked_fill_(layer.window.hidden(layer.kept_slot_positions()[:, None], start)[:, :, None],
                                         float("-inf"))
        logits[..., slots:].masked_fill_(layer.window.hidden(appended, start)[:, :, None], float("-inf"))
    probs = F.softmax(logits, dim=-1).to(layer.kept_values.dtype)
    out = (probs[..., :slots].flatten(1, 2) @ layer.kept_values).view(query.shape) + probs[..., slots:] @ layer.values
    return out.view(batch, heads, rows, head_dim).transpose(1, 2).to(query.dtype)


def fork(cache: DynamicCache) -> DynamicCache:
    """A new cache over the same tensors, without copying: layers grow by concatenation and slicing, or (a
    HeadwiseLayer) write only into reserved room past every fork's tokens, so decoding on the fork leaves
    `cache` as it was and forks can share it."""
    forked = DynamicCache()
    forked.layers = [copy.copy(layer) for layer in cache.layers]
    return forked


def stack_rows(rows: list[torch.Tensor], left: bool = False, value=NO_POSITION) -> torch.Tensor:
    """Per batch row (heads, k_b) -> (batch, heads, max k_b), filled with `value` after each row (or before it)."""
    widest = max(r.shape[-1] for r in rows)
    return torch.stack([F.pad(r, (widest - r.shape[-1], 0) if left else (0, widest - r.shape[-1]), value=value)
                        for r in rows])


def build_layer(keys: torch.Tensor, values: torch.Tensor, slots: list[torch.Tensor], positions: torch.Tensor, seen: int,
                pads: torch.Tensor | None = None) -> tuple[DynamicLayer, torch.Tensor]:
    """(layer, kept positions (batch, rows, k)): the layer holding, of keys/values (batch, kv_heads, n, d), the slots
    `slots[b]` (rows, k_b) each batch row keeps (its own slots; rows: KV heads, or query heads for one selection per
    query head; NO_POSITION after a head's last where its heads keep different counts). positions: (batch, kv_heads,
    n) the token position of every slot; seen: tokens the layer has seen; pads (batch,): a padded batch's left pads.

    Heads keeping different counts: a HeadwiseLayer, each head's positions then NO_POSITION (slots are then the
    prompt's own: a position's slot is itself plus the row's pads). Otherwise a CompressedLayer whose rows keeping
    fewer than the fullest are left-filled with NO_POSITION slots (the attention masks them), so that every row's kept
    slots end where its new tokens begin. An unpadded batch of one length is the case with no fill and no pads."""
    if any(bool((row == NO_POSITION).any()) for row in slots):
        kept = stack_rows([row - (0 if pads is None else int(pads[b])) * (row >= 0) for b, row in enumerate(slots)])
        return HeadwiseLayer(keys, values, kept, pads), kept
    stacked = stack_rows(slots, left=True)  # (batch, rows, k), NO_POSITION on a row's fill
    groups = stacked.shape[1] // keys.shape[1]
    fill, picked = stacked < 0, stacked.clamp(min=0)
    kept = positions.repeat_interleave(groups, dim=1).gather(-1, picked).masked_fill(fill, NO_POSITION)
    layer = CompressedLayer(gather_kv(keys, picked), gather_kv(values, picked), kept, seen, groups, pads)
    return layer, kept


def row_cache(cache: DynamicCache, b: int, pads: int) -> DynamicCache:
    """Row b of an uncompressed cache as its batch-1 cache: its slots after its `pads` left pads, no copy (a
    policy that scores after the prefill reads one prompt at a time: shared.SharedPrefill.prompt)."""
    row = DynamicCache()
    row.layers = []
    for layer in cache.layers:
        layer = copy.copy(layer)
        if layer.is_initialized:
            total = getattr(layer, "cumulative_length", None) or layer.keys.shape[-2]
            drop = max(0, pads - (total - layer.keys.shape[-2]))  # the pads still among the held slots
            layer.keys, layer.values = layer.keys[b:b + 1, :, drop:], layer.values[b:b + 1, :, drop:]
            if hasattr(layer, "cumulative_length"):
                layer.cumulative_length = total - pads
        row.layers.append(layer)
    return row


def stack_forks(caches: list[DynamicCache]) -> tuple[DynamicCache, torch.Tensor]:
    """One padded batch of batch-1 caches that share a compressed prefix and then appended different numbers of
    tokens (forks of one compressed context, each fed its own question): (cache, pads (batch,)).

    Row b is laid out as a left-padded prompt: pads[b] = (the most tokens any fork appended) - (its own), so every
    row's tokens end at the same slot; a compressed layer's rows are left-filled with NO_POSITION slots, an
    uncompressed layer's with zero slots that its positions (slot minus pads) mark as pads, and a sliding layer
    holds each row's own last tokens. Every later call masks them (state.attend_cache), and each row's new
    tokens get its own positions; a HeadwiseLayer's appended tokens are left-filled with slots it masks (`fill`)."""
    seen = [layer_seen(fork.layers[0]) for fork in caches]
    total = max(seen)
    pads = torch.tensor([total - s for s in seen])
    stacked = DynamicCache()
    stacked.layers = []
    for layers in zip(*(fork.layers for fork in caches)):
        first = layers[0]
        if [layer_seen(layer) for layer in layers] != seen:
            raise ValueError("the caches must share one prefix and differ only in the tokens appended to it")
        keys = stack_rows([layer.keys[0].mT for layer in layers], left=True, value=0).mT
        values = stack_rows([layer.values[0].mT for layer in layers], left=True, value=0).mT
        if isinstance(first, HeadwiseLayer):  # the kept prompt is the shared prefix; the appended tokens left-filled
            layer = copy.copy(first)
            for name in ("kept_keys", "kept_values", "slot_hidden", "kept"):
                setattr(layer, name, torch.cat([getattr(one, name) for one in layers]))
            layer.keys, layer.values, layer.seen, layer.pads, layer._reserve = keys, values, total, pads, None
            layer.fill = torch.tensor([keys.shape[-2] - one.keys.shape[-2] for one in layers])
            layer.window = RollingWindow.stacked([one.window for one in layers])
        elif isinstance(first, CompressedLayer):
            positions = stack_rows([layer.positions[0] for layer in layers], left=True)
            layer = CompressedLayer(keys, values, positions, total, first.groups, pads)
            layer.window = RollingWindow.stacked([one.window for one in layers])
        else:
            layer = copy.copy(first)
            layer.keys, layer.values = keys, values
            if hasattr(layer, "cumulative_length"):
                layer.cumulative_length = total
        stacked.layers.append(layer)
    return stacked, pads


def layer_seen(layer) -> int:
    """Tokens a cache layer has seen (its prompt and appended tokens), whatever it holds of them."""
    if isinstance(layer, (CompressedLayer, HeadwiseLayer)):
        return layer.seen
    return getattr(layer, "cumulative_length", None) or layer.keys.shape[-2]


def layer_nbytes(layer) -> int:
    if not layer.is_initialized:
        return 0
    return layer.nbytes() if hasattr(layer, "nbytes") else layer.keys.nbytes + layer.values.nbytes


def cache_bytes(cache: DynamicCache) -> int:
    """Bytes held by all keys and values of a cache."""
    return sum(layer_nbytes(layer) for layer in cache.layers)


def cache_lengths(cache: DynamicCache) -> list[int]:
    """Per layer, the positions held per head (the mean over heads for a ragged layer, rounded)."""
    lengths = []
    for layer in cache.layers:
        if isinstance(layer, HeadwiseLayer):
            lengths.append(round((layer.kept >= 0).sum(-1).float().mean().item()) + layer.keys.shape[-2])
        else:
            lengths.append(layer.keys.shape[-2])
    return lengths


def row_cache_lengths(cache: DynamicCache, pads: torch.Tensor) -> list[list[int]]:
    """[row][layer] the positions a padded batch's row holds per head (pads and fill slots not counted; the mean
    over heads for a ragged layer, rounded): what `cache_lengths` gives for the row's batch-1 run."""
    rows = [layer.keys.shape[1] for layer in cache.layers]
    return [[round(entries / heads) for entries, heads in zip(row, rows, strict=True)]
            for row in row_entries(cache, pads)]


def row_entries(cache: DynamicCache, pads: torch.Tensor | None = None) -> list[list[int]]:
    """[row][layer] the KV entries (one key and its value in one head of the layer's cache) a batch row holds, summed
    over the layer's heads: pads, fill and a head-wise layer's empty slots not counted. pads: (batch,) left pads."""
    held = [(slot_positions(layer, pads) >= 0).sum((1, 2)).tolist() for layer in cache.layers]
    return [list(row) for row in zip(*held)]
