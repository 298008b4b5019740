"""RULER generated offline (snapkv_lab.evaluation.ruler): official strings, lengths, answers, spans, determinism."""

from __future__ import annotations

import json
import math
import re
import time
from collections import Counter

import pytest
from transformers import AutoTokenizer

from snapkv_lab.core.models import bundled_checkpoint
from snapkv_lab.core.tokens import encode
from snapkv_lab.evaluation.examples import Example
from snapkv_lab.evaluation.metrics import score
from snapkv_lab.evaluation.ruler import (
    CONFIGS,
    DEPTHS,
    NOISE,
    RULER,
    SYNTHETIC_TASKS,
    TEMPLATES,
    _zeta,
    essay_words,
    largest_fitting,
    split_sentences,
)

NIAH = [task for task in SYNTHETIC_TASKS if task.startswith("niah")]
NEEDLE = re.compile(r"One of the special magic (numbers|uuids) for (\S+) is: (\S+)\.")
UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(bundled_checkpoint())


@pytest.fixture(scope="module")
def examples(tokenizer):
    """One example of every synthetic task at 4096 tokens (seed 0, index 0, RULER's sizing), built once."""
    return {task: RULER.example(RULER.specs(task, limit=1)[0], tokenizer) for task in SYNTHETIC_TASKS}


def prompt(example: Example) -> str:
    """RULER's input text without its model template: the solved examples (each and its answer, a newline), the
    context, the question and the answer prefix."""
    question = example.questions[0]
    shots = "".join(shot + answer + "\n" for shot, answer in example.shots)
    return shots + example.context + question.text + question.answer_prefix


# --- The official task list, strings and settings ----------------------------------------------------------------


def test_tasks_are_ruler_official_thirteen_all_run_by_default():
    assert RULER.name == "ruler"
    assert RULER.tasks == ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
                           "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2")
    assert RULER.default_tasks == RULER.tasks and SYNTHETIC_TASKS == RULER.tasks[:11]


def test_templates_are_the_official_strings():
    """scripts/data/synthetic/constants.py, TASKS, copied here by hand from NVIDIA/RULER."""
    official = {
        "niah": ("Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
                 "I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic "
                 "{type_needle_v} for {query} mentioned in the provided text?",
                 " The special magic {type_needle_v} for {query} mentioned in the provided text are", 128),
        "variable_tracking": ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
                              "{context}\nQuestion: Find all variables that are assigned the value {query} in the text "
                              "above.", " Answer: According to the chain(s) of variable assignment in the text above, "
                              "{num_v} variables are assigned the value {query}, they are: ", 30),
        "common_words_extraction": ("Below is a numbered list of words. In these words, some appear more often than "
                                    "others. Memorize the ones that appear most often.\n{context}\nQuestion: What are "
                                    "the 10 most common words in the above list?",
                                    " Answer: The top 10 words that appear most often in the list are:", 120),
        "freq_words_extraction": ("Read the following coded text and track the frequency of each coded word. Find the "
                                  "three most frequently appeared coded words. {context}\nQuestion: Do not provide any "
                                  "explanation. Please ignore the dots '....'. What are the three most frequently "
                                  "appeared words in the above coded text?", " Answer: According to the coded text "
                                  "above, the three most frequently appeared words are:", 50),
        "qa": ("Answer the question based on the given documents. Only give me the answer and do not output any other "
               "words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given "
               "documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}",
               " Answer:", 32),
    }
    assert {family: (t.template, t.answer_prefix, t.tokens_to_generate) for family, t in TEMPLATES.items()} == official
    assert NOISE == "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


def test_configs_mirror_synthetic_yaml():
    niah = {task: (c.type_haystack, c.type_needle_k, c.type_needle_v, c.num_needle_k, c.num_needle_v, c.num_needle_q)
            for task, c in CONFIGS.items() if task.startswith("niah")}
    assert niah == {
        "niah_single_1": ("noise", "words", "numbers", 1, 1, 1),
        "niah_single_2": ("essay", "words", "numbers", 1, 1, 1),
        "niah_single_3": ("essay", "words", "uuids", 1, 1, 1),
        "niah_multikey_1": ("essay", "words", "numbers", 4, 1, 1),
        "niah_multikey_2": ("needle", "words", "numbers", 1, 1, 1),
        "niah_multikey_3": ("needle", "uuids", "uuids", 1, 1, 1),
        "niah_multivalue": ("essay", "words", "numbers", 1, 4, 1),
        "niah_multiquery": ("essay", "words", "numbers", 1, 1, 4),
    }
    vt, cwe, fwe = CONFIGS["vt"], CONFIGS["cwe"], CONFIGS["fwe"]
    assert (vt.type_haystack, vt.num_chains, vt.num_hops) == ("noise", 1, 4)
    assert (cwe.freq_cw, cwe.freq_ucw, cwe.num_cw) == (30, 3, 10)
    assert fwe.alpha == 2.0 and (CONFIGS["qa_1"].dataset, CONFIGS["qa_2"].dataset) == ("squad", "hotpotqa")


def test_depths_are_rulers_forty_and_zeta_is_scipys():
    assert len(DEPTHS) == 40 and DEPTHS[:4] == (0, 3, 5, 8) and DEPTHS[-2:] == (97, 100)
    special = pytest.importorskip("scipy.special")
    for s in (1.5, 2.0, 3.0):
        assert _zeta(s) == pytest.approx(float(special.zeta(s)), rel=1e-12)


# --- Specs and the qa tasks --------------------------------------------------------------------------------------


def test_specs_are_limit_times_lengths_json_able_and_checked():
    specs = RULER.specs("vt", limit=3, lengths=(4096, 8192), seed=5)
    assert len(specs) == 6 and json.loads(json.dumps(specs)) == specs
    assert specs[4] == dict(dataset="ruler", task="vt", length=8192, seed=5, index=1, sizing="official")
    assert RULER.specs("cwe", limit=1)[0] == dict(dataset="ruler", task="cwe", length=4096, seed=0, index=0,
                                                  sizing="official", cwe_shots="turn")
    # the lab's former ways are recorded by leaving the options out, as in the specs of the committed tables
    assert RULER.specs("cwe", limit=1, sizing="fill", cwe_shots="inline")[0] == dict(
        dataset="ruler", task="cwe", length=4096, seed=0, index=0)
    with pytest.raises(ValueError, match="sizing must be one of"):
        RULER.specs("vt", sizing="exact")
    assert len(RULER.specs("cwe")) == 10 and {s["length"] for s in RULER.specs("cwe")} == {4096}
    assert RULER.specs("fwe", limit=0) == []
    with pytest.raises(ValueError, match="unknown RULER task"):
        RULER.specs("niah_single_4")
    with pytest.raises(ValueError):
        RULER.specs("vt", lengths=(0,))


@pytest.mark.parametrize("task", ["qa_1", "qa_2"])
def test_qa_tasks_without_the_hub_or_a_source_say_so(task, monkeypatch):
    import builtins

    real = builtins.__import__
    monkeypatch.setattr(builtins, "__import__", lambda name, *a, **k: (_ for _ in ()).throw(ImportError(name))
                        if name == "datasets" else real(name, *a, **k))
    with pytest.raises(ImportError, match="needs the datasets package"):
        RULER.specs(task, limit=1, source=None)


# --- Every synthetic task: length, answers, metric ---------------------------------------------------------------


@pytest.mark.parametrize("task", SYNTHETIC_TASKS)
def test_prompt_fits_the_length(task, examples, tokenizer):
    example = examples[task]
    tokens = len(encode(tokenizer, prompt(example)))
    assert example.meta["prompt_tokens"] == tokens
    assert tokens + example.max_new_tokens <= 4096  # RULER: input tokens + tokens_to_generate
    assert example.meta["sizing"] == "official"
    filled = RULER.example(RULER.specs(task, limit=1, sizing="fill")[0], tokenizer)  # the lab's former sizing
    assert 0.95 * 4096 <= filled.meta["prompt_tokens"] + filled.max_new_tokens <= 4096
    assert filled.meta["prompt_tokens"] >= tokens and filled.questions == example.questions  # same draws, more hay
    family = CONFIGS[task].family
    assert example.max_new_tokens == TEMPLATES[family].tokens_to_generate
    assert example.metric == "string_match_all" and len(example.questions) == 1
    assert (example.dataset, example.task, example.id) == ("ruler", task, "4096-0-0")
    assert example.meta["length"] == 4096 and example.meta["seed"] == 0 and example.meta["index"] == 0
    for answer in example.questions[0].answers:
        assert answer in example.context
    assert json.loads(json.dumps(example.meta)) == example.meta  # JSON-able, spans as lists


@pytest.mark.parametrize("task", ["niah_single_2", "vt", "cwe", "fwe"])
def test_prompt_fits_other_lengths_and_a_byte_tokenizer(task, tokenizer, byte_tokenizer):
    for length, tok in ((1024, tokenizer), (8192, tokenizer), (20000, byte_tokenizer)):
        for sizing, least in (("fill", 0.95), ("official", 0.5)):
            example = RULER.example(RULER.specs(task, limit=1, lengths=(length,), sizing=sizing)[0], tok)
            tokens = len(encode(tok, prompt(example))) + example.max_new_tokens
            assert least * length <= tokens <= length, (length, sizing, tokens)


@pytest.mark.parametrize("sizing", ["official", "fill"])
def test_too_short_a_length_says_so(tokenizer, sizing):
    with pytest.raises(ValueError, match="ask for a longer length"):
        RULER.example(RULER.specs("cwe", limit=1, lengths=(300,), sizing=sizing)[0], tokenizer)


# --- niah ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("task", NIAH)
def test_niah_needles_spans_and_question(task, examples):
    example, config = examples[task], CONFIGS[task]
    question, context = example.questions[0], example.context
    spans, asked = example.meta["needle_spans"], example.meta["asked_spans"]
    num_k = max(config.num_needle_k, config.num_needle_q)
    assert len(spans) == num_k * config.num_needle_v
    assert len(asked) == len(question.answers) == config.num_needle_q * config.num_needle_v
    needles = [NEEDLE.fullmatch(context[start:end]) for start, end in spans]
    assert all(needles) and all(n.group(1) == config.type_needle_v for n in needles)
    assert len({n.group(2) for n in needles}) == num_k  # distinct keys, num_needle_v values each
    asked_needles = [NEEDLE.fullmatch(context[start:end]) for start, end in asked]
    assert sorted(n.group(3) for n in asked_needles) == sorted(question.answers)
    keys = example.meta["keys"]
    assert {n.group(2) for n in asked_needles} == set(keys)
    for key in keys:  # the asked keys are in the question and the answer prefix, and in no other needle
        assert key in question.text and key in question.answer_prefix
        assert sum(f" for {key} is: " in context[a:b] for a, b in spans) == config.num_needle_v
        assert context.count(f" for {key} is: ") == config.num_needle_v
    if config.type_needle_v == "uuids":
        assert all(re.fullmatch(UUID, answer) for answer in question.answers)
    else:
        assert all(re.fullmatch(r"[1-9]\d{6}", answer) for answer in question.answers)
    if config.type_needle_k == "words":
        assert all(re.fullmatch(r"[A-Za-z' -]+-[A-Za-z' -]+", key) for key in keys)


def test_niah_single_and_plural_templates(examples):
    single = examples["niah_single_1"]
    key = single.meta["keys"][0]
    assert single.context.startswith("A special magic number is hidden within the following text. Make sure to "
                                     "memorize it. I will quiz you about the number afterwards.\n")
    assert single.questions[0].text == f"\nWhat is the special magic number for {key} mentioned in the provided text?"
    assert single.questions[0].answer_prefix == f" The special magic number for {key} mentioned in the provided text is"
    uuid = examples["niah_single_3"]
    assert uuid.context.startswith("A special magic uuid is hidden") and "magic uuids for" in uuid.context
    many = examples["niah_multiquery"]
    keys = many.meta["keys"]
    query = f"{keys[0]}, {keys[1]}, {keys[2]}, and {keys[3]}"
    assert many.context.startswith("Some special magic numbers are hidden within the following text. Make sure to "
                                   "memorize it. I will quiz you about the numbers afterwards.\n")
    assert many.questions[0].text == (f"\nWhat are all the special magic numbers for {query} mentioned in the "
                                      "provided text?")
    assert many.questions[0].answer_prefix == (f" The special magic numbers for {query} mentioned in the provided "
                                               "text are")


def test_niah_haystacks(examples):
    head = ("A special magic number is hidden within the following text. Make sure to memorize it. I will quiz you "
            "about the number afterwards.\n")
    noise = examples["niah_single_1"]
    lines = noise.context[len(head):].split("\n")
    assert [line for line in lines if line != NOISE] == [noise.context[a:b] for a, b in noise.meta["needle_spans"]]
    assert len(lines) == noise.meta["units"] + 1

    needle = examples["niah_multikey_2"]
    lines = needle.context[len(head):].split("\n")
    assert len(lines) == needle.meta["units"] + 1 and all(NEEDLE.fullmatch(line) for line in lines)
    assert len({NEEDLE.fullmatch(line).group(2) for line in lines}) > 0.99 * len(lines)  # distractors: other keys

    essay = examples["niah_multikey_1"]
    text = essay.context
    for start, end in sorted(essay.meta["needle_spans"], reverse=True):  # needles sit between sentences
        assert text[start - 1] == " " and text[end:end + 1] in (" ", "")
        assert start == len(head) + 1 or text[start - 2] in ".?!\"')]"
        text = text[:start - 1] + text[end:]
    assert text[len(head):].strip() == " ".join(essay_words()[:essay.meta["units"]])


def test_niah_needles_spread_over_the_haystack(tokenizer):
    """Over 12 examples the one needle of niah_single_2 lands at many different depths, from the start to the end."""
    depths = []
    for spec in RULER.specs("niah_single_2", limit=12, lengths=(2048,)):
        example = RULER.example(spec, tokenizer)
        depths.append(example.meta["needle_spans"][0][0] / len(example.context))
    assert len({round(d, 2) for d in depths}) >= 8 and min(depths) < 0.3 and max(depths) > 0.7


# --- vt, cwe, fwe ----------------------------------------------------------------------------------------------------


def test_vt_chain_spans_and_answers(examples, tokenizer):
    example = examples["vt"]
    question = example.questions[0]
    lines = [example.context[a:b] for a, b in example.meta["needle_spans"]]
    assert example.meta["asked_spans"] == example.meta["needle_spans"] and len(lines) == 5
    answers = question.answers
    value = re.fullmatch(r"VAR ([A-Z]{5}) = (\d{5})", lines[0])
    assert value and value.group(1) == answers[0]
    for j in range(1, 5):
        assert lines[j] == f"VAR {answers[j]} = VAR {answers[j - 1]} "  # RULER's own trailing space
    assert question.text == (f"\nQuestion: Find all variables that are assigned the value {value.group(2)} in the "
                             "text above.")
    assert question.answer_prefix == (" Answer: According to the chain(s) of variable assignment in the text above, 5 "
                                      f"variables are assigned the value {value.group(2)}, they are: ")
    start = example.meta["prompt_start"]
    main = example.context[start:]
    assert main.startswith("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n")
    assert sum(line.startswith("VAR ") for line in main.split("\n")) == 5
    assert set(main.split("\n")[2:]) - set(lines) == {NOISE}
    # the solved in-context example before it: 3-letter variables, at most 500 tokens of prompt, then its answer
    icl, answer = example.context[:start].rsplit("they are: ", 1)
    icl_vars = re.findall(r"VAR ([A-Z]{3}) = ", icl)
    assert answer.strip().split(" ") == icl_vars and answer.startswith(" ") and answer.endswith("\n\n")
    assert 450 <= len(encode(tokenizer, icl + "they are: ")) <= 500


def test_cwe_answers_are_the_most_common_words(examples, tokenizer):
    example = examples["cwe"]
    assert example.meta["prompt_start"] == 0 and len(example.shots) == 1  # the solved example: a turn of its own
    main = example.context.split("\n", 1)[1]
    entries = re.split(r" ?\b(\d+)\. ", " " + main)[1:]
    numbers, words = [int(n) for n in entries[0::2]], entries[1::2]
    assert numbers == list(range(1, len(words) + 1))
    counts = Counter(words)
    answers = example.questions[0].answers
    assert len(answers) == 10 and {counts[a] for a in answers} == {30}
    assert set(counts.values()) == {30, 3} and len(counts) == example.meta["units"]
    whole = Counter(re.findall(r"\d+\. ([^\d\n]+?)(?= \d+\. |\n|$)", prompt(example)))  # the few-shot example too
    assert {w for w, _ in whole.most_common(10)} == set(answers)
    ((shot, shot_answer),) = example.shots
    shot_list = shot.removesuffix("\nQuestion: What are the 10 most common words in the above list?")
    assert shot_answer.startswith(" Answer: The top 10 words that appear most often in the list are: 1. ")
    shot_counts = Counter(re.split(r" ?\b\d+\. ", " " + shot_list.split("\n", 1)[1])[1:])
    shot_answers = re.split(r" ?\b\d+\. ", " " + shot_answer.split(" are: ", 1)[1])[1:]
    assert sorted(shot_counts.values()) == [3] * 30 + [10] * 10  # 40 words, 10 of them 10 times, the rest 3
    assert {w for w, c in shot_counts.items() if c == 10} == set(shot_answers) and len(shot_answers) == 10
    # cwe_shots="inline" (the lab's former way): the same text, the solved example opening the context
    inline = RULER.example(RULER.specs("cwe", limit=1, cwe_shots="inline")[0], tokenizer)
    assert inline.shots == () and inline.context == shot + shot_answer + "\n" + example.context
    assert inline.meta["prompt_start"] == len(shot + shot_answer + "\n") and prompt(inline) == prompt(example)


def test_cwe_below_4096_repeats_six_and_one(tokenizer):
    example = RULER.example(RULER.specs("cwe", limit=1, lengths=(2048,))[0], tokenizer)
    main = example.context[example.meta["prompt_start"]:].split("\n", 1)[1]
    counts = Counter(re.split(r" ?\b\d+\. ", " " + main)[1:])
    assert {counts[a] for a in example.questions[0].answers} == {6} and set(counts.values()) == {6, 1}


def test_fwe_answers_are_the_three_most_frequent_coded_words(examples):
    example = examples["fwe"]
    counts = Counter(example.context.split(" "))
    ranked = [word for word, _ in counts.most_common(4)]
    assert ranked[0] == "..." and tuple(ranked[1:]) == example.questions[0].answers
    assert all(re.fullmatch(r"[a-z]{6}", a) for a in example.questions[0].answers)
    n = example.meta["units"]  # RULER's zeta law: the k-th word int(n k^-2 / zeta(2)) times
    assert [counts[w] for w in ranked] == [int(n * k ** -2.0 / (math.pi ** 2 / 6)) for k in (1, 2, 3, 4)]


# --- Determinism ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("task", SYNTHETIC_TASKS)
def test_same_spec_same_example_other_seed_or_index_another(task, examples, tokenizer):
    spec = RULER.specs(task, limit=1)[0]
    assert RULER.example(dict(spec), tokenizer) == examples[task]
    for other in (dict(spec, seed=1), dict(spec, index=1)):
        example = RULER.example(other, tokenizer)
        assert example.questions[0].answers != examples[task].questions[0].answers
        assert example.context != examples[task].context


@pytest.mark.parametrize("task", SYNTHETIC_TASKS)
def test_references_score_1_with_the_tasks_own_metric_at_another_length_and_seed(task, tokenizer):
    """A prediction that says every reference scores 1 with the metric the example names; one that leaves the last
    reference out scores its share less, so a metric that scored everything 1 would fail."""
    spec = RULER.specs(task, limit=1, lengths=[1500], seed=11)[0]
    example = RULER.example(spec, tokenizer)
    metric = example.questions[0].metric or example.metric
    references = list(example.questions[0].answers)
    assert score(metric, "Answer: " + ", ".join(references) + ".", references, **example.meta) == 1.0
    short = score(metric, " ".join(references[:-1]), references, **example.meta)
    assert short == pytest.approx((len(references) - 1) / len(references))


def test_sentences_split_after_ends_but_not_abbreviations():
    text = 'He said "stop." Then Mr. Smith left, e.g. at 5 p.m. on foot. Why? J. Doe came (late.) Done'
    assert [text[a:b] for a, b in split_sentences(text)] == [
        'He said "stop."', "Then Mr. Smith left, e.g. at 5 p.m. on foot.", "Why?", "J. Doe came (late.)", "Done"]


def test_largest_fitting_finds_the_last_fitting_size():
    def brute(count, budget, lo, hi):
        fits = [n for n in range(lo, hi + 1) if count(n) <= budget]
        return max(fits) if fits else None

    for a, b, wobble in ((40, 3.0, 0), (500, 0.7, 2), (7, 25.0, 9)):
        count = lambda n: a + int(b * n) + (n * 7919) % (wobble + 1)  # noqa: E731 (nearly linear; wobbles if wobble)
        for budget in (a + 1, 1000, 4000, 130000):
            calls = []
            counted = lambda n: calls.append(n) or count(n)  # noqa: E731
            found = largest_fitting(counted, budget, 1, 200000)
            if wobble == 0:
                assert found == brute(count, budget, 1, 200000)
            elif found is None:
                assert count(1) > budget
            else:  # fits, the next size does not, and nothing far beyond can
                assert count(found) <= budget < count(found + 1) and a + int(b * (found + 1)) + wobble > budget
            assert len(calls) <= 20
    assert largest_fitting(lambda n: 100 + n, 50, 1, 10) is None
    assert largest_fitting(lambda n: n, 10**6, 1, 10) == 10


def test_a_4k_and_a_16k_example_build_fast(tokenizer, examples):
    for task, length, seconds in (("niah_multikey_1", 4096, 2.0), ("niah_multiquery", 16384, 4.0)):
        start = time.perf_counter()
        RULER.example(dict(dataset="ruler", task=task, length=length, seed=3, index=0), tokenizer)
        assert time.perf_counter() - start < seconds
