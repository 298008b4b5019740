"""Oracles written plainly from transformers' eager attention (`output_attentions=True`), shared by the tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from conftest import eager_twin


def eager_attentions(model, ids) -> tuple[torch.Tensor, ...]:
    """Per layer (batch, heads, n, n) from the model's eager twin over ids (batch, n)."""
    with torch.no_grad():
        return eager_twin(model)(ids, output_attentions=True).attentions


def eager_maps(model, token_ids) -> list[torch.Tensor]:
    """Per layer (heads, n, n) from transformers' eager attention over one sequence (n,)."""
    return [a[0] for a in eager_attentions(model, token_ids[None])]


def kv_heads(config) -> int:
    """KV heads per layer; families without GQA (GPT-2, GPT-NeoX) have one per query head."""
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def top_with_tail(scores, k, n):
    """(..., prefix) scores -> (..., k + tail) the top-k prefix positions sorted, then the kept tail."""
    top = scores.topk(k, dim=-1).indices.sort(dim=-1).values
    return torch.cat([top, torch.arange(scores.shape[-1], n).expand(*top.shape[:-1], -1)], dim=-1)


def reference_kept(model, ids, window, capacity, *, pooling, kernel, per_query_head=False, gqa="mean"):
    """SnapKV written plainly from transformers' eager attention maps: (layers, batch, heads, capacity)
    kept positions, plus the scores they were chosen from (to tell ties apart)."""
    n = ids.shape[1]
    prefix = n - window
    kept, scores = [], []
    for attn in eager_attentions(model, ids):
        votes = attn[:, :, -window:, :prefix].sum(dim=2)  # (batch, heads, prefix)
        if pooling == "max":
            votes = F.max_pool1d(votes, kernel, stride=1, padding=kernel // 2)
        if pooling == "avg":
            votes = F.avg_pool1d(votes, kernel, stride=1, padding=kernel // 2)
        if not per_query_head:  # mean (or max) over the query heads of each KV head's group
            grouped = votes.reshape(votes.shape[0], kv_heads(model.config), -1, prefix)
            votes = grouped.mean(dim=2) if gqa == "mean" else grouped.amax(dim=2)
        kept.append(top_with_tail(votes, capacity - window, n))
        scores.append(votes)
    return kept, scores


def assert_same_selection(kept, ref_kept, ref_scores, window, layers=None):
    """Equal kept sets, except that positions tied in score (within 1e-5) at the top-k boundary may swap.
    layers: the model layer index of each entry, for messages (default 0, 1, ...)."""
    layers = range(len(kept)) if layers is None else layers
    for layer, mine, ref, score in zip(layers, kept, ref_kept, ref_scores, strict=True):
        assert mine.shape == ref.shape, layer
        picked = mine.shape[-1] - window  # the positions chosen by score, before the window
        assert torch.equal(mine[..., picked:], ref[..., picked:])
        mine_scores = score.gather(-1, mine[..., :picked]).sort(dim=-1).values
        ref_top = score.gather(-1, ref[..., :picked]).sort(dim=-1).values
        torch.testing.assert_close(mine_scores, ref_top, atol=1e-5, rtol=0)
        agree = (mine == ref).float().mean()
        assert agree > 0.95, f"layer {layer}: only {agree:.0%} of kept positions agree"


def official_capacities(scores: list[list[float]], base_capacity: int, window: int, beta: float, temp: float):
    """HeadKV's prefix capacities per (layer, query head), FYYFU/HeadKV at 0862a09, headkv/snapkv_utils.py,
    ReasonSnapKVCluster.__init__ (lines 343-389), line by line: scores normalised, raised to temp, normalised; a pool of
    (b // beta) per head shared by them; each head gets round(share * pool + b - b // beta)."""
    b = base_capacity - window
    flat = [s for layer in scores for s in layer]
    total = sum(flat)
    shares = [(s / total) ** temp for s in flat]
    shares = [s / sum(shares) for s in shares]
    pool = (b // beta) * len(flat)
    floor = b - b // beta
    caps = [round(s * pool + floor) for s in shares]  # torch.round: half to even, as Python's round
    width = len(scores[0])
    return [caps[i:i + width] for i in range(0, len(caps), width)]
