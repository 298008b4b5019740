"""Scorer x allocation at matched totals (issue 53): what in a method's result is its scorer, and what its allocation.

A compression method makes two choices: a scorer (how much each position matters, per layer and head) and an
allocation (how one budget is shared between layers and heads). The published methods come as pairs: SnapKV is
window attention under the uniform allocation, PyramidKV the same scorer under per-layer budgets, KVzip a
reconstruction score under one selection across all layers, HeadKV SnapKV under retrieval-head budgets. This study
crosses them: every scorer of SCORERS under every allocation of ALLOCATIONS, each allocation holding the uniform
allocation's KV entries at the same ratio (every row records its own: kv_entries, kv_share, over_budget), on the RULER
tasks the model's full cache answers and on the lab's needle suite, query-aware and query-agnostic, at kvpress's
ratios 0.25 / 0.5 / 0.75.

    snapkv-lab scorer-allocation --samples 3 --needle-samples 1   # cells in data/cells/scorer_allocation/, then
                                                                   # data/scorer_allocation.csv and its figure
    snapkv-lab scorer-allocation --table-only                      # the table and figure from the cells finished so far

Its figure and its reading (the `scorer-allocation` figure set): app.scorer_allocation_plots.

Scorers, each at its authors' defaults and with its own kept tail: SnapKV (the observation window's attention), KVzip
with allocation="uniform" (its reconstruction score alone), Surprisal, KNorm, ExpectedAttention, RandomKeep (chance).
The retrieval-head score (Wu et al.'s, as DuoAttention's and HeadKV's read it here) is not a scorer: it scores heads,
one number per (layer, head), and says nothing about which positions a head should keep; its methods use it to share
the budget between heads, so it is on the allocation axis (headkv, duo) and not on this one.

Allocations: uniform (each layer and head the budget), pyramid (PyramidKV's layer budgets, kvpress's schedule, which
holds the total at every ratio: policies.pyramid_allocation), adakv (AdaKV's per-head shares within a layer), global
(KVzip's one selection over every layer and head), headkv (HeadKV's retrieval-head budgets, redistribute=True so that
the labelled budget is held), duo (DuoAttention's full and streaming heads, hold_total=True).

Cells: one per (example, scorer), holding the scorer under every allocation at every ratio and mode, so that scores
made after the prefill (KVzip's reconstruction, Surprisal's output head) are made once per example and shared by the
allocations. A RULER example is an `evaluation` cell (kind "eval", `evaluation.run.run_example`), a needle a
`pressure` cell (kind "pressure", `pressure.grid.run_context`): the two studies' own work functions, unchanged, which
is why the runner sits in app: the studies import none of each other (tests/test_layers.py).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pandas as pd

# The scorers by name, as policies.parse_policy reads them: each under the uniform allocation.
SCORERS = {"SnapKV": "SnapKV", "KVzip": "KVzip(allocation='uniform')", "Surprisal": "Surprisal", "KNorm": "KNorm",
           "ExpectedAttention": "ExpectedAttention", "RandomKeep": "RandomKeep"}
# The allocations by name: each a written policy around a scorer ({}), holding the uniform allocation's total.
ALLOCATIONS = {"uniform": "{}", "pyramid": "PyramidAllocation({}, schedule='kvpress')", "adakv": "AdaKV({})",
               "global": "GlobalAllocation({})", "headkv": "HeadKV({}, redistribute=True)",
               "duo": "DuoAllocation({}, hold_total=True)"}
RATIOS = (0.25, 0.5, 0.75)
RULER_LENGTH = 4096
ANSWERED_TABLE = "eval_ruler_4k_answered.csv"  # the model's run on the RULER tasks its full cache answers
TABLE = "scorer_allocation.csv"
STORE = "scorer_allocation"  # <data>/cells/<STORE>/
FULL = "FullCache"  # the scorer and allocation written in the full cache's rows
COLUMNS = ["model", "benchmark", "task", "example", "scorer", "allocation", "policy", "ratio", "mode", "score",
           "kv_entries", "kv_share", "budget_share", "over_budget", "prompt_tokens", "prediction"]


def study_policy(scorer: str, allocation: str) -> str:
    """The written policy (policies.parse_policy) of a scorer under an allocation, both by name."""
    return ALLOCATIONS[allocation].format(SCORERS[scorer])


def answered_tasks(data_dir) -> list[str]:
    """The RULER tasks whose full cache answered every example of <data_dir>/eval_ruler_4k_answered.csv, in the order
    they first appear there: what compression can be judged on."""
    import pandas as pd

    path = Path(data_dir) / ANSWERED_TABLE
    if not path.is_file():
        raise ValueError(f"{path} is missing: it tells which RULER tasks the model's full cache answers; name them "
                         "(--tasks niah_single_1 ...) or run them first (docs/benchmarks.md)")
    full = pd.read_csv(path, usecols=["task", "mode", "score"])
    full = full[full["mode"] == "full"]
    answered = full.groupby("task", sort=False).score.min() == 1
    tasks = list(answered[answered].index)
    if not tasks:
        raise ValueError(f"the full cache of {path} answers no RULER task on every example: nothing to judge on")
    return tasks


def study_cells(model=None, *, tasks, samples: int = 3, needle_samples: int = 1, needle_length: int | None = None,
                scorers=tuple(SCORERS), allocations=tuple(ALLOCATIONS), ratios=RATIOS, modes=None,
                dataset: str = "ruler", lengths=(RULER_LENGTH,), framing: str | None = None) -> list:
    """The study's cells in run order: one per (example, scorer), the examples taken in turns from each RULER task and
    the needles (first examples first), so that a run stopped early holds every scorer and allocation on as many of
    each as it reached. tasks: RULER's (or `dataset`'s) task names; samples: examples per task; needle_samples:
    haystacks per needle depth (pressure's dev needles: needle_length tokens, default 4000, five depths). Bad names,
    ratios or modes are refused here, before any model loads."""
    from ..compression.generation import MODES
    from ..core.checks import check_names
    from ..evaluation import eval_cells
    from ..policies import parse_policy, policy_config
    from ..pressure.ablations import ABLATION_LENGTH, ANSWER_TOKENS
    from ..pressure.grid import NEEDLE_DEPTHS
    from ..sweep import Cell

    check_names(list(scorers), list(SCORERS), "scorers")
    check_names(list(allocations), list(ALLOCATIONS), "allocations")
    modes = list(modes or MODES)
    shares = [round(1 - float(r), 10) for r in ratios]  # eval_cells checks the ratios
    framed = {"framing": framing} if framing else {}
    turns = []  # per task (and the needles): per example, its cells (one per scorer)
    for task in tasks:
        per_scorer = [eval_cells(model, [dataset], [task], [study_policy(s, a) for a in allocations], ratios, None,
                                 modes, samples, None, lengths, 0, None, framing) for s in scorers]
        turns.append(list(zip(*per_scorer)))
    needles = [dict(builder="needle", n_tokens=needle_length or ABLATION_LENGTH, depth=depth, sample=sample, **framed)
               for sample in range(needle_samples) for depth in NEEDLE_DEPTHS]
    turns.append([[Cell("pressure", dict(model=model, policies=[policy_config(parse_policy(study_policy(s, a)))
                                                                for a in allocations],
                                         capacities=shares, modes=modes, max_new_tokens=ANSWER_TOKENS, describe=None,
                                         context=needle)) for s in scorers] for needle in needles])
    longest = max(map(len, turns))
    return [cell for i in range(longest) for examples in turns if i < len(examples) for cell in examples[i]]


def tidy(cells, store) -> pd.DataFrame:
    """The finished cells' rows as one table (COLUMNS): each answer's scorer and allocation by name, its compression
    ratio (0 for the full cache), mode, score in [0, 1] (RULER's metric; a needle is found or not, RULER's grade)
    and the KV entries its cache held; the full cache's rows (mode "full", ratio 0) once per example."""
    import pandas as pd

    from ..policies import parse_policy

    names = {parse_policy(study_policy(s, a)).scorer_label: (s, a) for s in SCORERS for a in ALLOCATIONS}
    names[FULL] = (FULL, FULL)
    parts = []
    for cell in cells:
        if not store.done(cell):
            continue
        rows = store.get(cell)
        if cell.kind == "eval":
            parts.append(rows.assign(benchmark=rows.dataset))
        else:  # a needle: its depth and haystack name it; found or not is its score
            parts.append(rows.assign(benchmark="needle",
                                     example=[f"{d:g}/{s}" for d, s in zip(rows.depth, rows["sample"])],
                                     ratio=(1 - rows.capacity.astype(float)).round(10).fillna(0.0),
                                     score=rows.correct.astype(float), prediction=rows.output))
    if not parts:
        return pd.DataFrame(columns=COLUMNS)
    table = pd.concat(parts, ignore_index=True)
    pairs = [names[label] for label in table.policy]
    table = table.assign(scorer=[p[0] for p in pairs], allocation=[p[1] for p in pairs],
                         ratio=table.ratio.astype(float), example=table.example.astype(str))
    repeated = (table.scorer == FULL) & table.duplicated(["benchmark", "task", "example", "mode", "policy"])
    return table.loc[~repeated, COLUMNS].reset_index(drop=True)


def recompute(options: dict) -> None:
    """Run the study's cells not yet stored in <data_dir>/cells/scorer_allocation/ (one process, one progress bar),
    then write <data_dir>/scorer_allocation.csv from every finished cell. options: data_dir (the model's own folder),
    model, tasks (default `answered_tasks`), samples (RULER examples per task, default 3), needle_samples (default 1),
    scorers, allocations, ratios, modes, framing, threads (torch threads), table_only (write the table from the
    finished cells, run nothing), executor, ray_address, cpus_per_worker, and for tests dataset, lengths,
    needle_length and loader (run_cells')."""
    import shlex

    from ..sweep import ResultStore, run_cells

    data_dir = Path(options.get("data_dir") or "data")
    cells = study_cells(options.get("model"), tasks=options.get("tasks") or answered_tasks(data_dir),
                        samples=options.get("samples") or 3, needle_samples=options.get("needle_samples") or 1,
                        needle_length=options.get("needle_length"), scorers=options.get("scorers") or tuple(SCORERS),
                        allocations=options.get("allocations") or tuple(ALLOCATIONS),
                        ratios=options.get("ratios") or RATIOS, modes=options.get("modes"),
                        dataset=options.get("dataset") or "ruler", lengths=options.get("lengths") or (RULER_LENGTH,),
                        framing=options.get("framing"))
    store = ResultStore(data_dir / "cells" / STORE)
    if not options.get("table_only"):
        if options.get("threads"):
            import torch

            torch.set_num_threads(options["threads"])
        from ..evaluation.run import run_example
        from ..pressure.grid import run_context

        logged = {k: v for k, v in options.items() if k not in ("loader", "data_dir")}
        run_cells(cells, {"eval": run_example, "pressure": run_context}, store, model=options.get("model"),
                  executor=options.get("executor") or "local", ray_address=options.get("ray_address"),
                  cpus_per_worker=options.get("cpus_per_worker"), desc="scorer x allocation cells",
                  loader=options.get("loader"),
                  manifest=dict(command=shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]), model=options.get("model"),
                                options={k: list(v) if isinstance(v, tuple) else v for k, v in logged.items()},
                                seeds=[0]))
    table = tidy(cells, store)
    done = sum(store.done(cell) for cell in cells)
    print(f"scorer x allocation: {done} of {len(cells)} cells finished, {len(table)} rows in {data_dir / TABLE}",
          file=sys.stderr, flush=True)
    table.to_csv(data_dir / TABLE, index=False)
