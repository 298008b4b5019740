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
    parser.add_argument("tables", nargs="+", type=Path)
    parser.add_argument("--data-dir", default="data", help="where the cells are stored (cells/entries/)")
    args = parser.parse_args()
    for path in args.tables:
        table = pd.read_csv(path)
        models = table.model.unique()
        if len(models) != 1:
            raise SystemExit(f"{path}: one model per table, found {list(models)}")
        audited = audit_entries(table, model=models[0], data_dir=args.data_dir)
        audited.to_csv(path, index=False)
        over = audited[audited.over_budget.astype(bool)]
        print(f"{path}: {len(audited)} rows; kv_share by policy at each ratio (min-max); {len(over)} over budget")
        spread = audited.groupby(["policy", "ratio"]).kv_share.agg(["min", "max"]).round(3)
        print(spread.to_string())
        if set(COLUMNS) - set(audited.columns):
            raise SystemExit(f"{path}: columns missing after the audit")


if __name__ == "__main__":
    main()
