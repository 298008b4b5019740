"""FactKV: keep whole facts at small budgets. KVzip's reconstruction scores, max-pooled over a fact's length.

Why (measured on SmolLM2-135M, needles at 1024 of 4000 tokens; README "Why compression fails"):
- A compressed run retrieves the needle when the kept positions serve the answer's attention to the needle's
  value, not when they serve most of its attention overall: coverage barely separates found from missed runs,
  the share of the needle-value attention served does (`pressure.ablations.retrieval_predictors`).
- SnapKV's misses are fragments: it keeps some of the value's digit tokens and the model answers a corrupted
  number (`99358423.` for 9935848). Its votes peak on a few tokens of the fact; pooling with kernel 7 spreads a
  peak over 7 positions, fewer than a fact's (the needle sentence is about 20 tokens, its value 7).
- Query-agnostic, SnapKV's window (the context's last tokens) does not look at the needle at all; KVzip's
  reconstruction pass does (it must reproduce the value), but per-token maxima keep fragments too (`935848.`).
So: score each position by KVzip's reconstruction attention, which needs no question, and pool the scores with
a kernel as long as a fact sentence, so that a peak anywhere in a fact keeps all of it.
Cost: KVzip's, one extra forward over the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

from .kvzip import KVzip

FACT_TOKENS = 31  # about one sentence: the needle sentence is 20-25 SmolLM2 tokens; odd, so pooling stays centred


@dataclass
class FactKV(KVzip):
    """KVzip's scores, max-pooled over `kernel_size` positions (one fact's length), top-k per KV head."""

    pooling: str | None = "max"
    kernel_size: int = FACT_TOKENS
