"""Cells and the results store: one parquet file per finished cell, keyed by the cell's full configuration.

    <root>/<key>.parquet   a finished cell's table; the cell's kind and config ride in the file's metadata
    <root>/manifest.json   one entry per run of the grid: command, options, model, seeds, versions, git commit

A cell's file is written to a hidden temporary name (`.<key>.<pid>.partial`, never read) and renamed, so a killed
process leaves whole cell files only: at most the cell in flight is lost. The key hashes the kind and the canonical JSON
of the config, so a changed option (model, budgets, max_new_tokens, ...) lands in a new file and never reuses a stale
one.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import pandas as pd

_CELL_METADATA = b"snapkv_lab.cell"


@dataclass(frozen=True)
class Cell:
    """One unit of a grid: `kind` names the work function family ("needle", "findings-ab", ...); `config` is the
    cell's whole configuration as JSON-able values (model, context, seeds, policies, options)."""

    kind: str
    config: dict

    def __post_init__(self):
        try:
            self.canonical  # noqa: B018 - fails here, not in a worker an hour later
        except (TypeError, ValueError) as err:
            raise TypeError(f"a cell's config must be JSON-able (str, numbers, bools, None, lists, dicts): "
                            f"{err}") from None

    @cached_property
    def canonical(self) -> str:
        """Kind and config as JSON with sorted keys and no spaces: equal configurations, equal text."""
        return json.dumps({"kind": self.kind, "config": self.config}, sort_keys=True, separators=(",", ":"),
                          allow_nan=False)

    @cached_property
    def key(self) -> str:
        """A stable name for the cell: 20 hex digits of the SHA-256 of `canonical`."""
        return hashlib.sha256(self.canonical.encode()).hexdigest()[:20]

    def __hash__(self) -> int:
        return hash(self.key)


class ResultStore:
    """A folder of finished cells (one parquet file each) and the grid's manifest."""

    def __init__(self, root):
        self.root = Path(root)

    def path(self, cell: Cell) -> Path:
        return self.root / f"{cell.key}.parquet"

    def done(self, cell: Cell) -> bool:
        return self.path(cell).exists()

    def put(self, cell: Cell, table: pd.DataFrame) -> None:
        """Write the cell's table atomically (temporary file, then rename).

        The table must come back from parquet as it went in, as CSV text (the final tables are CSV): a column
        that does not (mixed ints and missing values in an object column, lists) is refused with its name,
        rather than stored changed. Give such columns one type first (e.g. "Int64", or text).
        """
        import pyarrow as pa
        import pyarrow.parquet as pq

        if not isinstance(table, pd.DataFrame):
            raise TypeError(f"cell {cell.kind} {cell.key}: a work function returns a pandas DataFrame, got "
                            f"{type(table).__name__}")
        try:
            arrow = pa.Table.from_pandas(table, preserve_index=False)
        except (pa.ArrowException, TypeError, ValueError) as err:
            raise TypeError(f"cell {cell.kind} {cell.key}: its table cannot be stored as parquet ({err}); "
                            "give each column "
                            "one type (e.g. 'Int64' for integers with missing values, text for lists)") from None
        arrow = arrow.replace_schema_metadata({**(arrow.schema.metadata or {}),
                                               _CELL_METADATA: cell.canonical.encode()})
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".{cell.key}.{os.getpid()}.partial"
        pq.write_table(arrow, tmp)
        back = pd.read_parquet(tmp)
        if table.to_csv(index=False) != back.to_csv(index=False):
            changed = [c for c in table.columns if c not in back or _as_csv(table[c]) != _as_csv(back[c])]
            tmp.unlink()
            raise TypeError(f"cell {cell.kind} {cell.key}: columns {changed or list(table.columns)} would not read "
                            "back as written (e.g. integers with missing values in an object column become floats); "
                            "give them one type, e.g. 'Int64'")
        os.replace(tmp, self.path(cell))

    def get(self, cell: Cell) -> pd.DataFrame:
        if not self.done(cell):
            raise KeyError(f"cell {cell.kind} {cell.key} is not in {self.root}")
        return pd.read_parquet(self.path(cell))

    def table(self, cells) -> pd.DataFrame:
        """The tables of `cells` (all stored), concatenated in their order; an empty table for no cells."""
        cells = list(cells)
        return pd.concat([self.get(cell) for cell in cells], ignore_index=True) if cells else pd.DataFrame()

    def write_manifest(self, command: str, options: dict, model, seeds) -> Path:
        """Append this run to <root>/manifest.json: command, options, model, seeds, library versions and the git
        commit of the code (with a `dirty` flag for uncommitted changes). Returns the manifest's path."""
        runs = self._runs()
        runs.append(dict(started=datetime.datetime.now().astimezone().isoformat(timespec="seconds"), command=command,
                         options=options, model=model, seeds=seeds, versions=versions(), git=git_commit()))
        return self._write_runs(runs)

    def finish_manifest(self, **log) -> Path:
        """Add to the manifest's last run how it went (`log`: seconds, cells run, machine load, ...) and when it
        ended. A run's log lives here, beside its cells, not in the tables it writes: a rerun that changes no
        result changes no committed file."""
        runs = self._runs()
        if not runs:
            raise ValueError(f"{self.root / 'manifest.json'} holds no run to finish")
        runs[-1].update(finished=datetime.datetime.now().astimezone().isoformat(timespec="seconds"), **log)
        return self._write_runs(runs)

    def _runs(self) -> list[dict]:
        path = self.root / "manifest.json"
        return json.loads(path.read_text())["runs"] if path.exists() else []

    def _write_runs(self, runs: list[dict]) -> Path:
        path = self.root / "manifest.json"
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".partial")
        tmp.write_text(json.dumps({"runs": runs}, indent=1, default=str) + "\n")
        os.replace(tmp, path)
        return path


def _as_csv(column: pd.Series) -> list[str]:
    return column.to_frame().to_csv(index=False).splitlines()


def versions() -> dict:
    """Python, platform, and the installed torch, transformers, pandas, ray (None when absent) and snapkv_lab."""
    from ..core import __version__

    found = {}
    for name in ("torch", "transformers", "pandas", "ray"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return dict(python=sys.version.split()[0], platform=platform.platform(), snapkv_lab=__version__, **found)


def git_commit() -> dict | None:
    """The commit of the snapkv_lab checkout in use and whether it has uncommitted changes; None outside git."""
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here, capture_output=True,
                                text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if commit.returncode != 0:
        return None
    return dict(commit=commit.stdout.strip(), dirty=bool(status.stdout.strip()))
