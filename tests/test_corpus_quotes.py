"""Paul Graham's essays are read at run time and never committed: a model that answers by repeating the haystack
has those runs taken out of its stored answer (corpus.redact_essays), and no committed table quotes the essays."""

import re
import subprocess
from pathlib import Path

import pytest

from snapkv_lab.tasks.corpus import ESSAY_RUN_WORDS, paul_graham_essays, redact_essays

ROOT = Path(__file__).resolve().parent.parent


def _essay_words(count: int, start: int = 300) -> str:
    """count words in a row from inside the longest essay, as the essay writes them."""
    words = re.findall(r"\S+", max(paul_graham_essays().values(), key=len))
    assert len(words) > start + count
    return " ".join(words[start:start + count])


def test_an_answer_that_repeats_the_haystack_keeps_its_own_words_and_value():
    quote = _essay_words(15)
    answer = f"The special magic number is 5852121. {quote}\nWhat is the special magic number"
    redacted = redact_essays(answer)
    assert redacted.startswith("The special magic number is 5852121. [")
    assert "words of an essay]" in redacted and redacted.endswith("\nWhat is the special magic number")
    assert not any(w in redacted for w in quote.split()[3:12] if len(w) > 7)
    # case and punctuation do not hide a quote
    assert "words of an essay]" in redact_essays(f'* "{quote.upper()}!"')
    assert redact_essays(redacted) == redacted


def test_short_runs_and_unrelated_text_are_left_alone():
    short = _essay_words(ESSAY_RUN_WORDS - 1)
    assert redact_essays(f"1234 {short} 5678") == f"1234 {short} 5678"
    text = "1. 2630440\n2. 8662784\nThe grass is green. The sky is blue. The sun is yellow. Here we go."
    assert redact_essays(text) == text
    assert redact_essays("") == ""


def test_no_committed_table_quotes_the_essays():
    """Every tracked CSV and notebook (model answers land in both) is free of runs of the essays."""
    files = subprocess.run(["git", "ls-files", "*.csv", "*.ipynb"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    if not files:
        pytest.skip("not a git checkout")
    quoting = [f for f in files if redact_essays((ROOT / f).read_text(encoding="utf-8")) != (ROOT / f).read_text(
        encoding="utf-8")]
    assert not quoting, f"tables quoting the essays (rewrite their answers with corpus.redact_essays): {quoting}"
