"""How much of the generation's attention to the prompt a compression policy's kept positions hold.

    trace = capture(model, tokenizer, prompt_ids, max_new_tokens=32)           # full cache, every query row
    run = generate(model, tokenizer, prompt_ids, policy=SnapKV(capacity=256), max_new_tokens=32)
    table = attention_coverage(trace, run)          # or run.kept_indices

One tidy row per (layer, query head, sinks variant). With attn the generated rows' attention over the
prompt's eligible positions, renormalised per row to sum to 1 (eligible: all prompt positions, or with
sinks="excluded" all but the sinks of metrics.SinkRule):
- coverage = mean over generated rows of attn on the kept positions: the share of the prompt attention
  the compressed cache would still serve, had the full cache's attention been the same;
- oracle = the same for the best fixed set of the same size in hindsight: the k eligible positions with
  the largest renormalised attention summed over the generated rows (k = the head's kept count). Ranking
  by the renormalised sum makes it the exact maximum of coverage over all k-sets, so coverage <= oracle;
- chance = k / eligible: the expected coverage of k uniformly random eligible positions.
Sinks are found, as in metrics.py, on the generated rows' attention over the prompt; with sinks
"excluded" they leave the numerator, the denominator, the kept set and the oracle's candidates alike, so
`kept` counts only eligible kept positions there.
"""

from __future__ import annotations

import pandas as pd
import torch

from ..compression.kept import kept_mask
from ..core.overlap import SinkRule
from ..core.trace import AttentionTrace

COLUMNS = ["layer", "head", "kv_head", "sinks", "kept", "eligible", "coverage", "oracle", "chance"]


def attention_coverage(trace, kept, *, sinks: SinkRule = SinkRule()) -> pd.DataFrame:
    """Coverage of the generation's prompt attention by a policy's kept positions, against oracle and chance.

    trace: a full-cache AttentionTrace of a prompt and its generation (`capture`), with >= 1 generated row,
        or its GenerationAttention (reduced once, for many policies' kept positions against one trace).
    kept: a GenerationResult of the same prompt (`generate(..., policy=...)`), or its `kept_indices`: one
        (batch, kv_heads or heads, k) long tensor per layer of `trace.layers`, in that order. Batch row 0
        is used. Rows of head-wise budgets are padded with -1 and positions >= trace.prompt_len (generated
        positions held after eviction while decoding) are not prompt: both are ignored. With kv_heads rows,
        query head h uses row h // (heads // kv_heads); with heads rows, its own.
        A GenerationResult's prompt must equal the trace's; plain kept_indices cannot be checked, so kept
        positions of a longer prompt that fall at or past trace.prompt_len would be silently dropped
        (in query-agnostic mode the kept positions are the context's: the question's count as not kept).
        Or a mask from `kept.kept_mask` ((layers, rows, prompt) bool), e.g. of a CompressionState with
        whole_from= the compressed length, which counts the appended question as held.
    sinks: the SinkRule of the "excluded" rows (that of the GenerationAttention when one is passed).
    Returns a DataFrame with COLUMNS, rows ordered by layer, head, sinks ("kept", then "excluded"). A head
    whose generated rows see no eligible prompt position (a sliding-window layer) gets NaN coverage and
    oracle; no eligible position at all, NaN chance.
    Memory: per layer the (heads, generated, prompt) attention block, recomputed blockwise by the trace.
    """
    attention = GenerationAttention.of(trace, sinks)
    selected_all = kept_mask_for(attention.trace, kept)  # (layers, rows, prompt) bool, batch row 0
    heads = attention.trace.n_heads
    kv_head = torch.arange(heads) // (heads // attention.trace.n_kv_heads)
    out = []
    for entry, layer in enumerate(attention.trace.layers):
        selected = _per_query_head(selected_all[entry], heads)
        for label, reduced in attention.layers[entry].items():
            parts = reduced.coverage(selected)
            for h in range(heads):
                out.append(dict(layer=layer, head=h, kv_head=int(kv_head[h]), sinks=label,
                                **{name: value[h].item() for name, value in parts.items()}))
    return pd.DataFrame(out, columns=COLUMNS)


class ReducedAttention:
    """One layer's generated rows' attention over the prompt, for one eligible set, reduced to what coverage
    needs. Coverage is linear in the rows, so the sum over rows of the renormalised shares is enough:

    column (heads, prompt): the eligible positions' renormalised share summed over the generated rows;
    n_rows (heads,): rows that see an eligible position (sliding windows may not) and so vote;
    best (heads, prompt + 1): best[:, k] the sum of the k largest columns, the oracle's numerator.
    """

    def __init__(self, attn: torch.Tensor, eligible: torch.Tensor):
        """attn (heads, rows, prompt) as the trace gives it; eligible (heads, prompt) bool."""
        share = _renormalised(attn, eligible)  # (heads, rows, prompt), rows sum to 1 or 0
        self.eligible = eligible
        self.n_rows = (share.sum(-1) > 0).sum(-1).float()
        self.column = share.sum(1)
        ranked = self.column.masked_fill(~eligible, float("-inf")).sort(dim=-1, descending=True).values
        best = ranked.clamp(min=0).cumsum(-1)  # -inf -> 0: never past k anyway
        self.best = torch.cat([torch.zeros_like(best[:, :1]), best], dim=-1)

    def coverage(self, selected: torch.Tensor) -> dict[str, torch.Tensor]:
        """selected (heads, prompt) bool kept positions -> kept, eligible, coverage, oracle, chance, each (heads,)."""
        selected = selected & self.eligible
        defined = self.n_rows > 0
        k = selected.sum(-1)
        n_eligible = self.eligible.sum(-1)
        nan = torch.tensor(float("nan"))
        return dict(kept=k, eligible=n_eligible,
                    coverage=torch.where(defined, (self.column * selected).sum(-1) / self.n_rows, nan),
                    oracle=torch.where(defined, self.best.gather(-1, k[:, None]).squeeze(-1) / self.n_rows, nan),
                    chance=torch.where(n_eligible > 0, k / n_eligible.clamp(min=1), nan))

    def share_on(self, positions: torch.Tensor) -> torch.Tensor:
        """(heads, prompt) bool -> (heads,): mean over generated rows of the share on those positions."""
        return (self.column * (positions & self.eligible)).sum(-1) / self.n_rows.clamp(min=1)


class GenerationAttention:
    """A trace's generated rows' attention over the prompt, reduced once per layer for the sinks-kept and the
    sinks-excluded eligible sets (`layers[i]["kept" | "excluded"]`: ReducedAttention), so that the coverage of
    many kept sets against one trace costs no attention recomputation."""

    def __init__(self, trace: AttentionTrace, sinks: SinkRule = SinkRule(), *, context: int | None = None):
        """context: only the prompt's first `context` positions are eligible (a context before its question, whose
        question a policy never evicts: coverage then reads as the share of the attention paid to the context)."""
        _require_generated(trace)
        if context is not None and not 0 < context <= trace.prompt_len:
            raise ValueError(f"context must be 1..{trace.prompt_len} prompt positions, got {context}")
        self.trace, self.sinks, self.layers = trace, sinks, []
        for layer in trace.layers:
            # (heads, generated, prompt): the rows are normalised over all keys they see, prompt and generated.
            attn = trace.attention(layer, queries=trace.generated, keys=trace.prompt).cpu()
            sink = sinks.mask(attn)  # (heads, prompt)
            eligible = torch.ones_like(sink)
            if context is not None:
                eligible[:, context:] = False
            self.layers.append({"kept": ReducedAttention(attn, eligible),
                                "excluded": ReducedAttention(attn, eligible & ~sink)})

    @classmethod
    def of(cls, trace, sinks: SinkRule) -> GenerationAttention:
        """`trace` itself when already reduced (its own sink rule must be `sinks`), else its reduction."""
        if isinstance(trace, GenerationAttention):
            if trace.sinks != sinks:
                raise ValueError(f"the GenerationAttention was reduced with {trace.sinks}, not {sinks}")
            return trace
        return cls(trace, sinks)


def _require_generated(trace: AttentionTrace) -> None:
    if trace.n_generated < 1:
        raise ValueError(f"the trace has no generated rows (prompt_len {trace.prompt_len} = n_tokens): "
                         "capture it with max_new_tokens >= 1")


def _renormalised(attn: torch.Tensor, eligible: torch.Tensor) -> torch.Tensor:
    """attn (heads, rows, prompt) renormalised per row over the eligible (heads, prompt) positions; a row
    that sees none stays all zero."""
    masked = attn * eligible[:, None]
    return masked / masked.sum(-1, keepdim=True).clamp(min=torch.finfo(attn.dtype).tiny)


def _per_query_head(selected: torch.Tensor, heads: int) -> torch.Tensor:
    """(kv_heads or heads, prompt) kept sets -> (heads, prompt): each query head's (its KV head's) set."""
    return selected[torch.arange(heads) // (heads // selected.shape[0])]


def kept_mask_for(trace: AttentionTrace, kept) -> torch.Tensor:
    """(layers, kv_heads or heads, prompt) bool: `kept.kept_mask` of batch row 0 of a GenerationResult or its
    kept_indices, checked against the trace (layers, shapes, the result's prompt); a mask already made (bool,
    that shape) is checked for its shape only."""
    if isinstance(kept, torch.Tensor) and kept.dtype == torch.bool:
        if kept.ndim != 3 or kept.shape[0] != trace.n_layers or kept.shape[1] not in (trace.n_kv_heads, trace.n_heads) \
                or kept.shape[2] != trace.prompt_len:
            raise ValueError(f"a kept mask has shape {tuple(kept.shape)}; expected ({trace.n_layers}, "
                             f"{trace.n_kv_heads} or {trace.n_heads}, {trace.prompt_len}) for this trace")
        return kept.cpu()
    kept_indices, batch_rows = _kept_indices(trace, kept)
    if len(kept_indices) != trace.n_layers:
        raise ValueError(f"kept has {len(kept_indices)} layers but the trace records {trace.n_layers} "
                         f"(layers {trace.layers}); pass [kept[layer] for layer in trace.layers] for a partial trace")
    for layer, rows in zip(trace.layers, kept_indices):
        if rows.ndim != 3 or rows.shape[0] != batch_rows or rows.shape[1] not in (trace.n_kv_heads, trace.n_heads):
            raise ValueError(f"kept[{layer}] has shape {tuple(rows.shape)}; expected ({batch_rows}, "
                             f"{trace.n_kv_heads} or {trace.n_heads}, k)")
        if rows.is_floating_point():
            raise TypeError(f"kept[{layer}] must hold integer positions, got {rows.dtype}")
    return kept_mask(kept_indices, trace.prompt_len)


def _kept_indices(trace: AttentionTrace, kept) -> tuple[list[torch.Tensor], int]:
    """kept_indices and their batch size, from a GenerationResult (its prompt checked) or the list itself."""
    prompt_ids = getattr(kept, "prompt_ids", None)
    kept_indices = list(getattr(kept, "kept_indices", kept))
    if not kept_indices or not all(isinstance(rows, torch.Tensor) for rows in kept_indices):
        raise TypeError("kept must be a GenerationResult or its kept_indices: a non-empty list of tensors, "
                        "one per layer")
    batch_rows = kept_indices[0].shape[0] if kept_indices[0].ndim else 0
    if batch_rows < 1:
        raise ValueError(f"kept[0] has shape {tuple(kept_indices[0].shape)}: no batch row to read")
    if prompt_ids is not None:
        prompt_ids = torch.as_tensor(prompt_ids).cpu()
        if prompt_ids.ndim != 2 or prompt_ids.shape[0] != batch_rows:
            raise ValueError(f"the result's prompt_ids {tuple(prompt_ids.shape)} and kept_indices "
                             f"({batch_rows} batch rows) disagree")
        ours = trace.token_ids[: trace.prompt_len].cpu()
        if prompt_ids.shape[1] != trace.prompt_len or not torch.equal(prompt_ids[0], ours.to(prompt_ids.dtype)):
            raise ValueError(f"the result's prompt ({prompt_ids.shape[1]} tokens, batch row 0) is not the trace's "
                             f"({trace.prompt_len} tokens): its kept positions index another sequence")
    return kept_indices, batch_rows


def span_attention(trace, span: tuple[int, int], kept=None, *,
                   sinks: SinkRule = SinkRule()) -> pd.DataFrame:
    """How much of the generation's prompt attention lands on a span of the prompt (e.g. the needle's value),
    and, given a policy's kept positions, how much of that the kept ones hold.

    trace: an AttentionTrace or its GenerationAttention (as in attention_coverage).
    span: [start, end) prompt positions. kept: None, a GenerationResult of the same prompt or its kept_indices
    (as in attention_coverage). Attention is renormalised per generated row over the eligible prompt positions
    (sinks of `sinks` excluded, as attention_coverage's "excluded" rows).
    Returns one row per (layer, head): layer, head, kv_head, span_share (mean over generated rows of the
    span's share), and with kept: span_kept_share (the share on kept span positions, <= span_share) and
    span_kept (the fraction of the span's positions the head kept).
    """
    attention = GenerationAttention.of(trace, sinks)
    trace = attention.trace
    start, end = span
    if not 0 <= start < end <= trace.prompt_len:
        raise ValueError(f"span {span} is not a non-empty range of the {trace.prompt_len}-token prompt")
    selected_all = None if kept is None else kept_mask_for(trace, kept)
    heads = trace.n_heads
    kv_head = torch.arange(heads) // (heads // trace.n_kv_heads)
    in_span = torch.zeros(heads, trace.prompt_len, dtype=torch.bool)
    in_span[:, start:end] = True
    out = []
    for entry, layer in enumerate(trace.layers):
        reduced = attention.layers[entry]["excluded"]
        columns = dict(span_share=reduced.share_on(in_span))
        if selected_all is not None:
            selected = _per_query_head(selected_all[entry], heads)  # (heads, prompt)
            columns["span_kept_share"] = reduced.share_on(selected & in_span)
            columns["span_kept"] = selected[:, start:end].float().mean(-1)
        for h in range(heads):
            out.append(dict(layer=layer, head=h, kv_head=int(kv_head[h]),
                            **{name: value[h].item() for name, value in columns.items()}))
    return pd.DataFrame(out)


def coverage_summary(table: pd.DataFrame, *, sinks: str = "excluded", by: str = "policy") -> pd.DataFrame:
    """Mean coverage, oracle and chance per `by` (e.g. policy) over layers and heads, for one sinks variant,
    with coverage_of_oracle = coverage / oracle (the means' ratio). NaN heads (no eligible rows) are skipped."""
    rows = sinks_rows(table, sinks)
    summary = rows.groupby(by, sort=False)[["coverage", "oracle", "chance"]].mean()
    summary["coverage_of_oracle"] = summary["coverage"] / summary["oracle"]
    return summary


def layer_spread(table: pd.DataFrame, *, sinks: str = "excluded", by: str = "policy") -> pd.DataFrame:
    """Where the policies part ways: per layer, each `by` group's mean coverage over heads (one column each),
    spread (max - min over the groups), highest and lowest (the groups with the largest and the smallest
    coverage in the layer); rows sorted by spread, largest first."""
    rows = sinks_rows(table, sinks)
    means = rows.groupby(["layer", by], sort=False)["coverage"].mean().unstack(by)
    if means.shape[1] < 2:
        raise ValueError(f"layer_spread needs at least two {by} groups, got {list(means.columns)}")
    means["spread"] = means.max(axis=1) - means.min(axis=1)
    groups = means.columns.drop("spread")
    means["highest"] = means[groups].idxmax(axis=1)
    means["lowest"] = means[groups].idxmin(axis=1)
    return means.sort_values("spread", ascending=False, kind="stable")


def sinks_rows(table: pd.DataFrame, sinks: str) -> pd.DataFrame:
    """The rows of one sinks variant ("kept" or "excluded") of a coverage table; none is an error."""
    rows = table[table["sinks"] == sinks]
    if rows.empty:
        raise ValueError(f"the table has no rows with sinks == {sinks!r}; it has {sorted(table['sinks'].unique())}")
    return rows
