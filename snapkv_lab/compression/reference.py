"""Decoding over a compressed cache, the slow and plain way: the definition the fast path is tested against.

A policy keeps, per layer and head, a set of prompt positions. Decoding over that compressed cache means: every
later query of that head attends to the kept prompt positions and to every generated token, with the positions
(RoPE) they had, and to nothing else. So it equals decoding over the *full* cache with the evicted positions hidden
from that head:

    scores[h, q, k] = q_h . k_k * scaling  (+ the model's own mask: causal, sliding window)
    scores[h, q, k] = -inf  where k is a prompt position head h did not keep
    output[h, q]    = softmax(scores[h, q]) @ V

A policy that merges instead of evicting (`Policy.merge`: Merging) changes one more thing, the values: V is then the
full cache's with each head's kept prompt values replaced by the merged ones that `merge` gives for the kept set; one
that rewrites the keys it keeps (`Policy.rekey`: KeyRerotation's re-rotated keys), likewise the keys.

`masked_decode` computes exactly that, one eager attention call per layer with a per-head mask, on a full cache
that never shrinks. It is as slow as the full cache (slower: eager attention), and as plain as the equations; the
fast path (`compress`, `generate`: gathered or ragged keys, reserved room, sdpa) is checked to give the same tokens
(tests/test_reference_decoding.py), as nanoGPT keeps its slow attention beside the fused one.

Policies that evict while decoding (H2O, TOVA, DecodingEviction) change their kept sets at each step: a fixed mask
does not describe them, and they are refused. A policy whose heads roll a window (`Policy.decode_window`:
DuoAttention's streaming heads, those that kept less than the whole prompt) is described by one more rule: at the step
whose token sits at position t, such a head also stops seeing every position from `sinks` up to t - recent - 1.
"""

from __future__ import annotations

import torch
from torch.nn.utils.rnn import pad_sequence

from ..core.hooks import attention_modules, intercept_attention, model_eager_function, returned_cache, with_cache
from ..policies.base import NO_POSITION
from ..policies.decoding import EvictsWhileDecoding
from .kept import kept_mask


@torch.inference_mode()
def masked_decode(model, ids: torch.Tensor, kept, max_new_tokens: int) -> torch.Tensor:
    """Greedy tokens (1, max_new_tokens) of `model` after the prompt `ids` (1, n), each layer's heads seeing only
    the prompt positions `kept` holds (a GenerationResult, a CompressionState or kept_indices: see
    `kept.kept_mask`) and every generated token. No end-of-sequence stop: compare with an equally long run."""
    if ids.ndim != 2 or ids.shape[0] != 1:
        raise ValueError(f"one prompt (1, n) at a time, got ids of shape {tuple(ids.shape)}")
    policy = getattr(kept, "policy", None)
    if isinstance(policy, EvictsWhileDecoding) and policy.interval is not None:
        raise ValueError(f"{policy.label} changes its kept positions while decoding: no fixed mask describes it")
    n = ids.shape[1]
    hidden = ~kept_mask(kept, n).to(model.device)  # (layers, rows, n): prompt positions each head does not see
    window = None if policy is None else policy.decode_window(n)
    rolling = (~hidden).sum(-1) < n  # (layers, rows): the heads that kept less than the prompt

    def attend(function, module, query, key, value, attention_mask, **kwargs):
        heads, n_keys = query.shape[1], key.shape[2]
        if n_keys <= n:  # the prefill: the prompt is processed whole, as the paper's and every policy's is
            return function(module, query, key, value, attention_mask, **kwargs)
        evicted = hidden[module.layer_idx]
        evicted = torch.cat([evicted, evicted.new_zeros(evicted.shape[0], n_keys - n)], dim=-1)  # generated: seen
        if window is not None:  # this step's token is the last key, at position n_keys - 1
            sinks, recent = window
            position = torch.arange(n_keys, device=evicted.device)
            slid_out = (position >= sinks) & (position < n_keys - 1 - recent)
            evicted = evicted | (rolling[module.layer_idx][:, None] & slid_out)
        evicted = evicted.repeat_interleave(heads // evicted.shape[0], dim=0)[None, :, None]  # each query head's set
        own = attention_mask[..., :n_keys] if attention_mask is not None else None
        if own is not None and own.dtype == torch.bool:  # sdpa's mask (True: attend) as eager's additive one
            own = torch.zeros(own.shape, dtype=query.dtype,
                              device=query.device).masked_fill(~own, torch.finfo(query.dtype).min)
        blocked = torch.zeros(evicted.shape, dtype=query.dtype,
                              device=query.device).masked_fill(evicted, torch.finfo(query.dtype).min)
        mask = blocked if own is None else own + blocked
        return model_eager_function(module)(module, query, key, value, mask, **kwargs)

    with intercept_attention(model, None, attend=attend):
        out = model(ids, use_cache=True)
        cache, tokens = returned_cache(out), []
        if policy is not None:
            rewrite_kept(cache, policy, ~hidden, attention_modules(model))
        token = out.logits[:, -1].argmax(-1)
        for step in range(max_new_tokens):
            tokens.append(token)
            out = model(token[:, None], **with_cache(model, cache), use_cache=True,
                        position_ids=torch.tensor([[n + step]], device=model.device))
            token = out.logits[:, -1].argmax(-1)
    return torch.stack(tokens, 1)


def rewrite_kept(cache, policy, seen: torch.Tensor, modules: dict) -> None:
    """Replace, in place, the prompt values and keys of a full batch-1 `cache` by those `policy.merge` and
    `policy.rekey` make of each layer's kept set, seen (layers, kv_heads, n) bool: True where a head kept a position
    (modules: {layer: attention module}); nothing for a policy that rewrites neither."""
    for index, (layer, held) in enumerate(zip(cache.layers, seen, strict=True)):
        kept = pad_sequence([row.nonzero().flatten() for row in held], batch_first=True, padding_value=NO_POSITION)
        n = held.shape[-1]
        merged = policy.merge(layer.keys[0, :, :n], layer.values[0, :, :n], kept)
        rekeyed = policy.rekey(layer.keys[0, :, :n], kept, modules.get(index))
        if merged is not None:
            layer.values[0, :, :n] = merged
        if rekeyed is not None:
            layer.keys[0, :, :n] = rekeyed
