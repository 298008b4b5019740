"""The retrieval runner: every question of every context, with the full cache and each policy x budget x mode,
from one prefill of each context (compression.shared.SharedPrefill).

    context prefill (full cache, scores of every policy recorded)  -> query-agnostic states
    + question chunk (full cache, scores recorded again)            -> query-aware states
    each (policy, capacity, mode): a compressed copy of the full cache, then greedy decoding.
"""

from __future__ import annotations

import dataclasses

import pandas as pd
import torch

from ..compression import SharedPrefill
from ..compression.generation import MODES, GenerationResult, answer_runs
from ..compression.kept import kept_mask
from ..compression.state import CompressionState
from ..core.inputs import check_context_length
from ..core.progress import progress_bar
from ..core.timing import ms_per_token
from ..policies import H2O, RandomKeep, SnapKV, SnapKVNoPooling, StreamingLLM
from ..tasks.corpus import redact_essays
from ..tasks.needles import Context, found, found_exactly

DEFAULT_POLICIES = (SnapKV(), SnapKVNoPooling(), H2O(), StreamingLLM(), RandomKeep())
CAPACITIES = (256, 512, 1024, 2048)


def kept_fraction(kept: CompressionState | GenerationResult, span: tuple[int, int]) -> float:
    """Fraction of the span's token positions held, averaged over the compressed layers and their KV heads, by a
    compression state or an answer (its kept positions at the end of its run)."""
    start, end = span
    layers = sorted(kept.kept_indices) if isinstance(kept.kept_indices, dict) else range(len(kept.kept_indices))
    compressed = [i for i, layer in enumerate(layers) if layer not in kept.sliding_layers]
    return float(kept_mask(kept, end)[compressed, :, start:end].float().mean())


def kept_spans(kept: CompressionState | GenerationResult, query, compressed: bool) -> dict:
    """A row's fact_kept and value_kept: the kept_fraction of the query's fact and value spans, 1.0 each when the run
    was not compressed (the whole cache held)."""
    spans = {"fact_kept": query.span, "value_kept": query.value_span}
    return {column: kept_fraction(kept, span) if compressed else 1.0 for column, span in spans.items()}


@torch.inference_mode()
def run_retrieval(model, tokenizer, contexts: list[Context], policies=DEFAULT_POLICIES, capacities=CAPACITIES,
                  modes=MODES, max_new_tokens: int = 24, progress: bool = True, on_context=None,
                  describe=None) -> pd.DataFrame:
    """Answer every query of every context with the full cache and each policy x capacity x mode.

    capacities: each policy runs at each of them; None runs each policy at its own.
    Returns a tidy table: one row per (context, query, policy, capacity, mode), with the answer text,
    correctness as RULER grades it (`correct`: the expected value appears in the answer) and strictly
    (`exact`: it appears as a whole token, not inside a longer number), the fraction of the fact's and of the value's
    tokens kept (mean over layers and KV heads), the cache length and the decode time; `model` names the model (the
    figures' titles). `policy` is the policy's scorer_label: its name, with any non-default setting, so two
    configurations never share rows.
    on_context(rows_so_far) is called after each context (to save partial results).
    describe(context, query, state, n_compressed) -> dict adds columns to a run's row, computed from its
    compression state before decoding; n_compressed is the prompt length the state compressed (the context alone
    query-agnostic), so positions from there to the end of the prompt are held in full.
    """
    for context in contexts:  # all of them before the first prefill, not an hour into the grid
        longest = max(len(q.question_ids) for q in context.queries)
        check_context_length(model, len(context.context_ids) + longest + max_new_tokens,
                             what=f"retrieval context {context.meta} with its question and {max_new_tokens} new tokens")
    if capacities is not None:  # None: each policy at its own capacity (a study of one list of configurations)
        policies = [dataclasses.replace(p, capacity=c) for p in policies for c in capacities]
    rows = []
    steps = sum(len(c.queries) for c in contexts) * (1 + len(policies) * len(modes))
    bar = progress_bar(total=steps, desc="retrieval", disable=not progress)
    as_ids = lambda ids: torch.tensor([ids], device=model.device)  # noqa: E731
    for context in contexts:
        shared = SharedPrefill.run(model, tokenizer, as_ids(context.context_ids), policies)
        hook = None if describe is None else (
            lambda index, state, n, context=context: describe(context, context.queries[index], state, n))
        questions = [as_ids(query.question_ids) for query in context.queries]
        for run in answer_runs(model, tokenizer, shared, questions, policies, modes, max_new_tokens, hook):
            query = context.queries[run.question_index]
            rows.append(dict(**context.meta, **{k: v for k, v in query.meta.items() if k not in context.meta},
                             model=model.config.name_or_path,
                             policy=run.policy.scorer_label,
                             capacity=pd.NA if run.mode == "full" else run.policy.capacity,
                             mode=run.mode, expected=query.answer, output=redact_essays(run.text),
                             correct=found(query.answer, run.text),
                             exact=found_exactly(query.answer, run.text),
                             **kept_spans(run, query, run.compressed),
                             cache_length=max(run.cache_lengths), **run.entries.columns(),
                             prompt_tokens=run.prompt_tokens, prefill_s=shared.seconds,
                             decode_ms_per_token=ms_per_token(run.step_seconds), **run.extra))
            bar.update()
        if on_context is not None:
            on_context(pd.DataFrame(rows))
    bar.close()
    return pd.DataFrame(rows)
