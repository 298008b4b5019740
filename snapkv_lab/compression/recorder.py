"""Scores recorded at prefill without compressing, so that one prefill serves many policies and budgets.

    recorder = ScoreRecorder(policies)                       # a hook callback
    with intercept_attention(model, recorder): model(ids, past_key_values=full_cache)
    kept = kept_from_scores(policy, recorder.scores[policy.scorer_label], n, kv_heads, n_layers)
    compressed_copy(full_cache, kept)                        # what compress() would have built

The prefill's attention runs on the full keys under compression too, so scores recorded over a full
prefill equal those `compress` computes layer by layer.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from ..core.attention import AttentionSettings
from ..core.inputs import left_pads
from .compressor import all_where_none, attention_calls, stack_kept


class ScoreRecorder:
    """Hook callback that records, without compressing, the scores of several policies at every layer.

    Successive calls of a layer are prompt chunks (a context, then a question): accumulating policies add
    their scores up, the others keep the last chunk's. A policy that votes with the last queries (SnapKV's window,
    TOVA's last query) is handed a chunk shorter than its voters with the last queries of the chunks before it in
    front (a window may span the end of the context and the question, as in one prefill of both); every other policy
    sees each chunk's own queries, and what it carries from chunk to chunk (AttentionCall.carry), so its scores
    never depend on which other policies are recorded beside it. scores[policy.scorer_label][layer]: (batch, heads or
    kv_heads, n_keys). Policies sharing a scorer_label (differing only in budget) share one entry. Sliding-window
    layers are not scored: they are never compressed (see CompressionState).

    A padded batch (pads read off the first call's mask): each row is scored on its own tokens (its pads cut off,
    as CompressionState does), and its scores are stored left-padded with zeros to the batch's slots; `kept_from_scores`
    cuts them off again.
    """

    def __init__(self, policies, n_layers: int):
        policies = list(policies)
        self.policies = {p.scorer_label: p for p in policies if not p.scores_after_prefill}
        self.n_layers = n_layers
        # The most any policy votes with; a policy scoring after the prefill reads its voters from `recent`
        # (LookaheadQCache's draft window), so it counts here although it is not scored at the calls.
        self.voters = max((p.voters for p in policies), default=0)
        self.scores: dict[str, dict[int, torch.Tensor]] = {label: {} for label in self.policies}
        self.recent: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> last `voters` queries, their slots
        self.settings: dict[int, AttentionSettings] = {}  # layer -> its attention settings (scaling, soft-cap)
        self.carry: dict[tuple[str, int, int], dict] = {}  # (policy label, layer, batch row) -> AttentionCall.carry
        self.seen_layers: set[int] = set()  # layers whose attention calls reached the recorder
        self.sliding_layers: set[int] = set()  # of those, the sliding-window ones (never scored)
        self.pads: torch.Tensor | None = None  # (batch,) a padded batch's left pads
        self._prefilled = False  # the first call (the prompt's) has been seen: its mask told the pads

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        if not self._prefilled:
            self.pads, self._prefilled = left_pads(attention_mask), True
        self.seen_layers.add(module.layer_idx)
        settings = AttentionSettings.of_call(module, kwargs)
        if settings.sliding_window is not None:
            self.sliding_layers.add(module.layer_idx)
            return
        layer, n, rows = module.layer_idx, key.shape[2], query.shape[2]
        self.settings[layer] = settings
        slots = torch.arange(n - rows, n)  # at prefill a query's cache slot is its position
        pads = self.pads
        new_calls = attention_calls(module, query, key, value, slots, settings, self.n_layers, lead=pads)
        spanning = new_calls
        if layer in self.recent and rows < self.voters:  # (batch, heads, rows, d) with earlier chunks' last queries
            earlier, earlier_slots = self.recent[layer]
            query, slots = torch.cat([earlier, query], 2)[:, :, -self.voters:], torch.cat([earlier_slots, slots])[-self.voters:]
            spanning = attention_calls(module, query, key, value, slots, settings, self.n_layers, lead=pads)
        if self.voters:  # copies: a slice would keep the whole prompt's queries of every layer alive (8 GB at 32k, 8B)
            self.recent[layer] = (query[:, :, -self.voters:].clone(), slots[-self.voters:].clone())
        for label, policy in self.policies.items():
            calls = spanning if policy.voters else new_calls
            scored = [policy.score(dataclasses.replace(call, carry=self.carry.setdefault((label, layer, b), {})))
                      for b, call in enumerate(calls)]
            if scored[0] is None:
                continue
            if pads is not None:  # each row's own keys: left-padded back to the batch's slots
                scored = [F.pad(s, (n - s.shape[-1], 0)) for s in scored]
            new = torch.stack(scored)
            old = self.scores[label].get(layer)
            if policy.accumulates and old is not None:
                new = new + F.pad(old, (0, n - old.shape[-1]))
            self.scores[label][layer] = new

    def copy(self) -> ScoreRecorder:
        """A recorder that goes on from this one's scores (a question chunk after a shared context)."""
        other = ScoreRecorder(self.policies.values(), self.n_layers)
        other.voters, other.settings = self.voters, dict(self.settings)
        other.scores = {label: dict(layers) for label, layers in self.scores.items()}
        other.recent = dict(self.recent)
        other.carry = {key: dict(carried) for key, carried in self.carry.items()}
        other.seen_layers, other.sliding_layers = set(self.seen_layers), set(self.sliding_layers)
        other.pads, other._prefilled = self.pads, self._prefilled
        return other


def kept_from_scores(policy, scores: dict[int, torch.Tensor], n: int, kv_heads: int, n_layers: int,
                     pads: torch.Tensor | None = None) -> dict | None:
    """{layer: kept positions (batch, kv_heads, k)} for every scored layer ({layer: (batch, rows, n)}), by the
    policy's `keep_layers` for each batch row (none when no layer was scored: all slide); None if the prompt fits the
    budget. A padded batch (pads (batch,)): {layer: [per row (heads, k_b) its own kept positions]}, each row by its
    own length and scores (all its positions where it fits), None if every row fits."""
    if pads is not None:
        return _row_kept_from_scores(policy, scores, n, kv_heads, n_layers, pads)
    if policy.budget(n) is None:
        return None
    layers = sorted(scores)
    if not layers:
        return {}
    rows = [policy.keep_layers({layer: scores[layer][b] for layer in layers}, n, kv_heads, n_layers)
            for b in range(scores[layers[0]].shape[0])]
    return {layer: stack_kept([row[layer] for row in rows]) for layer in layers}


def _row_kept_from_scores(policy, scores, n, kv_heads, n_layers, pads) -> dict | None:
    lengths = (n - pads).tolist()
    if all(policy.budget(length) is None for length in lengths):
        return None
    layers = sorted(scores)
    rows = [policy.keep_layers({layer: scores[layer][b][:, n - length:] for layer in layers}, length, kv_heads, n_layers)
            if policy.budget(length) is not None else {} for b, length in enumerate(lengths)]
    return {layer: all_where_none([row.get(layer) for row in rows], lengths, kv_heads) for layer in layers}
