"""A benchmark example as token ids for one model: framed, and truncated as the benchmarks' own scripts truncate.

Framing (`framing=None`: the example's own, as its official script frames it):
- "chat" (RULER, and every set whose script applies the model's chat template): the tokenizer's chat template around
  the whole prompt (context and question in one user turn, the answer prefix after the generation prompt, as RULER's
  model templates put it); a tokenizer without one gets plain text. Solved examples (Example.shots, RULER's cwe) come
  first, each framed as RULER frames it: the whole template around it, its answer, a newline.
- "longbench" (LongBench's pred.py build_chat, lines 21-42): LongBench's own template for the models it names
  (longbench.CHAT_TEMPLATES, by Hub id), and for any other model the prompt as it is, BOS first where the tokenizer
  adds one (pred.py tokenizes with special tokens).
A task the official scripts send as raw text (Example.chat False: LongBench's few-shot and code tasks) gets the prompt
as it is, after the BOS token where the tokenizer starts texts with one. `framing="chat"` or `"plain"` overrides (the
tokenizer's template, or plain text); "chat" on LongBench is the lab's framing before 2026-11-29.

Truncation (`max_context`: the limit in tokens; None: no cut):
- Example.truncation "context": the context is cut from its middle, so that the frame's head and the question at
  the end stay whole: context + the longest question (framed) take at most max_context tokens (kvpress's protocol).
- "prompt" (LongBench's pred.py lines 57-62): the unframed prompt, tokenized with special tokens, keeps its first
  and last int(max_context / 2) tokens, each half decoded without special tokens and joined; then framed and
  tokenized again. max_context is then LongBench's max_length (longbench.max_length: the window less about 500).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..core.framing import bos_text, chat_frame, resolve_framing
from ..core.tokens import encode
from .examples import Example
from .longbench import longbench_frame

FRAMES = ("chat", "longbench")


@dataclass(frozen=True)
class EncodedExample:
    """context_ids: the framed context, cut to fit; questions: each question's ids (its text, the frame's tail and
    its answer prefix); truncated: tokens cut from the middle; framing: "chat", "plain" or "longbench-<model>"."""

    context_ids: list[int]
    questions: list[list[int]]
    truncated: int
    framing: str


def _frame(tokenizer, example: Example, framing: str | None) -> tuple[str, str, str, str]:
    """(head, tail, the head of a solved example's turn, the framing's name)."""
    if not example.chat:
        return bos_text(tokenizer), "", "", "plain"
    if framing is None and example.frame == "longbench":
        name, head, tail = longbench_frame(tokenizer)
        return bos_text(tokenizer) + head, tail, head, name
    if framing is None and example.frame not in FRAMES:
        raise ValueError(f"an example's frame is one of {FRAMES}, got {example.frame!r}")
    if resolve_framing(tokenizer, framing) == "chat":
        head, tail = chat_frame(tokenizer)
        return head, tail, head, "chat"
    return bos_text(tokenizer), "", "", "plain"


def frame_texts(tokenizer, example: Example, framing: str | None = None) -> tuple[str, list[str], str]:
    """(context text, question texts, framing) of the example framed for this tokenizer (module doc)."""
    head, tail, turn, chosen = _frame(tokenizer, example, framing)
    shots = "".join(shot + tail + answer + "\n" + turn for shot, answer in example.shots)
    return head + shots + example.context, [q.text + tail + q.answer_prefix for q in example.questions], chosen


def truncate_prompt(tokenizer, example: Example, max_length: int) -> tuple[Example, int]:
    """LongBench's pred.py lines 57-62 on an example of one question: where its prompt (context + question, tokenized
    with special tokens) is longer than max_length, the text of its first and last int(max_length / 2) tokens, each
    decoded without special tokens; returns the example holding that text (the question where it still ends the
    text, else the second half as the question) and the number of tokens cut."""
    if len(example.questions) != 1:
        raise ValueError(f"truncation 'prompt' cuts a prompt of one question; {example.dataset}/{example.task} "
                         f"#{example.id} has {len(example.questions)}")
    question = example.questions[0]
    ids = tokenizer(example.context + question.text)["input_ids"]
    if len(ids) <= max_length:
        return example, 0
    half = int(max_length / 2)
    first, last = (tokenizer.decode(part, skip_special_tokens=True) for part in (ids[:half], ids[-half:]))
    text = first + last
    if question.text and text.endswith(question.text):
        context, asked = text[:len(text) - len(question.text)], question.text
    else:  # the cut reached into the question: what is left of it opens no new context
        context, asked = first, last
    return replace(example, context=context, questions=(replace(question, text=asked),)), len(ids) - 2 * half


def encode_example(tokenizer, example: Example, *, framing: str | None = None,
                   max_context: int | None = None) -> EncodedExample:
    """Token ids of the framed example, cut as its truncation says (module doc) to max_context tokens (None: no
    cut)."""
    truncated = 0
    if max_context is not None and example.truncation == "prompt":
        example, truncated = truncate_prompt(tokenizer, example, max_context)
        max_context = None
    elif example.truncation not in ("context", "prompt"):
        raise ValueError(f"an example's truncation is 'context' or 'prompt', got {example.truncation!r}")
    context, questions, chosen = frame_texts(tokenizer, example, framing)
    context_ids, question_ids = encode(tokenizer, context), [encode(tokenizer, q) for q in questions]
    if max_context is not None:
        room = max_context - max(len(q) for q in question_ids)
        if room < 2:
            raise ValueError(f"max_context={max_context} leaves no room for the context of {example.dataset}/"
                             f"{example.task} #{example.id}: its longest question alone takes "
                             f"{max_context - room} tokens")
        truncated = max(0, len(context_ids) - room)
        if truncated:
            half = room // 2
            context_ids = context_ids[:half] + context_ids[len(context_ids) - (room - half):]
    return EncodedExample(context_ids, question_ids, truncated, chosen)
