"""The tests behind every comparative number of the benchmarks: the sign-flip test against its definition enumerated
here, Holm's adjustment against a worked example, and the two averages of a paired difference."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pandas as pd
import pytest

from snapkv_lab.evaluation.summary import answered_examples, holm, paired_difference, sign_flip_test


def _brute_force_p(differences, weights) -> float:
    """The sign-flip p by its definition: every assignment of signs to every example's difference (zeros included),
    the share whose |sum(weights * signed differences)| reaches the observed one."""
    differences, weights = np.asarray(differences, dtype=float), np.asarray(weights, dtype=float)
    observed = abs(np.sum(weights * differences))
    hits = sum(abs(np.sum(weights * np.asarray(signs) * differences)) >= observed - 1e-9
               for signs in itertools.product((-1, 1), repeat=len(differences)))
    return hits / 2 ** len(differences)


@pytest.mark.parametrize("differences", [
    [100, 100, 100, 100, 100],                      # all agree: 2 / 32
    [100, 100, -100, 0, 50, 50, 0, 100],            # ties and zeros
    [0, 0, 0],                                      # nothing differs: p 1
    [-25, 0, 75, 75, 75, -25, 100, 0, 50],         # partial scores (multivalue's quarters)
    [100],                                          # one difference: both signs reach it
    [100, -100, 100, 0, 100, 100, -100],            # one magnitude: counted as a binomial
])
def test_the_exact_sign_flip_p_of_a_mean_over_examples_is_its_enumerated_definition(differences):
    weights = np.full(len(differences), 1 / len(differences))
    p, method = sign_flip_test(np.asarray(differences), weights)
    assert method == "exact"
    assert p == pytest.approx(_brute_force_p(differences, weights))


def test_the_exact_sign_flip_p_of_a_mean_over_tasks_flips_examples_and_recomputes_the_task_mean():
    # Three tasks of 4, 2 and 1 examples: the leaderboard's statistic weighs an example 1 / (its task's size x 3),
    # so the lone example of task c counts four times one of task a's. The test flips each example's difference and
    # recomputes that statistic: the same as flipping the weighted terms.
    groups = [np.array([100.0, 0, 100, -100]), np.array([50.0, 50]), np.array([-100.0])]
    weights = np.concatenate([np.full(len(g), 1 / (len(g) * len(groups))) for g in groups])
    differences = np.concatenate(groups)
    p, method = sign_flip_test(differences, weights)
    assert method == "exact" and p == pytest.approx(_brute_force_p(differences, weights))
    # the mean over examples of the same differences is another statistic, with another p
    even = np.full(len(differences), 1 / len(differences))
    assert sign_flip_test(differences, even)[0] == pytest.approx(_brute_force_p(differences, even))
    assert _brute_force_p(differences, even) != pytest.approx(p)
    with pytest.raises(ValueError, match="one length"):
        sign_flip_test(differences, weights[:-1])


def test_differences_of_one_magnitude_are_counted_exactly_at_any_number():
    # 24 wins or losses of one size, 17 won: the statistic counts signs, and the exact p is a binomial tail,
    # P(|2B - 24| >= 10) with B ~ Bin(24, 1/2): no flip is drawn
    differences = np.array([100.0] * 17 + [-100.0] * 7 + [0.0] * 5)
    exact = sum(math.comb(24, k) for k in range(25) if abs(2 * k - 24) >= 10) / 2 ** 24
    assert sign_flip_test(differences, np.full(29, 1 / 29)) == (pytest.approx(exact), "exact")


def test_past_twenty_nonzero_differences_of_several_sizes_the_flips_are_counted_by_their_sums_or_drawn():
    # 22 differences of sizes 1 and 2: the exact p by the definition, the distribution of sum(signs * differences)
    # built by convolution over the examples (written here as dictionaries of counts), against the test's count,
    # and against 20,000 drawn flips where the sizes are no whole multiples of one unit
    differences = np.array([2.0] * 8 + [1.0] * 8 + [-1.0] * 4 + [-2.0] * 2)
    counts = {0: 1}
    for d in differences.astype(int):
        shifted: dict[int, int] = {}
        for total, n in counts.items():
            for signed in (d, -d):
                shifted[total + signed] = shifted.get(total + signed, 0) + n
        counts = shifted
    observed = abs(int(differences.sum()))
    exact = sum(n for total, n in counts.items() if abs(total) >= observed) / 2 ** len(differences)
    assert sign_flip_test(differences, np.full(22, 1 / 22), n_resamples=20000, seed=3) == (pytest.approx(exact),
                                                                                            "exact")
    # the leaderboard's weights, 1 / (tasks x examples in the task), and scores of three references: still counted
    weights = np.r_[np.full(15, 1 / (2 * 15)), np.full(7, 1 / (2 * 7))]
    assert sign_flip_test(differences * 100 / 3, weights)[1] == "exact"
    # sizes with no common unit (irrational ratios): the flips are drawn, p near the count of the same signs' sums
    odd = differences * np.sqrt([2.0, 3.0])[np.arange(22) % 2]
    counts = {0.0: 1}
    for d in np.abs(odd):
        shifted: dict[float, int] = {}
        for total, n in counts.items():
            for signed in (d, -d):
                key = round(total + signed, 9)
                shifted[key] = shifted.get(key, 0) + n
        counts = shifted
    exact = sum(n for total, n in counts.items() if abs(total) >= abs(odd.sum()) - 1e-9) / 2 ** 22
    p, method = sign_flip_test(odd, np.full(22, 1 / 22), n_resamples=20000, seed=3)
    assert method == "monte carlo (floor 1/20001)"
    assert p == pytest.approx(exact, abs=4 * math.sqrt(exact / 20000))
    # every drawn flip short of the observed: p is the floor, never 0
    assert sign_flip_test(np.r_[np.ones(20), np.sqrt(2.0)], np.full(21, 1 / 21), n_resamples=999) == (
        pytest.approx(1 / 1000), "monte carlo (floor 1/1000)")


def test_holm_against_a_worked_example():
    # Holm (1979), the usual textbook case: four hypotheses, p = 0.01, 0.04, 0.03, 0.005. Ordered, the smallest is
    # multiplied by 4 (0.02), the next by 3 (0.03), then by 2 (0.06), the largest by 1 (0.04, raised to 0.06 so that
    # the adjusted values keep the order of the raw ones). At 0.05 the first and fourth are rejected.
    assert holm(np.array([0.01, 0.04, 0.03, 0.005])) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm(np.array([0.5, 0.6, 0.2])) == pytest.approx([1.0, 1.0, 0.6])  # capped at 1
    assert holm(np.array([])).shape == (0,)


def _table(rows) -> pd.DataFrame:
    table = pd.DataFrame(rows, columns=["task", "example", "policy", "ratio", "mode", "score"])
    return table.assign(dataset="toy", capacity=pd.NA, question=0, model="tiny", length=4096)


def test_a_paired_difference_averages_over_tasks_or_over_examples():
    # task a: KVzip beats SnapKV on all four examples; task b: one example, a tie. Over tasks (100 + 0) / 2 = 50;
    # over examples 400 / 5 = 80. The full cache answers task a's four and not b's.
    rows = [("a", e, "FullCache", 0.0, "full", 1.0) for e in range(4)] + [("b", 0, "FullCache", 0.0, "full", 0.0)]
    rows += [(t, e, p, 0.5, "query-agnostic", float(p == "KVzip" and t == "a"))
             for t, n in (("a", 4), ("b", 1)) for e in range(n) for p in ("SnapKV", "KVzip")]
    table = _table(rows)
    tasks = paired_difference(table, n_boot=0).iloc[0]
    examples = paired_difference(table, n_boot=0, average="examples").iloc[0]
    assert tasks.difference == pytest.approx(50) and examples.difference == pytest.approx(80)
    assert tasks.p == examples.p == pytest.approx(2 / 16)  # four nonzero differences, all one way
    assert tasks.nonzero == 4 and tasks.p_method == "exact" and tasks.examples == 5
    with pytest.raises(ValueError, match="average must be one of"):
        paired_difference(table, average="questions")
    answered = answered_examples(table)
    assert sorted(zip(answered.task, answered.example)) == [("a", 0), ("a", 1), ("a", 2), ("a", 3)]
    # a partial answer is not an answer: the full cache at 50 on an example leaves it out, unless `at` says so
    half = _table([("a", 0, "FullCache", 0.0, "full", 0.5), ("a", 1, "FullCache", 0.0, "full", 1.0)])
    assert list(answered_examples(half).example) == [1]
    assert list(answered_examples(half, at=50).example) == [0, 1]
