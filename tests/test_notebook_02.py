"""Notebook 02 (the four findings) runs headless with small settings (SNAPKV_LAB_SMALL=1)."""

from __future__ import annotations

import pytest
from test_notebooks import printed, run_notebook


@pytest.mark.notebook
def test_consistency_findings_notebook():
    outputs = run_notebook("02_consistency_findings.ipynb")
    assert "answer:" in printed(outputs) and "sink positions per head" in printed(outputs)
    # (b), its windows, selection, heads, (a) and its baselines, (c) and its baselines, (d)
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 9
    verdicts = "".join(o.get("data", {}).get("text/markdown", "") for o in outputs)
    assert "| finding |" in verdicts and "held-out" in verdicts  # the verdict table, both splits
    tables = "".join(o.get("data", {}).get("text/html", "") for o in outputs)
    assert "ci_low" in tables  # intervals shown
