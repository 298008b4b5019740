"""A benchmark example as token ids for one model: framed, and truncated as the benchmarks' own scripts truncate.

Framing follows the official scripts: a chat model gets its chat template around the whole prompt (context and
question in one user turn, the answer prefix after the generation prompt, as RULER's model templates put it); a
base model, or a task the official scripts send as raw text (Example.chat False: LongBench's few-shot and code
tasks), gets the prompt as it is, after the BOS token where the tokenizer starts texts with one.

Truncation: LongBench's pred.py cuts a prompt longer than the model's limit from the middle, keeping its first and
last halves; kvpress truncates the context. Here the context is cut from its middle, so that the frame's head and
the question at the end stay whole: `max_context` bounds context + the longest question, in tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.framing import bos_text, chat_frame, resolve_framing
from ..core.tokens import encode
from .examples import Example


@dataclass(frozen=True)
class EncodedExample:
    """context_ids: the framed context, cut to fit; questions: each question's ids (its text, the frame's tail and
    its answer prefix); truncated: context tokens cut from the middle; framing: "chat" or "plain"."""

    context_ids: list[int]
    questions: list[list[int]]
    truncated: int
    framing: str


def frame_texts(tokenizer, example: Example, framing: str | None = None) -> tuple[str, list[str], str]:
    """(context text, question texts, framing) of the example framed for this tokenizer (module doc)."""
    chosen = resolve_framing(tokenizer, framing) if example.chat else "plain"
    if chosen == "chat":
        head, tail = chat_frame(tokenizer)
    else:
        head, tail = bos_text(tokenizer), ""
    return head + example.context, [q.text + tail + q.answer_prefix for q in example.questions], chosen


def encode_example(tokenizer, example: Example, *, framing: str | None = None,
                   max_context: int | None = None) -> EncodedExample:
    """Token ids of the framed example, the context cut from its middle so that context + the longest question
    take at most max_context tokens (None: no cut)."""
    context, questions, chosen = frame_texts(tokenizer, example, framing)
    context_ids, question_ids = encode(tokenizer, context), [encode(tokenizer, q) for q in questions]
    truncated = 0
    if max_context is not None:
        room = max_context - max(len(q) for q in question_ids)
        if room < 2:
            raise ValueError(f"max_context={max_context} leaves no room for the context of {example.dataset}/"
                             f"{example.task} #{example.id}: its longest question alone takes {max_context - room} tokens")
        truncated = max(0, len(context_ids) - room)
        if truncated:
            half = room // 2
            context_ids = context_ids[:half] + context_ids[len(context_ids) - (room - half):]
    return EncodedExample(context_ids, question_ids, truncated, chosen)
