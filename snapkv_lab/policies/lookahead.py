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
  kept, then the window. window_size 0 is LAQ, the paper's method; 8 is LAQ++, `LookaheadQCache(window_size=8)`.
  run_LAQ.sh:42 reads `stage2_window_size=8 # This window_size is used in the decoding stage, and it is set to 0 for
  LAQ, 8 for LAQ.` (sic: both named LAQ), and 8 is also run_longbench_LAQ.py's default (:420): the official script
  runs the 8-token window.

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
the first drafted token from its final hidden state, the lookahead from the engine's drafting function (`Prompt.draft`:
compress, decode, hand back the queries); the votes are SnapKV's over the voters. Scoring costs the draft's
selection, `lookahead_size` decode steps over the draft cache and one softmax per voter, paid in selection_seconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..core.checks import check_int
from .base import AttentionCall, Policy, Prompt
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

    # the votes need the prompt's last queries, a drafted answer from the prefill's final hidden state
    needs: ClassVar[frozenset[str]] = frozenset({"final_hidden", "last_queries", "draft"})

    def __post_init__(self):
        check_int("lookahead_size", self.lookahead_size, 1)
        check_int("lookahead_window", self.lookahead_window, 1)
        check_int("window_size", self.window_size)
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
            raise ValueError(f"{self.label} keeps {budget} positions of a {n_tokens}-token prompt, no more than its "
                             f"draft SnapKV's window (lookahead_window={self.lookahead_window}): raise the capacity or "
                             "lower lookahead_window")
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

    def prompt_scores(self, prompt: Prompt) -> dict[int, torch.Tensor]:
        """{layer: (1, heads, n)} float32 votes of every full-attention layer for a prompt (1, n), from the prompt's
        last queries (`prompt.last_queries`) and the queries of the answer drafted over the draft cache
        (`prompt.draft`, from the prefill's final hidden state)."""
        queries = prompt.last_queries
        if not queries or prompt.final_hidden is None:
            raise ValueError(f"{self.label} votes with the prefill's last queries and drafts from its final hidden "
                             "states, which the engine keeps: run it through snapkv_lab.generate or compare")
        held = min(query.shape[1] for query, _, _ in queries.values())
        if held < self.voters:
            raise ValueError(f"{self.label} reads the prompt's last {self.voters} queries; the prefill kept {held}")
        n, draft = prompt.n_tokens, self.draft()
        draft_votes = {layer: draft.score(self._call(prompt, layer, query, slots, settings))[None]
                       for layer, (query, slots, settings) in queries.items()}
        # A row that fits its budget (in a padded batch) keeps everything whatever its scores; a first token that
        # ends the answer drafts nothing, and the answer is empty whatever is kept: the draft's votes stand.
        lookahead = {} if self.budget(n) is None else prompt.draft(draft, draft_votes, self.lookahead_size)
        if not lookahead:
            return draft_votes
        scores = {}
        for layer, (query, slots, settings) in queries.items():
            voters = torch.cat([query[:, query.shape[1] - self.window_size:], lookahead[layer]], dim=1)
            if self.mask == "causal":  # a lookahead query sees every prompt key, as the prompt's last one does
                positions = torch.cat([slots[len(slots) - self.window_size:],
                                       slots.new_full((lookahead[layer].shape[1],), n - 1)])
            else:  # the official mask: the voters as if they were the prompt's last tokens
                positions = torch.arange(n - voters.shape[1], n, device=slots.device)
            votes = SnapKV(window_size=voters.shape[1])  # every voter votes: SnapKV's mean attention over them
            scores[layer] = votes.score(self._call(prompt, layer, voters, positions, settings))[None]
        return scores

    @staticmethod
    def _call(prompt: Prompt, layer: int, query: torch.Tensor, slots: torch.Tensor, settings) -> AttentionCall:
        """The attention call of `query` (heads, rows, head_dim) at `slots` over the prompt's cached keys of `layer`."""
        cached = prompt.cache.layers[layer]
        return AttentionCall(query, cached.keys[0], cached.values[0], slots, settings, None, layer,
                             prompt.model.config.num_hidden_layers)
