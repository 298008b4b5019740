"""CriticalKV (Feng et al. 2025, arXiv 2502.03805, "Identify Critical KV Cache in LLM Inference from an Output
Perturbation Perspective"): attention alone misses how much a kept value moves the output; its image
through the output projection, ||W_o v||_1, weighs it in."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..selection import votes_per_kv_head
from .base import AttentionCall, with_window
from .wrapper import Wrapper


def output_norms(call: AttentionCall) -> torch.Tensor:
    """||v_j W_o^h||_1 for every query head h and key j: (heads, n_keys) float32, head h reading its KV head.

    W_o^h (head_dim, hidden) is head h's slice of the output projection (Llama-style `module.o_proj`, whose
    weight is (hidden, heads * head_dim)); its bias is the same for every token and left out.
    """
    o_proj = getattr(call.module, "o_proj", None)
    if o_proj is None or getattr(o_proj, "weight", None) is None:
        raise TypeError(f"CriticalKV weighs values by the output projection `o_proj`, which "
                        f"{type(call.module).__name__} does not have (Llama-style attention modules only)")
    heads, kv_heads, head_dim = call.query.shape[0], call.value.shape[0], call.value.shape[-1]
    weight = o_proj.weight  # (hidden, heads * head_dim)
    if weight.shape[1] != heads * head_dim:
        raise TypeError(f"o_proj of {type(call.module).__name__} takes {weight.shape[1]} inputs, not heads x head_dim "
                        f"= {heads} x {head_dim}")
    per_head = weight.T.reshape(heads, head_dim, -1)  # (heads, head_dim, hidden)
    group = heads // kv_heads
    # One head at a time: the projected values (n_keys, hidden) of all heads at once could outgrow the cache itself.
    return torch.stack([(call.value[h // group].float() @ per_head[h].float()).abs().sum(dim=-1)
                        for h in range(heads)])


@dataclass
class CriticalKV(Wrapper):
    """Two-stage selection on an inner policy's scores s (pooled and GQA-reduced as the inner policy ranks):
    stage 1 keeps the floor(first_stage_ratio * k) prefix positions of highest s; stage 2 fills the rest of
    the k = budget - window_size by (s + epsilon) * ||W_o v||_1 (the norm averaged over each KV head's query
    heads, as kvpress's CriticalKVPress does).

    score: (2 * rows, n_keys): the inner scores (rows = heads or kv_heads) stacked on the value norms of those
    rows; `keep` needs both, and the split between stages depends on the budget, known only there.
    Difference from kvpress: kvpress counts SnapKV's window in the stage-1 budget (its window scores are
    forced to the maximum); here stage 1 takes its share of the prefix budget k, the window kept on top.
    """

    first_stage_ratio: float = 0.5
    epsilon: float = 1e-4

    def __post_init__(self):
        super().__post_init__()
        if not 0 <= self.first_stage_ratio <= 1:
            raise ValueError(f"first_stage_ratio must lie in [0, 1], got {self.first_stage_ratio}")

    def score(self, call: AttentionCall):
        scores = self.policy.score(call)  # (rows, n_keys)
        norms = output_norms(call)  # (heads, n_keys)
        if norms.shape[0] != scores.shape[0]:  # the inner policy scores KV heads (KNorm): so do the norms
            norms = votes_per_kv_head(norms, scores.shape[0])
        if self.accumulates:
            # The recorder adds up the scores of successive prompt chunks: give each key's norm only in the call
            # that brought the key in, so the sum holds it once.
            norms[:, : int(call.positions[0])] = 0
        return torch.cat([scores, norms.to(scores)])

    def keep(self, scores: torch.Tensor, n_tokens: int, kv_heads: int, layer: int, n_layers: int) -> torch.Tensor:
        inner, norms = scores.chunk(2)
        prefix_len = n_tokens - self.window_size
        first = self.ranked(inner, prefix_len, kv_heads)  # (rows, prefix_len)
        norms = norms[:, :prefix_len]
        if norms.shape[0] != first.shape[0]:
            norms = votes_per_kv_head(norms, first.shape[0])
        k = self.layer_budget(n_tokens, layer, n_layers) - self.window_size
        stage1 = first.topk(math.floor(k * self.first_stage_ratio), dim=-1).indices
        second = ((first + self.epsilon) * norms).scatter(-1, stage1, math.inf)  # stage-1 picks stay on top
        picked = second.topk(k, dim=-1).indices.sort(dim=-1).values
        return with_window(picked, prefix_len, n_tokens)
