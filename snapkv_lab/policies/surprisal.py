"""Surprisal: keep what the context could not predict, pooled over a fact. Needs no question.

Why (measured on SmolLM2-135M, needles at 1024 of 4000 tokens, query-agnostic; README "Why compression fails"):
- Without the question, SnapKV's window (the context's last tokens) keeps the needle only where it sits in the
  window. (KVzip's reconstruction attention, as its authors define it, keeps 14 of 15: `--suites question-free`;
  a former, simplified KVzip kept half, which is what this scorer was first built against.)
- A needle is by construction what its context cannot predict: a sentence about a "special magic number" inside
  an essay, and a random value. The model's own next-token loss over the context (the surprisal that LLMLingua
  uses to drop predictable prompt tokens) is high on it with no question asked.
- Single surprising tokens are scattered everywhere; what a retrieval needs is the whole fact, so the scores are
  max-pooled over a fact's length (31 tokens, as SnapKVFactKernel's votes), so that a peak anywhere in the
  needle sentence keeps all of it, value included.
- The first `sinks` positions are always kept, exactly those: most heads park their attention there (the findings'
  sinks).
One set of positions serves every layer and KV head. Cost: one extra forward over the context.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from .base import Policy
from .snapkv import FACT_TOKENS

CHUNK = 1024  # rows of logits at a time: the (n, vocab) logits of a long context would take GBs


def token_surprisal(model, ids: torch.Tensor) -> torch.Tensor:
    """(batch, n) -log p(ids[:, i] | ids[:, :i]) under `model`, 0 at position 0 (nothing predicts it)."""
    hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state  # (batch, n, hidden)
    head, cap = model.get_output_embeddings(), getattr(model.config, "final_logit_softcapping", None)
    out = torch.zeros(ids.shape, dtype=torch.float32, device=ids.device)
    for start in range(0, ids.shape[1] - 1, CHUNK):
        stop = min(start + CHUNK, ids.shape[1] - 1)
        logits = head(hidden[:, start:stop]).float()  # (batch, rows, vocab): row i predicts token i + 1
        if cap:
            logits = cap * torch.tanh(logits / cap)
        out[:, start + 1:stop + 1] = F.cross_entropy(logits.transpose(1, 2), ids[:, start + 1:stop + 1], reduction="none")
    return out


@dataclass
class Surprisal(Policy):
    """Scores each context position by the model's surprisal at it, max-pooled over `kernel_size` positions (one
    fact); the first `sinks` positions score highest. The same scores for every layer and KV head."""

    pooling: str | None = "max"
    kernel_size: int = FACT_TOKENS
    sinks: int = 4

    extra_passes: ClassVar[int] = 1
    scores_query_heads: ClassVar[bool] = False  # one set of positions serves every head

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.sinks, int) or self.sinks < 0:
            raise ValueError(f"sinks must be a non-negative int, got {self.sinks!r}")

    def prompt_scores(self, model, tokenizer, ids: torch.Tensor, cache) -> dict[int, torch.Tensor]:
        """{layer: (batch, kv_heads, n)} for every full-attention layer of `cache` (sliding ones keep their own)."""
        scores = token_surprisal(model, ids)
        scores[:, :self.sinks] = math.inf  # protected: kept, and never pooled into their neighbours (base.Policy.ranked)
        return {i: scores[:, None].expand(-1, layer.keys.shape[1], -1)
                for i, layer in enumerate(cache.layers) if not getattr(layer, "is_sliding", False)}
