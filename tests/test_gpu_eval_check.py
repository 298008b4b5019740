"""scripts/gpu_eval_check.py on the CPU, at the toy shape, so that the script a GPU session runs has run before it
gets there: both steps, the rows it writes, the policies it leaves out."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_eval_check.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=900)


def test_gpu_eval_check_runs_the_policies_it_names_in_groups_at_the_toy_shape(tmp_path):
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
