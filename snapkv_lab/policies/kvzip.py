"""KVzip (Kim et al. 2025, arXiv 2505.23416): query-agnostic scores from reconstructing the context.

After the prompt's prefill the model is asked to repeat the context and is fed it again (teacher forcing) over the
full cache; a context position's score is the largest attention any reconstruction query pays it. It needs no
question, so one compressed context serves any. What the paper leaves open follows the official code,
snu-mllab/KVzip @5d84729 (cited as file:line):

- System prompt: the official prefill is [system prompt (template prefix), context] (model/wrapper.py:181-182);
  the system prompt is never evicted (attention/kvcache.py:27-38, :140-150) and is the softmax's sink keys
  (attention/score.py:47). Here: the chat template's head (`framing.chat_frame`) when the prompt starts with it,
  else the prompt's first 4 tokens stand in for it (kvpress's n_sink). `sinks=n`: kvpress's rule (KVzipPress).
- Reconstruction (model/wrapper.py:197-221): the context in chunks of 2000 tokens; chunk 0 is fed after
  "\\n\\nRepeat the previous context exactly." and the template's suffix (end of the user turn, assistant
  generation prompt), chunk i > 0 after "\\n\\nRepeat the part of the previous context exactly, starting with "
  + the last 8 tokens of chunk i - 1 + the suffix. A model without a chat template gets the official fallback
  suffix "\\n\\nAnswer: " (model/template.py:26-29).
- Each chunk's forward runs over the whole cache and is then cut off (model/wrapper.py:133-146), so every chunk's
  feed sits at the positions right after the prompt (the cache's length, attention/kvcache.py:108-112); near the
  model's context limit they run past it, as there (RoPE extrapolates).
- Score (attention/score.py:36-65, called with post-RoPE queries and keys, attention/attn.py:41-54): q.k over the
  keys [system prompt, the chunk being reconstructed, the feed itself (causal)] only, softmax, the chunk's
  columns, max over the feed's queries and the query heads of each KV head. A position is scored by its own
  chunk's reconstruction alone.
- Budget (attention/score.py:88-120, args.py `--level`, default `pair`): one selection over all layers x KV
  heads x positions, so heads and layers keep different counts; `allocation="uniform"` is `pair-uniform`.
  (`--level head`, context-independent head scores trained once per model, is another method: not here.)

Differences, by design: scores are float32 under the layer's own scaling and soft-cap (official: softmax in the
model's dtype, "not fp32", score.py:61, with logits / sqrt(head_dim), score.py:57: equal for Llama, Qwen, SmolLM2).
The global selection keeps exactly budget x layers x KV heads positions, kvpress's top count (kvzip_press.py:
384-387); the official threshold keeps the scores strictly above the int(N ratio) - 1-th largest (score.py:94-97),
one pair fewer (more on ties). The budget counts the whole prompt, system prompt and kept tail included (the
official ratio counts the context alone and keeps the system prompt on top). A question inside the prompt is
compressed as context: in the paper's protocol (query-agnostic) the question comes after compression, and
nothing after the context is kept by right (kept_tail 0).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from einops import rearrange

from ..core.attention import BLOCK_ELEMENTS, AttentionSettings
from ..core.checks import check_int
from ..core.feed_attention import attention_by_parts, by_parts_supported
from ..core.framing import chat_frame
from ..core.tokens import encode
from .base import ADDED_LATER, LayerBudget, Policy, Prompt
from .global_allocation import keep_globally

REPEAT_FIRST = "\n\nRepeat the previous context exactly."  # model/wrapper.py:211
REPEAT_NEXT = "\n\nRepeat the part of the previous context exactly, starting with "  # model/wrapper.py:214
# The later chunks' instruction per `repeat_prompts`: kvpress drops the space after "with" (kvzip_press.py:266).
REPEAT_NEXT_BY = {"official": REPEAT_NEXT, "kvpress": REPEAT_NEXT.rstrip(" ")}
OVERLAP = 8  # last tokens of the previous chunk quoted in the next chunk's instruction (wrapper.py:201, :216)
BASE_SUFFIX = "\n\nAnswer: "  # the official postfix of a model without a known template (model/template.py:29)
FALLBACK_SINKS = 4  # first tokens standing in for a system prompt the prompt lacks (kvpress n_sink)
ALLOCATIONS = ("global", "uniform")


@dataclass(frozen=True)
class Layout:
    """Where the parts of a prompt lie for the reconstruction, as token positions.

    protected: the first `protected` positions are always kept. sinks: the first `sinks` positions are the
    softmax's sink keys. start: the context reconstructed is positions start..n-1 (positions between
    `protected` and `start` are never scored: score 0). suffix: the template's end of a user turn, as ids."""

    protected: int
    sinks: int
    start: int
    suffix: list[int]


def template_frame(tokenizer, ids: torch.Tensor) -> tuple[int, list[int]]:
    """(head, suffix ids) for ids (batch, n): head = the length of the chat template's head when every row starts
    with it, 0 when none does (or the tokenizer has no template); suffix = the template's text after a user turn
    (the official fallback "\\n\\nAnswer: " without a template)."""
    if not getattr(tokenizer, "chat_template", None):
        return 0, encode(tokenizer, BASE_SUFFIX)
    head, tail = (encode(tokenizer, text) for text in chat_frame(tokenizer))
    starts = [row[:len(head)].tolist() == head for row in ids] if ids.shape[1] > len(head) else [False] * len(ids)
    if any(starts) != all(starts):
        raise ValueError("some rows of the batch start with the chat template's head and some do not: KVzip would "
                         "treat their system prompts differently; score them in separate batches")
    return (len(head) if all(starts) else 0), tail


def reconstruction_feeds(tokenizer, context: torch.Tensor, suffix: list[int], chunk_size: int,
                         repeat_next: str = REPEAT_NEXT):
    """[(start, end, feed)] for context (batch, c): chunk [start, end) of the context and the tokens fed to
    reconstruct it, (batch, m): the instruction (`repeat_next` quoting the previous chunk's last OVERLAP tokens after
    the first chunk), the suffix, the chunk (model/wrapper.py:18-37, :197-221)."""
    batch = context.shape[0]
    def as_ids(tokens):
        return torch.tensor(tokens, dtype=context.dtype, device=context.device).expand(batch, -1)

    first, suffix = as_ids(encode(tokenizer, REPEAT_FIRST)), as_ids(suffix)
    feeds = []
    for start in range(0, context.shape[1], chunk_size):
        end = min(start + chunk_size, context.shape[1])
        if start == 0:
            instruction = first
        else:
            previous = context[:, start - chunk_size:start]
            instruction = torch.cat([as_ids(encode(tokenizer, repeat_next)), previous[:, -OVERLAP:]], dim=1)
        feeds.append((start, end, torch.cat([instruction, suffix, context[:, start:end]], dim=1)))
    return feeds


def reconstruction_scores(query: torch.Tensor, key: torch.Tensor, sinks: int, chunk: slice,
                          settings: AttentionSettings, per_query_head: bool = False) -> torch.Tensor:
    """(kv_heads, chunk length) float32: the largest attention any feed query pays each position of `chunk`, over
    the queries and each KV head's query heads, the softmax restricted to [sinks, chunk, feed] (score.py:44-63).
    per_query_head: the largest over the queries alone, (heads, chunk length), query head h reading KV head
    h // (heads // kv_heads) (KVCompose reduces each group itself).

    query: (heads, m, head_dim) the feed's; key: (kv_heads, n + m, head_dim) the cache, then the feed. Computed
    by blocks of feed rows of at most BLOCK_ELEMENTS probabilities, each in four whole-block operations: on a
    shared CPU every operation waits for both of its threads, so fewer, larger ones are faster there."""
    kv_heads, (heads, m, _) = key.shape[0], query.shape
    # (kv, rows, group, d): a block of rows is one contiguous (kv, rows * group, d) matrix, multiplied without a copy
    grouped = rearrange(query.float() * settings.scaling, "(kv g) q d -> kv q g d", kv=kv_heads)
    keys = torch.cat([key[:, :sinks], key[:, chunk], key[:, -m:]], dim=1).float().mT  # (kv, d, keys)
    width = keys.shape[-1] - m  # sinks and chunk: every feed query sees them; the feed's own keys causally
    later = torch.ones(m, m, dtype=torch.bool, device=query.device).triu(1)  # (m, m): a feed key after the query
    best = torch.zeros(kv_heads, heads // kv_heads if per_query_head else 1, width - sinks, device=query.device)
    rows = max(1, BLOCK_ELEMENTS // (heads * keys.shape[-1]))
    for start in range(0, m, rows):
        stop = min(start + rows, m)
        block = grouped[:, start:stop]  # (kv, rows, g, d)
        logits = (block.flatten(1, 2) @ keys[..., :width + stop]).unflatten(1, block.shape[1:3])  # (kv, rows, g, seen)
        logits = _capped(logits, settings.softcap)
        logits[..., width:].masked_fill_(later[start:stop, None, :stop], -math.inf)  # only the feed's keys are causal
        probs = torch.softmax(logits, dim=-1)[..., sinks:width]  # (kv, rows, g, chunk)
        best = torch.maximum(best, probs.amax(1) if per_query_head else probs.amax(dim=(1, 2))[:, None])
    return best.flatten(0, 1)


def reconstruction_by_parts(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, sinks: int, chunk: slice,
                            settings: AttentionSettings,
                            per_query_head: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(output (m, heads, head_dim): the feed's attention, as the backend's up to rounding; scores (kv_heads, chunk
    length) float32, or (heads, chunk length) if per_query_head: `reconstruction_scores`'s) from the fused kernel's
    parts (core.feed_attention), where `by_parts_supported`. The restricted softmax's normaliser is the log-sum-exp
    over [sinks, chunk] and the feed's own keys, both parts of the attention the forward computes anyway; a
    probability is then exp(l - lse), and its largest over the queries is exp of the largest l - lse: one product
    over the chunk's keys (the feed's columns, half the former product, and the softmax drop out), its rows augmented
    by -lse, in blocks of at most BLOCK_ELEMENTS.

    query: (heads, m, head_dim) the feed's; key, value: (kv_heads, n + m, head_dim) the cache, then the feed."""
    kv_heads, dim, n = key.shape[0], key.shape[-1], key.shape[1] - query.shape[1]
    subset = torch.zeros(n, dtype=torch.bool, device=key.device)
    subset[:sinks] = subset[chunk] = True
    output, lse_subset, lse_own = attention_by_parts(query, key, value, subset, settings.scaling)
    normaliser = torch.logaddexp(lse_subset, lse_own)  # (heads, m)
    rows = torch.cat([(query * settings.scaling).reshape(kv_heads, -1, dim),  # (kv, group * m, d + 1): q, -lse
                      -normaliser.reshape(kv_heads, -1, 1)], dim=-1)
    runs = query.shape[0] // kv_heads if per_query_head else 1  # row runs maxed apart: each query head's m rows
    rows = rows.unflatten(1, (runs, -1))  # (kv, runs, rows per run, d + 1)
    columns = key[:, chunk]
    columns = torch.cat([columns, torch.ones_like(columns[..., :1])], dim=-1).mT  # (kv, d + 1, chunk): k, 1
    best = torch.full((kv_heads, runs, columns.shape[-1]), -torch.inf, device=key.device)
    step = max(1, BLOCK_ELEMENTS // (kv_heads * runs * columns.shape[-1]))
    for start in range(0, rows.shape[2], step):
        block = rows[:, :, start:start + step]  # (kv, runs, rows, d + 1); one run: a view, multiplied without a copy
        best = torch.maximum(best, (block.flatten(1, 2) @ columns).unflatten(1, block.shape[1:3]).amax(2))
    return output, best.flatten(0, 1).exp_()


def _capped(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Gemma 2's logit soft-capping, in place (attention.py's convention)."""
    return logits if softcap is None else logits.div_(softcap).tanh_().mul_(softcap)


@dataclass
class KVzip(Policy):
    """KVzip as its paper and official code run it (see module doc). Cost, paid in selection_seconds: one forward
    per chunk, each feed attending to the whole prompt (chunks x m x (n + m) attention entries: 2.9x a 4k
    prefill's n^2 / 2, 2.5x an 8k one's), then the scores: for float32 layers on a CPU from the forward's own
    attention parts (`reconstruction_by_parts`: one product over the chunk's keys), else a softmax over [sinks,
    chunk, feed] per chunk (`reconstruction_scores`); while a chunk runs the cache also holds its feed (a fork, then
    dropped). Measured on SmolLM2 fp32, 2 CPU cores (2026-11-24, benchmarks/bench_policies.py on a quiet machine,
    before the parts): 3.1x / 4.1x / 3.5x the prefill at 2k / 4k / 8k tokens, the forwards alone 1.9-2.8x
    (measured beside other jobs); with the parts, docs/performance.md ("KVzip's reconstruction by parts"). The paper
    reports about 2x on GPUs with 8B models, whose prefill is mostly MLP; SmolLM2's on a CPU is mostly attention.

    chunk_size: context tokens reconstructed per forward (official 2000, wrapper.py:200; kvpress 2048).
    sinks: None: the system prompt (the chat template's head when the prompt starts with it, else the first 4
        tokens) is kept whole, left out of the reconstruction and used as the softmax's sink keys, as the
        official template prefix. An int n: kvpress's n_sink: the first n tokens are kept, the softmax's sink
        keys are the first min(n, head) tokens, the reconstruction starts after the chat template's head (at 0
        without one), and head tokens beyond the first n are never scored (score 0, so evicted first)
        (kvpress/presses/kvzip_press.py:193, :307, :342, :376).
    allocation: "global" (official `pair`, kvpress layerwise=False): one selection of budget x layers x KV heads
        positions over all of them; "uniform" (official `pair-uniform`): each layer and KV head keeps the budget.
        Head-adaptive budgets within each layer: AdaKV(policy=KVzip(allocation="uniform")), close to kvpress's
        layerwise=True with alpha_safeguard=0. A wrapper that budgets or ranks by itself refuses the global selection
        (it would replace it); those that keep what KVzip keeps (Merging, KeyRerotation) carry it (policies.wrapper).
    kept_tail: 0: nothing after the context is kept by right (official: the question comes after scoring).
    repeat_prompts: "official": the later chunks' instruction ends "starting with " before the quoted tokens
        (model/wrapper.py:214); "kvpress": without that space (kvpress/presses/kvzip_press.py:266). Prompts of one
        chunk never read it.
    """

    kept_tail: int = 0
    chunk_size: int = 2000
    sinks: int | None = None
    allocation: str = "global"
    repeat_prompts: str = field(default="official", metadata={ADDED_LATER: True})

    needs: ClassVar[frozenset[str]] = frozenset({"feed"})  # a reconstruction forward over the cached prompt
    scores_query_heads: ClassVar[bool] = False  # the largest attention over each KV head's query heads

    def __post_init__(self):
        super().__post_init__()
        check_int("chunk_size", self.chunk_size, 1)
        check_int("sinks", self.sinks, 0, optional=True)
        if self.allocation not in ALLOCATIONS:
            raise ValueError(f"allocation must be one of {ALLOCATIONS}, got {self.allocation!r}")
        if self.repeat_prompts not in REPEAT_NEXT_BY:
            raise ValueError(f"repeat_prompts must be one of {tuple(REPEAT_NEXT_BY)}, got {self.repeat_prompts!r}")

    @property
    def selects_across_layers(self) -> bool:
        return self.allocation == "global"

    @property
    def scoring_key(self) -> str:
        """The kept tail and the allocation act after scoring: variants differing only in them share one pass."""
        return Policy.scoring_key.fget(dataclasses.replace(self, kept_tail=0, allocation="global"))

    def layout(self, tokenizer, ids: torch.Tensor) -> Layout:
        """Where the system prompt, sink keys and context of ids (batch, n) lie (see `sinks`)."""
        head, suffix = template_frame(tokenizer, ids)
        if self.sinks is not None:
            return Layout(protected=self.sinks, sinks=min(self.sinks, head), start=head, suffix=suffix)
        system = head or min(FALLBACK_SINKS, ids.shape[1])
        return Layout(protected=system, sinks=system, start=system, suffix=suffix)

    def prompt_scores(self, prompt: Prompt) -> dict[int, torch.Tensor]:
        """{layer: (1, kv_heads, n)} float32 for a prompt (1, n): reconstruction scores of the context, +inf on the
        protected positions, 0 on those never scored, from the reconstruction forwards the engine feeds over a fork of
        the prompt's cache (`prompt.feed`). Sliding-window layers are left out (never compressed)."""
        ids, n = prompt.ids, prompt.n_tokens
        layout = self.layout(prompt.tokenizer, ids)
        scores = {i: torch.zeros(1, layer.keys.shape[1], n, device=ids.device)
                  for i, layer in enumerate(prompt.cache.layers) if not getattr(layer, "is_sliding", False)}
        for start, end, feed in reconstruction_feeds(prompt.tokenizer, ids[:, layout.start:], layout.suffix,
                                                     self.chunk_size, REPEAT_NEXT_BY[self.repeat_prompts]):
            chunk = slice(layout.start + start, layout.start + end)

            def record(module, query, key, value, settings):
                if settings.sliding_window is not None:
                    return None  # never compressed: the backend attends
                if by_parts_supported(query, settings):
                    output, scores[module.layer_idx][0, :, chunk] = reconstruction_by_parts(
                        query[0], key[0], value[0], layout.sinks, chunk, settings)
                    return output[None]
                scores[module.layer_idx][0, :, chunk] = reconstruction_scores(query[0], key[0], layout.sinks, chunk,
                                                                               settings)
                return None

            prompt.feed(feed, torch.arange(n, n + feed.shape[1], device=ids.device)[None], record)
        for layer_scores in scores.values():
            layer_scores[..., :layout.protected] = math.inf
        return scores

    def ranked(self, scores, budget: LayerBudget) -> torch.Tensor:
        """The base ranking; refused when a row's protected positions outnumber its prefix budget."""
        ranked = super().ranked(scores, budget)
        protected = int((ranked == math.inf).sum(-1).max())
        room = min(self.head_budgets(scores, budget))
        if protected > room:
            raise ValueError(f"{self.label} keeps {protected} protected positions (the system prompt or sinks) of a "
                             f"{budget.tokens}-token prompt, more than the {room} its budget leaves per head: raise "
                             "the capacity or set sinks=")
        return ranked

    def keep_layers(self, scores: dict[int, torch.Tensor], budget: LayerBudget) -> dict[int, torch.Tensor]:
        """{layer: (kv_heads, widest) kept positions}. allocation="global": one top count of budget x layers x KV
        heads over every layer's and head's ranking, then each row keeps its share (kvpress kvzip_press.py:384-387;
        official score.py:88-102 thresholds instead); "uniform": each layer by `keep`."""
        if self.allocation == "uniform":
            return super().keep_layers(scores, budget)
        return keep_globally(self, scores, budget)
