"""Non-causal chunked attention (Chari & Van Durme 2025, arXiv 2507.08143, Compactor's attention half; its transformers
code is its author's NVIDIA kvpress press, NonCausalAttnPress, kvpress 0.5.5 presses/non_causal_attention_press.py):
the prompt is cut into chunks of `chunk_size` positions from the first; inside each chunk every query attends to every
key of the chunk, before and after it (no causal mask), and a key's score is the attention its chunk's queries pay it,
summed over them (:95-101), averaged over its KV head's query heads (:123), times ||v|| (:125), smoothed by a mean over
3 neighbours (avg_pool1d, zero padded, :126) and z-scored over the layer (:127). The logits are the raw q.k, with no
1/sqrt(d) scaling (:93), as in kvpress and the authors' compactor-vllm kernel (sm_scale=1.0,
vnchari/compactor-vllm@48d9f65 src/compactor_vllm/compression/compactor.py:48).

The last chunk, when shorter: kvpress pads queries and keys with zero vectors, gives the padded queries' logits 0 and
the padded keys' -1e-9 (:82-94), so the padded keys share each query's softmax (exp(-1e-9) ~ 1) and each padded query
adds ~1/chunk_size to every key of the chunk. mask_padding=False (the default) does the same; mask_padding=True keeps
the padding out of the softmax and the sums (the authors' compactor-vllm kernel, which stops at the chunk's end,
compactor.py:430-470): our variant, named in the label.

Where this differs from kvpress: the queries are AttentionCall's post-RoPE ones (kvpress re-projects the hidden states
and rotates them with the layer's cos and sin, :117-121: the same vectors); the call must hold a query for every cached
key, the whole prompt in one call (kvpress: prefill only, :113), else NotImplementedError; the z-score spans one
prompt's heads and positions, kvpress's its whole batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from ..core.checks import check_int
from .base import AttentionCall, Policy, whole_prompt
from .leverage import zscore

PADDED_KEY_LOGIT = -1e-9  # kvpress non_causal_attention_press.py:94: a padded key's logit, not -inf


@dataclass
class NonCausalAttn(Policy):
    """Keep the keys their chunk's queries attend to most, value-weighted (see module doc). score: (kv_heads, n_keys).
    No kept tail, as kvpress's ScorerPress: every position competes."""

    kept_tail: int = 0
    chunk_size: int = 256
    mask_padding: bool = False

    scores_query_heads: ClassVar[bool] = False

    def __post_init__(self):
        super().__post_init__()
        check_int("chunk_size", self.chunk_size, 1)

    def score(self, call: AttentionCall) -> torch.Tensor:
        whole_prompt(call, self.name)
        return value_weighted(call.value, chunked_attention(call.query, call.key, self.chunk_size, self.mask_padding))


def chunked_attention(query: torch.Tensor, key: torch.Tensor, chunk_size: int, mask_padding: bool) -> torch.Tensor:
    """query (heads, n, d), key (kv_heads, n, d) -> (kv_heads, n) float32: each key's attention from the queries of its
    chunk (non-causal, unscaled logits), summed over them, averaged over its KV head's query heads."""
    heads, n, d = query.shape
    kv_heads = key.shape[0]
    padded = math.ceil(n / chunk_size) * chunk_size
    q = F.pad(query, (0, 0, 0, padded - n)).view(heads, -1, chunk_size, d)
    k = F.pad(key, (0, 0, 0, padded - n)).repeat_interleave(heads // kv_heads, 0).view(heads, -1, chunk_size, d)
    logits = (q @ k.transpose(-2, -1)).float()  # (heads, chunks, chunk_size queries, chunk_size keys)
    pad = torch.arange(padded - chunk_size, padded, device=query.device) >= n  # the last chunk's padding
    last = logits[:, -1]
    if mask_padding:
        last.masked_fill_(pad[None, None, :], -math.inf)
        attention = torch.softmax(logits, dim=-1)
        attention[:, -1].masked_fill_(pad[None, :, None], 0.0)
    else:
        last.masked_fill_(pad[None, :, None], 0.0)
        last.masked_fill_(pad[None, None, :], PADDED_KEY_LOGIT)
        attention = torch.softmax(logits, dim=-1)
    received = attention.sum(dim=-2).reshape(heads, padded)[:, :n]
    return received.view(kv_heads, heads // kv_heads, n).mean(dim=1)


def value_weighted(value: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
    """value (kv_heads, n, d), attention (kv_heads, n) -> (kv_heads, n): attention * ||v||, smoothed over 3
    neighbours (zero padded), z-scored."""
    scores = attention * value.float().norm(dim=-1)
    return zscore(F.avg_pool1d(scores[None], kernel_size=3, stride=1, padding=1)[0])
