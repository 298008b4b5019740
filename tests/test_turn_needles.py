"""The generated multi-turn suite (tasks.turn_needles): SCBench's schema, seeded rows, and the balanced order of the
needles' depths over turns, read back from where each asked value stands in the text."""

from __future__ import annotations

from collections import Counter
from itertools import permutations

import pytest

from snapkv_lab.tasks.turn_needles import turn_needle_rows

SOURCE = "pydoc"  # the stdlib's help topics: always installed, unlike the essays


def asked_bands(row) -> list[int]:
    """The depth band (0 = nearest the start) of the needle each turn asks for, from the answers' places in the text."""
    places = [row["context"].index(turn["answer"]) for turn in row["multi_turns"]]
    by_place = sorted(places)
    return [by_place.index(place) for place in places]


def test_rows_are_scbench_rows_with_one_needle_a_turn():
    rows = turn_needle_rows(4, words=300, needles=3, source=SOURCE)
    assert [row["id"] for row in rows] == [0, 1, 2, 3]
    for row in rows:
        assert set(row) == {"id", "context", "multi_turns"} and len(row["multi_turns"]) == 3
        answers = [turn["answer"] for turn in row["multi_turns"]]
        assert len(set(answers)) == 3 and all(a.isdigit() and len(a) == 7 for a in answers)
        assert all(row["context"].count(a) == 1 for a in answers)  # each value stands once: no turn answers another
        for turn in row["multi_turns"]:
            key = turn["input"].split("for ")[1].split(" mentioned")[0]
            assert f"special magic numbers for {key} is: {turn['answer']}." in row["context"]


def test_balanced_order_asks_each_band_at_each_turn_equally_often():
    rows = turn_needle_rows(6, words=300, needles=3, source=SOURCE)
    orders = [tuple(asked_bands(row)) for row in rows]
    assert sorted(orders) == sorted(permutations(range(3)))  # 6 rows: every order once, so every carry-over too
    for block in (orders[:3], orders[3:]):  # each block of 3 rows a Latin square
        for turn in range(3):
            assert sorted(order[turn] for order in block) == [0, 1, 2]
    eight = [tuple(asked_bands(row)) for row in turn_needle_rows(8, words=300, needles=4, source=SOURCE)]
    assert all(Counter(order[turn] for order in eight) == Counter({0: 2, 1: 2, 2: 2, 3: 2}) for turn in range(4))


def test_the_orders_share_the_rows_and_a_row_depends_on_its_index_only():
    balanced = turn_needle_rows(5, words=300, source=SOURCE, seed=3)
    shuffled = turn_needle_rows(5, words=300, source=SOURCE, seed=3, order="shuffled")
    for b, s in zip(balanced, shuffled):
        assert b["context"] == s["context"]
        assert sorted(map(tuple, (t.values() for t in b["multi_turns"]))) == sorted(
            map(tuple, (t.values() for t in s["multi_turns"])))
    assert turn_needle_rows(3, words=300, source=SOURCE, seed=3) == balanced[:3]
    assert turn_needle_rows(5, words=300, source=SOURCE, seed=4) != balanced
    assert len({tuple(asked_bands(row)) for row in shuffled}) > 1  # seeded per row, not one fixed order


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="order must be one of"):
        turn_needle_rows(2, words=300, source=SOURCE, order="sorted")
    with pytest.raises(ValueError, match="source must be one of"):
        turn_needle_rows(2, source="novels")
    with pytest.raises(ValueError, match="words >= 10 per needle"):
        turn_needle_rows(2, words=20, needles=3, source=SOURCE)
