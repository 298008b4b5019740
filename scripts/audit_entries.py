"""Fill kv_entries, kv_share, budget_share and over_budget into committed eval tables stored before their rows
recorded them: each example's compressions are rebuilt and counted without decoding (snapkv_lab.evaluation.audit),
resumable (cells under <data-dir>/cells/entries/), and the table is rewritten in place with the columns after
kept_tokens; every other column is left as it was.

    python scripts/audit_entries.py data/eval_ruler.csv data/eval_ruler_4k_ratios.csv
    python scripts/audit_entries.py data/gemma-3-270m/eval_ruler_4k_ratios.csv --data-dir data/gemma-3-270m
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from snapkv_lab.evaluation.audit import COLUMNS, audit_entries


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tables", nargs="+", type=Path, help="tables of one model: their examples are audited once")
    parser.add_argument("--data-dir", default="data", help="where the cells are stored (cells/entries/)")
    parser.add_argument("--examples", type=int, default=None,
                        help="audit the first N examples only (the others' columns left empty; a rerun resumes)")
    parser.add_argument("--first", type=int, default=0,
                        help="leave the first K examples out as well (parts run side by side: --first K --examples N)")
    parser.add_argument("--entries-only", type=Path, default=None, metavar="CSV",
                        help="write the audited rows (each table's name, its key columns and the entry columns) to CSV "
                             "and leave the tables as they are: an audit in parts read before the tables are filled")
    args = parser.parse_args()
    tables = [pd.read_csv(path) for path in args.tables]
    joined = pd.concat([t.assign(_table=i) for i, t in enumerate(tables)], ignore_index=True)
    models = joined.model.unique()
    if len(models) != 1:
        raise SystemExit(f"one model per run, found {list(models)}")
    audited = audit_entries(joined, model=models[0], data_dir=args.data_dir, examples=args.examples,
                             first=args.first)
    if args.entries_only is not None:
        keys = ["model", "dataset", "task", "example", "policy", "ratio", "capacity", "mode", "question"]
        done = audited[audited.kv_entries.notna()]
        done = done.assign(table=[args.tables[i].name for i in done._table])
        done[["table", *keys, *COLUMNS]].to_csv(args.entries_only, index=False)
        print(f"{args.entries_only}: {len(done)} rows of {done.spec.nunique()} examples; kv_share by policy and ratio "
              "(min, max):")
        print(done.groupby(["policy", "ratio"]).kv_share.agg(["min", "max"]).round(3).unstack().to_string())
        return
    for i, (path, table) in enumerate(zip(args.tables, tables, strict=True)):
        own = audited[audited._table == i].drop(columns="_table")
        columns = [c for c in own.columns if c in table.columns or c in COLUMNS]
        own[columns].to_csv(path, index=False)
        over = own[own.over_budget.eq(True)]
        print(f"{path}: {own.kv_entries.notna().sum()} of {len(own)} rows audited, {len(over)} over budget; kv_share "
              "by policy and ratio (min, max):")
        print(own.groupby(["policy", "ratio"]).kv_share.agg(["min", "max"]).round(3).unstack().to_string())


if __name__ == "__main__":
    main()
