"""RULER-style needle variants (Hsieh et al. 2024, arXiv 2404.06654), generated offline from the haystacks.

    ruler_context(tokenizer, 4000, task="multikey", value_kind="uuid", sample=0)

Tasks, each with `needles` facts spread evenly over the haystack (each after a sentence end):
- single: one needle (RULER's niah_single);
- multikey: needles with distinct keys, one asked about: the others are distractors (niah_multikey);
- multivalue: needles with one key and distinct values, all asked for at once (niah_multivalue);
- multiquery: needles with distinct keys, one question per key, answered on one context (niah_multiquery;
  compressed once in query-agnostic mode).
Values: 7-digit numbers, words (nouns), or uuid-like hex codes. A query's `answer` is a list of strings
when several values are expected (multivalue); the graders (`found`, `found_exactly`) then want all of them.
"""

from __future__ import annotations

import random

from ..core.framing import prompt_frame
from ..core.tokens import encode
from .corpus import haystack_ids
from .haystacks import word_key
from .needles import Context, Query, _fact, _question, sentence_start

TASKS = ("single", "multikey", "multivalue", "multiquery")
VALUE_KINDS = ("number", "word", "uuid")
NEEDLE = " One of the special magic {kind}s for {key} is: {value}. "
QUESTION = "What is the special magic {kind} for {key} mentioned in the provided text?"
ANSWER = "The special magic {kind} for {key} mentioned in the provided text is"
QUESTION_ALL = "What are all the special magic {kind}s for {key} mentioned in the provided text?"
ANSWER_ALL = "The special magic {kind}s for {key} mentioned in the provided text are"


def _value(rng: random.Random, kind: str) -> str:
    if kind == "number":
        return str(rng.randint(1_000_000, 9_999_999))
    if kind == "word":
        return word_key(rng).split("-")[-1]
    return f"{rng.getrandbits(32):08x}-{rng.getrandbits(16):04x}-{rng.getrandbits(16):04x}"


def ruler_context(tokenizer, n_tokens: int, task: str = "multikey", value_kind: str = "number", needles: int = 4,
                  sample: int = 0, framing: str | None = None) -> Context:
    """A haystack of n_tokens in all (the longest question included) holding `needles` facts (1 for single)."""
    if task not in TASKS or value_kind not in VALUE_KINDS:
        raise ValueError(f"task must be one of {TASKS} and value_kind one of {VALUE_KINDS}, got {task!r}, "
                         f"{value_kind!r}")
    needles = 1 if task == "single" else needles
    if needles < 1 or (task != "single" and needles < 2):
        raise ValueError(f"{task} needs at least 2 needles, got {needles}")
    rng = random.Random(f"ruler-{task}-{value_kind}-{sample}")
    keys = [word_key(rng)] * needles if task == "multivalue" else []
    while len(keys) < needles:  # distinct keys, so a distractor never answers the question
        key = word_key(rng)
        keys += [key] if key not in keys else []
    values = []
    while len(values) < needles:
        value = _value(rng, value_kind)
        values += [value] if value not in values else []
    frame = prompt_frame(tokenizer, framing=framing)
    head = encode(tokenizer, frame.head)
    template = NEEDLE.replace("{kind}", value_kind)
    facts = [_fact(tokenizer, template, key, value) for key, value in zip(keys, values, strict=True)]
    if task == "multivalue":
        asked = [(keys[0], list(range(needles)), QUESTION_ALL, ANSWER_ALL)]
    else:
        targets = range(needles) if task == "multiquery" else [rng.randrange(needles)]
        asked = [(keys[i], [i], QUESTION, ANSWER) for i in targets]
    questions = [_question(tokenizer, q.replace("{kind}", value_kind), frame, a.replace("{kind}", value_kind), key)
                 for key, _, q, a in asked]
    room = n_tokens - len(head) - sum(len(ids) for ids, _ in facts) - max(len(q) for q in questions)
    if room < needles:
        raise ValueError(f"a {task} context of {n_tokens} tokens leaves no room for a haystack: the frame, "
                         f"{needles} needles and the longest question alone take {n_tokens - room}")
    hay = haystack_ids(tokenizer, room, start=sample * 7)
    cuts = [sentence_start(tokenizer, hay, round((i + 0.5) / needles * len(hay))) for i in range(needles)]
    body, starts, previous = [], [], 0
    for cut, (ids, _) in zip(cuts, facts, strict=True):
        body += hay[previous:cut]
        starts.append(len(head) + len(body))
        body += ids
        previous = cut
    body += hay[previous:]
    context = head + body
    queries = []
    for (key, which, _, _), question in zip(asked, questions, strict=True):
        first = which[0]
        value_at = facts[first][1]
        answer = [values[i] for i in which] if task == "multivalue" else values[first]
        queries.append(Query(question, answer, (starts[first], starts[first] + len(facts[first][0])),
                             (starts[first] + value_at[0], starts[first] + value_at[1]),
                             dict(key=key, depth=(first + 0.5) / needles, depth_position=starts[first])))
    return Context(context, queries, dict(task=task, value_kind=value_kind, needles=needles, length=n_tokens,
                                          sample=sample))
