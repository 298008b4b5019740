"""The answer engine: greedy answers over a prefilled, compressed cache; one prompt, or one context and many
questions, under one policy or many.

    generate(model, tokenizer, prompt, policy=SnapKV(capacity=1024), question=[...])   # the front door
    answer(model, tokenizer, state, logits, ids, questions, extras, ...)               # one state, its questions
    answer_runs(model, tokenizer, shared, questions, policies, modes)                  # a context, every policy x mode

Every answer goes through `answer`: its question fed over a fork of the state (several questions over one
compressed context decode together as one left-filled batch where they can: `batched_answers`), greedy decoding,
the end of answer found once (greedy.eos_cut), one result type (GenerationResult). `answer_runs` is the loop of
compare, the pressure runner, evaluate and explain: the full cache, then each policy in each mode, answering each
question of one prefilled context (shared.SharedPrefill).

Query-aware: the question is fed on a fork of the full cache and the context and question are compressed together.
Query-agnostic (kvpress's protocol): the context alone is compressed, then the question is fed over the compressed
cache. The full cache ("full" mode, once per question) is the baseline of both.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from ..core.checks import check_int
from ..core.inputs import check_context_length, encode_batch, encode_continuation, eos_ids, extended_mask
from ..core.timing import ms_per_token, stopwatch
from ..policies.base import FullCache, Policy
from .compressor import PADDED_CHUNKS_REFUSED, compress, refuse_after_prefill
from .entries import HeldEntries
from .footprint import Footprint
from .greedy import decode_text, eos_cut, forward, greedy_decode
from .layers import cache_bytes, cache_lengths, row_cache_lengths, stack_forks
from .shared import SharedPrefill
from .state import CompressionState, applied

MODES = ("query-aware", "query-agnostic")
# Questions answered in one batch at most (each holds its own copy of the compressed cache while decoding).
QUESTION_BATCH = 8


@dataclass
class GenerationResult:
    """Output of `generate`.

    text: the answer (a list for a batch). token_ids: (batch, new_tokens). prompt_ids: (batch, n) of the
    compressed prompt (the context alone in query-agnostic mode). `kept_indices[layer]`: (batch, kv_heads,
    kept) token positions the layer's cache holds, sorted ascending: the kept prompt positions, or with
    eviction while decoding those held at the end (a sliding-window layer: the last ones, its own bounded
    cache; a head-wise budget: rows padded with -1). cache_lengths[layer]: positions per head right after
    prefill (the mean over heads for head-wise budgets). kv_bytes: keys and values held after prefill.
    A padded batch (prompts of different lengths): prompt_ids are left-padded, prompt_mask (batch, n) is 0 on the
    pads, kept_indices hold -1 on the slots of pads and of rows keeping fewer than the widest, cache_lengths
    count the batch's slots and `row_cache_lengths[row][layer]` each row's own; `rows()` splits the result into
    one per prompt, each as its batch-1 run reports it.
    Timings are wall-clock seconds read after synchronising the device; prefill_seconds includes scoring
    (selection_seconds) and any extra scoring pass (KVzip).

    Where one context answers several questions under several policies (`answer_runs`): mode ("full", "query-aware",
    "query-agnostic"), question_index (its place in the questions asked), compressed_tokens (the prompt length the
    state compressed: the context alone query-agnostic), compressed (whether a layer was compressed: a prompt within
    its budget, or only sliding layers, is not), prompt_tokens (context and question), sliding_layers (layers left to
    their own bounded cache), step_seconds (the decode steps after the first token), extra (the describe hook's
    columns, read from the state before decoding), entries (the KV entries held, the uncompressed cache's and the
    budget's, per row and layer, right after the prompt's compression: compression.entries; kv_entries and kv_share
    are their totals).
    footprint: the entries and bytes the cache held as each new token was predicted (compression.footprint: its
    integral over the decode steps and its peak), recorded for every policy by the decoding loop.
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
    prompt_mask: torch.Tensor | None = None
    row_cache_lengths: list[list[int]] | None = None
    mode: str = "query-aware"
    question_index: int = 0
    compressed_tokens: int = 0
    compressed: bool = False
    prompt_tokens: int = 0
    sliding_layers: list[int] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    extra: dict = field(default_factory=dict)
    entries: HeldEntries | None = None
    footprint: Footprint | None = None

    @property
    def kv_entries(self):
        """KV entries held right after the prompt's compression, summed over layers and KV heads (entries.py)."""
        return self.entries.total

    @property
    def kv_share(self):
        """kv_entries over the uncompressed cache's on the same prompt."""
        return self.entries.share

    def __repr__(self) -> str:
        """One line: the policy, the prompt, the cache, the answer (printing every layer's kept positions helps no
        one)."""
        batch, n = self.prompt_ids.shape
        texts = self.text if isinstance(self.text, list) else [self.text]
        shown = (", ".join(repr(t if len(t) <= 60 else t[:57] + "...") for t in texts[:2])
                 + (", ..." if batch > 2 else ""))
        prompts = f"{batch} prompts of up to {n} tokens" if batch > 1 else f"a {n}-token prompt"
        cache = sum(self.cache_lengths) / max(1, len(self.cache_lengths))
        asked = "" if self.question is None else f", question {self.question!r}"
        return (f"GenerationResult({self.policy.label}: {prompts}{asked}, {cache:.0f} cache positions per layer on "
                f"average, {self.token_ids.shape[1]} new tokens, {self.kv_bytes / 2**20:.2f} MiB of KV; text {shown})")

    def rows(self, eos=()) -> list[GenerationResult]:
        """One result per batch row, as its batch-1 run would report it: the prompt without pads, kept positions
        without the -1 columns that only other rows fill, tokens up to and including the first of `eos` (a batch
        decodes on until every row is done), its own cache lengths; kv_bytes is the row's share (its slots)."""
        batch = self.token_ids.shape[0]
        mask = torch.ones_like(self.prompt_ids) if self.prompt_mask is None else self.prompt_mask
        lengths = self.row_cache_lengths or [self.cache_lengths] * batch
        total = sum(sum(row) for row in lengths) or 1
        texts = self.text if isinstance(self.text, list) else [self.text]
        results = []
        for b in range(batch):
            cut = eos_cut(self.token_ids[b].tolist(), eos) + 1
            kept = []
            for layer in self.kept_indices:
                row = layer[b:b + 1]
                used = (row >= 0).any(1)[0]  # slots some head of this row fills
                kept.append(row[..., used] if bool(used.any()) else row[..., :0])
            results.append(dataclasses.replace(
                self, text=texts[b], token_ids=self.token_ids[b:b + 1, :cut],
                prompt_ids=self.prompt_ids[b:b + 1][:, mask[b].bool()], kept_indices=kept,
                cache_lengths=lengths[b], kv_bytes=round(self.kv_bytes * sum(lengths[b]) / total),
                prompt_mask=None, row_cache_lengths=None,
                entries=None if self.entries is None else self.entries.row(b),
                footprint=None if self.footprint is None else self.footprint.row(b, cut)))
        return results


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


def chunk_sizes(n: int, chunk: int) -> list[int]:
    """The sizes a prompt of n tokens is fed in under prefill_chunk=chunk: the remainder first, then whole chunks,
    so that the last chunk, whose queries vote last, is always a whole one."""
    return ([n % chunk] if n % chunk else []) + [chunk] * (n // chunk)


@torch.inference_mode()
def chunked_prefill(model, ids: torch.Tensor, policy: Policy, chunk: int,
                    tokenizer=None) -> tuple[CompressionState, torch.Tensor, float]:
    """Prefill ids (batch, n) in chunks of `chunk` tokens, compressing as it goes (see `compress`): (state, last
    logits, seconds). A capacity ratio is a budget of the whole prompt, fixed in tokens before the first chunk."""
    refuse_after_prefill(policy, "a chunked prefill cannot give: run it without prefill_chunk")
    n = ids.shape[1]
    tokens = dataclasses.replace(policy, capacity=policy.budget(n)) if isinstance(policy.capacity, float) else policy
    with compress(model, tokens, prefill_chunk=chunk, tokenizer=tokenizer) as state, stopwatch(model.device) as elapsed:
        start = 0
        for size in chunk_sizes(n, chunk):
            logits = forward(model, ids[:, start:start + size], state.cache, start)
            start += size
        state.end_prefill()
    state.policy = policy
    return state, logits, elapsed.seconds


@torch.inference_mode()
def prefill(model, tokenizer, ids: torch.Tensor, policy: Policy, prefill_chunk: int | None = None,
            mask: torch.Tensor | None = None) -> tuple[CompressionState, torch.Tensor, float]:
    """Prefill ids (batch, n) and compress with `policy`: (state, last logits, seconds). Policies that compress
    after the prefill (KVzip's extra scoring passes, CAKE's budgets across layers) prefill a full cache, score it,
    then keep a compressed copy.
    prefill_chunk: feed the prompt in chunks, compressing as it goes (`chunked_prefill`).
    mask: (batch, n) 0 on a padded batch's left pads (None: no row is padded)."""
    if prefill_chunk is not None:
        if mask is not None:
            raise NotImplementedError(PADDED_CHUNKS_REFUSED)
        return chunked_prefill(model, ids, policy, prefill_chunk, tokenizer)
    if not policy.compresses_after_prefill:
        with compress(model, policy, tokenizer=tokenizer) as state, stopwatch(model.device) as elapsed:
            logits = forward(model, ids, state.cache, 0, mask)  # the prefill: one forward, which ends it
        return state, logits, elapsed.seconds
    shared = SharedPrefill.run(model, tokenizer, ids, [policy], mask=mask)
    state = shared.state(policy)
    return state, shared.logits, shared.seconds + state.selection_seconds


@torch.inference_mode()
def generate(model, tokenizer, prompt, *, policy: Policy | None = None, max_new_tokens: int = 64,
             question=None, stop=None, prefill_chunk: int | None = None) -> GenerationResult | list[GenerationResult]:
    """Greedy generation with the prompt's KV cache compressed by `policy` after prefill.

    prompt: text, chat messages, token ids, or a batch: a list of prompts, or a (batch, n) tensor. Prompts of
        different lengths are left-padded inside; each row is scored, compressed and decoded as its batch-1 run
        (its kept positions, cache and greedy answer equal, up to float rounding), pads never kept nor voting;
        `result.rows()` gives one result per prompt.
    question: query-agnostic mode: `prompt` is the context alone, compressed; the question (text, tokenised
        without special tokens, or ids) is appended after compression, then the answer decoded. A list of questions
        (texts or id lists): compress once, ask many: one prefill and one compression, each question answered on its
        own copy of the compressed cache; returns one result per question.
    prefill_chunk=N: prefill in chunks of N tokens, the cache cut back to its budget after each (peak KV memory
        capacity + N per head, whatever the prompt's length; see `compress` for what scores mean then). Equal to
        the unchunked run when N covers the prompt.
    Timings: prefill_seconds covers the compressed forward (the question's included), selection_seconds the
    part of it spent scoring, selecting and gathering; decode ms/token the steps after the first token.
    """
    check_int("max_new_tokens", max_new_tokens, 1, why=" (the first token comes from the prefill)")
    policy = policy or FullCache()
    batch = encode_batch(tokenizer, prompt).to(model.device)
    ids, mask = batch.ids, (None if batch.pads is None else batch.mask)
    many = several_questions(question)
    questions, extras = encode_questions(model, tokenizer, ids, question, max_new_tokens)
    state, logits, prefill_seconds = prefill(model, tokenizer, ids, policy, prefill_chunk, mask)
    results = answer(model, tokenizer, state, logits, ids, questions, extras, prefill_seconds=prefill_seconds,
                     max_new_tokens=max_new_tokens, stop=stop, mask=mask)
    return results if many else results[0]


@torch.inference_mode()  # the state was built in inference mode: its tensors cannot meet autograd
def answer(model, tokenizer, state: CompressionState, logits, ids, questions, extras, *, prefill_seconds: float,
           max_new_tokens: int, stop=None, mask: torch.Tensor | None = None, mode: str = "query-aware",
           question_index: int = 0, describe: Callable[[int, CompressionState, int], dict] | None = None,
           end_ids=(), min_new_tokens: int = 0) -> list[GenerationResult]:
    """Answer after a prefill of ids (batch, n) compressed into `state`: once per question (its text or None, its ids
    (batch, m) or None: the answer follows the prefill's own `logits`), each on its own fork of the cache when there
    are several; several questions over one context decode together as one batch where they can (`batched_answers`),
    each as its own run. mask: (batch, n) 0 on a padded batch's pads. mode, question_index (of the first question)
    and describe(question index, state, n) (extra columns read before decoding): what the results record. end_ids:
    more tokens that end an answer, as its EOS does (transformers' eos_token_id list); min_new_tokens: none of the
    end tokens among the first ones (its min_new_tokens)."""
    eos = tuple(dict.fromkeys((*eos_ids(model, tokenizer), *end_ids)))
    lengths, kv_bytes = cache_lengths(state.cache), cache_bytes(state.cache)
    pads = None if mask is None else (mask == 0).sum(-1).cpu()
    row_lengths = None if mask is None else row_cache_lengths(state.cache, pads)
    batch, n = ids.shape
    entries = HeldEntries.of_state(model, state, batch, n, pads)
    compressed = state.compressed(n)
    described = [{} if describe is None else describe(question_index + i, state, n) for i in range(len(questions))]
    decoded = None
    if batch == 1 and mask is None and stop is None and answers_batched(state, extras):
        decoded = [one for group in range(0, len(extras), QUESTION_BATCH)
                   for one in batched_answers(model, state, extras[group:group + QUESTION_BATCH], n, max_new_tokens,
                                              eos, min_new_tokens)]
    results = []
    for index, (text, extra) in enumerate(zip(questions, extras, strict=True)):
        if decoded is not None:
            (token_ids, fed, seconds, footprint), kept = decoded[index], state.kept_indices
        else:
            footprint = Footprint()
            asked = state.fork() if len(questions) > 1 else state
            with applied(model, asked):
                with stopwatch(model.device) as feeding:
                    first = logits if extra is None else forward(model, extra, asked.cache, n, mask)
                start = n + (0 if extra is None else extra.shape[1])
                token_ids, seconds = greedy_decode(model, asked.cache, first, start, max_new_tokens, eos, stop,
                                                   None if mask is None else extended_mask(mask, start), min_new_tokens,
                                                   footprint)
            fed, kept = feeding.seconds, asked.kept_indices
        texts = decode_text(tokenizer, token_ids, eos)
        results.append(GenerationResult(
            text=texts[0] if batch == 1 else texts, token_ids=token_ids.cpu(), prompt_ids=ids.cpu(),
            kept_indices=[kept[i].cpu() for i in sorted(kept)], cache_lengths=lengths,
            kv_bytes=kv_bytes, prefill_seconds=prefill_seconds + fed, selection_seconds=state.selection_seconds,
            decode_ms_per_token=ms_per_token(seconds), policy=state.policy,
            question=text if isinstance(text, str) else None, prompt_mask=None if mask is None else mask.cpu(),
            row_cache_lengths=row_lengths, mode=mode, question_index=question_index + index, compressed_tokens=n,
            compressed=compressed, prompt_tokens=n + (0 if extra is None else extra.shape[1]),
            sliding_layers=list(state.sliding_layers), step_seconds=seconds, extra=described[index], entries=entries,
            footprint=footprint))
    return results


def answers_batched(state: CompressionState, extras) -> bool:
    """Whether several questions over one compressed context can decode as one batch: not under eviction while
    decoding, whose trackers follow one sequence each, nor over pruned or quantized storage (ThinK, KIVI), whose
    forks would be stacked dense (layers.stack_forks)."""
    storage = state.policy.storage
    return (len(extras) > 1 and all(extra is not None for extra in extras)
            and getattr(state.policy, "tracker", None) is None and (storage is None or not storage.packs))


def batched_answers(model, state: CompressionState, extras, n: int, max_new_tokens: int, eos,
                    min_new_tokens: int = 0) -> list[tuple]:
    """Answer several questions (ids (1, m_q) each) over the compressed context of n tokens in `state`: each question
    fed on its own fork of the cache, then the forks stacked into one left-padded batch (`stack_forks`) and decoded
    together, so every decode step reads the weights once for all of them. Each row is its own question's batch-1
    run (same positions, same visible slots), its tokens cut after its first EOS as a batch-1 run stops there.
    Returns per question (token ids (1, new), seconds its question took to feed, the shared decode steps' seconds,
    its footprint over its own steps)."""
    forks, firsts, fed = [], [], []
    for extra in extras:
        asked = state.fork()
        with applied(model, asked), stopwatch(model.device) as appended:
            firsts.append(forward(model, extra, asked.cache, n))
        forks.append(asked.cache)
        fed.append(appended.seconds)
    cache, pads = stack_forks(forks)
    together = dataclasses.replace(state.fork(), cache=cache, pads=pads)
    start = n + max(extra.shape[1] for extra in extras)
    mask = (torch.arange(start)[None] >= pads[:, None]).long().to(model.device)
    footprint = Footprint()
    with applied(model, together):
        token_ids, seconds = greedy_decode(model, cache, torch.cat(firsts), start, max_new_tokens, eos, mask=mask,
                                           min_new_tokens=min_new_tokens, footprint=footprint)
    out = []
    for b, (row, appended) in enumerate(zip(token_ids, fed, strict=True)):
        cut = eos_cut(row.tolist(), eos) + 1
        out.append((row[None, :cut], appended, seconds[:cut - 1], footprint.row(b, cut)))
    return out


@torch.inference_mode()
def answer_runs(model, tokenizer, shared: SharedPrefill, questions: list, policies, modes=MODES,
                max_new_tokens: int = 24, describe: Callable[[int, CompressionState, int], dict] | None = None, *,
                full: bool = True, texts: list | None = None, end_ids=(), min_new_tokens: int = 0
                ) -> Iterator[GenerationResult]:
    """The full cache (unless full=False), then each policy in each of `modes`, answering each question of the context
    `shared` prefilled (its policies must include `policies`), question by question; yields each answer as it is made.

    questions: per question its ids (1, m), or None where the prompt prefilled holds its question (the whole prompt is
    compressed: query-aware, its answer following the prefill's own logits). texts: the questions as texts, where
    they were given so (reported in the results). describe(question index, state, n_compressed) -> dict of extra
    columns, read from the state before decoding. end_ids, min_new_tokens: see `answer`."""
    texts = texts or [None] * len(questions)
    for index, _, mode, prompt, state in run_states(shared, questions, policies, modes, full=full):
        agnostic = mode == "query-agnostic" and questions[index] is not None
        fed = prompt.seconds if prompt.refed else shared.seconds  # a prompt fed again in one call: that forward
        yield from answer(model, tokenizer, state, None if agnostic else prompt.logits, prompt.ids, [texts[index]],
                          [questions[index] if agnostic else None],
                          prefill_seconds=fed + state.selection_seconds, max_new_tokens=max_new_tokens,
                          mask=shared.mask, mode=mode, question_index=index, describe=describe, end_ids=end_ids,
                          min_new_tokens=min_new_tokens)


def run_states(shared: SharedPrefill, questions: list, policies, modes=MODES, *, full: bool = True
               ) -> Iterator[tuple[int, Policy, str, SharedPrefill, CompressionState]]:
    """The compression states `answer_runs` answers from, in its order: (question index, policy, mode, the prefill
    compressed: the context's query-agnostic, the context and question's otherwise, or that prompt fed again in one call
    for a policy that scores the whole prompt from one attention call (SharedPrefill.serving), the state). A study of
    what policies keep (compression.entries, a budget audit) reads these without decoding."""
    if set(modes) - set(MODES):
        raise ValueError(f"modes must be among {MODES}, got {list(modes)}")
    runs = [(FullCache(), "full")] if full else []
    runs += [(policy, mode) for policy in policies for mode in MODES if mode in modes]
    needs_aware = full or "query-aware" in modes  # the question fed on the full cache
    for index, question in enumerate(questions):
        aware = shared.extend(question) if question is not None and needs_aware else shared
        for policy, mode in runs:
            prompt = (shared if mode == "query-agnostic" and question is not None else aware).serving(policy)
            yield index, policy, mode, prompt, prompt.state(policy)
