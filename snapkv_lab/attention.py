"""Exact causal softmax attention, computed in row blocks so that no (queries x keys) map is ever whole.

Every function takes post-RoPE queries and keys of one sequence:
    query: (heads, n_queries, head_dim)      key: (kv_heads, n_keys, head_dim)
    query_positions: (n_queries,) absolute positions; query row i sees keys 0..query_positions[i].
Query head h reads KV head h // (heads_total // kv_heads), as transformers' `repeat_kv` does; when
only some query heads are passed, `kv_index` names the KV head of each.

Probabilities are the model's: softmax in float32 of q.k * scaling over all causal keys, so a block
of columns is still normalised over the whole row. This matches transformers' eager attention.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from einops import rearrange

# One block of probabilities holds at most this many float32 numbers (64 MiB).
BLOCK_ELEMENTS = 1 << 24


def _logits(query: torch.Tensor, key: torch.Tensor, kv_index: torch.Tensor | None) -> torch.Tensor:
    """q.k for (heads, rows, d) queries and (kv_heads, keys, d) keys -> (heads, rows, keys) float32.

    With kv_index None the heads are all of the model's, in order: a grouped einsum then reads each KV
    head in place instead of copying it once per query head.
    """
    query = query.float()
    if kv_index is not None:
        return torch.einsum("hqd,hkd->hqk", query, key.index_select(0, kv_index.to(key.device)).float())
    if query.shape[0] % key.shape[0]:
        raise ValueError(f"{query.shape[0]} query heads cannot share {key.shape[0]} KV heads evenly; pass kv_index")
    grouped = rearrange(query, "(kv g) q d -> kv g q d", kv=key.shape[0])
    return rearrange(torch.einsum("vgqd,vkd->vgqk", grouped, key.float()), "kv g q k -> (kv g) q k")


def attention_row_blocks(
    query: torch.Tensor,
    key: torch.Tensor,
    scaling: float,
    query_positions: torch.Tensor,
    *,
    kv_index: torch.Tensor | None = None,
    block_elements: int = BLOCK_ELEMENTS,
) -> Iterator[tuple[slice, torch.Tensor]]:
    """Yield (rows, probs) with probs (heads, len(rows), n_keys_needed) float32, for consecutive row blocks.

    n_keys_needed is 1 + the largest query position of the block: later keys are masked anyway.
    """
    heads, n_queries, _ = query.shape
    query_positions = torch.as_tensor(query_positions, device=query.device)
    if query_positions.shape != (n_queries,):
        raise ValueError(f"query_positions must have shape ({n_queries},), got {tuple(query_positions.shape)}")
    if n_queries and int(query_positions.max()) >= key.shape[1]:
        raise ValueError(f"a query at position {int(query_positions.max())} needs more than the {key.shape[1]} keys given")
    rows_per_block = max(1, block_elements // max(1, heads * key.shape[1]))
    for start in range(0, n_queries, rows_per_block):
        rows = slice(start, min(start + rows_per_block, n_queries))
        positions = query_positions[rows]
        width = int(positions.max()) + 1
        logits = _logits(query[:, rows], key[:, :width], kv_index) * scaling
        future = torch.arange(width, device=logits.device)[None, :] > positions[:, None]
        logits.masked_fill_(future, float("-inf"))
        yield rows, torch.softmax(logits, dim=-1)


def attention_probs(query, key, scaling, query_positions, *, key_index=None, kv_index=None,
                    block_elements: int = BLOCK_ELEMENTS) -> torch.Tensor:
    """Softmax attention (heads, n_queries, n_selected_keys) float32; key_index selects columns (default all)."""
    n_keys = key.shape[1]
    columns = torch.arange(n_keys) if key_index is None else torch.as_tensor(key_index).reshape(-1)
    out = torch.zeros(query.shape[0], query.shape[1], columns.numel(), dtype=torch.float32, device=query.device)
    columns = columns.to(query.device)
    for rows, probs in attention_row_blocks(query, key, scaling, query_positions, kv_index=kv_index, block_elements=block_elements):
        visible = columns < probs.shape[-1]
        out[:, rows, visible] = probs.index_select(-1, columns[visible])
    return out


def attention_column_sums(query, key, scaling, query_positions, *, kv_index=None,
                          block_elements: int = BLOCK_ELEMENTS) -> torch.Tensor:
    """Sum over the query rows of their attention, (heads, n_keys) float32: the SnapKV vote before pooling."""
    out = torch.zeros(query.shape[0], key.shape[1], dtype=torch.float32, device=query.device)
    for _, probs in attention_row_blocks(query, key, scaling, query_positions, kv_index=kv_index, block_elements=block_elements):
        out[:, : probs.shape[-1]] += probs.sum(dim=1)
    return out


def attention_row_topk(query, key, scaling, query_positions, k: int, *, kv_index=None,
                       block_elements: int = BLOCK_ELEMENTS):
    """The k largest probabilities of every row and their key positions, each (heads, n_queries, k).

    Rows that see fewer than k keys are padded with probability 0 and position -1.
    """
    heads, n_queries, _ = query.shape
    values = torch.zeros(heads, n_queries, k, dtype=torch.float32, device=query.device)
    indices = torch.full((heads, n_queries, k), -1, dtype=torch.long, device=query.device)
    positions = torch.as_tensor(query_positions, device=query.device)
    for rows, probs in attention_row_blocks(query, key, scaling, positions, kv_index=kv_index, block_elements=block_elements):
        top = torch.topk(probs, min(k, probs.shape[-1]), dim=-1)
        visible = top.indices <= positions[rows, None]
        values[:, rows, : top.values.shape[-1]] = top.values * visible
        indices[:, rows, : top.indices.shape[-1]] = torch.where(visible, top.indices, -1)
    return values, indices
