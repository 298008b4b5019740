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

from ..attention import AttentionSettings
from .compressor import attention_calls, stack_kept


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
    """

    def __init__(self, policies, n_layers: int):
        self.policies = {p.scorer_label: p for p in policies if not p.extra_passes}
        self.n_layers = n_layers
        self.window = max((p.voters for p in self.policies.values()), default=0)
        self.scores: dict[str, dict[int, torch.Tensor]] = {label: {} for label in self.policies}
        self.recent: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> last `window` queries, their slots
        self.carry: dict[tuple[str, int, int], dict] = {}  # (policy label, layer, batch row) -> AttentionCall.carry
        self.seen_layers: set[int] = set()  # layers whose attention calls reached the recorder
        self.sliding_layers: set[int] = set()  # of those, the sliding-window ones (never scored)

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        self.seen_layers.add(module.layer_idx)
        settings = AttentionSettings.of_call(module, kwargs)
        if settings.sliding_window is not None:
            self.sliding_layers.add(module.layer_idx)
            return
        layer, n, rows = module.layer_idx, key.shape[2], query.shape[2]
        slots = torch.arange(n - rows, n)  # at prefill a query's cache slot is its position
        new_calls = attention_calls(module, query, key, value, slots, settings, self.n_layers)
        spanning = new_calls
        if layer in self.recent and rows < self.window:  # (batch, heads, rows, d) with earlier chunks' last queries
            earlier, earlier_slots = self.recent[layer]
            query, slots = torch.cat([earlier, query], 2)[:, :, -self.window:], torch.cat([earlier_slots, slots])[-self.window:]
            spanning = attention_calls(module, query, key, value, slots, settings, self.n_layers)
        if self.window:
            self.recent[layer] = (query[:, :, -self.window:], slots[-self.window:])
        for label, policy in self.policies.items():
            calls = spanning if policy.voters else new_calls
            scored = [policy.score(dataclasses.replace(call, carry=self.carry.setdefault((label, layer, b), {})))
                      for b, call in enumerate(calls)]
            if scored[0] is None:
                continue
            new = torch.stack(scored)
            old = self.scores[label].get(layer)
            if policy.accumulates and old is not None:
                new = new + F.pad(old, (0, n - old.shape[-1]))
            self.scores[label][layer] = new

    def copy(self) -> ScoreRecorder:
        """A recorder that goes on from this one's scores (a question chunk after a shared context)."""
        other = ScoreRecorder(self.policies.values(), self.n_layers)
        other.scores = {label: dict(layers) for label, layers in self.scores.items()}
        other.recent = dict(self.recent)
        other.carry = {key: dict(carried) for key, carried in self.carry.items()}
        other.seen_layers, other.sliding_layers = set(self.seen_layers), set(self.sliding_layers)
        return other


def kept_from_scores(policy, scores: dict[int, torch.Tensor], n: int, kv_heads: int, n_layers: int) -> dict[int, torch.Tensor] | None:
    """{layer: kept positions (batch, kv_heads, k)} for every scored layer ({layer: (batch, rows, n)}), by the
    policy's `keep_layers` for each batch row (none when no layer was scored: all slide); None if the prompt fits the
    budget."""
    if policy.budget(n) is None:
        return None
    layers = sorted(scores)
    if not layers:
        return {}
    rows = [policy.keep_layers({layer: scores[layer][b] for layer in layers}, n, kv_heads, n_layers)
            for b in range(scores[layers[0]].shape[0])]
    return {layer: stack_kept([row[layer] for row in rows]) for layer in layers}
