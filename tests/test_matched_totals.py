"""The committed tables compare policies at matched totals: every table whose rows record the KV entries they held
(kv_entries, recorded by the run or filled by the budget audit) holds each policy to its nominal budget's share
within rounding, except the policies evaluation.audit.BUDGET_DEPARTURES names, within the bounds it states (which
the docs' leaderboards mark: † over budget, "under budget" named)."""

from __future__ import annotations

from pathlib import Path

import pytest

from snapkv_lab.evaluation.audit import BUDGET_DEPARTURES, ROUNDING, budget_departure, budget_gaps, budget_records

DATA = Path(__file__).resolve().parents[1] / "data"


@pytest.fixture(scope="module")
def gaps():
    return budget_gaps(DATA)


def test_every_committed_policy_holds_its_budget_or_is_named(gaps):
    for row in gaps.itertuples():
        least, most, why = budget_departure(row.policy) or (-ROUNDING, ROUNDING, "matched")
        assert least - 1e-4 <= row.least and row.most <= most + 1e-4, (row.table, row.policy, row.least, row.most, why)
        if most <= ROUNDING:  # only a policy named over budget may hold more than rounding allows
            assert row.over_budget == 0, (row.table, row.policy, row.over_budget)


def test_the_check_reads_every_table_that_records_entries_and_every_departure_is_seen(gaps):
    records = budget_records(DATA)
    known = set(records.table[records.known & ~records.record.str.startswith("recorded as")])
    assert set(gaps.table) == known  # no table with entries left out of the check
    assert {"eval_ruler.csv", "eval_ruler_4k_ratios.csv"} <= known
    bounds = gaps.policy.map(budget_departure)
    for policy, bound in BUDGET_DEPARTURES.items():  # a bound no table reaches any longer is stale
        seen = gaps[bounds.map(lambda found: found is bound)]
        assert len(seen) and (seen.least.min() < -ROUNDING or seen.most.max() > ROUNDING), policy
