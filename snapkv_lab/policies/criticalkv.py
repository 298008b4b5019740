"""CriticalKV (Feng et al. 2025, arXiv 2502.03805, "Identify Critical KV Cache in LLM Inference from an Output
Perturbation Perspective"): attention alone misses how much a kept value moves the output; its image
through the output projection, ||W_o v||_1, weighs it in."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..core.hooks import attention_modules
from ..core.selection import votes_per_kv_head
from .base import AttentionCall, LayerBudget, Prompt, prefix_share
from .wrapper import Wrapper, policy_chain


def output_norms(module, value: torch.Tensor, heads: int) -> torch.Tensor:
    """||v_j W_o^h||_1 for every query head h and key j: (heads, n_keys) float32, head h reading its KV head.

    value: (kv_heads, n_keys, head_dim). W_o^h (head_dim, hidden) is head h's slice of the output projection
    (Llama-style `module.o_proj`, whose weight is (hidden, heads * head_dim)); its bias is the same for every token
    and left out.
    """
    o_proj = getattr(module, "o_proj", None)
    if o_proj is None or getattr(o_proj, "weight", None) is None:
        raise TypeError(f"CriticalKV weighs values by the output projection `o_proj`, which "
                        f"{type(module).__name__} does not have (Llama-style attention modules only)")
    kv_heads, head_dim = value.shape[0], value.shape[-1]
    weight = o_proj.weight  # (hidden, heads * head_dim)
    if weight.shape[1] != heads * head_dim:
        raise TypeError(f"o_proj of {type(module).__name__} takes {weight.shape[1]} inputs, not heads x head_dim "
                        f"= {heads} x {head_dim}")
    per_head = weight.T.reshape(heads, head_dim, -1)  # (heads, head_dim, hidden)
    group = heads // kv_heads
    # One head at a time: the projected values (n_keys, hidden) of all heads at once could outgrow the cache itself.
    return torch.stack([(value[h // group].float() @ per_head[h].float()).abs().sum(dim=-1) for h in range(heads)])


@dataclass
class CriticalKV(Wrapper):
    """Two-stage selection on an inner policy's scores s (pooled and GQA-reduced as the inner policy ranks), as the
    authors' code (FFY0/AdaKV-in-NVIDIA-kvpress, branch criticalkv; identical in kvpress 0.5.5,
    presses/criticalkv_press.py, CriticalKVPress.score, lines 75-98): of a head's budget B (the kept tail included),
    stage 1 keeps the int(first_stage_ratio * B) highest s, the tail first (kvpress's inner scores give the tail
    the maximum); stage 2 fills the rest of B by (s + epsilon) * ||W_o v||_1 (the norm averaged over each KV head's
    query heads). Over AdaKV (CriticalKV(policy=AdaKV(...)), kvpress's CriticalAdaKV) B is each head's own budget.

    score: (2 * rows, n_keys): the inner scores (rows = heads or kv_heads) stacked on the value norms of those
    rows; `ranked` needs both, and the split between stages depends on the budget, known only there.
    """

    first_stage_ratio: float = 0.5
    epsilon: float = 1e-4

    def __post_init__(self):
        super().__post_init__()
        if not 0 <= self.first_stage_ratio <= 1:
            raise ValueError(f"first_stage_ratio must lie in [0, 1], got {self.first_stage_ratio}")
        if any(isinstance(inner, CriticalKV) for inner in policy_chain(self.policy)):
            raise TypeError("CriticalKV weighs the values once: it cannot wrap another CriticalKV")

    @property
    def scoring_key(self) -> str:
        return f"CriticalKV[{self.policy.scoring_key}]"  # its scores carry the value norms too

    def score(self, call: AttentionCall):
        scores = self.policy.score(call)  # (rows, n_keys)
        norms = self._norms(call.module, call.value, call.query.shape[0], scores.shape[0])
        if self.accumulates:
            # The recorder adds up the scores of successive prompt chunks: give each key's norm only in the call
            # that brought the key in, so the sum holds it once.
            norms[:, : int(call.slots[0])] = 0
        return torch.cat([scores, norms.to(scores)])

    def prompt_scores(self, prompt: Prompt) -> dict[int, torch.Tensor]:
        """The inner policy's scores made after the prefill {layer: (1, rows, n)}, each stacked on the value norms."""
        scores = self.policy.prompt_scores(prompt)
        modules, heads = attention_modules(prompt.model), prompt.model.config.num_attention_heads
        return {layer: torch.cat([inner, self._norms(modules[layer], prompt.cache.layers[layer].values[0], heads,
                                                     inner.shape[1]).to(inner)[None]], dim=1)
                for layer, inner in scores.items()}

    @staticmethod
    def _norms(module, value: torch.Tensor, heads: int, rows: int) -> torch.Tensor:
        """(rows, n_keys) value norms: per query head, or averaged over each KV head's query heads."""
        norms = output_norms(module, value, heads)
        return norms if rows == heads else votes_per_kv_head(norms, rows)

    def ranked(self, scores, budget: LayerBudget) -> torch.Tensor:
        """Stage-1 picks at +inf, the rest by (s + epsilon) * norm: (rows, prefix_len)."""
        inner, norms = scores.chunk(2)
        first = self.policy.ranked(inner, budget)  # (rows, prefix_len)
        norms = norms[:, : first.shape[-1]].float()
        if norms.shape[0] != first.shape[0]:
            norms = votes_per_kv_head(norms, first.shape[0])
        budgets = self.policy.head_budgets(inner, budget)  # prefix budgets, the kept tail apart
        tail = budget.tokens - first.shape[-1]
        second = (first + self.epsilon) * norms
        for row, row_budget in enumerate(budgets):  # each head's stage 1: a share of its whole budget, the tail first
            stage1 = first[row].topk(prefix_share(self.first_stage_ratio, row_budget, tail)).indices
            second[row, stage1] = math.inf
        return second

    def head_budgets(self, scores, budget: LayerBudget):
        return self.policy.head_budgets(scores.chunk(2)[0], budget)
