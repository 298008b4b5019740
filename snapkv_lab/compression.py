"""KV-cache compression policies and their application to a live transformers cache.

A policy scores the prompt's key positions once, at prefill, and keeps `capacity` of them per KV head:
the top-scored prefix positions plus the last `window_size` prompt tokens (the observation window).
Nothing is evicted while decoding. Every policy has one scoring method:

    policy.score(query, key, attention, positions, layer) -> (heads, n_keys) float32, or None
        query: (heads, n_rows, head_dim) post-RoPE queries of the prompt rows at `positions` (n_rows,, CPU)
        key: (kv_heads, n_keys, head_dim) post-RoPE keys of the whole prompt so far
        attention: the layer's AttentionSettings (scaling, soft-cap), so scores see the model's own softmax

and the shared `Policy.keep` turns scores into kept indices with `selection.select` (pooling, GQA
reduction, top-k): the very function the attention analysis uses, so the two never disagree.

Applying a policy (`compress`) wraps the model's attention function with `intercept_attention`: at
the prefill call of each layer the callback scores, selects and swaps the layer's cache tensors for the
gathered ones. The layer's own attention still runs on the full keys it was handed, so the prefill
logits (and the first generated token) are those of the full cache, as in the paper.

Positions stay right after the cache shrinks because nothing downstream derives them from the cache
length: `generate` below passes position ids explicitly, and `model.generate` in transformers 5.x
counts positions from the prompt's own position ids (checked token for token in the tests). Under
sdpa, decode steps get no mask; under eager, the causal mask of a decode step is built for the
physical (compressed) cache length and every column is visible.
"""

from __future__ import annotations

import copy
import math
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from .attention import AttentionSettings, attention_column_sums
from .hooks import intercept_attention
from .inputs import check_context_length, encode_batch, encode_continuation, eos_ids
from .selection import POOLINGS, select, window_votes
from .timing import SectionTimer, stopwatch


@dataclass
class Policy:
    """Base policy: keep `capacity` positions per KV head after prefill (see module doc).

    capacity: total positions kept per head (prefix picks + window), as tokens (int), or as a ratio of
        the prompt (float in (0, 1)); None keeps everything. Prompts at or below it are left untouched.
    window_size: the last prompt tokens, always kept (and, for SnapKV, the voters).
    per_query_head: False (default) pools the scores of each GQA group and keeps one selection per KV
        head, so a GQA cache really shrinks. True reproduces the official SnapKV code: the KV heads are
        repeated and each query head keeps its own selection, a cache of `heads / kv_heads` times more
        bytes (3x on SmolLM2, 4x on Mistral-7B).
    """

    capacity: int | float | None = 1024
    window_size: int = 32
    per_query_head: bool = False
    pooling: str | None = None  # selection.pool_votes over positions, before the GQA reduction
    kernel_size: int = 1
    # True: scores of successive prompt chunks add up (accumulated attention); False: the last chunk's stand.
    accumulates: ClassVar[bool] = False

    def __post_init__(self):
        if not isinstance(self.window_size, int) or self.window_size < 1:
            raise ValueError(f"window_size must be a positive int, got {self.window_size!r}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {self.pooling!r}")
        if not isinstance(self.kernel_size, int) or self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be a positive odd int (pooling keeps positions centred), got {self.kernel_size!r}")
        if isinstance(self.capacity, float):
            if not 0 < self.capacity < 1:
                raise ValueError(f"a capacity ratio must lie in (0, 1), got {self.capacity}")
        elif self.capacity is not None:
            if not isinstance(self.capacity, int) or self.capacity < 1:
                raise ValueError(f"capacity must be a positive int, a ratio in (0, 1) or None, got {self.capacity!r}")
            if self.window_size >= self.capacity:
                raise ValueError(
                    f"window_size ({self.window_size}) must be smaller than capacity ({self.capacity}): the cache keeps "
                    "the whole observation window plus at least one selected prefix position."
                )

    @property
    def name(self) -> str:
        return type(self).__name__

    @property
    def label(self) -> str:
        """Short description for tables: name and budget."""
        return self.name if self.capacity is None else f"{self.name}@{self.capacity}"

    def budget(self, n_tokens: int) -> int | None:
        """Positions kept for an n-token prompt, or None when the prompt is left untouched."""
        if self.capacity is None:
            return None
        budget = math.floor(self.capacity * n_tokens) if isinstance(self.capacity, float) else self.capacity
        if n_tokens <= budget:
            return None
        if budget <= self.window_size:
            raise ValueError(
                f"capacity ratio {self.capacity} of a {n_tokens}-token prompt keeps {budget} positions, no more than "
                f"window_size ({self.window_size}); use a larger ratio or a token budget."
            )
        return budget

    def score(self, query, key, attention: AttentionSettings, positions, layer: int) -> torch.Tensor | None:
        """(heads, n_keys) float32 scores of the key positions, higher is kept first (see module doc)."""
        raise NotImplementedError

    def keep(self, scores: torch.Tensor, n_tokens: int, kv_heads: int) -> torch.Tensor:
        """Kept positions (kv_heads, or heads if per_query_head, budget) long, sorted ascending:
        the top prefix positions by pooled scores, then the window. Call only when budget(n) is not None."""
        budget = self.budget(n_tokens)
        prefix_len = n_tokens - self.window_size
        picked = select(scores[:, :prefix_len], budget - self.window_size, pooling=self.pooling,
                        kernel_size=self.kernel_size, kv_heads=None if self.per_query_head else kv_heads)
        window = torch.arange(prefix_len, n_tokens, device=picked.device).expand(picked.shape[0], -1)
        return torch.cat([picked, window], dim=-1)


@dataclass
class FullCache(Policy):
    """No compression (the reference)."""

    capacity: int | float | None = None

    def score(self, query, key, attention, positions, layer):
        return None


@dataclass
class SnapKV(Policy):
    """SnapKV: votes of the last `window_size` prompt queries over the prefix, max-pooled (kernel 7)."""

    pooling: str | None = "max"
    kernel_size: int = 7

    def score(self, query, key, attention, positions, layer):
        if query.shape[1] < self.window_size:
            raise ValueError(f"the last prompt chunk ({query.shape[1]} tokens) must hold the whole observation "
                             f"window ({self.window_size} tokens)")
        return window_votes(query[:, -self.window_size:], key, attention.scaling, positions[-self.window_size:], key.shape[1],
                            **attention.options())


@dataclass
class SnapKVNoPooling(SnapKV):
    """SnapKV without pooling: the paper's ablation (keeps isolated high-vote tokens, fragments of facts)."""

    pooling: str | None = None
    kernel_size: int = 1


@dataclass
class H2O(Policy):
    """H2O-style heavy hitters: attention accumulated over all prompt queries (a one-shot, prefill-only
    version of H2O, which evicts during decoding too). Costs one extra pass of attention over the prompt."""

    accumulates: ClassVar[bool] = True

    def score(self, query, key, attention, positions, layer):
        return attention_column_sums(query, key, attention.scaling, positions, **attention.options())


@dataclass
class StreamingLLM(Policy):
    """StreamingLLM: `sinks` first tokens (attention sinks) plus the most recent ones."""

    sinks: int = 4

    def score(self, query, key, attention, positions, layer):
        recency = torch.arange(key.shape[1], dtype=torch.float32, device=key.device)
        recency[: self.sinks] = math.inf
        return recency.expand(query.shape[0], -1)


@dataclass
class RandomKeep(Policy):
    """Uniformly random prefix positions, a different draw per layer and head (reproducible by seed)."""

    seed: int = 0

    def score(self, query, key, attention, positions, layer):
        generator = torch.Generator().manual_seed(self.seed * 100_003 + layer)
        return torch.rand(query.shape[0], key.shape[1], generator=generator).to(key.device)


POLICIES = {cls.__name__: cls for cls in (FullCache, SnapKV, SnapKVNoPooling, H2O, StreamingLLM, RandomKeep)}


def gather_kv(tensor: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """Keep positions of one layer's keys or values.

    tensor: (batch, kv_heads, n, head_dim); kept: (batch, kv_heads or heads, budget).
    With one selection per query head, the KV heads are first repeated as transformers' repeat_kv does.
    Returns (batch, kept heads, budget, head_dim), contiguous (the full tensor can be freed).
    """
    if kept.shape[1] != tensor.shape[1]:
        tensor = tensor.repeat_interleave(kept.shape[1] // tensor.shape[1], dim=1)
    return tensor.gather(2, kept[..., None].expand(-1, -1, -1, tensor.shape[-1]))


class CompressedLayer(DynamicLayer):
    """A full-attention cache layer holding the kept positions of a compressed prompt, then the new tokens.

    groups > 1: one KV head per query head (the official SnapKV layout): new keys are repeated on arrival.
    Rolling back is refused: assisted and prompt-lookup decoding feed several draft tokens, count their
    positions from the cache length (shorter than the tokens seen) and crop the rejected ones.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, groups: int = 1):
        super().__init__()
        self.lazy_initialization(keys, values)
        self.keys, self.values, self.groups = keys, values, groups

    def update(self, key_states, value_states, *args, **kwargs):
        if self.groups > 1:
            key_states = key_states.repeat_interleave(self.groups, dim=1)
            value_states = value_states.repeat_interleave(self.groups, dim=1)
        return super().update(key_states, value_states, *args, **kwargs)

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(
            "a compressed KV cache cannot be rolled back: assisted and prompt-lookup decoding are not supported "
            "under snapkv_lab.compress (they place draft tokens by the cache length, which compression shortened). "
            "Use plain greedy or sampled generation."
        )


def _refuse_padding(attention_mask) -> None:
    """Refuse a padded prefill. Any unpadded causal or sliding-window mask lets every token see itself; a pad
    token is hidden from every row, its own included. flash_attention_2 gets the 2-D padding mask itself."""
    if attention_mask is None:
        return
    if attention_mask.ndim == 2:
        padded = not bool(attention_mask.bool().all())
    elif attention_mask.ndim == 4:
        offset = attention_mask.shape[-1] - attention_mask.shape[-2]
        diagonal = attention_mask.diagonal(offset, dim1=-2, dim2=-1)
        visible = diagonal if diagonal.dtype == torch.bool else diagonal == 0
        padded = not bool(visible.all())
    else:
        return
    if padded:
        raise NotImplementedError(
            "padded batches are not supported by the compressor: pad tokens would vote and be kept, and the "
            "compressed cache would no longer line up with the padding mask. Pass prompts of equal length, or one "
            "at a time."
        )


@dataclass
class CompressionState:
    """What `compress` yields: the cache to pass to the model, and what compression did once prefill ran.

    kept_indices[layer]: (batch, kv_heads, kept) prompt positions the layer's cache holds after prefill, sorted.
    Full-attention layers keep what the policy selected. Sliding-window layers are not compressed: they keep
    their own bounded cache (the model's last `sliding_window - 1` positions), and kept_indices says which.
    """

    policy: Policy
    cache: DynamicCache
    kept_indices: dict[int, torch.Tensor] = field(default_factory=dict)
    timer: SectionTimer | None = None  # scoring, selecting and gathering: the compressor's own overhead
    sliding_layers: list[int] = field(default_factory=list)  # left uncompressed although the prompt exceeds the budget
    _groups: dict = field(default_factory=dict)  # attention module -> its original num_key_value_groups
    _checked: bool = False

    @property
    def selection_seconds(self) -> float:
        return 0.0 if self.timer is None else self.timer.seconds

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        layer = module.layer_idx
        if layer in self.kept_indices:  # prefill done: a decode step or an appended question
            if key.shape[1] == query.shape[1] and getattr(module, "num_key_value_groups", 1) > 1:
                self._groups[module] = module.num_key_value_groups  # one KV head per query head from now on
                module.num_key_value_groups = 1
            return
        if layer >= len(self.cache.layers) or not self.cache.layers[layer].is_initialized:
            raise RuntimeError("the model was not called with this compressor's cache: pass past_key_values=state.cache")
        if key.shape[2] != query.shape[2]:
            raise RuntimeError("the compressor's cache must start empty (the prefill compresses the whole prompt)")
        if not self.kept_indices:  # the mask is the same for every layer: one check (one host sync) per prefill
            _refuse_padding(attention_mask)
        batch, kv_heads, n, _ = key.shape
        settings = AttentionSettings.of_call(module, kwargs)
        if settings.sliding_window is not None and self.policy.budget(n) is not None:
            self.sliding_layers.append(layer)
        if settings.sliding_window is not None or self.policy.budget(n) is None:
            held = self.cache.layers[layer].keys.shape[-2]
            self.kept_indices[layer] = torch.arange(n - held, n, device=key.device).expand(batch, kv_heads, -1)
            return
        self.timer = self.timer or SectionTimer(key.device)
        with self.timer.section():
            positions = torch.arange(n)
            kept = torch.stack([self.policy.keep(self.policy.score(query[b], key[b], settings, positions, layer), n, kv_heads)
                                for b in range(batch)])
            self.kept_indices[layer] = kept
            self.cache.layers[layer] = CompressedLayer(gather_kv(key, kept), gather_kv(value, kept), kept.shape[1] // kv_heads)

    def check_prefill_seen(self) -> None:
        """Raise if the model filled the cache without its attention calls reaching the compressor; warn if
        every layer is a sliding-window layer, so the policy compressed nothing. Runs once per prefill."""
        if self._checked:
            return
        self._checked = bool(self.kept_indices)
        missed = [i for i, layer in enumerate(self.cache.layers) if layer.is_initialized and i not in self.kept_indices]
        if missed:
            raise RuntimeError(
                f"layers {missed} filled the cache without calling an attention function from transformers' registry, "
                f"so {self.policy.label} could not compress them (this model's attention bypasses "
                "ALL_ATTENTION_FUNCTIONS). The run would be uncompressed: refused."
            )
        if self.kept_indices and len(self.sliding_layers) == len(self.kept_indices):
            warnings.warn(f"every layer of this model uses sliding-window attention, which the compressor leaves to its "
                          f"own bounded cache: {self.policy.label} compressed nothing", stacklevel=3)

    def restore(self) -> None:
        for module, groups in self._groups.items():
            module.num_key_value_groups = groups


@contextmanager
def compress(model, policy: Policy | None = None):
    """Compress the prompt's cache with `policy` at the next prefill inside the block.

        with compress(model, SnapKV(capacity=1024)) as state:
            model.generate(input_ids, past_key_values=state.cache, max_new_tokens=32)
        state.kept_indices[layer]  # (batch, kv_heads, kept), sorted ascending

    The cache must start empty and be passed to the model; padded batches, assisted and prompt-lookup
    decoding are refused. Any attribute patched for the per-query-head layout is restored on exit.
    """
    state = CompressionState(policy or FullCache(), DynamicCache(config=model.config))
    try:
        with intercept_attention(model, state):
            yield state
        state.check_prefill_seen()
    finally:
        state.restore()


class ScoreRecorder:
    """Hook callback that records, without compressing, the scores of several policies at every layer, so
    one prefill serves many policies and budgets (the pressure tests compress copies of one full cache).

    Successive calls of a layer are prompt chunks (a context, then a question): accumulating policies add
    their scores up, the others keep the last chunk's. scores[policy.name][layer]: (batch, heads, n_keys).
    Sliding-window layers are not scored: they are never compressed (see CompressionState).
    """

    def __init__(self, policies):
        self.policies = {p.name: p for p in policies}
        self.scores: dict[str, dict[int, torch.Tensor]] = {name: {} for name in self.policies}

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        settings = AttentionSettings.of_call(module, kwargs)
        if settings.sliding_window is not None:
            return
        layer, n, rows = module.layer_idx, key.shape[2], query.shape[2]
        positions = torch.arange(n - rows, n)
        for name, policy in self.policies.items():
            new = policy.score(query[0], key[0], settings, positions, layer)
            if new is None:
                continue
            old = self.scores[name].get(layer)
            if policy.accumulates and old is not None:
                new = new + F.pad(old[0], (0, n - old.shape[-1]))
            self.scores[name][layer] = new[None]


def fork(cache: DynamicCache) -> DynamicCache:
    """A new cache over the same tensors, without copying: every layer type grows by concatenation and
    slicing, never in place, so decoding on the fork leaves `cache` as it was and forks can share it."""
    forked = DynamicCache()
    forked.layers = [copy.copy(layer) for layer in cache.layers]
    return forked


def compressed_copy(cache: DynamicCache, kept: dict[int, torch.Tensor]) -> DynamicCache:
    """A fork of `cache` whose layers in `kept` ({layer: (batch, kv_heads, kept)}) hold only those positions."""
    forked = fork(cache)
    for i, positions in kept.items():
        layer = cache.layers[i]
        forked.layers[i] = CompressedLayer(gather_kv(layer.keys, positions), gather_kv(layer.values, positions))
    return forked


def cache_bytes(cache: DynamicCache) -> int:
    """Bytes held by all keys and values of a cache."""
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.is_initialized)


@dataclass
class GenerationResult:
    """Output of `generate`.

    text: the answer (a list for a batch). token_ids: (batch, new_tokens). prompt_ids: (batch, n) of the
    compressed prompt (the context alone in query-agnostic mode). kept_indices[layer]: (batch, kv_heads,
    kept) prompt positions the layer's cache holds after prefill, sorted ascending (a sliding-window layer:
    the last ones, its own bounded cache). cache_lengths[layer]: cache length right after prefill.
    Timings are wall-clock seconds read after synchronising the device.
    """

    text: str | list[str]
    token_ids: torch.Tensor
    prompt_ids: torch.Tensor
    kept_indices: list[torch.Tensor]
    cache_lengths: list[int]
    kv_bytes: int
    prefill_seconds: float
    selection_seconds: float
    decode_ms_per_token: float
    policy: Policy


@torch.inference_mode()
def greedy_decode(model, cache, logits, start: int, max_new_tokens: int, eos_ids=(), stop=None) -> tuple[torch.Tensor, list[float]]:
    """Greedy decoding from the last prompt logits (batch, vocab), positions counted from `start`.

    Positions are passed explicitly: the compressed cache is shorter than the number of tokens seen.
    stop(token_ids) -> bool ends early (e.g. once an answer is complete). Returns ((batch, new), step seconds).
    """
    tokens, seconds = [], []
    done = torch.zeros(logits.shape[0], dtype=torch.bool)
    next_token = logits.argmax(-1)
    for step in range(max_new_tokens):
        tokens.append(next_token)
        done |= torch.isin(next_token.cpu(), torch.tensor(list(eos_ids), dtype=torch.long))
        if bool(done.all()) or step == max_new_tokens - 1 or (stop is not None and stop(torch.stack(tokens, 1))):
            break
        with stopwatch(model.device) as elapsed:
            position = torch.full((logits.shape[0], 1), start + step, dtype=torch.long, device=model.device)
            out = model(next_token[:, None], past_key_values=cache, position_ids=position, use_cache=True)
            next_token = out.logits[:, -1].argmax(-1)
        seconds.append(elapsed.seconds)
    return torch.stack(tokens, 1), seconds


def decode_text(tokenizer, token_ids: torch.Tensor, eos_ids) -> list[str]:
    """(batch, new) -> texts, each cut at its first EOS."""
    texts = []
    for row in token_ids.tolist():
        cut = next((i for i, t in enumerate(row) if t in eos_ids), len(row))
        texts.append(tokenizer.decode(row[:cut], skip_special_tokens=True).strip())
    return texts


@torch.inference_mode()
def generate(model, tokenizer, prompt, *, policy: Policy | None = None, max_new_tokens: int = 64,
             question=None, stop=None) -> GenerationResult:
    """Greedy generation with the prompt's KV cache compressed by `policy` after prefill.

    prompt: text, chat messages, token ids, or a list of equal-length prompts (a batch).
    question: query-agnostic mode: `prompt` is the context alone, compressed; the question (text,
        tokenised without special tokens, or ids) is appended after compression, then the answer decoded.
    Timings: prefill_seconds covers the compressed forward (question included), selection_seconds the part of
    it spent scoring, selecting and gathering; decode ms/token the steps after the first token.
    """
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int (the first token comes from the prefill), got {max_new_tokens!r}")
    ids = encode_batch(tokenizer, prompt).to(model.device)
    extra = None if question is None else encode_continuation(tokenizer, question).to(model.device).expand(ids.shape[0], -1)
    batch, n = ids.shape
    check_context_length(model, n + (0 if extra is None else extra.shape[1]) + max_new_tokens,
                         "the prompt, question and new tokens")
    eos = eos_ids(model, tokenizer)
    with compress(model, policy) as state:
        with stopwatch(model.device) as prefill:
            # logits_to_keep=1: the full-vocabulary logits of a long prompt would cost more memory than its KV cache.
            logits = model(ids, past_key_values=state.cache, position_ids=torch.arange(n, device=model.device)[None],
                           use_cache=True, logits_to_keep=1).logits[:, -1]
            state.check_prefill_seen()
            cache_lengths = [layer.keys.shape[-2] for layer in state.cache.layers]
            kv_bytes = cache_bytes(state.cache)
            start = n
            if extra is not None:
                positions = torch.arange(n, n + extra.shape[1], device=model.device)[None]
                logits = model(extra, past_key_values=state.cache, position_ids=positions, use_cache=True,
                               logits_to_keep=1).logits[:, -1]
                start += extra.shape[1]
        token_ids, seconds = greedy_decode(model, state.cache, logits, start, max_new_tokens, eos, stop)
    texts = decode_text(tokenizer, token_ids, eos)
    return GenerationResult(
        text=texts[0] if batch == 1 else texts, token_ids=token_ids.cpu(), prompt_ids=ids.cpu(),
        kept_indices=[state.kept_indices[i].cpu() for i in sorted(state.kept_indices)], cache_lengths=cache_lengths,
        kv_bytes=kv_bytes, prefill_seconds=prefill.seconds, selection_seconds=state.selection_seconds,
        decode_ms_per_token=1000 * sum(seconds) / len(seconds) if seconds else float("nan"), policy=state.policy,
    )
