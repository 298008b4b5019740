"""CurDKV (arXiv 2509.15038; its code here is kvpress 0.5.5's CURPress, presses/cur_press.py): keep the tokens whose
keys and values carry most of their window's energy, the row leverage of a CUR decomposition approximated by squared
norms.

A token's key leverage is ||k||^2, its value leverage ||v||^2 (random_projection=True: after a Gaussian projection G,
d x r, N(0, 1/r), shared by keys and values, cur_press.py:37-41); with the local approximation (the default) each is
divided by its sum over a window of `local_window_size` (16) tokens (:46-55); the two combine as their product
(leverage_type "kv_product", the default; "key", "value", "kv_avg" the others, :57-66), normalised to sum to 1 over the
positions (:68); the first `n_sink` (4) are kept (score 1, :69; +inf here). Post-RoPE keys, as cached (RoPE leaves
||k|| unchanged; only the projection sees the rotation). No kept tail: every position competes.

Windows: kvpress pads the energies at the end, windows from position 0 (:49-55): window_alignment="start", the
default. A public kvpress-style CURPress whose repository we could not identify (so not cited as the authors') pads
them in front instead, windows ending at the last position, a whole window of padding when n is a multiple of it
(`approximate_local_leverage_scores_matrix`): window_alignment="end", our variant, named in the label. The projection:
kvpress draws G from torch's global generator (r = 20, hard-coded: projection_dim); we draw it from a generator seeded
with seed * 100_003 + layer (the peer row seeds kvpress's global generator the same way).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from ..core.checks import check_int
from .base import AttentionCall, Policy

LEVERAGE_TYPES = ("key", "value", "kv_avg", "kv_product")
WINDOW_ALIGNMENTS = ("start", "end")


@dataclass
class CUR(Policy):
    """CurDKV's approximate leverage of keys and values (see module doc). score: (kv_heads, n_keys), +inf on sinks."""

    kept_tail: int = 0
    n_sink: int = 4
    leverage_type: str = "kv_product"
    random_projection: bool = False
    projection_dim: int = 20
    local_approximation: bool = True
    local_window_size: int = 16
    window_alignment: str = "start"
    seed: int = 0

    scores_query_heads: ClassVar[bool] = False

    def __post_init__(self):
        super().__post_init__()
        check_int("n_sink", self.n_sink)
        check_int("projection_dim", self.projection_dim, 1)
        check_int("local_window_size", self.local_window_size, 1)
        check_int("seed", self.seed)
        if self.leverage_type not in LEVERAGE_TYPES:
            raise ValueError(f"leverage_type must be one of {LEVERAGE_TYPES}, got {self.leverage_type!r}")
        if self.window_alignment not in WINDOW_ALIGNMENTS:
            raise ValueError(f"window_alignment must be one of {WINDOW_ALIGNMENTS}, got {self.window_alignment!r}")

    def score(self, call: AttentionCall) -> torch.Tensor:
        keys, values = call.key.float(), call.value.float()
        if self.random_projection:
            r = self.projection_dim
            generator = torch.Generator().manual_seed(self.seed * 100_003 + call.layer)
            projection = (torch.randn(keys.shape[-1], r, generator=generator) / math.sqrt(r)).to(keys.device)
            keys, values = keys @ projection, values @ projection
        k2, v2 = keys.square().sum(-1), values.square().sum(-1)  # (kv_heads, n)
        if self.local_approximation:
            k2, v2 = self._local(k2), self._local(v2)
        scores = {"key": k2, "value": v2, "kv_avg": (k2 + v2) / 2, "kv_product": k2 * v2}[self.leverage_type]
        scores = scores / scores.sum(dim=-1, keepdim=True)
        scores[:, : self.n_sink] = math.inf
        return scores

    def _local(self, energy: torch.Tensor) -> torch.Tensor:
        """(kv_heads, n) -> each position's share of its window's total, windows of local_window_size aligned as
        `window_alignment` says (zero padding fills the window at the other end)."""
        n, w = energy.shape[-1], self.local_window_size
        if self.window_alignment == "start":
            windows = F.pad(energy, (0, (w - n % w) % w)).view(energy.shape[0], -1, w)
            return (windows / windows.sum(-1, keepdim=True)).flatten(1)[:, :n]
        windows = F.pad(energy, ((n // w + 1) * w - n, 0)).view(energy.shape[0], -1, w)
        return (windows / windows.sum(-1, keepdim=True)).flatten(1)[:, -n:]
