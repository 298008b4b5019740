"""Notebook 01 runs headless with small settings (SNAPKV_LAB_SMALL=1)."""

from __future__ import annotations

import atexit
import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"

# Every notebook of a test session runs in one kernel, which imports torch, transformers, plotly and the package once
# rather than once per notebook. Before each notebook a first cell (dropped from its outputs, its errors still
# counted) clears what the last one left: its variables (%reset), pandas' display options, the model it was told to
# use (SNAPKV_LAB_MODEL) and the working folder.
_KERNEL: dict = {}
FRESH = """%reset -f
import gc, os, sys, warnings
if "pandas" in sys.modules:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sys.modules["pandas"].reset_option("all")
os.environ.pop("SNAPKV_LAB_MODEL", None)
if {model!r}:
    os.environ["SNAPKV_LAB_MODEL"] = {model!r}
os.chdir({folder!r})
gc.collect()
del gc, os, sys, warnings
"""


def notebook_kernel():
    """The session's kernel (started here on first use, with SNAPKV_LAB_SMALL=1, in the notebooks' folder), shut down
    when the session ends."""
    from jupyter_client.manager import AsyncKernelManager
    from jupyter_core.utils import run_sync

    km = _KERNEL.get("km")
    if km is not None and run_sync(km.is_alive)():
        return km
    env = {k: v for k, v in os.environ.items() if k != "SNAPKV_LAB_MODEL"} | {"SNAPKV_LAB_SMALL": "1"}
    km = AsyncKernelManager(kernel_name="python3")
    run_sync(km.start_kernel)(env=env, cwd=str(NOTEBOOKS), extra_arguments=["--HistoryManager.hist_file=:memory:"])
    atexit.register(run_sync(km.shutdown_kernel), now=True)
    _KERNEL["km"] = km
    return km


def run_notebook(name: str, timeout: int = 600, model: str | None = None) -> list:
    """Execute a notebook in its folder with SNAPKV_LAB_SMALL=1 on `model` (SNAPKV_LAB_MODEL; None: the default
    SmolLM2, whatever the caller's environment says); return its code cells' outputs, none an error."""
    # per cell: small settings run each in under a minute on a quiet machine; notebook 03's two-prompt compare cell
    # took over 180 s beside a 32k-token run on this 2-core machine (2026-11-24), so the limit only catches hangs
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    os.environ["SNAPKV_LAB_SMALL"] = "1"
    notebook.cells.insert(0, nbformat.v4.new_code_cell(FRESH.format(model=model or "", folder=str(NOTEBOOKS))))
    NotebookClient(notebook, timeout=timeout, kernel_name="python3", km=notebook_kernel(),
                   resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    fresh = notebook.cells.pop(0)
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    errors = [f"{o.ename}: {o.evalue}" for o in fresh.outputs + outputs if o.output_type == "error"]
    assert not errors, errors
    return outputs


def printed(outputs) -> str:
    """All text the cells printed."""
    return "".join(o.get("text", "") for o in outputs)


def count_plotly(outputs) -> int:
    return sum("application/vnd.plotly.v1+json" in o.get("data", {}) for o in outputs)


@pytest.mark.notebook
def test_attention_maps_notebook():
    outputs = run_notebook("01_attention_maps.ipynb")
    text = printed(outputs)
    assert "AttentionTrace(" in text and "answer:" in text
    assert count_plotly(outputs) >= 3


@pytest.mark.notebook
@pytest.mark.slow
def test_attention_maps_notebook_on_gemma():
    """The same notebook on the bundled base model Gemma 3 270M (no chat template, sliding-window layers)."""
    outputs = run_notebook("01_attention_maps.ipynb", model="gemma-3-270m")
    text = printed(outputs)
    assert "model: gemma-3-270m (base model: plain text)" in text and "sliding-window layers" in text
    assert "AttentionTrace(" in text and "18 layers, 4 heads / 1 KV heads" in text and "answer:" in text
    assert count_plotly(outputs) >= 3
