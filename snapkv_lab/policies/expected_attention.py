"""Expected Attention (Devoto et al. 2025, arXiv 2510.00636; its code is its authors' NVIDIA kvpress,
ExpectedAttentionPress, kvpress 0.5.5 presses/expected_attention_press.py): query-agnostic scores from the
statistics of the prompt's queries, projected onto the positions where future queries will sit.

Future queries are modelled as Gaussian, q ~ N(mu, Sigma) per query head, fitted on the prompt's queries before
RoPE, the first `n_sink` positions left out (attention-sink outliers; kvpress :69-80, Sigma biased, / count). RoPE
at a future position t maps q to R_t q; R = mean of R_t over the `n_future_positions` positions after the prompt
(kvpress :110-124), so mu' = R mu and Sigma' = R Sigma R^T. For a Gaussian, E[exp(s q.k)] = exp(s mu'.k + s^2
k^T Sigma' k / 2), and a key's expected attention is the softmax over keys of that exponent (:149-152), over every
key but the first `n_sink` (:136-139), which are always kept (+inf here; kvpress pads them with max + 1, :163).
Scores are then (score + epsilon) * ||v|| (:159-160) and averaged over each KV head's query heads (:154-156; here in
`keep`, the GQA mean of the base pipeline: the value norm is the same for a KV head's query heads, so the order of
the mean and the product does not matter). No tail is kept by right (kvpress keeps none): kept_tail = 0.

Defaults are kvpress's: n_future_positions 512, n_sink 4, use_covariance, use_vnorm, epsilon 0, no kept tail. Where
this differs from kvpress, by choice:

- Pre-RoPE queries: kvpress re-projects the layer's input hidden states with q_proj (kvpress utils.py
  get_prerope_query_states: q_proj, then q_norm for Qwen3 and Gemma 3 only). AttentionCall holds the post-RoPE
  queries instead, which we un-rotate through the family's own RoPE (snapkv_lab.rope: Cohere's interleaved pairs,
  partial rotary, Gemma 3's per-layer-type bases, SmolLM3's unrotated layers). The same vectors (tested against a
  q_proj reference), with whatever the family puts between q_proj and RoPE (biases, q_norm: OLMo 2's too, which
  kvpress misses), and no projection re-run; they exist while decoding too, where no hidden states reach a scorer.
  The mean rotation R is likewise the family's own rotation (the identity on SmolLM3's layers without RoPE), where
  kvpress builds Llama's half-split rotation for every model. A RoPE this cannot reproduce is refused
  (snapkv_lab.rope.LayerRope.of: GPT-2 and other models without RoPE, DeepSeek's MLA, dynamic NTK scaling).
- Scaling: the layer's own (AttentionCall.attention.scaling) where kvpress divides by sqrt(head_dim). Equal on
  Llama-style layers; on Gemma 2/3 (query_pre_attn_scalar ** -0.5) and Granite (attention_multiplier) the layer's
  is the attention the model computes, whose expectation the method models. Logit soft-capping (Gemma 2) has no
  closed form and is ignored, as in kvpress.
- Precision: queries un-rotated in float32, their statistics accumulated in float64 and the scores in float32, where
  kvpress computes in the model dtype.
  (In bf16 the model's rotation rounds its queries to bf16, as kvpress's q_proj does; un-rotating them with float32
  cos and sin recovers them to that rounding.)
- Budgets: one no larger than n_sink is refused, where kvpress would then evict some of its sinks.
- Prompt chunks: the statistics are running sums (count, sum of queries, sum of their outer products) carried
  across the chunks of one prefill (AttentionCall.carry), so a prompt fed in chunks (a context, then a question)
  scores as one prefill of the whole, whatever else is recorded beside it: bit for bit when the chunks hand over
  the same queries and keys (the model's chunked forward itself rounds them a little differently in deeper
  layers). kvpress sees one prefill.
- Future positions start at the token after the call's last query (positions[-1] + 1): kvpress's q_len at prefill.
  While decoding (DecodingEviction; kvpress DecodingPress) the statistics are those of the queries generated since
  the last eviction, rotated from the next token on; kvpress starts at its buffer's length and drops the buffer's
  first n_sink rows, whatever their positions: here only rows at token positions < n_sink are left out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..core.checks import check_int
from ..core.rope import LayerRope
from . import query_statistics
from .base import ADDED_LATER, AttentionCall, Policy, budget_past_sinks
from .trained_weights import model_label, weights_path


@dataclass
class ExpectedAttention(Policy):
    """Expected attention of future queries (see module doc). score: (heads, n_keys) float32, +inf on the sinks."""

    kept_tail: int = 0
    n_future_positions: int = 512
    n_sink: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0
    # Where mu and Sigma come from. None: the prompt's own queries (the paper; ExpectedAttentionPress). "shipped":
    # precomputed for the model by kvpress's recipe (ExpectedAttentionStatsPress; policies.query_statistics: shipped
    # for the bundled models, else computed into the cache folder by scripts/query_statistics.py); a path: that file.
    statistics: str | None = field(default=None, metadata={ADDED_LATER: True})

    def __post_init__(self):
        super().__post_init__()
        check_int("n_sink", self.n_sink)
        check_int("n_future_positions", self.n_future_positions, 1)
        if self.statistics not in (None, "shipped") and not Path(self.statistics).is_file():
            raise ValueError(f"statistics must be None, 'shipped' or a statistics file, got {self.statistics!r}")

    def _statistics_path(self, model) -> Path:
        def refusal() -> str:
            name = model_label(model)
            return (f"{self.label}: no query statistics for the model {name!r} (kvpress's are on the Hugging Face Hub, "
                    f"for other models): compute them with `{query_statistics.COMMAND.format(model=name)}`, or pass "
                    "statistics=PATH")

        return weights_path(None if self.statistics == "shipped" else self.statistics,
                            lambda: query_statistics.find_statistics(model), refusal)

    def prepare(self, model, tokenizer) -> None:
        if self.statistics is not None:
            query_statistics.load_for(model, self._statistics_path(model), self.statistics)

    def budget(self, n_tokens: int) -> int | None:
        return budget_past_sinks(self, n_tokens)

    def score(self, call: AttentionCall) -> torch.Tensor:
        heads, _, d = call.query.shape
        kv_heads, n_keys = call.key.shape[:2]
        rope = LayerRope.of(call.module, d)
        mu, cov = self._query_statistics(call, rope)  # (heads, d), (heads, d, d) float64
        if n_keys <= self.n_sink:  # every key a sink (a prompt's first chunk): all kept
            return call.query.new_full((heads, n_keys), math.inf, dtype=torch.float32)
        future = torch.arange(self.n_future_positions, device=call.query.device) + int(call.positions[-1]) + 1
        rotation = rope.mean_rotation(future).to(mu.device)  # (d, d)
        keys = call.key[:, self.n_sink:].float()  # (kv_heads, n_keys - n_sink, d): the sinks stay out of the softmax
        groups = (mu @ rotation.T).float().view(kv_heads, heads // kv_heads, d)  # R mu per query head
        logits = torch.einsum("vnd,vgd->vgn", keys, groups) * call.attention.scaling
        if self.use_covariance:
            cov = (rotation @ cov @ rotation.T).float().view(kv_heads, heads // kv_heads, d, d)
            logits += torch.einsum("vnd,vgde,vne->vgn", keys, cov, keys) * (call.attention.scaling ** 2 / 2)
        scores = torch.softmax(logits, dim=-1)  # (kv_heads, groups, n_keys - n_sink)
        if self.use_vnorm:
            scores = (scores + self.epsilon) * call.value[:, None, self.n_sink:].float().norm(dim=-1)
        return torch.nn.functional.pad(scores.reshape(heads, -1), (self.n_sink, 0), value=math.inf)

    def _query_statistics(self, call: AttentionCall, rope: LayerRope) -> tuple[torch.Tensor, torch.Tensor]:
        """(mu (heads, d), Sigma (heads, d, d)) float64 of the pre-RoPE queries: the precomputed ones (`statistics`;
        Sigma with N - 1, as kvpress stores it) or this prompt's so far (Sigma biased, / count, as kvpress's)."""
        if self.statistics is not None:
            stored = query_statistics.stored(call.module, self.statistics)
            if stored is None:
                raise RuntimeError(f"{self.label}: the model was not prepared (policy.prepare(model, tokenizer)), so "
                                   f"layer {call.layer}'s query statistics are not loaded")
            return stored
        count, total, outer = self._statistics(call, rope)
        if count == 0 and call.n_keys > self.n_sink:
            raise ValueError(f"ExpectedAttention needs a query at a token position >= n_sink = {self.n_sink}")
        mu = total / max(count, 1)
        return mu, outer / max(count, 1) - mu[:, :, None] * mu[:, None, :]

    def _statistics(self, call: AttentionCall, rope: LayerRope) -> tuple[int, torch.Tensor, torch.Tensor]:
        """The running (count, sum (heads, d), sum of outer products (heads, d, d)) float64 of the pre-RoPE queries
        of this prompt so far: the carried ones plus this call's rows at token positions >= n_sink (stored back)."""
        fresh = call.positions >= self.n_sink
        # Un-rotated in float32 (5x faster than float64 on a CPU; the sums stay float64), as the model rotated them.
        query = rope.unrotate(call.query[:, fresh.to(call.query.device)].float(), call.positions[fresh]).double()
        count = call.carry.get("count", 0) + query.shape[1]
        total = query.sum(1) + call.carry.get("sum", 0)
        outer = query.transpose(1, 2) @ query + call.carry.get("outer", 0)
        call.carry.update(count=count, sum=total, outer=outer)  # new tensors: forks of a prefill share the old ones
        return count, total, outer
