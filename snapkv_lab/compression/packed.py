"""A cache layer stored as its policy's `Storage` says: pruned key channels (ThinK), quantized keys and values (KIVI);
a head-wise (ragged) layer's heads each stored so on their own (PackedHeadwiseLayer).

The layer holds, per keys and values, a tuple of stored blocks of consecutive slots and a full-precision tail:

    keys   = [Block(first quantized slots: kept channels and/or codes), Block(...) ...] + tail (b, h, t, d)
    values = [Block(codes per token) ...] + tail (b, h, t', d)

Its bytes (`nbytes`) are those of the tensors it holds: codes packed several to a byte, one scale and one zero point
per group, the kept channels' indices, the full-precision tails. Nothing dense stays beside them. Attention runs on
the layer's dense keys and values, rebuilt at each call (`keys`, `values`: dequantized, the pruned channels zero, so
that q.k is the kept channels' product), and dropped after it: what a CPU pays for storing less (see
benchmarks/bench_quantized_decode.py).

Blocks are immutable and the tuples are replaced, never changed in place, so forks of a cache (layers.fork) that
share blocks decode on their own.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..policies.storage import Storage
from .layers import CompressedLayer, HeadwiseLayer, held_positions


@dataclass(frozen=True)
class Block:
    """Stored slots of a layer's keys or values.

    dense: (b, h, t, c) full precision, or None when quantized; codes: (b, h, t, c) values in [0, 2^bits) packed
    8 // bits to a uint8 along `axis`'s dimension (the quantization groups' axis); scale, zero: the groups' (b, h, t,
    c / group) per token (axis -1) or (b, h, t / group, c) per channel (axis -2), in the model's dtype; channels:
    (b, h, c) long, which of head_dim channels the block holds, None: all."""

    slots: int
    dense: torch.Tensor | None = None
    codes: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    zero: torch.Tensor | None = None
    bits: int | None = None
    group: int | None = None
    axis: int | None = None
    channels: torch.Tensor | None = None

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.dense, self.codes, self.scale, self.zero, self.channels) if t is not None]

    def full(self, head_dim: int) -> torch.Tensor:
        """(b, h, slots, head_dim): the block as attention reads it (dequantized; pruned channels zero)."""
        data = self.dense if self.codes is None else dequantize(self)
        if self.channels is None:
            return data
        out = data.new_zeros(*data.shape[:-1], head_dim)
        return out.scatter_(-1, self.channels[:, :, None].expand(-1, -1, data.shape[2], -1), data)


def quantize(x: torch.Tensor, bits: int, group: int, axis: int, channels: torch.Tensor | None = None) -> Block:
    """KIVI's asymmetric min-max quantization of x (b, h, t, c) in groups of `group` along `axis` (-2: per channel,
    groups of tokens, as KIVI's keys; -1: per token, groups of channels, as its values). A group whose values are all
    equal gets scale 1 (its codes 0 give it back exactly), where the official code divides by zero."""
    if x.shape[axis] % group:
        raise ValueError(f"{x.shape[axis]} {'tokens' if axis == -2 else 'channels'} do not split into groups of "
                         f"{group}")
    top = 2 ** bits - 1
    grouped = x.unflatten(axis, (-1, group))  # (b, h, t/g, g, c) or (b, h, t, c/g, g)
    inner = axis  # the within-group dimension of `grouped`, after the groups' own
    low, high = grouped.amin(inner, keepdim=True), grouped.amax(inner, keepdim=True)
    scale = (high - low) / top
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    codes = ((grouped - low) / scale).clamp_(0, top).round_().to(torch.uint8).flatten(inner - 1, inner)
    return Block(x.shape[2], codes=pack(codes, bits, axis), scale=scale.squeeze(inner), zero=low.squeeze(inner),
                 bits=bits, group=group, axis=axis, channels=channels)


def dequantize(block: Block) -> torch.Tensor:
    """(b, h, t, c) in the scale's dtype: code * scale + zero, each group its own."""
    codes = unpack(block.codes, block.bits, block.axis).to(block.scale.dtype)
    inner = block.axis
    grouped = codes.unflatten(block.axis, (-1, block.group))
    return (grouped * block.scale.unsqueeze(inner) + block.zero.unsqueeze(inner)).flatten(inner - 1, inner)


def pack(codes: torch.Tensor, bits: int, axis: int) -> torch.Tensor:
    """Codes (uint8, < 2^bits) packed 8 // bits to a byte along `axis` (its length a multiple of 8 // bits)."""
    per = 8 // bits
    grouped = codes.unflatten(axis, (-1, per))
    shifts = (torch.arange(per, dtype=torch.uint8, device=codes.device) * bits)
    shape = [1] * grouped.dim()
    shape[axis] = per
    return (grouped << shifts.view(shape)).sum(axis, dtype=torch.uint8)


def unpack(packed: torch.Tensor, bits: int, axis: int) -> torch.Tensor:
    """The codes `pack` packed."""
    per = 8 // bits
    shifts = torch.arange(per, dtype=torch.uint8, device=packed.device) * bits
    shape = [1] * (packed.dim() + 1)
    shape[axis] = per
    spread = (packed.unsqueeze(axis) >> shifts.view(shape)) & (2 ** bits - 1)
    return spread.flatten(axis - 1, axis)


def owned(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy that holds only its own elements: a slice of a one-KV-head layer's tokens is contiguous
    already, and `.contiguous()` would return it as a view that keeps the whole tensor's storage alive (bytes
    reported as saved, still held)."""
    return tensor.clone(memory_format=torch.contiguous_format)


def _key_block(keys: torch.Tensor, storage: Storage, channels: torch.Tensor | None) -> Block:
    """Keys (b, h, t, d) stored: their kept channels (channels: (b, h, c)), quantized per channel if key_bits."""
    if channels is not None:
        keys = keys.gather(-1, channels[:, :, None].expand(-1, -1, keys.shape[2], -1))
    if storage.key_bits is None:
        return Block(keys.shape[2], dense=owned(keys), channels=channels)
    return quantize(keys, storage.key_bits, storage.group_size, -2, channels)


def _value_block(values: torch.Tensor, storage: Storage) -> Block:
    """Values (b, h, t, d) quantized per token, in groups of group_size channels (a head narrower than a group is one
    group: the lab's tiny test models have 16 channels)."""
    return quantize(values, storage.value_bits, min(storage.group_size, values.shape[-1]), -1)


class PackedLayer(CompressedLayer):
    """A CompressedLayer stored as `storage` says (module doc): the same positions, seen, groups and pads; `keys` and
    `values` are rebuilt dense at each read. channels: (b, h, c) the key channels ThinK kept, None: all."""

    def __init__(self, layer: CompressedLayer, storage: Storage, channels: torch.Tensor | None):
        keys, values = layer.keys, layer.values
        super().__init__(keys, values, layer.positions, layer.seen, layer.groups, layer.pads)
        self.window = layer.window
        self.storage, self.head_dim = storage, keys.shape[-1]
        n = keys.shape[2]
        pruned = n - (min(n, storage.full_channel_recent) if channels is not None else 0)  # ThinK's, else all
        quantized = 0 if storage.key_bits is None else (
            pruned - pruned % storage.residual_length if storage.residual_length else pruned)  # KIVI's whole chunks
        dense = dataclasses.replace(storage, key_bits=None)
        stored = pruned if channels is not None else quantized  # the rest: the full-precision tail
        self.key_blocks = ((_key_block(keys[:, :, :quantized], storage, channels),) if quantized else ()) + (
            (_key_block(keys[:, :, quantized:stored], dense, channels),) if stored > quantized else ())
        self.key_tail = owned(keys[:, :, stored:])
        held = n if storage.value_bits is None else min(n, storage.residual_length)
        self.value_blocks = (_value_block(values[:, :, :n - held], storage),) if n - held else ()
        self.value_tail = owned(values[:, :, n - held:])

    # Dense views for whatever reads a layer's keys and values (attention, cache_lengths, stack_forks): rebuilt.
    @property
    def keys(self) -> torch.Tensor:
        return torch.cat([*(b.full(self.head_dim) for b in self.key_blocks), self.key_tail], -2)

    @keys.setter
    def keys(self, value) -> None:  # CompressedLayer's own __init__ (then replaced by the blocks)
        self.key_blocks, self.key_tail = (), value

    @property
    def values(self) -> torch.Tensor:
        return torch.cat([*(b.full(self.head_dim) for b in self.value_blocks), self.value_tail], -2)

    @values.setter
    def values(self, value) -> None:
        self.value_blocks, self.value_tail = (), value

    def get_seq_length(self) -> int:
        return sum(b.slots for b in self.key_blocks) + self.key_tail.shape[-2]

    def update(self, key_states, value_states, *args, **kwargs):
        """Append the new tokens in full precision; return the dense keys and values attention reads (those the
        official KIVI attends: the residual before it is quantized); then quantize what KIVI quantizes."""
        if self.groups > 1:
            key_states = key_states.repeat_interleave(self.groups, dim=1)
            value_states = value_states.repeat_interleave(self.groups, dim=1)
        count = key_states.shape[-2]
        new = torch.arange(self.seen, self.seen + count, device=self.positions.device)
        if self.pads is not None:
            new = (new - self.pads.to(new.device)[:, None])[:, None].expand(-1, self.positions.shape[1], -1)
        self.positions = torch.cat([self.positions, new.expand(*self.positions.shape[:2], -1)], -1)
        self.seen += count
        self.key_tail = torch.cat([self.key_tail, key_states], -2)
        self.value_tail = torch.cat([self.value_tail, value_states], -2)
        keys, values = self.keys, self.values
        storage, residual = self.storage, self.storage.residual_length
        if storage.key_bits is not None and residual and self.key_tail.shape[-2] >= residual:
            whole = self.key_tail.shape[-2] - self.key_tail.shape[-2] % residual
            self.key_blocks = (*self.key_blocks, _key_block(self.key_tail[:, :, :whole], storage, None))
            self.key_tail = owned(self.key_tail[:, :, whole:])
        if storage.value_bits is not None and self.value_tail.shape[-2] > residual:
            over = self.value_tail.shape[-2] - residual
            self.value_blocks = (*self.value_blocks, _value_block(self.value_tail[:, :, :over], storage))
            self.value_tail = owned(self.value_tail[:, :, over:])
        return keys, values

    def evict(self, kept_slots: torch.Tensor) -> None:
        raise NotImplementedError("eviction while decoding over pruned or quantized keys (ThinK, KIVI) is not "
                                  "supported: use an inner policy that evicts at the prefill only")

    def nbytes(self) -> int:
        """The bytes this layer holds: every stored block (codes, scales, zero points, channel indices, kept
        channels) and the full-precision tails, each tensor once."""
        held = [t for block in (*self.key_blocks, *self.value_blocks) for t in block.tensors]
        # blocks share channels
        unique = {t.data_ptr(): t for t in (*held, self.key_tail, self.value_tail) if t.numel()}
        return sum(t.nbytes for t in unique.values())


class PackedHeadwiseLayer(HeadwiseLayer):
    """A HeadwiseLayer (head-wise budgets: AdaKV, HeadKV, DuoAttention, KVzip's global selection) stored as `storage`
    says: each KV head's kept prompt positions as a PackedLayer of that head alone (its own quantization groups and
    full-precision tail, its own ThinK channels, chosen from its own kept keys), the tokens appended after the prompt
    as one PackedLayer over every head. kept_keys, kept_values, keys and values are rebuilt dense at each read, in
    the HeadwiseLayer's layout, so that its attention (layers.headwise_attention) reads them unchanged.

    heads[b][h]: batch row b's KV head h; channels: heads' kept key channels alike, (1, 1, c) or None.

    KIVI's groups of tokens never span a head's last kept prompt tokens and the first appended ones: a head's prompt
    keys past its last whole group stay in full precision (fewer than residual_length), where KIVI's own cache, one
    dense sequence, groups them with the tokens that follow; with heads of equal counts the prompt is stored exactly
    as a PackedLayer stores it (tests/test_storage.py)."""

    def __init__(self, layer: HeadwiseLayer, storage: Storage, channels: list[list[torch.Tensor | None]] | None):
        if layer.keys.shape[-2]:
            raise ValueError("a head-wise layer is stored packed right after its prompt's compression, with no "
                             f"token appended yet ({layer.keys.shape[-2]} here)")
        state = {k: v for k, v in vars(layer).items() if k not in ("keys", "values", "kept_keys", "kept_values")}
        self.__dict__.update(state)
        self.storage = storage
        counts = (self.kept >= 0).sum(-1).tolist()
        self.heads = [[PackedLayer(_one_head(keys, values, self.kept[b, h, :n], self.seen), storage,
                                   None if channels is None else channels[b][h])
                       for h, (keys, values, n) in enumerate(zip(row_keys, row_values, counts[b], strict=True))]
                      for b, (row_keys, row_values) in enumerate(zip(layer.prompt_keys, layer.prompt_values,
                                                                      strict=True))]
        empty = CompressedLayer(layer.keys, layer.values, self.kept[..., :0], self.seen)
        self.appended = PackedLayer(empty, storage, None)

    @property
    def kept_keys(self) -> torch.Tensor:
        return self._slots([[head.keys[0, 0] for head in row] for row in self.heads])

    @property
    def kept_values(self) -> torch.Tensor:
        return self._slots([[head.values[0, 0] for head in row] for row in self.heads])

    def _slots(self, rows: list[list[torch.Tensor]]) -> torch.Tensor:
        """(batch, slots, head_dim): each row's heads one after the other, zero slots after the row's last."""
        width = self.slot_hidden.shape[-1]
        joined = [torch.cat(row, 0) for row in rows]
        return torch.stack([F.pad(row, (0, 0, 0, width - row.shape[0])) for row in joined])

    @property
    def keys(self) -> torch.Tensor:
        return self.appended.keys

    @property
    def values(self) -> torch.Tensor:
        return self.appended.values

    def update(self, key_states, value_states, *args, **kwargs):
        self.appended = copy.copy(self.appended)  # forks share the one before: each updates its own copy
        keys, values = self.appended.update(key_states, value_states)
        self.seen += key_states.shape[-2]
        return keys, values

    def nbytes(self) -> int:
        return sum(head.nbytes() for row in self.heads for head in row) + self.appended.nbytes()


def _one_head(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, seen: int) -> CompressedLayer:
    """One KV head's kept prompt keys and values (kept, head_dim) as a one-row, one-head CompressedLayer."""
    return CompressedLayer(keys[None, None], values[None, None], positions[None, None], seen)


def pack_layers(storage: Storage, cache, layers: list[int], queries: dict[int, torch.Tensor] | None,
                pads: torch.Tensor | None = None) -> None:
    """Store each of `layers` of `cache` (after the positional policy's compression, or as the prefill left it) as
    `storage` says, in place. queries: {layer: (batch, heads, w, head_dim)} the prompt's last post-RoPE queries
    (w >= storage.channel_window), needed where channels are pruned."""
    if pads is not None:
        raise NotImplementedError("pruned or quantized storage (ThinK, KIVI) of a padded batch is not supported: "
                                  "its fill slots would share the rows' channel scores and quantization groups; run "
                                  "the prompts one at a time")
    for layer in layers:
        held = cache.layers[layer]
        query = None
        if storage.prunes_channels:
            if queries is None or layer not in queries or queries[layer].shape[2] < storage.channel_window:
                raise RuntimeError(f"ThinK scores layer {layer}'s key channels with the prompt's last "
                                   f"{storage.channel_window} queries, which the prefill did not keep")
            query = queries[layer][:, :, -storage.channel_window:]
        if isinstance(held, HeadwiseLayer):
            channels = None
            if query is not None:  # each KV head's channels from its query heads and its own kept keys
                group = query.shape[1] // held.kept.shape[1]
                channels = [[owned(storage.kept_channels(query[b, h * group:(h + 1) * group], keys[None])[None])
                             if len(keys) else None for h, keys in enumerate(row)]
                            for b, row in enumerate(held.prompt_keys)]
            cache.layers[layer] = PackedHeadwiseLayer(held, storage, channels)
            continue
        if not isinstance(held, CompressedLayer):  # the prompt fitted: every position, in order
            n = held.keys.shape[-2]
            held = CompressedLayer(held.keys, held.values, held_positions(held, n), n)
        channels = None
        if query is not None:
            channels = torch.stack([storage.kept_channels(query[b], held.keys[b]) for b in range(query.shape[0])])
        cache.layers[layer] = PackedLayer(held, storage, channels)
