"""One full prefill serving many policies: the A/B engine of `compare` and the pressure tests.

    shared = SharedPrefill.run(model, tokenizer, ids, policies)   # one forward, every policy's scores recorded
    asked = shared.extend(question_ids)                           # the question on a fork of the full cache
    state = asked.state(policy)                                   # a compressed copy, as compress() would build
    with applied(model, state): greedy_decode(model, state.cache, asked.logits, ...)

The prefill's attention runs on the full keys under compression too, so a state built here equals the
one `compress` builds layer by layer (tested). Policies with extra scoring passes (KVzip) pay only for
those passes, over a fork of the full cache, once per prefill for all budgets and selection settings.
Where a policy reads the decoder's final hidden states (Surprisal), the prefill's forward keeps them
(hooks.capture_final_hidden) on its cache as `cache.final_hidden` (batch, n, hidden_size), the chunks' (context,
then question) one after the other: no second forward. Other prefills keep none. A policy that votes after the
prefill with the prompt's last queries (LookaheadQCache) finds them on the cache as `cache.voter_queries`, kept by
the recorder, which holds the last `voters` queries of every full-attention layer for every policy it is given.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from ..core.hooks import capture_final_hidden, intercept_attention, with_cache
from ..policies.base import Policy
from ..core.timing import SectionTimer, stopwatch
from ..policies.decoding import prefill_seeds, seeded
from ..core.inputs import padded_positions
from .compressor import CompressionState, refuse_unseen_layers
from .layers import compressed_copy, fork, held_positions, padded_layer, row_cache, stack_rows
from .recorder import ScoreRecorder, kept_from_scores


@dataclass
class SharedPrefill:
    """A full cache after feeding `ids` (batch, n), the last logits (batch, vocab), every policy's scores."""

    model: object
    tokenizer: object
    ids: torch.Tensor
    cache: DynamicCache
    logits: torch.Tensor
    recorder: ScoreRecorder
    seconds: float  # the forward that fed the last chunk
    # Scores made after the prefill (Policy.scores_after_prefill) by scoring_key: paid once per prefill, by the first
    # state that needs them.
    after_prefill_scores: dict = field(default_factory=dict)
    keeps_final_hidden: bool = False  # some policy reads them (Policy.reads_final_hidden): cache.final_hidden
    # (batch, slots) 0 on a padded batch's left pads (every policy's rows are scored on their own tokens), else None
    mask: torch.Tensor | None = None

    @classmethod
    @torch.inference_mode()
    def run(cls, model, tokenizer, ids: torch.Tensor, policies, mask: torch.Tensor | None = None) -> SharedPrefill:
        policies = list(policies)
        for policy in policies:
            policy.prepare(model, tokenizer)
        recorder = ScoreRecorder(policies, model.config.num_hidden_layers)
        empty = None if mask is None else mask[:, :0]
        return cls(model, tokenizer, ids[:, :0], DynamicCache(config=model.config), None, recorder, 0.0,
                   keeps_final_hidden=any(p.reads_final_hidden for p in policies), mask=empty)._fed(ids, mask)

    @property
    def pads(self) -> torch.Tensor | None:
        return None if self.mask is None else (self.mask == 0).sum(-1).cpu()

    @torch.inference_mode()
    def _fed(self, ids: torch.Tensor, mask: torch.Tensor | None = None) -> SharedPrefill:
        """Feed ids after this prefill, on a fork of its cache, recording on a copy of its scores (mask: their
        padding mask, the prompt's; later feeds are tokens)."""
        cache, recorder, start = fork(self.cache), self.recorder.copy(), self.ids.shape[1]
        if self.mask is not None:
            mask = torch.cat([self.mask, torch.ones_like(ids) if mask is None else mask], 1)
        positions = padded_positions(None if mask is None else (mask == 0).sum(-1), start, ids.shape[1], self.model.device)
        capture = capture_final_hidden(self.model) if self.keeps_final_hidden else nullcontext()
        with intercept_attention(self.model, recorder), capture as hidden, stopwatch(self.model.device) as elapsed:
            logits = self.model(ids, **with_cache(self.model, cache), position_ids=positions, use_cache=True, logits_to_keep=1,
                                attention_mask=mask).logits[:, -1]
        if self.keeps_final_hidden:  # every fed id's: the earlier chunks', then these
            cache.final_hidden = torch.cat([self.cache.final_hidden, *hidden], 1) if start else hidden[0]
        return SharedPrefill(self.model, self.tokenizer, torch.cat([self.ids, ids], 1), cache, logits, recorder,
                             elapsed.seconds, keeps_final_hidden=self.keeps_final_hidden, mask=mask)

    def extend(self, ids: torch.Tensor) -> SharedPrefill:
        """The prefill of this context followed by ids (batch, m), e.g. a question (query-aware mode)."""
        return self._fed(ids)

    @property
    def n_tokens(self) -> int:
        return self.ids.shape[1]

    def _after_prefill_scores(self, policy: Policy) -> dict:
        key = policy.scoring_key
        if key not in self.after_prefill_scores:
            # The prompt's last queries of every full-attention layer, for a policy that votes with them after the
            # prefill (LookaheadQCache's draft window): {layer: ((batch, heads, voters, head_dim), slots, settings)}
            self.cache.voter_queries = {layer: (query, slots, self.recorder.settings[layer])
                                        for layer, (query, slots) in self.recorder.recent.items()}
            pads = self.pads
            if pads is None:
                self.after_prefill_scores[key] = policy.prompt_scores(self.model, self.tokenizer, self.ids, self.cache)
            else:  # row by row, each on its batch-1 slice (its own tokens and cache), left-padded back to the slots
                n = self.n_tokens
                rows = [policy.prompt_scores(self.model, self.tokenizer, self.ids[b:b + 1, int(p):],
                                             row_cache(self.cache, b, int(p))) for b, p in enumerate(pads.tolist())]
                self.after_prefill_scores[key] = {layer: torch.cat([F.pad(row[layer], (n - row[layer].shape[-1], 0)) for row in rows])
                                          for layer in rows[0]}
        return self.after_prefill_scores[key]

    @torch.inference_mode()
    def state(self, policy: Policy) -> CompressionState:
        """The compressor's state after prefill under `policy`: a compressed copy of the full cache (or a fork
        when the prompt fits), kept_indices for every layer, the selection time (scoring after the prefill included)."""
        n, n_layers = self.n_tokens, self.model.config.num_hidden_layers
        if self.pads is not None:
            return self._padded_state(policy)
        timer = SectionTimer(self.model.device)
        if policy.budget(n) is not None:
            # A model whose attention bypasses the registry records nothing: the state would be the full cache.
            refuse_unseen_layers(self.cache, self.recorder.seen_layers, self.recorder.sliding_layers, policy.label)
        with timer.section():
            scores = {}
            if policy.budget(n) is not None or seeded(policy):
                scores = self._after_prefill_scores(policy) if policy.scores_after_prefill else self.recorder.scores[policy.scorer_label]
            kept = {} if policy.budget(n) is None else \
                kept_from_scores(policy, scores, n, self.cache.layers[0].keys.shape[1], n_layers)
            state = compressed_state(policy, self.cache, kept, n, n_layers, self.recorder.sliding_layers, timer)
            if seeded(policy):
                state.seeds = {layer: prefill_seeds(list(scores[layer]), state.kept_indices[layer]) for layer in scores}
        return state

    def _padded_state(self, policy: Policy) -> CompressionState:
        """`state` for a padded batch: each row's kept positions by its own scores and length (recorder,
        kept_from_scores), the rows' layers left-filled where they keep different counts (layers.padded_layer)."""
        n, n_layers, pads = self.n_tokens, self.model.config.num_hidden_layers, self.pads
        lengths = (n - pads).tolist()
        compresses = any(policy.budget(length) is not None for length in lengths)
        held = {i: held_positions(layer, n, pads) for i, layer in enumerate(self.cache.layers)}
        timer = SectionTimer(self.model.device)
        if compresses:
            refuse_unseen_layers(self.cache, self.recorder.seen_layers, self.recorder.sliding_layers, policy.label)
        with timer.section():
            scores = {}
            if compresses or seeded(policy):
                scores = self._after_prefill_scores(policy) if policy.scores_after_prefill else self.recorder.scores[policy.scorer_label]
            rows = kept_from_scores(policy, scores, n, self.cache.layers[0].keys.shape[1], n_layers, pads) or {}
            cache = fork(self.cache)
            for layer, kept in rows.items():
                cache.layers[layer], held[layer] = padded_layer(self.cache.layers[layer].keys,
                                                                self.cache.layers[layer].values, kept, pads)
            seeds = {}
            if seeded(policy):  # per row: its own scores at its kept positions, left-filled as the layer's slots
                for layer in scores:
                    own = [r for r in (rows[layer] if layer in rows else
                                       [torch.arange(length).expand(held[layer].shape[1], -1) for length in lengths])]
                    seeds[layer] = stack_rows([prefill_seeds([scores[layer][b][:, n - lengths[b]:]], k[None])[0]
                                               for b, k in enumerate(own)], True, 0.0)
        state = CompressionState(policy, cache, n_layers, kept_indices=held, timer=timer, seeds=seeds, pads=pads)
        state.sliding_layers = sorted(self.recorder.sliding_layers) if rows else []
        return state


def compressed_state(policy: Policy, cache: DynamicCache, kept: dict, n: int, n_layers: int, sliding, timer=None
                     ) -> CompressionState:
    """The compressor's state over a compressed copy of the full `cache` of an n-token prompt: the layers in `kept`
    ({layer: (batch, rows, k)}) hold those positions, the others all they hold (`sliding`: the sliding-window layers,
    left their own bounded cache)."""
    held = {i: held_positions(layer, n) for i, layer in enumerate(cache.layers)}
    held.update(kept)
    state = CompressionState(policy, compressed_copy(cache, kept), n_layers, kept_indices=held, timer=timer)
    state.sliding_layers = sorted(sliding) if kept else []
    return state
