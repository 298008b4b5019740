"""KVCompose (Akulov et al. 2025, arXiv 2509.05165): attention-guided, layer-adaptive composite tokens.

The prompt is fed again over its own cache (KVzip's reconstruction without an instruction: the prompt itself, at the
positions after it); a position's score in a query head is the largest attention any fed token pays it, the softmax
over every cached key and the fed keys (causal). Then, per layer (kv_heads, n):

    S[h, j] = mean over KV head h's query heads of max_p A[p, j]           (aggregation over the task, then the group)
    S[h, j] += mean over KV heads of S[., j]                               (add_mean_across_heads)
    C[i] = mean over KV heads of the i-th largest S[h, .]                  (the layer's i-th composite token)

and layer 0's C is the largest of every layer's, position by position. One top count of budget x layers over every
layer's C gives each layer its count k_l (at least 1), and each KV head of the layer keeps its own top k_l positions:
the heads keep different positions but as many, so a layer's cache stays one dense (kv_heads, k_l) tensor (the
"composite tokens"), and layers keep different counts.

The authors' code is kvpress's KVComposePress, contributed by the paper's first author (NVIDIA/kvpress pull request
#137, "Add KVCompose"; kvpress 0.5.5 presses/kvcompose_press.py, cited as :line; no other release was found): its
defaults are ours, and every setting below is one of its parameters. The feed (:392-420), under eager attention: the
attention each fed token pays the context, max over the fed tokens per query head (:198-220, agg_task "max"), mean
over each KV head's query heads (:222-233, agg_group "mean"), the mean over KV heads added (:235-246), composite
scores as the mean of the KV heads' sorted scores (:248-266, agg_head "mean"), one top count of
max(1, int(layers x n x (1 - ratio))) over them, each layer at least max(1, keep_token_lower_bound) (:268-292), each
KV head its top count (:294-320).

Differences, by design: the fed tokens' attention comes from the fused kernel's parts (KVzip's
`reconstruction_by_parts`), equal to eager's up to float rounding. The budget is the lab's: capacity x layers
composite tokens (kvpress's int(layers x n x (1 - ratio)), the same where capacity = n (1 - ratio) is whole). Each
batch row is scored alone (kvpress maxes over the batch's rows too, :75). add_v_norm multiplies by the norms of the
prompt's values: kvpress 0.5.5 reads the cache while it still holds the fed tokens (2n values for n scores, :243-244,
an error), its later code crops the cache first (NVIDIA/kvpress@0f07976, `cache.crop`). kvpress's other settings
(agg_task, agg_group and agg_head "mean"/"max" besides the defaults, prompt_ids fed in place of the context) are not
offered.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..core.checks import check_int
from ..core.feed_attention import by_parts_supported
from .base import LayerBudget, Policy, Prompt, top_positions
from .kvzip import reconstruction_by_parts, reconstruction_scores

BONUS = 1e9  # added to the first keep_token_lower_bound composite scores of every row, as kvcompose_press.py:256, :264


def compose_scores(per_head: torch.Tensor, values: torch.Tensor, v_norm: bool, mean_across_heads: bool) -> torch.Tensor:
    """(kv_heads, n) float32 KVCompose scores of one layer (kvcompose_press.py:222-246): per_head (heads, n) each query
    head's largest attention over the fed tokens, meaned over each KV head's query heads; times each position's value
    norm if v_norm (values: (kv_heads, n, head_dim) the prompt's); plus the mean over KV heads if mean_across_heads."""
    scores = per_head.unflatten(0, (values.shape[0], -1)).mean(1)
    if v_norm:
        scores = scores * values.float().norm(dim=-1)
    if mean_across_heads:
        scores = scores + scores.mean(0, keepdim=True)
    return scores


@dataclass
class KVCompose(Policy):
    """KVCompose as its authors' code runs it (see module doc). Cost, paid in selection_seconds: one forward of the
    whole prompt over its cache (n x 2n attention entries, about twice the prefill's attention), scored as KVzip's
    reconstruction is.

    kept_tail: 0: nothing is kept by right (kvpress's press keeps no window).
    structured: True: each layer keeps one count for all its KV heads (composite tokens); False: kvpress's
        unstructured variant, one top count of budget x layers x KV heads over every head's sorted scores, each head
        its own count (a ragged layer), no layer-0 rule (kvcompose_press.py:255-256, :277-282).
    add_v_norm: scores times the norm of each position's value (kvpress's default False).
    add_mean_across_heads: the mean over the layer's KV heads added to each head's scores (kvpress's default True).
    keep_token_lower_bound: the positions every layer (structured) or head keeps at least; kvpress's default 0 (every
        layer still keeps at least 1).
    The allocation lives in `keep_layers`, as KVzip's global selection: a wrapper's own (AdaKV, ChunkKV) replaces it.
    """

    kept_tail: int = 0
    structured: bool = True
    add_v_norm: bool = False
    add_mean_across_heads: bool = True
    keep_token_lower_bound: int = 0

    needs: ClassVar[frozenset[str]] = frozenset({"feed"})  # the prompt fed again over its cache
    scores_query_heads: ClassVar[bool] = False  # one row per KV head: the group is meaned before selection

    def __post_init__(self):
        super().__post_init__()
        check_int("keep_token_lower_bound", self.keep_token_lower_bound)
        for name in ("structured", "add_v_norm", "add_mean_across_heads"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")

    @property
    def selects_across_layers(self) -> bool:
        return True  # one top count of composite tokens over every layer (keep_layers)

    @property
    def scoring_key(self) -> str:
        """The allocation acts after scoring: variants differing only in it share one pass."""
        return Policy.scoring_key.fget(dataclasses.replace(self, kept_tail=0, structured=True,
                                                            keep_token_lower_bound=0))

    def prompt_scores(self, prompt: Prompt) -> dict[int, torch.Tensor]:
        """{layer: (1, kv_heads, n)} float32 KVCompose scores of a prompt (1, n), from the prompt fed again at
        positions n..2n-1 over a fork of its cache (`prompt.feed`). Sliding-window layers are left out (never
        compressed)."""
        ids, n = prompt.ids, prompt.n_tokens
        scores = {i: torch.zeros(1, layer.keys.shape[1], n, device=ids.device)
                  for i, layer in enumerate(prompt.cache.layers) if not getattr(layer, "is_sliding", False)}
        context = slice(0, n)

        def record(module, query, key, value, settings):
            if settings.sliding_window is not None:
                return None  # never compressed: the backend attends
            output = None
            if by_parts_supported(query, settings):
                output, per_head = reconstruction_by_parts(query[0], key[0], value[0], 0, context, settings,
                                                           per_query_head=True)
            else:
                per_head = reconstruction_scores(query[0], key[0], 0, context, settings, per_query_head=True)
            scores[module.layer_idx][0] = compose_scores(per_head, value[0, :, :n], self.add_v_norm,
                                                         self.add_mean_across_heads)
            return None if output is None else output[None]

        prompt.feed(ids, torch.arange(n, 2 * n, device=ids.device)[None], record)
        return scores

    def keep_layers(self, scores: dict[int, torch.Tensor], budget: LayerBudget) -> dict[int, torch.Tensor]:
        """{layer: (kv_heads, widest) kept positions}: one top count of the budget's prefix picks over every layer's
        composite scores (structured; every row's sorted scores if not), then each KV head its layer's (or its own)
        count of its top positions, then the kept tail (kvcompose_press.py:248-320)."""
        layers = sorted(scores)
        ranked = torch.stack([self.ranked(scores[i], budget.at(i)) for i in layers])  # (layers, kv_heads, prefix)
        picks = [self.head_budgets(scores[i], budget.at(i)) for i in layers]
        best_first = ranked.sort(dim=-1, descending=True).values
        if self.structured:
            composite = best_first.mean(1)  # (layers, prefix): the layer's i-th composite token's score
            composite[0] = composite.max(0).values  # layer 0 keeps the most (kvcompose_press.py:265-266)
            total = sum(max(row) for row in picks)
        else:
            composite = best_first.flatten(0, 1)  # (layers x kv_heads, prefix)
            total = sum(sum(row) for row in picks)
        composite[:, :self.keep_token_lower_bound] += BONUS
        prefix = composite.shape[-1]
        counts = torch.bincount(composite.flatten().topk(total).indices // prefix, minlength=composite.shape[0])
        if self.structured:  # no layer left empty (kvcompose_press.py:286-292)
            counts = counts.clamp(min=max(1, self.keep_token_lower_bound)).repeat_interleave(ranked.shape[1])
        counts = counts.clamp(max=prefix).view(len(layers), -1).tolist()
        return {i: top_positions(ranked[j], counts[j], budget.tokens) for j, i in enumerate(layers)}
