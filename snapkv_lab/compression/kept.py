"""What a compressed cache holds, as a mask over prompt positions: the one answer to "what did this policy keep".

A selection is stored as token positions per layer (`kept_indices`: (batch, rows, k), rows the KV heads or, in the
per-query-head layout, the query heads; NO_POSITION pads the rows of heads that keep fewer, and positions past the
prompt are generated tokens held while decoding). Every reader asks `kept_mask`: the token view (`ab`), coverage
and the explorer's kept strip (`coverage`), and the pressure tables' kept shares (`pressure`).
"""

from __future__ import annotations

import torch


def kept_mask(kept, n_tokens: int, batch: int = 0, *, whole_from: int | None = None) -> torch.Tensor:
    """(layers, rows, n_tokens) bool: which of the first n_tokens prompt positions each layer's head holds.

    kept: a GenerationResult, a CompressionState after its prefill, or kept_indices: one (batch, rows, k) integer
        tensor per layer, in layer order. Padding (negative) and positions >= n_tokens are not prompt.
    rows: the widest layer's. A layer with fewer rows (a sliding layer left whole beside per-query-head
        selections) gives each of its rows to the rows it serves (KV head h to query heads h*g .. h*g+g-1).
    whole_from: positions whole_from..n_tokens-1 are held by every head: the question appended in full after a
        query-agnostic compression of the first whole_from positions.
    """
    indices = getattr(kept, "kept_indices", kept)
    if isinstance(indices, dict):  # a CompressionState's, by layer
        indices = [indices[layer] for layer in sorted(indices)]
    indices = list(indices)
    if not indices:
        raise ValueError("no layer's kept positions to read")
    rows = max(layer.shape[1] for layer in indices)
    mask = torch.zeros(len(indices), rows, n_tokens + 1, dtype=torch.bool)
    for layer, positions in enumerate(indices):
        positions = positions[batch].cpu().repeat_interleave(rows // positions.shape[1], dim=0)
        mask[layer].scatter_(-1, torch.where((positions >= 0) & (positions < n_tokens), positions, n_tokens), True)
    if whole_from is not None:
        mask[..., whole_from:] = True
    return mask[..., :n_tokens]
