"""Verdicts: a finding holds only where its interval clears chance and the paper's comparison holds; the
committed tables hold both splits with the issue's prompt counts."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from snapkv_lab.findings.report import markdown, read_tables, report, verdicts


def _rows(values: dict, key: str, n_samples=8, chance=0.05, support=1000.0, noise=0.02, seed=0) -> pd.DataFrame:
    """A (metric=recall, sinks=excluded) table: for each `key` value its value per sample, with a per-sample jitter
    shared by every key (prompts differ in difficulty; the paired differences are exactly the values' ones)."""
    jitter = np.random.default_rng(seed).normal(0, noise, n_samples)
    rows = [dict(**{key: k}, layer=0, metric="recall", sinks="excluded", numerator=support * (v + jitter[i]),
                 chance_numerator=support * chance, support=support, sample=f"s{i}", split="dev", mode="generated")
            for k, v in values.items() for i in range(n_samples)]
    return pd.DataFrame(rows)


def _verdict(table: pd.DataFrame, key: str) -> str:
    return verdicts({key: table}).set_index("measure").loc["recall, sinks excluded", "verdict"]


@pytest.mark.parametrize("front,back,expected", [(0.5, 0.5, "holds"), (0.4, 0.8, "partly"),
                                                 (0.04, 0.5, "does not hold")])
def test_question_placement_verdicts(front, back, expected):
    assert _verdict(_rows({"front": front, "back": back}, "placement"), "c").startswith(expected)


@pytest.mark.parametrize("values,expected", [({-1: 0.6, -2: 0.4, -3: 0.3}, "holds"),
                                             ({-1: 0.4, -2: 0.6, -3: 0.3}, "does not hold: segments [-2] agree better"),
                                             ({-1: 0.5, -2: 0.5, -3: 0.3}, "not shown"),
                                             ({-1: 0.03, -2: 0.02, -3: 0.01},
                                              "does not hold: the last segment is not above chance")])
def test_last_prompt_segment_verdicts(values, expected):
    assert _verdict(_rows(values, "segment"), "a").startswith(expected)


@pytest.mark.parametrize("values,expected", [({1: 0.5, 2: 0.5, 3: 0.5}, "holds"),
                                             ({1: 0.6, 2: 0.5, 3: 0.4},
                                              "holds (above chance in every segment, but it decays"),
                                             ({1: 0.5, 2: 0.04, 3: 0.5}, "does not hold: segment(s) [2]")])
def test_generation_consistency_verdicts(values, expected):
    verdict = _verdict(_rows(values, "segment", noise=0.005), "b")
    assert verdict.startswith(expected) and (expected != "holds" or verdict == "holds")


def test_sliding_and_global_layers_get_verdicts_apart():
    """A placement that holds on the global layers and fails on the sliding ones (a question 2500 tokens back is
    out of a 512-token window) is reported as such, not pooled into one verdict."""
    global_rows = _rows({"front": 0.5, "back": 0.5}, "placement").assign(layer=5)
    sliding_rows = _rows({"front": 0.01, "back": 0.5}, "placement", seed=1).assign(layer=0)
    table = verdicts({"c": pd.concat([global_rows, sliding_rows])}, sliding_layers=[0, 1])
    recall = table[table.measure == "recall, sinks excluded"].set_index("layers").verdict
    assert recall["global"] == "holds" and recall["sliding"].startswith("does not hold: question front")
    assert set(verdicts({"c": global_rows}).layers) == {"all"}
    assert "(c) question position does not matter, sliding layers" in markdown(table)


def test_side_by_side_puts_each_models_headline_verdicts_next_to_each_other():
    from snapkv_lab.findings.report import short_verdict, side_by_side

    one = verdicts({"c": _rows({"front": 0.5, "back": 0.5}, "placement")})
    global_rows = _rows({"front": 0.5, "back": 0.5}, "placement").assign(layer=5)
    sliding_rows = _rows({"front": 0.01, "back": 0.5}, "placement", seed=1).assign(layer=0)
    two = verdicts({"c": pd.concat([global_rows, sliding_rows])}, sliding_layers=[0])
    table = side_by_side({"A": one, "B": two}).splitlines()
    assert table[0] == "| finding | measure | A | B, global layers | B, sliding layers |"
    recall = next(line for line in table if "recall" in line)
    assert recall == ("| (c) question position does not matter | recall, sinks excluded | holds / - | holds / - "
                      "| does not hold / - |")
    assert short_verdict("holds (above chance in every window, but it decays)") == "holds"


def test_too_little_support_is_undefined_not_a_verdict():
    table = _rows({"front": 0.5, "back": 0.5}, "placement", support=0.5)  # 8 samples pool to 4 < MIN_SUPPORT
    assert _verdict(table, "c") == "undefined: too little support"


def test_committed_tables_hold_both_splits_with_the_prompt_counts():
    tables = read_tables("data")
    minimum = {"a": 8, "b": 8, "b_variants": 8, "c": 6, "d": 4}
    for key, table in tables.items():
        counts = table.groupby("split")["sample"].nunique()
        assert set(counts.index) == {"dev", "heldout"}, key
        assert (counts >= minimum[key]).all(), (key, counts.to_dict())
    table = report("data")
    assert set(table["finding"]) == {"a", "b", "b_windows", "b_selection", "c", "d"}
    assert set(table["split"]) == {"dev", "heldout"} and not table["verdict"].str.startswith("undefined").any()
    text = markdown(table)
    assert text.count("\n") == 1 + table.groupby(["finding", "measure", "mode"]).ngroups and "[" in text


def test_tables_and_settings_from_before_the_segment_rename_still_read(tmp_path):
    """Findings tables and run settings written when segments were called windows read back with today's names:
    the same table, the same verdicts, and the settings under their new keys (docs/glossary.md, "segment")."""
    import json

    from snapkv_lab.findings.experiments import DEFAULTS, _options
    from snapkv_lab.findings.legacy import upgrade_options

    table = _rows({-1: 0.6, -2: 0.4, -3: 0.3}, "segment").assign(model="m")
    table.rename(columns={"segment": "window"}).to_csv(tmp_path / "findings_a.csv", index=False)
    (tmp_path / "findings_run.json").write_text(json.dumps({"obs_window": 32, "prompt_window": 128, "n_windows": 20}))
    read = read_tables(tmp_path)["a"]
    assert "window" not in read and read["segment"].tolist() == table["segment"].tolist()
    with pytest.warns(DeprecationWarning, match="'prompt_window' is now named 'prompt_segment'"):
        old = report(tmp_path)
    pd.testing.assert_frame_equal(old, verdicts({"a": table}, obs_window=32))
    assert old.set_index("measure").loc["recall, sinks excluded", "verdict"] == "holds"
    with pytest.warns(DeprecationWarning):
        assert upgrade_options({"gen_window": 32, "obs_window": 8}) == {"gen_segment": 32, "obs_window": 8}
    with pytest.warns(DeprecationWarning):  # a run's options: the old name counts, the new one wins where both are set
        assert _options({"gen_window": 32})["gen_segment"] == 32 != DEFAULTS["gen_segment"]
    with pytest.warns(DeprecationWarning):
        assert _options({"gen_window": 32, "gen_segment": 16})["gen_segment"] == 16
