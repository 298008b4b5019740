"""The needle grid as cells, end to end through `snapkv-lab needle`: killed with SIGKILL mid-grid and rerun, and
run on a local Ray cluster, it writes the same table as an uninterrupted run in this process.

The model is a tiny random Llama with SmolLM2's tokenizer (the contexts need its chat template), saved to a
temporary folder; its answers are noise, but greedy decoding makes them the same noise in every run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import pytest
from conftest import make_tiny_llama

ROOT = Path(__file__).resolve().parents[1]
TIMINGS = ["prefill_s", "decode_ms_per_token"]  # wall-clock times: the only columns two runs may differ in
# 2 lengths x 3 depths = 6 cells (contexts), each with the full cache and SnapKV at 64 tokens, query-aware.
LENGTHS, DEPTHS = (200, 300), (0.0, 0.5, 1.0)
GRID = ["--suites", "needle", "--lengths", *map(str, LENGTHS), "--depths", *map(str, DEPTHS), "--samples", "1",
        "--policies", "SnapKV", "--capacities", "64", "--modes", "query-aware"]
N_CELLS = len(LENGTHS) * len(DEPTHS)


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory):
    from transformers import AutoTokenizer

    from snapkv_lab.core.models import bundled_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(bundled_checkpoint())
    model = make_tiny_llama(vocab_size=len(tokenizer), max_position_embeddings=512, eos_token_id=tokenizer.eos_token_id,
                            bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id)
    folder = tmp_path_factory.mktemp("tiny_chat_llama")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def uninterrupted(tiny_chat_model, tmp_path_factory):
    """The grid's table from one uninterrupted run of `pressure.recompute` in this process."""
    from snapkv_lab.pressure import recompute

    data_dir = tmp_path_factory.mktemp("uninterrupted")
    recompute(dict(data_dir=data_dir, model=str(tiny_chat_model), suites=["needle"], lengths=list(LENGTHS),
                   depths=list(DEPTHS), samples=1, policies=["SnapKV"], capacities=[64], modes=["query-aware"]))
    table = pd.read_csv(data_dir / "pressure_needle.csv")
    shutil.rmtree(data_dir, ignore_errors=True)
    assert len(table) == N_CELLS * 2 and set(table.policy) == {"FullCache", "SnapKV"}
    return table


def test_cells_are_keyed_by_every_option_and_ablations_keep_their_own():
    from snapkv_lab.policies import POLICY_NAMES
    from snapkv_lab.pressure import SUITES, grid_cells

    base = dict(suites=["needle", "windows"], lengths=[200], depths=[0.5], samples=1)
    cells = grid_cells(base)
    assert [len(cells[name]) for name in ("needle", "windows")] == [1, 5]
    needle = cells["needle"][0].config
    assert needle["context"] == dict(builder="needle", n_tokens=200, depth=0.5, sample=0)
    assert [p["name"] for p in needle["policies"]] == ["SnapKV", "SnapKVNoPooling", "H2O", "StreamingLLM", "RandomKeep"]
    changed = grid_cells(dict(base, policies=["TOVA"], capacities=[96], modes=["query-agnostic"]))
    assert changed["needle"][0].key != cells["needle"][0].key
    assert (changed["needle"][0].config["capacities"] == [96]
            and changed["needle"][0].config["modes"] == ["query-agnostic"])
    # the window ablation fixes its policies and budget: only the mode it leaves open follows the options
    assert [c.config["policies"] for c in changed["windows"]] == [c.config["policies"] for c in cells["windows"]]
    assert changed["windows"][0].config["capacities"] == list(SUITES["windows"].capacities)
    assert changed["windows"][0].config["modes"] == ["query-agnostic"]
    assert grid_cells(dict(base, model="other"))["needle"][0].key != cells["needle"][0].key
    assert "lines" not in grid_cells(dict(skip_lines=True))
    every = grid_cells(dict(base, suites=["needle"], policies=["all"]))["needle"][0].config["policies"]
    assert [p["name"] for p in every] == [name for name in POLICY_NAMES if name != "FullCache"]


def needle_command(model: Path, data_dir: Path, *extra: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "snapkv_lab", "needle", "--model", str(model), *GRID, "--data-dir",
                             str(data_dir), "--figures-dir", str(data_dir / "figures"), *extra], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(process: subprocess.Popen) -> str:
    """Wait for the command; its stderr (the grid's messages) once it succeeded."""
    out, err = process.communicate(timeout=600)
    assert process.returncode == 0, out + err
    return err


def assert_same_table(path: Path, expected: pd.DataFrame) -> None:
    table = pd.read_csv(path)
    assert list(table.columns) == list(expected.columns)
    pd.testing.assert_frame_equal(table.drop(columns=TIMINGS), expected.drop(columns=TIMINGS))


def test_a_killed_grid_resumes_without_recomputing_its_finished_cells(tiny_chat_model, uninterrupted, tmp_path):
    own = tmp_path / tiny_chat_model.name  # another model than the default writes its own folder
    cells = own / "cells" / "pressure"
    killed = needle_command(tiny_chat_model, tmp_path)
    deadline = time.monotonic() + 300
    while not list(cells.glob("*.parquet")):  # kill it as soon as its first cell is stored
        assert killed.poll() is None, killed.communicate()
        assert time.monotonic() < deadline, "no cell stored within 300 s"
        time.sleep(0.02)
    killed.send_signal(signal.SIGKILL)
    killed.communicate(timeout=60)
    assert killed.returncode == -signal.SIGKILL
    stored = {path.name: (path.stat().st_mtime_ns, path.read_bytes()) for path in cells.glob("*.parquet")}
    assert 1 <= len(stored) < N_CELLS, "the grid finished before it was killed: nothing left to resume"
    assert not (own / "pressure_needle.csv").exists()

    messages = finish(needle_command(tiny_chat_model, tmp_path))
    assert f"{N_CELLS} cells, {len(stored)} already in {cells} (skipped), {N_CELLS - len(stored)} to run" in messages
    for name, (mtime, content) in stored.items():  # the finished cells were read, not recomputed and rewritten
        assert (cells / name).stat().st_mtime_ns == mtime and (cells / name).read_bytes() == content
    assert len(list(cells.glob("*.parquet"))) == N_CELLS
    assert_same_table(own / "pressure_needle.csv", uninterrupted)


def test_the_ray_executor_writes_the_same_table(tiny_chat_model, uninterrupted, tmp_path):
    """On Ray's local cluster, with one-CPU workers (as many as the machine has cores, each taking cells)."""
    pytest.importorskip("ray",
                        reason="the Ray executor needs pip install 'snapkv_lab[ray]' (scripts/install.sh installs it)")
    # Ray's session folder, outside the default /tmp/ray and short: its socket paths must stay under 107 characters.
    # No authentication token either (Ray would write one into ~/.ray): the cluster lives only for this run.
    session = tempfile.mkdtemp(prefix="ray")
    try:
        messages = finish(needle_command(tiny_chat_model, tmp_path, "--executor", "ray", "--cpus-per-worker", "1",
                                         env=dict(RAY_TMPDIR=session, RAY_AUTH_MODE="disabled")))
    finally:
        shutil.rmtree(session, ignore_errors=True)
    assert f"{N_CELLS} cells, 0 already in" in messages and "(ray)" in messages
    assert_same_table(tmp_path / tiny_chat_model.name / "pressure_needle.csv", uninterrupted)


def test_the_needle_budget_audit_recounts_what_the_runs_recorded(tiny_chat_model, uninterrupted, tmp_path):
    """pressure.needle_audit rebuilds each row's context from its columns and its policy from its label, without
    decoding: on the grid's own table (whose runs recorded their entries) it agrees row by row and fills the same
    entries; a row whose recorded run differs from the rebuild is refused, not filled."""
    from snapkv_lab.compression.entries import ENTRY_COLUMNS
    from snapkv_lab.pressure.needle_audit import audit_tables, fill_table

    stored = uninterrupted.drop(columns=ENTRY_COLUMNS)  # as the tables made before the columns existed
    audited = audit_tables({"pressure_needle.csv": stored}, model=str(tiny_chat_model), data_dir=tmp_path)
    assert len(audited) == len(stored) and audited.agrees.all()
    filled = fill_table(stored, audited, "pressure_needle.csv")
    pd.testing.assert_frame_equal(filled, uninterrupted, check_dtype=False)
    compressed = filled[filled.policy == "SnapKV"]
    assert (compressed.kv_share < 1).all() and (filled[filled.policy == "FullCache"].kv_share == 1).all()
    moved = stored.assign(cache_length=stored.cache_length.where(stored.policy != "SnapKV", 65))
    again = audit_tables({"pressure_needle.csv": moved}, model=str(tiny_chat_model), data_dir=tmp_path)  # from cells
    assert (~again.agrees).sum() == N_CELLS
    with pytest.raises(ValueError, match=f"{N_CELLS} of {2 * N_CELLS} rows rebuild otherwise"):
        fill_table(moved, again, "pressure_needle.csv")


def test_needle_rows_name_the_context_their_suite_built():
    from snapkv_lab.pressure.grid import dev_needle_specs, haystack_specs, ruler_specs
    from snapkv_lab.pressure.needle_audit import context_spec, read_label, row_specs

    needle = dict(task="needle", haystack="essays", length=4000, depth=0.25, sample=2)
    assert context_spec(needle) in dev_needle_specs({})  # the essays are the needle builder's default haystack
    assert context_spec(dict(needle, haystack="logs", sample=0)) in haystack_specs({})
    ruler = dict(task="multivalue", value_kind="word", length=4000, sample=0)
    assert context_spec(ruler) in ruler_specs({})
    lines = pd.DataFrame(dict(task="lines", length=2000, sample=[0, 0, 0, 0, 1, 1], key=["a", "b", "c", "a", "a", "d"]))
    specs = [json.loads(spec) for spec in row_specs(pd.concat([lines, pd.DataFrame([needle])], ignore_index=True))]
    assert specs[0] == dict(builder="lines", n_tokens=2000, n_queries=3, sample=0)  # a, b, c asked of sample 0
    assert specs[4] == dict(builder="lines", n_tokens=2000, n_queries=2, sample=1)
    assert specs[6] == context_spec(needle)
    with pytest.raises(ValueError, match="no context builder"):
        context_spec(dict(needle, task="summary"))
    assert read_label("HeadKV(policy=SnapKV(window_size=32), redistribute=True)").policy.window_size == 32
    with pytest.raises(ValueError, match="unknown policy"):
        read_label("SnapKv")
