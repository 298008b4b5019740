"""Lookahead Q-Cache (Wang et al. 2025, arXiv 2505.20334): a drafted answer's queries as the observation window.

SnapKV's voters are the prompt's last queries, which are not the queries the answer will ask. LAQ drafts the answer's
first tokens and lets their queries vote: it compresses the prompt's cache once with SnapKV (the draft cache), decodes a
few tokens greedily over it, and ranks the full prompt cache by the attention those pseudo queries pay it. The draft
cache and the drafted tokens are then dropped; the answer is decoded from the prefill's own logits over the cache LAQ
kept. As the official code runs it, noforit/Lookahead_Q-Cache @74612bd (cited as file:line):

- Draft (pyramidkv/llama_model.py:3113-3151, select_KV_lookahead_stage): SnapKV at the same budget (run_LAQ.sh:
  lookahead_max_capacity_prompts = max_capacity_prompts) with a window of 32 (lookahead_window_size), max-pooled over
  7 positions (pyramidkv/pyramidkv_utils.py:553-596, SnapKVCluster.update_kv).
- Lookahead (llama_model.py:3271-3289): the first token is the prefill's argmax; each drafted token is fed greedily over
  the draft cache at the positions after the prompt, until `lookahead_size` tokens (8) were fed or an EOS comes.
- Votes (pyramidkv_utils.py:598-656, update_kv_LAQ): the prompt's last `window_size` queries and the lookahead queries
  (post-RoPE, llama_model.py:3036-3049) attend to the full prompt's keys alone (the drafted tokens' keys are not among
  them), summed over the voters, max-pooled (kernel 7); the top budget - window_size positions before the window are
  kept, then the window. window_size 0 is LAQ, the paper's method; 8 is LAQ++ (run_LAQ.sh, stage2_window_size: "8 for
  LAQ++, 0 for LAQ"), `LookaheadQCache(window_size=8)`.

Differences, named:
- GQA: the official repeats the KV heads, so each query head keeps its own selection (`per_query_head=True`, for the
  draft and the votes); the default pools each KV head's query heads (mean), as the lab's SnapKV, so a GQA cache
  really shrinks.
- Mask: update_kv_LAQ lays a causal mask over the last (window_size + k) prompt keys as if the k lookahead queries were
  prompt tokens (pyramidkv_utils.py:606-612): a prompt voter then misses its own last k keys, lookahead query j the
  last k - 1 - j prompt keys. `mask="causal"` (default) lets each voter see every prompt key up to its own position
  (a lookahead query: all of them), as the paper describes; `mask="official"` is the code's.
- EOS: the model's end-of-answer ids (its generation config's and the tokenizer's; official: the tokenizer's), and a
  first token that is one is not fed (official: fed), which leaves an empty answer either way.
- Votes are averaged over the voters (official: summed): the same ranking.
The prompt's last queries come from the prefill itself (the score recorder keeps the last `voters` of every layer),
the first drafted token from its final hidden state: scoring costs the draft's selection, `lookahead_size` decode
steps over the draft cache and one softmax per voter, paid in selection_seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ..core.hooks import intercept_attention
from ..core.inputs import eos_ids
from ..core.selection import window_votes
from .base import AttentionCall, Policy
from .snapkv import SnapKV

MASKS = ("causal", "official")


@dataclass
class LookaheadQCache(Policy):
    """LAQ (see module doc): the top positions by the votes of a drafted answer's queries (and of the prompt's last
    `window_size` queries), max-pooled over `kernel_size`; the last `window_size` prompt tokens kept.

    lookahead_size: tokens drafted and fed over the draft cache (official 8). lookahead_window: the draft SnapKV's
    observation window (official 32). window_size: the prompt's last queries voting beside the lookahead ones, and kept
    (0: LAQ; 8: LAQ++). kept_tail: None keeps the window, as the official; an int is our variant. mask: see module doc.
    """

    kept_tail: int | None = None
    pooling: str | None = "max"
    kernel_size: int = 7
    window_size: int = 0
    lookahead_size: int = 8
    lookahead_window: int = 32
    mask: str = "causal"

    scores_after_prefill: ClassVar[bool] = True  # the votes need the whole prompt's cache and a drafted answer
    reads_final_hidden: ClassVar[bool] = True  # the first drafted token is the prefill's argmax

    def __post_init__(self):
        for name in ("lookahead_size", "lookahead_window"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(self.window_size, int) or isinstance(self.window_size, bool) or self.window_size < 0:
            raise ValueError(f"window_size must be a non-negative int, got {self.window_size!r}")
        if self.mask not in MASKS:
            raise ValueError(f"mask must be one of {MASKS}, got {self.mask!r}")
        super().__post_init__()

    def tail(self, budget: int) -> int:
        return self.window_size if self.kept_tail is None else self.kept_tail

    def tail_setting(self, budget: int) -> str:
        return f"window_size ({self.window_size})" if self.kept_tail is None else super().tail_setting(budget)

    def budget(self, n_tokens: int) -> int | None:
        """The base budget; refused where it leaves the draft SnapKV no position beside its window."""
        budget = super().budget(n_tokens)
        if budget is not None and budget <= self.lookahead_window:
            raise ValueError(f"{self.label} keeps {budget} positions of a {n_tokens}-token prompt, no more than its draft "
                             f"SnapKV's window (lookahead_window={self.lookahead_window}): raise the capacity or lower "
                             "lookahead_window")
        return budget

    @property
    def voters(self) -> int:
        """The prompt's last queries scoring reads: the draft's window and the prompt voters of the votes."""
        return max(self.lookahead_window, self.window_size)

    @property
    def scoring_key(self) -> str:
        """The whole label: the draft cache, hence the lookahead queries and the scores, depend on the budget and
        the GQA layout."""
        return self.label

    def draft(self) -> SnapKV:
        """The SnapKV that compresses the cache the lookahead is decoded over."""
        return SnapKV(capacity=self.capacity, window_size=self.lookahead_window, per_query_head=self.per_query_head,
                      gqa=self.gqa)

    def prompt_scores(self, model, tokenizer, ids: torch.Tensor, cache) -> dict[int, torch.Tensor]:
        """{layer: (batch, heads, n)} float32 votes for ids (batch, n) prefilled into `cache` (left unchanged), every
        full-attention layer. `cache` must carry what SharedPrefill hands on: the prompt's last queries
        (`cache.voter_queries`) and final hidden states (`cache.final_hidden`)."""
        from ..compression.layers import row_cache  # compression imports policies: import at call time

        queries, hidden = getattr(cache, "voter_queries", None), getattr(cache, "final_hidden", None)
        if not queries or hidden is None:
            raise ValueError(f"{self.label} votes with the prefill's last queries and drafts from its final hidden "
                             "states, which SharedPrefill keeps: run it through snapkv_lab.generate or compare")
        held = min(query.shape[2] for query, _, _ in queries.values())
        if held < self.voters:
            raise ValueError(f"{self.label} reads the prompt's last {self.voters} queries; the prefill kept {held}")
        rows = [self._row_scores(model, tokenizer, ids[b:b + 1], row_cache(cache, b, 0)) for b in range(ids.shape[0])]
        return {layer: torch.cat([row[layer] for row in rows]) for layer in rows[0]}

    def _row_scores(self, model, tokenizer, ids: torch.Tensor, cache) -> dict[int, torch.Tensor]:
        """prompt_scores for one row: ids (1, n), its batch-1 cache."""
        n, n_layers, draft = ids.shape[1], model.config.num_hidden_layers, self.draft()
        draft_votes = {layer: draft.score(AttentionCall(query[0], cache.layers[layer].keys[0], cache.layers[layer].values[0],
                                                        slots, settings, None, layer, n_layers))[None]
                       for layer, (query, slots, settings) in cache.voter_queries.items()}
        # A row that fits its budget (in a padded batch) keeps everything whatever its scores; a first token that
        # ends the answer drafts nothing, and the answer is empty whatever is kept: the draft's votes stand.
        lookahead = {} if self.budget(n) is None else self.lookahead_queries(model, tokenizer, n, cache, draft,
                                                                             draft_votes)
        if not lookahead:
            return draft_votes
        scores = {}
        for layer, (query, slots, settings) in cache.voter_queries.items():
            prompt = query[0, :, query.shape[2] - self.window_size:]
            voters = torch.cat([prompt, lookahead[layer]], dim=1)  # (heads, window_size + k, head_dim)
            if self.mask == "causal":  # a lookahead query sees every prompt key, as the prompt's last one does
                positions = torch.cat([slots[len(slots) - self.window_size:],
                                       slots.new_full((lookahead[layer].shape[1],), n - 1)])
            else:  # the official mask: the voters as if they were the prompt's last tokens
                positions = torch.arange(n - voters.shape[1], n, device=slots.device)
            votes = window_votes(voters, cache.layers[layer].keys[0], settings.scaling, positions, n, **settings.options())
            scores[layer] = (votes / voters.shape[1])[None]
        return scores

    def lookahead_queries(self, model, tokenizer, n: int, cache, draft: SnapKV, draft_votes: dict) -> dict[int, torch.Tensor]:
        """{layer: (heads, k, head_dim)} post-RoPE queries of the k <= lookahead_size drafted tokens, fed greedily over
        the draft cache at positions n, n + 1, ...; empty when the first token is an EOS. The draft cache: the full
        `cache` of one n-token row, compressed by `draft` (this policy's `draft()`) from its votes ({layer: (1, heads, n)})."""
        from ..compression.compressor import applied
        from ..compression.generation import greedy_decode
        from ..compression.recorder import kept_from_scores
        from ..compression.shared import compressed_state

        n_layers = model.config.num_hidden_layers
        kept = kept_from_scores(draft, draft_votes, n, cache.layers[min(draft_votes)].keys.shape[1], n_layers)
        state = compressed_state(draft, cache, kept, n, n_layers, set(range(len(cache.layers))) - set(draft_votes))
        drafted = {layer: [] for layer in draft_votes}

        def record(module, query, key, value, attention_mask, **kwargs):
            if module.layer_idx in drafted:
                drafted[module.layer_idx].append(query[0, :, -1:])

        logits = model.get_output_embeddings()(cache.final_hidden[:, -1]).float()
        with applied(model, state), intercept_attention(model, record):
            greedy_decode(model, state.cache, logits, n, self.lookahead_size + 1, eos_ids(model, tokenizer))
        return {layer: torch.cat(rows, dim=1) for layer, rows in drafted.items() if rows}
