"""CAPKV (arXiv 2604.25975; its code here is kvpress 0.5.5's CapPress, presses/cap_press.py): keep the tokens whose
values add most capacity to what the cache can still express, weighted by how well their keys align with the
queries seen so far.

Per query head: an anchor mu, the mean of the prompt's pre-RoPE queries after the first `n_sink` tokens (:165-181),
rotated by RoPE averaged over the `n_future_positions` (512) positions after the prompt (:101-139, as
ExpectedAttention); a key's weight w_i = exp(tau (cos(mu, k_i) - max_j cos(mu, k_j))) (:183-219, tau 5, keys and
anchor unit-normalised); the capacity matrix A = I + sum_i (w_i + epsilon) v_i v_i^T (:262-277, epsilon 1e-6); a
token's score w_i * v_i^T A^-1 v_i (:279-285), averaged over its KV head's query heads (:287-289). The first n_sink
tokens are left out of all of it and kept (max + 1 in kvpress, :295; +inf here). No kept tail.

Where this differs from kvpress:

- Pre-RoPE queries: AttentionCall's post-RoPE queries un-rotated through the family's own RoPE, and the mean rotation
  the family's own (snapkv_lab.core.rope.LayerRope), as ExpectedAttention; kvpress re-projects the hidden states with
  q_proj and builds Llama's half-split rotation for every model (the same on Llama-style layers).
- Prompt chunks: the anchor is a running mean carried across the chunks of one prefill (AttentionCall.carry), so a
  prompt fed in chunks scores as one prefill of the whole; kvpress sees one call's hidden states. The future positions
  start after the call's last query (kvpress: the call's length, the same at a prefill).
- Precision: statistics in float64, the capacity matrix in float32 (kvpress: the model dtype, then float32).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from ..core.checks import check_int
from ..core.rope import LayerRope
from .base import AttentionCall, Policy, budget_past_sinks


@dataclass
class Cap(Policy):
    """CAPKV's alignment-weighted value leverage (see module doc). score: (kv_heads, n_keys), +inf on the sinks."""

    kept_tail: int = 0
    tau: float = 5.0
    n_future_positions: int = 512
    n_sink: int = 4
    epsilon: float = 1e-6

    scores_query_heads: ClassVar[bool] = False

    def __post_init__(self):
        super().__post_init__()
        check_int("n_sink", self.n_sink)
        check_int("n_future_positions", self.n_future_positions, 1)

    def budget(self, n_tokens: int) -> int | None:
        return budget_past_sinks(self, n_tokens)

    def score(self, call: AttentionCall) -> torch.Tensor:
        heads, _, d = call.query.shape
        kv_heads, n_keys = call.key.shape[:2]
        if n_keys <= self.n_sink:  # every key a sink: all kept
            return call.query.new_full((heads, n_keys), math.inf, dtype=torch.float32)
        rope = LayerRope.of(call.module, d)
        anchor = self._anchor(call, rope)  # (heads, d) pre-RoPE mean query
        future = torch.arange(self.n_future_positions, device=call.query.device) + int(call.positions[-1]) + 1
        anchor = (anchor @ rope.mean_rotation(future).to(anchor.device).T).float()
        group = heads // kv_heads
        keys = call.key[:, self.n_sink:].float().repeat_interleave(group, 0)  # (heads, m, d)
        values = call.value[:, self.n_sink:].float().repeat_interleave(group, 0)
        cosine = (F.normalize(keys, dim=-1) @ F.normalize(anchor, dim=-1)[:, :, None])[..., 0].clamp(-1, 1)
        logits = self.tau * cosine
        weights = torch.exp(logits - logits.amax(dim=-1, keepdim=True))  # (heads, m)
        capacity = torch.eye(d, device=keys.device) + torch.einsum("hm,hmd,hme->hde", weights + self.epsilon, values,
                                                                   values)
        leverage = (values.transpose(1, 2) * torch.linalg.solve(capacity, values.transpose(1, 2))).sum(dim=1)
        scores = (weights * leverage).view(kv_heads, group, -1).mean(dim=1)
        return F.pad(scores, (self.n_sink, 0), value=math.inf)

    def _anchor(self, call: AttentionCall, rope: LayerRope) -> torch.Tensor:
        """(heads, d) float64 mean of the prompt's pre-RoPE queries at token positions >= n_sink so far: the carried
        count and sum plus this call's rows (stored back, new tensors)."""
        fresh = call.positions >= self.n_sink
        query = rope.unrotate(call.query[:, fresh.to(call.query.device)].float(), call.positions[fresh]).double()
        count = call.carry.get("count", 0) + query.shape[1]
        total = query.sum(1) + call.carry.get("sum", 0)
        if count == 0:
            raise ValueError(f"Cap needs a query at a token position >= n_sink = {self.n_sink}")
        call.carry.update(count=count, sum=total)
        return total / count
