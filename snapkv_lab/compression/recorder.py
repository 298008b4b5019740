"""Scores of policies at the prefill's attention calls: the one place a policy's `score` runs on a prompt.

    recorder = ScoreRecorder(policies, n_layers)            # a hook callback, or called by the live compressor
    with intercept_attention(model, recorder): model(ids, past_key_values=full_cache)
    kept, slots, seeds = engine.compress_layers(policy, recorder.scores[policy.score_table], compressed, n_layers)

The shared prefill records every policy's scores over a full prefill (shared.SharedPrefill); the live compressor
records its one policy's at each layer's call and compresses that layer at once (compressor.compress). The prefill's
attention runs on the full keys under compression too, so the two give the same scores.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from ..core.attention import AttentionSettings
from ..core.inputs import left_pads
from ..policies.base import WholePromptOnly
from .engine import attention_calls


class ScoreRecorder:
    """Hook callback that records, without compressing, the scores of several policies at every layer.

    Successive calls of a layer are prompt chunks (a context, then a question): accumulating policies add
    their scores up, the others keep the last chunk's. A policy that votes with the last queries (SnapKV's window,
    TOVA's last query) is handed a chunk shorter than its voters with the last queries of the chunks before it in
    front (a window may span the end of the context and the question, as in one prefill of both); every other policy
    sees each chunk's own queries, and what it carries from chunk to chunk (AttentionCall.carry), so its scores
    never depend on which other policies are recorded beside it. scores[policy.score_table][layer]: (batch, heads or
    kv_heads, n_keys). Policies sharing a score_table (differing only in budget) share one entry. Sliding-window
    layers are not scored: they are never compressed (see state.CompressionState).

    A padded batch (pads read off the first call's mask): each row is scored on its own tokens (its pads cut off,
    as its batch-1 run is), and its scores are stored left-padded with zeros to the batch's slots; the engine
    (engine.kept_rows) cuts them off again.

    defer_refusals (a prefill shared by several policies): a policy that scores the whole prompt from one call and is
    handed a later chunk (policies.base.WholePromptOnly) is not scored further, and its refusal is kept in
    `refused[score_table]` (its state is then built from the prompt fed again in one call: SharedPrefill.serving); the
    others go on. Otherwise (the live
    compressor, one policy) the refusal is raised at once.
    """

    def __init__(self, policies, n_layers: int, defer_refusals: bool = False):
        policies = list(policies)
        self.policies = {p.score_table: p for p in policies if not p.scores_after_prefill}
        self.n_layers = n_layers
        # The most any policy votes with; a policy scoring after the prefill reads its voters from `recent`
        # (LookaheadQCache's draft window), so it counts here although it is not scored at the calls.
        self.voters = max((p.voters for p in policies), default=0)
        # The last queries held per layer (`recent`): the voters, or more where a policy's storage scores key channels
        # with them (ThinK's window), read by the engine after the prefill, never voting.
        self.held_queries = max([self.voters, *(p.storage.channel_window for p in policies
                                                if p.storage is not None and p.storage.prunes_channels)])
        self.scores: dict[str, dict[int, torch.Tensor]] = {label: {} for label in self.policies}
        # layer -> last `held_queries` queries, their slots
        self.recent: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.settings: dict[int, AttentionSettings] = {}  # layer -> its attention settings (scaling, soft-cap)
        self.carry: dict[tuple[str, int, int], dict] = {}  # (policy label, layer, batch row) -> AttentionCall.carry
        self.seen_layers: set[int] = set()  # layers whose attention calls reached the recorder
        self.sliding_layers: set[int] = set()  # of those, the sliding-window ones (never scored)
        self.pads: torch.Tensor | None = None  # (batch,) a padded batch's left pads
        self._prefilled = False  # the first call (the prompt's) has been seen: its mask told the pads
        self.defer_refusals = defer_refusals
        self.refused: dict[str, WholePromptOnly] = {}  # score_table -> the refusal that stopped its scoring

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        """The hook: record every policy's scores of a prompt chunk (its slots are its positions: a full cache)."""
        if not self._prefilled:
            self.pads, self._prefilled = left_pads(attention_mask), True
        self.seen_layers.add(module.layer_idx)
        settings = AttentionSettings.of_call(module, kwargs)
        if settings.sliding_window is not None:
            self.sliding_layers.add(module.layer_idx)
            return
        self.record(module, query, key, value, settings)

    def record(self, module, query, key, value, settings: AttentionSettings, positions: torch.Tensor | None = None
               ) -> dict[str, torch.Tensor]:
        """Score one attention call of a full-attention layer, whose new query rows are its last cache slots, for
        every policy; returns {scorer_label: (batch, rows, slots)} as stored. positions (rows,): the new rows' token
        positions where they are not their slots (a live chunked prefill over held slots)."""
        layer, n, rows = module.layer_idx, key.shape[2], query.shape[2]
        self.settings[layer] = settings
        slots = torch.arange(n - rows, n)  # a full cache: a query's cache slot is its position
        pads = self.pads
        new_calls = attention_calls(module, query, key, value, slots, settings, self.n_layers, positions, lead=pads)
        spanning, fed, fed_slots = new_calls, query, slots
        # (batch, heads, rows, d) with earlier chunks' last queries, over a full cache (a live chunked prefill's chunk
        # holds its own voters: compressor.check_chunking)
        if positions is None and layer in self.recent and rows < self.voters:
            earlier, earlier_slots = self.recent[layer]
            query, slots = (torch.cat([earlier, query], 2)[:, :, -self.voters:],
                            torch.cat([earlier_slots, slots])[-self.voters:])
            spanning = attention_calls(module, query, key, value, slots, settings, self.n_layers, lead=pads)
        if self.held_queries:  # copies: a slice would keep the whole prompt's queries of every layer alive (8 GB at
            keep = self.held_queries  # 32k, 8B); a short chunk's held after the earlier chunks' last ones
            if positions is None and layer in self.recent and rows < keep:
                earlier, earlier_slots = self.recent[layer]
                fed, fed_slots = torch.cat([earlier, fed], 2), torch.cat([earlier_slots, fed_slots])
            self.recent[layer] = (fed[:, :, -keep:].clone(), fed_slots[-keep:].clone())
        for label, policy in self.policies.items():
            if label in self.refused:
                continue
            calls = spanning if policy.voters else new_calls
            try:
                scored = [policy.score(dataclasses.replace(call, carry=self.carry.setdefault((label, layer, b), {})))
                          for b, call in enumerate(calls)]
            except WholePromptOnly as refusal:
                if not self.defer_refusals:
                    raise
                self.refused[label] = refusal
                continue
            if scored[0] is None:
                continue
            if pads is not None:  # each row's own keys: left-padded back to the batch's slots
                scored = [F.pad(s, (n - s.shape[-1], 0)) for s in scored]
            new = torch.stack(scored)
            old = self.scores[label].get(layer)
            if policy.accumulates and old is not None:
                new = new + F.pad(old, (0, n - old.shape[-1]))
            self.scores[label][layer] = new
        return {label: layers[layer] for label, layers in self.scores.items() if layer in layers}

    def compact(self, layer: int, slots: torch.Tensor) -> None:
        """Keep only the slots `slots` (batch, rows, k) of `layer`'s stored scores, those its cache still holds after
        a live compression (a chunked prefill's accumulated scores go on over them); earlier queries no longer sit at
        their slots, so none are held for spanning."""
        for layers in self.scores.values():
            if layer in layers:
                held = layers[layer]
                layers[layer] = held.gather(-1, slots.repeat_interleave(held.shape[1] // slots.shape[1], 1))
        self.recent.pop(layer, None)

    def copy(self) -> ScoreRecorder:
        """A recorder that goes on from this one's scores (a question chunk after a shared context)."""
        other = ScoreRecorder(self.policies.values(), self.n_layers, self.defer_refusals)
        other.refused = dict(self.refused)
        other.voters, other.held_queries, other.settings = self.voters, self.held_queries, dict(self.settings)
        other.scores = {label: dict(layers) for label, layers in self.scores.items()}
        other.recent = dict(self.recent)
        other.carry = {key: dict(carried) for key, carried in self.carry.items()}
        other.seen_layers, other.sliding_layers = set(self.seen_layers), set(self.sliding_layers)
        other.pads, other._prefilled = self.pads, self._prefilled
        return other
