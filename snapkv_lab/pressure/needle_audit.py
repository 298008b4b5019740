"""The KV entries behind a needle table's rows (pressure_*.csv), recomputed without decoding: the budget audit of the
needle suites' tables, stored before their rows recorded kv_entries (issue 53). The eval tables' audit is
evaluation.audit; these tables name each policy by its label alone, so this one reads the labels.

    audited = audit_tables({"pressure_needle.csv": pd.read_csv(...)}, model=None, data_dir="data")

Each row's context is rebuilt from its columns (`context_spec`: the needle, lines and RULER-needle builders of
pressure.grid) and each policy from its label (`policies.parse_policy`, refused unless the policy built labels
itself the same). One cell per context (kind "needle-entries", resumable) prefills it once and compresses it with every
label x capacity x mode the tables ran on it, exactly as the needle runner did (compression.generation.run_states, the
states `answer_runs` answers from), and counts each state's entries (compression.entries). Nothing is decoded.

The rebuild is checked against what the run recorded, row by row: the prompt's length (`prompt_tokens`) and the
longest layer's cache (`cache_length`) must be equal, and the fact's and value's kept shares (`fact_kept`,
`value_kept`) equal within FRACTION_TOLERANCE, for every policy that evicts nothing while decoding (those shares are
read at the end of a run). Not exactly: a run on other threads or in a batch sums scores in another order, which can
swap two positions tied at a head's budget (seen on the lines table: 1 row of 56, 0.0005 of the fact, in one head).
A row that disagrees is not filled: the table was made by other code or other defaults, and its entries cannot be
recomputed from today's.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pandas as pd
import torch

from ..compression import SharedPrefill
from ..compression.entries import ENTRY_COLUMNS, HeldEntries
from ..compression.generation import MODES, run_states
from ..compression.layers import cache_lengths
from ..policies import parse_policy
from ..tasks.ruler_needles import TASKS
from .grid import build_context
from .runner import kept_spans

CELL_KIND = "needle-entries"
KEYS = ["spec", "key", "policy", "capacity", "mode"]
CHECKED = ["prompt_tokens", "cache_length", "fact_kept", "value_kept"]
FRACTION_TOLERANCE = 0.01  # of a fact's (value's) tokens over every layer and head: a few tied positions, no more


def context_spec(row, queries: int | None = None) -> dict:
    """The pressure.grid context spec a row's columns describe: a needle (task "needle", haystack other than the
    essays named), LongEval lines (task "lines"; `queries`: the context's questions), or a RULER needle task."""
    if row["task"] == "needle":
        haystack = row.get("haystack")
        spec = dict(builder="needle", n_tokens=int(row["length"]), depth=float(row["depth"]), sample=int(row["sample"]))
        return spec if pd.isna(haystack) or haystack == "essays" else {**spec, "haystack": haystack}
    if row["task"] == "lines":
        return dict(builder="lines", n_tokens=int(row["length"]), n_queries=queries, sample=int(row["sample"]))
    if row["task"] in TASKS:
        return dict(builder="ruler", n_tokens=int(row["length"]), task=row["task"], value_kind=row["value_kind"],
                    sample=int(row["sample"]))
    raise ValueError(f"no context builder for a row of task {row['task']!r}")


def row_specs(table: pd.DataFrame) -> pd.Series:
    """Each row's context spec as sorted JSON (lines contexts count their questions from the table: the keys asked of
    one length and sample)."""
    lines = table.task == "lines"
    queries = pd.Series(None, index=table.index, dtype="Int64")
    queries[lines] = table[lines].groupby(["length", "sample"])["key"].transform("nunique")
    return pd.Series([json.dumps(context_spec(row, None if pd.isna(n) else int(n)), sort_keys=True)
                      for (_, row), n in zip(table.iterrows(), queries)], index=table.index, dtype=object)


def read_label(label: str):
    """The policy a table's `policy` column names (its scorer_label), built with today's code; refused where the built
    policy would label itself otherwise (a setting read wrong)."""
    policy = parse_policy(label)
    if policy.scorer_label != label:
        raise ValueError(f"the label {label!r} builds a policy labelled {policy.scorer_label!r}")
    return policy


def audit_cells(tables: dict[str, pd.DataFrame], model: str | None) -> list:
    """One cell per context of `tables` (several tables' rows on one context share it): its spec, every label x
    capacity run on it, and the modes. A table with a `spec` column (`row_specs`) is read as it is."""
    from ..sweep import Cell

    rows = pd.concat([t if "spec" in t else t.assign(spec=row_specs(t)) for t in tables.values()], ignore_index=True)
    cells = []
    for spec, own in rows.groupby("spec", sort=False):
        compressed = own[own["mode"] != "full"]
        runs = sorted({(label, int(capacity)) for label, capacity in zip(compressed.policy, compressed.capacity)})
        for label, _ in runs:
            read_label(label)  # here, not an hour into the audit
        cells.append(Cell(CELL_KIND, dict(model=model, context=json.loads(spec), runs=[list(run) for run in runs],
                                          modes=[m for m in MODES if m in set(compressed["mode"])])))
    return cells


def context_entries(model, tokenizer, config: dict) -> pd.DataFrame:
    """One cell: per question of the context, the full cache and every label x capacity x mode of `config`, right
    after the prompt's compression: KEYS, the CHECKED columns as the run would record them, ENTRY_COLUMNS and
    layer_kv_share (JSON)."""
    context = build_context(tokenizer, config["context"])
    policies = [dataclasses.replace(read_label(label), capacity=capacity) for label, capacity in config["runs"]]

    def as_ids(ids):
        return torch.tensor([ids], device=model.device)

    rows = []
    with torch.inference_mode():
        shared = SharedPrefill.run(model, tokenizer, as_ids(context.context_ids), policies)
        questions = [as_ids(query.question_ids) for query in context.queries]
        for index, policy, mode, prompt, state in run_states(shared, questions, policies, config["modes"]):
            query = context.queries[index]
            entries = HeldEntries.of_state(model, state, 1, prompt.n_tokens)
            fed = questions[index].shape[1] if mode == "query-agnostic" else 0
            compressed = state.compressed(prompt.n_tokens)  # as the run decided it (pressure.runner, AnswerRun)
            rows.append(dict(spec=json.dumps(config["context"], sort_keys=True),
                             key={**context.meta, **query.meta}["key"],
                             policy=policy.scorer_label, capacity=None if mode == "full" else policy.capacity,
                             mode=mode,
                             prompt_tokens=prompt.n_tokens + fed, cache_length=max(cache_lengths(state.cache)),
                             **kept_spans(state, query, compressed),
                             decoding_eviction=compressed and changes_while_decoding(policy, prompt.n_tokens),
                             **entries.columns(),
                             layer_kv_share=json.dumps([round(s, 5) for s in entries.layer_shares()[0]])))
    return pd.DataFrame(rows).astype({"capacity": "Int64"})


def changes_while_decoding(policy, n_tokens: int) -> bool:
    """Whether what a policy holds moves after the prefill (eviction while decoding, a rolling window): its run's
    fact_kept and value_kept were read at the end of decoding, which an audit without decoding cannot rebuild."""
    return getattr(policy, "tracker", None) is not None or policy.decode_window(n_tokens) is not None


def audit_tables(tables: dict[str, pd.DataFrame], *, model: str | None = None, data_dir="data") -> pd.DataFrame:
    """Every row of `tables` ({name: a needle table}) with its recomputed entries: the table's name, KEYS, the
    CHECKED columns as recorded and as rebuilt (suffix _rebuilt), `agrees` (see the module doc) and ENTRY_COLUMNS.
    Cells stored in <data_dir>/cells/needle-entries/."""
    from ..sweep import ResultStore, run_cells

    store = ResultStore(Path(data_dir) / "cells" / CELL_KIND)
    tables = {name: table.assign(spec=row_specs(table)) for name, table in tables.items()}
    found = run_cells(audit_cells(tables, model), context_entries, store, model=model, desc="needle budget audit")
    found = found.drop(columns="layer_kv_share").drop_duplicates(KEYS)
    audited = []
    for name, table in tables.items():
        keyed = table.assign(table=name, capacity=table.capacity.astype("Int64"))
        merged = keyed[["table", *KEYS, *CHECKED]].merge(found, how="left", on=KEYS, suffixes=("", "_rebuilt"),
                                                         validate="many_to_one")
        if merged.kv_entries.isna().any():
            raise ValueError(f"{name}: {int(merged.kv_entries.isna().sum())} rows found no recomputed entries")
        audited.append(merged.assign(agrees=agreement(merged)))
    return pd.concat(audited, ignore_index=True)


def agreement(merged: pd.DataFrame) -> pd.Series:
    """Whether each audited row's rebuild matches what its run recorded (module doc)."""
    same = (merged.prompt_tokens == merged.prompt_tokens_rebuilt) & (merged.cache_length == merged.cache_length_rebuilt)
    for column in ("fact_kept", "value_kept"):
        close = (merged[column] - merged[f"{column}_rebuilt"]).abs() <= FRACTION_TOLERANCE
        same &= close | merged.decoding_eviction
    return same


def fill_table(table: pd.DataFrame, audited: pd.DataFrame, name: str) -> pd.DataFrame:
    """`table` with ENTRY_COLUMNS from its audited rows (`audit_tables`' rows of the same name, in table order), placed
    after cache_length. Refused unless every row's rebuild agrees: a table is filled whole or not at all."""
    own = audited[audited.table == name].reset_index(drop=True)
    if len(own) != len(table) or not all((own[c].values == table[c].values).all() for c in ("key", "policy", "mode")):
        raise ValueError(f"{name}: its audited rows are not its rows, in its order ({len(own)} for {len(table)})")
    if not own.agrees.all():
        bad = own[~own.agrees]
        raise ValueError(f"{name}: {len(bad)} of {len(table)} rows rebuild otherwise than their run recorded them "
                         f"(policies {', '.join(sorted(bad.policy.unique()))}): not filled")
    left = table.drop(columns=[c for c in ENTRY_COLUMNS if c in table]).reset_index(drop=True)
    order = list(left.columns)
    at = order.index("cache_length") + 1
    filled = pd.concat([left, own[ENTRY_COLUMNS]], axis=1)
    return filled[order[:at] + ENTRY_COLUMNS + order[at:]]
