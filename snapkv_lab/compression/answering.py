"""Every policy x mode answering every question of one context, from one prefill: the loop the pressure suites and
the benchmark runs share.

    shared = SharedPrefill.run(model, tokenizer, context_ids, policies)
    for run in answer_runs(model, tokenizer, shared, [question_ids, ...], policies, modes, max_new_tokens):
        run.policy, run.mode, run.question, run.text, run.state ...

Query-aware: the question is fed on a fork of the full cache and the context and question are compressed together.
Query-agnostic (kvpress's protocol): the context alone is compressed, then the question is fed over the compressed
cache. The full cache ("full" mode, once per question) is the baseline of both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ..core.inputs import eos_ids
from ..policies.base import FullCache, Policy
from .compressor import CompressionState, applied
from .generation import decode_text, forward, greedy_decode
from .layers import cache_lengths
from .shared import SharedPrefill

MODES = ("query-aware", "query-agnostic")


@dataclass
class AnswerRun:
    """One answer of one policy in one mode to one question.

    mode: "full" (the full cache), "query-aware" or "query-agnostic". question: its index in the list asked.
    state: the compression state it answered from (its cache holds the decoded tokens afterwards).
    n_compressed: the prompt length the state compressed (the context alone query-agnostic).
    compressed: False where the policy kept everything (a prompt within its budget, or only sliding layers).
    cache_length: the longest layer cache before decoding; prompt_tokens: context + question.
    token_ids: (1, new); step_seconds: the decode steps after the first token. extra: the describe hook's columns.
    """

    policy: Policy
    mode: str
    question: int
    state: CompressionState
    n_compressed: int
    compressed: bool
    cache_length: int
    prompt_tokens: int
    token_ids: torch.Tensor
    text: str
    step_seconds: list[float]
    extra: dict


@torch.inference_mode()
def answer_runs(model, tokenizer, shared: SharedPrefill, questions: list[torch.Tensor], policies, modes=MODES,
                max_new_tokens: int = 24,
                describe: Callable[[int, CompressionState, int], dict] | None = None) -> Iterator[AnswerRun]:
    """The full cache, then each policy in each of `modes`, answering each question (1, m) of the context that
    `shared` prefilled (its policies must include `policies`). Yields each run as it finishes.

    describe(question index, state, n_compressed) -> dict of extra columns, read from the state before decoding.
    """
    if set(modes) - set(MODES):
        raise ValueError(f"modes must be among {MODES}, got {list(modes)}")
    eos = eos_ids(model, tokenizer)
    for index, question in enumerate(questions):
        aware = shared.extend(question)

        def run(policy: Policy, mode: str, state: CompressionState, first_logits) -> AnswerRun:
            n = shared.n_tokens if mode == "query-agnostic" else aware.n_tokens
            compressed = bool(set(state.kept_indices) - set(state.sliding_layers)) and policy.budget(n) is not None
            length = max(cache_lengths(state.cache))
            extra = {} if describe is None else describe(index, state, n)
            with applied(model, state):
                if first_logits is None:
                    first_logits = forward(model, question, state.cache, shared.n_tokens)
                tokens, seconds = greedy_decode(model, state.cache, first_logits, aware.n_tokens, max_new_tokens, eos)
            return AnswerRun(policy, mode, index, state, n, compressed, length, aware.n_tokens, tokens.cpu(),
                             decode_text(tokenizer, tokens, eos)[0], seconds, extra)

        yield run(FullCache(), "full", aware.state(FullCache()), aware.logits)
        for policy in policies:
            if "query-aware" in modes:
                yield run(policy, "query-aware", aware.state(policy), aware.logits)
            if "query-agnostic" in modes:
                yield run(policy, "query-agnostic", shared.state(policy), None)
