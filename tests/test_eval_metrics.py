"""The benchmarks' official metrics (snapkv_lab.evaluation.metrics) on hand-worked cases.

Each expected value is derived in its comment from the official definition; a few come from the official libraries
themselves (the `rouge` package 1.0.1, rouge-score 0.1.2, fuzzywuzzy 0.18.0, NLTK 3.10.4, and LongBench's and
InfiniteBench's scorer files), run once outside this suite on the inputs written here.
"""

from __future__ import annotations

import importlib.util
import math

import pytest

from snapkv_lab.evaluation.metrics import (
    METRICS,
    cloze_counts,
    extract_choice,
    first_line,
    fuzz_ratio,
    normalize_answer,
    normalize_zh_answer,
    rouge_l,
    rouge_lsum,
    rouge_n,
    ruler_postprocess,
    score,
    sentence_bleu,
)

HAS_JIEBA = importlib.util.find_spec("jieba") is not None
NEEDS_JIEBA = {"qa_f1_zh_score", "rouge_zh_score"}
# the `rouge` package divides by (p + r + 1e-8): a perfect match scores 2 / (2 + 1e-8)
ROUGE_ONE = pytest.approx(1.0, abs=1e-8)

# One perfect prediction per metric: (prediction, references, meta). A metric without one fails the test below.
PERFECT = {
    "kvpress_aime": ("so the answer is \\boxed{42}", ["42"], {}),
    "kvpress_math500": ("\\boxed{5}", ["5"], {}),
    "math_equal": ("\\boxed{\\frac12}", ["\\frac{1}{2}"], {}),
    "nolima_em": ("Yuki", ["Yuki"], {}),
    "nolima_contains": ("It is Yuki.", ["Yuki"], {}),
    "nolima_lastline_em": ("Let me think.\nYuki", ["Yuki"], {}),
    "nolima_lastline_contains": ("Let me think.\nIt is Yuki.", ["Yuki"], {}),
    "qa_f1_score": ("The Eiffel Tower", ["eiffel tower"], {}),
    "qa_f1_zh_score": ("北京", ["北京"], {}),
    "rouge_score": ("the cat sat on the mat", ["the cat sat on the mat"], {}),
    "rouge_zh_score": ("我们去北京", ["我们去北京"], {}),
    "classification_score": ("Location", ["Location"], {"all_classes": ["Location", "Human", "Food"]}),
    "retrieval_score": ("Paragraph 3", ["Paragraph 3"], {}),
    "retrieval_zh_score": ("段落3", ["段落3"], {}),
    "count_score": ("5", ["5"], {}),
    "code_sim_score": ("return x + 1", ["return x + 1"], {}),
    "choice_accuracy": ("The correct answer is (B)", ["B"], {}),
    "string_match_all": ("123 and 456", ["123", "456"], {}),
    "string_match_part": ("Paris", ["paris", "London"], {}),
    "infinitebench_passkey": ("71432", ["71432"], {}),
    "infinitebench_number_string": ("2200012222", ["2200012222"], {}),
    "infinitebench_kv_retrieval": ('"00a0-42"', ["00a0-42"], {}),
    "infinitebench_longbook_sum_eng": ("The cat sat.", ["the cat sat"], {}),
    "infinitebench_longbook_choice_eng": ("B", ["Taking care of Totty", "B"], {}),
    "infinitebench_longbook_qa_eng": ("Peyton", ['"Peyton"'], {}),
    "infinitebench_longbook_qa_chn": ("北京", ["北京"], {}),
    "infinitebench_longdialogue_qa_eng": ("ACE", ["ACE", "ACE ROTHSTEIN"], {}),
    "infinitebench_math_find": ("91", ["91"], {}),
    "infinitebench_math_calc": ("[1, 4, 8]", ["1", "4", "8"], {}),
    "infinitebench_code_run": ("42", ["42"], {}),
    "infinitebench_code_debug": ("B. func_b", ["func_b", "B"], {}),
    "scbench_kv": ("00a0-42", ["00a0-42"], {}),
    "scbench_prefix_suffix": ("abc-xyz", ["abc-xyz"], {}),
    "scbench_vt": ("X1 X2 X3", ["X1", "X2", "X3"], {}),
    "scbench_qa_eng": ("Ace", ["ACE"], {}),
    "scbench_qa_chn": ("北京", ["北京"], {}),
    "scbench_choice_eng": ("B", ["Taking care of Totty", "B"], {}),
    "scbench_many_shot": ("label: positive", ["positive"], {}),
    "scbench_summary": ("the cat sat", ["the cat sat"], {}),
    "scbench_mf": ("12", ["12"], {}),
    "scbench_passkey": ("71432", ["71432"], {}),
    "loogle_rouge_l": ("a b c", ["a b c"], {}),
    "loogle_rouge_1": ("a b c", ["a b c"], {}),
    "loogle_rouge_2": ("a b c", ["a b c"], {}),
    "loogle_bleu_1": ("a b c d", ["a b c d"], {}),
    "loogle_bleu_4": ("a b c d", ["a b c d"], {}),
    "loogle_exact_match": ("{'<mask-0>': 'Bob'}", ['{"<mask-0>": "Bob"}'], {}),
    "loogle_partial_match": ("{'<mask-0>': 'Bob'}", ['{"<mask-0>": "Bob"}'], {}),
    "needle_rouge": ("a b c", ["a b c"], {}),
}

# Predictions of every kind: empty, blank, noisy, long, and the shapes the extractors look for.
SOME_PREDICTIONS = ["", " \n ", "...", "The correct answer is (A)", "Paragraph 3, Paragraph 12", "ACE and BOB",
                    "answer: 7.5 then 12", "{'<mask-0>': 'Alice'}", "我们去北京。", "x " * 300, "\x00\tweird\x1f"]


def _skip_without_jieba(name: str) -> None:
    if name in NEEDS_JIEBA and not HAS_JIEBA:
        pytest.skip("jieba is not installed (pip install jieba)")


@pytest.mark.parametrize("name", sorted(METRICS))
def test_every_metric_scores_its_perfect_prediction_1(name):
    assert name in PERFECT, f"add a perfect-prediction case for the new metric {name!r} to PERFECT"
    _skip_without_jieba(name)
    prediction, references, meta = PERFECT[name]
    assert score(name, prediction, references, **meta) == pytest.approx(1.0, abs=1e-8)


@pytest.mark.parametrize("name", sorted(METRICS))
def test_every_metric_is_in_the_unit_interval(name):
    _skip_without_jieba(name)
    perfect, references, meta = PERFECT[name]
    for prediction in [*SOME_PREDICTIONS, perfect + " and more words", "no match at all"]:
        value = score(name, prediction, references, **meta)
        assert isinstance(value, float) and 0.0 <= value <= 1.0, (prediction, value)


# ---------------------------------------------------------------------------------------------------------------
# score

def test_score_names_the_known_metrics_for_an_unknown_one():
    with pytest.raises(ValueError, match=r"unknown metric 'f1'.*qa_f1_score.*string_match_all"):
        score("f1", "x", ["x"])


def test_score_refuses_a_string_or_no_references():
    with pytest.raises(TypeError):
        score("qa_f1_score", "Paris", "Paris")
    with pytest.raises(ValueError, match="no reference"):
        score("qa_f1_score", "Paris", [])


def test_score_cuts_to_the_first_line_when_meta_asks():
    prediction = "\n\nParis\nQuestion: what is the capital of Italy?"
    assert first_line(prediction) == "Paris"
    assert score("qa_f1_score", prediction, ["Paris"], first_line=True) == 1.0
    # whole text: "paris question what is capital of italy" = 7 tokens, 1 shared: F1 = 2*(1/7)*1/(1/7+1) = 1/4
    assert score("qa_f1_score", prediction, ["Paris"]) == pytest.approx(0.25)


def test_score_passes_meta_and_ignores_what_a_metric_does_not_use():
    meta = {"all_classes": ["Location", "Human"], "length": 5000, "task": "trec", "_id": "x"}
    assert score("classification_score", "Human", ["Human"], **meta) == 1.0
    assert score("qa_f1_score", "Human", ["Human"], **meta) == 1.0


# ---------------------------------------------------------------------------------------------------------------
# LongBench

def test_normalize_answer_lowers_and_drops_punctuation_articles_and_extra_spaces():
    assert normalize_answer("The  Cat, an apple & A dog!") == "cat apple dog"
    assert normalize_answer("theater") == "theater"  # "the" only as a whole word
    assert normalize_zh_answer("北京， 是 首都。A") == "北京是首都a"


def test_qa_f1_score_by_hand():
    # "cat sat on mat" vs "cat on mat": 3 shared of 4 predicted and 3 reference: 2*(3/4)*1/(3/4+1) = 6/7
    assert METRICS["qa_f1_score"]("the cat sat on the mat", ["cat on mat"]) == pytest.approx(6 / 7)
    # best reference: "dog" shares nothing, the other gives 6/7
    assert METRICS["qa_f1_score"]("the cat sat on the mat", ["dog", "cat on mat"]) == pytest.approx(6 / 7)
    # repeated tokens are counted as a multiset: "x x y" vs "x y y" share one x and one y: 2*(2/3)*(2/3)/(4/3) = 2/3
    assert METRICS["qa_f1_score"]("x x y", ["x y y"]) == pytest.approx(2 / 3)
    assert METRICS["qa_f1_score"]("", ["Paris"]) == 0.0
    assert METRICS["qa_f1_score"]("the", ["a"]) == 0.0  # both normalise to nothing


def test_qa_f1_zh_score_by_hand():
    pytest.importorskip("jieba")
    # jieba: 我们/去/北京/。 ; "。" normalises away: 1 shared of 3 and 1: 2*(1/3)*1/(1/3+1) = 1/2
    assert METRICS["qa_f1_zh_score"]("我们去北京。", ["北京"]) == pytest.approx(0.5)
    assert METRICS["qa_f1_zh_score"]("", ["北京"]) == 0.0


def test_rouge_score_by_hand():
    # one sentence each: LCS(a c e, a b c d) = "a c": 2 hits; p = 2/4, r = 2/3: F = 2pr/(p+r+1e-8) ~ 4/7
    assert METRICS["rouge_score"]("a b c d", ["a c e"]) == pytest.approx(4 / 7, abs=1e-8)
    # summary level, sentences split at '.': ref "c a" meets "a b" on a and "c d" on c: 2 hits of 2 distinct
    # reference words and 4 hypothesis words: p = 1/2, r = 1: F = 2/3 (one sentence "a b c d" would give 1 hit)
    assert METRICS["rouge_score"]("a b. c d", ["c a"]) == pytest.approx(2 / 3, abs=1e-8)
    assert METRICS["rouge_score"]("Cat", ["cat"]) == 0.0  # case counts
    assert METRICS["rouge_score"]("", ["cat"]) == 0.0  # the package raises on an empty text; LongBench scores 0
    assert METRICS["rouge_score"]("...", ["cat"]) == 0.0  # only dots: no sentence either


def test_rouge_score_counts_distinct_words_and_reads_the_lcs_back_like_the_package():
    # distinct words: "a a a" has one distinct word, the LCS with "a" hits it: p = r = 1
    assert METRICS["rouge_score"]("a a a", ["a"]) == ROUGE_ONE
    # LCS(ref a a b, hyp a b a) has length 2; read back stepping along the hypothesis on ties it is "a b" (2
    # distinct of 2 and 2: F ~ 1); read back the other way it would be "a a" (1 hit: F = 1/2)
    assert METRICS["rouge_score"]("a b a", ["a a b"]) == ROUGE_ONE


def test_rouge_l_on_the_rouge_package_readme_pair():
    # the README's example of pltrdy/rouge; values from rouge 1.0.1's Rouge().get_scores(hyp, ref)[0]
    hyp = ("the #### transcript is a written version of each day 's cnn student news program use this transcript "
           "to help students with reading comprehension and vocabulary use the weekly newsquiz to test your "
           "knowledge of storie s you saw on cnn student news")
    ref = ("this page includes the show transcript use the transcript to help students with reading comprehension "
           "and vocabulary at the bottom of the page , comment for a chance to be mentioned on cnn student news . "
           "you must be a teacher or a student age # # or older to request a mention on the cnn student news roll "
           "call . the weekly newsquiz tests students ' knowledge of even ts in the news")
    assert rouge_l(hyp, ref) == pytest.approx((0.5714285714285714, 0.4166666666666667, 0.4819277059660328))
    assert rouge_n(hyp, ref, 1) == pytest.approx((0.6285714285714286, 0.4583333333333333, 0.5301204770503702))
    assert rouge_n(hyp, ref, 2) == pytest.approx((0.375, 0.21739130434782608, 0.2752293531520916))


def test_rouge_zh_score_by_hand():
    pytest.importorskip("jieba")
    # "我们 去 北京 。" is one sentence ("。" is not "."), 4 distinct words; LCS with "北京" hits 1:
    # p = 1/4, r = 1: F = 2*(1/4)/(5/4) = 2/5
    assert METRICS["rouge_zh_score"]("我们去北京。", ["北京"]) == pytest.approx(0.4, abs=1e-8)


def test_classification_score_by_hand():
    classes = ["Location", "Human", "Food"]
    # two classes named, the right one among them: 1/2
    assert METRICS["classification_score"]("Location or Human", ["Location"], all_classes=classes) == 0.5
    assert METRICS["classification_score"]("Food", ["Location"], all_classes=classes) == 0.0
    with pytest.raises(ValueError, match="all_classes"):
        METRICS["classification_score"]("Food", ["Food"])


def test_classification_score_keeps_the_official_drop_loop():
    # matched: Chinese, Chi, nese, Chinese food. The loop drops "Chinese" (inside the reference, not it), which
    # skips "Chi"; drops "nese", which skips "Chinese food": left [Chi, Chinese food], score 1/2 (not 1)
    classes = ["Chinese", "Chi", "nese", "Chinese food"]
    assert METRICS["classification_score"]("Chinese food", ["Chinese food"], all_classes=classes) == 0.5


def test_retrieval_and_count_scores_by_hand():
    # numbers 3 and 12, one of them the paragraph: 1/2
    assert METRICS["retrieval_score"]("Paragraph 3, or maybe Paragraph 12", ["Paragraph 3"]) == 0.5
    assert METRICS["retrieval_score"]("Paragraph 30", ["Paragraph 3"]) == 0.0  # whole numbers are compared
    assert METRICS["retrieval_score"]("I do not know", ["Paragraph 3"]) == 0.0
    assert METRICS["retrieval_zh_score"]("答案是段落3和段落5", ["段落3"]) == 0.5
    with pytest.raises(ValueError, match="Paragraph"):
        METRICS["retrieval_score"]("3", ["3"])
    assert METRICS["count_score"]("There are 5 unique paragraphs", ["5"]) == 1.0
    assert METRICS["count_score"]("5 or 6", ["5"]) == 0.5
    assert METRICS["count_score"]("none", ["5"]) == 0.0


def test_fuzz_ratio_by_hand():
    assert fuzz_ratio("abcd", "abce") == 75  # 3 matching characters: 2*3/8
    # 1 matching of 16 characters: 12.5, rounded half to even as Python's round: 12 (fuzzywuzzy 0.18.0 gives 12)
    assert fuzz_ratio("abcdefgh", "aijklmno") == 12
    assert fuzz_ratio("", "") == 100  # fuzzywuzzy tests equality before emptiness
    assert fuzz_ratio("", "x") == 0


def test_code_sim_score_takes_the_first_line_without_backticks_hashes_or_slashes():
    prediction = "\n```python\nx = 1  # set\n// note\nreturn x + 1\n```"
    assert METRICS["code_sim_score"](prediction, ["return x + 1"]) == 1.0
    assert METRICS["code_sim_score"]("```\n# only comments\n```", ["return x"]) == 0.0  # no line left: ""
    # from LongBench's metrics.py code_sim_score (fuzzywuzzy's difflib path)
    assert METRICS["code_sim_score"]("    return self.weight * x + self.bias\n",
                                     ["return self.weight * x"]) == 0.73


# ---------------------------------------------------------------------------------------------------------------
# LongBench v2

def test_extract_choice_as_longbench_v2_pred_py():
    assert extract_choice("**The correct answer is (B)**") == "B"  # '*' dropped first
    assert extract_choice("The correct answer is C.") == "C"
    # the parenthesised form is looked for first, anywhere
    assert extract_choice("The correct answer is A. No: The correct answer is (D)") == "D"
    assert extract_choice("the correct answer is (A)") is None  # case counts
    assert extract_choice("The correct answer is (E)") is None
    assert METRICS["choice_accuracy"]("The correct answer is (B)", ["C"]) == 0.0
    assert METRICS["choice_accuracy"]("B", ["B"]) == 0.0  # a bare letter is not read


# ---------------------------------------------------------------------------------------------------------------
# RULER

def test_ruler_string_match_by_hand():
    # 2 of 3 references found: 2/3
    assert METRICS["string_match_all"]("The numbers are 123 and 456", ["123", "456", "789"]) == pytest.approx(2 / 3)
    assert METRICS["string_match_all"]("ABC", ["abc"]) == 1.0  # case-insensitive
    assert METRICS["string_match_part"]("It is London.", ["Paris", "london"]) == 1.0
    assert METRICS["string_match_part"]("", ["Paris"]) == 0.0


def test_ruler_postprocess_turns_control_characters_into_newlines():
    assert ruler_postprocess("  key\tvalue\x00 \n") == "key\nvalue"
    # so a reference with a tab is no longer found in a prediction that has it
    assert METRICS["string_match_all"]("key\tvalue", ["key\tvalue"]) == 0.0


# ---------------------------------------------------------------------------------------------------------------
# InfiniteBench

def test_infinitebench_passkey_and_kv_retrieval():
    assert METRICS["infinitebench_passkey"]("The pass key is 71432.", ["71432"]) == 1.0
    assert METRICS["infinitebench_passkey"]("7 then 71432", ["71432"]) == 0.0  # the first number only
    assert METRICS["infinitebench_passkey"]("714321", ["71432"]) == 0.0
    assert METRICS["infinitebench_kv_retrieval"]('The value is "00a0-42".', ["00a0-42"]) == 1.0
    assert METRICS["infinitebench_kv_retrieval"]("value:00a0-42x", ["00a0-42"]) == 0.0  # a whole word is needed
    assert METRICS["scbench_kv"]("value:00a0-42x", ["00a0-42"]) == 1.0  # SCBench's version: a substring


def test_infinitebench_code_run_and_code_debug():
    assert METRICS["infinitebench_code_run"]("The return value is: 42.", ["42"]) == 1.0
    assert METRICS["infinitebench_code_run"]("-5", ["-5"]) == 1.0
    assert METRICS["infinitebench_code_run"]("42 is the answer", ["42"]) == 0.0  # the last word is read
    label = ["func_b", "B"]
    assert METRICS["infinitebench_code_debug"]("B: func_b crashes", label) == 1.0
    assert METRICS["infinitebench_code_debug"]("The answer is: func_b", label) == 1.0
    # "option" is blanked, so "The correct option is: B" becomes "The correct is: B"; after "is:" comes B
    assert METRICS["infinitebench_code_debug"]("The correct option is: B", label) == 1.0
    assert METRICS["infinitebench_code_debug"]("I think B", label) == 0.0  # no answer prefix
    assert METRICS["infinitebench_code_debug"]("The answer is: C", label) == 0.0


def test_infinitebench_math_find_and_math_calc():
    assert METRICS["infinitebench_math_find"]("The largest number is 91.", ["91"]) == 1.0
    assert METRICS["infinitebench_math_find"]("91.5", ["91"]) == 0.0
    assert METRICS["infinitebench_math_find"]("3.5", ["3.5"]) == 1.0
    assert METRICS["scbench_mf"]("12.7", ["12"]) == 1.0  # SCBench reads int(float("12.7")) = 12
    # the prefix of matching values: 1, 4 then 9 != 8: 2/3
    assert METRICS["infinitebench_math_calc"]("[1, 4, 9]", ["1", "4", "8"]) == pytest.approx(2 / 3)
    # digit runs carry no sign: -1 is read as 1, so the third value never matches: 2/3
    assert METRICS["infinitebench_math_calc"]("[8, 5, -1]", ["[8, 5, -1]"]) == pytest.approx(2 / 3)
    assert METRICS["infinitebench_math_calc"]("", ["1", "4"]) == 0.0
    with pytest.raises(ValueError, match="expected values"):
        METRICS["infinitebench_math_calc"]("1", ["none"])


def test_infinitebench_longdialogue_qa_eng():
    assert METRICS["infinitebench_longdialogue_qa_eng"]("It is likely Ace.", ["ACE", "ACE ROTHSTEIN"]) == 1.0
    # only the first label counts, as one word: a two-word name never matches
    assert METRICS["infinitebench_longdialogue_qa_eng"]("ACE", ["BOB", "ACE"]) == 0.0
    assert METRICS["infinitebench_longdialogue_qa_eng"]("ACE ROTHSTEIN", ["ACE ROTHSTEIN"]) == 0.0
    assert METRICS["scbench_qa_eng"]("it was ace rothstein", ["BOB", "ACE ROTHSTEIN"]) == 1.0  # SCBench: substring


def test_infinitebench_longbook_choice_eng():
    label = ["Taking care of Totty", "B"]
    choice = METRICS["infinitebench_longbook_choice_eng"]
    assert choice("B. Taking care of Totty", label) == 1.0  # the first letter decides
    assert choice("A", label) == 0.0
    assert choice("Taking care of Totty", label) == 1.0  # the option's text
    assert choice("The answer is B", label) == 1.0  # after "answer is"
    assert choice("I choose B", label) == 1.0  # the first word that is in "ABCD"
    assert choice("I pick AB", label) == 0.0  # "AB" is in "ABCD" (a substring test), and is not a label
    assert choice("", label) == 0.0


def test_infinitebench_longbook_qa_chn_and_sum():
    # characters 北 京 市 vs 北 京: 2 shared of 3 and 2: 2*(2/3)*1/(2/3+1) = 4/5
    assert METRICS["infinitebench_longbook_qa_chn"]("北京市。", ["北京"]) == pytest.approx(0.8)
    # rougeLsum: "the cat sat" vs "the cat ran": LCS 2 of 3 tokens each: F = 2/3
    assert METRICS["infinitebench_longbook_sum_eng"]("the cat sat", ["the cat ran"]) == pytest.approx(2 / 3)
    assert METRICS["infinitebench_longbook_sum_eng"]("", ["the cat"]) == 0.0


def test_rouge_lsum_by_hand():
    assert rouge_lsum("The Cat!", "the cat") == 1.0  # lower case, punctuation separates
    # lines are sentences: ref "c a" meets line "a b" on a and line "c d" on c: 2 hits, p = 2/4, r = 2/2: F = 2/3
    assert rouge_lsum("a b\nc d", "c a") == pytest.approx(2 / 3)
    # hits are clipped by counts (unlike the `rouge` package): "a a a" vs "a": 1 hit, p = 1/3, r = 1: F = 1/2
    assert rouge_lsum("a a a", "a") == pytest.approx(0.5)
    # both reference lines hit the one predicted "a", which counts once: 1 hit, p = 1/1, r = 1/2: F = 2/3
    assert rouge_lsum("a", "a\na") == pytest.approx(2 / 3)
    # the read-back steps along the reference on ties: LCS(a a, line "a") is the second a, LCS(a a, line "a b")
    # the first, so the union is both: 2 hits, p = 2/3, r = 2/2: F = 4/5 (stepping along the prediction, both
    # would be the second a: 1 hit, F = 2/5)
    assert rouge_lsum("a\na b", "a a") == pytest.approx(0.8)
    # from InfiniteBench's get_score_one_longbook_sum_eng (evaluate's rouge, rouge-score 0.1.2)
    prediction = "The committee approved the budget.\nIt will fund new schools and repair roads."
    reference = "The budget was approved by the committee.\nNew schools will be funded, and roads repaired."
    assert rouge_lsum(prediction, reference) == pytest.approx(0.5)


# ---------------------------------------------------------------------------------------------------------------
# SCBench

def test_scbench_vt_rounds_each_example_to_two_decimals():
    assert METRICS["scbench_vt"]("X1 only", ["X1", "X2", "X3"]) == 0.33  # 1/3 rounded
    assert METRICS["string_match_all"]("X1 only", ["X1", "X2", "X3"]) == pytest.approx(1 / 3)  # RULER's: not


# ---------------------------------------------------------------------------------------------------------------
# LooGLE

def test_loogle_rouge_is_recall():
    # LCS(a c e, a b c d) hits 2 of 3 distinct reference words: recall 2/3
    assert METRICS["loogle_rouge_l"]("a b c d", ["a c e"]) == pytest.approx(2 / 3)
    assert METRICS["loogle_rouge_1"]("a b c d", ["a c e"]) == pytest.approx(2 / 3)  # unigrams a, c of 3
    # bigrams of "a b c d": ab bc cd; of "a b e": ab be: 1 of 2
    assert METRICS["loogle_rouge_2"]("a b c d", ["a b e"]) == pytest.approx(0.5)
    # an empty prediction is scored as the text "None": 1 of 3 reference words
    assert METRICS["loogle_rouge_l"]("", ["None of them"]) == pytest.approx(1 / 3)


def test_sentence_bleu_by_hand():
    # BLEU-1: 2 of 4 unigrams match, hypothesis longer than reference (no penalty): 1/2
    assert sentence_bleu("a b c d".split(), "a c e".split(), 1) == pytest.approx(0.5)
    # all unigrams match, hypothesis 2 words, reference 3: penalty exp(1 - 3/2)
    assert sentence_bleu("a c".split(), "a c e".split(), 1) == pytest.approx(math.exp(-0.5))
    # BLEU-4 is the 4-gram precision: "the cat is on / cat is on the / is on the mat" match, "on the mat today"
    # does not: 3/4, hypothesis longer (no penalty)
    assert sentence_bleu("the cat is on the mat today".split(), "the cat is on the mat".split(), 4) == 0.75
    assert sentence_bleu("a b c".split(), "a b c".split(), 4) == 0.0  # no 4-gram at all
    # from NLTK 3.10.4's sentence_bleu([ref], hyp, weights=(1, 0, 0, 0)): 5 of 6 match, penalty exp(1 - 7/6)
    assert sentence_bleu("the cat is on the mat".split(), "there is a cat on the mat".split(), 1) == \
        pytest.approx(0.7054014374088451)


def test_loogle_cloze_matches():
    reference = '{"<mask-0>": "Bob Smith", "<mask-1>": "Gorrosion Magazine"}'
    prediction = "{'<mask-0>': 'Bob Smith', '<mask-1>': 'Magazine'}"
    # mask 0 exact; mask 1 shares the word "Magazine": exact 1 of 2, partial 2 of 2
    assert cloze_counts(prediction, reference) == (1, 2, 2)
    assert METRICS["loogle_exact_match"](prediction, [reference]) == 0.5
    assert METRICS["loogle_partial_match"](prediction, [reference]) == 1.0
    assert cloze_counts("Bob Smith", reference) == (0, 0, 2)  # not a dict
    assert cloze_counts("{'<mask-0>': 3}", reference) == (0, 0, 2)  # not a text entity
    assert cloze_counts("__import__('os').getcwd()", reference) == (0, 0, 2)  # parsed, never run
    with pytest.raises(ValueError, match="mask"):
        cloze_counts("{}", "Bob")


# ---------------------------------------------------------------------------------------------------------------
# kvpress's needle in a haystack

def test_needle_rouge_by_hand():
    # needle = hypothesis "a b c d" (4 distinct words), prediction = reference "c a" (2): the LCS hits 1 word:
    # p = 1/4, r = 1/2: F = 2*(1/8)/(3/4) = 1/3
    assert METRICS["needle_rouge"]("c a", ["a b c d"]) == pytest.approx(1 / 3, abs=1e-8)
    assert METRICS["needle_rouge"]("  a b c\n", ["a b c"]) == ROUGE_ONE  # both stripped
    assert METRICS["needle_rouge"]("", ["a b c"]) == 0.0
