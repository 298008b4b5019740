"""Finding (b) split by head type, against sums written out by hand."""

from __future__ import annotations

import pandas as pd
import pytest

from snapkv_lab.findings.head_types import findings_by_head_type, head_types


def tables():
    retrieval = pd.DataFrame(dict(layer=[0, 0, 1, 1], head=[0, 1, 0, 1], retrieval_score=[0.5, 0.0, float("nan"), 0.2]))
    rows = []
    for sample in range(6):
        for layer, head, numerator in [(0, 0, 2), (0, 1, 9), (1, 0, 8), (1, 1, 4 + sample % 2)]:
            rows.append(dict(layer=layer, head=head, metric="recall", sinks="excluded", numerator=numerator,
                             chance_numerator=1, support=10, sample=sample, split="dev"))
    return pd.DataFrame(rows), retrieval


def test_heads_split_by_their_score_and_pool_their_rows():
    findings, retrieval = tables()
    assert head_types(retrieval).to_dict() == {(0, 0): "retrieval", (0, 1): "other", (1, 0): "other",
                                               (1, 1): "retrieval"}
    table = findings_by_head_type(findings, retrieval).set_index("head_type")
    # retrieval heads (0,0) and (1,1): 6 x 2 + (3 x 4 + 3 x 5) = 39 of 120; the others 6 x (9 + 8) = 102 of 120
    assert table.loc["retrieval", "value"] == pytest.approx(39 / 120)
    assert table.loc["other", "value"] == pytest.approx(102 / 120)
    assert table.loc["retrieval", "chance"] == pytest.approx(12 / 120) and table.loc["retrieval", "n_heads"] == 2
    assert table.loc["retrieval - other", "value"] == pytest.approx(39 / 120 - 102 / 120)
    low, high = table.loc["retrieval - other", ["ci_low", "ci_high"]]
    assert low <= 39 / 120 - 102 / 120 <= high < 0


def test_heads_the_retrieval_table_lacks_are_refused():
    findings, retrieval = tables()
    with pytest.raises(ValueError, match="one model"):
        findings_by_head_type(findings, retrieval[retrieval.layer == 0])
