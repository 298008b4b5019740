"""Turning what a user passes as a prompt (text, chat messages, token ids) into input ids."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .framing import plain_prompt

_RAW_TEXT_NOTICED: set[str] = set()  # tokenizers already told that a str prompt skips their chat template


def encode_prompt(tokenizer, prompt) -> torch.Tensor:
    """Prompt -> (1, n) input ids.

    str: tokenised as is (with the tokenizer's special tokens, e.g. BOS), also for a chat model: text is text,
        as a trace of an essay needs it. A chat model's tokenizer gets a one-time notice (a UserWarning) saying
        so; pass [{"role": "user", "content": text}] for a chat turn.
    list of {"role", "content"} dicts: the model's chat template, with the generation prompt appended; for a
    tokenizer without one (a base model), the turns as plain text with speaker labels (framing.plain_prompt).
    list of ints, or a 1-D / (1, n) tensor: used as given.
    """
    if isinstance(prompt, str):
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        _notice_raw_text(tokenizer)
    elif isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, return_dict=True,
                                                return_tensors="pt")["input_ids"]
        else:  # the text holds BOS already
            ids = tokenizer(plain_prompt(tokenizer, list(prompt)), add_special_tokens=False,
                            return_tensors="pt")["input_ids"]
    else:
        ids = torch.as_tensor(prompt, dtype=torch.long)
        if ids.ndim == 1:
            ids = ids[None]
    if ids.ndim != 2 or ids.shape[0] != 1:
        raise ValueError(
            f"expected one prompt, got input ids of shape {tuple(ids.shape)}; pass a batch as a list of prompts "
            "or a (batch, n) tensor."
        )
    if ids.shape[1] == 0:
        raise ValueError("the prompt is empty")
    return ids


def _notice_raw_text(tokenizer) -> None:
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    if getattr(tokenizer, "chat_template", None) and name not in _RAW_TEXT_NOTICED:
        _RAW_TEXT_NOTICED.add(name)
        warnings.warn(f"a str prompt is tokenised as plain text, without {name}'s chat template; for a chat turn pass "
                      "[{'role': 'user', 'content': text}] (this notice shows once)", UserWarning, stacklevel=4)


def encode_continuation(tokenizer, continuation) -> torch.Tensor:
    """Teacher-forced continuation -> (n,) ids; text is tokenised without special tokens."""
    if isinstance(continuation, str):
        return torch.as_tensor(tokenizer(continuation, add_special_tokens=False)["input_ids"], dtype=torch.long)
    ids = torch.as_tensor(continuation, dtype=torch.long)
    if ids.ndim > 1 and ids.shape[0] != 1:
        raise ValueError(f"a continuation or question is one sequence of token ids, got shape {tuple(ids.shape)}; "
                         "pass several questions as a list")
    return ids.reshape(-1)


@dataclass
class Batch:
    """Prompts of a batch, left-padded to the longest.

    ids: (batch, n) token ids, pads first. mask: (batch, n) long, 0 on pads (what model.generate takes as
    attention_mask). pads: (batch,) long, each row's left pads; None when no row is padded (every path then runs
    exactly as for prompts of one length). A row's token at position p (its index in its own prompt, what RoPE
    rotates it by) sits at slot p + pads[b].
    """

    ids: torch.Tensor
    mask: torch.Tensor
    pads: torch.Tensor | None

    def to(self, device) -> Batch:
        return Batch(self.ids.to(device), self.mask.to(device), self.pads)

    @property
    def lengths(self) -> list[int]:
        """Each row's own prompt length."""
        n = self.ids.shape[1]
        return [n] * self.ids.shape[0] if self.pads is None else (n - self.pads).tolist()


def padded_positions(pads: torch.Tensor | None, start: int, count: int, device=None) -> torch.Tensor:
    """Position ids of slots start..start+count-1: (1, count) when unpadded, else (batch, count), each row's own
    positions (slot minus its pads; pads clamped to 0: they are masked, so what RoPE gives them is never seen)."""
    slots = torch.arange(start, start + count, device=device)[None]
    return slots if pads is None else (slots - pads.to(slots.device)[:, None]).clamp(min=0)


def extended_mask(mask: torch.Tensor, total: int) -> torch.Tensor:
    """The (batch, n) padding mask of a prompt, extended by ones to `total` slots (the tokens fed after it)."""
    return F.pad(mask, (0, total - mask.shape[1]), value=1)


def left_pads(attention_mask) -> torch.Tensor | None:
    """(batch,) the left pads of each row of a prefill call's mask (a 2-D padding mask, or a 4-D one: a pad row does
    not see itself, whereas any unpadded causal or sliding-window mask lets every token see itself); None when no row
    is padded. Padding elsewhere than on the left is refused."""
    if attention_mask is None or attention_mask.ndim not in (2, 4):
        return None
    if attention_mask.ndim == 2:
        hidden = ~attention_mask.bool()
    else:
        offset = attention_mask.shape[-1] - attention_mask.shape[-2]
        diagonal = attention_mask[:, 0].diagonal(offset, dim1=-2, dim2=-1)  # (batch, rows)
        hidden = ~diagonal if diagonal.dtype == torch.bool else diagonal != 0
    pads = hidden.sum(-1).cpu()
    if not bool(pads.any()):
        return None
    if not torch.equal(hidden.cpu(), torch.arange(hidden.shape[-1]) < pads[:, None]):
        raise NotImplementedError(PADDING_REFUSED)
    return pads


PADDING_REFUSED = (
    "only left padding is supported by the compressor (each row's pads first, then its prompt, as "
    "snapkv_lab.generate pads a batch of prompts of different lengths): pads elsewhere would sit between a row's "
    "tokens."
)


def pad_id(tokenizer) -> int:
    """The token that fills pads: the tokenizer's pad token, else its EOS, else 0 (pads are masked: any id does)."""
    for pad in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if pad is not None:
            return pad
    return 0


def tensor_batch(tokenizer, ids: torch.Tensor) -> Batch:
    """A (batch, n) tensor as a Batch: rows holding the tokenizer's pad token (by the rule model.generate infers a
    padding mask with, transformers' _prepare_attention_mask_for_generation: a pad token that is not also the EOS
    token) are padded; they must be padded on the left."""
    ids = ids.long()
    pad = getattr(tokenizer, "pad_token_id", None)
    mask = torch.ones_like(ids)
    if pad is not None and pad != getattr(tokenizer, "eos_token_id", None):
        mask = (ids != pad).long()
    pads = left_pads(mask)
    if pads is not None and bool((pads == ids.shape[1]).any()):
        raise ValueError("a row of the batch holds only pad tokens")
    return Batch(ids, mask, pads)


def encode_batch(tokenizer, prompt) -> Batch:
    """One prompt (see encode_prompt), a (batch, n) tensor (left-padded with the tokenizer's pad token, or not
    padded), or a list of prompts -> a Batch, left-padded to the longest prompt."""
    if isinstance(prompt, torch.Tensor) and prompt.ndim == 2:
        return tensor_batch(tokenizer, prompt)
    is_batch = isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], (str, list, tuple, torch.Tensor))
    rows = [encode_prompt(tokenizer, p) for p in prompt] if is_batch else [encode_prompt(tokenizer, prompt)]
    n = max(r.shape[1] for r in rows)
    ids = torch.cat([F.pad(r, (n - r.shape[1], 0), value=pad_id(tokenizer)) for r in rows])
    mask = torch.cat([F.pad(torch.ones_like(r), (n - r.shape[1], 0)) for r in rows])
    return Batch(ids, mask, left_pads(mask))


def eos_ids(model, tokenizer) -> tuple[int, ...]:
    """Every token id that ends a greedy answer: the generation config's (one or several) and the tokenizer's."""
    config = model.generation_config.eos_token_id if model.generation_config is not None else None
    config = config if isinstance(config, (list, tuple)) else [config]
    return tuple(dict.fromkeys(i for i in [*config, tokenizer.eos_token_id] if i is not None))


def check_context_length(model_or_config, n_tokens: int, what: str = "prompt") -> None:
    """Raise ValueError if a run would use more positions than the model was trained for.

    model_or_config: a model (its `.config` is read) or a config. n_tokens: positions the run uses (the
    prompt, plus the new tokens when it generates). The limit is `max_position_embeddings` of the (text)
    config; a config without one is not checked. Called before any model run, because past that limit
    rotary models do not fail: they return fluent garbage.
    """
    config = getattr(model_or_config, "config", model_or_config)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and n_tokens > limit:
        name = getattr(config, "name_or_path", "") or type(config).__name__
        raise ValueError(
            f"{what} needs {n_tokens} positions, but {name} handles at most {limit} "
            f"(config.max_position_embeddings). Use a shorter prompt or fewer new tokens, "
            f"or a model with a longer context."
        )
