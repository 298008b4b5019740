"""Notebook 05 (a benchmark run, explained) runs headless with small settings (SNAPKV_LAB_SMALL=1)."""

from __future__ import annotations

import pytest
from test_notebooks import count_plotly, printed, run_notebook


@pytest.mark.notebook
@pytest.mark.slow
def test_benchmark_explained_notebook():
    outputs = run_notebook("05_benchmark_explained.ipynb")
    text = printed(outputs)
    assert "tasks the full cache fails" in text and "References:" in text
    assert "of the full cache's answer attention" in text and "Of the needle's tokens it kept" in text
    assert "KV heads kept under half of a needle" in text
    pages = "".join(o.get("data", {}).get("text/html", "") for o in outputs)
    assert "red box" in pages and "coverage" in pages  # the explanation's kept-token view and summary
    assert "p_holm" in pages  # StreamingLLM read against SnapKV on the same examples
    # its p is not adjusted over its own run: the run is not in the family, whose verdicts are read beside it
    assert "no adjusted p" in text and "the family's verdicts on these policies" in text
    assert "eval_ruler.csv" in pages and "answered" in pages  # the family's rows: the committed leaderboard's
    assert count_plotly(outputs) >= 1
