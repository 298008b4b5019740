"""Scores recorded at prefill without compressing, so that one prefill serves many policies and budgets.

    recorder = ScoreRecorder(policies)                       # a hook callback
    with intercept_attention(model, recorder): model(ids, past_key_values=full_cache)
    kept = kept_from_scores(policy, recorder.scores[policy.scorer_label], n, kv_heads, n_layers)
    compressed_copy(full_cache, kept)                        # what compress() would have built

The prefill's attention runs on the full keys under compression too, so scores recorded over a full
prefill equal those `compress` computes layer by layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..attention import AttentionSettings
from .compressor import attention_calls, stack_kept


class ScoreRecorder:
    """Hook callback that records, without compressing, the scores of several policies at every layer.

    Successive calls of a layer are prompt chunks (a context, then a question): accumulating policies add
    their scores up, the others keep the last chunk's. A chunk shorter than the longest observation window
    is scored with the last queries of the chunks before it in front (a window may span the end of the
    context and the question, as in one prefill of both). scores[policy.scorer_label][layer]: (batch, heads or
    kv_heads, n_keys). Policies sharing a scorer_label (differing only in budget) share one entry. Sliding-window
    layers are not scored: they are never compressed (see CompressionState).
    """

    def __init__(self, policies, n_layers: int):
        self.policies = {p.scorer_label: p for p in policies if not p.extra_passes}
        self.n_layers = n_layers
        self.window = max((p.window_size for p in self.policies.values()), default=0)
        self.scores: dict[str, dict[int, torch.Tensor]] = {label: {} for label in self.policies}
        self.recent: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> last `window` queries, positions

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        settings = AttentionSettings.of_call(module, kwargs)
        if settings.sliding_window is not None:
            return
        layer, n, rows = module.layer_idx, key.shape[2], query.shape[2]
        positions = torch.arange(n - rows, n)
        new_calls = attention_calls(module, query, key, value, positions, settings, self.n_layers)
        spanning = new_calls
        if layer in self.recent and rows < self.window:  # (batch, heads, rows, d) with earlier chunks' last queries
            earlier, earlier_positions = self.recent[layer]
            query, positions = torch.cat([earlier, query], 2)[:, :, -self.window:], torch.cat([earlier_positions, positions])[-self.window:]
            spanning = attention_calls(module, query, key, value, positions, settings, self.n_layers)
        self.recent[layer] = (query[:, :, -self.window:], positions[-self.window:])
        for label, policy in self.policies.items():
            scored = [policy.score(call) for call in (new_calls if policy.accumulates else spanning)]
            if scored[0] is None:
                continue
            new = torch.stack(scored)
            old = self.scores[label].get(layer)
            if policy.accumulates and old is not None:
                new = new + F.pad(old, (0, n - old.shape[-1]))
            self.scores[label][layer] = new

    def copy(self) -> ScoreRecorder:
        """A recorder that goes on from this one's scores (a question chunk after a shared context)."""
        other = ScoreRecorder(self.policies.values(), self.n_layers)
        other.scores = {label: dict(layers) for label, layers in self.scores.items()}
        other.recent = dict(self.recent)
        return other


def kept_from_scores(policy, scores: dict[int, torch.Tensor], n: int, kv_heads: int, n_layers: int) -> dict[int, torch.Tensor] | None:
    """{layer: kept positions (batch, kv_heads, k)} for every scored layer, or None if the prompt fits the budget."""
    if policy.budget(n) is None:
        return None
    return {layer: stack_kept([policy.keep(row, n, kv_heads, layer, n_layers) for row in layer_scores])
            for layer, layer_scores in sorted(scores.items())}
