"""Where the test suite's time goes, per xdist worker: a pytest plugin that logs each test's start and end, and a
summary of that log, one row per worker and test file, in the order each worker ran them.

    PYTHONPATH=benchmarks python3 -m pytest -q -p suite_timeline        # logs to $SUITE_TIMELINE (suite_timeline.jsonl)
    python3 benchmarks/suite_timeline.py suite_timeline.jsonl           # the table (files under --least s left out)

docs/performance.md ("The test suite's time") reads the suite's balance from it: when each worker started and
finished, and what it ran.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import pandas as pd

LOG = os.environ.get("SUITE_TIMELINE", "suite_timeline.jsonl")
_started: dict[str, float] = {}


def pytest_runtest_logstart(nodeid, location):
    _started[nodeid] = time.time()


def pytest_runtest_logfinish(nodeid, location):
    # under xdist the controller hears every test too: its rows (worker "main") are left out of the summary
    start = _started.pop(nodeid)
    with open(LOG, "a") as log:
        log.write(json.dumps(dict(worker=os.environ.get("PYTEST_XDIST_WORKER", "main"), test=nodeid, start=start,
                                  end=time.time())) + "\n")


def by_file(path: str) -> pd.DataFrame:
    """One row per (worker, test file) of a timeline log: seconds from the first test's start to the file's first
    start and last end, and the seconds its tests ran."""
    tests = pd.read_json(path, lines=True)
    tests = tests[tests.worker != "main"] if (tests.worker != "main").any() else tests
    origin = tests.start.min()
    tests = tests.assign(file=tests.test.str.split("::").str[0].str.split("/").str[-1],
                         first=tests.start - origin, last=tests.end - origin, seconds=tests.end - tests.start)
    table = tests.groupby(["worker", "file"], sort=False).agg(first=("first", "min"), last=("last", "max"),
                                                              seconds=("seconds", "sum"), tests=("test", "size"))
    return table.reset_index().sort_values(["worker", "first"]).round(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", nargs="?", default=LOG)
    parser.add_argument("--least", type=float, default=8.0, help="leave out files that ran fewer seconds")
    args = parser.parse_args()
    table = by_file(args.log)
    workers = table.groupby("worker").agg(first=("first", "min"), last=("last", "max"), busy=("seconds", "sum"))
    print(workers.round(1).to_string(), end="\n\n")
    print(table[table.seconds >= args.least].to_string(index=False))


if __name__ == "__main__":
    main()
