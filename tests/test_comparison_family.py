"""The family of comparisons (evaluation.family): written down in one file, checked against the tables it names,
refused where it would count shared examples twice, Holm-adjusted over its primary rows; and the committed results
(data/comparison_family_results.csv) are what the code computes from the committed tables."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from snapkv_lab.evaluation import family
from snapkv_lab.evaluation.summary import holm

ROOT = Path(__file__).resolve().parents[1]


def test_an_example_set_is_written_in_stretches_and_read_back():
    examples = pd.DataFrame({"task": ["a"] * 6 + ["b"] * 3,
                             "example": ["4096-0-0", "4096-0-1", "4096-0-2", "4096-0-5", "x", "4096-0-6",
                                         "8-1-07", "8-1-08", "8-1-9"]})
    text = family.format_examples(examples)
    assert text == "a:4096-0-0..2 4096-0-5 x 4096-0-6; b:8-1-07 8-1-08 8-1-9"  # "07" is no number: kept whole
    assert family.parse_examples(text) == set(zip(examples.task, examples.example))
    with pytest.raises(ValueError, match="cannot be written"):
        family.format_examples(pd.DataFrame({"task": ["a"], "example": ["two words"]}))
    with pytest.raises(ValueError, match="task:ID"):
        family.parse_examples("a 4096-0-0")


def _run(path: Path, examples: dict[str, range], kvzip_wins: bool, others: tuple[str, ...] = ()) -> None:
    """A toy eval table at 4096 tokens: the full cache answers every example of task "a" and none of "b"; KVzip
    and SnapKV at ratio 0.5 without the question, KVzip keeping task a's answers where SnapKV loses them (`others`:
    more policies, each answering as SnapKV)."""
    rows = []
    for task, indices in examples.items():
        for i in indices:
            example, answered = f"4096-0-{i}", task == "a"
            rows.append((task, example, "FullCache", 0.0, "full", float(answered)))
            rows.append((task, example, "SnapKV", 0.5, "query-agnostic", 0.0))
            rows.append((task, example, "KVzip", 0.5, "query-agnostic", float(answered and kvzip_wins)))
            rows += [(task, example, other, 0.5, "query-agnostic", 0.0) for other in others]
    table = pd.DataFrame(rows, columns=["task", "example", "policy", "ratio", "mode", "score"])
    table.assign(model="tiny", dataset="ruler", length=4096, capacity=np.nan, question=0).to_csv(path, index=False)


@pytest.fixture
def runs(tmp_path):
    """Two runs sharing the examples a:0-5, and a third on other examples."""
    _run(tmp_path / "eval_big.csv", {"a": range(8), "b": range(4)}, kvzip_wins=True)
    _run(tmp_path / "eval_small.csv", {"a": range(6)}, kvzip_wins=True)
    _run(tmp_path / "eval_other.csv", {"a": range(10, 13)}, kvzip_wins=False)
    return tmp_path


def test_a_family_that_counts_shared_examples_twice_is_refused(runs):
    big, small, other = (family.rows_for(runs, f"eval_{name}.csv") for name in ("big", "small", "other"))
    assert list(big.examples) == ["a:4096-0-0..7; b:4096-0-0..3"] and len(big) == 1 and big.policy[0] == "KVzip"
    family.check_family(pd.concat([big, other]), runs)  # no example shared: two pieces of evidence
    with pytest.raises(ValueError, match="share 6 examples"):
        family.check_family(pd.concat([big, small]), runs)
    family.check_family(pd.concat([big, small.assign(evidence="same examples as eval_big.csv")]), runs)
    with pytest.raises(ValueError, match="shares no example with eval_big.csv"):
        family.check_family(pd.concat([big, other.assign(evidence="same examples as eval_big.csv")]), runs)
    with pytest.raises(ValueError, match="does not hold that comparison as primary"):
        family.check_family(pd.concat([big, small.assign(evidence="same examples as eval_nowhere.csv")]), runs)
    with pytest.raises(ValueError, match="evidence is"):
        family.check_family(big.assign(evidence="secondary"), runs)
    with pytest.raises(ValueError, match="twice"):
        family.check_family(pd.concat([big, big]), runs)


def test_a_family_says_what_its_tables_hold(runs):
    big = family.rows_for(runs, "eval_big.csv")
    _run(runs / "eval_big.csv", {"a": range(9), "b": range(4)}, kvzip_wins=True)  # the run grew by one example
    with pytest.raises(ValueError, match="declared again"):
        family.check_family(big, runs)
    with pytest.raises(ValueError, match="in the family only"):
        family.check_family(family.rows_for(runs, "eval_big.csv").assign(policy="TOVA"), runs)
    with pytest.raises(ValueError, match="no rows of the baseline 'H2O'"):
        family.rows_for(runs, "eval_big.csv", baseline="H2O")


def test_the_family_reads_the_answered_examples_first_and_adjusts_over_its_primary_rows(runs):
    rows = pd.concat([family.rows_for(runs, "eval_big.csv"), family.rows_for(runs, "eval_other.csv"),
                      family.rows_for(runs, "eval_small.csv", evidence="same examples as eval_big.csv")])
    results = (family.family_results(runs, rows, n_boot=0).set_index(["table", "analysis", "task"], drop=False)
               .sort_index())
    answered = results.loc[("eval_big.csv", "answered")].iloc[0]
    # the full cache answers task a's eight: KVzip keeps all eight where SnapKV keeps none, p = 2 / 2^8
    assert (answered.examples, answered.nonzero, answered.difference) == (8, 8, pytest.approx(100))
    assert answered.p == pytest.approx(2 / 2 ** 8) and answered.p_method == "exact"
    mean = results.loc[("eval_big.csv", "task mean")].iloc[0]
    assert mean.examples == 12 and mean.tasks == 2 and mean.difference == pytest.approx(50)  # task b: 0, weighs 1/2
    assert mean.full_cache == pytest.approx(50)
    per_task = results.loc[("eval_big.csv", "task")].set_index("task")
    assert per_task.loc["a", "difference"] == pytest.approx(100) and per_task.loc["b", "p"] == 1.0
    assert per_task.p_holm.isna().all()  # read beside, not adjusted
    # Holm over the two primary rows of each analysis; the row on shared examples is shown, not counted
    for analysis in ("answered", "task mean"):
        primary = results[(results.analysis == analysis) & (results.evidence == "primary")]
        assert primary.p_holm.to_numpy() == pytest.approx(holm(primary.p.to_numpy()))
    assert results.loc[("eval_small.csv", "answered")].p_holm.isna().all()
    assert results.loc[("eval_small.csv", "answered")].iloc[0].examples == 6
    assert results.loc[("eval_big.csv", "answered")].iloc[0].p_holm == pytest.approx(2 * 2 / 2 ** 8)


def test_a_run_whose_full_cache_answers_nothing_keeps_its_answered_rows_and_holm_counts_them(runs):
    """A run with no answered example (a task the full cache fails throughout, as NoLiMa's non-literal one on SmolLM2)
    has an "answered" row per comparison, 0 examples and p 1, that Holm counts like any other primary row; its rows
    once lost their baseline and fell out of the results."""
    _run(runs / "eval_failed.csv", {"b": range(20, 23)}, kvzip_wins=True)
    rows = pd.concat([family.rows_for(runs, "eval_big.csv"), family.rows_for(runs, "eval_failed.csv")])
    results = family.family_results(runs, rows, n_boot=0)
    failed = results[(results.table == "eval_failed.csv") & (results.analysis == "answered")]
    assert len(failed) == 1 and failed.iloc[0].examples == 0 and failed.iloc[0].p == 1.0
    assert failed.iloc[0].baseline == "SnapKV" and failed.iloc[0].p_holm == 1.0
    big = results[(results.table == "eval_big.csv") & (results.analysis == "answered")].iloc[0]
    assert big.p_holm == pytest.approx(2 * 2 / 2 ** 8)  # Holm over both primary rows


def test_the_committed_family_holds_and_its_results_are_what_the_code_computes():
    """The family file names what the committed tables hold; the committed results are its own (each primary row's
    p_holm Holm over the primary rows' p), and recomputing the runs of few examples (exact tests, seconds) gives the
    committed numbers."""
    data = ROOT / "data"
    rows = family.read_family(data / family.FAMILY)
    committed = family.read_family_results(data)
    assert len(committed[committed.analysis == "answered"]) == len(rows)
    for analysis in ("answered", "task mean"):
        primary = committed[(committed.analysis == analysis) & (committed.evidence == "primary")]
        assert len(primary) == (rows.evidence == "primary").sum()
        assert primary.p_holm.to_numpy() == pytest.approx(holm(primary.p.to_numpy()), rel=1e-5)
    small = ["gemma-3-270m/eval_ruler_16k.csv", "eval_ruler_8k.csv", "eval_ruler_8k_answered.csv"]
    some = rows[rows.table.isin(small)]
    fresh = family.family_results(data, some)  # check_family runs on these rows too
    keys = ["table", "policy", "ratio", "mode", "analysis", "task"]
    merged = fresh.merge(committed, on=keys, suffixes=("", "_committed"))
    assert len(merged) == len(fresh)
    for column in ("examples", "nonzero", "difference", "low", "high", "p", "full_cache"):
        assert merged[column].to_numpy(dtype=float) == pytest.approx(
            merged[f"{column}_committed"].to_numpy(dtype=float), rel=1e-5, nan_ok=True)
    assert (merged.p_method == merged.p_method_committed).all()


def test_the_docs_tables_read_the_familys_files():
    from snapkv_lab.app import docs_tables

    assert docs_tables.FAMILY_FILES == (family.FAMILY, family.RESULTS)
    for name in ("difference", "difference-ratios", "family-runs", "family-holds", "family-tasks"):
        assert set(docs_tables.FAMILY_FILES) <= set(docs_tables.BLOCKS[name].reads)


def test_the_docs_say_holm_ran_over_every_primary_row_of_the_committed_family():
    """The docs' difference table names the family Holm adjusted over: every primary row, the multi-turn runs' (each
    policy against itself, not against SnapKV) as well; it once counted only the rows against SnapKV (568 of 612)."""
    from snapkv_lab.app.docs_tables import _differences

    primary = int((family.read_family(ROOT / "data" / family.FAMILY).evidence == family.PRIMARY).sum())
    results = family.read_family_results(ROOT / "data")
    assert (results.baseline != "SnapKV").any()  # the committed family holds comparisons of another baseline
    assert primary == results.loc[results.analysis == "answered", "p_holm"].notna().sum()  # the rows Holm adjusted
    assert f"Holm's adjustment over the family's {primary} primary comparisons" in _differences(ROOT / "data")


def test_a_comparison_past_holm_over_its_run_but_not_over_the_family_is_marked_nowhere(runs):
    """KVzip keeps task a's eight answers where SnapKV keeps none (p = 2 / 2^8 = 0.0078 on the answered examples and
    on the mean over tasks alike): over its own run (one comparison) it would pass, and over a family of two it
    still does (p_holm 0.016), so the difference figure fills it and the docs' table bolds it. With eight more
    comparisons in the family (another run's KVzip and seven policies that answer as SnapKV) Holm asks under
    0.05 / 9 and p_holm is 9 x 0.0078 = 0.07: neither the figure nor the docs mark it, whatever the run alone says."""
    from snapkv_lab.app.docs_tables import _differences
    from snapkv_lab.evaluation import read_results
    from snapkv_lab.evaluation.leaderboard_plots import draw, marked_differences
    from snapkv_lab.evaluation.summary import paired_difference

    big = read_results(runs / "eval_big.csv")
    alone = paired_difference(big).iloc[0]
    assert alone.p == pytest.approx(2 / 2 ** 8)  # the run alone, one comparison: it would pass at 0.05

    def marked(family_rows):
        family_rows.to_csv(runs / family.FAMILY, index=False)
        family.write_results(runs, n_boot=0)
        adjustment = family.run_adjustment(runs / "eval_big.csv")
        points = marked_differences(big, adjustment=adjustment).set_index("policy").loc["KVzip"]
        figures = runs / "figures"
        figures.mkdir(exist_ok=True)
        draw(runs, figures, names=["big"])
        page = (figures / "eval_big_difference.html").read_text()
        return adjustment, points, page, _differences(runs, name="big")

    adjustment, points, page, block = marked(pd.concat([family.rows_for(runs, "eval_big.csv"),
                                                        family.rows_for(runs, "eval_other.csv")]))
    assert points.p_holm == pytest.approx(2 * 2 / 2 ** 8) and points.filled and points.ringed
    assert "Holm over the family's 2 primary comparisons" in adjustment.says
    assert "Holm over the family's 2 primary comparisons" in page and "nothing filled" not in page
    assert "| KVzip | **50, p 0.0078** |" in block  # n_boot=0: no interval

    _run(runs / "eval_other.csv", {"a": range(10, 13)}, kvzip_wins=False, others=tuple(f"P{i}" for i in range(7)))
    adjustment, points, page, block = marked(pd.concat([family.rows_for(runs, "eval_big.csv"),
                                                        family.rows_for(runs, "eval_other.csv")]))
    assert points.p == pytest.approx(2 / 2 ** 8) and points.p_holm == pytest.approx(9 * 2 / 2 ** 8)
    assert not points.filled and not points.ringed
    assert "Holm over the family's 9 primary comparisons" in page
    assert "| KVzip | 50, p 0.0078 |" in block and "family's 9 primary comparisons" in block

    # a run the family counts on another run's examples, or does not name, is marked nowhere either
    _run(runs / "eval_other.csv", {"a": range(10, 13)}, kvzip_wins=False)
    rows = pd.concat([family.rows_for(runs, "eval_big.csv"),
                      family.rows_for(runs, "eval_small.csv", evidence="same examples as eval_big.csv")])
    rows.to_csv(runs / family.FAMILY, index=False)
    family.write_results(runs, n_boot=0)
    assert "counted on eval_big.csv" in family.run_adjustment(runs / "eval_small.csv").says
    assert "not in the family" in family.run_adjustment(runs / "eval_other.csv").says
    small = marked_differences(read_results(runs / "eval_small.csv"), adjustment=family.run_adjustment(
        runs / "eval_small.csv"))
    assert (paired_difference(read_results(runs / "eval_small.csv")).p < 0.05).all() and not small.filled.any()
    # the table grew since the family declared it: no adjusted p until it is declared again
    _run(runs / "eval_big.csv", {"a": range(9), "b": range(4)}, kvzip_wins=True)
    assert family.run_adjustment(runs / "eval_big.csv").p_holm.empty
