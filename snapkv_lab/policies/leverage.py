"""Leverage scores of the pre-RoPE keys (Chari & Van Durme 2025, arXiv 2507.08143, "Compactor: Calibrated
Query-Agnostic KV Cache Compression with Approximate Leverage Scores"; its transformers code is its author's NVIDIA
kvpress press, LeverageScorePress, kvpress 0.5.5 presses/leverage_press.py): a key far outside the subspace the
other keys span is one no mixture of them can stand in for, so it is kept.

A key's (ridge) leverage is the diagonal of X (X^T X + lambda I)^-1 X^T, X the keys centred over the sequence. The
paper sketches X on the right with a Gaussian Phi (d x k, entries N(0, 1/k)) so that the Gram matrix is k x k: X Phi
(kvpress :75-87); the Gram matrix is symmetrised and factored by Cholesky with lambda = 1e-2, raised tenfold while the
factorisation fails (:47-57, 93); the scores are clamped at 0 (:100) and z-scored over the layer (:117; a monotone
map, which matters only when Compactor blends them).

Where this differs from kvpress:

- Pre-RoPE keys: kvpress re-projects the layer's input hidden states (utils.get_prerope_key_states: k_proj, then
  k_norm for Qwen3 and Gemma 3). AttentionCall holds the post-RoPE keys, which we un-rotate through the family's own
  RoPE (snapkv_lab.core.rope.LayerRope, as ExpectedAttention does its queries): the same vectors, with whatever the
  family puts between k_proj and RoPE. Un-rotating needs each key's token position, known while the cache holds the
  whole prompt: a cache compressed before (prefill_chunk, DecodingEviction) is refused, as kvpress scores only a
  prefill (:114).
- The sketch: kvpress draws Phi from torch's global generator; we draw it from a generator seeded with
  seed * 100_003 + layer (RandomKeep's convention), reproducible whatever else ran. The peer row seeds kvpress's
  global generator the same way before each layer (benchmarks/_kvpress_worker.py `seeded`).
- The z-score spans one prompt's heads and positions; kvpress's spans its whole batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..core.checks import check_int
from ..core.rope import LayerRope
from .base import AttentionCall, Policy

RIDGE = 1e-2  # kvpress leverage_press.py:93, jitter=1e-2
RIDGE_TRIES = 5  # :93, max_tries=5: lambda, then 10x while the factorisation fails


@dataclass
class LeverageScore(Policy):
    """Keep the keys of highest approximate leverage, per KV head (see module doc). score: (kv_heads, n_keys).

    sketch_dimension: columns k of the Gaussian sketch (kvpress's 48); seed: the sketch's seed (with the layer).
    No kept tail, as kvpress's ScorerPress: every position competes."""

    kept_tail: int = 0
    sketch_dimension: int = 48
    seed: int = 0

    scores_query_heads: ClassVar[bool] = False

    def __post_init__(self):
        super().__post_init__()
        check_int("sketch_dimension", self.sketch_dimension, 1)
        check_int("seed", self.seed)

    def score(self, call: AttentionCall) -> torch.Tensor:
        sketch = gaussian_sketch(call, self.sketch_dimension, self.seed)
        return zscore(leverage_scores(prerope_keys(call, self.name), sketch))


def gaussian_sketch(call: AttentionCall, k: int, seed: int) -> torch.Tensor:
    """(kv_heads, head_dim, k) float32 Gaussian sketch of the call's layer, N(0, 1/k) entries, drawn on the CPU from
    seed * 100_003 + layer (the same on every device), on the keys' device."""
    kv_heads, _, d = call.key.shape
    generator = torch.Generator().manual_seed(seed * 100_003 + call.layer)
    return (torch.randn(kv_heads, d, k, generator=generator) * (1 / math.sqrt(k))).to(call.key.device)


def prerope_keys(call: AttentionCall, name: str) -> torch.Tensor:
    """(kv_heads, n_keys, head_dim) float32 keys before RoPE, un-rotated at their token positions 0..n_keys-1: only
    while the layer's cache holds every token so far (else NotImplementedError naming `name`)."""
    n = call.n_keys
    if int(call.positions[-1]) + 1 != n or int(call.slots[-1]) + 1 != n:
        raise NotImplementedError(f"{name} un-rotates the cached keys at their token positions, known only while the "
                                  "cache holds the whole prompt: it scores one prefill (as kvpress), not a cache "
                                  "compressed before (prefill_chunk, DecodingEviction)")
    rope = LayerRope.of(call.module, call.key.shape[-1])
    return rope.unrotate(call.key.float(), torch.arange(n, device=call.key.device))


def leverage_scores(keys: torch.Tensor, sketch: torch.Tensor) -> torch.Tensor:
    """keys (kv_heads, n, d), sketch (kv_heads, d, k) -> (kv_heads, n) float32 ridge leverage of the centred, sketched
    keys: diag(X (X^T X + lambda I)^-1 X^T), X = (keys - their mean) @ sketch, clamped at 0."""
    x = ((keys - keys.mean(dim=-2, keepdim=True)) @ sketch.to(keys.dtype)).float()  # (kv_heads, n, k)
    gram = x.transpose(-2, -1) @ x
    gram = (gram + gram.transpose(-2, -1)) / 2
    eye = torch.eye(gram.shape[-1], device=gram.device, dtype=gram.dtype)
    ridge = RIDGE
    for _ in range(RIDGE_TRIES):
        factor, info = torch.linalg.cholesky_ex(gram + ridge * eye)
        if bool((info == 0).all()):
            break
        ridge *= 10
    else:
        raise RuntimeError(f"leverage scores: the sketched keys' Gram matrix is not positive definite even with a "
                           f"ridge of {ridge / 10:g}")
    solved = torch.cholesky_solve(x.transpose(-2, -1), factor)  # (kv_heads, k, n) = (G + lambda I)^-1 X^T
    return (x * solved.transpose(-2, -1)).sum(dim=-1).clamp_min(0)


def zscore(scores: torch.Tensor) -> torch.Tensor:
    """(scores - mean) / std over every element (unbiased std, floored at 1e-6), as kvpress's Compactor presses."""
    return (scores - scores.mean()) / scores.std().clamp_min(1e-6)
