"""The field's benchmarks, run the way the field runs them: `snapkv-lab eval`, `evaluate(...)`, a leaderboard.

    examples.py     Example and Question (a benchmark item split where compression happens), the Benchmark protocol
    registry.py     DATASETS: every benchmark by name
    ruler.py        RULER generated offline: the niah family, variable tracking, common and frequent words
    hub.py          sets read from the Hugging Face Hub (or a local copy): longbench.py, infinitebench.py, loogle.py,
                    scbench.py, and kvpress's own RULER copy
    metrics.py      METRICS: each benchmark's official metrics by its own names, (prediction, references) -> [0, 1]
    prompting.py    an example as a model's token ids: framed (chat or plain) and cut from the middle
    run.py          evaluate: one resumable sweep cell per example, one prefill for every policy x ratio x mode
    summary.py      task scores, the leaderboard and the gap to the full cache, with bootstrap intervals
    family.py       the family of comparisons: every comparison the docs report, one Holm adjustment over them
    audit.py        audit_entries: the KV entries behind a stored table's rows, recomputed without decoding
    explain.py      explain: one row of a table rerun, with the full cache's attention, its coverage and kept tokens
    figures.py      score vs compression ratio, task x policy heatmap, gap per task (the `eval` figure set)
    kvpress_format.py  kvpress's results files both ways: a run exported for its leaderboard, its results read back
"""

import json
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

import pandas as pd

from ..core.figure_files import FigureSet, register
from .examples import Benchmark, Example, Question
from .explain import Explanation, explain
from .prompting import EncodedExample, encode_example
from .ruler import SYNTHETIC_TASKS
from .run import (
    CELL_KIND,
    RATIOS,
    _check_lengths,
    budgets,
    eval_cells,
    evaluate,
    read_results,
    reuse_rows,
    run_eval_cells,
    run_example,
)
from .summary import answered_examples, full_cache_fails, gap_to_full, leaderboard, paired_difference, task_scores


def __getattr__(name):
    # DATASETS and METRICS import their modules on first use: `snapkv-lab eval --help` stays instant.
    if name == "DATASETS":
        from .registry import DATASETS

        return DATASETS
    if name == "METRICS":
        from .metrics import METRICS

        return METRICS
    raise AttributeError(name)


def draw(data_dir, figures_dir, names=None, peers=None) -> list[Path]:
    """Every benchmark figure of data_dir's eval_*.csv tables (evaluation.figures, imported when drawing); peers:
    kvpress's results (kvpress_format.read_kvpress) beside the leaderboards' points."""
    from .leaderboard_plots import draw as draw_figures

    return draw_figures(data_dir, figures_dir, names, peers)


# The committed leaderboard: RULER at 4k on the bundled model, every policy, kvpress's ratios, both modes; its 11
# synthetic tasks under the lab's former protocol (every example filled to the length, cwe's solved example inside
# the task's turn), as data/eval_ruler.csv was run. RULER's own (13 tasks, sizing "official", cwe_shots "turn") is a
# rerun from scratch (issue 53): then tasks=None and protocol={} here.
LEADERBOARD = dict(datasets=["ruler"], lengths=[4096], ratios=list(RATIOS), modes=["query-aware", "query-agnostic"],
                   tasks=list(SYNTHETIC_TASKS), protocol=dict(sizing="fill", cwe_shots="inline"))


# The committed run's policies, in the groups they joined it in. A cell's key names its policies, so a policy
# registered later (or a default changed) joins through cells of its own over the same examples instead of starting
# the run over. The third group ran HeadKV and DuoAttention under their former defaults, which keep those labels; the
# last group runs their defaults since 2026-11-29 (HeadKV's official 8-token window, DuoAttention's rolling window).
LEADERBOARD_GROUPS = (
    ("SnapKV", "SnapKVNoPooling", "SnapKVFactKernel", "H2O", "StreamingLLM", "RandomKeep", "TOVA", "KNorm", "PyramidKV",
     "AdaKV", "ChunkKV", "CriticalKV", "ExpectedAttention", "KVzip", "Surprisal", "DecodingEviction"),
    ("KeyDiff", "LagKV", "QFilters"),
    ("HeadKV(policy=SnapKV(window_size=32))", "DuoAttention(rolling=False)", "CAKE"),
    ("RKV", "LookaheadQCache"),
    ("HeadKV", "DuoAttention"),
)


def leaderboard_policies() -> list[str]:
    return [name for group in LEADERBOARD_GROUPS for name in group]


def recompute(options: dict) -> None:
    """Rerun the committed leaderboard (LEADERBOARD, every group of LEADERBOARD_GROUPS) into options' data_dir (the
    model's own folder), resuming from its cells; options["samples"]: examples per task (default the generated
    sets' 10), or {task: examples} to grow only the tasks named (leaderboard_cells); options["reuse"]: the examples
    the existing eval_ruler.csv answers whole count as done (run.reuse_rows) and stay in the table, also where they
    pass --samples (a task grown to 4 examples keeps them at --samples 3).
    Every group's cells run as one sweep (options' executor, ray_address and cpus_per_worker: a cluster's workers
    take any group's cells); the groups' tables are joined into eval_ruler.csv, the full cache's rows (every
    group's cells answer with it) once."""
    from ..sweep import ResultStore

    data_dir = Path(options.get("data_dir", "data"))
    committed = data_dir / "eval_ruler.csv"
    reuse = read_results(committed) if options.get("reuse") and committed.exists() else None
    samples, model = options.get("samples"), options.get("model")
    _check_lengths(model, LEADERBOARD["lengths"])
    groups = [leaderboard_cells(model, group, samples, reuse) for group in LEADERBOARD_GROUPS]
    run_eval_cells([cell for cells in groups for cell in cells], model=model, data_dir=data_dir, reuse=reuse,
                   options=dict(LEADERBOARD, model=model, groups=[list(group) for group in LEADERBOARD_GROUPS],
                                samples=samples, reuse=reuse is not None, seed=0),
                   executor=options.get("executor") or "local", ray_address=options.get("ray_address"),
                   cpus_per_worker=options.get("cpus_per_worker"))
    store = ResultStore(data_dir / "cells" / CELL_KIND)
    joined_tables([store.table(cells) for cells in groups]).to_csv(committed, index=False)


def leaderboard_cells(model, group, samples: int | Mapping[str, int] | None = None,
                      held: pd.DataFrame | None = None) -> list:
    """The leaderboard's cells (LEADERBOARD, seed 0) for one policy group, in the order a run writes them: the first
    `samples` examples per task (None: each task's default), or with {task: examples} those of the tasks named; and
    every example `held` (an earlier leaderboard table) has rows of, wherever it stands."""
    # each held example's spec, keyed as reuse_rows matches a cell's example
    specs = [] if held is None else [json.loads(spec) for spec in held.spec.unique()]
    held_specs = {json.dumps(spec, sort_keys=True): spec for spec in specs}

    def cells(limit, tasks=None):
        return eval_cells(model, LEADERBOARD["datasets"], tasks or LEADERBOARD.get("tasks"), list(group),
                          LEADERBOARD["ratios"], None, LEADERBOARD["modes"], limit, None, LEADERBOARD["lengths"], 0,
                          None, None, LEADERBOARD.get("protocol"))

    named = isinstance(samples, Mapping)
    first = [cell for task, n in samples.items() for cell in cells(n, [task])] if named else cells(samples)
    if not held_specs and not named:
        return first
    wanted = {cell.key for cell in first}
    tasks = {cell.config["example"]["task"] for cell in first} | {spec["task"] for spec in held_specs.values()}
    per_task = max(Counter(cell.config["example"]["task"] for cell in first).values(), default=0)
    last = max((spec["index"] for spec in held_specs.values()), default=-1)
    return [cell for cell in cells(max(per_task, last + 1), sorted(tasks))
            if cell.key in wanted or json.dumps(cell.config["example"], sort_keys=True) in held_specs]


def joined_tables(tables) -> pd.DataFrame:
    """evaluate's tables of one set of examples under different policies, as one: each example's full-cache rows from
    the first table that has them (the others answered the same prompts with the same model)."""
    seen, parts = set(), []
    for table in tables:
        examples = pd.Series(list(zip(table.dataset, table.task, table.example)), index=table.index)
        parts.append(table[(table.policy != "FullCache") | ~examples.isin(seen)])
        seen |= set(examples[table.policy == "FullCache"])
    return pd.concat(parts, ignore_index=True)


register(FigureSet(name="eval", recompute=recompute, draw=draw, recompute_by_default=False))

__all__ = ["DATASETS", "LEADERBOARD", "METRICS", "RATIOS", "Benchmark", "EncodedExample", "Example", "Explanation",
           "Question", "answered_examples", "budgets", "draw", "encode_example", "explain", "eval_cells", "evaluate",
           "full_cache_fails", "gap_to_full", "leaderboard", "leaderboard_cells", "paired_difference", "read_results",
           "recompute", "reuse_rows", "run_eval_cells", "run_example", "task_scores"]
