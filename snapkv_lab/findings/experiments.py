"""The paper's four observation experiments, each a function from captured traces to a tidy table, run as cells
over both prompt splits, and the "findings" figure set (`snapkv-lab figures`).

(a) prompt_segments:        the last `n_prompt_segments` prompt segments, each voting on a common prefix, vs
                            the attention of all generated tokens; x = segment (-1, the last, is the
                            observation window).
(b) generation_consistency: the observation window's selection vs each of `n_gen_segments` segments of
                            generated tokens; observation windows of several sizes, and two selections:
                            "paper" (top-p per query head, no pooling, as the paper's observation code) and
                            "compressor" (what `SnapKV` keeps: max pooling, kernel 7, one set per KV head).
(c) question_placement:     (b) with one segment of all generated tokens, question before vs after the document.
(d) question_dependence:    selections over the document made by (question + its answer), H(M_A, M_B)
                            between the selections of different questions, and the same overlap between
                            alternate rows of one question (a control: how stable a selection is at all).

Selections are top-p (default 5%) of the prefix; metrics come from `metrics` with their chance levels, sinks
kept and excluded, sinks defined once per prompt from all its generated rows. Beside chance, every finding is scored
against BASELINES of the window's selection's size: recency, a random earlier segment and the hindsight oracle.

Every sample is one cell of `sweep.run_cells` (work functions `chat_cell`: one chat prompt, (a) and (b);
`placement_cell`: one document, (c); `dependence_cell`: one document and its questions, (d)), stored under
<data_dir>/cells/findings/ as it finishes, so a stopped `snapkv-lab figures --recompute` resumes where it was.
"""

from __future__ import annotations

import itertools
import json
import shlex
import sys
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from ..core.capture import capture
from ..core.figure_files import FigureSet, register
from ..core.framing import resolve_framing
from ..core.inputs import check_context_length
from ..core.models import load_tokenizer, model_source, sliding_layers
from ..core.overlap import (
    MIN_SUPPORT,
    PARTS,
    THETA,
    SinkRule,
    hindsight_oracle,
    metric_rows,
    selection_overlap,
    selection_vs_generation,
    to_mask,
)
from ..core.selection import TOP_P, select, select_from_trace, topk_count
from ..core.tokens import encode
from ..policies.snapkv import SnapKV
from .legacy import COLUMNS, RENAMED, old_keywords, upgrade_options

MODES = ("generated", "teacher-forced")
SPLITS = ("dev", "heldout")
OBS_WINDOWS = (16, 32, 64, 128)
# How each selection turns votes (heads, prefix) into kept positions, as `selection.select` options.
SELECTIONS = {"paper": dict(pooling=None, per_kv_head=False),
              "compressor": dict(pooling=SnapKV.pooling, kernel_size=SnapKV.kernel_size, per_kv_head=True)}
# What the observation window's selection is compared with, beside chance (a random set of the same size): "recency"
# (the last k prefix positions), "random segment" (the paper's selection voted by an earlier segment of the voters'
# length, placed at random: the mean of `random_segments` draws, seeded) and "oracle" (the best k positions given the
# generation's own attention: `hindsight_oracle`). Every one keeps as many positions as the window's selection.
BASELINES = dict(random_segments=4, seed=0)
BASELINE_NAMES = ("recency", "random segment", "oracle")
DEFAULTS = dict(splits=SPLITS, samples=8, placement_documents=6, dependence_documents=4, questions=3,
                obs_window=32, obs_windows=OBS_WINDOWS, prompt_segment=128, n_prompt_segments=20, gen_segment=64,
                n_gen_segments=4, qa_new_tokens=48, modes=("generated",), p=TOP_P, framing=None)


ORDER = ["layer", "head", "segment", "obs_window", "selection", "pair", "comparison", "voters", "metric", "sinks",
         *PARTS, "n_heads", "value", "chance"]


def _tidy(table: pd.DataFrame) -> pd.DataFrame:
    """Columns in one order in every findings table: keys, metric, parts, value, chance, then the rest."""
    return table[[c for c in ORDER if c in table] + [c for c in table if c not in ORDER]]


def _require(prompt_len: int, needed: int, what: str) -> None:
    if prompt_len < needed:
        raise ValueError(f"{what} needs a prompt of more than {needed} tokens, got {prompt_len}")


def _generated_attention(trace, layer: int, sink_rule: SinkRule) -> tuple[torch.Tensor, torch.Tensor]:
    """(heads, generated, prompt) attention of every generated row over the prompt, and the prompt's sinks
    (heads, prompt) from those rows: one set per prompt, whatever segment is scored later."""
    attn = trace.attention(layer, queries=trace.generated, keys=trace.prompt)
    return attn, sink_rule.mask(attn)


@old_keywords(**COLUMNS)  # prompt_windows' `window` is today's `segment`
def prompt_segments(trace, *, segment=128, n_prompt_segments=20, p=TOP_P, sink_rule=SinkRule(), sample=0,
                    baselines=False) -> pd.DataFrame:
    """(a) Each of the last `n_prompt_segments` segments of `segment` prompt tokens votes on the common prefix
    before the earliest one; in column `segment`, -1 is the last (the observation window), -2 the one before; column
    `selection` is "paper" (the paper's selection, voted by that segment). baselines=True adds rows of selection
    "recency" and "oracle" (segment empty), each of the size of segment -1's selection; the random earlier segment is
    the mean of the other segments (`findings_tables`)."""
    _require(trace.prompt_len, segment * n_prompt_segments + 1, "prompt_segments")
    rows = [row for layer in trace.layers
            for row in _segment_rows(trace, layer, *_generated_attention(trace, layer, sink_rule), segment,
                                     n_prompt_segments, p, baselines)]
    return _segment_table(rows, sample)


def prompt_windows(trace, **options) -> pd.DataFrame:
    """`prompt_segments` under its name before 2026-11-26, which took `window` and `n_windows`: warns, and returns
    prompt_segments' table."""
    warnings.warn(f"prompt_windows is now named prompt_segments (since {RENAMED})", DeprecationWarning, stacklevel=2)
    return prompt_segments(trace, **options)


def _segment_rows(trace, layer, attn, sinks, segment, n_prompt_segments, p, baselines=False) -> list[dict]:
    """(a) in one layer, from its generated rows' attention and sinks (`_generated_attention`); with `baselines`,
    recency and the oracle too, sized as the last segment's selection."""
    prefix_len = trace.prompt_len - segment * n_prompt_segments
    selections = {}
    for j in range(1, n_prompt_segments + 1):
        start = trace.prompt_len - segment * j
        selections[-j] = to_mask(select_from_trace(trace, layer, slice(start, start + segment), p,
                                                   prefix_len=prefix_len), prefix_len)
    attn, sinks = attn[..., :prefix_len], sinks[:, :prefix_len]
    scored = {**selections, "recency": recency_mask(selections[-1])} if baselines else selections
    rows = selection_vs_generation(attn, scored, sinks=sinks, layer=layer)
    return rows + (hindsight_oracle(attn, selections[-1], sinks=sinks, layer=layer) if baselines else [])


def _segment_table(rows: list[dict], sample) -> pd.DataFrame:
    """(a)'s rows -> its table: each prompt segment is a selection here, scored against all generated rows (one
    segment of them); a segment's rows get its number in `segment` and selection "paper", a baseline's an empty
    segment and its name."""
    table = pd.DataFrame(rows).drop(columns=["segment"])
    voted = table["selection"].map(lambda s: not isinstance(s, str))
    table["segment"] = pd.array(table["selection"].where(voted), dtype="Int64")
    table["selection"] = table["selection"].where(~voted, "paper")
    return _tidy(table.assign(sample=sample))


def recency_mask(reference: torch.Tensor) -> torch.Tensor:
    """(heads, prefix) bool selection -> the last prefix positions, as many per head as `reference` holds: recency,
    the selection a sliding window makes."""
    size = reference.sum(-1, keepdim=True)
    return torch.arange(reference.shape[-1], device=reference.device) >= reference.shape[-1] - size


def segment_starts(first: int, last: int, draws: int, seed: int) -> list[int]:
    """`draws` start positions, uniform on [first, last] (numpy default_rng(seed)): the random earlier segments."""
    if last < first:
        raise ValueError(f"no room for a random earlier segment: its start must lie in [{first}, {last}]")
    return np.random.default_rng(seed).integers(first, last + 1, draws).tolist()


def earlier_segment_mask(trace, layer: int, start: int, length: int, k: int, span: tuple[int, int]) -> torch.Tensor:
    """The paper's selection (top k per query head, no pooling) voted by the `length` rows from `start`, over the
    positions of `span` = (first, end) it precedes, i.e. [first, start): (heads, end - first) bool."""
    first, end = span
    votes = trace.column_sums(layer, queries=slice(start, start + length))[:, first:start]
    return to_mask(select(votes, k, pooling=None), end - first)


def random_segment_masks(trace, layer: int, length: int, k: int, span: tuple[int, int],
                         baselines: dict) -> list[torch.Tensor]:
    """`baselines["random_segments"]` selections of `earlier_segment_mask`, each voted by `length` rows placed at
    random inside `span` with at least k positions of the span before them (so that each can choose k it has
    seen); the same places in every layer of a trace (seed `baselines["seed"]`)."""
    first, end = span
    starts = segment_starts(first + k, end - length, baselines["random_segments"], baselines["seed"])
    return [earlier_segment_mask(trace, layer, start, length, k, span) for start in starts]


def _average_draws(rows: list[dict], draws, label: str) -> list[dict]:
    """Rows of the selections named in `draws` -> one row per key with their mean numerator, chance numerator and
    support (the support is each draw's own: it depends on the attention, not the selection), as selection `label`."""
    table = pd.DataFrame([row for row in rows if row["selection"] in draws])
    keys = [c for c in table if c not in (*PARTS, "value", "chance", "selection")]
    mean = table.groupby(keys, dropna=False, sort=False)[PARTS].mean().reset_index()
    defined = mean["support"] >= MIN_SUPPORT
    mean["value"] = (mean["numerator"] / mean["support"]).where(defined)
    mean["chance"] = (mean["chance_numerator"] / mean["support"]).where(defined)
    return mean.assign(selection=label).to_dict("records")


def select_mask(votes: torch.Tensor, p: float, selection: str, n_kv_heads: int) -> torch.Tensor:
    """(heads, prefix) votes -> (heads, prefix) bool selection of one of SELECTIONS; a per-KV-head set is
    repeated over the query heads that read it, so every selection is scored per query head."""
    if selection not in SELECTIONS:
        raise ValueError(f"selection must be one of {sorted(SELECTIONS)}, got {selection!r}")
    options = dict(SELECTIONS[selection])
    per_kv_head = options.pop("per_kv_head")
    kept = select(votes, p, kv_heads=n_kv_heads if per_kv_head else None, **options)
    mask = to_mask(kept, votes.shape[-1])
    return mask.repeat_interleave(votes.shape[0] // mask.shape[0], dim=0)


@old_keywords()
def generation_consistency(trace, *, obs_window=32, gen_segment=128, n_gen_segments=4, p=TOP_P, selection="paper",
                           sink_rule=SinkRule(), sample=0, baselines=None) -> pd.DataFrame:
    """(b) The observation window's top-p selection vs each segment of `gen_segment` generated tokens (column
    `segment`: 1 the first).

    obs_window and selection may be lists (several sizes, several of SELECTIONS): every combination is scored
    against the same generated rows and the same sinks; the table says which in `obs_window` and `selection`.
    Each observation window votes on the positions before it (prefix = prompt - obs_window). "coarse" rows (a
    property of the voters' attention, not of a selection) repeat for each selection.
    baselines (e.g. BASELINES: {"random_segments": 4, "seed": 0}; None: none) adds, for every window, the selections
    of BASELINE_NAMES, each of the size of the window's "paper" selection (no coarse rows for them).
    """
    obs_windows, selections = _as_list(obs_window), _as_list(selection)
    _require(trace.prompt_len, max(obs_windows) + 1, "generation_consistency")
    rows = [row for layer in trace.layers
            for row in _consistency_rows(trace, layer, *_generated_attention(trace, layer, sink_rule), obs_windows,
                                         selections, gen_segment, n_gen_segments, p,
                                         {size: baselines for size in obs_windows} if baselines else {})]
    return _tidy(pd.DataFrame(rows).assign(sample=sample))


def _as_list(value) -> list:
    return [value] if isinstance(value, (int, str)) else list(value)


def _consistency_rows(trace, layer, attn, sinks, obs_windows, selections, gen_segment, n_gen_segments, p,
                      baselines: dict | None = None) -> list[dict]:
    """(b) in one layer, from its generated rows' attention and sinks (`_generated_attention`); baselines: {window
    size: BASELINES-like settings} for the windows that get the baselines."""
    segments = {i + 1: slice(i * gen_segment, min((i + 1) * gen_segment, trace.n_generated))
                for i in range(n_gen_segments) if i * gen_segment < trace.n_generated}  # rows of the generated block
    rows = []
    for size in obs_windows:
        prefix_len = trace.prompt_len - size
        observation = slice(prefix_len, trace.prompt_len)
        votes = trace.column_sums(layer, queries=observation)[:, :prefix_len]
        observed = trace.attention(layer, queries=observation, keys=slice(0, prefix_len))
        chosen = {name: select_mask(votes, p, name, trace.n_kv_heads) for name in selections}
        settings = (baselines or {}).get(size)
        if not settings:
            rows += selection_vs_generation(attn[..., :prefix_len], chosen, sinks=sinks[:, :prefix_len],
                                            observed=observed, segments=segments, layer=layer, obs_window=size)
            continue
        reference = select_mask(votes, p, "paper", trace.n_kv_heads)  # every baseline keeps as many positions
        draws = {f"random segment {i}": mask for i, mask in enumerate(
            random_segment_masks(trace, layer, size, topk_count(p, prefix_len), (0, prefix_len), settings))}
        scored = selection_vs_generation(attn[..., :prefix_len],
                                         {**chosen, "recency": recency_mask(reference), **draws},
                                         sinks=sinks[:, :prefix_len], observed=observed, segments=segments, layer=layer,
                                         obs_window=size)
        rows += [row for row in scored if row["selection"] in chosen
                 or (row["selection"] == "recency" and row["metric"] != "coarse")]
        rows += _average_draws([row for row in scored if row["metric"] != "coarse"], draws, "random segment")
        rows += hindsight_oracle(attn[..., :prefix_len], reference, sinks=sinks[:, :prefix_len], segments=segments,
                                 layer=layer, obs_window=size)
    return rows


def question_placement(traces: dict, *, obs_window=32, p=TOP_P, sink_rule=SinkRule(), sample=0,
                       baselines=None) -> pd.DataFrame:
    """(c) {"front": trace, "back": trace} of one question and document -> the observation window's selection
    ("paper", column `selection`) against all generated tokens, per placement; baselines as in
    `generation_consistency`."""
    tables = [generation_consistency(trace, obs_window=obs_window, gen_segment=max(1, trace.n_generated),
                                     n_gen_segments=1, p=p, sink_rule=sink_rule, sample=sample,
                                     baselines=baselines).assign(placement=placement)
              for placement, trace in traces.items()]
    return pd.concat(tables, ignore_index=True).drop(columns=["obs_window"])


def document_selections(trace, document: tuple[int, int], voters_start: int, *, p=TOP_P, sink_rule=SinkRule(),
                        baselines=None) -> dict[int, dict]:
    """Per layer, top-p selections over the document span voted by the rows from `voters_start` to the end
    (question + answer): all of them, the even and the odd ones; and the document's sinks. Each (heads, doc)
    bool. A small summary of a trace for (d), so that the trace itself can be dropped.

    baselines (BASELINES-like; None: none) adds two question-free selections of the same size: "recency" (the
    document's last positions) and "random segment" (a list: `random_segment_masks` voted by as many document rows as
    there are voters)."""
    start, end = document
    voters = torch.arange(voters_start, trace.n_tokens)
    out = {}
    for layer in trace.layers:
        entry = {}
        for name, rows in (("all", voters), ("even", voters[0::2]), ("odd", voters[1::2])):
            votes = trace.column_sums(layer, queries=rows)[:, start:end]
            entry[name] = to_mask(select(votes, p, pooling=None), end - start)
        entry["sinks"] = _generated_attention(trace, layer, sink_rule)[1][:, start:end]
        if baselines:
            entry["recency"] = recency_mask(entry["all"])
            entry["random segment"] = random_segment_masks(trace, layer, len(voters), topk_count(p, end - start),
                                                           document, baselines)
        out[layer] = entry
    return out


def dependence_rows(selections: list[dict], *, sample=0, min_support=MIN_SUPPORT) -> pd.DataFrame:
    """(d) from `document_selections` of one document under several questions (same document positions).

    - different questions, all rows: H(M_A, M_B) for every ordered pair of questions (the paper's figure);
    - different questions, alternate rows: A's even rows vs B's odd rows;
    - same question, alternate rows: A's even rows vs A's odd rows, the control. Selections that did not
      depend on the question would overlap as much across questions as within one;
    - question vs recency, question vs random segment (where `document_selections` made them): H(M_A, B) of A's
      selection and a question-free one of the same size from A's own trace (a random segment: the mean over its
      draws), the share of A's selection that needs no question at all. No oracle here: the best set of A's size
      for A's own rows is A's own selection (overlap 1).
    The sink variant drops document positions that are sinks of either prompt.
    """
    pairs = [(a, b, "different questions", "all rows", "all", "all")
             for a, b in itertools.permutations(range(len(selections)), 2)]
    pairs += [(a, b, "different questions", "alternate rows", "even", "odd")
              for a, b in itertools.permutations(range(len(selections)), 2)]
    pairs += [(a, a, "same question", "alternate rows", "even", "odd") for a in range(len(selections))]
    rows = []
    for layer in selections[0]:
        for a, b, comparison, voters, side_a, side_b in pairs:
            first, second = selections[a][layer], selections[b][layer]
            for label, eligible in (("kept", None), ("excluded", ~(first["sinks"] | second["sinks"]))):
                parts = selection_overlap(first[side_a], second[side_b], eligible=eligible)
                rows += metric_rows(parts, layer=layer, pair=f"q{a}-q{b}", comparison=comparison, voters=voters,
                                    metric="overlap", sinks=label, min_support=min_support)
        for a, name in itertools.product(range(len(selections)), ("recency", "random segment")):
            entry = selections[a][layer]
            if name not in entry:
                continue
            others = entry[name] if isinstance(entry[name], list) else [entry[name]]
            for label, eligible in (("kept", None), ("excluded", ~entry["sinks"])):
                draws = [selection_overlap(entry["all"], other, eligible=eligible) for other in others]
                parts = {part: torch.stack([d[part] for d in draws]).mean(0) for part in PARTS}
                rows += metric_rows(parts, layer=layer, pair=f"q{a}-{name}", comparison=f"question vs {name}",
                                    voters="all rows", metric="overlap", sinks=label, min_support=min_support)
    return _tidy(pd.DataFrame(rows).assign(sample=sample))


def question_dependence(traces: list, document: tuple[int, int], question_starts: list[int], *, p=TOP_P,
                        sink_rule=SinkRule(), sample=0, baselines=None) -> pd.DataFrame:
    """(d) Traces of one document with different questions after it (same document positions); see
    `dependence_rows`. Each trace votes with the rows of its question and answer (question_starts[i] to the end)."""
    return dependence_rows([document_selections(t, document, q, p=p, sink_rule=sink_rule, baselines=baselines)
                            for t, q in zip(traces, question_starts)], sample=sample)


# ---- cells: one sample each ---------------------------------------------------------------------
def _sink_rule(config: dict) -> SinkRule:
    return SinkRule(**config["sink_rule"])


def _model_columns(model, config: dict) -> dict:
    return dict(split=config["split"], model=model.config.name_or_path or type(model).__name__)


def chat_cell(model, tokenizer, config: dict) -> pd.DataFrame:
    """One chat prompt: (a) and (b) (every observation window and selection) per mode; column `table` says
    which findings table a row belongs to ("a", or "b" for (b) rows of every variant)."""
    from ..tasks.prompts import chat_prompt

    prompt = chat_prompt(tokenizer, config["recipes"], split=config["split"], index=config["index"],
                         framing=config.get("framing"))
    new_tokens = config["gen_segment"] * config["n_gen_segments"]
    _require(prompt.n_tokens, max(config["prompt_segment"] * config["n_prompt_segments"], *config["obs_windows"]) + 1,
             prompt.name)
    tables = []
    for mode in config["modes"]:
        forced = encode(tokenizer, prompt.continuation)[:new_tokens] if mode == "teacher-forced" else None
        trace = capture(model, tokenizer, prompt.ids, max_new_tokens=new_tokens, continuation=forced, stop_at_eos=False)
        a, b = [], []
        for layer in trace.layers:  # one pass of the generated rows' attention per layer serves (a) and (b)
            attn, sinks = _generated_attention(trace, layer, _sink_rule(config))
            a += _segment_rows(trace, layer, attn, sinks, config["prompt_segment"], config["n_prompt_segments"],
                               config["p"], baselines=True)
            b += _consistency_rows(trace, layer, attn, sinks, config["obs_windows"], list(SELECTIONS),
                                   config["gen_segment"], config["n_gen_segments"], config["p"],
                                   {config["obs_window"]: config["baselines"]})
        tables += [_segment_table(a, prompt.name).assign(table="a", mode=mode),
                   _tidy(pd.DataFrame(b)).assign(sample=prompt.name, table="b", mode=mode)]
        del trace
    return pd.concat(tables, ignore_index=True).assign(**_model_columns(model, config))


def _qa_traces(model, tokenizer, prompts: dict, modes, new_tokens: int) -> dict[str, dict]:
    """{mode: {placement: trace}} of one question's prompts {placement: Prompt}: greedy, and teacher-forced.

    The essays come without reference answers, so the teacher-forced reference of a placement is the model's
    own greedy answer with the question at the *other* placement (with one placement, its own answer)."""
    greedy = {placement: capture(model, tokenizer, q.ids, max_new_tokens=new_tokens)
              for placement, q in prompts.items()}
    out = {"generated": greedy} if "generated" in modes else {}
    if "teacher-forced" in modes:
        other = {"front": "back", "back": "front"}
        answer = {placement: t.token_ids[t.generated] for placement, t in greedy.items()}
        out["teacher-forced"] = {placement: capture(model, tokenizer, q.ids,
                                                    continuation=answer.get(other[placement], answer[placement]))
                                 for placement, q in prompts.items()}
    return out


def placement_cell(model, tokenizer, config: dict) -> pd.DataFrame:
    """One document: (c), its question before and after it, per mode."""
    from ..tasks.prompts import qa_prompt

    prompts = {placement: qa_prompt(tokenizer, config["recipes"], config["essay"], config["question"], placement,
                                    config.get("framing"))
               for placement in ("front", "back")}
    traces = _qa_traces(model, tokenizer, prompts, config["modes"], config["new_tokens"])
    tables = [question_placement(placed, obs_window=config["obs_window"], p=config["p"], sink_rule=_sink_rule(config),
                                 sample=config["essay"], baselines=config["baselines"]).assign(
                                     mode=mode, question=config["question"])
              for mode, placed in traces.items()]
    return pd.concat(tables, ignore_index=True).assign(**_model_columns(model, config))


def dependence_cell(model, tokenizer, config: dict) -> pd.DataFrame:
    """One document and its questions: (d) per mode. Front placements are captured only for teacher forcing."""
    from ..tasks.prompts import qa_prompt

    placements = ("back", "front") if "teacher-forced" in config["modes"] else ("back",)
    summaries: dict[str, list] = {mode: [] for mode in config["modes"]}
    for question in config["questions"]:
        prompts = {placement: qa_prompt(tokenizer, config["recipes"], config["essay"], question, placement,
                                        config.get("framing"))
                   for placement in placements}
        for mode, placed in _qa_traces(model, tokenizer, prompts, config["modes"], config["new_tokens"]).items():
            back = prompts["back"]
            summaries[mode].append(document_selections(placed["back"], back.spans["document"],
                                                       back.spans["question"][0], p=config["p"],
                                                       sink_rule=_sink_rule(config), baselines=config["baselines"]))
    tables = [dependence_rows(selections, sample=config["essay"]).assign(mode=mode)
              for mode, selections in summaries.items()]
    return pd.concat(tables, ignore_index=True).assign(**_model_columns(model, config))


# ---- running everything -----------------------------------------------------------------------
def _options(options: dict) -> dict:
    options = upgrade_options(options)
    o = {**DEFAULTS, **{k: v for k, v in options.items() if v is not None and k in DEFAULTS}}
    o["modes"], o["splits"], o["obs_windows"] = tuple(o["modes"]), tuple(o["splits"]), tuple(o["obs_windows"])
    if not o["modes"] or set(o["modes"]) - set(MODES):
        raise ValueError(f"modes must be a non-empty subset of {MODES}, got {o['modes']!r}")
    if not o["splits"] or set(o["splits"]) - set(SPLITS):
        raise ValueError(f"splits must be a non-empty subset of {SPLITS}, got {o['splits']!r}")
    if o["obs_window"] not in o["obs_windows"]:
        o["obs_windows"] = tuple(sorted({*o["obs_windows"], o["obs_window"]}))
    return o


def findings_cells(options: dict, recipes: dict, model_name: str | None) -> dict[str, list]:
    """The cells of a findings run: {"ab": chat prompts, "c": documents, "d": documents}, both splits."""
    from ..sweep import Cell

    o = _options(options)
    common = dict(model=model_name, modes=list(o["modes"]), p=o["p"],
                  sink_rule=dict(first=SinkRule.first, share=SinkRule.share), theta=THETA, min_support=MIN_SUPPORT,
                  baselines=BASELINES)
    if o["framing"] is not None:  # only an override keys the cells: chosen per model, the framing is the model's
        common["framing"] = o["framing"]
    chat = dict(recipes={"seed": recipes["seed"], "chat": recipes["chat"]}, obs_windows=list(o["obs_windows"]),
                obs_window=o["obs_window"],
                prompt_segment=o["prompt_segment"], n_prompt_segments=o["n_prompt_segments"],
                gen_segment=o["gen_segment"], n_gen_segments=o["n_gen_segments"], **common)
    qa = dict(recipes={"seed": recipes["seed"], "qa": recipes["qa"]}, new_tokens=o["qa_new_tokens"], **common)
    cells: dict[str, list] = {"ab": [], "c": [], "d": []}
    n_questions = len(recipes["qa"]["questions"])
    for split in o["splits"]:
        essays = recipes["qa"][split]
        for name, count in (("placement_documents", o["placement_documents"]),
                            ("dependence_documents", o["dependence_documents"])):
            if count > len(essays):
                raise ValueError(f"{name}={count}, but the {split} split has {len(essays)} essays")
        if o["questions"] > n_questions:
            raise ValueError(f"questions={o['questions']}, but the recipes hold {n_questions}")
        cells["ab"] += [Cell("findings-ab", dict(chat, finding="ab", split=split, index=i))
                        for i in range(o["samples"])]
        # (c) rotates through the questions, one per document.
        cells["c"] += [Cell("findings-c", dict(qa, finding="c", split=split, essay=essay, question=i % n_questions,
                                               obs_window=o["obs_window"]))
                       for i, essay in enumerate(essays[:o["placement_documents"]])]
        cells["d"] += [Cell("findings-d", dict(qa, finding="d", split=split, essay=essay,
                                               questions=list(range(o["questions"]))))
                       for essay in essays[:o["dependence_documents"]]]
    return cells


WORK = {"ab": chat_cell, "c": placement_cell, "d": dependence_cell}


def findings_cell(model, tokenizer, config: dict) -> pd.DataFrame:
    """The work function of every findings cell: `config["finding"]` names which ("ab", "c" or "d", see WORK).

    The config records the metrics' constants (theta, min_support), so that changing them keys new cells; a cell
    made for other constants than this library's is refused rather than computed with the wrong ones."""
    for name, value in (("theta", THETA), ("min_support", MIN_SUPPORT)):
        if config[name] != value:
            raise ValueError(f"this cell was configured for {name}={config[name]}, but snapkv_lab.metrics uses "
                             f"{value}")
    return WORK[config["finding"]](model, tokenizer, config)


@old_keywords()  # the options of **options, as keywords: old and new name together are refused
def run_findings(model=None, tokenizer=None, *, data_dir="data", recipes_path=None, executor="local",
                 ray_address=None, cpus_per_worker=None, **options) -> dict[str, pd.DataFrame]:
    """Run every findings cell not yet stored (<data_dir>/cells/findings/) and write data/findings_{a,b,
    b_variants,c,d}.csv and data/findings_run.json (the settings and sample counts; the run's time and machine load go
    to the cells' manifest, not to a committed file).

    model: a model name for `models.load_model` (None: the bundled SmolLM2), loaded only if a cell is left to
    run; or a loaded model, with its `tokenizer`. options: see DEFAULTS (splits, samples, documents, observation
    window and segment sizes, new tokens, modes, framing). recipes_path: the prompt recipes (default
    <data_dir>/prompt_recipes.json; where missing, the packaged recipes are written there first: `folder_recipes`).
    executor / ray_address / cpus_per_worker: see `sweep.run_cells`.
    """
    from transformers import AutoConfig

    from ..sweep import ResultStore, run_cells
    from ..tasks.prompts import folder_recipes

    o = _options(options)
    data_dir = Path(data_dir)
    recipes = folder_recipes(recipes_path or data_dir / "prompt_recipes.json")
    loaded = tokenizer is not None
    name = (model.config.name_or_path or type(model).__name__) if loaded else model
    cells = findings_cells(o, recipes, name)
    if loaded:
        _check_lengths(model, tokenizer, cells)
    else:  # a framing the model cannot take (chat without a template) is refused before any model loads
        resolve_framing(load_tokenizer(model), o["framing"])
    store = ResultStore(data_dir / "cells" / "findings")
    manifest = dict(command=shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]),
                    options={k: str(v) for k, v in o.items()}, model=name, seeds=[recipes["seed"]])
    everything = [cell for cell_list in cells.values() for cell in cell_list]
    run_cells(everything, findings_cell, store, model=None if loaded else model, executor=executor,
              ray_address=ray_address, cpus_per_worker=cpus_per_worker, desc="findings cells", manifest=manifest,
              loader=(lambda _: (model, tokenizer)) if loaded else None)
    out = findings_tables({key: store.table(cell_list) for key, cell_list in cells.items()}, o["obs_window"])
    data_dir.mkdir(parents=True, exist_ok=True)
    for key, table in out.items():
        table.to_csv(data_dir / f"findings_{key}.csv", index=False, float_format="%.7g")
    counts = {key: {split: int(t.loc[t["split"] == split, "sample"].nunique()) for split in o["splits"]}
              for key, t in out.items()}
    config = model.config if loaded else AutoConfig.from_pretrained(model_source(model))
    run = {**{k: list(v) if isinstance(v, tuple) else v for k, v in o.items()}, "model": str(out["a"]["model"].iloc[0]),
           # the report gives verdicts for sliding-window and global layers apart (findings_report.verdicts)
           "sliding_layers": sliding_layers(config),
           "sliding_window": getattr(config.get_text_config(), "sliding_window", None),
           "samples_per_table": counts, "cells": len(everything)}
    (data_dir / "findings_run.json").write_text(json.dumps(run, indent=1) + "\n")
    return out


def _check_lengths(model, tokenizer, cells: dict) -> None:
    """Every chat prompt fits the model with its new tokens, checked before the first capture."""
    from ..tasks.prompts import chat_prompt

    for cell in cells["ab"]:
        c = cell.config
        prompt = chat_prompt(tokenizer, c["recipes"], split=c["split"], index=c["index"], framing=c.get("framing"))
        new = c["gen_segment"] * c["n_gen_segments"]
        check_context_length(model, prompt.n_tokens + new, what=f"prompt {prompt.name} with {new} new tokens")


def pool_heads(table: pd.DataFrame) -> pd.DataFrame:
    """Sum numerator, chance numerator and support over heads (exact); value and chance recomputed, NaN
    below MIN_SUPPORT. A cell's `n_heads` says how many heads it pools."""
    keys = [c for c in table.columns if c not in (*PARTS, "value", "chance", "head")]
    pooled = table.groupby(keys, dropna=False, sort=False)[PARTS].sum()
    pooled["n_heads"] = table.groupby(keys, dropna=False, sort=False).size()
    defined = pooled["support"] >= MIN_SUPPORT
    pooled["value"] = (pooled["numerator"] / pooled["support"]).where(defined)
    pooled["chance"] = (pooled["chance_numerator"] / pooled["support"]).where(defined)
    return _tidy(pooled.reset_index())


def findings_tables(raw: dict[str, pd.DataFrame], obs_window: int) -> dict[str, pd.DataFrame]:
    """The cells' tables {"ab", "c", "d"} (any of them) -> the committed ones, each with its baselines
    (BASELINE_NAMES, in column `selection`, or `comparison` for (d)): (a) pooled over heads, its random earlier
    segment the mean of the segments before the last (`random_segment_rows`); (b) per head in the paper's setting
    (observation window `obs_window`, "paper" selection); the (b) variants, with (b)'s baselines, (c) and (d) pooled
    over heads."""
    out = {}
    if "ab" in raw:
        ab = raw["ab"]
        a = pool_heads(ab[ab["table"] == "a"].drop(columns=["table", "obs_window"]).astype({"segment": "Int64"}))
        b = ab[ab["table"] == "b"].drop(columns=["table"]).astype({"segment": int, "obs_window": int})
        paper = (b["obs_window"] == obs_window) & (b["selection"] == "paper")
        out["a"] = _tidy(pd.concat([a, random_segment_rows(a)], ignore_index=True))
        out["b"] = b[paper].drop(columns=["obs_window", "selection"]).reset_index(drop=True)
        out["b_variants"] = pool_heads(b[b["metric"] != "coarse"])
    if "c" in raw:
        out["c"] = pool_heads(raw["c"])
    if "d" in raw:
        out["d"] = pool_heads(raw["d"])
    return out


def random_segment_rows(a: pd.DataFrame) -> pd.DataFrame:
    """(a)'s random earlier segment: per sample and key, the mean numerators and support of every segment but the last
    (the expected score of one of them drawn at random), as selection "random segment" with an empty segment."""
    others = a[(a["selection"] == "paper") & (a["segment"] != -1)]
    keys = [c for c in a if c not in (*PARTS, "value", "chance", "segment", "n_heads")]
    mean = others.groupby(keys, dropna=False, sort=False).agg({**{part: "mean" for part in PARTS}, "n_heads": "first"})
    defined = mean["support"] >= MIN_SUPPORT
    mean["value"] = (mean["numerator"] / mean["support"]).where(defined)
    mean["chance"] = (mean["chance_numerator"] / mean["support"]).where(defined)
    return mean.reset_index().assign(selection="random segment", segment=pd.NA).astype({"segment": "Int64"})


def _recompute(options: dict) -> None:
    from ..sweep import import_ray

    options = upgrade_options(options)  # make_figures' options, written by a caller before the rename
    if options.get("executor") == "ray":
        import_ray()  # a missing Ray is said before any model loads
    split = options.get("split")
    run_findings(options.get("model"), data_dir=options["data_dir"], recipes_path=options.get("recipes_path"),
                 executor=options.get("executor") or "local", framing=options.get("framing"),
                 ray_address=options.get("ray_address"), cpus_per_worker=options.get("cpus_per_worker"),
                 samples=options.get("samples"), obs_window=options.get("obs_window"),
                 prompt_segment=options.get("prompt_segment"), gen_segment=options.get("gen_segment"),
                 splits=None if split in (None, "both") else (split,))


def draw(data_dir, figures_dir) -> list[Path]:
    from .findings_plots import draw_findings

    return draw_findings(data_dir, figures_dir)


register(FigureSet(name="findings", recompute=_recompute, draw=draw))
