"""Non-literal needles (tasks.nonliteral) and NoLiMa's loader and metric (evaluation.nolima).

The no-overlap check is written here, apart from the generator: its own stop-words and its own suffix stripping,
so that a bank entry that slips a shared word past the generator's author fails here. Expected NoLiMa prompts are
worked by hand from adobe-research/NoLiMa at 7532e4e (evaluation/run_tests.py, evaluation/async_evaluate.py,
data/book_haystack.py), on an invented needle set and book in the set's schema (tests/fixtures/eval/nolima).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import ByteTokenizer
from scipy.stats import t as scipy_t

from snapkv_lab.evaluation import nolima
from snapkv_lab.evaluation.metrics import score
from snapkv_lab.evaluation.nolima import DEFAULT_TASK_TEMPLATE, NOLIMA
from snapkv_lab.tasks.nonliteral import BANK, NAMES, nonliteral_item

FIXTURE = Path(__file__).parent / "fixtures" / "eval" / "nolima"

STOP_WORDS = frozenset("""a an the of to in on at for from by with about into onto over under near beside next and or
but not no nor so as is are was were be been being am has have had having do does did can cannot could should would
will shall may might must which who whom whose what when where why how this that these those it its there here
their they them he she his her him i me my we our you your one once every each some any all""".split())


def stem(word: str) -> str:
    """A crude suffix stripper (plural, -ing, -ed, -er, -ly): enough to match lives/live, visited/visit."""
    for suffix in ("ies", "ing", "ed", "er", "ly", "es", "s"):
        if len(word) > len(suffix) + 2 and word.endswith(suffix):
            return word[: -len(suffix)] + ("y" if suffix == "ies" else "")
    return word


def content_words(text: str) -> set[str]:
    return {stem(w) for w in re.findall(r"[a-z]+", text.lower()) if w not in STOP_WORDS}


def test_the_overlap_check_itself_sees_shared_words():
    assert content_words("Yuki lives next to the Opera House.") & content_words("Who lived near an opera?") \
        == {"liv", "opera"}
    assert not content_words("Which character has been to Dresden?") & content_words(
        "Actually, Yuki lives next to the Semper Opera House.") - {"character"}


def test_no_generated_question_shares_a_content_word_with_its_needle():
    items = [nonliteral_item(seed, index) for seed in range(3) for index in range(3 * len(BANK))]
    assert {item.pair for item in items} == set(range(len(BANK)))  # every bank entry is drawn
    for item in items:
        shared = content_words(item.question) & content_words(item.needle)
        assert not shared, (item.needle, item.question, shared)
        # the control asks with the needle's own words, for the same answer
        assert content_words(item.literal_question) & content_words(item.needle) - {"character"}, item
        assert item.answer in NAMES and item.answer in item.needle
        assert item.answer not in item.question and item.answer not in item.literal_question


def test_items_are_seeded_and_cover_the_bank_evenly():
    assert nonliteral_item(1, 5) == nonliteral_item(1, 5)
    pairs = [nonliteral_item(0, i).pair for i in range(len(BANK))]
    assert sorted(pairs) == list(range(len(BANK)))
    with pytest.raises(ValueError, match="index"):
        nonliteral_item(0, -1)


def test_generated_literal_and_nonliteral_share_one_context_of_the_length():
    tokenizer = ByteTokenizer()
    for index in (0, 13):  # depth 0 and depth 0.52
        specs = [dict(dataset="nolima", task=task, length=1500, seed=0, index=index)
                 for task in ("generated", "generated_literal")]
        plain, literal = (NOLIMA.example(spec, tokenizer) for spec in specs)
        item = nonliteral_item(0, index)
        assert plain.context == literal.context and item.needle in plain.context
        assert plain.context.startswith("You will answer a question based on the following book snippet:\n\n")
        assert plain.questions[0].text.endswith(f"Question: {item.question}\n\n Return only the final answer with no "
                                                "additional explanation or reasoning.")
        assert literal.questions[0].text.endswith(f"Question: {item.literal_question}\n\n Return only the final "
                                                  "answer with no additional explanation or reasoning.")
        assert plain.questions[0].answers == literal.questions[0].answers == (item.answer,)
        for example in (plain, literal):  # bytes: one token each; the answer's tokens counted in the length
            assert 1500 - 24 <= len((example.context + example.questions[0].text).encode()) + 16 <= 1500
        share = plain.context.index(item.needle) / len(plain.context)
        assert abs(share - plain.meta["depth"]) < 0.1
    with pytest.raises(ValueError, match="no room"):
        NOLIMA.example(dict(dataset="nolima", task="generated", length=200, seed=0, index=0), tokenizer)


def test_nolima_metric_is_the_official_contains():
    # async_evaluate.py lines 117-124: case-sensitive; EM on the stripped response; lastline on its last line
    assert score("nolima_contains", "I think it is Yuki.", ["Yuki"]) == 1.0
    assert score("nolima_contains", "yuki", ["Yuki"]) == 0.0
    assert score("nolima_em", " Yuki\n", ["Yuki"]) == 1.0 and score("nolima_em", "Yuki.", ["Yuki"]) == 0.0
    assert score("nolima_lastline_contains", "Yuki\nNo idea", ["Yuki"]) == 0.0
    assert score("nolima_lastline_em", "Reasoning...\nYuki", ["Yuki"]) == 1.0


def test_needle_set_expands_as_run_tests_does():
    tests = nolima.load_tests(str(FIXTURE))
    assert [t["test_name"] for t in tests] == ["0401_World_T01_C01_onehop", "0401_World_T02_C01_onehop",
                                               "0401_World_T01_C01_twohop", "0401_World_T02_C01_twohop",
                                               "0502_Fixed_T01_onehop"]
    assert tests[1]["needle"] == "Actually, {CHAR} lives next to the Kiasma museum."
    assert tests[1]["question"] == "Which character has been to Helsinki?"
    assert tests[2]["question"] == "Which character has been to Germany?"
    assert tests[0]["seed"] == 42 + 401 and tests[4]["seed"] == 42 + 502


def test_official_example_by_hand():
    source = str(FIXTURE)
    specs = NOLIMA.specs("onehop", lengths=(300,), source=source)
    assert len(specs) == 1 * 3 * 26  # one book, three onehop tests, 26 depths
    assert NOLIMA.specs("twohop", limit=2, lengths=(300,), source=source)[1]["depth"] == 1
    book = (FIXTURE / "haystack" / "rand_shuffle" / "rand_book_1.txt").read_text()
    # test 1 (Kiasma) at depth index 13 = 52%: line ends at bytes 44k + 43; the first one at or past 0.52 * 301 =
    # 156.5 is 175; the window starts at 175 - round(300 * 0.52) = 19 and ends at 319; the text before the needle
    # loses its last line end, the needle goes on a line of its own (book_haystack.py lines 89-94).
    spec = dict(dataset="nolima", task="onehop", source=source, length=300, book=0, test=1, depth=13)
    example = NOLIMA.example(spec, ByteTokenizer())
    character = np.random.RandomState(42 + 401).choice(["Yuki", "Stuart", "Katie", "Veronica", "Calvin"], 26)[13]
    haystack = book[19:175] + f" Actually, {character} lives next to the Kiasma museum.\n" + book[176:319]
    whole = DEFAULT_TASK_TEMPLATE.format(haystack=haystack, question="Which character has been to Helsinki?")
    assert example.context + example.questions[0].text == whole
    assert example.context.endswith(haystack) and example.questions[0].answers == (character,)
    assert example.metric == "nolima_contains" and example.max_new_tokens == 192
    fixed = NOLIMA.example(dict(spec, test=4, depth=0), ByteTokenizer())  # no {CHAR}: the test's gold answers
    assert fixed.questions[0].answers == ("Kiasma",)
    assert "The night guard said the Kiasma stays shut on Mondays.\n" in fixed.context
    with pytest.raises(ValueError, match="too short"):
        NOLIMA.example(dict(spec, length=20_000), ByteTokenizer())


def test_nolima_is_refused_clearly_without_its_files(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="needlesets/needle_set.json"):
        NOLIMA.specs("onehop", source=str(tmp_path))

    def offline(*args, **kwargs):
        raise OSError("no network")

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    nolima.load_tests.cache_clear()
    with pytest.raises(RuntimeError, match="amodaresi/NoLiMa.*--source DIR"):
        NOLIMA.specs("onehop")
    assert len(NOLIMA.specs("generated", limit=3)) == 3  # the generated tasks need no file


def _run(scores: dict) -> pd.DataFrame:
    """An eval table: {(policy, mode): [score per item]}, the full cache's under mode "full", one question each."""
    rows = [dict(dataset="nolima", length=4096, task="t", example=f"i{i}", policy=policy, mode=mode,
                 ratio=0.0 if policy == "FullCache" else 0.5, capacity=None, score=s, kv_share=0.5, over_budget=False)
            for (policy, mode), values in scores.items() for i, s in enumerate(values)]
    return pd.DataFrame(rows)


def test_literal_gap_by_hand():
    from snapkv_lab.evaluation.literal_gap import literal_gap

    # four items; the full cache answers items 0-2 both ways and misses item 3's non-literal question
    nonliteral = _run({("FullCache", "full"): [1, 1, 1, 0], ("SnapKV", "query-aware"): [0, 0, 1, 0]})
    literal = _run({("FullCache", "full"): [1, 1, 1, 1], ("SnapKV", "query-aware"): [1, 1, 1, 0]})
    out = literal_gap(nonliteral, literal).set_index("subset")
    # gaps in points: item 0 (0-100) - (100-100) = -100, item 1 -100, item 2 0, item 3 (0-0) - (0-100) = +100
    answered, every = out.loc["answered"], out.loc["all"]
    assert answered.n == 3 and answered.gap == pytest.approx(-200 / 3) and answered.nonzero == 2
    assert answered.loss_nonliteral == pytest.approx(-200 / 3) and answered.loss_literal == 0
    half = scipy_t.ppf(0.975, 2) * np.std([-100, -100, 0], ddof=1) / np.sqrt(3)
    assert (answered.low, answered.high) == pytest.approx((-200 / 3 - half, -200 / 3 + half))
    assert answered.p == pytest.approx(0.5)  # two equal nonzero gaps of one sign: 2 / 2^2 flips reach it
    assert every.n == 4 and every.gap == pytest.approx(-25) and every.full_nonliteral == 75
    with pytest.raises(ValueError, match="different items"):
        literal_gap(nonliteral, literal[literal.example != "i3"])


def test_the_docs_blocks_read_the_gap_tables():
    from snapkv_lab.app.docs_tables import NOLIMA_TABLES
    from snapkv_lab.evaluation.literal_gap import TABLES

    assert NOLIMA_TABLES == TABLES
