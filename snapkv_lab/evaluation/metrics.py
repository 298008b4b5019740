"""Each benchmark's official per-example metric, reimplemented: METRICS[name](prediction, references, **meta) -> [0, 1].

A metric scores one prediction against the references of one question, aggregating over the references the way
the benchmark's own scorer does (LongBench, InfiniteBench's F1: the best reference; RULER's string_match_all: the
fraction of references found; ...). `meta` carries what a metric needs besides (LongBench's `all_classes`); every
metric ignores the keys it does not use, so an Example's whole meta can be passed. `score` looks a metric up by name
and applies LongBench's first-line cut where meta asks for it.

Sources, read at these commits (names below are the files' own):
    LongBench, LongBench-E   THUDM/LongBench 2e00731, LongBench/metrics.py and LongBench/eval.py (MIT)
    LongBench v2             THUDM/LongBench 2e00731, pred.py `extract_answer`, result.py (MIT)
    RULER                    NVIDIA/RULER c3f5e3b, scripts/eval/synthetic/constants.py, scripts/eval/evaluate.py
    InfiniteBench            OpenBMB/InfiniteBench 88b3daa, src/compute_scores.py, src/eval_utils.py `get_answer`
    SCBench                  microsoft/MInference fb56c91, scbench/compute_scores.py, scbench/eval_utils.py
    LooGLE                   bigai-nlco/LooGLE 6734382, Evaluation/automatic_metrics.py and automatic_eval.py; as
                             NVIDIA/kvpress 8bb29b9 evaluation/benchmarks/loogle/calculate_metrics.py runs them
    needle in a haystack     NVIDIA/kvpress 8bb29b9, evaluation/benchmarks/needle_in_haystack/calculate_metrics.py
The scorers' libraries are reimplemented here too, on the standard library, so that no new dependency is needed:
the `rouge` package 1.0.1 (pltrdy/rouge, rouge/rouge.py and rouge/rouge_score.py: LongBench, LooGLE, kvpress's
needle), Google's `rouge-score` 0.1.2 behind Hugging Face `evaluate`'s "rouge" (rouge_score/rouge_scorer.py and
tokenize.py: InfiniteBench's and SCBench's summaries), fuzzywuzzy 0.18.0's `fuzz.ratio` (LongBench's code tasks) and
NLTK 3.10's `sentence_bleu` (LooGLE). The Chinese metrics tokenise with jieba, imported when first needed.

Not reproduced (NOT_REPRODUCED says why, per item): LooGLE's METEOR (needs NLTK's WordNet download), BERTScore (a
model download) and GPT-4 judging (an API); SCBench's repoqa (tree-sitter parsing of the generated function and
pass@k over similarity thresholds); InfiniteBench's GPT-4-only shift of math_calc's numbers.
"""

from __future__ import annotations

import ast
import difflib
import math
import re
import string
from collections import Counter
from collections.abc import Callable, Sequence
from itertools import chain

from .math_answers import kvpress_aime, kvpress_math500, math_equal_score

References = Sequence[str]
Metric = Callable[..., float]  # (prediction, references, **meta) -> [0, 1]


# ----------------------------------------------------------------------------------------------------------------
# Text normalisation and token F1 (LongBench/metrics.py; InfiniteBench and SCBench compute_scores.py: the same code)

_CHINESE_PUNCTUATION = ("！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～"
                        "｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟"
                        "〰〾〿–—‘’‛“”„‟…‧﹏.")
_ENGLISH_PUNCTUATION = frozenset(string.punctuation)
_ALL_PUNCTUATION = frozenset(string.punctuation + _CHINESE_PUNCTUATION)


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation, as LongBench/metrics.py `normalize_answer` (and InfiniteBench's, identical): lower
    case, drop ASCII punctuation, drop the articles a/an/the, collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _ENGLISH_PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def normalize_zh_answer(text: str) -> str:
    """LongBench/metrics.py `normalize_zh_answer`: lower case, drop ASCII and Chinese punctuation, drop all
    whitespace (Chinese has no spaces between words)."""
    text = "".join(ch for ch in text.lower() if ch not in _ALL_PUNCTUATION)
    return "".join(text.split())


def _token_f1(prediction_tokens: Sequence[str], reference_tokens: Sequence[str]) -> float:
    """LongBench/metrics.py `f1_score`: F1 of the multiset overlap; 0 when nothing is shared (so also when empty)."""
    shared = sum((Counter(prediction_tokens) & Counter(reference_tokens)).values())
    if shared == 0:
        return 0.0
    precision = shared / len(prediction_tokens)
    recall = shared / len(reference_tokens)
    return 2 * precision * recall / (precision + recall)


def _best(per_reference: Callable[[str, str], float], prediction: str, references: References) -> float:
    """LongBench/eval.py `scorer`'s aggregation, shared by InfiniteBench's F1: the best reference, at least 0."""
    return max([0.0, *(per_reference(prediction, reference) for reference in references)])


def _jieba():
    try:
        import jieba
    except ImportError as error:
        raise ImportError("LongBench's Chinese metrics (qa_f1_zh_score, rouge_zh_score) tokenise with jieba, as "
                          "the official scorer does: pip install jieba") from error
    return jieba


def _jieba_words(text: str) -> list[str]:
    return list(_jieba().cut(text, cut_all=False))


# ----------------------------------------------------------------------------------------------------------------
# Longest common subsequence, read back the way each ROUGE library reads it

def _lcs_ref_positions(ref: Sequence[str], hyp: Sequence[str], *, ties_move_ref: bool) -> list[int]:
    """Positions in `ref` of one longest common subsequence of ref and hyp.

    Which one matters: the libraries count the LCS's distinct words (the `rouge` package) or clip its words by
    their counts (rouge-score), so each library's tie-breaking in the read-back is kept. The `rouge` package
    (rouge_score.py `_recon_lcs`) steps along hyp on a tie, rouge-score (rouge_scorer.py `_backtrack_norec`) along
    ref. The `rouge` package reads back recursively, so a long pair of sentences (over about 1000 read-back steps:
    two 1000-word texts without a '.') raises RecursionError there, which LongBench's bare except scores 0; this
    scores the pair.
    """
    cols = len(hyp)
    table = [[0] * (cols + 1)]
    for word in ref:
        above, row = table[-1], [0]
        for j in range(cols):
            row.append(above[j] + 1 if word == hyp[j] else max(above[j + 1], row[j]))
        table.append(row)
    positions = []
    i, j = len(ref), cols
    while i and j:
        if ref[i - 1] == hyp[j - 1]:
            positions.append(i - 1)
            i, j = i - 1, j - 1
        elif table[i - 1][j] > table[i][j - 1] or (ties_move_ref and table[i - 1][j] == table[i][j - 1]):
            i -= 1
        else:
            j -= 1
    return positions[::-1]


# The `rouge` package 1.0.1 (pltrdy/rouge): rouge/rouge.py `Rouge.get_scores` and rouge/rouge_score.py

def _rouge_sentences(text: str) -> list[str]:
    """rouge.py `Rouge._get_scores`: sentences are the non-empty pieces between '.', whitespace collapsed (a piece
    of blanks stays as an empty sentence, whose one word is '')."""
    return [" ".join(piece.split()) for piece in text.split(".") if piece]


def _rouge_words(sentences: list[str]) -> list[str]:
    # rouge_score.py `_split_into_words` splits on single spaces
    return list(chain.from_iterable(sentence.split(" ") for sentence in sentences))


def _rouge_f(precision: float, recall: float) -> float:
    # the package adds 1e-8 to the denominator, so a perfect match scores 2 / (2 + 1e-8), not 1
    return 2.0 * precision * recall / (precision + recall + 1e-8)


def rouge_l(hypothesis: str, reference: str) -> tuple[float, float, float] | None:
    """(precision, recall, F) of the `rouge` package's "rouge-l" (`Rouge().get_scores(hyp, ref)[0]["rouge-l"]`).

    Its definition (rouge_score.py `rouge_l_summary_level`, exclusive mode, the default): both texts are split
    into sentences on '.' and into words on spaces; the hits are the distinct words of the union, over every pair
    of a reference and a hypothesis sentence, of one LCS of the pair; precision = hits / distinct hypothesis words,
    recall = hits / distinct reference words. Case and punctuation other than '.' count. None where the package
    raises (a text without a sentence: empty, or only dots).
    """
    hyp_sentences, ref_sentences = _rouge_sentences(hypothesis), _rouge_sentences(reference)
    if not hyp_sentences or not ref_sentences:
        return None
    hits: set[str] = set()
    for ref_sentence in ref_sentences:
        ref_words = ref_sentence.split(" ")
        for hyp_sentence in hyp_sentences:
            positions = _lcs_ref_positions(ref_words, hyp_sentence.split(" "), ties_move_ref=False)
            hits.update(ref_words[i] for i in positions)
    precision = len(hits) / len(set(_rouge_words(hyp_sentences)))
    recall = len(hits) / len(set(_rouge_words(ref_sentences)))
    return precision, recall, _rouge_f(precision, recall)


def rouge_n(hypothesis: str, reference: str, n: int) -> tuple[float, float, float] | None:
    """(precision, recall, F) of the `rouge` package's "rouge-<n>" (rouge_score.py `rouge_n`, exclusive mode):
    overlap of the *sets* of word n-grams, the words of all sentences run together. None where the package raises."""
    hyp_sentences, ref_sentences = _rouge_sentences(hypothesis), _rouge_sentences(reference)
    if not hyp_sentences or not ref_sentences:
        return None
    hyp_grams, ref_grams = (_ngram_set(_rouge_words(sentences), n) for sentences in (hyp_sentences, ref_sentences))
    overlap = len(hyp_grams & ref_grams)
    precision = overlap / len(hyp_grams) if hyp_grams else 0.0
    recall = overlap / len(ref_grams) if ref_grams else 0.0
    return precision, recall, _rouge_f(precision, recall)


def _ngram_set(words: list[str], n: int) -> set[tuple[str, ...]]:
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


# Google's rouge-score 0.1.2, as Hugging Face `evaluate.load("rouge")` calls it (no stemmer, default tokenizer)

def _rouge_score_tokens(text: str) -> list[str]:
    # rouge_score/tokenize.py `tokenize`: lower case, every run of characters other than [a-z0-9] separates tokens
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).split()


def rouge_lsum(prediction: str, reference: str) -> float:
    """F-measure of rouge-score's "rougeLsum" (rouge_scorer.py `_summary_level_lcs`): sentences are the non-empty
    lines, tokens as `_rouge_score_tokens`; the hits are the union LCS of each reference sentence with every
    predicted sentence, each token counted at most as often as it occurs in both texts; precision = hits /
    predicted tokens, recall = hits / reference tokens. 0 when either side has no token."""
    ref_sentences = [_rouge_score_tokens(line) for line in reference.split("\n") if line]
    hyp_sentences = [_rouge_score_tokens(line) for line in prediction.split("\n") if line]
    ref_total, hyp_total = sum(map(len, ref_sentences)), sum(map(len, hyp_sentences))
    if not ref_total or not hyp_total:
        return 0.0
    ref_left, hyp_left = Counter(chain.from_iterable(ref_sentences)), Counter(chain.from_iterable(hyp_sentences))
    hits = 0
    for ref_sentence in ref_sentences:
        union = set().union(*(_lcs_ref_positions(ref_sentence, hyp_sentence, ties_move_ref=True)
                              for hyp_sentence in hyp_sentences))
        for token in (ref_sentence[i] for i in sorted(union)):
            if ref_left[token] > 0 and hyp_left[token] > 0:
                hits += 1
                ref_left[token] -= 1
                hyp_left[token] -= 1
    precision, recall = hits / hyp_total, hits / ref_total
    return 2 * precision * recall / (precision + recall) if precision + recall > 0 else 0.0


def fuzz_ratio(a: str, b: str) -> int:
    """fuzzywuzzy 0.18.0 `fuzz.ratio` on its pure-Python path (what LongBench's requirements.txt installs: fuzzywuzzy
    without python-Levenshtein): 100 for equal strings, 0 if either is empty, else round(100 * difflib's
    SequenceMatcher(None, a, b).ratio()) (Python's round: halves to even). With python-Levenshtein installed,
    fuzzywuzzy uses Levenshtein's ratio instead, which can differ by a few points on long or repetitive strings."""
    if a == b:
        return 100
    if not a or not b:
        return 0
    return int(round(100 * difflib.SequenceMatcher(None, a, b).ratio()))


# ----------------------------------------------------------------------------------------------------------------
# LongBench and LongBench-E (LongBench/metrics.py; the aggregation of LongBench/eval.py `scorer`: best reference)

def first_line(prediction: str) -> str:
    """LongBench/eval.py `scorer`: for trec, triviaqa, samsum and lsht (the few-shot tasks, where a model goes on
    with the next shot) only the first line of the prediction is scored, `prediction.lstrip('\\n').split('\\n')[0]`.
    `score` applies it where meta has first_line=True."""
    return prediction.lstrip("\n").split("\n")[0]


def qa_f1_score(prediction: str, references: References, **meta) -> float:
    """Token F1 after `normalize_answer`, best reference: LongBench/metrics.py `qa_f1_score` (narrativeqa, qasper,
    multifieldqa_en, hotpotqa, 2wikimqa, musique, triviaqa); also InfiniteBench's longbook_qa_eng
    (src/compute_scores.py `qa_f1_score`, the same normalisation and the same max)."""
    return _best(lambda pred, ref: _token_f1(normalize_answer(pred).split(), normalize_answer(ref).split()),
                 prediction, references)


def qa_f1_zh_score(prediction: str, references: References, **meta) -> float:
    """Word F1 for Chinese, best reference: LongBench/metrics.py `qa_f1_zh_score` (multifieldqa_zh): jieba's words
    (precise mode), each normalised by `normalize_zh_answer`, the empty ones dropped."""
    def words(text: str) -> list[str]:
        return [word for word in map(normalize_zh_answer, _jieba_words(text)) if word]

    return _best(lambda pred, ref: _token_f1(words(pred), words(ref)), prediction, references)


def _longbench_rouge(prediction: str, reference: str) -> float:
    # metrics.py `rouge_score`: Rouge().get_scores([pred], [ref], avg=True)["rouge-l"]["f"], 0 where it raises
    scores = rouge_l(prediction, reference)
    return 0.0 if scores is None else scores[2]


def rouge_score(prediction: str, references: References, **meta) -> float:
    """ROUGE-L F of the `rouge` package (see `rouge_l`), best reference, 0 for an empty prediction: LongBench/
    metrics.py `rouge_score` (gov_report, qmsum, multi_news, samsum)."""
    return _best(_longbench_rouge, prediction, references)


def rouge_zh_score(prediction: str, references: References, **meta) -> float:
    """`rouge_score` on jieba's words joined by spaces, best reference: LongBench/metrics.py `rouge_zh_score`
    (dureader, vcsum)."""
    def spaced(text: str) -> str:
        return " ".join(_jieba_words(text))

    return _best(lambda pred, ref: _longbench_rouge(spaced(pred), spaced(ref)), prediction, references)


def classification_score(prediction: str, references: References, **meta) -> float:
    """LongBench/metrics.py `classification_score` (trec, lsht); needs meta["all_classes"], best reference.

    The classes whose name occurs in the prediction are matched; those that occur inside the reference without
    being it are then dropped; the score is 1 / (classes left) if the reference is among them, else 0. The
    official drop loop removes items from the list it iterates over, so the class right after a dropped one is
    never examined (and stays): reproduced, since it changes scores wherever class names nest.
    """
    classes = meta.get("all_classes")
    if not classes:
        raise ValueError("classification_score needs meta['all_classes'], the task's class names (LongBench's "
                         "all_classes field)")

    def one(pred: str, ref: str) -> float:
        matched = [name for name in classes if name in pred]
        i = 0
        while i < len(matched):
            if matched[i] in ref and matched[i] != ref:
                del matched[i]  # and skip the next one, as the official for-loop over a shrinking list does
            i += 1
        return 1.0 / len(matched) if ref in matched else 0.0

    return _best(one, prediction, references)


def _number_share(prediction: str, target: str) -> float:
    # metrics.py `count_score` and `retrieval_score`: share of the prediction's numbers that are the target
    numbers = re.findall(r"\d+", prediction)
    return sum(number == target for number in numbers) / len(numbers) if numbers else 0.0


def count_score(prediction: str, references: References, **meta) -> float:
    """LongBench/metrics.py `count_score` (passage_count): the share of the numbers in the prediction that equal
    the reference count, best reference."""
    return _best(_number_share, prediction, references)


def _paragraph_id(pattern: str, reference: str) -> str:
    found = re.findall(pattern, reference)
    if not found:
        raise ValueError(f"a passage-retrieval reference names its paragraph as {pattern!r}, got {reference!r}")
    return found[0]


def retrieval_score(prediction: str, references: References, **meta) -> float:
    """LongBench/metrics.py `retrieval_score` (passage_retrieval_en): the reference is "Paragraph <id>"; the share
    of the numbers in the prediction that are that id, best reference."""
    return _best(lambda pred, ref: _number_share(pred, _paragraph_id(r"Paragraph (\d+)", ref)),
                 prediction, references)


def retrieval_zh_score(prediction: str, references: References, **meta) -> float:
    """LongBench/metrics.py `retrieval_zh_score` (passage_retrieval_zh): as `retrieval_score` with "段落<id>"."""
    return _best(lambda pred, ref: _number_share(pred, _paragraph_id(r"段落(\d+)", ref)), prediction, references)


def code_sim_score(prediction: str, references: References, **meta) -> float:
    """LongBench/metrics.py `code_sim_score` (lcc, repobench-p): the prediction's first line (leading newlines
    stripped) that contains none of '`', '#', '//' anywhere (not only at its start: the official test is
    `not in line`), or "" if none; its `fuzz_ratio` with the reference / 100, best reference."""
    lines = prediction.lstrip("\n").split("\n")
    code = next((line for line in lines if "`" not in line and "#" not in line and "//" not in line), "")
    return _best(lambda pred, ref: fuzz_ratio(pred, ref) / 100, code, references)


# ----------------------------------------------------------------------------------------------------------------
# LongBench v2 (pred.py `extract_answer`; result.py scores `pred == answer`)

def extract_choice(response: str) -> str | None:
    """LongBench v2's pred.py `extract_answer`: drop every '*' (markdown bold), then the letter of the first
    "The correct answer is (X)", else of the first "The correct answer is X", X in A-D; None if neither."""
    response = response.replace("*", "")
    found = (re.search(r"The correct answer is \(([A-D])\)", response)
             or re.search(r"The correct answer is ([A-D])", response))
    return found.group(1) if found else None


def choice_accuracy(prediction: str, references: References, **meta) -> float:
    """LongBench v2: 1 if `extract_choice` of the prediction is the reference letter (references[0]), else 0 (an
    answer that cannot be read scores 0: result.py's default, compensated=False)."""
    return float(extract_choice(prediction) == references[0])


# ----------------------------------------------------------------------------------------------------------------
# RULER (scripts/eval/synthetic/constants.py; predictions cleaned by scripts/eval/evaluate.py `postprocess_pred`)

def ruler_postprocess(prediction: str) -> str:
    """RULER's scripts/eval/evaluate.py `postprocess_pred`: strip, turn each control character (\\x00-\\x1f) into
    a newline, strip again. It cuts no trailing text: the metrics look for the references anywhere."""
    return re.sub(r"[\x00-\x1f]", "\n", prediction.strip()).strip()


def string_match_all(prediction: str, references: References, **meta) -> float:
    """RULER's `string_match_all` for one example (niah_*, vt, cwe, fwe): the fraction of the references found,
    case-insensitively, as substrings of the post-processed prediction."""
    found = ruler_postprocess(prediction).lower()
    return sum(reference.lower() in found for reference in references) / len(references)


def string_match_part(prediction: str, references: References, **meta) -> float:
    """RULER's `string_match_part` for one example (qa_1, qa_2): 1 if any reference is found, case-insensitively,
    as a substring of the post-processed prediction."""
    found = ruler_postprocess(prediction).lower()
    return float(any(reference.lower() in found for reference in references))


# ----------------------------------------------------------------------------------------------------------------
# InfiniteBench (src/compute_scores.py `get_score_one_<task>`). Its label is the row's answer list (eval_utils.py
# `get_answer`): references[0] is the label where the official scorer takes `label[0]` or a single value; for
# longbook_choice_eng and code_debug the references are (the correct option's text, its letter), get_answer's pair.

def _blank(text: str, needles: Sequence[str]) -> str:
    # the official scorers' `for c in [...]: pred = pred.replace(c, " ")`
    for needle in needles:
        text = text.replace(needle, " ")
    return text


def _collapse_spaces(text: str) -> str:
    while "  " in text:
        text = text.replace("  ", " ")
    return text


def _first_integer(text: str) -> str:
    # compute_scores.py `first_int_match`: the first run of ASCII digits, "" if none
    found = re.search(r"[0-9]+", text)
    return found.group(0) if found else ""


def infinitebench_passkey(prediction: str, references: References, **meta) -> float:
    """InfiniteBench's `get_score_one_passkey` (and `get_score_one_number_string`, the same code): 1 if the first
    run of digits in the prediction is exactly the label."""
    return float(_first_integer(prediction) == references[0])


def infinitebench_kv_retrieval(prediction: str, references: References, **meta) -> float:
    """InfiniteBench's `get_score_one_kv_retrieval` (kv_retrieval, kv_retrieval_prefix, kv_retrieval_both): 1 if the
    label is one of the prediction's words, words split at whitespace and at \\n : " ' . , ? ! { }."""
    return float(references[0] in _blank(prediction, "\n:\"'.,?!{}").split())


def infinitebench_code_run(prediction: str, references: References, **meta) -> float:
    """InfiniteBench's `get_score_one_code_run`: 1 if the prediction's last word (split at whitespace and at
    \\n . ` ' " :) is an integer equal to the label (the label is an int in the official data: parsed here)."""
    label = int(references[0])
    words = _blank(prediction.strip(), "\n.`'\":").split()
    try:
        return float(bool(words) and int(words[-1]) == label)
    except ValueError:  # the last word is not a number
        return 0.0


def infinitebench_code_debug(prediction: str, references: References, **meta) -> float:
    """InfiniteBench's `get_score_one_code_debug`; references = (the buggy function's name, its option letter).

    1 if the prediction starts with "<letter>." or "<letter>:"; otherwise, after turning \\n ` ' " - * "Option"
    "option" into spaces and collapsing runs of spaces, the text after the first of "answer is:", "is:",
    "answer:" that occurs (and one more character) must start with the letter or the name. (The official list ends
    with "correct option is:", which "is:" always finds first.)
    """
    name, letter = references[0], references[1]
    pred = prediction.strip()
    if pred[:2] in (f"{letter}.", f"{letter}:"):
        return 1.0
    pred = _collapse_spaces(_blank(pred, ("\n", "`", "'", '"', "-", "*", "Option", "option")))
    for prefix in ("answer is:", "is:", "answer:"):
        at = pred.find(prefix)
        if at == -1:
            continue
        rest = pred[at + len(prefix) + 1:]
        return float(bool(rest) and (rest.startswith(letter) or rest.startswith(name)))
    return 0.0


def _number(text: str) -> int | float:
    # the official labels are ints or floats; ours are their str()
    text = text.strip()
    return int(text) if re.fullmatch(r"-?\d+", text) else float(text)


def infinitebench_math_find(prediction: str, references: References, **meta) -> float:
    """InfiniteBench's `get_score_one_math_find`: the prediction's first number (r"\\d+\\.\\d+|\\d+", no sign)
    must equal the label, compared as an int for an int label and as a float for a float one. A decimal answer to
    an int label scores 0 (the official int() of it raises)."""
    label = _number(references[0])
    found = re.search(r"\d+\.\d+|\d+", prediction)
    if found is None:
        return 0.0
    if isinstance(label, int):
        return float("." not in found.group(0) and int(found.group(0)) == label)
    return float(float(found.group(0)) == label)


def infinitebench_math_calc(prediction: str, references: References, **meta) -> float:
    """InfiniteBench's `get_score_one_math_calc`: the references are the expected intermediate values in order
    (one per reference, or all in one text such as "[1, 4, 8]"); the score is the length of the prefix of them
    that the prediction's digit runs reproduce, over their number. Digit runs carry no sign, so a negative value
    is never matched, as in the official scorer. (Its shift of the numbers for GPT-4's prompt is not kept.)"""
    expected = [int(value) for value in re.findall(r"-?\d+", " ".join(references))]
    if not expected:
        raise ValueError(f"math_calc's references are the expected values, got {list(references)!r}")
    produced = [int(run) for run in re.findall(r"[0-9]+", prediction)]
    matched = 0
    for want, got in zip(expected, produced):
        if want != got:
            break
        matched += 1
    return matched / len(expected)


def infinitebench_longdialogue_qa_eng(prediction: str, references: References, **meta) -> float:
    """InfiniteBench's `get_score_one_longdialogue_qa_eng`: 1 if the first label is one of the prediction's
    upper-cased words (split at whitespace and at \\n : " ' . , ? ! { }); the label is compared as given (the
    data's names are upper case), and only the first label counts."""
    return float(references[0] in [word.upper() for word in _blank(prediction.strip(), "\n:\"'.,?!{}").split()])


def infinitebench_longbook_choice_eng(prediction: str, references: References, **meta) -> float:
    """InfiniteBench's `get_score_one_longbook_choice_eng`; references = (the correct option's text, its letter),
    either counting.

    In order: an empty prediction scores 0; one starting with A-D is judged by that letter; a prediction equal to
    a reference scores 1; then, with \\n " ' . , ? ! { } turned into spaces and runs of spaces collapsed, the text
    after the first of "answer is:", "answer:", "answer is", "option is" that occurs (and one more character)
    must start with a reference; without any, the first word that is a substring of "ABCD" (the official `in`
    test: "AB" passes) is judged as the letter.
    """
    label = list(references)
    pred = prediction.strip()
    if not pred:
        return 0.0
    if pred[0] in "ABCD":
        return float(pred[0] in label)
    if pred in label:
        return 1.0
    pred = _collapse_spaces(_blank(pred, "\n\"'.,?!{}"))
    for prefix in ("answer is:", "answer:", "answer is", "option is"):
        at = pred.find(prefix)
        if at == -1:
            continue
        rest = pred[at + len(prefix) + 1:]
        return float(bool(rest) and any(rest.startswith(option) for option in label))
    for word in pred.split():
        if word in "ABCD":
            return float(word in label)
    return 0.0


def infinitebench_longbook_qa_chn(prediction: str, references: References, **meta) -> float:
    """InfiniteBench's `get_score_one_longbook_qa_chn` (`qa_f1_score_zh`): character F1 after
    `normalize_zh_answer`, best reference. Unlike LongBench's qa_f1_zh_score, no jieba: one character, one token."""
    return _best(lambda pred, ref: _token_f1(list(normalize_zh_answer(pred)), list(normalize_zh_answer(ref))),
                 prediction, references)


def infinitebench_longbook_sum_eng(prediction: str, references: References, **meta) -> float:
    """InfiniteBench's `get_score_one_longbook_sum_eng`: Hugging Face evaluate's "rouge" rougeLsum F-measure
    (`rouge_lsum`), best reference (evaluate's `score_multi` keeps the reference of highest F)."""
    return _best(rouge_lsum, prediction, references)


# ----------------------------------------------------------------------------------------------------------------
# SCBench (scbench/compute_scores.py). Its tasks reuse InfiniteBench's getters, some of them rewritten; the labels
# are eval_utils.py `get_ground_truth`'s: (text, letter) for scbench_choice_eng, a list for scbench_qa_eng, else the
# turn's answer.

def scbench_kv(prediction: str, references: References, **meta) -> float:
    """SCBench's `get_score_one_kv_retrieval` (scbench_kv, scbench_prefix_suffix, and the kv turns of
    scbench_repoqa_and_kv): 1 if the label occurs in the prediction, case-sensitively, anywhere."""
    return float(references[0] in prediction)


def scbench_vt(prediction: str, references: References, **meta) -> float:
    """SCBench's `string_match_all` (scbench_vt): RULER's, without RULER's post-processing and rounded to two
    decimals per example (1 of 3 found scores 0.33)."""
    return round(sum(reference.lower() in prediction.lower() for reference in references) / len(references), 2)


def scbench_qa_eng(prediction: str, references: References, **meta) -> float:
    """SCBench's `get_score_one_longdialogue_qa_eng` (scbench_qa_eng, scbench_many_shot): 1 if any label,
    upper-cased, occurs in the upper-cased prediction."""
    found = prediction.strip().upper()
    return float(any(reference.upper() in found for reference in references))


def scbench_mf(prediction: str, references: References, **meta) -> float:
    """SCBench's `get_score_one_math_find` (scbench_mf): InfiniteBench's, except that for an int label the first
    number is read as int(float(...)), so "12.7" answers 12."""
    label = _number(references[0])
    found = re.search(r"\d+\.\d+|\d+", prediction)
    if found is None:
        return 0.0
    value = float(found.group(0))
    return float((int(value) if isinstance(label, int) else value) == label)


# ----------------------------------------------------------------------------------------------------------------
# LooGLE (Evaluation/automatic_metrics.py, as kvpress's loogle/calculate_metrics.py runs it). QA and summaries: its
# "automatic_sim" metrics that need no download; clozes: "automatic_match". One reference per question.

def _loogle_text(prediction: str) -> str:
    # automatic_eval.py `evaluation` scores an empty prediction as the text "None"
    return prediction or "None"


def _recall(scores: tuple[float, float, float] | None) -> float:
    # get_rouge_score(metric="r"); kvpress's try_except_metric scores 0 where the package raises
    return 0.0 if scores is None else scores[1]


def loogle_rouge_l(prediction: str, references: References, **meta) -> float:
    """LooGLE's `get_rouge_score` "rouge-l" of the `rouge` package (`rouge_l`): its recall, not F, as
    automatic_metrics.py asks (metric="r")."""
    return _best(lambda pred, ref: _recall(rouge_l(_loogle_text(pred), ref)), prediction, references)


def loogle_rouge_1(prediction: str, references: References, **meta) -> float:
    """LooGLE's `get_rouge_score` "rouge-1" recall of the `rouge` package (`rouge_n`, n=1)."""
    return _best(lambda pred, ref: _recall(rouge_n(_loogle_text(pred), ref, 1)), prediction, references)


def loogle_rouge_2(prediction: str, references: References, **meta) -> float:
    """LooGLE's `get_rouge_score` "rouge-2" recall of the `rouge` package (`rouge_n`, n=2)."""
    return _best(lambda pred, ref: _recall(rouge_n(_loogle_text(pred), ref, 2)), prediction, references)


def sentence_bleu(hypothesis: Sequence[str], reference: Sequence[str], n: int) -> float:
    """NLTK's `sentence_bleu([reference], hypothesis, weights=<1 at order n, 0 elsewhere>)`, no smoothing: the
    brevity penalty times the clipped n-gram precision; 0 when no unigram matches (NLTK returns 0) and when no
    n-gram matches (NLTK returns exp(log(sys.float_info.min)) = 2.2e-308)."""
    def clipped(order: int) -> tuple[int, int]:
        hyp_counts = Counter(tuple(hypothesis[i:i + order]) for i in range(len(hypothesis) - order + 1))
        ref_counts = Counter(tuple(reference[i:i + order]) for i in range(len(reference) - order + 1))
        return sum((hyp_counts & ref_counts).values()), max(1, sum(hyp_counts.values()))

    matches, total = clipped(n)
    if clipped(1)[0] == 0 or matches == 0:
        return 0.0
    if len(hypothesis) > len(reference):
        penalty = 1.0
    else:
        penalty = math.exp(1 - len(reference) / len(hypothesis))
    return penalty * matches / total


def loogle_bleu_1(prediction: str, references: References, **meta) -> float:
    """LooGLE's `get_bleu_score` BLEU-1: `sentence_bleu` with weights (1, 0, 0, 0) on whitespace-split words."""
    return _best(lambda pred, ref: sentence_bleu(_loogle_text(pred).split(), ref.split(), 1), prediction, references)


def loogle_bleu_4(prediction: str, references: References, **meta) -> float:
    """LooGLE's `get_bleu_score` BLEU-4: weights (0, 0, 0, 1), i.e. the 4-gram precision alone (times the brevity
    penalty), not the geometric mean of orders 1 to 4."""
    return _best(lambda pred, ref: sentence_bleu(_loogle_text(pred).split(), ref.split(), 4), prediction, references)


def _literal_dict(text: str) -> dict | None:
    # The official scripts eval() the text; a literal parse reads the same dict without running model output.
    try:
        value = ast.literal_eval(text.strip())
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def cloze_counts(prediction: str, reference: str) -> tuple[int, int, int]:
    """LooGLE's `get_exact_match` and `get_partial_match` for one cloze: (masks filled exactly, masks whose entity
    shares a word with the right one, masks). The reference is the {mask: entity} dict as a Python or JSON
    literal; a prediction that is not a dict literal fills nothing. LooGLE's task score is the sum of the fills
    over the sum of the masks (automatic_eval.py `get_match_score`); `loogle_exact_match` is one example's share.
    """
    truth = _literal_dict(reference)
    if truth is None:
        raise ValueError(f"a LooGLE cloze reference is a {{mask: entity}} literal, got {reference!r}")
    filled = _literal_dict(prediction) or {}
    exact = sum(mask in filled and filled[mask] == entity for mask, entity in truth.items())
    partial = sum(mask in filled and _shares_a_word(filled[mask], entity) for mask, entity in truth.items())
    return exact, partial, len(truth)


def _shares_a_word(given, entity: str) -> bool:
    # a non-text entity in the prediction makes the official .split() raise; it matches nothing here
    return isinstance(given, str) and bool(set(given.split()) & set(entity.split()))


def loogle_exact_match(prediction: str, references: References, **meta) -> float:
    """LooGLE's `get_exact_match` for one cloze (shortdep_cloze): the share of masks whose entity the prediction
    gives exactly (`cloze_counts`)."""
    exact, _, masks = cloze_counts(prediction, references[0])
    return exact / masks if masks else 0.0


def loogle_partial_match(prediction: str, references: References, **meta) -> float:
    """LooGLE's `get_partial_match` for one cloze: the share of masks whose predicted entity shares a word with the
    right one (`cloze_counts`)."""
    _, partial, masks = cloze_counts(prediction, references[0])
    return partial / masks if masks else 0.0


# ----------------------------------------------------------------------------------------------------------------
# kvpress's needle in a haystack (evaluation/benchmarks/needle_in_haystack/calculate_metrics.py)

def needle_rouge(prediction: str, references: References, **meta) -> float:
    """kvpress's needle-in-a-haystack score: the `rouge` package's rouge-l F of `scorer.get_scores(needle.strip(),
    prediction.strip())`, i.e. with the needle as the hypothesis and the prediction as the reference (kvpress's
    order, kept: the read-back of the LCS depends on it). kvpress reports rouge-1/2/l x p/r/f; rouge-l F is the
    one kept. An empty prediction scores 0 (kvpress raises). references[0] is the needle."""
    scores = rouge_l(references[0].strip(), prediction.strip())
    return 0.0 if scores is None else scores[2]


# NoLiMa: evaluation/async_evaluate.py's _evaluate_response (adobe-research/NoLiMa at 7532e4e, lines 114-126), by
# its four `metric` names; the response as the API returned it (case-sensitive, the gold answers a list).


def nolima_em(prediction: str, references: References, **meta) -> float:
    return float(prediction.strip() in references)


def nolima_contains(prediction: str, references: References, **meta) -> float:
    return float(any(reference in prediction for reference in references))


def nolima_lastline_em(prediction: str, references: References, **meta) -> float:
    return float(prediction.strip().split("\n")[-1] in references)


def nolima_lastline_contains(prediction: str, references: References, **meta) -> float:
    return float(any(reference in prediction.strip().split("\n")[-1] for reference in references))


# ----------------------------------------------------------------------------------------------------------------
# The registry

METRICS: dict[str, Metric] = {
    # LongBench and LongBench-E (metrics.py's own names)
    "qa_f1_score": qa_f1_score,
    "qa_f1_zh_score": qa_f1_zh_score,
    "rouge_score": rouge_score,
    "rouge_zh_score": rouge_zh_score,
    "classification_score": classification_score,
    "retrieval_score": retrieval_score,
    "retrieval_zh_score": retrieval_zh_score,
    "count_score": count_score,
    "code_sim_score": code_sim_score,
    # LongBench v2
    "choice_accuracy": choice_accuracy,
    # RULER
    "string_match_all": string_match_all,
    "string_match_part": string_match_part,
    # InfiniteBench: infinitebench_<task>
    "infinitebench_passkey": infinitebench_passkey,
    "infinitebench_number_string": infinitebench_passkey,
    "infinitebench_kv_retrieval": infinitebench_kv_retrieval,
    "infinitebench_longbook_sum_eng": infinitebench_longbook_sum_eng,
    "infinitebench_longbook_choice_eng": infinitebench_longbook_choice_eng,
    "infinitebench_longbook_qa_eng": qa_f1_score,
    "infinitebench_longbook_qa_chn": infinitebench_longbook_qa_chn,
    "infinitebench_longdialogue_qa_eng": infinitebench_longdialogue_qa_eng,
    "infinitebench_math_find": infinitebench_math_find,
    "infinitebench_math_calc": infinitebench_math_calc,
    "infinitebench_code_run": infinitebench_code_run,
    "infinitebench_code_debug": infinitebench_code_debug,
    # SCBench: by task (compute_scores.py's names), turn kinds of the mixed sets included
    "scbench_kv": scbench_kv,
    "scbench_prefix_suffix": scbench_kv,
    "scbench_vt": scbench_vt,
    "scbench_qa_eng": scbench_qa_eng,
    "scbench_qa_chn": infinitebench_longbook_qa_chn,
    "scbench_choice_eng": infinitebench_longbook_choice_eng,
    "scbench_many_shot": scbench_qa_eng,
    "scbench_summary": infinitebench_longbook_sum_eng,
    "scbench_mf": scbench_mf,
    "scbench_passkey": infinitebench_passkey,
    # LooGLE
    "loogle_rouge_l": loogle_rouge_l,
    "loogle_rouge_1": loogle_rouge_1,
    "loogle_rouge_2": loogle_rouge_2,
    "loogle_bleu_1": loogle_bleu_1,
    "loogle_bleu_4": loogle_bleu_4,
    "loogle_exact_match": loogle_exact_match,
    "loogle_partial_match": loogle_partial_match,
    # kvpress's needle in a haystack
    "needle_rouge": needle_rouge,
    # kvpress's reasoning sets (evaluation.math_answers): AIME25 and MATH500 as kvpress scores them, MATH's grader
    "kvpress_aime": kvpress_aime,
    "kvpress_math500": kvpress_math500,
    "math_equal": math_equal_score,
    # NoLiMa (its run configs score "contains")
    "nolima_em": nolima_em,
    "nolima_contains": nolima_contains,
    "nolima_lastline_em": nolima_lastline_em,
    "nolima_lastline_contains": nolima_lastline_contains,
}

NOT_REPRODUCED: dict[str, str] = {
    "loogle METEOR": "NLTK's single_meteor_score needs the WordNet corpus, a download",
    "loogle BERTScore": "bert_score runs a RoBERTa-large model, a download",
    "loogle GPT-4 judge": "Evaluation/llm_eval.py asks GPT-4 through the OpenAI API",
    "scbench_repoqa": "compute_repoqa_score parses the generated function with tree-sitter and reports pass@1 over "
                      "BLEU similarity thresholds against every function of the repository",
    "infinitebench math_calc for gpt4": "the official scorer drops GPT-4's first number (its prompt's echo); open "
                                        "models are scored without the shift, as here",
}


def score(metric_name: str, prediction: str, references: References, **meta) -> float:
    """The metric `metric_name` of METRICS for one prediction and its references, in [0, 1].

    meta goes to the metric (e.g. all_classes); first_line=True in it scores only the prediction's first line
    (`first_line`: LongBench's trec, triviaqa, samsum and lsht).
    """
    metric = METRICS.get(metric_name)
    if metric is None:
        raise ValueError(f"unknown metric {metric_name!r}; known: {', '.join(sorted(METRICS))}")
    if isinstance(references, str):
        raise TypeError("references is a list of reference answers, not one string")
    if not references:
        raise ValueError(f"{metric_name}: no reference to score against")
    if meta.get("first_line"):
        prediction = first_line(prediction)
    return float(metric(prediction, references, **meta))
