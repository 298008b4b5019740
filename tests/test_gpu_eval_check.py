"""scripts/gpu_eval_check.py on the CPU, at the toy shape, so that the script a GPU session runs has run before it
gets there: both steps, the rows it writes, the policies it leaves out."""

from __future__ import annotations

import json
import select
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_eval_check.py"

# One interpreter runs the script once per command line, as `python scripts/gpu_eval_check.py ...` would (its
# `__main__` block, sys.argv, exit status; stdout and stderr captured per run), so that torch, transformers and the
# package are imported once rather than once per run. It reads one JSON argv per line and answers one JSON line.
RUNNER = r"""
import contextlib, io, json, runpy, sys, traceback
script = sys.argv[1]
for line in sys.stdin:
    out, err = io.StringIO(), io.StringIO()
    sys.argv = [script, *json.loads(line)]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as exit:  # as the interpreter exits: None is 0, an int itself, anything else printed, 1
            if exit.code is None or isinstance(exit.code, int):
                code = exit.code or 0
            else:
                print(exit.code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
    print(json.dumps([code, out.getvalue(), err.getvalue()]), flush=True)
"""


@pytest.fixture
def run():
    """run(*args) -> CompletedProcess of `python scripts/gpu_eval_check.py *args`, in the runner's interpreter."""
    runner = subprocess.Popen([sys.executable, "-c", RUNNER, str(SCRIPT)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)

    def run(*args: str) -> subprocess.CompletedProcess:
        runner.stdin.write(json.dumps(args) + "\n")
        runner.stdin.flush()
        if not select.select([runner.stdout], [], [], 900)[0]:  # as subprocess.run(..., timeout=900) per run
            runner.kill()
            raise subprocess.TimeoutExpired(args, 900)
        reply = runner.stdout.readline()
        assert reply, f"the runner exited ({runner.wait(timeout=60)})"
        code, out, err = json.loads(reply)
        return subprocess.CompletedProcess([sys.executable, str(SCRIPT), *args], code, out, err)

    yield run
    runner.stdin.close()
    try:
        runner.wait(timeout=60)
    except subprocess.TimeoutExpired:
        runner.kill()


def test_gpu_eval_check_runs_the_policies_it_names_in_groups_at_the_toy_shape(tmp_path, run):
    prepared = run("prepare", str(tmp_path / "tokenizer"))
    assert prepared.returncode == 0, prepared.stderr[-2000:]
    done = run("run", str(tmp_path / "tokenizer"), "--out", str(tmp_path / "out"), "--shape", "tiny",
               "--length", "1024", "--modes", "query-agnostic", "--group", "1",
               "--policies", "SnapKV", "HeadKV", "PyramidKV", "--model-folder", str(tmp_path / "model"))
    assert done.returncode == 0, done.stderr[-3000:]
    built = (tmp_path / "model" / "model.safetensors").stat().st_mtime_ns
    table = pd.read_csv(tmp_path / "out" / "eval_gpu_query-agnostic.csv")
    assert table.policy.tolist() == ["FullCache", "SnapKV", "PyramidKV"]  # HeadKV is skipped by default
    full = table[table["mode"] == "full"]
    assert len(full) == 1 and (full.kept_tokens == full.prompt_tokens).all()
    squeezed = table[table["mode"] == "query-agnostic"]
    assert (squeezed.kept_tokens < squeezed.prompt_tokens).all() and (squeezed.new_tokens == 128).all()
    assert done.stdout.count("| FullCache |") == 2  # a table per group, each with its full-cache row: one kept

    again = run("run", str(tmp_path / "tokenizer"), "--out", str(tmp_path / "again"), "--shape", "tiny",
                "--length", "1024", "--modes", "query-agnostic", "--policies", "SnapKV", "--cudnn",
                "--model-folder", str(tmp_path / "model"))
    assert again.returncode == 0, again.stderr[-3000:]
    assert (tmp_path / "model" / "model.safetensors").stat().st_mtime_ns == built  # read back, not built again
    assert pd.read_csv(tmp_path / "again" / "eval_gpu_query-agnostic.csv").policy.tolist() == ["FullCache", "SnapKV"]

    other = run("run", str(tmp_path / "tokenizer"), "--out", str(tmp_path / "other"), "--shape", "llama3-8b",
                "--modes", "query-agnostic", "--policies", "SnapKV", "--model-folder", str(tmp_path / "model"))
    assert other.returncode != 0 and "another shape than llama3-8b" in other.stderr  # the tiny model is not reused
    assert "'hidden_size': (256, 4096)" in other.stderr
    assert not (tmp_path / "other" / "eval_gpu_query-agnostic.csv").exists()
