"""The sweep package: cell keys, the parquet store and its manifest, and the local executor's skip-and-resume."""

from __future__ import annotations

import json
import sys

import pandas as pd
import pytest

from snapkv_lab.sweep import Cell, ResultStore, run_cells

CALLS: list[int] = []  # the x of every cell the work functions below ran, in order


def no_model(name):
    return None, None


def square(model, tokenizer, config) -> pd.DataFrame:
    CALLS.append(config["x"])
    return pd.DataFrame({"x": [config["x"]] * 2, "square": [config["x"] ** 2] * 2, "part": ["a", "b"]})


def square_until_three(model, tokenizer, config) -> pd.DataFrame:
    if config["x"] == 3:
        raise RuntimeError("killed at x=3")
    return square(model, tokenizer, config)


@pytest.fixture(autouse=True)
def fresh_calls():
    CALLS.clear()


def cells(xs, **extra):
    return [Cell("square", dict(x=x, **extra)) for x in xs]


def test_keys_follow_the_whole_config_not_its_spelling():
    assert Cell("k", dict(a=1, b=[1, 2])).key == Cell("k", dict(b=(1, 2), a=1)).key
    assert Cell("k", dict(a=1)).key != Cell("k", dict(a=2)).key
    assert Cell("k", dict(a=1)).key != Cell("other", dict(a=1)).key
    assert Cell("k", dict(a=1, model=None)).key != Cell("k", dict(a=1, model="some/model")).key
    assert len({Cell("k", dict(a=1)), Cell("k", dict(a=1))}) == 1
    with pytest.raises(TypeError, match="JSON-able"):
        Cell("k", dict(policy=object()))
    with pytest.raises(TypeError, match="JSON-able"):
        Cell("k", dict(budget=float("nan")))


def test_store_round_trips_a_table_and_refuses_one_it_would_change(tmp_path):
    store = ResultStore(tmp_path / "cells")
    cell = Cell("k", dict(a=1))
    assert not store.done(cell)
    table = pd.DataFrame({"capacity": pd.array([None, 256], dtype="Int64"), "share": [0.1 + 0.2, 1 / 3],
                          "text": ["9935848.", ""], "correct": [True, False]})
    store.put(cell, table)
    assert store.done(cell)
    assert store.get(cell).to_csv(index=False) == table.to_csv(index=False)
    assert [p.name for p in (tmp_path / "cells").iterdir()] == [f"{cell.key}.parquet"]  # no temporary file left

    mixed = pd.DataFrame({"capacity": [pd.NA, 256]}, dtype=object)  # would come back as floats: "256.0"
    with pytest.raises(TypeError, match=r"\['capacity'\]"):
        store.put(Cell("k", dict(a=2)), mixed)
    with pytest.raises(TypeError, match="parquet"):
        store.put(Cell("k", dict(a=3)), pd.DataFrame({"expected": ["1", ["2", "3"]]}))
    assert sorted(p.name for p in (tmp_path / "cells").iterdir()) == [f"{cell.key}.parquet"]
    with pytest.raises(KeyError, match="not in"):
        store.get(Cell("k", dict(a=4)))


def test_manifest_appends_each_run_with_versions(tmp_path):
    store = ResultStore(tmp_path)
    store.write_manifest("snapkv-lab needle --lengths 200", dict(lengths=[200]), model=None, seeds=[0, 1])
    path = store.write_manifest("snapkv-lab needle --lengths 200", dict(lengths=[200]), model="tiny", seeds=[0])
    runs = json.loads(path.read_text())["runs"]
    assert [r["model"] for r in runs] == [None, "tiny"]
    assert runs[0]["options"] == dict(lengths=[200]) and runs[0]["seeds"] == [0, 1]
    assert set(runs[0]["versions"]) >= {"python", "torch", "transformers", "snapkv_lab"}
    assert runs[0]["versions"]["torch"] is not None
    assert runs[0]["git"] is None or len(runs[0]["git"]["commit"]) == 40


def test_a_runs_log_goes_to_the_manifest_when_it_finishes(tmp_path):
    store = ResultStore(tmp_path)
    manifest = dict(command="snapkv-lab needle", options={}, model=None, seeds=[0])
    run_cells(cells([1, 2]), square, store, loader=no_model, manifest=manifest)
    run_cells(cells([1, 2, 3]), square, store, loader=no_model, manifest=manifest)
    runs = json.loads((tmp_path / "manifest.json").read_text())["runs"]
    assert [(r["cells"], r["cells_run"]) for r in runs] == [(2, 2), (3, 1)]
    assert all(r["finished"] >= r["started"] and r["seconds"] >= 0 and len(r["load_average_at_end"]) == 3 for r in runs)
    with pytest.raises(RuntimeError, match="x=3"):  # a failed run has started, not finished
        run_cells(cells([3, 4], scale=2), square_until_three, store, loader=no_model, manifest=manifest)
    runs = json.loads((tmp_path / "manifest.json").read_text())["runs"]
    assert len(runs) == 3 and "finished" not in runs[-1]
    with pytest.raises(ValueError, match="no run to finish"):
        ResultStore(tmp_path / "empty").finish_manifest(seconds=1)


def test_local_run_skips_finished_cells_and_returns_the_same_table(tmp_path, capsys):
    store = ResultStore(tmp_path)
    first = run_cells(cells([1, 2]), square, store, loader=no_model)
    assert CALLS == [1, 2]
    assert first.x.tolist() == [1, 1, 2, 2] and first.square.tolist() == [1, 1, 4, 4]
    assert "0 already in" in capsys.readouterr().err

    CALLS.clear()
    again = run_cells(cells([3, 1, 2]), square, store, loader=no_model)
    assert CALLS == [3]  # 1 and 2 came from the store
    assert "3 cells, 2 already in" in capsys.readouterr().err
    assert again.x.tolist() == [3, 3, 1, 1, 2, 2]  # the order of the cells, not of the work
    pd.testing.assert_frame_equal(again.iloc[2:].reset_index(drop=True), first)

    CALLS.clear()
    other = run_cells(cells([1], scale=2), square, store, loader=no_model)  # a changed option: a new cell
    assert CALLS == [1] and len(other) == 2


def test_a_failed_run_keeps_its_finished_cells_and_resumes(tmp_path):
    store = ResultStore(tmp_path)
    with pytest.raises(RuntimeError, match="x=3"):
        run_cells(cells([1, 2, 3, 4]), square_until_three, store, loader=no_model)
    assert CALLS == [1, 2]
    CALLS.clear()
    resumed = run_cells(cells([1, 2, 3, 4]), square, store, loader=no_model)
    assert CALLS == [3, 4]
    CALLS.clear()
    uninterrupted = run_cells(cells([1, 2, 3, 4]), square, ResultStore(tmp_path / "fresh"), loader=no_model)
    pd.testing.assert_frame_equal(resumed, uninterrupted)


def negate(model, tokenizer, config) -> pd.DataFrame:
    CALLS.append(-config["x"])
    return pd.DataFrame({"x": [config["x"]], "square": [-config["x"]], "part": ["n"]})


def test_cells_of_several_kinds_run_with_their_own_work_function(tmp_path):
    mixed = [Cell("square", dict(x=2)), Cell("negate", dict(x=2)), Cell("square", dict(x=3))]
    table = run_cells(mixed, dict(square=square, negate=negate), ResultStore(tmp_path), loader=no_model)
    assert CALLS == [2, -2, 3]
    assert table.square.tolist() == [4, 4, -2, 9, 9]
    with pytest.raises(ValueError, match=r"kind \['negate'\]"):
        run_cells(mixed, dict(square=square), ResultStore(tmp_path / "other"), loader=no_model)


def test_the_model_is_loaded_only_when_a_cell_is_left(tmp_path):
    loaded = []
    store = ResultStore(tmp_path)
    run_cells(cells([1]), square, store, loader=lambda name: loaded.append(name) or (None, None), model="m")
    run_cells(cells([1]), square, store, loader=lambda name: loaded.append(name) or (None, None), model="m")
    assert loaded == ["m"]


def test_bad_executor_options_are_refused(tmp_path, monkeypatch):
    store = ResultStore(tmp_path)
    with pytest.raises(ValueError, match="one of"):
        run_cells(cells([1]), square, store, executor="dask", loader=no_model)
    with pytest.raises(ValueError, match="--executor ray"):
        run_cells(cells([1]), square, store, ray_address="auto", loader=no_model)
    with pytest.raises(ValueError, match=r"cpus_per_worker \(--cpus-per-worker\) is only used with"):
        run_cells(cells([1]), square, store, cpus_per_worker=1, loader=no_model)
    for bad in (0, 1.5):
        with pytest.raises(ValueError, match="positive number of CPUs"):
            run_cells(cells([1]), square, store, executor="ray", cpus_per_worker=bad, loader=no_model)
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'snapkv_lab\[ray\]'"):
        run_cells(cells([1]), square, store, executor="ray", loader=no_model)
    assert CALLS == []


def test_ray_workers_take_a_node_whole_or_as_many_cpus_per_worker_as_asked(capsys):
    """Without GPUs: one actor per live node holding all of its CPUs, or with cpus_per_worker as many actors of that
    many CPUs (and torch threads) as each node holds; never more actors than cells. With GPUs: one per GPU, and
    cpus_per_worker said to be unused."""
    pytest.importorskip("ray", reason="the Ray executor needs pip install 'snapkv_lab[ray]'")
    from snapkv_lab.sweep.executors import _start_actors

    class FakeRay:
        def __init__(self, gpus=0):
            self.gpus = gpus

        def nodes(self):
            return [dict(NodeID="a" * 56, Alive=True, Resources=dict(CPU=2.0)),
                    dict(NodeID="b" * 56, Alive=True, Resources=dict(CPU=5.0)),
                    dict(NodeID="c" * 56, Alive=False, Resources=dict(CPU=8.0))]

        def cluster_resources(self):
            return dict(CPU=7.0, GPU=float(self.gpus))

        def remote(self, cls):
            class Actor:
                def options(self, num_cpus=None, num_gpus=None, scheduling_strategy=None):
                    node = scheduling_strategy.node_id[0] if scheduling_strategy else None
                    return type("Bound", (), dict(remote=lambda _, model, loader, threads:
                                                  (node, num_gpus or num_cpus, threads)))()
            return Actor()

    ray = FakeRay()
    assert _start_actors(ray, None, no_model, 10) == [("a", 2, 2), ("b", 5, 5)]
    assert _start_actors(ray, None, no_model, 10, cpus_per_worker=2) == [("a", 2, 2), ("b", 2, 2), ("b", 2, 2)]
    assert _start_actors(ray, None, no_model, 2, cpus_per_worker=1) == [("a", 1, 1), ("a", 1, 1)]
    with pytest.raises(RuntimeError, match="no node of the Ray cluster has 6 CPUs"):
        _start_actors(ray, None, no_model, 10, cpus_per_worker=6)
    capsys.readouterr()
    assert _start_actors(FakeRay(gpus=2), None, no_model, 10, cpus_per_worker=1) == [(None, 1, None)] * 2
    assert "cpus_per_worker=1 is not used: the cluster has GPUs" in capsys.readouterr().err


def test_cells_of_a_cuda_model_run_without_cudnn_attention_and_cpu_cells_untouched(tmp_path):
    """A grid meets a new sequence length at nearly every step, and sdpa's cuDNN backend builds a plan per new length
    (60x a warm decode step on an H100): cells of a CUDA model run without it, and the setting is restored after."""
    import torch

    class OnCuda:
        device = torch.device("cuda")

    seen = []

    def record(model, tokenizer, config) -> pd.DataFrame:
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return pd.DataFrame({"x": [config["x"]]})

    assert torch.backends.cuda.cudnn_sdp_enabled()
    run_cells(cells([1, 2]), record, ResultStore(tmp_path / "cuda"), loader=lambda name: (OnCuda(), None))
    run_cells(cells([1]), record, ResultStore(tmp_path / "cpu"), loader=lambda name: (torch.nn.Linear(1, 1), None))
    assert seen == [False, False, True] and torch.backends.cuda.cudnn_sdp_enabled()
