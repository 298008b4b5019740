"""Notebook 03 (SnapKV A/B) runs headless with small settings (SNAPKV_LAB_SMALL=1)."""

from __future__ import annotations

import pytest

from test_notebooks import run_notebook


@pytest.mark.notebook
@pytest.mark.slow
def test_snapkv_ab_notebook():
    notebook = run_notebook("03_snapkv_ab.ipynb")
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs)
    assert text.count("answer:") >= 3 and "positions per head in every layer" in text
    pages = "".join(o.get("data", {}).get("text/html", "") for o in outputs)
    assert "MiB KV" in pages and "red outline" in pages  # side-by-side answers and the kept-token view
    assert sum("application/vnd.plotly.v1+json" in o.get("data", {}) for o in outputs) >= 2
