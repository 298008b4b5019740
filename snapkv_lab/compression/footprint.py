"""The KV footprint of a generation: what the cache holds at every decode step, its integral over the steps and its
peak.

A compressed cache's size right after the prompt says little about a long generation: eviction while decoding
(H2O, TOVA, R-KV, DecodingEviction) lets the cache grow between evictions and cuts it back, the full cache grows by
one entry per KV head and layer at every step, and a policy that makes the output longer holds its cache for more
steps. Bhaskar et al. ("Cache Me If You Can", arXiv 2506.17121, abstract) propose the KV footprint, which "accounts
for both the amount of KV entries stored and their lifespan in memory", and report the peak beside it. Here, over the
decode steps of one answer:

- held[t]: the KV entries (one key and its value in one head of one layer, summed over layers and KV heads, pads and
  a head-wise layer's empty slots not counted: layers.row_entries) the cache holds when new token t is predicted:
  t = 0 right after the prompt (and its question) and its compression, t > 0 right after decode step t, which fed
  token t - 1 and evicted if its policy evicts then. One value per generated token, the end token included;
- integral = sum_t held[t], in entry-steps (the area under the cache-size curve, one step per generated token);
- peak = max_t held[t]. A step that evicts appends its token before cutting back, so inside that forward the cache
  holds one more entry per layer and KV head than the step before it; the peak counts what is held between steps;
- bytes[t], bytes_integral, bytes_peak: the same in bytes of what the cache layers store (layers.cache_bytes: a
  pruned or quantized layer counts its own codes, scales and tails, policies.storage), a batch's split by rows'
  entries.

Counts read off the cache layers (`layers.row_entries`, `layers.cache_bytes`), no tensor copied: the engine records
them at every step of `greedy.greedy_decode`, for every policy alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .layers import cache_bytes, row_entries


@dataclass
class Footprint:
    """What a cache held at each decode step (see module doc): held[row][t] entries, bytes[t] of the whole batch."""

    held: list[list[int]] = field(default_factory=list)
    bytes: list[int] = field(default_factory=list)

    def record(self, cache, pads: torch.Tensor | None = None) -> None:
        """Append the cache's entries per batch row (pads: (batch,) each row's left pads) and its bytes."""
        rows = [sum(row) for row in row_entries(cache, pads)]
        if not self.held:
            self.held = [[] for _ in rows]
        for steps, entries in zip(self.held, rows, strict=True):
            steps.append(entries)
        self.bytes.append(cache_bytes(cache))

    def row(self, b: int, steps: int | None = None) -> Footprint:
        """Batch row b alone over its first `steps` tokens (None: all): its entries, and its share of the bytes
        (the row's entries over the batch's at each step)."""
        totals = [sum(step) for step in zip(*self.held, strict=True)]
        mine = self.held[b][:steps]
        shares = [round(nbytes * held / total) if total else 0
                  for nbytes, held, total in zip(self.bytes, mine, totals, strict=False)]
        return Footprint([mine], shares)

    def _one(self, name: str) -> list[int]:
        if len(self.held) != 1:
            raise ValueError(f"{name} is one run's: split the batch of {len(self.held)} rows first (row(b))")
        return self.held[0]

    @property
    def steps(self) -> int:
        return len(self._one("steps"))

    @property
    def integral(self) -> int:
        """Entry-steps: the entries held, summed over the decode steps."""
        return sum(self._one("integral"))

    @property
    def peak(self) -> int:
        """The most entries held at one step."""
        return max(self._one("peak"), default=0)

    @property
    def bytes_integral(self) -> int:
        self._one("bytes_integral")
        return sum(self.bytes)

    @property
    def bytes_peak(self) -> int:
        self._one("bytes_peak")
        return max(self.bytes, default=0)

    def columns(self) -> dict:
        """A batch-1 run's columns for a results table."""
        return dict(footprint_integral=self.integral, footprint_peak=self.peak,
                    footprint_bytes_integral=self.bytes_integral, footprint_bytes_peak=self.bytes_peak)
