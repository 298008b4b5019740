"""What a compressed cache holds, counted in KV entries: the budget's unit, auditable across policies.

A KV entry is one key and its value in one head of one layer's cache. `kept_tokens` (the longest layer's positions per
head) hides what policies with uneven budgets hold: AdaKV, CAKE, PyramidKV, KVzip's global selection, HeadKV and
DuoAttention move positions between heads and layers. Their totals, summed over layers and heads, are what two
policies at "the same ratio" must match.

Counted right after the prompt's compression, before the question of a query-agnostic run and before decoding
(eviction while decoding changes what is held later; the budget is the prompt's):
- held: the entries the cache holds (pads and a head-wise layer's empty slots not counted);
- full: the entries the uncompressed cache holds over the same prompt (KV heads x prompt tokens in a full-attention
  layer; a sliding-window layer's own bounded cache, which no policy compresses);
- budget: the entries the policy's nominal budget allows: `Policy.budget(n)` per KV head in each full-attention layer
  (the full count where the prompt fits), the full count in sliding layers. A policy whose held entries are its own
  decision, not its capacity's (`Policy.capacity_sets_entries` False: SimLayerKV, DMS), has the full count as its
  budget: its kv_share is what it chose to hold.
"""

from __future__ import annotations

from dataclasses import dataclass

from .layers import row_entries

# A results table's columns for what a run held (HeldEntries.columns), in this order after its cache-size column.
ENTRY_COLUMNS = ["kv_entries", "kv_share", "budget_share", "over_budget"]


@dataclass(frozen=True)
class HeldEntries:
    """KV entries per batch row and layer: held, full and budget are [row][layer] lists of ints (see module doc).
    A batch-1 run's totals are ints; a batch's are one per row."""

    held: list[list[int]]
    full: list[list[int]]
    budget: list[list[int]]
    compressed_heads: list[int]  # per row: (layer, KV head) pairs under a budget, each allowed one entry of rounding

    @classmethod
    def of(cls, cache, policy, prompt_tokens: list[int], kv_heads: int, pads=None) -> HeldEntries:
        """The entries of `cache` compressed by `policy` from prompts of `prompt_tokens[row]` tokens (their own, pads
        not counted); kv_heads: the model's KV heads per layer."""
        held = row_entries(cache, pads)
        sliding = [bool(getattr(layer, "is_sliding", False)) for layer in cache.layers]
        full, budget, compressed = [], [], []
        for row, n in zip(held, prompt_tokens, strict=True):
            per_head = policy.budget(n) if policy.capacity_sets_entries else None  # else no budget but the full cache
            full.append([h if slide else kv_heads * n for h, slide in zip(row, sliding, strict=True)])
            budget.append([f if slide or per_head is None else min(f, kv_heads * per_head)
                           for f, slide in zip(full[-1], sliding, strict=True)])
            compressed.append(0 if per_head is None else kv_heads * sliding.count(False))
        return cls(held, full, budget, compressed)

    @classmethod
    def of_state(cls, model, state, batch: int, n: int, pads=None) -> HeldEntries:
        """The entries of a compression state after the prefill of a batch of n slots (pads: (batch,) each row's left
        pads, None where no row is padded)."""
        config = model.config.get_text_config()
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        rows = [n] * batch if pads is None else [n - int(p) for p in pads]
        return cls.of(state.cache, state.policy, rows, kv_heads, pads)

    def _per_row(self, values: list[list[int]]):
        totals = [sum(row) for row in values]
        return totals[0] if len(totals) == 1 else totals

    def row(self, b: int) -> HeldEntries:
        """Batch row b alone, as its batch-1 run reports it."""
        return HeldEntries([self.held[b]], [self.full[b]], [self.budget[b]], [self.compressed_heads[b]])

    @property
    def total(self):
        """KV entries held, summed over layers and heads."""
        return self._per_row(self.held)

    @property
    def share(self):
        """Held over the uncompressed cache's entries on the same prompt."""
        return self._ratio(self.held, self.full)

    @property
    def budget_share(self):
        """The nominal budget's entries over the uncompressed cache's."""
        return self._ratio(self.budget, self.full)

    @property
    def over_budget(self):
        """Whether more entries are held than the nominal budget allows, beyond one per compressed head of rounding."""
        rows = zip(self.held, self.budget, self.compressed_heads, strict=True)
        over = [sum(h) > sum(b) + slack for h, b, slack in rows]
        return over[0] if len(over) == 1 else over

    def columns(self) -> dict:
        """A batch-1 run's columns for a results table: kv_entries, kv_share, budget_share and over_budget."""
        if len(self.held) != 1:
            raise ValueError(f"columns are one run's: split the batch of {len(self.held)} rows first (row(b))")
        return dict(kv_entries=self.total, kv_share=self.share, budget_share=self.budget_share,
                    over_budget=self.over_budget)

    def layer_shares(self) -> list[list[float]]:
        """[row][layer] held over the uncompressed cache's entries."""
        return [[h / f if f else 1.0 for h, f in zip(held, full, strict=True)]
                for held, full in zip(self.held, self.full, strict=True)]

    def _ratio(self, top, bottom):
        ratios = [sum(t) / sum(b) if sum(b) else 1.0 for t, b in zip(top, bottom, strict=True)]
        return ratios[0] if len(ratios) == 1 else ratios
