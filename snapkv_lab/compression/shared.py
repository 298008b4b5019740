"""One full prefill serving many policies: the prefill object every comparison starts from.

    shared = SharedPrefill.run(model, tokenizer, ids, policies)   # one forward, every policy's scores recorded
    asked = shared.extend(question_ids)                           # the question on a fork of the full cache
    state = asked.state(policy)                                   # a compressed copy, as compress() would build
    with applied(model, state): greedy_decode(model, state.cache, asked.logits, ...)

The prefill's attention runs on the full keys under compression too, so a state built here equals the one `compress`
builds layer by layer (tested): both go through engine.compress_layers. What a policy needs beyond the prefill's
attention calls (`Policy.needs`) is kept here, on the prefill object, and handed to it in a `Prompt` (`prompt`): the
decoder's final hidden states (Surprisal, LookaheadQCache: kept only when a policy reads them, context and question
chunks one after the other, no second forward), the prompt's last queries of every full-attention layer (the
recorder holds the last `voters` for every policy it is given), a pass of more tokens over a fork of the cache
(KVzip's reconstruction) and a drafted answer over a compressed copy (LookaheadQCache). Scores made after the prefill
are paid once per prefill for all budgets and selection settings (`Policy.scoring_key`), one prompt (batch row) at
a time.
"""

from __future__ import annotations

import functools
from contextlib import nullcontext
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from ..core.attention import AttentionSettings
from ..core.hooks import attention_modules, capture_final_hidden, capture_layer_inputs, intercept_attention, with_cache
from ..core.inputs import eos_ids, padded_positions
from ..core.timing import SectionTimer, stopwatch
from ..policies.base import Policy, Prompt
from ..policies.decoding import seeded
from ..policies.surprisal import token_surprisal
from .engine import compress_layers, refuse_unseen_layers, row_lengths
from .greedy import greedy_decode
from .layers import fork, held_positions, row_cache
from .recorder import ScoreRecorder
from .state import CompressionState, applied


@dataclass
class SharedPrefill:
    """A full cache after feeding `ids` (batch, n), the last logits (batch, vocab), every policy's scores.

    final_hidden: (batch, n, hidden_size) the decoder's final hidden states over every fed token, kept when a policy
    reads them (`Policy.reads_final_hidden`), else None. mask: (batch, slots) 0 on a padded batch's left pads (every
    policy's rows are scored on their own tokens), else None."""

    model: object
    tokenizer: object
    ids: torch.Tensor
    cache: DynamicCache
    logits: torch.Tensor | None
    recorder: ScoreRecorder
    seconds: float  # the forward that fed the last chunk
    keeps_final_hidden: bool = False
    final_hidden: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    # {layer: (batch, n, hidden_size)} each attention layer's input hidden states, kept when a policy reads them
    # (`Policy.reads_layer_inputs`: KVzap, FastKVzip), else None
    layer_inputs: dict | None = None
    # Scores made after the prefill (Policy.needs) by scoring_key: paid once per prefill, by the first state that needs
    # them.
    after_prefill_scores: dict = field(default_factory=dict)
    # [(ids (1, k), surprisal (1, k))] the model's surprisal at a row's tokens (Prompt.surprisal), computed when asked
    # for, by this prefill and every prefill fed from the same one (a context's, each of its questions'): one list,
    # from which a row whose tokens begin as a computed row's pays only the rest.
    surprisals: list = field(default_factory=list)
    # This prefill's prompt fed again in one call for the policies that score the whole prompt from one attention call
    # and refused the split one (`serving`): built when first asked for, once for all of them.
    _whole: SharedPrefill | None = field(default=None, repr=False)
    refed: bool = False  # this is such a prefill: `seconds` is the whole prompt's forward, not its last chunk's

    @classmethod
    @torch.inference_mode()
    def run(cls, model, tokenizer, ids: torch.Tensor, policies, mask: torch.Tensor | None = None,
            layer_inputs: bool = False) -> SharedPrefill:
        """layer_inputs: keep every attention layer's input hidden states even when no policy reads them (training
        data for the trained scorers, policies.fastkvzip_training)."""
        policies = list(policies)
        for policy in policies:
            policy.prepare(model, tokenizer)
        recorder = ScoreRecorder(policies, model.config.num_hidden_layers, defer_refusals=True)
        empty = None if mask is None else mask[:, :0]
        return cls(model, tokenizer, ids[:, :0], DynamicCache(config=model.config), None, recorder, 0.0,
                   keeps_final_hidden=any(p.reads_final_hidden for p in policies), mask=empty,
                   layer_inputs={} if layer_inputs or any(p.reads_layer_inputs for p in policies) else None
                   )._fed(ids, mask)

    @property
    def pads(self) -> torch.Tensor | None:
        return None if self.mask is None else (self.mask == 0).sum(-1).cpu()

    @property
    def n_tokens(self) -> int:
        return self.ids.shape[1]

    @torch.inference_mode()
    def _fed(self, ids: torch.Tensor, mask: torch.Tensor | None = None) -> SharedPrefill:
        """Feed ids after this prefill, on a fork of its cache, recording on a copy of its scores (mask: their
        padding mask, the prompt's; later feeds are tokens)."""
        cache, recorder, start = fork(self.cache), self.recorder.copy(), self.ids.shape[1]
        if self.mask is not None:
            mask = torch.cat([self.mask, torch.ones_like(ids) if mask is None else mask], 1)
        positions = padded_positions(None if mask is None else (mask == 0).sum(-1), start, ids.shape[1],
                                     self.model.device)
        capture = capture_final_hidden(self.model) if self.keeps_final_hidden else nullcontext()
        inputs = capture_layer_inputs(self.model) if self.layer_inputs is not None else nullcontext()
        with intercept_attention(self.model, recorder), capture as hidden, inputs as fed_inputs, \
                stopwatch(self.model.device) as elapsed:
            logits = self.model(ids, **with_cache(self.model, cache), position_ids=positions, use_cache=True,
                                logits_to_keep=1, attention_mask=mask).logits[:, -1]
        final_hidden = None
        if self.keeps_final_hidden:  # every fed id's: the earlier chunks', then these
            final_hidden = torch.cat([self.final_hidden, *hidden], 1) if start else hidden[0]
        layer_inputs = None
        if self.layer_inputs is not None:  # the earlier chunks', then these
            layer_inputs = {layer: torch.cat([*([self.layer_inputs[layer]] if start else []), *fed], 1)
                            for layer, fed in fed_inputs.items()}
        return SharedPrefill(self.model, self.tokenizer, torch.cat([self.ids, ids], 1), cache, logits, recorder,
                             elapsed.seconds, keeps_final_hidden=self.keeps_final_hidden, final_hidden=final_hidden,
                             mask=mask, layer_inputs=layer_inputs, surprisals=self.surprisals)

    def extend(self, ids: torch.Tensor) -> SharedPrefill:
        """The prefill of this context followed by ids (batch, m), e.g. a question (query-aware mode)."""
        return self._fed(ids)

    def serving(self, policy: Policy) -> SharedPrefill:
        """The prefill `policy`'s state is built from: this one, or, where the policy scores the whole prompt from one
        attention call and this prompt was fed in two (a question after its context: the query-aware mode), the same
        prompt fed again in one call to the policies that refused it (policies.base.WholePromptOnly), as kvpress scores
        a query-aware prefill. That forward is paid once per prompt, when the first such policy is asked for; every
        other policy is served by this prefill."""
        if policy.score_table not in self.recorder.refused:
            return self
        if self._whole is None:
            refused = [p for label, p in self.recorder.policies.items() if label in self.recorder.refused]
            whole = SharedPrefill.run(self.model, self.tokenizer, self.ids, refused, mask=self.mask)
            self._whole = replace(whole, refed=True)
        return self._whole

    def prompt(self, row: int = 0) -> Prompt:
        """Batch row `row` of this prefill as its batch-1 prompt (its pads cut off), with all a policy that scores after
        the prefill may need (`Policy.needs`; see policies.base.Prompt)."""
        pads = 0 if self.pads is None else int(self.pads[row])
        ids, cache = self.ids[row:row + 1, pads:], row_cache(self.cache, row, pads)
        hidden = None if self.final_hidden is None else self.final_hidden[row:row + 1, pads:]
        queries = {layer: (query[row], slots - pads, self.recorder.settings[layer])
                   for layer, (query, slots) in self.recorder.recent.items()}
        inputs = None if self.layer_inputs is None else {
            layer: states[row:row + 1, pads:] for layer, states in self.layer_inputs.items()}
        return Prompt(self.model, self.tokenizer, ids, cache, hidden, queries,
                      feed=functools.partial(feed, self.model, cache),
                      draft=functools.partial(draft, self.model, self.tokenizer, cache, hidden), layer_inputs=inputs,
                      surprisal=None if hidden is None else functools.partial(self._surprisal, ids, hidden))

    @torch.inference_mode()
    def _surprisal(self, ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Prompt.surprisal of one prompt, ids (1, n) and its final hidden states (1, n, hidden_size): computed once,
        and only past the longest start it shares with a prompt computed before (`surprisals`)."""
        known, shared = None, 0
        for seen, values in self.surprisals:
            length = min(seen.shape[1], ids.shape[1])
            differ = (seen[0, :length] != ids[0, :length]).nonzero()
            common = int(differ[0]) if len(differ) else length
            if common > shared:
                known, shared = values[:, :common], common
        if shared == ids.shape[1]:
            return known
        values = token_surprisal(self.model, hidden, ids, known=known)
        self.surprisals.append((ids, values))
        return values

    def _after_prefill_scores(self, policy: Policy) -> dict:
        """{layer: (batch, rows, n)} the policy's scores made after the prefill, each prompt's left-padded back to the
        batch's slots; paid once per scoring_key."""
        key = policy.scoring_key
        if key not in self.after_prefill_scores:
            n = self.n_tokens
            rows = [policy.prompt_scores(self.prompt(b)) for b in range(self.ids.shape[0])]
            self.after_prefill_scores[key] = {
                layer: torch.cat([F.pad(row[layer], (n - row[layer].shape[-1], 0)) for row in rows])
                for layer in rows[0]}
        return self.after_prefill_scores[key]

    @torch.inference_mode()
    def state(self, policy: Policy) -> CompressionState:
        """The compressor's state after prefill under `policy`: a compressed copy of the full cache (a fork where every
        row fits its budget), kept_indices for every layer, the selection time (scoring after the prefill included).
        A policy that refused this prefill's split prompt is served by its prompt fed in one call (`serving`)."""
        if (served := self.serving(policy)) is not self:
            return served.state(policy)
        n, n_layers, pads = self.n_tokens, self.model.config.num_hidden_layers, self.pads
        compresses = any(policy.budget(length) is not None for length in row_lengths(n, self.ids.shape[0], pads))
        compresses = compresses or (policy.storage is not None and policy.storage.packs)  # channels, bits
        if compresses:
            # A model whose attention bypasses the registry records nothing: the state would be the full cache.
            refuse_unseen_layers(self.cache, self.recorder.seen_layers, self.recorder.sliding_layers, policy.label)
        timer = SectionTimer(self.model.device)
        with timer.section():
            scores = {}
            if compresses or seeded(policy):
                scores = (self._after_prefill_scores(policy) if policy.scores_after_prefill
                          else self.recorder.scores[policy.score_table])
            cache = fork(self.cache)
            kept = {i: held_positions(layer, n, pads) for i, layer in enumerate(self.cache.layers)}
            queries = {layer: query for layer, (query, _) in self.recorder.recent.items()}
            compressed, _, seeds = compress_layers(policy, scores, cache, n_layers, pads=pads, queries=queries,
                                                   modules=attention_modules(self.model))
            kept.update(compressed)
        sliding = sorted(self.recorder.sliding_layers) if compresses and scores else []
        return CompressionState(policy, cache, kept_indices=kept, sliding_layers=sliding, seeds=seeds, pads=pads,
                                timer=timer)


def feed(model, cache, ids: torch.Tensor, positions: torch.Tensor, on_call) -> None:
    """Prompt.feed: run ids (1, m) at `positions` through the decoder over a fork of `cache` (no output head: only the
    attention calls are read), on_call(module, query, key, value, settings) seeing every attention call; a tensor it
    returns is the call's output (batch, m, heads, head_dim), in place of the backend's."""
    def attend(function, module, query, key, value, attention_mask, **kwargs):
        output = on_call(module, query, key, value, AttentionSettings.of_call(module, kwargs))
        return function(module, query, key, value, attention_mask, **kwargs) if output is None else (output, None)

    decoder = model.get_decoder()
    with torch.inference_mode(), intercept_attention(model, None, attend=attend):
        decoder(input_ids=ids, **with_cache(decoder, fork(cache)), position_ids=positions, use_cache=True)


def draft(model, tokenizer, cache, final_hidden: torch.Tensor, policy: Policy, scores: dict, tokens: int
          ) -> dict[int, torch.Tensor]:
    """Prompt.draft: {layer: (heads, k, head_dim)} the post-RoPE queries of the k <= tokens drafted tokens, fed greedily
    at positions n, n + 1, ... over `cache` (one n-token prompt) compressed by `policy` from its `scores` ({layer:
    (1, rows, n)}); the first token is the prefill's own next token (its final hidden state's argmax); none when it
    ends the answer."""
    n, n_layers = final_hidden.shape[1], model.config.num_hidden_layers
    compressed = fork(cache)
    kept = {i: held_positions(layer, n) for i, layer in enumerate(cache.layers)}
    kept.update(compress_layers(policy, scores, compressed, n_layers, modules=attention_modules(model))[0])
    state = CompressionState(policy, compressed, kept_indices=kept)
    drafted = {layer: [] for layer in scores}

    def record(module, query, key, value, attention_mask, **kwargs):
        if module.layer_idx in drafted:
            drafted[module.layer_idx].append(query[0, :, -1:])

    logits = model.get_output_embeddings()(final_hidden[:, -1]).float()
    with applied(model, state), intercept_attention(model, record):
        greedy_decode(model, state.cache, logits, n, tokens + 1, eos_ids(model, tokenizer))
    return {layer: torch.cat(rows, dim=1) for layer, rows in drafted.items() if rows}
