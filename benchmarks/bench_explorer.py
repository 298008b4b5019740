"""How fast the trace explorer redraws, and what it holds, at 4k, 16k and 32k tokens.

    python benchmarks/bench_explorer.py                                   # Gemma 3 270M's shape, 4096 16384 32752
    python benchmarks/bench_explorer.py --shape smollm2 --lengths 2048 8192

A trace of the model's real shape (query heads, KV heads, head_dim; one full-attention layer and, for Gemma, one
sliding-window layer) with random queries and keys: redraw time and memory depend on the shapes, not the values.
Each length runs in its own process (peak memory is that process's). Per layer kind, with the widget built (so a
redraw includes sending the drawn array to the figure):
- "open": explore(trace, layer, head) the first time: the one exact pass over the head's rows, then the overview;
- "open, head mean": the same for the mean of the layer's heads (every head in one pass);
- "overview again": a redraw of the overview after a zoom (from the stored base grid);
- "zoom <side>": a view of side x side tokens ending at the prompt's end (on the diagonal), drawn at the block it
  needs: from the base grid, recomputed from queries and keys below the base block, exact at block 1;
- "zoom <side>, far from the diagonal": the last rows over the first keys;
- "precompute every head and the mean, save": AttentionTiles.precompute for the layer, written to a file (what a
  capture machine does once), then "open, from saved tiles" and "open, head mean, from saved tiles": a fresh
  explorer over that file, on another head, as a laptop opens a trace captured elsewhere.
Memory: the base grids the explorer keeps for the views above, and the process's peak RSS above the trace itself,
after each step (peak_so_far_above_trace_mib: the full layer's "open, head mean" row is the explorer's own peak, before
any precompute) and at the end.
"""

from __future__ import annotations

import argparse
import io
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch

SHAPES = {  # query heads, KV heads, head_dim, sliding window of the sliding layers (None: none)
    "gemma-3-270m": (4, 1, 256, 512),
    "smollm2": (9, 3, 64, None),
}
RESULTS = Path(__file__).resolve().parent / "results"


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def synthetic_trace(shape: str, n: int):
    from snapkv_lab.core.attention import AttentionSettings
    from snapkv_lab.core.trace import AttentionTrace

    heads, kv_heads, dim, window = SHAPES[shape]
    generator = torch.Generator().manual_seed(0)
    kinds = [("full", None)] + ([("sliding", window)] if window else [])
    return AttentionTrace(
        token_ids=torch.zeros(n, dtype=torch.long), tokens=["x"] * n, prompt_len=n - 32,
        queries=[torch.randn(heads, n, dim, generator=generator) for _ in kinds],
        keys=[torch.randn(kv_heads, n, dim, generator=generator) for _ in kinds],
        attention_settings=[AttentionSettings(dim ** -0.5, sliding_window=w) for _, w in kinds],
        layers=list(range(len(kinds)))), [kind for kind, _ in kinds]


def timed(action) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def child(shape: str, n: int, max_cells: int) -> list[dict]:
    from snapkv_lab.views.explorer import explore
    from snapkv_lab.views.tiles import AttentionTiles

    trace, kinds = synthetic_trace(shape, n)
    before = rss_mib()
    rows = []
    for layer, kind in enumerate(kinds):
        ex = None

        def open_head():
            nonlocal ex
            ex = explore(trace, layer=layer, head=0, max_cells=max_cells, progress=False)
            ex.widget  # noqa: B018 - built, so that every later redraw updates the figure too
        steps = [("open", open_head)]
        end = trace.prompt_len
        for side in (n // 2, n // 8, 4096, 1024, 64):
            if side < n:
                steps.append((f"zoom {side}", lambda side=side: ex.zoom(rows=slice(end - side, end),
                                                                     cols=slice(end - side, end))))
        steps.append(("zoom 1024, far from the diagonal",
                      lambda: ex.zoom(rows=slice(n - 1024, n), cols=slice(0, 1024))))
        steps.append(("overview again", lambda: ex.overview()))
        steps.append(("open, head mean", lambda: ex.select(head="mean")))
        with tempfile.TemporaryDirectory() as folder:
            saved = Path(folder) / "tiles.safetensors"
            steps.append(("precompute every head and the mean, save", lambda: AttentionTiles(
                trace, progress=False).precompute(layers=[layer]).save(saved)))

            def open_saved(head):
                nonlocal ex
                ex = explore(trace, layer=layer, head=head, max_cells=max_cells, tiles=saved, progress=False)
                ex.widget  # noqa: B018
            steps.append(("open, from saved tiles", lambda: open_saved(1)))
            steps.append(("open, head mean, from saved tiles", lambda: ex.select(head="mean")))
            for name, action in steps:
                seconds = timed(action)
                rows.append(dict(shape=shape, tokens=n, layer=kind, view=name, block=ex.block,
                                 cells=f"{ex.tile.max.shape[0]} x {ex.tile.max.shape[1]}", seconds=seconds,
                                 peak_so_far_above_trace_mib=peak_rss_mib() - before))
        grids = sum(b.max.nbytes + b.sum.nbytes + b.lse.nbytes for b in ex.tiles._bases.values())
        for row in rows:
            if row["layer"] == kind:
                row["grids_mib"] = grids / 2**20
    trace_mib = sum(t.nbytes for t in [*trace.queries, *trace.keys]) / 2**20
    for row in rows:
        row.update(trace_mib=trace_mib, peak_above_trace_mib=peak_rss_mib() - before)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="gemma-3-270m")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 32752])
    parser.add_argument("--max-cells", type=int, default=512, help="the most cells a view draws per side")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(pd.DataFrame(child(args.shape, args.child, args.max_cells)).to_json(orient="records"))
        return
    tables = []
    for n in args.lengths:
        out = subprocess.run([sys.executable, __file__, "--shape", args.shape, "--max-cells", str(args.max_cells),
                              "--child", str(n)], capture_output=True, text=True, check=True)
        tables.append(pd.read_json(io.StringIO(out.stdout.strip().splitlines()[-1])))
        print(tables[-1].to_string(index=False), flush=True)
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    table = pd.concat(tables, ignore_index=True).assign(load_1min=float(load))
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"explorer_{args.shape}_cpu.csv"
    table.to_csv(path, index=False)
    print(f"saved {path} (1-minute load at the end: {load}, {torch.get_num_threads()} threads)")


if __name__ == "__main__":
    main()
