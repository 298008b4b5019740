"""The pressure figure set: the needle grid and the lines ablation (`snapkv-lab needle`, `figures`)."""

from __future__ import annotations

import dataclasses
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from ..core.checks import check_names
from ..policies import (
    CAKE,
    CAM,
    CUR,
    DMS,
    KIVI,
    RKV,
    TOVA,
    AdaKV,
    Cap,
    Compactor,
    DuoAttention,
    EntropyGatedChunkKV,
    FastKVzip,
    Finch,
    HeadKV,
    KeyDiff,
    KVCompose,
    KVgrad,
    KVzap,
    KVzip,
    LagKV,
    LeverageScore,
    LookaheadQCache,
    Merging,
    NonCausalAttn,
    ObservedAttention,
    PyramidKV,
    QFilters,
    SimLayerKV,
    SnapKV,
    SnapKVFactKernel,
    SnapKVNoPooling,
    StreamingLLM,
    Surprisal,
    ThinK,
    expand_policies,
    parse_policy,
    policy_config,
    policy_from_config,
)
from ..tasks.haystacks import HAYSTACKS
from ..tasks.needles import lines_context, needle_context
from ..tasks.ruler_needles import TASKS, VALUE_KINDS, ruler_context
from .ablations import (
    ABLATION_CAPACITY,
    ABLATION_LENGTH,
    ABLATION_SAMPLES,
    ANSWER_TOKENS,
    ablation_policies,
    coverage_describer,
)
from .runner import CAPACITIES, DEFAULT_POLICIES, MODES, run_retrieval

NEEDLE_LENGTHS = (2000, 4000, 7500)
NEEDLE_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
NEEDLE_SAMPLES = 3  # haystacks per (length, depth): the committed grid
LINES_SAMPLES = 1
WINDOW_ABLATION = (16, 32, 64, 128)  # SnapKV observation windows at a 25% budget of the 4000-token needles
RULER_LENGTH = 4000
RULER_POLICIES = (SnapKV(), AdaKV(), PyramidKV(), TOVA(), StreamingLLM())
RULER_CAPACITY = 1024  # 25% of the RULER contexts
QUESTION_FREE_POLICIES = (KVzip(), AdaKV(policy=KVzip(allocation="uniform")), KVzip(pooling="max", kernel_size=3),
                          KVzip(pooling="max", kernel_size=31), SnapKVFactKernel())
HAYSTACK_POLICIES = (SnapKV(), SnapKVFactKernel(), Surprisal())
# The methods the field compares next (head and layer budgets, attention-free scorers, decoding-time eviction, drafted
# voters), their authors' defaults, beside SnapKV; and two named variants: HeadKV holding its labelled budget, LAQ++.
METHOD_POLICIES = (SnapKV(), HeadKV(), DuoAttention(), CAKE(), RKV(), KeyDiff(), QFilters(), LagKV(), LookaheadQCache(),
                   HeadKV(redistribute=True), LookaheadQCache(window_size=8))
# kvpress 0.5.5's presses that the lab added for issue 54 (scorers, trained scorers, layer/threshold policies, and the
# axes beyond eviction: merging, key channels, quantization), each at its authors' defaults, beside SnapKV. The
# wrappers that only re-apply a scorer (PerLayer, PerChunk, Blockwise, Composed, KeyRerotation) are left out; KVzap
# runs the linear model, the one shipped for both bundled models (kvpress's default is the MLP); FastKVzip the gates
# shipped for both (scripts/train_kvzap.py --method fastkvzip).
PRESS_POLICIES = (SnapKV(), LeverageScore(), NonCausalAttn(), Compactor(), CUR(), Cap(), ObservedAttention(), Finch(),
                  EntropyGatedChunkKV(), KVgrad(), KVCompose(), KVzap(model_type="linear"), FastKVzip(), SimLayerKV(),
                  DMS(), Merging(), ThinK(), KIVI(), CAM())
MAX_NEW_TOKENS = 24  # answers such as codes need 24-32 new tokens
# A context spec names its builder and that builder's arguments (JSON-able, so that it keys a cell).
CONTEXTS = {"needle": needle_context, "lines": lines_context, "ruler": ruler_context}
# run_retrieval's describe hooks by name, each built per model: (model, tokenizer) -> describe(...) -> extra columns.
DESCRIBERS = {"coverage": coverage_describer}


def _samples(options: dict, default: int) -> range:
    """Sample indices (each seeds a context's needles and haystack start); first_sample runs a grid in pieces."""
    first = options.get("first_sample") or 0
    return range(first, first + (options.get("samples") or default))


def needle_specs(options: dict) -> list[dict]:
    return [dict(builder="needle", n_tokens=int(n), depth=float(d), sample=s)
            for n in options.get("lengths") or NEEDLE_LENGTHS
            for d in options.get("depths") or NEEDLE_DEPTHS for s in _samples(options, NEEDLE_SAMPLES)]


def lines_specs(options: dict) -> list[dict]:
    first = options.get("first_sample") or 0
    return [dict(builder="lines", n_tokens=int(n), n_queries=options.get("line_queries") or 8, sample=s)
            for n in options.get("lines_lengths") or (2000,) for s in range(first, first + LINES_SAMPLES)]


def window_specs(options: dict) -> list[dict]:
    return [dict(builder="needle", n_tokens=4000, depth=d, sample=s)
            for d in NEEDLE_DEPTHS for s in _samples(options, 1)]


def _budget_needles(options: dict, samples: int) -> list[dict]:
    """The needles of the 25%-budget suites: ABLATION_LENGTH tokens, every depth, `samples` haystacks by default."""
    return [dict(builder="needle", n_tokens=ABLATION_LENGTH, depth=d, sample=s) for s in _samples(options, samples)
            for d in NEEDLE_DEPTHS]


def ablation_specs(options: dict) -> list[dict]:
    return _budget_needles(options, ABLATION_SAMPLES)


def dev_needle_specs(options: dict) -> list[dict]:
    """All 15 dev needles of the grid at ABLATION_LENGTH (NEEDLE_SAMPLES haystacks x 5 depths)."""
    return _budget_needles(options, NEEDLE_SAMPLES)


def haystack_specs(options: dict) -> list[dict]:
    """A needle in every kind of haystack (pressure.haystacks), ABLATION_LENGTH tokens, every depth (or --depths),
    1 sample (or --samples)."""
    return [dict(builder="needle", n_tokens=ABLATION_LENGTH, depth=float(d), sample=s, haystack=h) for h in HAYSTACKS
            for s in _samples(options, 1) for d in options.get("depths") or NEEDLE_DEPTHS]


def ruler_specs(options: dict) -> list[dict]:
    return [dict(builder="ruler", n_tokens=RULER_LENGTH, task=task, value_kind=kind, sample=s) for task in TASKS
            for kind in VALUE_KINDS for s in _samples(options, 1)]


@dataclass(frozen=True)
class Suite:
    """One table of the pressure set: its contexts (options -> context specs) and what runs on each. policies,
    capacities, modes: None takes the grid's options (--policies, --capacities, --modes), else the runner's
    defaults; a suite that ablates one of them fixes it. describe: a DESCRIBERS name, extra columns for every run.
    max_new_tokens: per answer."""

    table: str
    contexts: Callable[[dict], list[dict]]
    policies: tuple | None = None
    capacities: tuple | None = None
    modes: tuple | None = None
    describe: str | None = None
    max_new_tokens: int = MAX_NEW_TOKENS


# One row per suite, run in this order by `snapkv-lab needle --suites ...` (default all).
SUITES = {
    "needle": Suite("pressure_needle.csv", needle_specs),
    "lines": Suite("pressure_lines.csv", lines_specs, (SnapKV(), SnapKVNoPooling()), (256, 512, 1024),
                   ("query-aware",)),
    "windows": Suite("pressure_windows.csv", window_specs, tuple(SnapKV(window_size=w) for w in WINDOW_ABLATION),
                     (1024,)),
    "ablations": Suite("pressure_ablations.csv", ablation_specs, tuple(ablation_policies()), (ABLATION_CAPACITY,),
                       describe="coverage", max_new_tokens=ANSWER_TOKENS),
    # The ablations' best query-aware setting (a kernel as long as a fact) on all 15 dev needles of the grid's 4000.
    "fact-kernel": Suite("pressure_fact_kernel.csv", dev_needle_specs, (SnapKV(kernel_size=31),), (ABLATION_CAPACITY,),
                         ("query-aware",), max_new_tokens=ANSWER_TOKENS),
    # Without the question SnapKV's window does not look at the needle: scorers that need no question (KVzip's
    # reconstruction, its budgets per layer and head by AdaKV, pooled) and the fact kernel, on the same 15 needles.
    "question-free": Suite("pressure_question_free.csv", dev_needle_specs, QUESTION_FREE_POLICIES, (ABLATION_CAPACITY,),
                           ("query-agnostic",), max_new_tokens=ANSWER_TOKENS),
    # The model's own surprisal, pooled over a fact: a question-free scorer that is not attention (policies.surprisal).
    "surprisal": Suite("pressure_surprisal.csv", dev_needle_specs, (Surprisal(),), (ABLATION_CAPACITY,),
                       max_new_tokens=ANSWER_TOKENS),
    "ruler": Suite("pressure_ruler.csv", ruler_specs, RULER_POLICIES, (RULER_CAPACITY,)),
    # The small-budget policies beyond essays: code, logs where every line holds ids, and a list of keys whose
    # distractors look like the fact (pressure.haystacks), beside the essays; both modes.
    "haystacks": Suite("pressure_haystacks.csv", haystack_specs, HAYSTACK_POLICIES, (ABLATION_CAPACITY,),
                       max_new_tokens=ANSWER_TOKENS),
    # Surprisal where values are words and codes, with distractor keys: facts less out of place than a magic number.
    "surprisal-ruler": Suite("pressure_surprisal_ruler.csv", ruler_specs, (Surprisal(),), (RULER_CAPACITY,)),
    # The newer methods on the 15 dev needles at 25%, both modes, with the ablations' coverage columns.
    "methods": Suite("pressure_methods.csv", dev_needle_specs, METHOD_POLICIES, (ABLATION_CAPACITY,),
                     describe="coverage", max_new_tokens=ANSWER_TOKENS),
    # kvpress's other presses on the same 15 dev needles at 25% (no coverage columns: their cost), both modes: the
    # whole-prompt scorers (NonCausalAttn, Compactor) query-aware from the context and question fed again in one call
    # (SharedPrefill.serving).
    "presses": Suite("pressure_presses.csv", dev_needle_specs, PRESS_POLICIES, (ABLATION_CAPACITY,), MODES,
                     max_new_tokens=ANSWER_TOKENS),
}


def build_context(tokenizer, spec: dict):
    """The Context a spec describes: CONTEXTS[spec["builder"]](tokenizer, **the other entries)."""
    arguments = dict(spec)
    return CONTEXTS[arguments.pop("builder")](tokenizer, **arguments)


def run_context(model, tokenizer, config: dict) -> pd.DataFrame:
    """One cell of the grid: build the context, prefill it once and answer its questions with the full cache and
    every policy x capacity x mode of `config` (runner.run_retrieval), with its describe hook's columns if any.
    Rows as run_retrieval's."""
    context = build_context(tokenizer, config["context"])
    describe = DESCRIBERS[config["describe"]](model, tokenizer) if config["describe"] else None
    table = run_retrieval(model, tokenizer, [context], policies=[policy_from_config(p) for p in config["policies"]],
                          capacities=config["capacities"], modes=config["modes"],
                          max_new_tokens=config["max_new_tokens"], progress=False, describe=describe)
    # One type per column, so that the table reads back from the store as written: capacity is empty for the full
    # cache (shares of the prompt, as a scorer x allocation study gives them, stay floats), and RULER's multivalue
    # answers are lists, written as CSV writes them.
    shares = any(isinstance(capacity, float) for capacity in config["capacities"])
    return table.assign(capacity=table.capacity.astype("Float64" if shares else "Int64"),
                        expected=table.expected.map(str))


def grid_cells(options: dict) -> dict[str, list]:
    """The cells of each suite in options["suites"] (default all, less "lines" with skip_lines), in run order.

    A cell is one context with all its policies, capacities and modes, keyed by the model, the context's spec,
    every policy field, the capacities, modes and max_new_tokens. Bad options are refused here, before any run.
    """
    from ..sweep import Cell

    names = list(options.get("suites") or SUITES)
    check_names(names, list(SUITES), "suites")
    names = [name for name in names if not (name == "lines" and options.get("skip_lines"))]
    named = [parse_policy(text) for text in expand_policies(options.get("policies") or ())]
    if any(type(policy).__name__ == "FullCache" for policy in named):  # DMS may run without a capacity
        raise ValueError("--policies takes compression policies: the full cache runs in every grid as the baseline")
    modes = tuple(options.get("modes") or ())
    if set(modes) - set(MODES):
        raise ValueError(f"modes must be among {MODES}, got {list(modes)}")
    cells = {}
    for name in names:
        suite = SUITES[name]
        policies = suite.policies or tuple(named) or DEFAULT_POLICIES
        capacities = [int(c) for c in suite.capacities or options.get("capacities") or CAPACITIES]
        for policy in policies:  # a window at or above a budget fails here, not an hour into the grid
            for capacity in capacities:
                dataclasses.replace(policy, capacity=capacity)
        config = dict(model=options.get("model"), policies=[policy_config(p) for p in policies], capacities=capacities,
                      modes=list(suite.modes or modes or MODES), max_new_tokens=suite.max_new_tokens,
                      describe=suite.describe)
        # Only an override keys the cells: chosen per model (framing.prompt_frame), the framing is the model's.
        framing = {"framing": options["framing"]} if options.get("framing") else {}
        cells[name] = [Cell("pressure", dict(config, context={**spec, **framing})) for spec in suite.contexts(options)]
    return cells


def _check_before_running(model_name, by_suite: dict[str, list]) -> None:
    """Refuse bad grids before the first prefill: the shortest context of each suite is built here (chat framing asked
    of a tokenizer without a chat template, or a length with no room for the haystack, fails now), and the longest must
    fit the model with its new tokens (each builder's n_tokens holds its questions). Skipped when the model cannot
    be read here (a Ray head node without it): the cells check the same things where they run."""
    from transformers import AutoConfig, AutoTokenizer

    from ..core.inputs import check_context_length
    from ..core.models import model_source

    try:
        source = model_source(model_name)
        config, tokenizer = AutoConfig.from_pretrained(source), AutoTokenizer.from_pretrained(source)
    except OSError:
        return
    specs = [[cell.config["context"] for cell in cells] for cells in by_suite.values() if cells]
    for suite_specs in specs:
        build_context(tokenizer, min(suite_specs, key=lambda spec: spec["n_tokens"]))
    longest = max(spec["n_tokens"] for suite_specs in specs for spec in suite_specs)
    check_context_length(config, longest + MAX_NEW_TOKENS,
                         what=f"a {longest}-token context with {MAX_NEW_TOKENS} new tokens")


def recompute(options: dict) -> None:
    """Run the suites in options["suites"] (default all: see SUITES) as cells stored in <data_dir>/cells/pressure/,
    skipping the cells already there, then write each suite's table (data/pressure_needle.csv, ...).

    options: data_dir, model, framing (None: the model's own, see framing.prompt_frame), suites, skip_lines, lengths,
    depths, samples, first_sample, lines_lengths, line_queries, policies (names from snapkv_lab.POLICIES), capacities,
    modes, executor ("local" or "ray") and ray_address (see sweep.run_cells).
    """
    from ..sweep import ResultStore, run_cells

    data_dir = Path(options.get("data_dir", "data"))
    by_suite = grid_cells(options)
    cells = [cell for suite_cells in by_suite.values() for cell in suite_cells]
    if not cells:
        return
    _check_before_running(options.get("model"), by_suite)
    store = ResultStore(data_dir / "cells" / "pressure")
    manifest = dict(command=shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]), model=options.get("model"),
                    options=options,
                    seeds=sorted({cell.config["context"]["sample"] for cell in cells}))
    run_cells(cells, run_context, store, model=options.get("model"), executor=options.get("executor") or "local",
              ray_address=options.get("ray_address"), cpus_per_worker=options.get("cpus_per_worker"),
              desc="pressure cells", manifest=manifest)
    for name, suite_cells in by_suite.items():
        store.table(suite_cells).to_csv(data_dir / SUITES[name].table, index=False)
