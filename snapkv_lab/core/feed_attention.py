"""The attention of tokens fed over a cache, computed in parts of its keys, with each part's log-sum-exp.

A feed of m tokens over a cache of n attends every cached key and its own keys causally. PyTorch's fused CPU kernel
(`aten._scaled_dot_product_flash_attention_for_cpu`, the one SDPA dispatches to on a CPU) also returns each query's
log-sum-exp of its scaled logits (natural log), so the attention over all the keys is the parts' outputs weighted by
exp(lse_part - lse_all), and the normaliser of a softmax restricted to some of the keys comes with it: KVzip's
scores need that one (policies.kvzip). Without an explicit mask the kernel neither builds nor reads an (m, n + m)
float mask, and a part without a causal edge reads each KV head's query heads as one matrix (its keys not repeated):
on SmolLM2 at 4k tokens, as fast as the backend's masked call (0.70 s against 0.75 s per layer, 2 CPU threads).

Equal to the backend's attention up to float rounding (the sums are added in another order), not bit for bit.
"""

from __future__ import annotations

import torch

from .attention import AttentionSettings


def by_parts_supported(query: torch.Tensor, settings: AttentionSettings) -> bool:
    """Whether `attention_by_parts` computes this call as the layer does: float32 on a CPU (the fused kernel's
    log-sum-exp, a private op: a torch without it takes the layer's own path), no logit soft-cap and no sliding
    window (the kernel applies neither)."""
    return (query.device.type == "cpu" and query.dtype == torch.float32 and settings.softcap is None
            and settings.sliding_window is None
            and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"))


def attention_by_parts(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, subset: torch.Tensor,
                       scaling: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(output (m, heads, head_dim), lse_subset (heads, m), lse_own (heads, m)) of a feed's attention.

    query: (heads, m, head_dim) the fed tokens', post-RoPE; key, value: (kv_heads, n + m, head_dim) the cache's n,
    then the fed tokens'; subset: (n,) bool, cache positions whose log-sum-exp is returned apart. Query head h reads
    KV head h // (heads // kv_heads), as transformers' `repeat_kv`. output: every fed token attends every cached key
    and the fed keys up to its own, softmax(q.k * scaling), in the query's dtype. lse_subset, lse_own (float32):
    log sum exp(q.k * scaling) of each query over the cache keys in `subset` (-inf when it is empty), and over the fed
    keys up to its own. Three kernel calls: the subset, the other cache keys, the fed keys (causal)."""
    heads, m, dim = query.shape
    kv_heads, n = key.shape[0], key.shape[1] - m
    if subset.shape != (n,) or subset.dtype != torch.bool:
        raise ValueError(f"subset must be a ({n},) bool tensor over the cache's positions, got {tuple(subset.shape)} "
                         f"{subset.dtype}")
    kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    # Without a mask the rows are independent: a KV head's query heads are one (group * m, d) matrix of queries.
    grouped = query.reshape(1, kv_heads, heads // kv_heads * m, dim)
    outputs, lses = [], []
    for keys in (subset, ~subset):
        if not keys.any():
            outputs.append(None)
            lses.append(torch.full((heads, m), -torch.inf, device=query.device))
            continue
        output, lse = kernel(grouped, key[None, :, :n][:, :, keys], value[None, :, :n][:, :, keys], scale=scaling)
        outputs.append(output.reshape(heads, m, dim))
        lses.append(lse.reshape(heads, m))
    group = heads // kv_heads
    own_keys, own_values = (t[:, n:].repeat_interleave(group, dim=0)[None] for t in (key, value))
    output, lse = kernel(query[None], own_keys, own_values, is_causal=True, scale=scaling)
    outputs.append(output[0])
    lses.append(lse[0])
    total = torch.stack(lses).logsumexp(0)  # (heads, m): over every key a query sees
    merged = sum(part * (lse - total).exp()[..., None] for part, lse in zip(outputs, lses, strict=True)
                 if part is not None)
    return merged.transpose(0, 1).to(query.dtype), lses[0], lses[2]
