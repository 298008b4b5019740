"""Feeding tokens over a cache and decoding greedily: the steps every answer is made of, and where it stops.

Positions are passed explicitly: a compressed cache is shorter than the tokens seen, so a position read off the
cache's length would be wrong. A padded batch's rows count their positions from their own first token.
"""

from __future__ import annotations

import torch

from ..core.hooks import with_cache
from ..core.inputs import extended_mask, padded_positions
from ..core.timing import stopwatch
from .footprint import Footprint


def eos_cut(tokens: list[int], eos) -> int:
    """The index of the first end-of-answer token of `tokens`, or len(tokens): the answer is tokens[:cut], and what
    was generated of it (the EOS included) tokens[:cut + 1]."""
    return next((i for i, token in enumerate(tokens) if token in eos), len(tokens))


def decode_text(tokenizer, token_ids: torch.Tensor, eos_ids) -> list[str]:
    """(batch, new) -> texts, each cut at its first EOS."""
    return [tokenizer.decode(row[:eos_cut(row, eos_ids)], skip_special_tokens=True).strip()
            for row in token_ids.tolist()]


def forward(model, ids: torch.Tensor, cache, start: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Feed ids (batch, n) at slots start.. over `cache`; the last position's logits (batch, vocab).
    logits_to_keep=1: the full-vocabulary logits of a long prompt would cost more memory than its KV cache.
    mask: a padded batch's (batch, m) padding mask of the slots before and among these (extended by ones to
    start + n): each row's positions count from its own first token, and the model masks the pads."""
    pads = None if mask is None else (mask == 0).sum(-1)
    positions = padded_positions(pads, start, ids.shape[1], model.device)
    padding = None if mask is None else extended_mask(mask, start + ids.shape[1]).to(model.device)
    return model(ids, **with_cache(model, cache), position_ids=positions, use_cache=True, logits_to_keep=1,
                 attention_mask=padding).logits[:, -1]


def pick(logits: torch.Tensor, step: int, eos_ids=(), min_new_tokens: int = 0) -> torch.Tensor:
    """The greedy token of logits (batch, vocab) at decode step `step` (0: the first new token): before
    min_new_tokens, the end tokens are never picked (transformers' min_length / min_new_tokens logits processor)."""
    if step < min_new_tokens and len(eos_ids):
        logits = logits.clone()
        logits[:, list(eos_ids)] = float("-inf")
    return logits.argmax(-1)


@torch.inference_mode()
def greedy_decode(model, cache, logits, start: int, max_new_tokens: int, eos_ids=(), stop=None,
                  mask: torch.Tensor | None = None, min_new_tokens: int = 0,
                  footprint: Footprint | None = None) -> tuple[torch.Tensor, list[float]]:
    """Greedy decoding from the last prompt logits (batch, vocab), positions counted from `start`.

    Run it inside `applied(model, state)` when the cache is compressed. stop(token_ids) -> bool ends early (e.g. once
    an answer is complete). mask: a padded batch's (batch, m) padding mask of the slots before `start` (each row's
    positions then count from its first token, and the mask, extended by ones, goes to the model so that it masks
    the pads of the layers the compressor leaves whole). min_new_tokens: no end token among the first ones (`pick`).
    footprint: records the entries and bytes the cache holds as each new token is predicted (footprint.Footprint).
    A batch decodes until every row has ended (`eos_cut` finds each row's end). Returns ((batch, new), step seconds).
    """
    pads = None if mask is None else (mask == 0).sum(-1)
    tokens, seconds = [], []
    done = torch.zeros(logits.shape[0], dtype=torch.bool)
    ends = torch.tensor(list(eos_ids), dtype=torch.long)
    next_token = pick(logits, 0, eos_ids, min_new_tokens)
    if footprint is not None:
        footprint.record(cache, pads)
    for step in range(max_new_tokens):
        tokens.append(next_token)
        done |= torch.isin(next_token.cpu(), ends)
        if bool(done.all()) or step == max_new_tokens - 1 or (stop is not None and stop(torch.stack(tokens, 1))):
            break
        with stopwatch(model.device) as elapsed:
            position = padded_positions(pads, start + step, 1, model.device).expand(logits.shape[0], 1)
            padding = None if mask is None else extended_mask(mask, start + step + 1)
            out = model(next_token[:, None], **with_cache(model, cache), position_ids=position, use_cache=True,
                        attention_mask=padding)
            next_token = pick(out.logits[:, -1], step + 1, eos_ids, min_new_tokens)
        seconds.append(elapsed.seconds)
        if footprint is not None:  # outside the stopwatch: counting is not the step's time
            footprint.record(cache, pads)
    return torch.stack(tokens, 1), seconds
