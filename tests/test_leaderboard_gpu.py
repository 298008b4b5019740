"""scripts/leaderboard_gpu.sh on the CPU at a tiny random Qwen3 shape, so that the recipe a GPU session runs has run
before it gets there: kvpress's four ratios and both modes through `snapkv-lab eval`, kvpress's files written, and a
rerun resuming from the stored examples."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from snapkv_lab.evaluation.kvpress_format import read_kvpress

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "leaderboard_gpu.sh"


def leaderboard_gpu(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=900,
                          env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "HOME": str(Path.home())})


@pytest.mark.slow
def test_the_recipe_runs_kvpress_protocol_at_a_tiny_qwen3_and_resumes(tmp_path):
    out = tmp_path / "run"
    args = ["--random", "tiny", "--limit", "1", "--tasks", "niah_single_1", "--policies", "SnapKV", "KNorm",
            "--out", str(out)]
    first = leaderboard_gpu(*args)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "eval cells: 1 cells, 0 already in" in first.stderr and "1 to run" in first.stderr  # progress
    assert json.loads((out / "model-tiny" / "config.json").read_text())["model_type"] == "qwen3"
    scores = read_kvpress(out / "kvpress")
    folders = sorted(p.name for p in (out / "kvpress").iterdir())
    assert len(folders) == 1 + 2 * 4 * 2  # the full cache once, 2 policies x 4 ratios x 2 modes
    # kvpress names a folder model by its path, "/" as "--" (evaluate.py:129)
    assert any(name.startswith("ruler__4096__--") and name.endswith("--model-tiny__KNorm__0.88__query_aware")
               for name in folders)
    assert sorted(scores.ratio.unique()) == [0.0, 0.25, 0.5, 0.75, 0.875]
    assert set(scores["mode"]) == {"full", "query-aware", "query-agnostic"} and set(scores.length) == {4096}
    second = leaderboard_gpu(*args)  # resumes: the stored example is not run again
    assert second.returncode == 0, second.stderr[-3000:]
    assert "1 already in" in second.stderr and "0 to run" in second.stderr
    bad = leaderboard_gpu("--random", "huge", "--out", str(tmp_path / "bad"))
    assert bad.returncode != 0 and "--random huge: the shapes are qwen3-8b, tiny" in bad.stderr
