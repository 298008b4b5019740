"""The scorer x allocation study (app.scorer_allocation): its cells, a run on the tiny model over a toy benchmark and
byte needles (resumed, the table rebuilt from the cells), the KV entries matched across allocations, and the figure and
the reading drawn from a small table."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from conftest import ByteTokenizer, make_tiny_llama
from test_eval_run import ToyBenchmark

from snapkv_lab.app import scorer_allocation as study
from snapkv_lab.app.scorer_allocation_plots import cell_scores, decomposition, draw, paired, report
from snapkv_lab.evaluation import registry
from snapkv_lab.policies import parse_policy, policy_config


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(registry.DATASETS, "toy", ToyBenchmark())


def test_cells_take_examples_in_turns_one_cell_per_scorer(toy):
    cells = study.study_cells(None, tasks=["repeat", "twice"], samples=2, needle_samples=1, dataset="toy",
                              scorers=["SnapKV", "KNorm"], allocations=["uniform", "global"], ratios=[0.5])
    assert len(cells) == (2 * 2 + 5) * 2  # (2 tasks x 2 examples + 5 needle depths) x 2 scorers
    where = [(c.kind, c.config.get("example", c.config.get("context", {})).get("task", "needle"),
              c.config.get("example", {}).get("index", c.config.get("context", {}).get("depth"))) for c in cells[::2]]
    assert where[:4] == [("eval", "repeat", 0), ("eval", "twice", 0), ("pressure", "needle", 0.0),
                         ("eval", "repeat", 1)]
    first, second = cells[0].config["policies"], cells[1].config["policies"]
    assert first == [policy_config(parse_policy(t)) for t in ("SnapKV", "GlobalAllocation(SnapKV)")]
    assert second == [policy_config(parse_policy(t)) for t in ("KNorm", "GlobalAllocation(KNorm)")]
    needle = next(c for c in cells if c.kind == "pressure")
    assert needle.config["capacities"] == [0.5] and needle.config["context"]["n_tokens"] == 4000
    with pytest.raises(ValueError, match="unknown scorers"):
        study.study_cells(None, tasks=["repeat"], dataset="toy", scorers=["SnapKv"])
    with pytest.raises(ValueError, match="unknown allocations"):
        study.study_cells(None, tasks=["repeat"], dataset="toy", allocations=["pyramidal"])
    with pytest.raises(ValueError, match="compression ratio"):
        study.study_cells(None, tasks=["repeat"], dataset="toy", ratios=[1.5])


def test_every_scorer_under_every_allocation_is_a_policy():
    labels = {parse_policy(study.study_policy(s, a)).scorer_label for s in study.SCORERS for a in study.ALLOCATIONS}
    assert len(labels) == len(study.SCORERS) * len(study.ALLOCATIONS)
    assert study.study_policy("KVzip", "global") == "GlobalAllocation(KVzip(allocation='uniform'))"


def test_answered_tasks_are_those_the_full_cache_answers_every_time(tmp_path):
    pd.DataFrame(dict(task=["a", "a", "b", "b", "c"], mode=["full", "full", "full", "full", "query-aware"],
                      score=[1.0, 1.0, 1.0, 0.0, 0.0])).to_csv(tmp_path / study.ANSWERED_TABLE, index=False)
    assert study.answered_tasks(tmp_path) == ["a"]
    with pytest.raises(ValueError, match="--tasks"):
        study.answered_tasks(tmp_path / "nowhere")


def tiny_loader(name):
    return make_tiny_llama(initializer_range=0.3), ByteTokenizer()


def test_a_run_on_the_tiny_model_resumes_and_holds_matched_entries(toy, tmp_path):
    options = dict(data_dir=tmp_path, dataset="toy", tasks=["repeat"], samples=1, needle_samples=1, needle_length=300,
                   scorers=["SnapKV", "KNorm"], allocations=["uniform", "global", "pyramid"], ratios=[0.5],
                   loader=tiny_loader)
    study.recompute(options)
    table = pd.read_csv(tmp_path / study.TABLE, dtype={"example": str})
    assert list(table.columns) == study.COLUMNS
    compressed = table[table.scorer != study.FULL]
    examples = table.drop_duplicates(["benchmark", "example"])
    assert sorted(examples.benchmark) == ["needle"] * 5 + ["toy"]
    assert len(compressed) == 6 * 2 * 3 * 2  # examples x scorers x allocations x modes
    assert len(table[table.scorer == study.FULL]) == 6  # once per example, though two cells answered it
    assert set(compressed.ratio) == {0.5} and set(table[table.scorer == study.FULL].ratio) == {0.0}
    assert not compressed.over_budget.any()
    entries = compressed.pivot_table(index=["benchmark", "example", "mode", "scorer"], columns="allocation",
                                     values="kv_entries")
    assert (entries["global"] == entries["uniform"]).all()
    assert ((entries["uniform"] - entries["pyramid"]).abs() <= 2).all()  # 2 layers x 2 KV heads, rounding
    manifest = json.loads((tmp_path / "cells" / study.STORE / "manifest.json").read_text())["runs"]
    assert manifest[-1]["cells_run"] == 12
    study.recompute(options)  # resumed: nothing left to run, the same table
    assert json.loads((tmp_path / "cells" / study.STORE / "manifest.json").read_text())["runs"][-1]["cells_run"] == 0
    pd.testing.assert_frame_equal(pd.read_csv(tmp_path / study.TABLE, dtype={"example": str}), table)
    (tmp_path / study.TABLE).unlink()
    study.recompute({**options, "table_only": True, "samples": 2})  # a grown grid: the finished cells' rows alone
    pd.testing.assert_frame_equal(pd.read_csv(tmp_path / study.TABLE, dtype={"example": str}), table)


def small_table() -> pd.DataFrame:
    """Four answered examples and one the full cache misses: SnapKV uniform finds 1 of 4, SnapKV global 2, KVzip
    uniform 3, KVzip global 4 (each of the missing example's answers found, to show it is left out)."""
    rows = []
    found = {("SnapKV", "uniform"): [1, 0, 0, 0, 1], ("SnapKV", "global"): [1, 1, 0, 0, 1],
             ("KVzip", "uniform"): [1, 1, 1, 0, 1], ("KVzip", "global"): [1, 1, 1, 1, 1]}
    for example in range(5):
        base = dict(model="tiny", benchmark="toy", task="repeat", example=str(example), budget_share=0.5,
                    prompt_tokens=100, prediction="")
        rows.append({**base, "mode": "full", "scorer": study.FULL, "allocation": study.FULL, "policy": "FullCache",
                     "ratio": 0.0, "score": float(example < 4), "kv_entries": 100, "kv_share": 1.0,
                     "over_budget": False})
        for mode in ("query-aware", "query-agnostic"):
            base = {**base, "mode": mode}
            for (scorer, allocation), hits in found.items():
                rows.append({**base, "scorer": scorer, "allocation": allocation, "policy": f"{scorer}/{allocation}",
                             "ratio": 0.5, "score": float(hits[example]), "kv_entries": 50, "kv_share": 0.5,
                             "over_budget": False})
    return pd.DataFrame(rows)[study.COLUMNS]


def test_scores_are_over_the_answered_examples_with_wilson_intervals():
    scores = cell_scores(small_table()).set_index(["mode", "scorer", "allocation"])
    cell = scores.loc[("query-aware", "KVzip", "uniform")]
    assert (cell.n, cell.found, cell.score) == (4, 3, 75.0)
    assert cell.low == pytest.approx(100 * 0.3006, abs=0.05) and cell.high == pytest.approx(100 * 0.9544, abs=0.05)


def test_a_method_splits_into_scoring_and_allocation_exactly():
    table = small_table()
    parts = decomposition(table)
    kvzip = parts[(parts.method == "KVzip") & (parts["mode"] == "query-aware")].set_index("part")
    assert kvzip.difference.to_dict() == {"whole": 75.0, "scoring": 50.0, "allocation": 25.0}
    assert (kvzip.loc["whole", "a_only"], kvzip.loc["whole", "b_only"]) == (3, 0)
    assert kvzip.loc["whole", "p"] == pytest.approx(0.25)  # 3 discordant, all one way: 2 x 1/8
    assert "p_holm" not in parts  # descriptive: outside the family, so no adjustment of its own either
    one = paired(table, ("KVzip", "global"), ("KVzip", "uniform"))
    assert one.loc[0, "low"] < 25 < one.loc[0, "high"]
    text = report(table)
    assert "| KVzip | query-aware | 0.5 | +75" in text and "3/4 [30, 95]" in text


def test_the_figure_is_drawn_from_the_table(tmp_path):
    small_table().to_csv(tmp_path / study.TABLE, index=False)
    written = draw(tmp_path, tmp_path / "figures")
    assert [p.name for p in written] == ["scorer_allocation.png", "scorer_allocation.html"]
    assert all(p.stat().st_size > 1000 for p in written)
    assert draw(tmp_path / "empty", tmp_path / "figures") == []
