"""Notebook 06 (what the answer needs) runs headless with small settings (SNAPKV_LAB_SMALL=1)."""

from __future__ import annotations

import pytest
from test_notebooks import count_plotly, printed, run_notebook


@pytest.mark.notebook
def test_what_the_answer_needs_notebook():
    outputs = run_notebook("06_what_the_answer_needs.ipynb")
    text = printed(outputs)
    assert "the full cache's answer:" in text and "changes the answer: True" in text  # the needle's block alone
    assert "Spearman between the gradient estimate" in text and "the most causal coverage:" in text
    assert "finding (e) in small, query-agnostic: mean per-prompt rho" in text  # the many-prompt section
    tables = "".join(o.get("data", {}).get("text/html", "") for o in outputs)
    assert "answer_changed" in tables and "attention_coverage" in tables and "oracle" in tables
    assert count_plotly(outputs) >= 1
