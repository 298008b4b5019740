"""How a policy's kept positions are stored: every key channel or some (ThinK), full precision or a few bits (KIVI).

Eviction chooses positions; `Storage` says what of each kept position the cache really holds. The engine
(compression.packed.PackedLayer) stores it so, and counts the bytes of what it holds: positions x channels x bits,
plus quantization scales and zero points, channel indices and the full-precision tails. Nothing pruned or quantized
is kept beside it (kvpress's ThinKPress zeroes the pruned channels in a full-size tensor: no byte saved).

The layout, for a layer of n kept positions (n counted after eviction), head_dim d:
- keys: the first `quantized` positions (those before the ThinK recent tail and the KIVI residual) hold the kept
  channels only (ThinK, `key_channel_ratio` > 0) and/or `key_bits`-bit codes per channel in groups of `group_size`
  tokens (KIVI); the rest are full precision, every channel. While decoding, new tokens join the full-precision tail;
  under KIVI, each time the tail holds `residual_length` positions its oldest `residual_length` are quantized per
  channel (every channel).
- values: under KIVI, all but the last `residual_length` positions are `value_bits`-bit codes per token in groups of
  `group_size` channels; while decoding the oldest full-precision value beyond `residual_length` is quantized.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..core.checks import check_int

BITS = (2, 4, 8)  # KIVI packs 2, 4 or 8 bits per code (quant/new_pack.py:99: "Only 2, 4, 8 bits are supported")


_CHANNELS = frozenset({"key_channel_ratio", "channel_window", "full_channel_recent"})  # ThinK's axis
_QUANTIZATION = frozenset({"key_bits", "value_bits", "group_size", "residual_length"})  # KIVI's


@dataclass(frozen=True)
class Storage:
    """What of each kept position a cache layer holds (see module doc). Defaults store everything."""

    key_channel_ratio: float = 0.0  # ThinK: the share of key channels pruned, per layer and KV head
    channel_window: int = 32  # ThinK: the last prompt queries that score channels
    full_channel_recent: int = 32  # ThinK: the last kept positions whose keys keep every channel
    key_bits: int | None = None  # KIVI: bits per key code (per channel), None: full precision
    value_bits: int | None = None  # KIVI: bits per value code (per token), None: full precision
    group_size: int = 32  # KIVI: tokens per key group, channels per value group, sharing a scale and zero point
    residual_length: int = 128  # KIVI: the most recent positions held in full precision

    def __post_init__(self):
        if not 0.0 <= self.key_channel_ratio < 1.0:
            raise ValueError(f"key_channel_ratio is the share of key channels pruned, in [0, 1): got "
                             f"{self.key_channel_ratio!r}")
        check_int("channel_window", self.channel_window, 1)
        check_int("full_channel_recent", self.full_channel_recent, 0)
        for name in ("key_bits", "value_bits"):
            if getattr(self, name) is not None and getattr(self, name) not in BITS:
                raise ValueError(f"{name} must be one of {BITS} or None (full precision), got {getattr(self, name)!r}")
        check_int("group_size", self.group_size, 1)
        check_int("residual_length", self.residual_length, 0)
        if self.quantizes and self.residual_length % self.group_size:
            raise ValueError(f"residual_length ({self.residual_length}) must be a multiple of group_size "
                             f"({self.group_size}): KIVI quantizes the keys' residual in whole groups "
                             "(models/llama_kivi.py: assert self.residual_length % self.group_size == 0)")

    @property
    def prunes_channels(self) -> bool:
        return self.key_channel_ratio > 0

    @property
    def quantizes(self) -> bool:
        return self.key_bits is not None or self.value_bits is not None

    @property
    def packs(self) -> bool:
        """Whether a layer is stored otherwise than as full-precision positions."""
        return self.prunes_channels or self.quantizes

    def with_settings(self, **settings) -> Storage:
        return dataclasses.replace(self, **settings)

    def wrapped(self, wrapper, **settings) -> Storage:
        """This (an inner policy's) storage with the storage wrapper `wrapper`'s `settings` added, refused where it
        already uses the axis they set: a second wrapper of one axis would silently replace the first one's
        settings."""
        for fields, used, uses in ((_QUANTIZATION, self.quantizes, "quantizes"),
                                   (_CHANNELS, self.prunes_channels, "prunes key channels")):
            if used and fields & settings.keys():
                raise ValueError(f"{wrapper.label}: the inner policy {uses} already")
        return self.with_settings(**settings)

    def pruned(self, head_dim: int) -> int:
        """Key channels pruned of head_dim (ThinK's int(head_dim * ratio), kv_pruning_utils.py:13)."""
        return int(head_dim * self.key_channel_ratio)

    def kept_channels(self, query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """(rows, head_dim - pruned) ascending: the key channels each row of a layer keeps (ThinK, arXiv 2407.21018,
        eq. 4's query-driven criterion in the official code's form, SalesforceAIResearch/ThinK e3654136,
        ThinK_flash/src/kv_pruning_utils.py:11-22: score_c = mean_t q[t, c]^2 * mean_j k[j, c]^2; the lowest
        int(d * ratio) channels pruned).

        query: (heads, w, d) the prompt's last post-RoPE queries (w <= channel_window); keys: (rows, n, d) the layer's
        kept post-RoPE keys, rows = KV heads (each KV head's query heads' query term averaged, as kvpress's
        think_press.py:81-82) or query heads (a per_query_head cache: each head its own, as the official code, whose
        keys are repeated per query head)."""
        rows, _, d = keys.shape
        if query.shape[0] % rows:
            raise ValueError(f"{query.shape[0]} query heads do not split over {rows} cache rows")
        queries = query.float().pow(2).mean(1).view(rows, -1, d).mean(1)  # (rows, d)
        scores = queries * keys.float().pow(2).mean(1)
        pruned = scores.topk(self.pruned(d), dim=-1, largest=False).indices
        kept = torch.ones_like(scores, dtype=torch.bool).scatter_(-1, pruned, False)
        return kept.nonzero()[:, 1].view(rows, d - self.pruned(d))
