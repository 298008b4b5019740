"""Cache layers that hold a compressed prompt, and cache surgery (fork, gather, bytes).

Two layouts, both holding only kept positions (no fake keys, no padding kept across steps):

- `CompressedLayer`: every head keeps the same number of positions: dense (batch, heads, kept, head_dim),
  attended by the model's own attention function (sdpa, flash, eager).
- `HeadwiseLayer`: heads keep different numbers (head-adaptive budgets such as AdaKV): each (batch row,
  KV head) holds its own (kept_bh, head_dim) tensors; tokens that arrive after compression are dense.
  `headwise_attention` computes its attention (the compressor routes the layer's calls there).

Both record `positions`: the token position of every slot, so that kept indices stay meaningful after
eviction during decoding.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ..attention import AttentionSettings
from ..policies.base import NO_POSITION


def gather_kv(tensor: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """Keep positions of one layer's keys or values.

    tensor: (batch, kv_heads, n, head_dim); kept: (batch, kv_heads or heads, budget).
    With one selection per query head, the KV heads are first repeated as transformers' repeat_kv does.
    Returns (batch, kept heads, budget, head_dim), contiguous (the full tensor can be freed).
    """
    if kept.shape[1] != tensor.shape[1]:
        tensor = tensor.repeat_interleave(kept.shape[1] // tensor.shape[1], dim=1)
    return tensor.gather(2, kept[..., None].expand(-1, -1, -1, tensor.shape[-1]))


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

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, seen: int, groups: int = 1):
        super().__init__()
        self.lazy_initialization(keys, values)
        self.keys, self.values, self.positions, self.seen, self.groups = keys, values, positions, seen, groups

    def update(self, key_states, value_states, *args, **kwargs):
        if self.groups > 1:
            key_states = key_states.repeat_interleave(self.groups, dim=1)
            value_states = value_states.repeat_interleave(self.groups, dim=1)
        self.positions = torch.cat([self.positions, _new_positions(self.positions, self.seen, key_states.shape[-2])], -1)
        self.seen += key_states.shape[-2]
        return super().update(key_states, value_states, *args, **kwargs)

    def evict(self, kept_slots: torch.Tensor) -> None:
        """Keep only the slots `kept_slots` (batch, heads, k) of the layer (eviction while decoding)."""
        self.keys, self.values = gather_kv(self.keys, kept_slots), gather_kv(self.values, kept_slots)
        self.positions = self.positions.gather(-1, kept_slots)

    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(_ROLLBACK_REFUSED)


def held_positions(layer, n: int) -> torch.Tensor:
    """(batch, kv_heads, held) the positions an uncompressed layer holds after n tokens: its last `held` (all of
    them for a full layer, the last sliding_window - 1 for a sliding one)."""
    held = layer.keys.shape[-2]
    return torch.arange(n - held, n, device=layer.keys.device).expand(*layer.keys.shape[:2], -1)


def hidden_future(rows: int, n_keys: int, device) -> torch.Tensor:
    """(rows, n_keys) bool, True where a key is hidden: the rows are the last `rows` of n_keys tokens, each
    seeing every key up to itself (a causal mask whose earlier keys are all visible)."""
    return torch.ones(rows, n_keys, dtype=torch.bool, device=device).triu(n_keys - rows + 1)


def _new_positions(positions: torch.Tensor, seen: int, count: int) -> torch.Tensor:
    """(batch, heads, count) positions seen..seen+count-1, shaped like `positions`."""
    new = torch.arange(seen, seen + count, device=positions.device)
    return new.expand(*positions.shape[:2], -1)


class HeadwiseLayer(DynamicLayer):
    """Kept prompt positions of different counts per head, stored ragged; later tokens dense.

    prompt_keys[b][h], prompt_values[b][h]: (kept_bh, head_dim) of batch row b, KV head h.
    keys, values: (batch, kv_heads, new, head_dim) tokens appended after compression (every head sees them).
    kept: (batch, kv_heads, widest) the prompt positions, NO_POSITION (-1) after a head's last one.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, kept: torch.Tensor):
        super().__init__()
        self.lazy_initialization(keys, values)
        self.prompt_keys = [[k[h, row[row >= 0]] for h, row in enumerate(rows)] for k, rows in zip(keys, kept)]
        self.prompt_values = [[v[h, row[row >= 0]] for h, row in enumerate(rows)] for v, rows in zip(values, kept)]
        self.kept, self.seen = kept, keys.shape[-2]
        # Fresh empty tensors, not keys[:, :, :0]: a zero-length view would keep the whole prompt's storage alive.
        self.keys = keys.new_empty(*keys.shape[:2], 0, keys.shape[-1])
        self.values = values.new_empty(*values.shape[:2], 0, values.shape[-1])

    def get_seq_length(self) -> int:
        """The longest head's length: what transformers sizes masks by (the compressor builds its own)."""
        return max(len(k) for row in self.prompt_keys for k in row) + self.keys.shape[-2]

    def update(self, key_states, value_states, *args, **kwargs):
        self.seen += key_states.shape[-2]
        return super().update(key_states, value_states, *args, **kwargs)

    @property
    def positions(self) -> torch.Tensor:
        """(batch, kv_heads, widest + new) position of every slot, NO_POSITION where a head has none."""
        return torch.cat([self.kept, _new_positions(self.kept, self.seen - self.keys.shape[-2], self.keys.shape[-2])], -1)

    def nbytes(self) -> int:
        prompt = sum(t.nbytes for rows in (self.prompt_keys, self.prompt_values) for row in rows for t in row)
        return prompt + self.keys.nbytes + self.values.nbytes

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(_ROLLBACK_REFUSED)


def headwise_attention(layer: HeadwiseLayer, query: torch.Tensor, settings: AttentionSettings) -> torch.Tensor:
    """Attention of `query` (batch, heads, rows, head_dim), the last `rows` tokens of the layer, over each head's
    kept prompt positions (all visible) and the tokens since (causal). Returns (batch, rows, heads, head_dim), as
    transformers' attention functions do. Each (batch row, KV head) is one small softmax in float32."""
    batch, heads, rows, _ = query.shape
    kv_heads = layer.keys.shape[1]
    group = heads // kv_heads
    new = layer.keys.shape[-2]
    hidden = hidden_future(rows, new, query.device)  # over the appended tokens: the prompt's are all visible
    out = torch.empty_like(query)
    for b in range(batch):
        for h in range(kv_heads):
            q = query[b, h * group:(h + 1) * group].float()  # (group, rows, head_dim)
            keys = torch.cat([layer.prompt_keys[b][h], layer.keys[b, h]]).float()  # (kept_bh + new, head_dim)
            values = torch.cat([layer.prompt_values[b][h], layer.values[b, h]]).float()
            logits = q @ keys.T * settings.scaling  # (group, rows, kept_bh + new)
            if settings.softcap is not None:
                logits = settings.softcap * torch.tanh(logits / settings.softcap)
            if new:
                logits[..., -new:] = logits[..., -new:].masked_fill(hidden, float("-inf"))
            out[b, h * group:(h + 1) * group] = (F.softmax(logits, dim=-1) @ values).to(query.dtype)
    return out.transpose(1, 2)


def fork(cache: DynamicCache) -> DynamicCache:
    """A new cache over the same tensors, without copying: every layer type grows by concatenation and
    slicing, never in place, so decoding on the fork leaves `cache` as it was and forks can share it."""
    forked = DynamicCache()
    forked.layers = [copy.copy(layer) for layer in cache.layers]
    return forked


def compressed_layer(keys: torch.Tensor, values: torch.Tensor, kept: torch.Tensor) -> DynamicLayer:
    """The layer holding positions `kept` (batch, kv_heads or heads, k) of keys/values (batch, kv_heads, n, d):
    dense when every head keeps as many, ragged (HeadwiseLayer) when `kept` is padded with NO_POSITION."""
    if bool((kept == NO_POSITION).any()):
        return HeadwiseLayer(keys, values, kept)
    return CompressedLayer(gather_kv(keys, kept), gather_kv(values, kept), kept, keys.shape[-2],
                           kept.shape[1] // keys.shape[1])


def compressed_copy(cache: DynamicCache, kept: dict[int, torch.Tensor]) -> DynamicCache:
    """A fork of `cache` whose layers in `kept` ({layer: (batch, kv_heads, kept)}) hold only those positions."""
    forked = fork(cache)
    for i, positions in kept.items():
        forked.layers[i] = compressed_layer(cache.layers[i].keys, cache.layers[i].values, positions)
    return forked


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
