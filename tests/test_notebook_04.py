"""Notebook 04 (why compression fails) runs headless with small settings (SNAPKV_LAB_SMALL=1)."""

from __future__ import annotations

import pytest
from test_notebooks import count_plotly, printed, run_notebook


@pytest.mark.notebook
@pytest.mark.slow
def test_why_compression_fails_notebook():
    outputs = run_notebook("04_why_compression_fails.ipynb")
    text = printed(outputs)
    assert text.count("answer:") >= 4 and "needle value kept" in text  # the full cache and three policies
    assert "The full cache answered" in text and "oracle" in text and "Across the 3 policies" in text
    pages = "".join(o.get("data", {}).get("text/html", "") for o in outputs)
    assert "red box" in pages and "coverage_of_oracle" in pages  # kept-token views, the summary table
    assert count_plotly(outputs) >= 1
