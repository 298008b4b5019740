"""DuoAttention (Xiao et al. 2024, arXiv 2410.10819): retrieval heads keep the whole context, streaming heads keep
attention sinks and recent tokens.

The paper learns a gate per (layer, KV head) by optimisation on synthetic passkey data; the official code
(mit-han-lab/duo-attention at 03dca84, duo_attn/utils.py) loads them (`load_attn_pattern`, clipped to [0, 1]) and
turns them into full and streaming heads by a quantile over all layers (`sparsify_attention_heads`: the heads below
the `sparsity` quantile stream; ties broken by random noise of 1e-6), the streaming heads keeping `sink_size` and
`recent_size` tokens (128 and 256 in its Llama-3.1-8B pattern's config.json). kvpress's DuoAttentionPress does the
same with `head_compression_ratio` the share of streaming heads, and masks the middle of their keys at attention time.

snapkv_lab, what differs (docs/faithfulness.md): the gates are Wu et al.'s retrieval scores measured on the model
itself (`snapkv_lab.retrieval_heads`, a KV head scoring the mean of its query heads', kvpress's on-the-fly reduction),
not learned; the share of streaming heads follows from the budget instead of being given: with n prompt tokens, a
budget B = capacity (a share of n, or positions) per head and s = min(sink_size + recent_size, B) per streaming head,
the floor(L K (B - s) / (n - s)) best-scoring KV heads of all L layers x K KV heads keep all n positions and the
others s (L: the layers compressed; sliding-window layers keep their own bounded cache), so the cache holds at
most L K B positions; ties between equal scores go to the earlier (layer, head). Streaming heads really drop their
middle (the cache is stored ragged), instead of masking it. A budget below sink_size + recent_size positions (the
official never meets one: it sets no budget) makes every head stream, with sinks and recent tokens in the
proportion sink_size : recent_size.

While decoding, the official streaming heads roll: each step's token is appended and the cache cut back to the sinks
and the last recent_size tokens (duo_attn/patch/llama.py:273-290; static_kv_cache.py:127-160 for its static cache).
So do ours by default (`decode_window`; the engine's compression.layers.RollingWindow): at every call after the
prefill a streaming head sees its sinks, the recent positions before the call's first token and the call's own
tokens. What slides out is hidden, not freed: a streaming head's generated tokens stay stored (a ragged cache cannot
drop one slot per head and step without copying the layer), so the bytes match the official's after the prefill and
grow by one token per head and step while decoding, where the official's stay fixed. rolling=False, our former
default, freezes the prefill's set and lets every generated token stay visible.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..core.checks import check_int
from .base import AttentionCall, LayerBudget, Policy
from .headkv import model_head_scores


def full_heads(scores: torch.Tensor, count: int) -> torch.Tensor:
    """(L, K) scores -> (L, K) bool: the `count` best-scoring heads, ties to the earlier (layer, head)."""
    flat = scores.flatten().nan_to_num(-torch.inf)
    order = torch.sort(-flat, stable=True).indices[:count]
    full = torch.zeros(flat.numel(), dtype=torch.bool)
    full[order] = True
    return full.view(scores.shape)


@dataclass
class DuoAttention(Policy):
    """Full cache for the best-scoring KV heads, sinks + recent tokens for the others, as many full heads as the
    budget pays for, the streaming heads' window rolling while decoding (rolling=False: frozen after the prefill; see
    the module docstring). score: the first `sink_size` positions first (in order), then recency.
    kept_tail=w (default 0) only names the last w tokens as the always-kept tail: they are the most recent anyway."""

    kept_tail: int = 0
    sink_size: int = 128
    recent_size: int = 256
    # The official streaming heads roll: every decode step appends its token and cuts back to the sinks and the last
    # recent_size (duo_attn/patch/llama.py:273-290, static_kv_cache.py:127-160). rolling=False, our former default,
    # freezes what the prefill kept and lets every generated token stay.
    rolling: bool = True

    scores_query_heads: ClassVar[bool] = False

    def __post_init__(self):
        super().__post_init__()
        if self.per_query_head:
            raise ValueError("DuoAttention picks full and streaming KV heads: per_query_head=True is not supported")
        check_int("sink_size", self.sink_size)
        check_int("recent_size", self.recent_size)

    def prepare(self, model, tokenizer) -> None:
        scores = model_head_scores(model, tokenizer, self.label)  # (L, query heads)
        kv_heads = getattr(model.config, "num_key_value_heads", None) or scores.shape[1]
        kv_scores = scores.view(scores.shape[0], kv_heads, -1).mean(-1)  # NaN on sliding layers: never full
        self._compressed_heads = int((~kv_scores.isnan()).sum())
        if self._compressed_heads and not bool((kv_scores.nan_to_num(0.0) > 0).any()):
            raise ValueError(f"{self.label} keeps the whole context in its best retrieval heads, and no head scored "
                             "above 0 (the model copied no needle token): there is nothing to rank them by")
        self._kv_scores = kv_scores

    def score(self, call: AttentionCall):
        order = torch.arange(call.n_keys, dtype=torch.float32, device=call.key.device)
        sinks = self.sinks_kept(call.n_keys)
        order[:sinks] = call.n_keys + sinks - order[:sinks]  # above every recency, the first sink highest
        return order.expand(call.key.shape[0], -1)

    @property
    def budget_in_scores(self) -> bool:
        return True  # the sinks scored first are a share of a budget below sink_size + recent_size (sinks_kept)

    def decode_window(self, n_tokens: int) -> tuple[int, int] | None:
        """(sinks, recent) of the streaming heads as decoding goes: what they kept of an n-token prompt, rolling
        (None under rolling=False, or when the prompt fits the budget and no head streams)."""
        if not self.rolling or self.budget(n_tokens) is None:
            return None
        sinks = self.sinks_kept(n_tokens)
        return sinks, self.streaming_budget(n_tokens) - sinks

    def streaming_budget(self, n_tokens: int) -> int:
        """Positions a streaming head keeps: sink_size + recent_size, or the whole budget if smaller."""
        return min(self.sink_size + self.recent_size, self.budget(n_tokens))

    def sinks_kept(self, n_tokens: int) -> int:
        """A streaming head's sinks: sink_size, or, when the budget holds less than sink_size + recent_size, its
        share sink_size / (sink_size + recent_size) of the budget (so recent tokens stay: 1 in 3 with 128 and 256)."""
        budget = self.budget(n_tokens)
        if budget is None:
            return min(self.sink_size, n_tokens)
        whole = self.sink_size + self.recent_size
        return self.sink_size if budget >= whole else (budget * self.sink_size) // whole

    def full_count(self, n_tokens: int, n_heads: int) -> int:
        """How many of the model's n_heads KV heads keep all n_tokens within n_heads x budget positions."""
        budget, streaming = self.budget(n_tokens), self.streaming_budget(n_tokens)
        return (n_heads * (budget - streaming)) // (n_tokens - streaming)

    def full_head_mask(self, n_tokens: int) -> torch.Tensor:
        """(layers, KV heads) bool: the heads that keep all of an n-token prompt (after `prepare`)."""
        return full_heads(self.gates, self.full_count(n_tokens, self._compressed_heads))

    def sharing_heads(self) -> torch.Tensor:
        """(layers, KV heads) bool: the heads that share the budget, those of the compressed (not sliding) layers."""
        return ~self.gates.isnan()

    @property
    def gates(self) -> torch.Tensor:
        """(layers, KV heads) the scores the heads are ranked by (after `prepare`), NaN on sliding-window layers."""
        kv_scores = getattr(self, "_kv_scores", None)
        if kv_scores is None:
            raise RuntimeError(f"{self.label}: the model was not prepared (policy.prepare(model, tokenizer)), so its "
                               "heads' retrieval scores are unknown")
        return kv_scores

    def head_budgets(self, scores, budget: LayerBudget) -> list[int]:
        full = self.full_head_mask(budget.tokens)[budget.layer]
        prefix = self.prefix_len(budget)
        streaming = self.streaming_budget(budget.tokens) - (budget.tokens - prefix)  # the kept tail: recent tokens too
        return [prefix if is_full else streaming for is_full in full.tolist()]
