"""Throughput of a sweep's worker layouts on one CPU machine: this process on all cores, one Ray worker on all
cores, and one Ray worker per core (`--cpus-per-worker 1`), on the same eval cells.

    python benchmarks/bench_workers.py                        # 4 cells: niah_single_1 and niah_multivalue at 4k
    python benchmarks/bench_workers.py --tasks vt --limit 1 --layouts local ray-1

Each layout runs the cells from nothing in a data folder of its own (`evaluation.evaluate`, SnapKV and
StreamingLLM at ratio 0.5, both modes, and the full cache: one prefill per cell), so its wall time includes Ray's
start and every worker's model load, as a user's run does. cells/min: cells over wall minutes; "vs local": the
local run's wall over this one's. "same answers": every prediction equal to the local run's (greedy decoding: a
layout changes only how many threads a matrix product uses). Other processes on the machine inflate every timing:
run it alone.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import pandas as pd
from _common import report

from snapkv_lab.evaluation import evaluate

LAYOUTS = {  # name -> (executor, cpus_per_worker)
    "local": ("local", None),
    "ray": ("ray", None),  # one worker per machine, on all of its CPUs
    "ray-1": ("ray", 1),  # one worker per CPU, one torch thread each
}


def run(layout: str, tasks: list[str], limit: int, policies: list[str]) -> tuple[float, pd.DataFrame]:
    executor, cpus_per_worker = LAYOUTS[layout]
    with tempfile.TemporaryDirectory() as data_dir:
        began = time.perf_counter()
        table = evaluate(None, tasks=tasks, policies=policies, ratios=[0.5], limit=limit, data_dir=data_dir,
                         executor=executor, cpus_per_worker=cpus_per_worker, write=False)
        return time.perf_counter() - began, table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", nargs="+", default=["niah_single_1", "niah_multivalue"],
                        help="RULER tasks at 4k (default: a short answer and a long one, 128 tokens)")
    parser.add_argument("--limit", type=int, default=2, help="examples per task (one cell each)")
    parser.add_argument("--policies", nargs="+", default=["SnapKV", "StreamingLLM"])
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    args = parser.parse_args()

    cells = len(args.tasks) * args.limit
    load = os.getloadavg()[0]
    rows, answers = [], {}
    for layout in args.layouts:
        wall, table = run(layout, args.tasks, args.limit, args.policies)
        answers[layout] = table.prediction.tolist()
        executor, cpus_per_worker = LAYOUTS[layout]
        workers = 1 if executor == "local" or cpus_per_worker is None else os.cpu_count() // cpus_per_worker
        rows.append(dict(layout=layout, workers=workers, threads_per_worker=cpus_per_worker or os.cpu_count(),
                         cells=cells, wall_s=round(wall, 1), cells_per_min=round(cells / wall * 60, 2)))
    frame = pd.DataFrame(rows)
    first = args.layouts[0]
    frame[f"vs {first}"] = (frame.wall_s.iloc[0] / frame.wall_s).round(2)
    frame[f"same answers as {first}"] = [answers[layout] == answers[first] for layout in args.layouts]
    report(frame, "workers_smollm2_cpu",
           f"{cells} eval cells ({', '.join(args.tasks)} at 4k, {args.limit} each; {', '.join(args.policies)} at 0.5, "
           f"both modes, and the full cache), {os.cpu_count()} CPUs, load average before: {load:.2f}")


if __name__ == "__main__":
    main()
