"""Notebook 02 (the four findings) runs headless with small settings (SNAPKV_LAB_SMALL=1)."""

from __future__ import annotations

import pytest
from test_notebooks import run_notebook


@pytest.mark.notebook
def test_consistency_findings_notebook():
    notebook = run_notebook("02_consistency_findings.ipynb")
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert "answer:" in "".join(o.get("text", "") for o in outputs)
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 4  # the four findings' figures
