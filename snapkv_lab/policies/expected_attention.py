"""Expected Attention (NVIDIA kvpress, ExpectedAttentionPress, 2025): query-agnostic scores from the
statistics of the prompt's queries, projected onto the positions where future queries will sit.

Future queries are modelled as Gaussian, q ~ N(mu, Sigma) per head, fitted on the prompt's queries before
RoPE (the first `n_sink` rows left out: attention-sink outliers). RoPE at a future position t is a rotation
R_t, averaged over the next `n_future_positions` positions: R = mean_t R_t, so mu' = R mu and
Sigma' = R Sigma R^T. For a Gaussian, E[exp(s q.k)] = exp(s mu'.k + s^2 k^T Sigma' k / 2), so the expected
attention of key k is the softmax over keys of that exponent (s: the layer's scaling, 1/sqrt(d) in the
paper). Scores are then weighted by the value norm (score + epsilon) * ||v||, as kvpress does, and the first
`n_sink` positions are always kept.

kvpress projects the layer's input hidden states with q_proj; AttentionCall hands us the post-RoPE queries
instead, so we un-rotate them with their known positions. Both give the same mu and Sigma for Llama-style
layers; ours also covers a q_proj bias and query norms (Qwen3, Gemma 3) and never re-runs a projection.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from .base import AttentionCall, Policy


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(..., d) -> (..., d): [x1, x2] -> [-x2, x1], the pairing of transformers' RoPE."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def rope_cos_sin(module, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (len(positions), head_dim) float32 of the module's model family: its RotaryEmbedding class
    (in transformers 5 the rotary embedding lives on the model, not on the attention module), built from
    module.config, so that scaled RoPE variants (llama3, yarn) are what the model uses."""
    family = sys.modules[type(module).__module__]
    rotary = next((getattr(family, name) for name in dir(family) if name.endswith("RotaryEmbedding")), None)
    if rotary is None:
        raise NotImplementedError(f"{type(module).__name__}: no RotaryEmbedding class found in its module")
    cos, sin = rotary(config=module.config)(torch.zeros(1, dtype=torch.float32), positions[None].long())
    return cos[0].float(), sin[0].float()


@dataclass
class ExpectedAttention(Policy):
    """Expected attention of future queries (see module doc). score: (heads, n_keys) float32."""

    n_future_positions: int = 512
    n_sink: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0

    def score(self, call: AttentionCall):
        heads, rows, d = call.query.shape
        kv_heads, n_keys = call.key.shape[:2]
        if rows <= self.n_sink + 1:
            raise ValueError(f"ExpectedAttention needs more than n_sink + 1 = {self.n_sink + 1} prompt queries")
        cos, sin = rope_cos_sin(call.module, torch.cat([call.positions, torch.arange(n_keys, n_keys + self.n_future_positions)]))
        if cos.shape[-1] != d:
            raise NotImplementedError("ExpectedAttention needs RoPE over the whole head (no partial rotary)")
        cos, sin = cos.to(call.query.device), sin.to(call.query.device)
        # Un-rotate the queries: R(-theta) = (cos, -sin), divided by cos^2 + sin^2 (RoPE's attention_scaling^2).
        c, s = cos[:rows], sin[:rows]
        q = call.query.float()
        q = (q * c - rotate_half(q) * s) / (c * c + s * s)  # (heads, rows, d) pre-RoPE
        q = q[:, self.n_sink:]
        mu = q.mean(dim=1)  # (heads, d)
        # The mean rotation over the future positions: R v = v * cos + rotate_half(v) * sin, averaged.
        eye = torch.eye(d, device=q.device)
        rotation = (eye[None] * cos[rows:, None] + rotate_half(eye)[None] * sin[rows:, None]).mean(0).T  # (d, d)
        mu = mu @ rotation.T  # R mu, (heads, d)
        keys = call.key.float().repeat_interleave(heads // kv_heads, dim=0)  # (heads, n_keys, d)
        logits = torch.einsum("hd,hnd->hn", mu, keys) * call.attention.scaling
        if self.use_covariance:
            centred = q - q.mean(dim=1, keepdim=True)
            cov = centred.transpose(1, 2) @ centred / centred.shape[1]  # (heads, d, d), biased as kvpress
            cov = rotation @ cov @ rotation.T  # R Sigma R^T
            logits += torch.einsum("hnd,hde,hne->hn", keys, cov, keys) * call.attention.scaling ** 2 / 2
        scores = torch.softmax(logits, dim=-1)  # (heads, n_keys)
        if self.use_vnorm:
            vnorm = call.value.float().norm(dim=-1).repeat_interleave(heads // kv_heads, dim=0)  # (heads, n_keys)
            scores = (scores + self.epsilon) * vnorm
        scores[:, : self.n_sink] = float("inf")  # attention sinks: always kept
        return scores
