"""Executors: run a grid's cells in this process ("local") or on Ray ("ray"), storing each finished cell at once.

    table = run_cells(cells, work, ResultStore(data_dir / "cells" / "needle"), model=None, executor="ray")

`work(model, tokenizer, config) -> DataFrame` is a module-level function (Ray pickles it by name). On Ray, each
actor loads the model once and takes cells until none are left: one actor per GPU (num_gpus=1) when the cluster
has GPUs, else one per node using all of its CPUs. Only this process writes to the store, so workers on other
machines need no shared disk: their tables come back to the driver.

On a CUDA model every cell runs with sdpa's cuDNN backend turned off (`many_shapes_attention`): a grid meets a new
(query, key) length at nearly every step, and cuDNN builds a plan per new length. Measured on an H100 in bf16
(docs/performance.md, "Cold vs warm decode"): PyramidKV's first decode of an 8k prompt took 1330 ms per token with
cuDNN and 23 ms without; warm, the two differ by under 10%.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import nullcontext

import pandas as pd

from ..core.progress import progress_bar
from .store import Cell, ResultStore

EXECUTORS = ("local", "ray")
RAY_INSTALL = "pip install 'snapkv_lab[ray]' (or: pip install ray)"


def check_executor(executor: str, *, ray_address: str | None = None, cpus_per_worker: int | None = None) -> None:
    """Refuse, with a ValueError naming both the argument and its command-line flag, an unknown executor, Ray's
    options without executor "ray", and a cpus_per_worker that is not a positive whole number. run_cells calls it;
    so does the command line, before any model is looked at."""
    if executor not in EXECUTORS:
        raise ValueError(f"executor must be one of {EXECUTORS}, got {executor!r}")
    ray_only = [f"{name} (--{name.replace('_', '-')})" for name, value in
                (("ray_address", ray_address), ("cpus_per_worker", cpus_per_worker)) if value is not None]
    if ray_only and executor != "ray":
        raise ValueError(f"{' and '.join(ray_only)} {'is' if len(ray_only) == 1 else 'are'} only used with "
                         "executor='ray' (--executor ray)")
    if cpus_per_worker is not None and (int(cpus_per_worker) != cpus_per_worker or cpus_per_worker < 1):
        raise ValueError(f"cpus_per_worker is a positive number of CPUs, got {cpus_per_worker!r}")


def run_cells(cells, work, store: ResultStore, *, model=None, executor: str = "local", ray_address: str | None = None,
              cpus_per_worker: int | None = None, desc: str = "grid", loader=None,
              manifest: dict | None = None) -> pd.DataFrame:
    """Run every cell not yet in `store` with `work(model, tokenizer, cell.config)` and write each finished table to
    the store at once; say how many cells were skipped; one progress bar (done / skipped / remaining).

    work: a module-level function, or a dict kind -> function for a grid whose cells are of several kinds.
    model: the model name given to `loader` (default `models.load_model`: None is the bundled SmolLM2), loaded once
    here (local) or once per Ray actor, and only when a cell is left to run. loader must be module-level for Ray.
    executor: "local" or "ray"; ray_address: an existing cluster ("auto", "ray://head:10001", ...), else Ray
    starts a local one for this run and stops it after. cpus_per_worker (Ray on a cluster without GPUs): each actor
    takes that many CPUs and runs torch on as many threads, as many actors per node as fit (None: one per node
    holding all of its CPUs): e.g. 1 to run as many cells at once as one machine has cores (the leaderboard's
    examples ran on this lab's 2-core machine as two one-thread processes side by side).
    manifest: the arguments of `store.write_manifest` (command, options, model, seeds), written once the options
    are checked, before any cell runs; when every cell has finished, the run's log is added to it (cells, cells
    run, wall and CPU seconds of this process, torch threads, load average: `store.finish_manifest`).
    Returns every cell's table, read back from the store, concatenated in the order of `cells`, so a resumed run
    returns the same table as an uninterrupted one.
    """
    check_executor(executor, ray_address=ray_address, cpus_per_worker=cpus_per_worker)
    if executor == "ray":
        import_ray()  # a missing Ray is said before any work, not after the local cells
    cells = list(cells)
    if isinstance(work, dict):
        missing = sorted({cell.kind for cell in cells} - set(work))
        if missing:
            raise ValueError(f"no work function for the cells of kind {missing}; work has {sorted(work)}")
    if manifest is not None:
        store.write_manifest(**manifest)
    unique = list({cell.key: cell for cell in cells}.values())
    pending = [cell for cell in unique if not store.done(cell)]
    skipped = len(unique) - len(pending)
    print(f"{desc}: {len(unique)} cells, {skipped} already in {store.root} (skipped), {len(pending)} to run "
          f"({executor})", file=sys.stderr, flush=True)
    began, cpu = time.perf_counter(), time.process_time()
    bar = progress_bar(total=len(unique), desc=desc)
    bar.update(skipped)
    counts = dict(done=0, skipped=skipped, remaining=len(pending))
    bar.set_postfix(counts, refresh=False)

    def finished(cell: Cell, table: pd.DataFrame) -> None:
        store.put(cell, table)
        counts["done"] += 1
        counts["remaining"] -= 1
        bar.set_postfix(counts, refresh=False)
        bar.update()

    try:
        if pending:
            load = loader or _load_model
            if executor == "local":
                model_and_tokenizer = load(model)
                for cell in pending:
                    with many_shapes_attention(model_and_tokenizer[0]):
                        table = _work_of(work, cell)(*model_and_tokenizer, cell.config)
                    finished(cell, table)
            else:
                _run_ray(pending, work, model, load, ray_address, cpus_per_worker, finished)
    finally:
        bar.close()
    if manifest is not None:
        import torch

        store.finish_manifest(cells=len(unique), cells_run=len(pending), seconds=round(time.perf_counter() - began),
                              cpu_seconds=round(time.process_time() - cpu), torch_threads=torch.get_num_threads(),
                              load_average_at_end=[round(x, 2) for x in os.getloadavg()])
    return store.table(cells)


def many_shapes_attention(model):
    """A context for runs of many distinct sequence lengths: sdpa without its cuDNN backend where `model` is on a CUDA
    device (flash, memory-efficient and math stay allowed, in torch's order), nothing elsewhere."""
    device = getattr(model, "device", None)
    if getattr(device, "type", None) != "cuda":
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def _work_of(work, cell: Cell):
    return work[cell.kind] if isinstance(work, dict) else work


def _load_model(name):
    from ..core.models import load_model

    return load_model(name)


def import_ray():
    try:
        import ray
    except ModuleNotFoundError as err:
        if err.name != "ray":
            raise
        raise ModuleNotFoundError(f"--executor ray needs Ray, an optional dependency: {RAY_INSTALL}") from None
    return ray


class CellWorker:
    """The body of a Ray actor: loads the model once, then runs the cells it is given."""

    def __init__(self, model, loader, threads: int | None):
        if threads:  # the CPUs Ray granted this actor, as the local executor would use them
            import torch

            torch.set_num_threads(threads)
        self.model, self.tokenizer = loader(model)

    def run(self, work, config: dict) -> pd.DataFrame:
        with many_shapes_attention(self.model):
            return work(self.model, self.tokenizer, config)


def _start_actors(ray, model, loader, n_cells: int, cpus_per_worker: int | None = None) -> list:
    """One actor per GPU of the cluster (num_gpus=1); without GPUs, one per node holding all of its CPUs, or with
    cpus_per_worker, as many actors of that many CPUs as each node holds."""
    actor = ray.remote(CellWorker)
    gpus = int(ray.cluster_resources().get("GPU", 0))
    if gpus:
        if cpus_per_worker is not None:
            print(f"cpus_per_worker={cpus_per_worker} is not used: the cluster has GPUs, one worker per GPU",
                  file=sys.stderr, flush=True)
        return [actor.options(num_gpus=1).remote(model, loader, None) for _ in range(min(gpus, n_cells))]
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    slots = []  # (node, cpus) per actor, node by node
    for node in ray.nodes():
        cpus = int(node["Resources"].get("CPU", 0)) if node["Alive"] else 0
        if cpus_per_worker is None:
            slots += [(node, cpus)] if cpus >= 1 else []
        else:
            slots += [(node, cpus_per_worker)] * (cpus // cpus_per_worker)
    if cpus_per_worker is not None and not slots:
        raise RuntimeError(f"no node of the Ray cluster has {cpus_per_worker} CPUs for a worker: "
                           f"{ray.cluster_resources()}")
    return [actor.options(num_cpus=cpus, scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False))
            .remote(model, loader, cpus) for node, cpus in slots[:n_cells]]


def _start_local_cluster(ray, attempts: int = 2) -> None:
    """A Ray cluster on this machine with all of its CPUs. Ray gives its node 30 s (fixed) to register, which a
    busy machine can miss: then it tries again, once."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    for attempt in range(1, attempts + 1):
        try:
            ray.init(address="local", num_cpus=cpus, include_dashboard=False)
            return
        except Exception as err:  # Ray raises a bare Exception for this timeout
            if "timed out during startup" not in str(err) or attempt == attempts:
                raise
            ray.shutdown()
            print(f"Ray's local cluster did not start in time ({err}); trying again", file=sys.stderr, flush=True)


def _run_ray(pending: list[Cell], work, model, loader, ray_address, cpus_per_worker, finished) -> None:
    """Keep every actor busy with one cell; store each table as it comes back (in completion order)."""
    ray = import_ray()
    started = not ray.is_initialized()
    if started and ray_address:
        ray.init(address=ray_address)
    elif started:
        _start_local_cluster(ray)
    actors = []
    try:
        actors = _start_actors(ray, model, loader, len(pending), cpus_per_worker)
        if not actors:
            raise RuntimeError("the Ray cluster has no GPU and no node with a CPU to run cells on: "
                               f"{ray.cluster_resources()}")
        queue, running = list(reversed(pending)), {}

        def submit(actor) -> None:
            cell = queue.pop()
            running[actor.run.remote(_work_of(work, cell), cell.config)] = (actor, cell)

        for actor in actors[:len(queue)]:
            submit(actor)
        while running:
            [ref], _ = ray.wait(list(running), num_returns=1)
            actor, cell = running.pop(ref)
            finished(cell, ray.get(ref))
            if queue:
                submit(actor)
    finally:
        for actor in actors:
            ray.kill(actor)
        if started:
            ray.shutdown()
