"""How a prompt's pieces are framed for a model: its own chat template, or plain text for a base model.

Every prompt set of the lab (findings chats and essays, needles, records) is built from pieces whose token
spans stay exact: the frame's text before the user's content (head) and after it (tail) are tokenised on
their own, next to the pieces that go in between.

- chat: the tokenizer's chat template, rendered once around a placeholder standing for a user turn's
  content; the tail is the end of the turn and the assistant's generation prompt.
- plain: a base model's completion. One turn: BOS, the content, a question labelled "Question: ", then
  "\\nAnswer:" (and the answer's opening words where a task needs them). After earlier turns: the turns as
  plain text with speaker labels ("User: ...\\n\\nAssistant: ...\\n\\n"), then "User: " + content +
  "\\n\\nAssistant:".

`framing=None` picks chat for a tokenizer with a chat template and plain otherwise; "chat" or "plain" overrides.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .tokens import encode

PLACEHOLDER = "\u2063SNAPKV_LAB_PART\u2063"
FRAMINGS = ("chat", "plain")
SPEAKERS = {"user": "User", "assistant": "Assistant", "system": "System"}


@dataclass(frozen=True)
class Frame:
    """The text around a user turn's content. head: before it; tail: after it, up to where the answer begins.
    question: the label before a question asked about a context ("" inside a chat turn, "Question: " in plain
    text). answer_sep: between the tail and an answer's opening words (" " after "Answer:")."""

    framing: str
    head: str
    tail: str
    question: str = ""
    answer_sep: str = ""

    def ask(self, question: str, answer: str = "", before: str = "\n\n") -> str:
        """The text of a question about a context that ends the prompt: `before`, the label, the question, the tail
        and, when given, the answer's opening words (so that the next token is the value asked for)."""
        return before + self.question + question + self.tail + (self.answer_sep + answer if answer else "")


def _name(tokenizer) -> str:
    return getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__


def resolve_framing(tokenizer, framing: str | None = None) -> str:
    """"chat" or "plain": the framing asked for, or (None) chat where the tokenizer has a chat template."""
    if framing is None:
        return "chat" if getattr(tokenizer, "chat_template", None) else "plain"
    if framing not in FRAMINGS:
        raise ValueError(f"framing must be one of {FRAMINGS} or None (chosen by the tokenizer), got {framing!r}")
    if framing == "chat":
        require_chat_template(tokenizer)
    return framing


def require_chat_template(tokenizer) -> None:
    """Raise ValueError, naming the model and what to do, if the tokenizer has no chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"The tokenizer of {_name(tokenizer)!r} has no chat template (a base model), and chat framing was asked "
            "for. Use framing='plain' (or None: plain text is chosen for a base model), or set tokenizer.chat_template."
        )


def chat_frame(tokenizer, history: list[dict] = ()) -> tuple[str, str]:
    """(head, tail): the chat template's text before and after the content of a user turn that follows `history`."""
    require_chat_template(tokenizer)
    messages = [*history, {"role": "user", "content": PLACEHOLDER}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if rendered.count(PLACEHOLDER) != 1:
        raise ValueError(f"The chat template of {_name(tokenizer)!r} does not copy a user message verbatim: "
                         f"{rendered!r}")
    head, tail = rendered.split(PLACEHOLDER)
    return head, tail


def bos_text(tokenizer) -> str:
    """The BOS token's text where the tokenizer starts every encoded text with it (Gemma, Llama 2), else ""."""
    bos, bos_id = getattr(tokenizer, "bos_token", None), getattr(tokenizer, "bos_token_id", None)
    if bos is None or bos_id is None:
        return ""
    ids = tokenizer("a")["input_ids"]
    return bos if ids and ids[0] == bos_id else ""


def plain_turns(history: list[dict]) -> str:
    """Chat turns as plain text with speaker labels, each followed by a blank line."""
    text = ""
    for turn in history:
        role = turn["role"]
        if role not in SPEAKERS:
            raise ValueError(f"a turn's role must be one of {sorted(SPEAKERS)}, got {role!r}")
        text += f"{SPEAKERS[role]}: {turn['content']}\n\n"
    return text


def prompt_frame(tokenizer, history: list[dict] = (), framing: str | None = None) -> Frame:
    """The Frame of a user turn that follows `history` (a list of {"role", "content"}), chat or plain (see the
    module's docstring)."""
    if resolve_framing(tokenizer, framing) == "chat":
        return Frame("chat", *chat_frame(tokenizer, history))
    if history:
        return Frame("plain", bos_text(tokenizer) + plain_turns(history) + "User: ", "\n\nAssistant:",
                     question="Question: ", answer_sep=" ")
    return Frame("plain", bos_text(tokenizer), "\nAnswer:", question="Question: ", answer_sep=" ")


def plain_prompt(tokenizer, messages: list[dict]) -> str:
    """Chat messages (ending with a user turn) as one plain-text prompt, BOS included, for a base model."""
    if not messages or messages[-1]["role"] != "user":
        raise ValueError("plain framing needs the messages to end with a user turn, which the answer follows")
    frame = prompt_frame(tokenizer, list(messages[:-1]), "plain")
    return frame.head + messages[-1]["content"] + frame.tail


def framed_ids(tokenizer, history: list[dict], parts: list[tuple[str, str | list[int]]],
               framing: str | None = None) -> tuple[torch.Tensor, dict]:
    """Token ids of `history` + a user turn made of named parts, framed to be answered (prompt_frame).

    parts: [(name, text or token ids)], tokenised one by one so that their spans are exact.
    Returns ((1, n) ids, {name: (start, end)}).
    """
    frame = prompt_frame(tokenizer, history, framing)
    ids, spans = encode(tokenizer, frame.head), {}
    for name, part in parts:
        piece = encode(tokenizer, part) if isinstance(part, str) else list(part)
        spans[name] = (len(ids), len(ids) + len(piece))
        ids += piece
    return torch.tensor([ids + encode(tokenizer, frame.tail)]), spans
