"""Fill kv_entries, kv_share, budget_share and over_budget into committed eval and needle tables stored before their
rows recorded them: each example's (context's) compressions are rebuilt and counted without decoding
(snapkv_lab.evaluation.audit; snapkv_lab.pressure.needle_audit for the needle suites' pressure_*.csv, whose rows
are checked against what their runs recorded), resumable (cells under <data-dir>/cells/), and the table is rewritten
in place with the columns after kept_tokens (cache_length); every other column is left as it was.

    python scripts/audit_entries.py data/eval_ruler.csv data/eval_ruler_4k_ratios.csv
    python scripts/audit_entries.py data/gemma-3-270m/eval_ruler_4k_ratios.csv --data-dir data/gemma-3-270m
    python scripts/audit_entries.py data/eval_ruler.csv ... --from-audit data/budget_audit_smollm2_4k.csv  # no compute
    python scripts/audit_entries.py data/pressure_*.csv --entries-only data/budget_audit_needles_smollm2.csv
    python scripts/audit_entries.py data/gemma-3-270m/pressure_*.csv --model gemma-3-270m --data-dir data/gemma-3-270m
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from snapkv_lab.evaluation.audit import COLUMNS, audit_entries, entries_of, fill_from_entries
from snapkv_lab.pressure.needle_audit import audit_tables, fill_table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tables", nargs="+", type=Path, help="tables of one model: their examples are audited once")
    parser.add_argument("--data-dir", default="data", help="where the cells are stored (cells/entries/)")
    parser.add_argument("--examples", type=int, default=None,
                        help="audit the first N examples only (the others' columns left empty; a rerun resumes)")
    parser.add_argument("--first", type=int, default=0,
                        help="leave the first K examples out as well: --first K --examples N audits examples K+1 "
                        "to N (parts run side by side)")
    parser.add_argument("--entries-only", type=Path, default=None, metavar="CSV",
                        help="write the audited rows (each table's name, its key columns and the entry columns) to CSV "
                             "and leave the tables as they are: an audit in parts read before the tables are filled")
    parser.add_argument("--from-audit", type=Path, default=None, metavar="CSV",
                        help="fill the tables from an audit already made (--entries-only CSVs concatenated, e.g. "
                             "data/budget_audit_smollm2_4k.csv) without recomputing; refused unless it has every row")
    parser.add_argument("--model", default=None,
                        help="needle tables: the model they ran (default: their model column, else the bundled "
                             "SmolLM2)")
    args = parser.parse_args()
    tables = [pd.read_csv(path) for path in args.tables]
    needle = [path.name.startswith("pressure_") for path in args.tables]
    if any(needle):
        if not all(needle):
            raise SystemExit("audit the needle tables (pressure_*.csv) and the eval tables in separate runs")
        if args.examples is not None or args.first:
            raise SystemExit("--examples and --first are the eval tables' parts: a needle audit resumes from its cells")
        _needle_tables(args, tables)
        return
    if args.from_audit is not None:
        _write_filled(args, tables, fill_from_entries, pd.read_csv(args.from_audit))
        return
    joined = pd.concat([t.assign(_table=i) for i, t in enumerate(tables)], ignore_index=True)
    models = joined.model.unique()
    if len(models) != 1:
        raise SystemExit(f"one model per run, found {list(models)}")
    audited = audit_entries(joined, model=models[0], data_dir=args.data_dir, examples=args.examples,
                             first=args.first)
    if args.entries_only is not None:
        done = pd.concat([entries_of(audited[audited._table == i], path.name) for i, path in enumerate(args.tables)])
        done.to_csv(args.entries_only, index=False)
        print(f"{args.entries_only}: {len(done)} rows of {done[['task', 'example']].drop_duplicates().shape[0]} "
              "examples; kv_share by policy and ratio (min, max):")
        print(done.groupby(["policy", "ratio"]).kv_share.agg(["min", "max"]).round(3).unstack().to_string())
        return
    for i, (path, table) in enumerate(zip(args.tables, tables, strict=True)):
        own = audited[audited._table == i].drop(columns="_table")
        columns = [c for c in own.columns if c in table.columns or c in COLUMNS]
        own[columns].to_csv(path, index=False)
        _report(path, own)


def _needle_tables(args, tables: list[pd.DataFrame]) -> None:
    named = {path.name: table for path, table in zip(args.tables, tables, strict=True)}
    if args.from_audit is not None:
        audited = pd.read_csv(args.from_audit)
    else:
        models = {m for table in tables if "model" in table for m in table.model.unique()}
        if args.model is None and len(models) > 1:
            raise SystemExit(f"one model per run, found {sorted(models)}")
        model = args.model or next(iter(models), None)
        audited = audit_tables(named, model=model, data_dir=args.data_dir).assign(model=model)
        if args.entries_only is not None:
            audited.to_csv(args.entries_only, index=False)
            print(f"{args.entries_only}: {len(audited)} rows, {int((~audited.agrees).sum())} rebuilt otherwise than "
                  "recorded; kv_share by policy (min, max):")
            print(audited.groupby("policy").kv_share.agg(["min", "max"]).round(3).to_string())
            return
    _write_filled(args, tables, fill_table, audited)


def _write_filled(args, tables: list[pd.DataFrame], fill, audit: pd.DataFrame) -> None:
    """Each table rewritten in place as fill(table, audit, its file name) fills it; one the audit cannot fill whole
    stops the run with fill's reason."""
    for path, table in zip(args.tables, tables, strict=True):
        try:
            filled = fill(table, audit, path.name)
        except ValueError as error:
            raise SystemExit(str(error)) from None
        filled.to_csv(path, index=False)
        _report(path, filled)


def _report(path: Path, table: pd.DataFrame) -> None:
    over = table[table.over_budget.eq(True)]
    print(f"{path}: {table.kv_entries.notna().sum()} of {len(table)} rows audited, {len(over)} over budget; kv_share "
          "by policy and ratio (min, max):")
    budget = "ratio" if "ratio" in table else "capacity"
    print(table.groupby(["policy", budget], dropna=False).kv_share.agg(["min", "max"]).round(3).unstack().to_string())


if __name__ == "__main__":
    main()
