"""Wall-clock timing that is right on a GPU: CUDA kernels run asynchronously, so a clock read without a
synchronisation measures the launch, not the work.

    with stopwatch(device) as elapsed:      # synchronises before starting and before stopping
        model(ids)
    elapsed.seconds

    timer = SectionTimer(device)             # sections inside a hot path, with no host sync inside them
    with timer.section():
        ...                                  # CUDA events on a GPU, perf_counter on CPU
    timer.seconds                            # one synchronisation, when read
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch


def synchronize(device) -> None:
    """Wait for every kernel queued on `device` (a no-op on CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Elapsed:
    """Seconds measured by `stopwatch`, filled in when the block ends."""

    seconds: float = float("nan")


@contextmanager
def stopwatch(device):
    """Time a block on `device`: synchronise, read the clock, run the block, synchronise, read the clock."""
    elapsed = Elapsed()
    synchronize(device)
    began = time.perf_counter()
    yield elapsed
    synchronize(device)
    elapsed.seconds = time.perf_counter() - began


def ms_per_token(step_seconds) -> float:
    """Decode speed: the mean wall time of the decode steps in milliseconds, NaN when nothing was decoded (an answer of
    one token comes from the prefill's logits: no step was timed, and 0 ms would read as infinitely fast)."""
    return 1000 * sum(step_seconds) / len(step_seconds) if len(step_seconds) else float("nan")


def over_full_cache(table, columns=("prefill_s", "decode_ms", "kv_mib", "extra_mb"), by=("tokens", "batch")):
    """A timing table with `<column>_vs_full` beside each of `columns` it has: the row's value over the FullCache
    row's with the same `by` values (NaN where no FullCache row matches). table: one row per (by..., policy)."""
    table = table.copy()
    full = table[table.policy == "FullCache"].set_index(list(by))
    keys = list(zip(*(table[column] for column in by)))
    for column in columns:
        if column in table:
            table[f"{column}_vs_full"] = table[column].to_numpy() / [full[column].get(key, float("nan"))
                                                                     for key in keys]
    return table


class SectionTimer:
    """Adds up the time of code sections on one device without synchronising inside them.

    On CUDA each section records a pair of events; reading `seconds` synchronises once and sums them.
    On CPU the work is synchronous and perf_counter is exact.
    """

    def __init__(self, device):
        self.device = torch.device(device)
        self._cpu_seconds = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @contextmanager
    def section(self):
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((start, end))
        else:
            began = time.perf_counter()
            yield
            self._cpu_seconds += time.perf_counter() - began

    @property
    def seconds(self) -> float:
        if self._events:
            self._events[-1][1].synchronize()
        return self._cpu_seconds + sum(start.elapsed_time(end) for start, end in self._events) / 1000
