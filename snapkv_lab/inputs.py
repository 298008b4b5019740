"""Turning what a user passes as a prompt (text, chat messages, token ids) into input ids."""

from __future__ import annotations

import torch

from .framing import plain_prompt


def encode_prompt(tokenizer, prompt) -> torch.Tensor:
    """Prompt -> (1, n) input ids.

    str: tokenised as is (with the tokenizer's special tokens, e.g. BOS).
    list of {"role", "content"} dicts: the model's chat template, with the generation prompt appended; for a
    tokenizer without one (a base model), the turns as plain text with speaker labels (framing.plain_prompt).
    list of ints, or a 1-D / (1, n) tensor: used as given.
    """
    if isinstance(prompt, str):
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    elif isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, return_dict=True,
                                                return_tensors="pt")["input_ids"]
        else:  # the text holds BOS already
            ids = tokenizer(plain_prompt(tokenizer, list(prompt)), add_special_tokens=False, return_tensors="pt")["input_ids"]
    else:
        ids = torch.as_tensor(prompt, dtype=torch.long)
        if ids.ndim == 1:
            ids = ids[None]
    if ids.ndim != 2 or ids.shape[0] != 1:
        raise ValueError(
            f"expected one prompt, got input ids of shape {tuple(ids.shape)}; pass prompts one at a time "
            "(padded batches would put pad tokens inside the attention maps)."
        )
    if ids.shape[1] == 0:
        raise ValueError("the prompt is empty")
    return ids


def encode_continuation(tokenizer, continuation) -> torch.Tensor:
    """Teacher-forced continuation -> (n,) ids; text is tokenised without special tokens."""
    if isinstance(continuation, str):
        return torch.as_tensor(tokenizer(continuation, add_special_tokens=False)["input_ids"], dtype=torch.long)
    ids = torch.as_tensor(continuation, dtype=torch.long)
    if ids.ndim > 1 and ids.shape[0] != 1:
        raise ValueError(f"a continuation or question is one sequence of token ids, got shape {tuple(ids.shape)}; "
                         "pass several questions as a list")
    return ids.reshape(-1)


PADDING_REFUSED = (
    "padded batches are not supported by the compressor: pad tokens would vote and be kept, and the compressed cache "
    "would no longer line up with the padding mask. Pass prompts of equal length, or one at a time."
)


def refuse_pad_tokens(tokenizer, ids: torch.Tensor) -> None:
    """Raise if ids (batch, n) hold the tokenizer's pad token, by the rule model.generate infers a padding mask with
    (transformers' _prepare_attention_mask_for_generation: a pad token that is not also the EOS token)."""
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is not None and pad != getattr(tokenizer, "eos_token_id", None) and bool((ids == pad).any()):
        raise NotImplementedError(f"the prompt ids hold the pad token ({pad}): {PADDING_REFUSED}")


def encode_batch(tokenizer, prompt) -> torch.Tensor:
    """One prompt (see encode_prompt), a (batch, n) tensor, or a list of prompts of equal length -> (batch, n).
    Ids holding the pad token (a padded batch) are refused, as model.generate under `compress` refuses them."""
    if isinstance(prompt, torch.Tensor) and prompt.ndim == 2:
        refuse_pad_tokens(tokenizer, prompt)
        return prompt.long()
    is_batch = isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], (str, list, tuple, torch.Tensor))
    if not is_batch:
        return encode_prompt(tokenizer, prompt)
    rows = [encode_prompt(tokenizer, p) for p in prompt]
    lengths = sorted({r.shape[1] for r in rows})
    if len(lengths) > 1:
        raise NotImplementedError(
            f"prompts of different lengths {lengths}: left-padded batches are not supported by the compressor (pad "
            "tokens would be voted on and kept). Pass prompts of equal length, or one at a time."
        )
    return torch.cat(rows)


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
            f"(config.max_position_embeddings). Use a shorter prompt or fewer new tokens, or a model with a longer context."
        )
