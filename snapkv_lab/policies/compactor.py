"""Compactor (Chari & Van Durme 2025, arXiv 2507.08143, "Compactor: Calibrated Query-Agnostic KV Cache Compression
with Approximate Leverage Scores"; its transformers code is its author's NVIDIA kvpress press, CompactorPress, kvpress
0.5.5 presses/compactor_press.py): blend two query-agnostic views of a key, its leverage among the pre-RoPE keys
(snapkv_lab.policies.leverage) and the attention its own chunk pays it (snapkv_lab.policies.non_causal), each
z-scored: score = blending * leverage + attention (:134).

The first `sinks` (8) and the last `kept_tail` (4) positions are kept and left out of both scores: the two are
computed on the positions between (:117-128; the leverage's centring, the chunks and the z-scores over those only) and
the ends padded with the maximum (:136; +inf here, kept whatever the budget). blending=None uses the compression
ratio, 1 - capacity / n for a token budget, 1 - capacity for a ratio (:133, kvpress's default: "a good heuristic"),
0 with no budget. Defaults are kvpress's: sinks 8, kept tail 4, chunk_size 256, sketch_dimension 48.

The authors' vLLM engine (vnchari/compactor-vllm@48d9f65 src/compactor_vllm/compression/compactor.py) differs: a
fixed blending of 0.5 (:57), chunks of 128 for the attention (:17), leverage per 512-position chunk with a ridge of
5e-3 (:115-120): not reproduced here. Where this differs from kvpress (pre-RoPE keys un-rotated, a seeded sketch, the
whole prompt in one call, z-scores per prompt): see the two modules above.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from ..core.checks import check_int
from .base import AttentionCall, Policy, whole_prompt
from .leverage import gaussian_sketch, leverage_scores, prerope_keys, zscore
from .non_causal import chunked_attention, value_weighted


@dataclass
class Compactor(Policy):
    """Leverage and non-causal attention blended (see module doc). score: (kv_heads, n_keys), +inf on the sinks."""

    kept_tail: int = 4
    sinks: int = 8
    chunk_size: int = 256
    sketch_dimension: int = 48
    blending: float | None = None
    seed: int = 0
    mask_padding: bool = False

    scores_query_heads: ClassVar[bool] = False

    def __post_init__(self):
        super().__post_init__()
        check_int("sinks", self.sinks)
        check_int("chunk_size", self.chunk_size, 1)
        check_int("sketch_dimension", self.sketch_dimension, 1)
        check_int("seed", self.seed)

    @property
    def budget_in_scores(self) -> bool:
        return self.blending is None  # blended by the compression ratio

    def compression_ratio(self, n_tokens: int) -> float:
        """kvpress's compression_ratio of an n-token prompt under this capacity (blending's default)."""
        if self.capacity is None:
            return 0.0
        return 1 - self.capacity if isinstance(self.capacity, float) else 1 - self.capacity / n_tokens

    def score(self, call: AttentionCall) -> torch.Tensor:
        whole_prompt(call, self.name)
        n = call.n_keys
        start = min(self.sinks, n)
        end = n - min(self.kept_tail, n - start)
        keys = prerope_keys(call, self.name)[:, start:end]
        leverage = zscore(leverage_scores(keys, gaussian_sketch(call, self.sketch_dimension, self.seed)))
        attention = chunked_attention(call.query[:, start:end], call.key[:, start:end], self.chunk_size,
                                      self.mask_padding)
        attention = value_weighted(call.value[:, start:end], attention)
        blending = self.compression_ratio(n) if self.blending is None else self.blending
        scores = blending * leverage + attention
        return F.pad(scores, (start, n - end), value=math.inf)
