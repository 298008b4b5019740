"""The one way a policy's scores become a compressed cache: score (recorder), keep, merge (a merging policy's
values) and rekey (a policy's rewritten keys: KeyRerotation), build, per layer.

    calls = attention_calls(module, query, key, value, slots, settings, n_layers, lead=pads)   # one per batch row
    scores = {layer: (batch, rows, slots)}                       # recorder.ScoreRecorder, from those calls
    kept, slots, seeds = compress_layers(policy, scores, cache, n_layers, pads=pads)       # keep, merge, build

The live compressor (compressor.compress: one layer as its prefill call ends, or each prompt chunk) and the shared
prefill (shared.SharedPrefill.state: every layer at once, from the scores recorded over a full prefill) both call
`compress_layers`, so a policy is applied one way whatever runs it. A policy whose layers share one budget (KVzip's
global allocation, CAKE) needs every layer's scores at once: only the shared prefill can give them.

Batches are rows: each batch row is scored and kept as its batch-1 run (a padded batch's row on its own tokens, its
pads cut off, with budgets from its own length), and the rows' layers are stacked, left-filled where they keep
different counts (layers.build_layer). A batch of one length is the case with no pads and no fill.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from ..policies.base import NO_POSITION, AttentionCall, Policy
from ..policies.decoding import prefill_seeds, seeded
from .layers import RollingWindow, build_layer, held_positions, stack_rows
from .packed import pack_layers


def attention_calls(module, query, key, value, slots, settings, n_layers, positions=None, lead=None, shift=None):
    """One AttentionCall per batch row of an attention call's (batch, heads, rows, head_dim) tensors; slots and
    positions (rows,) as AttentionCall's (positions default to the slots, as at prefill).

    lead (batch,): the leading slots of each row that hold none of its tokens (a padded batch's pads, or fill slots),
    cut off the row's keys and query rows so that the row's call is its batch-1 call (its slots counted after them);
    shift (batch,): each row's pads, subtracted from its positions (default: lead)."""
    positions = slots if positions is None else positions
    lead = [0] * query.shape[0] if lead is None else [int(x) for x in lead]
    shift = lead if shift is None else [int(x) for x in shift]
    calls = []
    for b, drop in enumerate(lead):
        first = int((slots < drop).sum()) if drop else 0  # query rows on dropped slots (slots ascend)
        calls.append(AttentionCall(query[b][:, first:], key[b][:, drop:], value[b][:, drop:], slots[first:] - drop,
                                   settings, module, module.layer_idx, n_layers, positions[first:] - shift[b]))
    return calls


def row_lengths(n_slots: int, batch: int, pads: torch.Tensor | None) -> list[int]:
    """Each batch row's own slots: all n_slots, less its left pads."""
    return [n_slots] * batch if pads is None else (n_slots - pads).tolist()


def kept_rows(policy: Policy, scores: dict[int, torch.Tensor], lengths: list[int], kv_heads: int,
              n_layers: int) -> dict[int, list[torch.Tensor]] | None:
    """{layer: per batch row (rows, k_b) the positions it keeps among its own slots}, by the policy's `keep_layers` over
    the row's own scores (scores[layer]: (batch, rows, slots), each row's own slots last) and budget; a row within its
    budget keeps all its positions. None when every row fits."""
    if all(policy.budget(n) is None for n in lengths):
        return None
    layers = sorted(scores)
    rows = []
    for b, n in enumerate(lengths):
        budget = policy.layer_budget_of(n, kv_heads, n_layers)
        own = {layer: scores[layer][b][:, scores[layer].shape[-1] - n:] for layer in layers}
        rows.append({} if budget is None else policy.keep_layers(own, budget))
    heads = max((row[layer].shape[0] for row in rows for layer in row), default=kv_heads)
    return {layer: [row[layer] if layer in row else torch.arange(n).expand(heads, -1)
                    for row, n in zip(rows, lengths, strict=True)] for layer in layers}


def kept_from_scores(policy: Policy, scores: dict[int, torch.Tensor], n: int, kv_heads: int, n_layers: int,
                     pads: torch.Tensor | None = None) -> dict[int, torch.Tensor] | None:
    """{layer: (batch, rows, widest)} the positions each batch row keeps of an n-slot prompt (`kept_rows`), NO_POSITION
    after a row's last; None when every row fits its budget. pads (batch,): a padded batch's left pads."""
    batch = next(iter(scores.values())).shape[0] if scores else 1
    rows = kept_rows(policy, scores, row_lengths(n, batch, pads), kv_heads, n_layers)
    return None if rows is None else {layer: stack_rows(kept) for layer, kept in rows.items()}


def rolling_window(policy: Policy, kept: list[torch.Tensor], lengths: list[int], device) -> RollingWindow | None:
    """A layer's RollingWindow under `policy` (`Policy.decode_window`), None when no batch row's heads roll: a row's
    rolling heads are those keeping less than its n own positions (kept: per row (rows, k) positions, NO_POSITION
    after a head's last)."""
    windows = [policy.decode_window(n) for n in lengths]
    if all(window is None for window in windows):
        return None
    streaming = torch.stack([(row >= 0).sum(-1) < n if window is not None
                             else torch.zeros(row.shape[0], dtype=torch.bool)
                             for row, n, window in zip(kept, lengths, windows, strict=True)])
    sinks, recent = (torch.tensor([0 if window is None else window[i] for window in windows], device=device)
                     for i in (0, 1))
    return RollingWindow(streaming.to(device), sinks, recent)


def merged_values(policy: Policy, keys: torch.Tensor, values: torch.Tensor, kept: list[torch.Tensor],
                  lead: list[int]) -> torch.Tensor:
    """A layer's values (batch, kv_heads, slots, head_dim) with each batch row's kept values rewritten by
    `policy.merge` over the row's own slots (after its `lead` leading pads; kept: per row (rows, k) positions among
    them), before `build_layer` gathers the kept positions: `values` itself where the policy merges nothing, else a
    new tensor (the cache it came from, a shared prefill's among them, is left as it was)."""
    return _rows_rewritten(values, kept, lead, lambda b, drop, row: policy.merge(keys[b, :, drop:], values[b, :, drop:],
                                                                                 row))


def rekeyed(policy: Policy, keys: torch.Tensor, kept: list[torch.Tensor], lead: list[int], module) -> torch.Tensor:
    """`merged_values` for keys: each batch row's kept keys rewritten by `policy.rekey` (module: the layer's attention
    module, its RoPE), `keys` itself where the policy rewrites none."""
    return _rows_rewritten(keys, kept, lead, lambda b, drop, row: policy.rekey(keys[b, :, drop:], row, module))


def _rows_rewritten(layer: torch.Tensor, kept: list[torch.Tensor], lead: list[int], rewrite) -> torch.Tensor:
    """`layer` (batch, kv_heads, slots, head_dim) with row b's own slots (after its lead[b] pads) replaced by
    rewrite(b, lead[b], kept[b]) where that gives a tensor (None: the row as it was); a new tensor if any row is."""
    rewritten = layer
    for b, (row, drop) in enumerate(zip(kept, lead, strict=True)):
        new = rewrite(b, drop, row)
        if new is None:
            continue
        if rewritten is layer:
            rewritten = layer.clone()
        rewritten[b, :, drop:] = new
    return rewritten


def compress_layers(policy: Policy, scores: dict[int, torch.Tensor], cache: DynamicCache, n_layers: int, *,
                    pads: torch.Tensor | None = None, positions: dict[int, torch.Tensor] | None = None,
                    seen: int | None = None, queries: dict[int, torch.Tensor] | None = None,
                    modules: dict | None = None) -> tuple[dict, dict, dict]:
    """Keep and build: each layer of `scores` ({layer: (batch, rows, slots)}, a padded batch's rows left-padded with
    zeros) in `cache` is replaced by one holding what `policy` keeps of it, each batch row by its own scores and budget.

    pads (batch,): a padded batch's left pads. positions: {layer: (batch, kv_heads, slots)} the token position of each
    slot, where slots are not the prompt's own positions (a chunked prefill's held slots then its chunk); seen: the
    tokens the layers have seen (default: their slots). Returns (kept positions {layer: (batch, rows, k)}, kept slots
    {layer: (batch, rows, k)}, seeds {layer: (batch, kv_heads, k)}: the prefill scores of the held positions, for a
    policy that evicts while decoding by accumulated scores (H2O); empty otherwise). Every row within its budget: the
    layers are left as they are (their held positions reported). A policy whose `storage` prunes key channels or
    quantizes (ThinK, KIVI) has every layer of `scores` stored so afterwards (packed.pack_layers; queries: {layer:
    (batch, heads, w, head_dim)} the prompt's last queries, which ThinK's channel scores read). modules: {layer: its
    attention module}, for a policy that rewrites the keys it keeps (`Policy.rekey`: KeyRerotation reads the RoPE)."""
    layers = sorted(scores)
    if not layers:
        return {}, {}, {}
    batch, n_slots = scores[layers[0]].shape[0], scores[layers[0]].shape[-1]
    lengths = row_lengths(n_slots, batch, pads)
    kv_heads = cache.layers[layers[0]].keys.shape[1]
    rows = kept_rows(policy, scores, lengths, kv_heads, n_layers)
    lead = [0] * batch if pads is None else pads.tolist()
    kept, slots, seeds = {}, {}, {}
    for layer in layers:
        full = cache.layers[layer]
        held = positions[layer] if positions is not None else held_positions(full, n_slots, pads)
        if rows is None:
            kept[layer] = slots[layer] = held
        else:
            own = [torch.where(row >= 0, row + drop, NO_POSITION) for row, drop in zip(rows[layer], lead, strict=True)]
            if positions is not None and any(bool((row == NO_POSITION).any()) for row in own):
                raise NotImplementedError(f"{policy.label}: head-wise budgets under a chunked prefill are not "
                                          "supported (a ragged cache layer cannot take the next chunk)")
            values = merged_values(policy, full.keys, full.values, rows[layer], lead)
            keys = rekeyed(policy, full.keys, rows[layer], lead, None if modules is None else modules.get(layer))
            cache.layers[layer], kept[layer] = build_layer(keys, values, own, held,
                                                           n_slots if seen is None else seen, pads)
            cache.layers[layer].window = rolling_window(policy, rows[layer], lengths, full.keys.device)
            slots[layer] = stack_rows(own, left=True)
        if seeded(policy):  # per row: its own scores at its kept positions, left-filled as the layer's slots
            own_kept = rows[layer] if rows is not None else [torch.arange(n).expand(kv_heads, -1) for n in lengths]
            seeds[layer] = stack_rows([prefill_seeds([scores[layer][b][:, n_slots - n:]], k[None])[0]
                                       for b, (n, k) in enumerate(zip(lengths, own_kept, strict=True))], True, 0.0)
    if policy.storage is not None and policy.storage.packs:
        pack_layers(policy.storage, cache, layers, queries, pads)
    return kept, slots, seeds


def refuse_unseen_layers(cache: DynamicCache, seen, sliding, label: str, stacklevel: int = 3) -> None:
    """Raise if a layer filled `cache` without its attention calls reaching our hook (`seen`: layer indices that did),
    since the run would be uncompressed under a compressed label; warn if every seen layer is a sliding-window layer
    (`sliding`), which the compressor leaves to its own bounded cache."""
    import warnings

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
