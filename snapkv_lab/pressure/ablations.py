"""Why SnapKV loses needles at a 25% budget: its design choices one at a time, and the other methods, on the dev
needles, each run explained by the attention it kept (`snapkv-lab needle --suites ablations`).

Every run of the ablation table carries, besides its answer, what `coverage.attention_coverage` and
`coverage.span_attention` measure against a full-cache capture of the same prompt and answer:

    coverage, oracle, chance   share of the answer's prompt attention on the kept positions, on the best fixed set
                               of that size, and k / prompt (sinks excluded; mean over layers and query heads)
    value_attention            share of the answer's prompt attention on the needle value's tokens
    value_attention_kept       the part of it on kept value tokens (<= value_attention)
"""

from __future__ import annotations

import pandas as pd
import torch

from ..capture import capture
from ..compression.layers import held_positions
from ..coverage import GenerationAttention, attention_coverage, sinks_rows, span_attention
from ..policies import (H2O, KNorm, KVzip, AdaKV, ChunkKV, CriticalKV, ExpectedAttention, PyramidKV, RandomKeep, SnapKV,
                        StreamingLLM, TOVA)
from .runner import run_retrieval
from .tasks import Context, Query

ABLATION_LENGTH = 4000
ABLATION_CAPACITY = 1024  # 25% of the prompt
ABLATION_SAMPLES = 2  # haystacks per needle depth: the needle grid's first samples, the dev needles
ANSWER_TOKENS = 8  # the full-cache capture the runs are explained by: a 7-digit value and its full stop

# axis -> setting -> policy. SnapKV's defaults (window 32, max pooling with kernel 7, GQA mean, one selection per
# KV head) appear once on every axis: the run is shared, the table repeats it per axis. KVzip's variants share its
# reconstruction pass (SharedPrefill pays it once per prefill).
AXES: dict[str, dict[str, object]] = {
    "window": {str(w): SnapKV(window_size=w) for w in (16, 32, 64, 128)},
    "kernel": {str(k): SnapKV(kernel_size=k) for k in (1, 3, 7, 15, 31)},
    "pooling": {"max": SnapKV(), "avg": SnapKV(pooling="avg")},
    "gqa": {"mean": SnapKV(), "max": SnapKV(gqa="max")},
    "layout": {"per KV head": SnapKV(), "per query head": SnapKV(per_query_head=True)},
    "KVzip pooling": {"none": KVzip(), "max 7": KVzip(pooling="max", kernel_size=7),
                      "max 31": KVzip(pooling="max", kernel_size=31)},
    "method": {p.name: p for p in (SnapKV(), PyramidKV(), AdaKV(), TOVA(), KNorm(), ChunkKV(), CriticalKV(),
                                   ExpectedAttention(), KVzip(), H2O(), StreamingLLM(), RandomKeep())},
}


def ablation_policies() -> list:
    """Every distinct policy of AXES (by scorer_label), in order of first appearance."""
    return list({p.scorer_label: p for settings in AXES.values() for p in settings.values()}.values())


def held_prompt_positions(state, n_compressed: int, n_prompt: int) -> list[torch.Tensor]:
    """Per layer (batch, rows, k) the prompt positions a compression state's cache holds before decoding: the kept
    positions of compressed layers, all positions of uncompressed ones, and every position from n_compressed to
    n_prompt (the question, appended in full after a query-agnostic compression). rows: the compressed layers' head
    count (KV heads, or query heads in the per-query-head layout)."""
    rows = next((kept.shape[1] for kept in state.kept_indices.values()), None)
    held = []
    for layer in range(state.n_layers):
        if layer in state.kept_indices:
            positions = state.kept_indices[layer]
        else:
            positions = held_positions(state.cache.layers[layer], n_compressed)
            positions = positions[:, :1].expand(-1, rows or positions.shape[1], -1)  # one set shared by every head
        appended = torch.arange(n_compressed, n_prompt, device=positions.device).expand(*positions.shape[:2], -1)
        held.append(torch.cat([positions, appended], dim=-1))
    return held


def coverage_describer(model, tokenizer):
    """A `run_retrieval(describe=...)` function: coverage columns (module doc) of each run, from one full-cache
    capture per question (its prompt and greedy answer), made when the question is first described."""
    reduced: dict[int, GenerationAttention] = {}

    def describe(context: Context, query: Query, state, n_compressed: int) -> dict:
        if id(query) not in reduced:
            prompt = torch.tensor([context.context_ids + query.question_ids], device=model.device)
            reduced.clear()  # one question at a time
            trace = capture(model, tokenizer, prompt, max_new_tokens=ANSWER_TOKENS, progress=False)
            reduced[id(query)] = GenerationAttention(trace)
        attention = reduced[id(query)]
        kept = held_prompt_positions(state, n_compressed, attention.trace.prompt_len)
        covered = sinks_rows(attention_coverage(attention, kept), "excluded")
        on_value = span_attention(attention, query.value_span, kept)
        return dict(coverage=covered.coverage.mean(), oracle=covered.oracle.mean(), chance=covered.chance.mean(),
                    value_attention=on_value.span_share.mean(), value_attention_kept=on_value.span_kept_share.mean())

    return describe


def run_ablations(model, tokenizer, contexts: list[Context], *, capacity: int = ABLATION_CAPACITY,
                  on_context=None, progress: bool = True) -> pd.DataFrame:
    """Every policy of AXES at `capacity`, both modes, each run with its coverage columns: run_retrieval's table."""
    return run_retrieval(model, tokenizer, contexts, policies=ablation_policies(), capacities=(capacity,),
                         on_context=on_context, progress=progress, describe=coverage_describer(model, tokenizer))


def ablation_table(table: pd.DataFrame) -> pd.DataFrame:
    """Found / asked with Wilson intervals (both grades), mean value tokens kept and coverage columns, per axis,
    setting and mode; the full cache's row on top of each axis and mode."""
    from .grid import accuracy_intervals  # grid imports this module for its suite row

    means = ["value_kept", "coverage", "oracle", "chance", "value_attention", "value_attention_kept"]
    rows = []
    for axis, settings in AXES.items():
        for setting, policy in [("full cache", None), *settings.items()]:
            for mode in ("query-aware", "query-agnostic"):
                part = table[table["mode"] == "full"] if policy is None else \
                    table[(table.policy == policy.scorer_label) & (table["mode"] == mode)]
                if part.empty:
                    continue
                found = accuracy_intervals(part.assign(group=0), by=("group",)).iloc[0].drop("group")
                rows.append(dict(axis=axis, setting=setting, mode=mode, **found,
                                 **{c: part[c].mean() for c in means if c in part}))
    return pd.DataFrame(rows)
