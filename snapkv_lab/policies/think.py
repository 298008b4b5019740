"""ThinK (Xu et al. 2024, arXiv 2407.21018, "ThinK: Thinner Key Cache by Query-Driven Pruning"): prune key channels,
not positions. Per layer and KV head, the channels whose query-key interaction is weakest over the prompt's last
queries are dropped from the stored keys; values keep every channel.

Official code: SalesforceAIResearch/ThinK, commit e3654136, ThinK_flash/src/kv_pruning_utils.py:11-27
(`key_pruner_query_driven`: score_c = mean over the last 32 queries of q_c^2 times mean over the kept keys of k_c^2,
the int(d * ratio) lowest pruned, the last `recent_size` = 32 positions keeping every channel) and :97-130
(`update_thinkv`: SnapKV first, then the channels of what SnapKV kept); defaults :212-218 (ratio 0.4, recent_size 32).
The official keys are repeated per query head before pruning (llama_model.py:83-85), so each query head prunes its
own; ours prune per KV head (the query term averaged over its query heads, as kvpress's ThinKPress,
think_press.py:81-82), so that a GQA cache stores one set; per_query_head=True on the inner policy gives the official
layout. Tokens generated later keep every channel (official: `update` appends them unpruned).

kvpress 0.5.5's ThinKPress zeroes the pruned channels in place (think_press.py:90-92: "no memory gain"), pruning every
position (no full-channel recent tail) with key_channel_compression_ratio 0.0 by default. Ours really stores fewer
channels (compression.packed.PackedLayer); `recent_size=0` prunes every position, as kvpress.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..core.checks import check_int
from .storage import Storage
from .wrapper import Wrapper


@dataclass
class ThinK(Wrapper):
    """Key-channel pruning over any positional policy (`policy`: SnapKV by default; capacity=None, the default, keeps
    every position: ThinK alone). key_channel_ratio: the share of key channels pruned (official 0.4); window_size:
    the last prompt queries that score channels (official 32); recent_size: the last kept positions whose keys keep
    every channel (official 32)."""

    keeps_inner_selection: ClassVar[bool] = True
    capacity: int | float | None = None
    key_channel_ratio: float = 0.4
    window_size: int = 32
    recent_size: int = 32

    def __post_init__(self):
        super().__post_init__()
        check_int("window_size", self.window_size, 1)
        check_int("recent_size", self.recent_size, 0)
        _ = self.storage  # checks the ratio now, not at the first prefill

    @property
    def storage(self) -> Storage:
        return (self.policy.storage or Storage()).wrapped(
            self, key_channel_ratio=self.key_channel_ratio, channel_window=self.window_size,
            full_channel_recent=self.recent_size)
