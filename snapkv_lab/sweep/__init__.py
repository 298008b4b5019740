"""Grids that resume and scale: cells, a results store, and executors (this process, or Ray).

    store.py      Cell (kind + full JSON config, keyed by its hash), ResultStore (one parquet file per cell, manifest)
    executors.py  run_cells: every cell not in the store, here or on Ray actors, each stored as it finishes

A grid is a list of cells and a module-level work function `work(model, tokenizer, config) -> DataFrame`:

    cells = [Cell("needle", dict(model=None, context=..., policies=..., capacities=...)) for ...]
    table = run_cells(cells, work, ResultStore("data/cells/needle"), executor="local")

`work` may also be a dict kind -> function, for a grid whose cells are of several kinds (one run, one bar).
Rerunning skips the cells already stored and returns the same table. Ray is optional: pip install 'snapkv_lab[ray]'.
"""

from .executors import EXECUTORS, RAY_INSTALL, check_executor, import_ray, run_cells
from .store import Cell, ResultStore, git_commit, versions

__all__ = ["EXECUTORS", "RAY_INSTALL", "Cell", "ResultStore", "check_executor", "git_commit", "import_ray", "run_cells",
           "versions"]
