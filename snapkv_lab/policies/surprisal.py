"""Surprisal: keep what the context could not predict, pooled over a fact. Needs no question.

Why (measured on SmolLM2-135M, needles at 1024 of 4000 tokens, query-agnostic; docs/pressure.md, "Why compression
fails"):
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
One set of positions serves every layer and KV head. Cost: no second forward. The prefill that fills the cache
already computes every position's final hidden states and drops all but the last before its output head
(`logits_to_keep=1`); SharedPrefill keeps them (hooks.capture_final_hidden) when a policy reads them, and the
scores are the output head over them, LOGIT_ELEMENTS logits at a time, computed by the engine once per prompt
(`Prompt.surprisal`): a question fed after its context pays only its own tokens' rows, the context's being the same
(the model is causal). It needs the whole prompt's hidden states, so
Surprisal scores after the prefill (`scores_after_prefill`; snapkv_lab.generate,
compare, SharedPrefill), never live at a layer's attention call (`compress` refuses it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..core.checks import check_int
from .base import Policy, Prompt
from .snapkv import FACT_TOKENS

# Logits held at a time (256 MiB in float32): the (n, vocab) logits of a long context would take GBs, and rows of a
# large vocabulary are long (Gemma 3's 262k: 1024 rows were a 1 GiB chunk, 3x the full cache's peak at 8k tokens).
LOGIT_ELEMENTS = 1 << 26


def token_surprisal(model, hidden: torch.Tensor, ids: torch.Tensor, known: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """(batch, n) -log p(ids[:, i] | ids[:, :i]) under `model`, from the decoder's final hidden states (batch, n,
    hidden_size) over ids; 0 at position 0 (nothing predicts it). known: (batch, k) the first k positions' surprisal,
    already computed over the same first tokens (a causal model's at a token reads only the tokens before it): only
    the others are computed."""
    head, cap = model.get_output_embeddings(), getattr(model.config, "final_logit_softcapping", None)
    out = torch.zeros(ids.shape, dtype=torch.float32, device=ids.device)
    first = 0 if known is None else max(known.shape[1] - 1, 0)  # the hidden state predicting the first unknown token
    if known is not None:
        out[:, :known.shape[1]] = known
    rows = max(1, LOGIT_ELEMENTS // (ids.shape[0] * head.weight.shape[0]))
    for start in range(first, ids.shape[1] - 1, rows):
        stop = min(start + rows, ids.shape[1] - 1)
        logits = head(hidden[:, start:stop]).float()  # (batch, rows, vocab): row i predicts token i + 1
        if cap:
            logits = logits.div_(cap).tanh_().mul_(cap)
        # -log softmax at the target: log-sum-exp over the vocabulary minus the target's logit, computed in place
        # along contiguous rows (the head's matmul stays the cost: no second (rows, vocab) tensor)
        target = logits.gather(-1, ids[:, start + 1:stop + 1, None])[..., 0]
        top = logits.amax(-1, keepdim=True)
        out[:, start + 1:stop + 1] = top[..., 0] + logits.sub_(top).exp_().sum(-1).log() - target
    return out


@dataclass
class Surprisal(Policy):
    """Scores each context position by the model's surprisal at it, max-pooled over `kernel_size` positions (one
    fact); the first `sinks` positions score highest. The same scores for every layer and KV head."""

    pooling: str | None = "max"
    kernel_size: int = FACT_TOKENS
    sinks: int = 4

    # The output head over every prompt position's final hidden states, which the prefill keeps: no second forward.
    needs: ClassVar[frozenset[str]] = frozenset({"final_hidden"})
    scores_query_heads: ClassVar[bool] = False  # one set of positions serves every head

    def __post_init__(self):
        super().__post_init__()
        check_int("sinks", self.sinks)

    def prompt_scores(self, prompt: Prompt) -> dict[int, torch.Tensor]:
        """{layer: (1, kv_heads, n)} for every full-attention layer of the prompt's cache (sliding ones keep their
        own), from the surprisal the engine computed over the final hidden states its prefill kept
        (`prompt.surprisal`, `prompt.final_hidden`)."""
        hidden, ids = prompt.final_hidden, prompt.ids
        if hidden is None or hidden.shape[:2] != ids.shape or prompt.surprisal is None:
            raise ValueError(f"{self.label} scores from the final hidden states of the prefill of ids, which the "
                             "engine keeps (SharedPrefill): run it through snapkv_lab.generate or compare")
        scores = prompt.surprisal().clone()
        # protected: kept, and never pooled into their neighbours (base.Policy.ranked)
        scores[:, :self.sinks] = math.inf
        return {i: scores[:, None].expand(-1, layer.keys.shape[1], -1)
                for i, layer in enumerate(prompt.cache.layers) if not getattr(layer, "is_sliding", False)}
