"""Notebook 01 runs headless with small settings (SNAPKV_LAB_SMALL=1)."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def run_notebook(name: str, timeout: int = 600):
    """Execute a notebook in its folder with SNAPKV_LAB_SMALL=1; return the executed notebook."""
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    os.environ["SNAPKV_LAB_SMALL"] = "1"
    NotebookClient(notebook, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    return notebook


@pytest.mark.notebook
def test_attention_maps_notebook():
    notebook = run_notebook("01_attention_maps.ipynb")
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs)
    assert "AttentionTrace(" in text and "answer:" in text
    assert sum("application/vnd.plotly.v1+json" in o.get("data", {}) for o in outputs) >= 3
