"""Reading a multi-turn run (evaluation.turns) and its comparisons in the family (evaluation.family): the contrasts
by hand on a toy table, Spearman's exact p against every ordering enumerated, the family's rows of a multi-turn run
checked and adjusted with a RULER run's, and the figure and the docs block drawn from the table."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from snapkv_lab.evaluation import family, turns

N = 8  # examples


def _score(policy, mode, feed, compress, turn, example) -> float:
    """The toy run: the full cache answers every turn but the model feed's third turn of examples 6 and 7; SnapKV
    keeps turn 1 and loses turn 3 of examples 2-7 when compressed once with the question (the later questions'
    needles gone), and every turn of examples 4-7 when compressed every turn; without the question it keeps all;
    KVzip (once only, as compress_again refuses it) keeps everything but the model feed's turn 3 of example 7."""
    if policy == "FullCache":
        return float(not (feed == "model" and turn == 3 and example >= 6))
    if policy == "KVzip":
        return float(not (feed == "model" and turn == 3 and example == 7))
    if mode == "query-agnostic" or turn == 1:
        return 1.0
    if compress == "every-turn":
        return float(example < 4)
    return float(turn == 2 or example < 2)


def _table() -> pd.DataFrame:
    rows = []
    runs = [("FullCache", 0.0, "full", "none")] + [
        (p, 0.5, m, c) for p in ("SnapKV", "KVzip") for m in ("query-aware", "query-agnostic")
        for c in ("once", "every-turn") if not (p == "KVzip" and c == "every-turn")]
    for example in range(N):
        for feed in ("model", "gold"):
            for policy, ratio, mode, compress in runs:
                for turn in (1, 2, 3):
                    share = 1.0 if policy == "FullCache" else (0.5 if compress != "every-turn" or turn == 1 else 0.4)
                    score = _score(policy, mode, feed, compress, turn, example)
                    value = f"{1_000_000 + 10 * example + turn}"  # the turn's needle; a lost turn answers turn 1's
                    rows.append(dict(model="tiny", dataset="scbench", task="scbench_qa_eng", example=str(example),
                                     references=json.dumps([value]),
                                     prediction=value if score else f"It is {1_000_000 + 10 * example + 1}.",
                                     question=turn - 1, policy=policy, ratio=ratio, capacity=np.nan, mode=mode,
                                     score=score, length=np.nan,
                                     kv_entries=1000 * share, kv_share=share, feed=feed, compress=compress, turn=turn,
                                     recompressed=compress == "every-turn" and turn > 1, over_budget=False))
    return pd.DataFrame(rows)


@pytest.fixture
def run(tmp_path):
    _table().to_csv(tmp_path / turns.TABLE, index=False)
    return tmp_path


def test_a_setting_is_written_and_read_back():
    text = turns.setting("gold", "every-turn", 3)
    assert text == "feed=gold compress=every-turn turn=3"
    assert turns.parse_setting(text) == dict(feed="gold", compress="every-turn", turn=3)
    with pytest.raises(ValueError, match="feed=F compress=C turn=T"):
        turns.parse_setting("feed=gold turn=3")


def test_the_comparisons_of_a_multi_turn_run():
    comparisons = turns.turn_comparisons(_table())
    # turn 3 vs 1: SnapKV in 2 modes x 2 feeds x 2 options, KVzip in 2 x 2 x once; every-turn vs once: SnapKV's 2 x 2;
    # model vs gold feed: SnapKV's 2 modes x 2 options, KVzip's 2 x once
    assert comparisons.kind.value_counts().to_dict() == {"turn": 12, "compress": 4, "feed": 6}
    assert (comparisons.policy == comparisons.baseline).all()
    row = comparisons[(comparisons.kind == "compress") & (comparisons["mode"] == "query-aware")
                      & (comparisons.policy == "SnapKV")].iloc[0]
    assert (row.setting, row.baseline_setting) == ("feed=model compress=every-turn turn=3",
                                                   "feed=model compress=once turn=3")
    with pytest.raises(ValueError, match="one last turn"):
        turns.turn_comparisons(_table().query("not (example == '0' and turn == 3)"))


def test_the_contrasts_by_hand():
    out = turns.contrasts(_table())
    key = ["subset", "kind", "policy", "mode", "setting"]
    out = out.set_index(key)
    # SnapKV with the question, gold feed, once: turn 3 less turn 1 is -100 on examples 2-7, 0 on 0-1
    row = out.loc[("all", "turn", "SnapKV", "query-aware", "feed=gold compress=once turn=3")]
    values = np.array([0, 0] + [-100] * 6, dtype=float)
    interval = stats.ttest_1samp(values, 0).confidence_interval(0.95)
    assert (row.n, row.nonzero, row.difference) == (8, 6, pytest.approx(-75))
    assert (row.low, row.high) == pytest.approx((interval.low, interval.high))
    assert row.p == pytest.approx(2 / 2 ** 6) and row.p_method == "exact"  # six losses of one size: binomial
    assert (row.score, row.baseline_score, row.kv_share) == (pytest.approx(25), 100, 0.5)
    # the answered examples: the full cache misses the model feed's turn 3 of examples 6 and 7
    answered = out.loc[("answered", "turn", "SnapKV", "query-aware", "feed=gold compress=once turn=3")]
    assert (answered.n, answered.difference) == (6, pytest.approx(-400 / 6))
    # every-turn less once at turn 3: examples 2-3 kept under every-turn, lost under once
    every = out.loc[("all", "compress", "SnapKV", "query-aware", "feed=gold compress=every-turn turn=3")]
    assert (every.difference, every.nonzero, every.p) == (pytest.approx(25), 2, pytest.approx(0.5))
    # the model feed less the gold feed, KVzip once at turn 3: example 7 lost
    feed = out.loc[("all", "feed", "KVzip", "query-agnostic", "feed=model compress=once turn=3")]
    assert (feed.difference, feed.nonzero, feed.p) == (pytest.approx(-12.5), 1, 1.0)
    kinds = turns.answer_kinds(_table()).set_index(["policy", "mode", "feed", "compress", "turn"])
    lost = kinds.loc[("SnapKV", "query-aware", "gold", "once", 3)]  # 6 of 8 answer turn 1's needle
    assert (lost.right, lost.other_needle, lost.no_number) == (25, 75, 0)
    scores = turns.turn_scores(_table()).set_index(["policy", "mode", "feed", "compress", "turn"])
    assert scores.loc[("FullCache", "full", "model", "none", 3)].score == pytest.approx(75)
    assert scores.loc[("SnapKV", "query-aware", "gold", "every-turn", 3)].kv_share == pytest.approx(0.4)


def test_spearmans_p_is_every_ordering_counted():
    first, last = np.array([90.0, 70.0, 40.0, 20.0, 10.0]), np.array([60.0, 65.0, 30.0, 5.0, 10.0])
    rho, p = turns._spearman_p(first, last)
    observed = stats.spearmanr(first, last).statistic
    reached = [abs(stats.spearmanr(first, np.array(order)).statistic) >= abs(observed) - 1e-12
               for order in itertools.permutations(last)]
    # ranks 5 4 3 2 1 against 4 5 3 1 2: sum d^2 = 4, rho = 1 - 6 x 4 / (5 x 24) = 0.8
    assert rho == pytest.approx(0.8) and p == pytest.approx(np.mean(reached))
    assert np.isnan(turns._spearman_p(first[:2], last[:2])[1])
    ranks = turns.turn_rank(_table()).set_index(["mode", "feed", "compress"])
    assert ranks.loc[("query-aware", "gold", "once")].policies == 2  # SnapKV and KVzip: no ranking to test
    assert np.isnan(ranks.loc[("query-aware", "gold", "once")].p)


def test_a_multi_turn_run_in_the_family(run):
    _ruler(run)
    rows = family.rows_for(run, turns.TABLE, baseline=None)  # each policy against itself: no baseline policy
    for table, baseline in ((turns.TABLE, "SnapKV"), ("eval_ruler.csv", None)):
        with pytest.raises(ValueError, match="a multi-turn run: its baseline is"):
            family.rows_for(run, table, baseline=baseline)
    assert len(rows) == 22 and rows.length.isna().all() and rows.setting.ne("").all()
    assert rows.examples.iloc[0] == "scbench_qa_eng:" + " ".join(map(str, range(N)))
    both = pd.concat([family.rows_for(run, "eval_ruler.csv"), rows], ignore_index=True)
    both.to_csv(run / family.FAMILY, index=False)
    read = family.read_family(run / family.FAMILY)
    family.check_family(read, run)
    with pytest.raises(ValueError, match="in the family only"):
        family.check_family(pd.concat([read, read.iloc[-1:].assign(setting="feed=gold compress=once turn=2")]), run)
    results = family.family_results(run, read, n_boot=0).set_index(["policy", "mode", "setting", "baseline_setting",
                                                                     "analysis"])
    contrasts = turns.contrasts(_table())
    for r in contrasts.itertuples():
        got = results.loc[(r.policy, r.mode, r.setting, r.baseline_setting,
                           "task mean" if r.subset == "all" else r.subset)]
        assert (got.examples, got.nonzero) == (r.n, r.nonzero) and got.p == pytest.approx(r.p)
        assert got.difference == pytest.approx(r.difference) or r.n == 0
    # Holm over every primary row, the RULER run's and the multi-turn run's together
    answered = results.xs("answered", level="analysis")
    assert len(answered) == 23 and answered.p_holm.to_numpy() == pytest.approx(family.holm(answered.p.to_numpy()))
    full = results.loc[("SnapKV", "query-aware", "feed=model compress=once turn=3", "feed=model compress=once turn=1",
                        "task mean")]
    assert full.full_cache == pytest.approx(75)  # the full cache's model-feed turn 3
    family.write_results(run, n_boot=0)
    assert len(family.read_family_results(run)) == len(results)
    # the docs' family tables print the run with no length; the RULER run's KVzip, 12 of 12 kept, holds past Holm
    # over 23 rows (p 2 / 2^12 x 23 = 0.011), nothing of 8 examples can (2 / 2^8 x 23 = 0.18)
    from snapkv_lab.app.docs_tables import _family_holds, _family_runs

    assert f"| tiny | - | {turns.TABLE} | 1 | 8 | 6 | 22 | primary | 0 / 0 |" in _family_runs(run)
    assert "| tiny | 4096 | aware | 0.5 | KVzip | 12 | +100 | 0.00049 | **0.011** |" in _family_holds(run)
    _table().assign(example=lambda t: t.example.replace("7", "9")).to_csv(run / turns.TABLE, index=False)
    with pytest.raises(ValueError, match="declared again"):
        family.check_family(read, run)


def _ruler(folder) -> None:
    """A one-comparison RULER run beside it: KVzip keeps what SnapKV loses on 12 examples."""
    rows = [dict(task="a", example=f"4096-0-{i}", policy=p, ratio=r, mode=m, score=s)
            for i in range(12) for p, r, m, s in (("FullCache", 0.0, "full", 1.0), ("SnapKV", 0.5, "query-aware", 0.0),
                                                 ("KVzip", 0.5, "query-aware", 1.0))]
    pd.DataFrame(rows).assign(model="tiny", dataset="ruler", length=4096, capacity=np.nan, question=0).to_csv(
        folder / "eval_ruler.csv", index=False)


def test_a_family_file_written_before_the_settings_reads_as_single_turn(tmp_path):
    _ruler(tmp_path)
    rows = family.rows_for(tmp_path, "eval_ruler.csv")
    rows.drop(columns=family.SETTINGS).to_csv(tmp_path / family.FAMILY, index=False)
    read = family.read_family(tmp_path / family.FAMILY)
    assert read.setting.eq("").all() and read.length.tolist() == [4096]
    # rows appended under a header that names the settings: the older rows' missing fields read as empty
    text = (tmp_path / family.FAMILY).read_text().splitlines()
    text[0] += ",setting,baseline_setting"
    (tmp_path / family.FAMILY).write_text("\n".join(text) + "\n")
    family.check_family(family.read_family(tmp_path / family.FAMILY), tmp_path)


def test_the_figure_and_the_docs_block_come_from_the_table(run, tmp_path):
    from snapkv_lab.app import docs_tables
    from snapkv_lab.app.figure_sets import FIGURE_MODULES

    assert FIGURE_MODULES["multi-turn"][0] == "snapkv_lab.evaluation.turns"
    assert turns.draw(run, tmp_path) == [tmp_path / "multiturn_turns.png"]
    block = docs_tables.BLOCKS["multi-turn"]
    assert block.reads == (turns.TABLE,) and block.page == "multi-turn.md"
    assert docs_tables.BLOCKS["multi-turn-balanced"].reads == (turns.BALANCED_TABLE,)
    text = docs_tables.rendered("multi-turn", run)
    assert "8 examples of 3 turns" in text and "on 6 of them" in text
    assert "| model | full cache | 100 / 0 / 0 | 100 / 0 / 0 | 75 / 25 / 0 |" in text
    assert "| SnapKV | aware | gold | once | 100 [100, 100] | 100 [100, 100] | 25 [-14, 64] |" in text
    # turn 3 less turn 1, then every-turn less once at turn 3: fewer entries held than appending
    assert "| SnapKV | aware | gold | once | 500 (0.50) vs 500 (0.50) | -75 [-114, -36], p 0.031 (6 of 8) |" in text
    assert "| SnapKV | aware | gold | 400 (0.40) vs 500 (0.50) | +25 [-14, +64], p 0.5 (2 of 8) |" in text
    assert json.dumps(turns.RUN["policies"])  # the reported run is plain data


def test_the_balanced_runs_depth_scores_read_the_band_each_turn_asked(tmp_path):
    """The full cache of a toy balanced run finds only the middle band's needle: depth_scores must put every hit in
    band 1, whichever turn asked it. The band each turn asked is read here from where its answer stands in the
    generated haystack, not from balanced_order."""
    from snapkv_lab.tasks.turn_needles import turn_needle_rows

    rows = turn_needle_rows(6, words=300, source="pydoc")
    table = []
    for row in rows:
        places = [row["context"].index(t["answer"]) for t in row["multi_turns"]]
        for turn, place in enumerate(places, start=1):
            band = sorted(places).index(place)
            for feed in ("gold", "model"):
                table.append(dict(model="tiny", dataset="scbench", task="scbench_qa_eng", example=str(row["id"]),
                                  policy="FullCache", ratio=0.0, mode="full", feed=feed, compress="none", turn=turn,
                                  score=float(band == 1)))
    scores = turns.depth_scores(pd.DataFrame(table)).set_index(["feed", "turn", "band"])
    assert len(scores) == 2 * 3 * 3 and (scores.n == 2).all()  # 6 rows: each band at each turn twice
    assert (scores.xs(1, level="band").score == 100).all() and (scores.drop(1, level="band").score == 0).all()
    text = turns.depth_report(pd.DataFrame(table))
    assert "| gold | 1 | 100 [100, 100] (n 2) | 100 [100, 100] (n 2) | 100 [100, 100] (n 2) |" in text


def test_recompute_writes_each_runs_suite_where_missing(tmp_path, monkeypatch):
    from snapkv_lab.evaluation import run as eval_run

    calls = []
    monkeypatch.setattr(turns, "SUITES", str(tmp_path / "suites"))
    monkeypatch.setattr(eval_run, "evaluate", lambda model, **options: calls.append(options))
    monkeypatch.setattr("snapkv_lab.tasks.turn_needles.turn_needle_rows",
                        lambda n, **suite: [dict(id=0, order=suite["order"], words=suite["words"], rows=n)])
    turns.recompute(dict(data_dir=str(tmp_path)))
    assert [c["name"] for c in calls] == ["scbench_multiturn", "scbench_multiturn_balanced"]
    assert [c["limit"] for c in calls] == [8, 6]
    for call, order in zip(calls, ("shuffled", "balanced")):
        written = json.loads((tmp_path / "suites" / call["source"].rsplit("/", 1)[1] / "scbench_qa_eng.jsonl")
                             .read_text())
        assert written == dict(id=0, order=order, words=500, rows=turns.SUITE_ROWS)
