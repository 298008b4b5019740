"""Greedy generation over a compressed cache: one prompt, or one compressed context and many questions."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from ..inputs import check_context_length, encode_batch, encode_continuation, eos_ids
from ..policies.base import FullCache, Policy
from ..timing import ms_per_token, stopwatch
from .compressor import CompressionState, applied, compress
from .layers import cache_bytes, cache_lengths, fork
from .shared import SharedPrefill


@dataclass
class GenerationResult:
    """Output of `generate`.

    text: the answer (a list for a batch). token_ids: (batch, new_tokens). prompt_ids: (batch, n) of the
    compressed prompt (the context alone in query-agnostic mode). kept_indices[layer]: (batch, kv_heads,
    kept) token positions the layer's cache holds, sorted ascending: the kept prompt positions, or with
    eviction while decoding those held at the end (a sliding-window layer: the last ones, its own bounded
    cache; a head-wise budget: rows padded with -1). cache_lengths[layer]: positions per head right after
    prefill (the mean over heads for head-wise budgets). kv_bytes: keys and values held after prefill.
    Timings are wall-clock seconds read after synchronising the device; prefill_seconds includes scoring
    (selection_seconds) and any extra scoring pass (KVzip).
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
    question: str | None = None


@torch.inference_mode()
def greedy_decode(model, cache, logits, start: int, max_new_tokens: int, eos_ids=(), stop=None) -> tuple[torch.Tensor, list[float]]:
    """Greedy decoding from the last prompt logits (batch, vocab), positions counted from `start`.

    Run it inside `applied(model, state)` when the cache is compressed. Positions are passed explicitly: the
    compressed cache is shorter than the number of tokens seen. stop(token_ids) -> bool ends early (e.g. once
    an answer is complete). Returns ((batch, new), step seconds).
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


def forward(model, ids: torch.Tensor, cache, start: int) -> torch.Tensor:
    """Feed ids (batch, n) at positions start.. over `cache`; the last position's logits (batch, vocab).
    logits_to_keep=1: the full-vocabulary logits of a long prompt would cost more memory than its KV cache."""
    positions = torch.arange(start, start + ids.shape[1], device=model.device)[None]
    return model(ids, past_key_values=cache, position_ids=positions, use_cache=True, logits_to_keep=1).logits[:, -1]


def several_questions(question) -> bool:
    """A list of questions (texts, or id lists), not one question's token ids."""
    return isinstance(question, (list, tuple)) and not all(isinstance(q, int) for q in question)


def encode_questions(model, tokenizer, ids, question, max_new_tokens: int) -> tuple[list, list]:
    """(questions, their ids (batch, m) or None) for None, one question, or a list of them; checks the longest
    fits the context after ids (batch, n) with max_new_tokens."""
    questions = list(question) if several_questions(question) else [question]
    if not questions:
        raise ValueError("question is an empty list: give at least one question")
    extras = [None if q is None else encode_continuation(tokenizer, q).to(model.device).expand(ids.shape[0], -1)
              for q in questions]
    longest = max(0 if e is None else e.shape[1] for e in extras)
    check_context_length(model, ids.shape[1] + longest + max_new_tokens, "the prompt, question and new tokens")
    return questions, extras


def branch(state: CompressionState) -> CompressionState:
    """A state over a fork of `state`'s cache, for one more question on the same compressed context."""
    return dataclasses.replace(state, cache=fork(state.cache), kept_indices=dict(state.kept_indices), _groups={},
                               _trackers={}, timer=None)


def chunk_sizes(n: int, chunk: int) -> list[int]:
    """The sizes a prompt of n tokens is fed in under prefill_chunk=chunk: the remainder first, then whole chunks,
    so that the last chunk, whose queries vote last, is always a whole one."""
    return ([n % chunk] if n % chunk else []) + [chunk] * (n // chunk)


@torch.inference_mode()
def chunked_prefill(model, ids: torch.Tensor, policy: Policy, chunk: int) -> tuple[CompressionState, torch.Tensor, float]:
    """Prefill ids (batch, n) in chunks of `chunk` tokens, compressing as it goes (see `compress`): (state, last
    logits, seconds). A capacity ratio is a budget of the whole prompt, fixed in tokens before the first chunk."""
    if policy.extra_passes:
        raise NotImplementedError(f"{policy.label} scores with {policy.extra_passes} extra pass(es) over the whole "
                                  "prompt, which a chunked prefill never holds: run it without prefill_chunk")
    n = ids.shape[1]
    tokens = dataclasses.replace(policy, capacity=policy.budget(n)) if isinstance(policy.capacity, float) else policy
    with compress(model, tokens, prefill_chunk=chunk) as state, stopwatch(model.device) as elapsed:
        start = 0
        for size in chunk_sizes(n, chunk):
            logits = forward(model, ids[:, start:start + size], state.cache, start)
            start += size
        state.end_prefill()
    state.policy = policy
    return state, logits, elapsed.seconds


@torch.inference_mode()
def prefill(model, tokenizer, ids: torch.Tensor, policy: Policy,
            prefill_chunk: int | None = None) -> tuple[CompressionState, torch.Tensor, float]:
    """Prefill ids (batch, n) and compress with `policy`: (state, last logits, seconds). Policies with extra
    scoring passes (KVzip) prefill a full cache, score it with those passes, then keep a compressed copy.
    prefill_chunk: feed the prompt in chunks, compressing as it goes (`chunked_prefill`)."""
    if prefill_chunk is not None:
        return chunked_prefill(model, ids, policy, prefill_chunk)
    if not policy.extra_passes:
        with compress(model, policy) as state, stopwatch(model.device) as elapsed:
            logits = forward(model, ids, state.cache, 0)
            state.check_prefill_seen()
        return state, logits, elapsed.seconds
    shared = SharedPrefill.run(model, tokenizer, ids, [policy])
    state = shared.state(policy)
    return state, shared.logits, shared.seconds + state.selection_seconds


@torch.inference_mode()
def generate(model, tokenizer, prompt, *, policy: Policy | None = None, max_new_tokens: int = 64,
             question=None, stop=None, prefill_chunk: int | None = None) -> GenerationResult | list[GenerationResult]:
    """Greedy generation with the prompt's KV cache compressed by `policy` after prefill.

    prompt: text, chat messages, token ids, or a list of equal-length prompts (a batch).
    question: query-agnostic mode: `prompt` is the context alone, compressed; the question (text, tokenised
        without special tokens, or ids) is appended after compression, then the answer decoded. A list of
        questions (texts or id lists): compress once, ask many: one prefill and one compression, each question answered on its
        own copy of the compressed cache; returns one result per question.
    prefill_chunk=N: prefill in chunks of N tokens, the cache cut back to its budget after each (peak KV memory
        capacity + N per head, whatever the prompt's length; see `compress` for what scores mean then). Equal to
        the unchunked run when N covers the prompt.
    Timings: prefill_seconds covers the compressed forward (the question's included), selection_seconds the
    part of it spent scoring, selecting and gathering; decode ms/token the steps after the first token.
    """
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int (the first token comes from the prefill), got {max_new_tokens!r}")
    policy = policy or FullCache()
    ids = encode_batch(tokenizer, prompt).to(model.device)
    many = several_questions(question)
    questions, extras = encode_questions(model, tokenizer, ids, question, max_new_tokens)
    state, logits, prefill_seconds = prefill(model, tokenizer, ids, policy, prefill_chunk)
    results = answers(model, tokenizer, state, logits, ids, questions, extras, prefill_seconds, max_new_tokens, stop)
    return results if many else results[0]


@torch.inference_mode()  # the state was built in inference mode: its tensors cannot meet autograd
def answers(model, tokenizer, state: CompressionState, logits, ids, questions, extras, prefill_seconds: float,
            max_new_tokens: int, stop=None) -> list[GenerationResult]:
    """Decode after a prefill of ids (batch, n) compressed into `state`: once per question (its text or None, its
    ids (batch, m) or None), each on its own fork of the cache when there are several."""
    eos = eos_ids(model, tokenizer)
    lengths, kv_bytes = cache_lengths(state.cache), cache_bytes(state.cache)
    batch, n = ids.shape
    results = []
    for text, extra in zip(questions, extras, strict=True):
        asked = branch(state) if len(questions) > 1 else state
        with applied(model, asked):
            with stopwatch(model.device) as appended:
                first = logits if extra is None else forward(model, extra, asked.cache, n)
            start = n + (0 if extra is None else extra.shape[1])
            token_ids, seconds = greedy_decode(model, asked.cache, first, start, max_new_tokens, eos, stop)
        texts = decode_text(tokenizer, token_ids, eos)
        results.append(GenerationResult(
            text=texts[0] if batch == 1 else texts, token_ids=token_ids.cpu(), prompt_ids=ids.cpu(),
            kept_indices=[asked.kept_indices[i].cpu() for i in sorted(asked.kept_indices)], cache_lengths=lengths,
            kv_bytes=kv_bytes, prefill_seconds=prefill_seconds + appended.seconds, selection_seconds=state.selection_seconds,
            decode_ms_per_token=ms_per_token(seconds), policy=state.policy,
            question=text if isinstance(text, str) else None))
    return results
