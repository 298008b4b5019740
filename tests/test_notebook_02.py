"""Notebook 02 (the four findings) runs headless with small settings (SNAPKV_LAB_SMALL=1)."""

from __future__ import annotations

import pytest
from test_notebooks import printed, run_notebook


@pytest.mark.notebook
def test_consistency_findings_notebook():
    outputs = run_notebook("02_consistency_findings.ipynb")
    assert "answer:" in printed(outputs)
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 4  # the four findings' figures
