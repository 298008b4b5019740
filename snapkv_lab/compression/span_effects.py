"""Evictions as experiments: what removing one span of a prompt's keys and values from the cache does to the answer.

    table = span_effects(model, tokenizer, context, question)          # one row per block of 64 context positions
    table.sort_values("kl", ascending=False).head()                     # the spans the answer needs most

A compressor bets that the positions it evicts do not change the answer; this measures the bet. The context is
prefilled once. For each span, its keys and values are removed from the cache (every layer and KV head, or the
`layers` / `heads` given), the other positions keeping their original positions as a compressor leaves them; then
the question and the answer are fed over the evicted cache, teacher-forced, and each answer token's next-token
distribution is compared with the full cache's. Removal is exact by masking: a key the span's mask hides gets no
weight in the softmax, which is the attention over the cache without it (tests/test_span_effects.py checks this
against a forward over a cache with the span cut out). Spans run `batch_size` at a time as the rows of one batch,
each over its own view of the one prefilled cache.

Columns: start, end (context positions, end exclusive); kl (mean over the answer's tokens of KL(full || evicted)
between next-token distributions, nats); logprob_delta (log p(answer | evicted) - log p(answer | full), summed over
the answer's tokens); answer_changed (the evicted cache's greedy decoding no longer reproduces the answer: some
answer token is not the evicted cache's argmax after the answer's own prefix, which for the default answer, the full
cache's greedy one, is exactly whether the evicted greedy answer differs).

query_aware=True evicts after a prefill of the context and the question together, so the question is in the cache
(and evictable, where a span covers it: spans are still context positions); the answer's first token then follows
the prefill's own logits and is unaffected by any eviction (its KL is 0): only later tokens carry the effect.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from ..core.checks import check_int
from ..core.hooks import intercept_attention, with_cache
from ..core.inputs import check_context_length, encode_batch, encode_continuation, eos_ids
from ..core.progress import progress_bar
from .greedy import eos_cut, forward, greedy_decode
from .layers import fork, held_positions
from .state import visible_mask


def default_spans(n: int, block: int) -> list[tuple[int, int]]:
    """Consecutive blocks of `block` positions over n context positions, the last one shorter."""
    if block < 1:
        raise ValueError(f"block must be a positive number of positions, got {block}")
    return [(start, min(start + block, n)) for start in range(0, n, block)]


def _whole(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _checked_spans(spans, n: int) -> list[tuple[int, int]]:
    spans = [tuple(span) for span in spans]
    bad = [span for span in spans if len(span) != 2 or not all(map(_whole, span)) or not 0 <= span[0] < span[1] <= n]
    if bad:
        raise ValueError(f"spans are (start, end) context positions with 0 <= start < end <= {n}, got {bad[:3]}")
    return [(int(start), int(end)) for start, end in spans]


def _checked_indices(name: str, indices, count: int) -> set[int] | None:
    """A layers= or heads= subset as a set, each a whole number in [0, count); None (all) stays None."""
    if indices is None:
        return None
    indices = list(indices)
    bad = [i for i in indices if not _whole(i) or not 0 <= i < count]
    if bad:
        raise ValueError(f"{name} are indices in [0, {count}) (the cache's {name}), got {bad[:3]}")
    return {int(i) for i in indices}


def _batched(cache: DynamicCache, rows: int) -> DynamicCache:
    """A fork of a batch-1 cache whose every layer reads as `rows` identical rows (views: nothing is copied until a
    layer grows)."""
    forked = fork(cache)
    for layer in forked.layers:
        layer.keys = layer.keys.expand(rows, *layer.keys.shape[1:])
        layer.values = layer.values.expand(rows, *layer.values.shape[1:])
    return forked


class _Hider:
    """The attention override that hides, from the chosen layers and KV heads, each batch row's set of spans (module
    doc). positions[layer]: (slots,) the prompt position each cached slot of the layer holds (a sliding layer holds
    its last ones); the fed tokens' slots come after them and are never hidden."""

    def __init__(self, cache: DynamicCache, n: int, layers, heads):
        """n: the tokens prefilled into `cache` (the context, and the question when query-aware)."""
        self.positions = {i: held_positions(layer, n)[0, 0] for i, layer in enumerate(cache.layers)}
        self.layers, self.heads = layers, heads
        self.sets: list[list[tuple[int, int]]] = []  # per batch row, the spans it hides

    def __call__(self, function, module, query, key, value, attention_mask, **kwargs):
        layer = module.layer_idx
        if self.layers is not None and layer not in self.layers:
            return function(module, query, key, value, attention_mask, **kwargs)
        positions = self.positions[layer].to(key.device)
        slots = key.shape[-2]
        hidden = torch.zeros(len(self.sets), slots, dtype=torch.bool, device=key.device)
        for row, spans in enumerate(self.sets):
            for start, end in spans:
                hidden[row, :len(positions)] |= (positions >= start) & (positions < end)
        hidden = hidden[:, None, None, :]  # (batch, 1, 1, slots)
        if self.heads is not None:  # hide only from the query heads reading the chosen KV heads
            group = query.shape[1] // key.shape[1]
            chosen = torch.zeros(query.shape[1], dtype=torch.bool, device=key.device)
            for head in self.heads:
                chosen[head * group:(head + 1) * group] = True
            hidden = hidden & chosen[None, :, None, None]
        mask = attention_mask if attention_mask is not None else visible_mask(None, query, slots, module)
        if mask.shape[-1] != slots:
            raise ValueError(f"layer {layer}: the model's mask covers {mask.shape[-1]} slots, its keys {slots}")
        if mask.dtype == torch.bool:
            mask = mask & ~hidden
        else:  # an additive mask: where() broadcasts it to the heads where masked_fill cannot
            mask = torch.where(hidden, torch.finfo(mask.dtype).min, mask)
        return function(module, query, key, value, mask, **kwargs)


@dataclass
class EvictionProbe:
    """One context prefilled, its question and answer: the effect of hiding any set of spans from its cache.

    cache: the prefill's (the context, and the question when query-aware); n: the context's tokens; answer: (1, m)
    ids; fed: (1, k) the tokens teacher-forced after the prefill (the question and the answer but its last token, or
    the answer but its last); start: the first fed token's position; first: (1, 1, vocab) the prefill's
    log-probabilities where they give the answer's first token (query-aware), else None; reference: (1, m, vocab)
    the full cache's log-probabilities of each answer token's draw; forwards: batched forwards run so far."""

    model: object
    cache: DynamicCache
    n: int
    answer: torch.Tensor
    fed: torch.Tensor
    start: int
    first: torch.Tensor | None
    reference: torch.Tensor | None = None
    forwards: int = 0

    @classmethod
    @torch.inference_mode()
    def prefilled(cls, model, tokenizer, context, question, *, answer=None, query_aware: bool = False,
                  max_new_tokens: int = 32) -> EvictionProbe:
        """The probe of one context and question (arguments as `span_effects`)."""
        ids = encode_batch(tokenizer, context).ids.to(model.device)
        if ids.shape[0] != 1:
            raise ValueError(f"span effects take one context, got a batch of {ids.shape[0]}")
        n = ids.shape[1]
        check_int("max_new_tokens", max_new_tokens, 1, kind="a positive whole number")
        asked = encode_continuation(tokenizer, question).to(model.device)[None]
        given = None if answer is None else encode_continuation(tokenizer, answer).to(model.device)[None]
        check_context_length(model, n + asked.shape[1] + (max_new_tokens if given is None else given.shape[1]),
                             "the context, question and answer")
        if asked.shape[1] == 0 and not query_aware:
            raise ValueError("the question is empty: a query-agnostic probe feeds it after the eviction (give one, or "
                             "query_aware=True to evict after the context alone)")
        prompt = torch.cat([ids, asked], 1) if query_aware else ids
        cache = DynamicCache(config=model.config)
        prefill = model(prompt, **with_cache(model, cache), use_cache=True, logits_to_keep=1).logits[:, -1]
        if answer is None:  # the full cache's greedy answer to the question
            asking = fork(cache)
            logits = prefill if query_aware else forward(model, asked, asking, n)
            eos = eos_ids(model, tokenizer)
            generated, _ = greedy_decode(model, asking, logits, n + asked.shape[1], max_new_tokens, eos)
            answer = generated[:, :eos_cut(generated[0].tolist(), eos) + 1]
        else:
            answer = given
        if answer.shape[1] == 0:
            raise ValueError("the answer is empty: give one, or a max_new_tokens that lets the model answer")
        # Teacher forcing: the tokens whose next-token distributions are the answer's (not the last answer token's).
        fed = answer[:, :-1] if query_aware else torch.cat([asked, answer[:, :-1]], 1)
        first = F.log_softmax(prefill.float(), -1)[:, None] if query_aware else None
        probe = cls(model, cache, n, answer, fed, prompt.shape[1] if query_aware else n, first)
        probe.reference = probe._logprobs(None, prefill.shape[-1])
        return probe

    @torch.inference_mode()
    def effects(self, sets: list[list[tuple[int, int]]], *, layers=None, heads=None) -> list[dict]:
        """Per set of spans (hidden together, one batch row each): kl, logprob_delta, answer_changed (module doc).
        layers, heads: the layer indices and KV heads they are hidden from (None: all)."""
        if not sets:
            return []
        layers = _checked_indices("layers", layers, len(self.cache.layers))
        heads = _checked_indices("heads", heads, self.cache.layers[0].keys.shape[1])
        hider = _Hider(self.cache, self.start if self.first is not None else self.n, layers,
                       None if heads is None else sorted(heads))
        hider.sets = [_checked_spans(spans, self.n) for spans in sets]
        evicted, reference = self._logprobs(hider, self.reference.shape[-1]), self.reference
        kl = (reference.exp() * (reference - evicted)).sum(-1).mean(-1)  # (rows,)
        taken = self.answer[..., None]
        delta = evicted.gather(-1, taken.expand(len(sets), -1, -1)).sum((1, 2)) - reference.gather(-1, taken).sum()
        changed = (evicted.argmax(-1) != self.answer).any(-1)
        return [dict(kl=float(k), logprob_delta=float(d), answer_changed=bool(c))
                for k, d, c in zip(kl, delta, changed, strict=True)]

    def _logprobs(self, hider: _Hider | None, vocab: int) -> torch.Tensor:
        """(rows, answer length, vocab) float32: the log-probabilities each answer token was drawn from, over a
        batched view of the cache (one row per hidden set; one row, nothing hidden, when hider is None)."""
        rows = 1 if hider is None else len(hider.sets)
        if self.fed.shape[1] == 0:  # a one-token answer to a prefilled question: nothing is fed
            logprobs = torch.zeros(rows, 0, vocab, device=self.answer.device)
        else:
            model = self.model
            positions = torch.arange(self.start, self.start + self.fed.shape[1], device=model.device)
            run = dict(position_ids=positions[None].expand(rows, -1), use_cache=True)
            with nullcontext() if hider is None else intercept_attention(model, None, attend=hider):
                logits = model(self.fed.expand(rows, -1), **with_cache(model, _batched(self.cache, rows)), **run).logits
            logprobs = F.log_softmax(logits.float(), dim=-1)
            self.forwards += 1
        if self.first is not None:
            logprobs = torch.cat([self.first.expand(rows, -1, -1), logprobs], 1)
        return logprobs[:, -self.answer.shape[1]:]


@torch.inference_mode()
def span_effects(model, tokenizer, context, question, *, spans=None, block: int = 64, answer=None, layers=None,
                 heads=None, query_aware: bool = False, max_new_tokens: int = 32, batch_size: int = 8,
                 progress: bool = True) -> pd.DataFrame:
    """The effect on the answer of evicting each span of the context's cache (module doc).

    context: text, chat messages or token ids, as `generate` takes a prompt (the chat template applies to text and
    messages as there). question, answer: text (tokenised without special tokens) or token ids; answer None: the
    full cache's greedy answer (up to max_new_tokens, ending at EOS included). spans: [(start, end)] context positions
    (default: consecutive blocks of `block`). layers, heads: the layer indices and KV heads the span is evicted from
    (None: all). batch_size: spans per forward."""
    probe = EvictionProbe.prefilled(model, tokenizer, context, question, answer=answer, query_aware=query_aware,
                                    max_new_tokens=max_new_tokens)
    return probe_spans(probe, default_spans(probe.n, block) if spans is None else spans, layers=layers, heads=heads,
                       batch_size=batch_size, progress=progress)


def probe_spans(probe: EvictionProbe, spans, *, layers=None, heads=None, batch_size: int = 8,
                progress: bool = True) -> pd.DataFrame:
    """span_effects' table for a probe already prefilled: one row per span, each hidden alone."""
    check_int("batch_size", batch_size, 1, kind="a positive whole number")
    spans = _checked_spans(spans, probe.n)
    rows = []
    batches = range(0, len(spans), batch_size)
    for at in progress_bar(batches, desc="span effects", total=len(batches), disable=not progress):
        chunk = spans[at:at + batch_size]
        effects = probe.effects([[span] for span in chunk], layers=layers, heads=heads)
        rows += [dict(start=s, end=e, **effect) for (s, e), effect in zip(chunk, effects, strict=True)]
    return pd.DataFrame(rows, columns=["start", "end", "kl", "logprob_delta", "answer_changed"])
