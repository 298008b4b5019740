"""Token ids of a text (no special tokens added) and the exact token span of a character range.

Spans come from character offsets, never from searching a value's own tokens: tokenizers merge digits
(Llama-3 cuts numbers into 3-digit chunks) and glue a leading space to the next word, so a value
tokenised alone need not appear verbatim among the tokens of the text that holds it.
"""

from __future__ import annotations


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def token_span(tokenizer, text: str, start: int, end: int) -> tuple[list[int], tuple[int, int]]:
    """Token ids of `text`, and the [first, last + 1) range of every token overlapping characters [start, end).

    Fast tokenizers report each token's character offsets; for the others they are measured by decoding.
    """
    if not 0 <= start < end <= len(text):
        raise ValueError(f"characters [{start}, {end}) are not a non-empty range of a text of {len(text)}")
    if getattr(tokenizer, "is_fast", False):
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
    else:
        ids = encode(tokenizer, text)
        offsets = decoded_offsets(tokenizer, ids, text)
    overlapping = [i for i, (a, b) in enumerate(offsets) if a < end and b > start]
    if not overlapping:
        raise ValueError(f"no token of {text!r} overlaps characters [{start}, {end})")
    return ids, (overlapping[0], overlapping[-1] + 1)


def decoded_offsets(tokenizer, ids: list[int], text: str) -> list[tuple[int, int]]:
    """[start, end) characters of each token of `text`, from the lengths of its decoded prefixes.

    Quadratic in len(ids): meant for short texts (a fact, a line). A decoder that drops characters at the
    start (SentencePiece's leading space) shifts every token by the same amount, so offsets are counted
    back from the end of the text.
    """
    ends = [len(tokenizer.decode(ids[: i + 1])) for i in range(len(ids))]
    shift = len(text) - ends[-1] if ends else 0
    return [(a + shift, b + shift) for a, b in zip([0, *ends[:-1]], ends)]
