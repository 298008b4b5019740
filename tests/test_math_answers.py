"""AIME25 and MATH500: the answer checkers on hand-picked answers (PRM800K's grader's rules, kvpress's string rules),
and the loaders on offline fixtures in kvpress's Hub schema, refused clearly without data."""

from __future__ import annotations

from pathlib import Path

import pytest

from snapkv_lab.evaluation.hub import load_rows
from snapkv_lab.evaluation.math_answers import boxed, kvpress_aime, kvpress_math500, math_equal, math_normalize
from snapkv_lab.evaluation.metrics import score
from snapkv_lab.evaluation.registry import DATASETS

FIXTURES = Path(__file__).parent / "fixtures" / "eval"


@pytest.mark.parametrize("given, truth", [
    ("\\frac12", "\\frac{1}{2}"),  # MATH's normalization braces \frac12
    ("0.5", "\\frac{1}{2}"),  # its 0.5 rule
    ("1/2", "\\frac{1}{2}"),  # a/b of integers
    ("\\dfrac{3}{4}", "\\frac{3}{4}"),
    ("2.5", "\\frac52"),  # sympy: 5/2 - 2.5 = 0
    ("2\\sqrt{2}", "\\sqrt{8}"),  # sympy simplifies
    ("\\frac{\\pi}{2}", "\\pi/2"),
    ("x = 3", "3"),  # "x =" dropped
    ("10\\%", "10"),
    ("5 \\text{ cm}", "5"),  # units on the right
    ("1,000", "1000"),  # thousands separators
    ("(1, 2)", "(1,2)"),
    ("(x+1)^2", "x^2+2x+1"),
    ("1 1/2", "\\frac{3}{2}"),  # a mixed number
    ("\\text{(C)}", "(C)"),
    ("90^\\circ", "90"),
])
def test_equivalent_answers(given, truth):
    assert math_equal(given, truth)


@pytest.mark.parametrize("given, truth", [
    ("2/4", "\\frac{1}{2}"),  # an unreduced fraction is not the answer (grader.py: fractions compared as written)
    ("\\frac{2}{4}", "\\frac12"),
    ("(1,2)", "[1,2]"),  # an open interval is not a closed one
    ("3.0001", "3"),  # an integer answer only matches an integer
    ("7", "8"),
    ("(1,2,3)", "(1,2)"),
    ("", "4"),
    (None, "4"),
])
def test_non_equivalent_answers(given, truth):
    assert not math_equal(given, truth)


def test_math_normalize_follows_hendrycks_order():
    assert math_normalize("\\left( 3, \\tfrac12 \\right)") == "(3,\\frac{1}{2})"
    assert math_normalize(".5") == "\\frac{1}{2}" and math_normalize("k = \\sqrt3") == "\\sqrt{3}"


def test_boxed_answers_and_kvpress_string_rules():
    text = "First \\boxed{\\frac{1}{2}}, then on reflection \\boxed{\\frac{1}{3}}."
    assert boxed(text) == "\\frac{1}{3}" and boxed(text, last=False) == "\\frac{1}{2}"
    assert boxed("no box") is None and boxed("\\boxed{unclosed") is None
    # AIME25 (kvpress): the last box, as a string
    assert kvpress_aime("\\boxed{70} ... so \\boxed{588}", ["588"]) == 1.0
    assert kvpress_aime("\\boxed{588.0}", ["588"]) == 0.0
    # MATH500 (kvpress): the first "boxed{" to the next "}": a nested answer never matches, an equivalent form neither
    assert kvpress_math500("\\boxed{3}", ["3"]) == 1.0
    assert kvpress_math500("\\boxed{\\frac{1}{2}}", ["\\frac{1}{2}"]) == 0.0
    assert kvpress_math500("\\boxed{0.5}", ["\\frac{1}{2}"]) == 0.0
    # MATH's grader reads the last box and counts equivalent forms
    assert score("math_equal", "\\boxed{0.5}", ["\\frac{1}{2}"]) == 1.0
    assert score("math_equal", "the answer is 0.5", ["\\frac{1}{2}"]) == 0.0  # no box, no answer


def test_loaders_read_the_fixtures_in_kvpress_schema():
    load_rows.cache_clear()
    aime = DATASETS["aime25"]
    spec, second = aime.specs("aime25", source=str(FIXTURES / "aime25"))
    example = aime.example(second)
    assert example.metric == "kvpress_aime" and example.max_new_tokens == 32000
    assert example.questions[0].answers == ("70",) and "7 \\times 8" in example.questions[0].text
    math = DATASETS["math500"]
    spec = math.specs("math500", source=str(FIXTURES / "math500"))[0]
    example = math.example(spec)
    assert example.metric == "math_equal" and example.id == "test/prealgebra/1.json"
    assert example.meta == {"subject": "Prealgebra", "level": 1}
    kvpress = math.example(math.specs("math500", source=str(FIXTURES / "math500"), grader="kvpress")[1])
    assert kvpress.metric == "kvpress_math500" and kvpress.questions[0].answers == ("(-2,2)",)
    load_rows.cache_clear()


def test_absent_data_is_refused_clearly(tmp_path):
    load_rows.cache_clear()
    with pytest.raises(FileNotFoundError, match="math500.jsonl"):
        DATASETS["math500"].specs("math500", source=str(tmp_path))
    with pytest.raises(ValueError, match="grader must be one of"):
        DATASETS["math500"].specs("math500", source=str(FIXTURES / "math500"), grader="exact")
