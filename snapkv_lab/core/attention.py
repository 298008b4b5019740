"""Exact causal softmax attention, computed in row blocks so that no (queries x keys) map is ever whole.

Every function takes post-RoPE queries and keys of one sequence:
    query: (heads, n_queries, head_dim)      key: (kv_heads, n_keys, head_dim)
    query_positions: (n_queries,) absolute positions; query row i sees keys 0..query_positions[i].
Query head h reads KV head h // (heads_total // kv_heads), as transformers' `repeat_kv` does; when
only some query heads are passed, `kv_index` names the KV head of each.

Probabilities are the model's: softmax in float32 of q.k * scaling over the keys a row sees, so a
block of columns is still normalised over the whole row. This matches transformers' eager attention:
- `sliding_window` w: row at position p sees keys p - w < k <= p (transformers' sliding-window mask);
- `softcap` c: logits become c * tanh(logits / c) before the softmax (Gemma 2's attention soft-capping).
Keys a row cannot see get probability 0.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch
from einops import rearrange


@dataclass(frozen=True)
class AttentionSettings:
    """What one layer's attention computes besides q.k: its scale, sliding window and logit soft-cap."""

    scaling: float
    sliding_window: int | None = None
    softcap: float | None = None

    @classmethod
    def of_call(cls, module, kwargs: dict) -> "AttentionSettings":
        """The settings a transformers layer passes to its attention function (`kwargs` of that call)."""
        window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
        return cls(scaling=float(kwargs.get("scaling") or module.scaling),
                   sliding_window=int(window) if window else None, softcap=float(softcap) if softcap else None)

    def options(self) -> dict:
        """Keyword arguments of the functions below (all but scaling)."""
        return {k: v for k, v in asdict(self).items() if k != "scaling"}


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
    sliding_window: int | None = None,
    softcap: float | None = None,
    block_elements: int = BLOCK_ELEMENTS,
) -> Iterator[tuple[slice, int, torch.Tensor]]:
    """Yield (rows, first_key, probs) for consecutive row blocks; probs (heads, len(rows), width) float32
    holds the keys first_key .. first_key + width - 1: the only keys the block's rows can see.

    query_positions: (n_queries,) on any device; a CPU tensor (or list) spares a GPU a host sync per block.
    """
    heads, n_queries, _ = query.shape
    # Block bounds are Python ints: read them from a CPU copy so that the GPU is never waited for here.
    host_positions = torch.as_tensor(query_positions).cpu().long()
    device_positions = host_positions.to(query.device)
    if host_positions.shape != (n_queries,):
        raise ValueError(f"query_positions must have shape ({n_queries},), got {tuple(host_positions.shape)}")
    if n_queries and int(host_positions.max()) >= key.shape[1]:
        raise ValueError(f"a query at position {int(host_positions.max())} needs more than the "
                         f"{key.shape[1]} keys given")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window}")
    span = key.shape[1] if sliding_window is None else min(key.shape[1], sliding_window + 1)
    rows_per_block = max(1, block_elements // max(1, heads * span))
    for start in range(0, n_queries, rows_per_block):
        rows = slice(start, min(start + rows_per_block, n_queries))
        last = int(host_positions[rows].max()) + 1
        first = 0 if sliding_window is None else max(0, int(host_positions[rows].min()) - sliding_window + 1)
        sees_all = (int(host_positions[rows].min()) + 1 == last
                    and (sliding_window is None or last - first <= sliding_window))
        logits = attention_logits(query[:, rows], key, scaling, device_positions[rows], first=first, last=last,
                                  kv_index=kv_index, sliding_window=sliding_window, softcap=softcap, sees_all=sees_all)
        yield rows, first, torch.softmax(logits, dim=-1)


def attention_logits(query, key, scaling, query_positions, *, first: int = 0, last: int | None = None,
                     kv_index=None, sliding_window: int | None = None, softcap: float | None = None,
                     sees_all: bool = False) -> torch.Tensor:
    """The logits softmax reads, (heads, n_queries, last - first) float32, for keys first..last-1: q.k * scaling,
    soft-capped, and -inf where a row cannot see the key (causal or sliding-window mask); sees_all: the caller knows
    every row sees every one of these keys (no mask to build).

    query_positions: (n_queries,) on the query's device. A row's probabilities over these keys are
    exp(logits - logsumexp of its whole row).
    """
    last = key.shape[1] if last is None else last
    logits = _logits(query, key[:, first:last], kv_index) * scaling
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    if sees_all:  # every row sees every key from first to last (a decode step's query): nothing to mask
        return logits
    columns = torch.arange(first, last, device=logits.device)[None, :]
    positions = torch.as_tensor(query_positions, device=logits.device)
    hidden = columns > positions[:, None]
    if sliding_window is not None:
        hidden |= columns <= positions[:, None] - sliding_window
    return logits.masked_fill_(hidden, float("-inf"))


def attention_probs(query, key, scaling, query_positions, *, key_index=None, **options) -> torch.Tensor:
    """Softmax attention (heads, n_queries, n_selected_keys) float32; key_index selects columns (default all).

    options: kv_index, sliding_window, softcap, block_elements (see attention_row_blocks).
    """
    n_keys = key.shape[1]
    columns = torch.arange(n_keys) if key_index is None else torch.as_tensor(key_index).reshape(-1).cpu()
    out = torch.zeros(query.shape[0], query.shape[1], columns.numel(), dtype=torch.float32, device=query.device)
    # A run of consecutive keys (all keys, a slice) is copied as a slice, not gathered column by column.
    run = columns.numel() > 0 and bool((columns.diff() == 1).all())
    low = int(columns[0]) if run else 0
    columns = columns.to(query.device)
    for rows, first, probs in attention_row_blocks(query, key, scaling, query_positions, **options):
        if run:
            start, stop = max(first, low), min(first + probs.shape[-1], low + out.shape[-1])
            if start < stop:
                out[:, rows, start - low:stop - low] = probs[..., start - first:stop - first]
            continue
        inside = (columns >= first) & (columns < first + probs.shape[-1])
        out[:, rows, inside] = probs.index_select(-1, columns[inside] - first)
    return out


def attention_column_sums(query, key, scaling, query_positions, **options) -> torch.Tensor:
    """Sum over the query rows of their attention, (heads, n_keys) float32: the SnapKV vote before pooling."""
    return _column_reduce(query, key, scaling, query_positions, "sum", **options)


def attention_column_max(query, key, scaling, query_positions, **options) -> torch.Tensor:
    """Largest attention any query row pays each key, (heads, n_keys) float32 (KVzip's score)."""
    return _column_reduce(query, key, scaling, query_positions, "max", **options)


def _column_reduce(query, key, scaling, query_positions, how: str, **options) -> torch.Tensor:
    out = torch.zeros(query.shape[0], key.shape[1], dtype=torch.float32, device=query.device)
    for _, first, probs in attention_row_blocks(query, key, scaling, query_positions, **options):
        columns = out[:, first: first + probs.shape[-1]]
        if how == "sum":
            columns += probs.sum(dim=1)
        else:
            columns.copy_(torch.maximum(columns, probs.amax(dim=1)))
    return out


def attention_row_topk(query, key, scaling, query_positions, k: int, **options):
    """The k largest probabilities of every row and their key positions, each (heads, n_queries, k).

    Rows that see fewer than k keys are padded with probability 0 and position -1.
    """
    heads, n_queries, _ = query.shape
    values = torch.zeros(heads, n_queries, k, dtype=torch.float32, device=query.device)
    indices = torch.full((heads, n_queries, k), -1, dtype=torch.long, device=query.device)
    positions = torch.as_tensor(query_positions).to(query.device)
    window = options.get("sliding_window")
    for rows, first, probs in attention_row_blocks(query, key, scaling, query_positions, **options):
        top = torch.topk(probs, min(k, probs.shape[-1]), dim=-1)
        keys, row_positions = top.indices + first, positions[rows, None]
        seen = (keys <= row_positions) & (keys > row_positions - window if window is not None else True)
        values[:, rows, : top.values.shape[-1]] = top.values * seen
        indices[:, rows, : top.indices.shape[-1]] = torch.where(seen, keys, -1)
    return values, indices
