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
    assert (recall["global"].startswith("holds: after - before inside")
            and recall["sliding"].startswith("does not hold: question front"))
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
    assert recall == ("| (c) question position does not matter | recall, sinks excluded | holds / - / - | holds / - / "
                      "- | does not hold / - / - |")
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
    for key in ("a", "b_variants", "c"):  # the baselines beside chance
        assert {"paper", "recency", "random segment", "oracle"} <= set(tables[key]["selection"]), key
    assert {"question vs recency", "question vs random segment"} <= set(tables["d"]["comparison"])
    table = report("data")
    assert set(table["finding"]) == {"a", "b", "b_windows", "b_selection", "c", "d"}
    assert set(table["split"]) == {"dev", "heldout", "both"} and not table["verdict"].str.startswith("undefined").any()
    text = markdown(table)
    assert text.count("\n") == 1 + len(table) and "[" in text  # a row per verdict: each split, then both pooled


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


def _noisy(values: dict, key: str, n_samples: int, noise: float, seed: int, split="dev") -> pd.DataFrame:
    """As `_rows`, with a per-sample value of each key drawn independently around its mean (paired differences vary)."""
    rng = np.random.default_rng(seed)
    rows = [dict(**{key: k}, layer=0, metric="recall", sinks="excluded", numerator=1000.0 * (v + rng.normal(0, noise)),
                 chance_numerator=50.0, support=1000.0, sample=f"{split}{i}", split=split, mode="generated")
            for i in range(n_samples) for k, v in values.items()]
    return pd.DataFrame(rows)


def test_no_effect_needs_equivalence_not_a_failure_to_reject():
    """(c) on 6 noisy documents with no true difference: not rejected, yet not shown equivalent within the margin, so
    "not shown", not "holds"; a small difference measured tightly is "holds within the margin"; pooling both splits
    reports a third row with their n added."""
    from snapkv_lab.findings.report import EQUIVALENCE_MARGIN

    noisy = _verdict(_noisy({"front": 0.5, "back": 0.5}, "placement", 6, noise=0.06, seed=2), "c")
    assert noisy.startswith("not shown: after - before neither differs from 0"), noisy
    tight = pd.concat([_noisy({"front": 0.5, "back": 0.52}, "placement", 6, noise=0.004, seed=3, split=s)
                       for s in ("dev", "heldout")]).assign(selection="paper")
    tight = pd.concat([tight, tight.assign(selection="recency", numerator=tight["numerator"] / 2)])
    table = verdicts({"c": tight}).set_index(["measure", "split"]).loc["recall, sinks excluded"]
    assert len({line.count("|") for line in markdown(verdicts({"c": tight})).splitlines()}) == 1  # cells never split
    assert list(table.index) == ["dev", "heldout", "both"] and table.loc["both", "n"] == 12
    assert table.loc["both", "verdict"].startswith("holds within the margin"), table.loc["both", "verdict"]
    assert EQUIVALENCE_MARGIN == 0.05  # stated in docs/findings.md; changing it is a change of protocol


def test_a_window_that_does_not_beat_recency_is_above_chance_only():
    """(b) with baselines: the window far above chance, but recency's selection holds as much: "above chance only"."""
    window = _noisy({1: 0.5, 2: 0.5}, "segment", 8, noise=0.01, seed=4).assign(selection="paper", obs_window=32)
    baselines = pd.concat([_noisy({1: v, 2: v}, "segment", 8, noise=0.01, seed=5).assign(selection=name, obs_window=32)
                           for name, v in (("recency", 0.52), ("random segment", 0.3), ("oracle", 0.8))])
    table = verdicts({"b": window.drop(columns=["selection", "obs_window"]),
                      "b_variants": pd.concat([window, baselines])})
    row = table[(table.finding == "b") & (table.measure == "recall, sinks excluded")].iloc[0]
    assert row["verdict"] == "above chance only: not above recency", row["verdict"]
    assert ("recency 0.52" in row["baselines"] and "oracle 0.80" in row["baselines"]
            and "% of the oracle" in row["result"])
