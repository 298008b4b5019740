"""`evaluate`: the field's benchmarks through the lab's policies, one resumable cell per example.

    table = evaluate("SmolLM2-135M-Instruct", datasets=["ruler"], tasks=["niah_single_1"], limit=2,
                     policies=["SnapKV", "AdaKV(ExpectedAttention)"], ratios=[0.25, 0.5, 0.75])

Each example is a cell of snapkv_lab.sweep: its context is prefilled once with the full cache while every policy
records its scores, then the full cache and every policy x budget x mode answer each of its questions
(compression.generation.answer_runs). A rerun skips the stored cells; `executor="ray"` spreads them over a cluster.

Each benchmark runs as its official script runs it (evaluation.examples; docs/benchmarks.md, "As the official
scripts"); where the lab also offers its former way, a protocol option names it (PROTOCOL: RULER's sizing and
cwe_shots, LongBench's truncation and predictions; `framing="chat"` for LongBench's former chat template), and each
example's spec records the values of the options its benchmark has.

Budgets are kvpress's compression ratios (the fraction of the compressed prompt's KV pairs removed: 0.25 keeps
75%), or capacities in tokens per KV head. A ratio r runs a policy at capacity 1 - r (Policy.capacity as a share).
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from ..compression import SharedPrefill
from ..compression.generation import MODES, answer_runs
from ..core.checks import check_datasets_and_tasks
from ..core.inputs import check_context_length, eos_ids
from ..core.progress import progress_bar
from ..policies import expand_policies, parse_policy, policy_config, policy_from_config, upgrade_config
from .answer_rows import example_row, prediction, stop_ids
from .examples import Example
from .longbench import max_length
from .multiturn import COMPRESS, FEEDS, check_multi_turn, run_conversations
from .prompting import encode_example

RATIOS = (0.25, 0.5, 0.75)
CELL_KIND = "eval"
# The protocol options, each with its values, the official script's first (the default); a benchmark takes those in
# its `options`, and its specs record them.
PROTOCOL = {"sizing": ("official", "fill"), "cwe_shots": ("turn", "inline"), "truncation": ("official", "context"),
            "predictions": ("official", "strip")}


def _registry() -> dict:
    """evaluation.registry.DATASETS, imported when first needed (its modules are many)."""
    from .registry import DATASETS

    return DATASETS


def _check_names(datasets, tasks=None) -> None:
    """Refuse an unknown dataset, or a task none of `datasets` has, with the closest names (core.checks)."""
    check_datasets_and_tasks(datasets, tasks, {name: benchmark.tasks for name, benchmark in _registry().items()})


def _benchmark(name: str):
    """The registered benchmark of that name, or a clear error."""
    _check_names([name])
    return _registry()[name]


def budgets(ratios=None, capacities=None) -> list[dict]:
    """[{"ratio": r} ...] or [{"capacity": c} ...]: one of the two, checked (a ratio in (0, 1), a capacity >= 1)."""
    if (ratios is None) == (capacities is None):
        raise ValueError("give compression ratios (--ratios) or capacities in tokens (--capacities), not both")
    if ratios is not None:
        bad = [r for r in ratios if not 0 < float(r) < 1]
        if bad:
            raise ValueError(f"a compression ratio is the share of KV pairs removed, in (0, 1); got {bad}")
        return [{"ratio": float(r)} for r in ratios]
    bad = [c for c in capacities if int(c) != c or c < 1]
    if bad:
        raise ValueError(f"capacities are positive token counts, got {bad}")
    return [{"capacity": int(c)} for c in capacities]


def _capacity(budget: dict) -> int | float:
    # round: 1 - 0.7 is 0.30000000000000004, a label nobody wrote
    return budget["capacity"] if "capacity" in budget else round(1 - budget["ratio"], 10)


def eval_cells(model: str | None, datasets: list[str], tasks=None, policies=("SnapKV",), ratios=None,
               capacities=None, modes=MODES, limit: int | None = None, max_context: int | None = None,
               lengths=(), seed: int = 0, source: str | None = None, framing: str | None = None,
               protocol: dict | None = None, multi_turn: dict | None = None) -> list:
    """The cells of a run, one per example, in order (dataset, task, example). Bad options fail here, before any run.

    protocol: {option: value} of PROTOCOL (the official value where not given); each benchmark's specs take the
    options it has.

    tasks: the benchmarks' own task names (None: each dataset's default tasks; a name no dataset has is refused).
    policies: Policy objects or their written form ("SnapKV", "AdaKV(ExpectedAttention)", see policies.parse_policy);
    "all" stands for every registered compressor (policies.expand_policies).
    multi_turn: {"feeds": [...], "compress": [...]} for SCBench's multi-turn mode (evaluation.multiturn), None for
    the same-context mode; only a multi-turn cell's config holds it, so earlier runs' cells keep their identity.
    """
    from ..sweep import Cell

    if multi_turn is not None:
        check_multi_turn(datasets, tasks, multi_turn.get("feeds"), multi_turn.get("compress"), framing)
        multi_turn = dict(feeds=list(multi_turn["feeds"]), compress=list(multi_turn["compress"]))
    named = [parse_policy(p) if isinstance(p, str) else p for p in expand_policies(policies)]
    if not named or any(type(policy).__name__ == "FullCache" for policy in named):  # DMS may run without capacity
        raise ValueError("policies takes compression policies: the full cache runs in every example as the baseline")
    labels = [policy.scorer_label for policy in named]
    if len(set(labels)) < len(labels):
        raise ValueError(f"two policies share a label (the same settings): {labels}")
    steps = budgets(ratios, capacities)
    for policy in named:  # a window at or above a budget in tokens fails now
        for budget in steps:
            dataclasses.replace(policy, capacity=_capacity(budget))
    if not modes or set(modes) - set(MODES):
        raise ValueError(f"modes must be among {MODES}, got {list(modes)}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be a positive number of examples per task, got {limit}")
    _check_names(datasets, tasks)
    protocol = check_protocol(protocol)
    benchmarks = [_registry()[name] for name in datasets]
    config = dict(model=model, policies=[policy_config(p) for p in named], budgets=steps, modes=list(modes),
                  max_context=max_context, framing=framing) | ({} if multi_turn is None else {"multi_turn": multi_turn})
    cells = []
    for benchmark in benchmarks:
        chosen = [t for t in benchmark.tasks if t in tasks] if tasks else list(benchmark.default_tasks)
        for task in chosen:
            options = {name: value for name, value in protocol.items() if name in getattr(benchmark, "options", {})}
            for spec in benchmark.specs(task, limit=limit, lengths=tuple(lengths), seed=seed, source=source,
                                        **options):
                cells.append(Cell(CELL_KIND, dict(config, example=spec)))
    return cells


def check_protocol(protocol: dict | None) -> dict:
    """Every PROTOCOL option's value: the given one (checked), else the official one."""
    protocol = dict(protocol or {})
    unknown = set(protocol) - set(PROTOCOL)
    if unknown:
        raise ValueError(f"unknown protocol option {', '.join(sorted(unknown))}: the options are {', '.join(PROTOCOL)}")
    for name, value in protocol.items():
        if value not in PROTOCOL[name]:
            raise ValueError(f"{name} must be one of {PROTOCOL[name]} (the first is the official script's), "
                             f"got {value!r}")
    return {name: protocol.get(name, values[0]) for name, values in PROTOCOL.items()}


def default_max_context(model, example: Example) -> int | None:
    """The cut an example gets when the run names none: LongBench's max_length (the window less about 500) for a
    prompt cut as pred.py cuts it, else the model's window less the answer's tokens (None: a model without a limit)."""
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if limit is None:
        return None
    return max_length(limit) if example.truncation == "prompt" else limit - example.max_new_tokens


def prepared_example(model, tokenizer, config: dict):
    """(example, its encoded ids, {policy label: budget}, the policies at every budget) of a cell's config, the
    context checked to fit the model with the longest question and the answer's tokens."""
    example = _benchmark(config["example"]["dataset"]).example(config["example"], tokenizer)
    max_context = config["max_context"] or default_max_context(model, example)
    encoded = encode_example(tokenizer, example, framing=config["framing"], max_context=max_context)
    longest = max(len(q) for q in encoded.questions)
    check_context_length(model, len(encoded.context_ids) + longest + example.max_new_tokens,
                         what=f"{example.dataset}/{example.task} #{example.id} with {example.max_new_tokens} "
                              "new tokens")
    budget_of, policies = {}, []
    for entry in config["policies"]:
        for budget in config["budgets"]:
            policy = dataclasses.replace(policy_from_config(entry), capacity=_capacity(budget))
            budget_of[policy.label] = budget
            policies.append(policy)
    return example, encoded, budget_of, policies


def run_example(model, tokenizer, config: dict) -> pd.DataFrame:
    """One cell: build the example, prefill its context once, answer every question with the full cache and every
    policy x budget x mode, and score each answer with the task's metric. One row per answer (module doc). A
    multi-turn cell (config["multi_turn"]) runs its conversations instead (multiturn.run_conversations)."""
    prepared = prepared_example(model, tokenizer, config)
    if "multi_turn" in config:
        return run_conversations(model, tokenizer, config, prepared)
    example, encoded, budget_of, policies = prepared
    as_ids = lambda ids: torch.tensor([ids], device=model.device)  # noqa: E731
    shared = SharedPrefill.run(model, tokenizer, as_ids(encoded.context_ids), policies)
    rows = []
    stops = stop_ids(tokenizer, example)
    runs = answer_runs(model, tokenizer, shared, [as_ids(q) for q in encoded.questions], policies, config["modes"],
                       example.max_new_tokens, end_ids=stops, min_new_tokens=1 if stops else 0)
    ends = (*eos_ids(model, tokenizer), *stops)
    answers = len(encoded.questions) * (1 + len(policies) * len(config["modes"]))
    # A cell is stored whole, and one at 8k takes most of an hour here: its answers get a bar of their own (transient,
    # quiet in log files).
    for run in progress_bar(runs, desc=f"{example.task} #{example.id} answers", total=answers, leave=False):
        budget = {"ratio": 0.0} if run.mode == "full" else budget_of[run.policy.label]
        rows.append(example_row(model, example, config, run, budget, prediction(tokenizer, example, run, ends),
                                len(encoded.context_ids), encoded.truncated, encoded.framing, shared.seconds))
    table = pd.DataFrame(rows)
    # One type per column, so that the table reads back from the store as written.
    return table.astype({"ratio": "Float64", "capacity": "Int64", "length": "Int64"})


def evaluate(model: str | None = None, *, datasets=("ruler",), tasks=None, policies=("SnapKV",), ratios=None,
             capacities=None, modes=MODES, limit: int | None = None, max_context: int | None = None, lengths=(),
             seed: int = 0, source: str | None = None, framing: str | None = None, data_dir="data",
             name: str | None = None, executor: str = "local", ray_address: str | None = None,
             cpus_per_worker: int | None = None, write: bool = True, reuse=None, sizing: str = "official",
             cwe_shots: str = "turn", truncation: str = "official", predictions: str = "official",
             multi_turn: bool = False, feeds=FEEDS, compress=COMPRESS) -> pd.DataFrame:
    """Run benchmarks through policies; returns the tidy table, also written to <data_dir>/eval_<name>.csv unless
    write=False.

    model: a bundled name, hub id or folder (None: the default bundled model); datasets and tasks by name
    (evaluation.DATASETS); ratios (default 0.25 0.5 0.75 unless capacities are given) or capacities; modes; limit:
    the first N examples per task (and length); max_context: tokens of context + question, the context cut from
    its middle (None: the model's own limit less the answer's tokens); lengths and seed: of generated sets (RULER);
    source: a local folder of a Hub set's rows (JSONL per task) instead of the Hub; framing: None (each benchmark's
    own: evaluation.prompting), "chat" or "plain"; sizing, cwe_shots (RULER), truncation, predictions (LongBench):
    the protocol options (PROTOCOL; the official script's way by default, the lab's former way by name); name: the
    table's name
    (default the datasets joined by "+"). Cells are stored in <data_dir>/cells/eval/. reuse: an earlier table
    of this run's kind (a path or a DataFrame, e.g. a committed eval_ruler.csv), or a list of them: the cells they
    answer whole together are stored from their rows instead of being run (reuse_rows), so a fresh clone grows a
    committed run by its new examples only, and runs of the same examples at different ratios join into one.
    executor, ray_address, cpus_per_worker: see sweep.run_cells. multi_turn: SCBench's multi-turn mode
    (evaluation.multiturn), under each of `feeds` ("model", "gold") and `compress` ("once", "every-turn"); its rows add
    the columns feed, compress ("none" for the full cache), turn (1, 2, ...) and recompressed.

    Columns: model, dataset, task, example, spec and policy_config (JSON: what rebuilds the example and the policy,
    see evaluation.explain), question, metric, policy, ratio (0 for the full cache), capacity,
    mode ("full", "query-aware", "query-agnostic"), score (in [0, 1]), prediction, references (JSON),
    context_tokens, prompt_tokens, kept_tokens (the longest layer's positions per head before decoding: the budget
    where every layer and head keeps as many, more where they differ: PyramidKV, CAKE, AdaKV, HeadKV, DuoAttention),
    kv_entries (the KV entries held after the prompt's compression, summed over layers and KV heads: what two policies
    at one ratio must match), kv_share (of the uncompressed cache's entries on the same prompt), budget_share (the
    nominal budget's share), over_budget (more entries held than the budget allows beyond one per compressed head:
    compression.entries), truncated_tokens, framing, length, prefill_s, selection_s, decode_ms_per_token, new_tokens;
    and in the cell store alone, layer_kv_share (JSON: each layer's share).
    """
    if ratios is None and capacities is None:
        ratios = RATIOS
    datasets = [datasets] if isinstance(datasets, str) else list(datasets)
    policies = expand_policies(policies)
    protocol = dict(sizing=sizing, cwe_shots=cwe_shots, truncation=truncation, predictions=predictions)
    turns = dict(feeds=list(feeds), compress=list(compress)) if multi_turn else None
    cells = eval_cells(model, datasets, tasks, policies, ratios, capacities, modes, limit, max_context, lengths, seed,
                       source, framing, protocol, turns)
    _check_lengths(model, lengths)
    options = dict(model=model, datasets=datasets, tasks=tasks,
                   policies=[p if isinstance(p, str) else p.label for p in policies], ratios=ratios,
                   capacities=capacities, modes=list(modes), limit=limit, max_context=max_context,
                   lengths=list(lengths), seed=seed, source=source, framing=framing, **protocol,
                   **({} if turns is None else {"multi_turn": turns}))
    table = run_eval_cells(cells, model=model, options=options, data_dir=data_dir, executor=executor,
                           ray_address=ray_address, cpus_per_worker=cpus_per_worker, reuse=reuse)
    # The per-layer shares stay in the cell store: 30 numbers a row would swamp the table.
    table = table.drop(columns="layer_kv_share", errors="ignore")
    if write:
        table.to_csv(Path(data_dir) / f"eval_{name or '+'.join(datasets)}.csv", index=False)
    return table


def run_eval_cells(cells, *, model, options: dict, data_dir="data", executor: str = "local",
                   ray_address: str | None = None, cpus_per_worker: int | None = None, reuse=None) -> pd.DataFrame:
    """Run `eval_cells`' cells not yet stored in <data_dir>/cells/eval/ (after storing those `reuse` answers whole,
    see `evaluate`) as one sweep, its manifest holding `options` and the seeds; returns every cell's rows in the
    order of `cells`."""
    from ..sweep import ResultStore, run_cells

    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    store = ResultStore(data_dir / "cells" / CELL_KIND)
    manifest = dict(command=shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]), model=model, options=options,
                    seeds=[options.get("seed", 0)])
    if reuse is not None:
        tables = [reuse] if isinstance(reuse, (str, Path, pd.DataFrame)) else list(reuse)
        reused = reuse_rows(cells, store, pd.concat([read_results(t) if isinstance(t, (str, Path)) else t
                                                     for t in tables], ignore_index=True))
        print(f"eval cells: {reused} taken whole from an earlier table's rows", file=sys.stderr, flush=True)
    return run_cells(cells, run_example, store, model=model, executor=executor, ray_address=ray_address,
                     cpus_per_worker=cpus_per_worker, desc="eval cells", manifest=manifest)


def reuse_rows(cells, store, table: pd.DataFrame) -> int:
    """Store each cell of `cells` that `store` lacks from the rows of `table` (an earlier `evaluate` table) that
    answer it whole; returns how many were stored. A cell is answered whole when the table holds, for its model
    and example, every policy x budget x mode of the cell's config, each for the same questions as the full
    cache's rows; anything less (another model, budget or policy setting, a missing answer) leaves the cell to run.
    `table` may join several runs' tables (e.g. one at ratio 0.5, one at 0.25 and 0.75): an answer or a full-cache
    row found twice is taken from the first, and the cell's rows are stored in the order run_example writes them.

    A joined leaderboard keeps each example's full-cache rows once (evaluation.joined_tables), so a later group's
    cell takes them from the first group's: the same prompts answered by the same model; only their timings are the
    other cell's, and a join drops them again.
    """
    from ..core.models import model_name

    table = table.astype({"ratio": "Float64", "capacity": "Int64", "length": "Int64"})
    by_example = dict(list(table.groupby(["model", "spec"], sort=False)))
    stored = 0
    for cell in cells:
        config = cell.config
        rows = by_example.get((model_name(config["model"]), json.dumps(config["example"], sort_keys=True)))
        if rows is None or store.done(cell):
            continue
        full = (rows["mode"] == "full") & ~rows.duplicated(["mode", "question"])
        questions = sorted(rows.question[full])
        # run_example's order: per question the full cache, then policy by policy, budget by budget, MODES' order.
        answers = [(entry, b, mode) for entry in config["policies"] for b in config["budgets"]
                   for mode in MODES if mode in config["modes"]]
        wanted = {(json.dumps(policy_config(dataclasses.replace(policy_from_config(entry), capacity=_capacity(b)))),
                   mode): rank for rank, (entry, b, mode) in enumerate(answers, start=1)}
        answer = pd.Series([pair in wanted for pair in zip(rows.policy_config, rows["mode"])], index=rows.index)
        answer &= ~rows.duplicated(["policy_config", "mode", "question"])
        answered = rows[answer].groupby(["policy_config", "mode"]).question.agg(lambda q: sorted(q) == questions)
        if not questions or set(answered.index) != set(wanted) or not answered.all():
            continue
        kept = rows[full | answer]
        rank = [wanted.get(pair, 0) for pair in zip(kept.policy_config, kept["mode"])]  # 0: the full cache's
        order = np.lexsort((rank, kept.question.to_numpy()))
        store.put(cell, kept.iloc[order].reset_index(drop=True))
        stored += 1
    return stored


TEXT_COLUMNS = ("example", "prediction", "references", "spec", "policy_config")


def read_results(path) -> pd.DataFrame:
    """A table `evaluate` wrote, read back as written: answers, ids and JSON stay text (an answer "8957682" is not a
    number, an empty answer not a missing value). Policy configs stored under former field names are rewritten as
    today's code writes them (policies.upgrade_config), so an older table still resumes and explains its rows."""
    table = pd.read_csv(path, dtype={column: str for column in TEXT_COLUMNS})
    table = table.fillna({column: "" for column in TEXT_COLUMNS if column in table})
    if "policy_config" in table:
        current = {text: json.dumps(policy_config(policy_from_config(upgrade_config(json.loads(text)))))
                   if text else text for text in table.policy_config.unique()}
        table["policy_config"] = table.policy_config.map(current)
    return table


def _check_lengths(model: str | None, lengths) -> None:
    """Generated sets at a length the model cannot hold fail before the first prefill (skipped when the model's
    config cannot be read here, e.g. a Ray head node without it: the cells check where they run)."""
    if not lengths:
        return
    from transformers import AutoConfig

    from ..core.models import model_source

    try:
        config = AutoConfig.from_pretrained(model_source(model))
    except OSError:
        return
    check_context_length(config, max(lengths), what=f"a generated example of {max(lengths)} tokens")
