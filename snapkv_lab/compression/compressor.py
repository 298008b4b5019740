"""Compressing a live transformers cache as its prefill runs: `compress`, and the live compressor behind it.

`compress` wraps the model's attention function with `intercept_attention`. At each layer's prefill call the live
compressor scores the call (recorder.ScoreRecorder, for its one policy) and swaps the layer's cache for one holding
the kept positions (engine.compress_layers): score, keep, build, as the shared prefill does for every layer at once.
The layer's own attention still runs on the full keys it was handed, so the prefill logits (and the first generated
token) are those of the full cache, as in the paper. Later calls are routed by the state (state.CompressionState).

The caller states the phase: without prefill_chunk the first forward inside the block is the prefill, and it ends
with that forward; with prefill_chunk every forward is a prompt chunk until `state.end_prefill()` (snapkv_lab.generate
calls it, and model.generate's prefill stage ends it: its `_prefill` is wrapped for the block).

Positions stay right after the cache shrinks because nothing downstream derives them from the cache length:
`generate` passes position ids explicitly, and `model.generate` in transformers 5.x counts positions from the
prompt's own position ids (checked token for token in the tests).

Padded batches (prompts of different lengths, left-padded; the pads are read off the prefill's mask, `left_pads`):
each row is scored on its own tokens only, with budgets from its own length, so its kept positions are those of its
batch-1 run, and pads never vote nor are kept (engine: batches are rows).
"""

from __future__ import annotations

import dataclasses
import functools
from contextlib import contextmanager

import torch
from transformers import DynamicCache

from ..core.attention import AttentionSettings
from ..core.checks import check_int
from ..core.inputs import left_pads
from ..core.timing import SectionTimer
from ..policies.base import FullCache, Policy
from ..policies.decoding import seeded
from .engine import compress_layers, refuse_unseen_layers
from .greedy import forward
from .layers import CompressedLayer, HeadwiseLayer, held_positions
from .recorder import ScoreRecorder
from .state import CompressionState, Phase, applied

PADDED_CHUNKS_REFUSED = ("a chunked prefill of a padded batch is not supported (each row's chunks would start at "
                         "different positions): prefill it whole, or row by row")


class LivePrefill:
    """The live compressor, while its state's prefill runs: scores each layer's prefill call (or each prompt chunk's)
    and compresses that layer at once. chunk: the most tokens a chunk holds (Phase.PREFILL_CHUNKS), else None."""

    def __init__(self, state: CompressionState, chunk: int | None):
        self.state, self.chunk = state, chunk
        self.recorder = ScoreRecorder([state.policy], state.n_layers)
        self.fed: dict[int, int] = {}  # layer -> prompt tokens fed so far

    def __call__(self, module, query, key, value, attention_mask, kwargs) -> None:
        state, layer, rows = self.state, module.layer_idx, query.shape[2]
        if layer >= len(state.cache.layers) or not state.cache.layers[layer].is_initialized:
            raise RuntimeError("the model was not called with this compressor's cache: "
                               "pass past_key_values=state.cache")
        seen = self.fed.get(layer, 0)
        if self.chunk is None and seen:
            raise RuntimeError("a second prefill call of a layer: without prefill_chunk the prefill is one forward of "
                               "the model passed to compress (it ends with that forward)")
        if not seen and key.shape[2] != rows:
            raise RuntimeError("the compressor's cache must start empty (the prefill compresses the whole prompt)")
        if not self.recorder.seen_layers:  # the mask is the same for every layer: one check (one host sync) per prefill
            state.pads = self.recorder.pads = left_pads(attention_mask)
            if self.chunk is not None and state.pads is not None:
                raise NotImplementedError(PADDED_CHUNKS_REFUSED)
        if self.chunk is not None and rows > self.chunk:
            raise ValueError(f"a prompt call of {rows} tokens under prefill_chunk={self.chunk}: feed the prompt in "
                             f"chunks (model.generate(..., prefill_chunk_size={self.chunk}))")
        self.fed[layer] = seen + rows
        self.recorder.seen_layers.add(layer)
        settings = AttentionSettings.of_call(module, kwargs)
        cache_layer, n_keys, policy = state.cache.layers[layer], key.shape[2], state.policy
        lengths = [n_keys] * key.shape[0] if state.pads is None else (n_keys - state.pads).tolist()
        compresses = any(policy.budget(n) is not None for n in lengths)
        if settings.sliding_window is not None:  # left to its own bounded cache
            self.recorder.sliding_layers.add(layer)
            if compresses and layer not in state.sliding_layers:
                state.sliding_layers.append(layer)
            state.kept_indices[layer] = held_positions(cache_layer, seen + rows, state.pads)
            return
        held = (cache_layer.positions if isinstance(cache_layer, CompressedLayer)
                else held_positions(cache_layer, seen + rows, state.pads))  # (batch, kv_heads, n_keys)
        packs = policy.storage is not None and policy.storage.packs  # stored pruned or quantized, fitting or not
        if not (compresses or packs or seeded(policy) or (self.chunk is not None and policy.accumulates)):
            state.kept_indices[layer] = held
            return
        state.timer = state.timer or SectionTimer(key.device)
        with state.timer.section():
            scores = self.recorder.record(module, query, key, value, settings,
                                          None if self.chunk is None else torch.arange(seen, seen + rows))
            chunked = {} if self.chunk is None else dict(positions={layer: held}, seen=seen + rows)
            recent = self.recorder.recent.get(layer)
            kept, slots, seeds = compress_layers(policy, {layer: scores[policy.score_table]}, state.cache,
                                                 state.n_layers, pads=state.pads, **chunked,
                                                 queries=None if recent is None else {layer: recent[0]},
                                                 modules={layer: module})
            state.kept_indices[layer] = kept[layer]
            state.seeds.update(seeds)
            if self.chunk is not None and compresses:
                self.recorder.compact(layer, slots[layer])

    def finish(self) -> None:
        """Raise if the model filled the cache without its attention calls reaching the compressor; warn if every
        layer is a sliding-window layer, so the policy compressed nothing."""
        refuse_unseen_layers(self.state.cache, self.recorder.seen_layers, self.state.sliding_layers,
                             self.state.policy.label, stacklevel=5)


def refuse_after_prefill(policy: Policy, consequence: str) -> None:
    """Refuse a policy that compresses only after the whole prefill (`Policy.compresses_after_prefill`) where the
    cache is compressed as the prefill runs; `consequence` ends the message."""
    if policy.scores_after_prefill:
        reason = ("scores after the prefill, from the whole prompt's cache or final hidden states (a reconstruction "
                  "forward or the output head over every position)")
    elif policy.selects_across_layers:
        reason = "compresses after the prefill: each layer's budget depends on every layer's scores"
    else:
        return
    raise NotImplementedError(f"{policy.label} {reason}, which {consequence}")


def check_chunking(policy: Policy, prefill_chunk: int) -> None:
    """Refuse a chunked prefill that has no meaning for `policy` (see `compress`)."""
    check_int("prefill_chunk", prefill_chunk, 2, kind="an int of at least 2 tokens")
    if isinstance(policy.capacity, float):
        raise ValueError(f"{policy.label}: a capacity ratio of a prompt fed in chunks is unknown until its last chunk: "
                         "give a token budget, or use snapkv_lab.generate(..., prefill_chunk=N), "
                         "which knows the prompt")
    if policy.per_query_head:
        raise NotImplementedError(f"{policy.label}: per_query_head caches under a chunked prefill are not supported")
    if policy.storage is not None and policy.storage.packs:
        raise NotImplementedError(f"{policy.label}: pruned or quantized storage under a chunked prefill is not "
                                  "supported (the next chunk would read the stored keys)")
    if prefill_chunk < policy.voters:
        raise ValueError(f"prefill_chunk={prefill_chunk} is shorter than the {policy.voters} last queries "
                         f"{policy.label} votes with: each chunk's own voters must fit in it")


@contextmanager
def _prefill_stage_ends(model, state: CompressionState):
    """Inside the block, model.generate's prefill stage (transformers' `_prefill`, which feeds a prompt in chunks under
    prefill_chunk_size) ends the state's prefill when it returns: the decode steps that follow are not chunks."""
    stage = getattr(model, "_prefill", None)
    if stage is None:
        yield
        return

    @functools.wraps(stage)
    def prefill_stage(*args, **kwargs):
        output = stage(*args, **kwargs)
        state.end_prefill()
        return output

    model._prefill = prefill_stage
    try:
        yield
    finally:
        del model._prefill


@contextmanager
def compress(model, policy: Policy | None = None, prefill_chunk: int | None = None, tokenizer=None):
    """Compress the prompt's cache with `policy` at the next prefill inside the block.

        with compress(model, SnapKV(capacity=1024)) as state:
            model.generate(input_ids, past_key_values=state.cache, max_new_tokens=32)
        state.kept_indices[layer]  # (batch, kv_heads, kept), sorted ascending

    The cache must start empty and be passed to the model. The first forward inside the block is the prefill; every
    later one is a decode step or a question appended to the compressed context. A left-padded batch
    (model.generate(ids, attention_mask=mask)) is compressed row by row as each row's batch-1 run (see the module doc);
    padding elsewhere, assisted and prompt-lookup decoding are refused. Policies that compress only after the whole
    prefill (`compresses_after_prefill`: KVzip and Surprisal score from the whole prompt, LookaheadQCache from an answer
    drafted after it, CAKE's layer budgets need every layer's scores) cannot run inside one forward: use `generate`.

    prefill_chunk=N: compress as you go. The prompt is fed in chunks of at most N tokens
    (`model.generate(..., prefill_chunk_size=N)`, or `snapkv_lab.generate(..., prefill_chunk=N)`), and after each
    chunk every layer is cut back to the budget, so the cache never holds more than capacity + N positions per
    head, whatever the prompt's length. Every forward is a chunk until `state.end_prefill()` (model.generate's prefill
    stage calls it). What the scores mean then: each chunk's queries score the held slots and the chunk (SnapKV: the
    chunk's last window_size queries vote, so N must hold them); accumulated scores (H2O) add up over chunks for the
    slots still held; pooling acts on slot neighbours (the kept positions in order); budgets that depend on the
    prompt's length (PyramidKV) are computed from the slots held plus the chunk. Later tokens see only what earlier
    chunks kept, so their keys differ from an unchunked prefill's: the two agree exactly when one chunk covers the
    prompt. Refused: capacity ratios (the prompt's length is unknown here), extra scoring passes over the whole prompt
    (KVzip, Surprisal, LookaheadQCache), per_query_head, and head-wise budgets (AdaKV, at the first compression).

    tokenizer: needed only by a policy calibrated on the model (QFilters) whose calibration is not cached yet.
    """
    policy = policy or FullCache()
    refuse_after_prefill(policy, "cannot run inside model.generate's prefill: use snapkv_lab.generate")
    if prefill_chunk is not None:
        check_chunking(policy, prefill_chunk)
    policy.prepare(model, tokenizer)
    state = CompressionState(policy, DynamicCache(config=model.config),
                             phase=Phase.PREFILL if prefill_chunk is None else Phase.PREFILL_CHUNKS)
    state.live = LivePrefill(state, prefill_chunk)

    def after_forward(module, args, output):
        if state.phase is Phase.PREFILL:  # one forward is the prefill
            state.end_prefill()

    handle = model.register_forward_hook(after_forward)
    try:
        with applied(model, state), _prefill_stage_ends(model, state):
            yield state
    finally:
        handle.remove()
    state.end_prefill()


@torch.inference_mode()
def compress_again(model, state: CompressionState, ids: torch.Tensor, start: int, capacity: int) -> torch.Tensor:
    """Feed ids (1, m) at positions start.. over the state's compressed cache, then compress the live cache again:
    each layer's held slots and these m tokens, scored by this feed's queries, cut back to `capacity` tokens per KV
    head. Returns the feed's last logits (1, vocab).

    This is one more prompt chunk of a chunked prefill (`compress(prefill_chunk=...)`, the live compressor above), fed
    after the prefill: the same scoring, keeping and building, so a policy is applied one way whatever runs it. A
    multi-turn conversation (evaluation.multiturn) calls it before each new question, the cache holding the earlier
    turns' questions and answers. What the scores mean is what a chunk's scores mean (see `compress`); a feed shorter
    than a policy's voters (SnapKV's window) votes with all its tokens. The state's policy keeps its label (its
    capacity as the run named it); eviction while decoding (H2O's tracker) starts afresh from this compression's
    seeds. Refused, as a chunked prefill refuses them: policies that score after the whole prefill (KVzip, CAKE),
    per_query_head, pruned or quantized storage, and head-wise caches (AdaKV: a ragged layer cannot take the feed)."""
    policy = state.policy
    check_int("capacity", capacity, 1, kind="a budget in tokens per KV head")
    reason = again_refusal(policy) or ("its cache is head-wise (ragged)" if any(
        isinstance(layer, HeadwiseLayer) for layer in state.cache.layers) else None)
    if reason:
        raise NotImplementedError(f"{policy.label} cannot compress a live cache again: {reason}")
    if state.pads is not None:
        raise NotImplementedError(PADDED_CHUNKS_REFUSED)
    fed = dataclasses.replace(policy, capacity=capacity)
    if getattr(policy, "window_size", None) and ids.shape[1] < policy.window_size:
        fed = dataclasses.replace(fed, window_size=ids.shape[1])  # a short feed votes with all its tokens
    state.policy = fed
    state.phase, state.live = Phase.PREFILL_CHUNKS, LivePrefill(state, ids.shape[1])
    state.live.fed = dict.fromkeys(range(state.n_layers), start)  # the tokens every layer has seen before this feed
    try:
        with applied(model, state):
            logits = forward(model, ids, state.cache, start)
        state.end_prefill()
    finally:
        state.policy, state.phase, state.live, state.eviction = policy, Phase.DECODE, None, None
    return logits


def again_refusal(policy: Policy) -> str | None:
    """Why `compress_again` refuses `policy` (what a chunked prefill refuses too), None when it takes it."""
    if policy.scores_after_prefill or policy.selects_across_layers:
        return "it scores after the whole prefill or shares one budget across layers (KVzip, CAKE)"
    if type(policy).head_budgets is not Policy.head_budgets:
        return "its budgets are head-wise (AdaKV): a ragged layer cannot take the next feed"
    if policy.per_query_head:
        return "per_query_head caches cannot take the next feed"
    if policy.storage is not None and policy.storage.packs:
        return "pruned or quantized storage cannot take the next feed"
    return None
