"""Notebook 03 (SnapKV A/B) runs headless with small settings (SNAPKV_LAB_SMALL=1)."""

from __future__ import annotations

import pytest
from test_notebooks import count_plotly, printed, run_notebook


@pytest.mark.notebook
@pytest.mark.slow
def test_snapkv_ab_notebook():
    outputs = run_notebook("03_snapkv_ab.ipynb")
    text = printed(outputs)
    assert (text.count("answer:") >= 4  # full, SnapKV, fact kernel, stream
            and "positions per head in every layer" in text)
    pages = "".join(o.get("data", {}).get("text/html", "") for o in outputs)
    assert "MiB KV" in pages and "red box" in pages  # side-by-side answers and the kept-token view
    assert "SnapKVFactKernel@" in pages and "Surprisal@" in pages  # the small-budget policies in the A/B, kept views
    assert "misses on prompts the full cache answered right" in text  # paired on the same sample
    assert "the model fails the task itself" in text  # the all-zero pooling table explained from the data
    assert count_plotly(outputs) >= 2
