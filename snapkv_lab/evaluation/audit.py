"""The KV entries behind an eval table's rows, recomputed without decoding: a budget audit of results stored before
their rows recorded it (issue 53: `kept_tokens` alone cannot say whether two policies held the same total).

    audited = audit_entries(pd.read_csv("data/eval_ruler.csv"), data_dir="data")   # the table with kv_entries, ...

Each example of the table is a cell (kind "entries", resumable): its context is prefilled once, every policy x budget
x mode the table ran on it is compressed exactly as `evaluate` compressed it (compression.generation.run_states, the
states `answer_runs` answers from) and its entries counted (compression.entries); nothing is decoded. A rebuilt
example whose context differs in length from the row's `context_tokens` is refused: the table was made by other
example-building code, and its budgets cannot be recomputed from today's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import torch

from ..compression import SharedPrefill
from ..compression.entries import ENTRY_COLUMNS as COLUMNS
from ..compression.entries import HeldEntries
from ..compression.generation import MODES, run_states
from ..policies import policy_config, policy_from_config, policy_spec, upgrade_config
from .run import prepared_example

CELL_KIND = "entries"
KEYS = ["spec", "policy_config", "mode", "question", "ratio", "capacity"]


def canonical_config(text: str) -> str:
    """A stored policy_config as today's code writes it (older keywords upgraded), so rows of any age join."""
    return json.dumps(policy_config(policy_from_config(upgrade_config(json.loads(text)))))


def audit_cells(table: pd.DataFrame, model: str | None) -> list:
    """One cell per example of `table`: its spec, the policies (without their budget) and budgets run on it, the
    modes, the framing, and the context's length as the table recorded it."""
    from ..sweep import Cell

    cells = []
    for spec, rows in table.groupby("spec", sort=False):
        compressed = rows[rows["mode"] != "full"]
        configs = {json.dumps({**json.loads(canonical_config(c)), "capacity": None}) for c in compressed.policy_config}
        budgets = [{"ratio": float(r)} for r in sorted(compressed.ratio.dropna().unique())]
        budgets += [{"capacity": int(c)} for c in sorted(compressed.capacity.dropna().unique())]
        cells.append(Cell(CELL_KIND, dict(
            model=model, example=json.loads(spec), policies=[json.loads(c) for c in sorted(configs)], budgets=budgets,
            modes=[m for m in MODES if m in set(compressed["mode"])], max_context=None,
            framing=rows.framing.iloc[0], context_tokens=int(rows.context_tokens.iloc[0]))))
    return cells


def example_entries(model, tokenizer, config: dict) -> pd.DataFrame:
    """One cell: per question, the full cache and every policy x budget x mode of `config`, the KV entries held
    right after the prompt's compression; the key columns of `evaluate`'s rows (KEYS), then COLUMNS and
    layer_kv_share (JSON)."""
    example, encoded, budget_of, policies = prepared_example(model, tokenizer, config)
    if len(encoded.context_ids) != config["context_tokens"]:
        raise ValueError(f"{example.dataset}/{example.task} #{example.id} rebuilds to a "
                         f"{len(encoded.context_ids)}-token context, not the table's {config['context_tokens']}: "
                         "its budgets cannot be recomputed")

    def as_ids(ids):
        return torch.tensor([ids], device=model.device)

    with torch.inference_mode():
        shared = SharedPrefill.run(model, tokenizer, as_ids(encoded.context_ids), policies)
        rows = []
        questions = [as_ids(q) for q in encoded.questions]
        for index, policy, mode, prompt, state in run_states(shared, questions, policies, config["modes"]):
            entries = HeldEntries.of_state(model, state, 1, prompt.n_tokens)
            budget = {"ratio": 0.0} if mode == "full" else budget_of[policy.label]
            rows.append(dict(spec=json.dumps(config["example"], sort_keys=True),
                             policy_config=json.dumps(policy_config(policy)), mode=mode, question=index,
                             ratio=budget.get("ratio"), capacity=budget.get("capacity"), **entries.columns(),
                             layer_kv_share=json.dumps([round(s, 5) for s in entries.layer_shares()[0]])))
    return pd.DataFrame(rows).astype({"ratio": "Float64", "capacity": "Int64"})


def audit_entries(table: pd.DataFrame, *, model: str | None = None, data_dir="data",
                  examples: int | None = None, first: int = 0) -> pd.DataFrame:
    """`table` (an `evaluate` table) with COLUMNS filled from recomputed compressions (module doc), placed after
    kept_tokens; cells stored in <data_dir>/cells/entries/. model: the table's model (None: the bundled default).
    examples: audit only the table's first `examples` examples (in its order), leaving the others' COLUMNS empty (an
    audit in parts: a rerun with a larger number resumes); None audits every one. first: leave the first `first`
    examples out too (parts computed side by side, or on another machine, each its own range)."""
    from ..sweep import ResultStore, run_cells

    store = ResultStore(Path(data_dir) / "cells" / CELL_KIND)
    every = audit_cells(table, model)
    cells = every[first:examples]
    if not cells:  # examples is where the part ends: --first 2 --examples 2 selects nothing
        raise ValueError(f"no example to audit: the tables hold {len(every)}, and first={first}, examples={examples} "
                         "selects none of them (examples is where the part ends, not how many it holds)")
    found = run_cells(cells, example_entries, store, model=model, desc="budget audit")
    found = found.drop(columns="layer_kv_share").drop_duplicates(KEYS)
    keyed = table.drop(columns=[c for c in COLUMNS if c in table], errors="ignore").assign(
        policy_config_key=table.policy_config.map(canonical_config),
        ratio=table.ratio.astype("Float64"), capacity=table.capacity.astype("Int64"))
    merged = keyed.merge(found.rename(columns={"policy_config": "policy_config_key"}), how="left",
                         on=["policy_config_key" if k == "policy_config" else k for k in KEYS], validate="many_to_one")
    audited = merged.spec.isin(list(dict.fromkeys(table.spec))[first:examples])  # audit_cells' order
    missing = int((merged.kv_entries.isna() & audited).sum())
    if missing:
        raise ValueError(f"{missing} rows found no recomputed entries (a policy, budget or mode the cells lack)")
    order = list(table.columns.drop(COLUMNS, errors="ignore"))
    at = order.index("kept_tokens") + 1
    return merged[order[:at] + COLUMNS + order[at:]]


ENTRY_KEYS = ["model", "dataset", "task", "example", "policy", "ratio", "capacity", "mode", "question"]


def entries_of(audited: pd.DataFrame, table_name: str) -> pd.DataFrame:
    """`audit_entries`' audited rows as an --entries-only CSV keeps them: the table's name, ENTRY_KEYS, COLUMNS."""
    done = audited[audited.kv_entries.notna()]
    return done.assign(table=table_name)[["table", *ENTRY_KEYS, *COLUMNS]]


def fill_from_entries(table: pd.DataFrame, entries: pd.DataFrame, table_name: str) -> pd.DataFrame:
    """`table` with COLUMNS taken from an audit already made (`entries_of` rows, e.g. data/budget_audit_*.csv) instead
    of recomputed: each row joined to the audited row of the same table and ENTRY_KEYS. Refused unless every row of
    `table` finds exactly one: a table is filled whole or not at all, never with some budgets silently left empty."""
    own = entries[entries.table == table_name].drop(columns="table")
    if own.duplicated(ENTRY_KEYS).any():
        raise ValueError(f"{table_name}: the audit holds a row twice ({int(own.duplicated(ENTRY_KEYS).sum())} repeats)")
    typed = {"ratio": "Float64", "capacity": "Int64", "question": "Int64", "example": "str"}
    left = table.drop(columns=[c for c in COLUMNS if c in table]).astype(typed)
    merged = left.merge(own.astype(typed), how="left", on=ENTRY_KEYS, validate="many_to_one", indicator=True)
    missing = merged[merged._merge != "both"]
    if len(missing):
        examples = (missing.task + "/" + missing.example).unique()
        raise ValueError(f"{table_name}: {len(missing)} of {len(table)} rows are not in the audit (examples "
                         f"{', '.join(examples[:5])}{' ...' if len(examples) > 5 else ''}): audit them first")
    order = list(left.columns)
    at = order.index("kept_tokens") + 1
    return merged[order[:at] + COLUMNS + order[at:]]


# Columns that say how big a run's cache was: a table with one of them holds runs (not a summary or a family).
_CACHE_COLUMNS = ("kv_entries", "kept_tokens", "cache_length", "kept_entries", "cache_after_prefill")
# Columns that record the KV entries held, summed over layers and KV heads, under another name than kv_entries.
_ENTRIES_AS = {"kept_entries": "kept_entries (the context's entries kept, in positions' worth)",
               "footprint_integral": "footprint_integral and _peak (entries over decoding)"}


def budget_records(data_dir="data") -> pd.DataFrame:
    """Every table of runs under `data_dir` (a CSV with `policy` and a cache-size column; per-model folders included),
    and how the KV entries its rows held are known. Columns: table (path under data_dir), rows, examples
    (task/example pairs, None where the table has none), record: "recorded" (the run wrote kv_entries), "filled from
    an audit" (kv_entries written from a budget_audit_*.csv of the table's folder that holds every example, or, for a
    needle table, its rows), "recorded as <column>", "audited" (every example in a budget_audit_*.csv of its folder),
    "audited in part" (some), or "not recorded"; known: every row's entries are known (neither of the last two);
    audited (its examples in an audit); auditable: a table scripts/audit_entries.py rebuilds (an eval table, rows with
    spec and policy_config, or a needle table, rows with task, capacity, mode and cache_length:
    pressure.needle_audit)."""
    data_dir = Path(data_dir)
    audited_examples, audited_tables = set(), set()
    for path in sorted(data_dir.glob("**/budget_audit_*.csv")):
        if "cells" in path.relative_to(data_dir).parts:
            continue
        audit = pd.read_csv(path)
        tables = audit.table.map(lambda name, folder=path.parent: str((folder / name).relative_to(data_dir)))
        if "spec" in audit:  # a needle audit (pressure.needle_audit): whole tables, row by row
            audited_tables |= set(tables)
        else:
            audited_examples |= set(zip(tables, audit.model, audit.task, audit.example.astype(str)))
    rows = []
    for path in sorted(data_dir.glob("**/*.csv")):
        name = str(path.relative_to(data_dir))
        if path.name.startswith("budget_audit_") or "cells" in path.relative_to(data_dir).parts:
            continue
        columns = set(pd.read_csv(path, nrows=0).columns)
        if "policy" not in columns or not columns & set(_CACHE_COLUMNS):
            continue
        table = pd.read_csv(path, usecols=list({"policy", "model", "task", "example", "kv_entries"} & columns))
        pairs = (set(zip(table.model, table.task, table.example.astype(str)))
                 if {"model", "task", "example"} <= columns else None)
        audited = 0 if pairs is None else sum((name, *pair) in audited_examples for pair in pairs)
        whole = name in audited_tables if pairs is None else bool(pairs) and audited == len(pairs)
        if "kv_entries" in table and table.kv_entries.notna().all():
            record = "filled from an audit" if whole else "recorded"
        elif other := next((column for column in _ENTRIES_AS if column in columns), None):
            record = f"recorded as {_ENTRIES_AS[other]}"
        elif whole:
            record = "audited"
        else:
            record = "audited in part" if audited else "not recorded"
        rows.append(dict(table=name, rows=len(table), examples=None if pairs is None else len(pairs), record=record,
                         known=record not in ("audited in part", "not recorded"), audited=audited,
                         auditable={"spec", "policy_config"} <= columns
                         or {"task", "capacity", "mode", "cache_length"} <= columns))
    return pd.DataFrame(rows)


# Policies holding other than their nominal budget's share of the KV entries beyond rounding in the committed tables
# (docs/benchmarks.md): kv_share - budget_share at its least and most there, and why. Every other policy holds its
# budget to within ROUNDING either way, and is never over_budget.
BUDGET_DEPARTURES = {
    "PyramidKV": (-0.121, 0.0035, "over on SmolLM2: the official integer schedule gives a layer a whole position "
                  "per head more; under on Gemma 3 270M: the schedule runs over all 18 layers, and the 3 it compresses "
                  "(5, 11, 17; the rest slide) sit past its middle, where budgets are smaller (0.448 of the full "
                  "cache against 0.568 at 16257 tokens and capacity 0.5)"),
    "SnapKV(per_query_head=True)": (0.0, 0.52, "over by design: one selection per query head, each stored (heads / "
                                    "kv_heads times the entries)"),
    "ChunkKV": (-0.004, 0.0, "under: whole chunks, kvpress's int(n_chunks B / n) of them, the prompt's last "
                "(shorter) chunk possibly among them: up to 2 (chunk_size - 1) positions per head fewer than B "
                "(policies.chunkkv)"),
    "CAKE": (-0.020, 0.0, "under: the official integer budgets (cake/utils.py adjust_budgets) spread a capped layer's "
             "excess once, so a layer that spread lifts past its prefix keeps its prefix and the rest goes unused (3 "
             "of SmolLM2's 30 layers on a 3998-token prompt at capacity 0.75: 37.6 positions per KV head)"),
    "DuoAttention(rolling=False)": (-0.196, 0.0, "under: whole heads, floor(L K (B - s) / (n - s)) of them keeping "
                                    "all n positions, so up to one head's n - s positions go unused: 1/90 of the "
                                    "compressed entries on SmolLM2 (90 KV heads), up to 1/3 on Gemma 3 270M (3): "
                                    "0.156 of the full cache at 16257 tokens and capacity 0.25, no head full"),
    "HeadKV(policy=SnapKV(window_size=32))": (-0.551, 0.0, "under: the official slicing leaves unused what a head's "
                                              "share holds beyond its prefix (HeadKV(redistribute=True) matches; "
                                              "-0.5506 on SmolLM2 at 8160 tokens and capacity 0.75)"),
    "PyramidAllocation": (-0.086, 0.0, "under on Gemma 3 270M, any scorer: kvpress's pyramid schedule over all 18 "
                          "layers, as PyramidKV's (its 3 compressed layers sit past the middle)"),
    "SimLayerKV": (-0.45, 0.0, "no budget (its budget_share is the full cache's): its lazy layers keep sinks and "
                   "recent tokens, the others the whole prompt (0.575 of the full cache at the least on RULER's 4k "
                   "haystacks)"),
    "DMS(threshold=0.001)": (-0.96, 0.0, "no budget (its budget_share is the full cache's): it keeps what clears its "
                             "threshold, which depends on the text (0.048 of the full cache on RULER's 4k haystacks)"),
}
ROUNDING = 0.002  # of the full cache's entries: a position per head in every layer of a 500-token prompt


def budget_departure(policy: str) -> tuple[float, float, str] | None:
    """The bounds BUDGET_DEPARTURES states for a policy's label: its own, else its class's (a key without arguments
    covers every label of that class, PyramidAllocation under any scorer), else None (held to ROUNDING)."""
    return BUDGET_DEPARTURES.get(policy) or BUDGET_DEPARTURES.get(policy_spec(policy)["name"])


def budget_gaps(data_dir="data") -> pd.DataFrame:
    """Per table of runs under `data_dir` that records its rows' entries (`budget_records`) and compressed policy: the
    rows, kv_share - budget_share at its least and most, and the rows over_budget. A multi-turn table (column `turn`)
    counts its first turn's query-aware rows alone: later turns hold the first compression's budget plus the turns
    appended since (docs/multi-turn.md), measured against the turn's own prompt."""
    data_dir = Path(data_dir)
    gaps = []
    for name in budget_records(data_dir).table:
        table = pd.read_csv(data_dir / name)
        if "budget_share" not in table:
            continue
        rows = table[(table.policy != "FullCache") & table.kv_share.notna()]
        if "turn" in rows:
            rows = rows[(rows.turn == 1) & (rows["mode"] == "query-aware")]
        gap = rows.kv_share - rows.budget_share
        gaps.append(rows.assign(table=name, gap=gap).groupby(["table", "policy"]).agg(
            rows=("gap", "size"), least=("gap", "min"), most=("gap", "max"),
            over_budget=("over_budget", "sum")).reset_index())
    return pd.concat(gaps, ignore_index=True)


def example_keys(entries: pd.DataFrame) -> pd.Series:
    """Each audited row's example: its `spec` (an `audit_entries` table), else task/example (an --entries-only CSV,
    whose examples stand in several tables)."""
    return entries.spec if "spec" in entries else entries.task + "/" + entries.example.astype(str)


def held_against_budget(entries: pd.DataFrame) -> pd.DataFrame:
    """Per policy of audited rows (`audit_entries`' COLUMNS beside `policy` and the columns `example_keys` reads): the
    examples and rows audited, the share of the full cache's KV entries held less the budget's share
    (kv_share - budget_share) at its least and most, and the rows over budget. The full cache is left out."""
    rows = entries[entries.policy != "FullCache"]
    rows = rows.assign(example_key=example_keys(rows), gap=rows.kv_share - rows.budget_share)
    return rows.groupby("policy").agg(
        examples=("example_key", "nunique"), rows=("gap", "size"), least=("gap", "min"), most=("gap", "max"),
        over_budget=("over_budget", "sum")).reset_index()
