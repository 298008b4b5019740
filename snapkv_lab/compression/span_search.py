"""Beyond single spans: the smallest set of blocks whose eviction changes the answer, and where (which layers, which
KV heads) one span's effect lives. Both read an EvictionProbe (compression.span_effects), so the context is
prefilled once and every candidate is one batch row of a forward.

    probe = EvictionProbe.prefilled(model, tokenizer, context, question)
    effects = probe_spans(probe, default_spans(probe.n, 64))
    found = minimal_evicting_set(probe, effects, budget=16)      # found.spans, found.changed, found.forwards
    layer_effects(probe, found.spans)                            # one row per layer: the set hidden there alone
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from .span_effects import EvictionProbe


@dataclass
class EvictingSet:
    """A search's result. spans: the set found (context positions), smallest first found by the search; changed:
    whether hiding it changes the greedy answer (False: none did within the budget, and spans is the largest set
    tried); effect: its row (kl, logprob_delta, answer_changed); forwards: the batched forwards the search ran;
    minimal: whether every member was tried out and none can be dropped (False where the budget ended the pruning
    first, or where nothing changed the answer)."""

    spans: list[tuple[int, int]]
    changed: bool
    effect: dict
    forwards: int
    minimal: bool = False


def minimal_evicting_set(probe: EvictionProbe, effects: pd.DataFrame, *, budget: int = 16,
                         batch_size: int = 8) -> EvictingSet:
    """A small set of the spans in `effects` (a span_effects table) whose eviction together changes the answer,
    within `budget` batched forwards of `batch_size` candidate sets each.

    Greedy, then pruned: spans are ranked by their own KL; the prefixes of that ranking (the top 1, 2, ... spans) are
    tried in batches until one changes the answer; then members are dropped one at a time, the weakest first, while
    the set without it still changes the answer (each round tries the members in batches of `batch_size`, one forward
    each, until one can be dropped or every one has been tried). Where the budget lets the last round try every
    member, the result is minimal in the sense that no single member can be dropped (`minimal`); a smaller set of
    other spans may exist (the search is greedy, not exhaustive: 2^spans sets)."""
    if budget < 1 or batch_size < 1:
        raise ValueError(f"budget and batch_size are positive counts of forwards and sets, got {budget}, {batch_size}")
    by_kl = effects.sort_values("kl", ascending=False, kind="stable")
    ranked = [(int(r.start), int(r.end)) for r in by_kl.itertuples()]
    if not ranked:
        raise ValueError("effects holds no span")
    used, found, effect = 0, None, None
    for at in range(0, len(ranked), batch_size):
        if used == budget:
            break
        prefixes = [ranked[:k] for k in range(at + 1, min(at + batch_size, len(ranked)) + 1)]
        rows = probe.effects(prefixes)
        used += 1
        hit = next((i for i, row in enumerate(rows) if row["answer_changed"]), None)
        if hit is not None:
            found, effect = prefixes[hit], rows[hit]
            break
        found, effect = prefixes[-1], rows[-1]
    if not effect["answer_changed"]:
        return EvictingSet(found, False, effect, used)
    minimal = len(found) == 1
    while not minimal and used < budget:
        # weakest first: the member whose own KL is smallest is tried first among those whose removal still works
        trials = [[s for s in found if s != drop] for drop in reversed(found)]
        tried, dropped = 0, False
        while tried < len(trials) and used < budget and not dropped:
            batch = trials[tried:tried + batch_size]
            rows = probe.effects(batch)
            used += 1
            hit = next((i for i, row in enumerate(rows) if row["answer_changed"]), None)
            if hit is None:
                tried += len(batch)
            else:
                found, effect, dropped = batch[hit], rows[hit], True
        if not dropped:  # every member tried and none can go, or the budget ended the round
            minimal = tried == len(trials)
            break
        minimal = len(found) == 1
    return EvictingSet(found, True, effect, used, minimal)


def layer_effects(probe: EvictionProbe, spans: list[tuple[int, int]], layers=None) -> pd.DataFrame:
    """One row per layer (default: every one): the effect of hiding `spans` from that layer alone (all its KV
    heads): layer, kl, logprob_delta, answer_changed. One forward per layer."""
    layers = range(len(probe.cache.layers)) if layers is None else layers
    return pd.DataFrame([dict(layer=layer, **probe.effects([list(spans)], layers=[layer])[0]) for layer in layers])


def head_effects(probe: EvictionProbe, spans: list[tuple[int, int]], layer: int) -> pd.DataFrame:
    """One row per KV head of `layer`: the effect of hiding `spans` from that head alone: layer, kv_head, kl,
    logprob_delta, answer_changed. One forward per head."""
    heads = probe.cache.layers[layer].keys.shape[1]
    rows = [dict(layer=layer, kv_head=head, **probe.effects([list(spans)], layers=[layer], heads=[head])[0])
            for head in range(heads)]
    return pd.DataFrame(rows)
