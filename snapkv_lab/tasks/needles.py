"""Retrieval tasks on real text: needle in a haystack, and LongEval-Lines-style key/value records.

A context (the frame's head and a haystack holding the facts) comes with one or more questions about it;
each knows the token spans of its fact and of the answer's value, to measure what a cache kept. The frame is the
model's chat template, or plain text for a base model (framing.prompt_frame; `framing` overrides the choice).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from ..core.framing import Frame, prompt_frame
from ..core.tokens import encode, token_span
from .haystacks import boundary, haystack_tokens, needle_template, word_key

# The context is the frame's head and the user's text; a question chunk is the question, the frame's tail (a chat
# template's end of turn and generation prompt, or "\nAnswer:") and the answer's first words, so that the next
# token is the value.
NEEDLE_QUESTION = "What is the special magic number for {key} mentioned in the provided text?"
NEEDLE_ANSWER = "The special magic number for {key} mentioned in the provided text is"
LINE = "line {key}: REGISTER_CONTENT is <{value}>\n"
LINES_HEAD = ("Below is a record of lines I want you to remember. Each line begins with 'line <line index>' and "
              "contains a '<REGISTER_CONTENT>' at the end of the line as a numerical value. For each line index, "
              "memorize its corresponding <REGISTER_CONTENT>. At the end of the record, I will ask you to retrieve "
              "the corresponding <REGISTER_CONTENT> of a certain line index.\n\n")
LINES_QUESTION = "Now the record is over. Tell me what is the <REGISTER_CONTENT> in line {key}? I need the number."
LINES_ANSWER = "The <REGISTER_CONTENT> in line {key} is <"


@dataclass
class Query:
    """A question about a context: question_ids follow the context; `span` is the [start, end) token range
    of the fact in the context and `value_span` that of every token overlapping the answer's characters."""

    question_ids: list[int]
    answer: str | list[str]  # several values expected (RULER's multivalue): all of them
    span: tuple[int, int]
    value_span: tuple[int, int]
    meta: dict = field(default_factory=dict)


@dataclass
class Context:
    context_ids: list[int]
    queries: list[Query]
    meta: dict = field(default_factory=dict)


def _fact(tokenizer, template: str, key: str, value: str) -> tuple[list[int], tuple[int, int]]:
    """A fact's token ids (tokenised on its own) and the [start, end) range of the tokens holding its value."""
    text = template.format(key=key, value=value)
    start = len(template.partition("{value}")[0].format(key=key))
    return token_span(tokenizer, text, start, start + len(value))


def _question(tokenizer, question: str, frame: Frame, answer: str, key: str, before: str = "\n\n") -> list[int]:
    """The question chunk: `before`, the question (labelled in plain text), the frame's tail, the answer's first
    words."""
    return encode(tokenizer, frame.ask(question.format(key=key), answer.format(key=key), before))


def sentence_start(tokenizer, hay: list[int], at: int, end: str = ".") -> int:
    """The haystack index at or before `at` right after a token holding `end` (a sentence end; a line end in code,
    logs and lists), so that a needle is a sentence or line of its own."""
    while 0 < at < len(hay) and end not in tokenizer.decode(hay[at - 1: at]):
        at -= 1
    return at


def needle_context(tokenizer, n_tokens: int, depth: float, sample: int = 0, framing: str | None = None,
                   haystack: str = "essays") -> Context:
    """A haystack of n_tokens in all (question included), with one 7-digit needle placed at `depth` (0 = first
    sentence or line, 1 = last), after a sentence end (a line end). haystack: Paul Graham's essays, or another kind
    with a needle that reads naturally in it (see pressure.haystacks). framing: see framing.prompt_frame."""
    rng = random.Random(f"needle-{sample}")
    key, value = word_key(rng), str(rng.randint(1_000_000, 9_999_999))
    frame = prompt_frame(tokenizer, framing=framing)
    head = encode(tokenizer, frame.head)
    needle, value_at = _fact(tokenizer, needle_template(haystack, rng), key, value)
    question = _question(tokenizer, NEEDLE_QUESTION, frame, NEEDLE_ANSWER, key)
    room = n_tokens - len(head) - len(needle) - len(question)
    if room < 1:
        raise ValueError(f"a needle context of {n_tokens} tokens leaves no room for a haystack: the frame, "
                         f"needle and question alone take {n_tokens - room}")
    hay = haystack_tokens(tokenizer, haystack, room, sample)
    at = sentence_start(tokenizer, hay, round(depth * len(hay)), boundary(haystack))
    body = hay[:at] + needle + hay[at:]
    start = len(head) + at
    query = Query(question, value, (start, start + len(needle)), (start + value_at[0], start + value_at[1]),
                  dict(key=key, depth=depth, depth_position=start))
    return Context(head + body, [query],
                   dict(task="needle", haystack=haystack, length=n_tokens, depth=depth, sample=sample))


def lines_context(tokenizer, n_tokens: int, n_queries: int = 8, sample: int = 0, framing: str | None = None) -> Context:
    """LongEval-Lines-style record of `line <word-word>: REGISTER_CONTENT is <number>` lines filling n_tokens,
    with n_queries questions about lines spread evenly over the record."""
    rng = random.Random(f"lines-{sample}")
    frame = prompt_frame(tokenizer, framing=framing)
    head = encode(tokenizer, frame.head + LINES_HEAD)
    def ask(key):
        return _question(tokenizer, LINES_QUESTION, frame, LINES_ANSWER, key, before="\n")

    question_room = len(ask("wonderful-question"))
    body, facts, keys, longest_question = [], [], set(), 0
    while len(head) + len(body) < n_tokens - question_room - 30:
        key = word_key(rng)
        if key in keys:
            continue
        keys.add(key)
        value = str(rng.randint(10_000, 99_999))
        line, value_at = _fact(tokenizer, LINE, key, value)
        # A tokenizer with short tokens makes lines longer than the 30 spare tokens: stop before the
        # record and any line's question pass n_tokens.
        longest_question = max(longest_question, len(ask(key)))
        if len(head) + len(body) + len(line) + longest_question > n_tokens:
            break
        facts.append((key, value, len(head) + len(body), line, value_at))
        body += line
    if len(facts) < n_queries:
        raise ValueError(f"a lines record of {n_tokens} tokens holds {len(facts)} lines, "
                         f"fewer than {n_queries} queries")
    queries = []
    for i in range(n_queries):
        key, value, start, line, value_at = facts[round((i + 0.5) * len(facts) / n_queries)]
        queries.append(Query(ask(key), value,
                             (start, start + len(line)), (start + value_at[0], start + value_at[1]),
                             dict(key=key, depth=start / (len(head) + len(body)), depth_position=start)))
    return Context(head + body, queries, dict(task="lines", length=n_tokens, lines=len(facts), sample=sample))



def found(expected: str | list[str], answer: str) -> bool:
    """RULER's grade: the expected string (each of them, for a list) appears anywhere in the answer (so
    99358488888 finds 9935848)."""
    return all(value in answer for value in _listed(expected))


def found_exactly(expected: str | list[str], answer: str) -> bool:
    """The strict grade: the expected value (each of them) appears as a whole token, not inside a longer
    number or word (99358488888 does not find 9935848; "is 9935848." does)."""
    return all(re.search(rf"(?<![\w-]){re.escape(value)}(?![\w-])", answer) is not None for value in _listed(expected))


def _listed(expected: str | list[str]) -> list[str]:
    return [expected] if isinstance(expected, str) else list(expected)
