"""Prompts in the model's own chat template, built from pieces whose token spans stay exact.

The template is rendered once around a placeholder standing for the content of a user turn; the text
before it (head) and after it (tail: end of the turn and the assistant's generation prompt) are then
tokenised on their own, next to the pieces that go in between.
"""

from __future__ import annotations

import torch

from .tokens import encode

PLACEHOLDER = "\u2063SNAPKV_LAB_PART\u2063"


def _name(tokenizer) -> str:
    return getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__


def require_chat_template(tokenizer) -> None:
    """Raise ValueError, naming the model and what to do, if the tokenizer has no chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"The tokenizer of {_name(tokenizer)!r} has no chat template, and these prompts are chat turns. Use an "
            "instruction-tuned (chat) model, or set tokenizer.chat_template to a Jinja chat template first."
        )


def chat_frame(tokenizer, history: list[dict] = ()) -> tuple[str, str]:
    """(head, tail): the template's text before and after the content of a user turn that follows `history`."""
    require_chat_template(tokenizer)
    messages = [*history, {"role": "user", "content": PLACEHOLDER}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if rendered.count(PLACEHOLDER) != 1:
        raise ValueError(f"The chat template of {_name(tokenizer)!r} does not copy a user message verbatim: {rendered!r}")
    head, tail = rendered.split(PLACEHOLDER)
    return head, tail


def chat_ids(tokenizer, history: list[dict], parts: list[tuple[str, str | list[int]]]) -> tuple[torch.Tensor, dict]:
    """Token ids of `history` + a user turn made of named parts, with the generation prompt.

    parts: [(name, text or token ids)], tokenised one by one so that their spans are exact.
    Returns ((1, n) ids, {name: (start, end)}).
    """
    head, tail = chat_frame(tokenizer, history)
    ids, spans = encode(tokenizer, head), {}
    for name, part in parts:
        piece = encode(tokenizer, part) if isinstance(part, str) else list(part)
        spans[name] = (len(ids), len(ids) + len(piece))
        ids += piece
    return torch.tensor([ids + encode(tokenizer, tail)]), spans
