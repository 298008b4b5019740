"""A/B comparison of compression policies on the same prompts, with a rich notebook display.

    table = compare(model, tokenizer, prompts, policies=[FullCache(), SnapKV(capacity=1024), StreamingLLM()])
    table                      # in a notebook: answers side by side, then the metrics
    table.kept_view(0, "SnapKV@1024", around=(900, 1100))   # prompt text shaded by how often each token was kept

`compare` returns a pandas DataFrame (one row per prompt and policy) that also remembers each run's
GenerationResult, so the kept-token view needs no rerun.
"""

from __future__ import annotations

import html

import pandas as pd
import torch

from ..core.inputs import encode_batch, eos_ids
from ..core.progress import progress_bar
from ..policies import FullCache, SnapKV
from .generation import GenerationResult, answer_runs, encode_questions, several_questions
from .kept import kept_mask
from .shared import SharedPrefill

# The highlighted span gets one box around all its tokens. A border, unlike an outline, takes its own room in the
# line: it never paints over a character (an outline per token covered single digits of a needle). Its vertical
# extent (2 px) fits in the half-leading of line-height 1.6, so it does not reach the lines above and below.
HIGHLIGHT_STYLE = "border:2px solid #c00;border-radius:3px;padding:0 1px"


def kept_tokens_html(tokenizer, prompt_ids, kept_indices, *, layer: int | None = None, head: int | None = None,
                     highlight: tuple[int, int] | None = None, around: tuple[int, int] | None = None) -> str:
    """The prompt as HTML, each token shaded green by the fraction of heads that kept it.

    prompt_ids: (n,) or (1, n); kept_indices: per layer (batch, heads, kept). layer None averages over
    layers and heads; layer alone over that layer's heads; layer and head give kept (1) or dropped (0).
    highlight: [start, end) tokens framed by one red box (e.g. the needle), in an element of class
    "highlight"; every character stays visible. around: [start, end) tokens shown.
    """
    ids = torch.as_tensor(prompt_ids).reshape(-1).tolist()
    mask = kept_mask(kept_indices, len(ids)).float()
    if layer is not None:
        mask = mask[layer: layer + 1]
    if head is not None:
        mask = mask[:, head: head + 1]
    fraction = mask.mean(dim=(0, 1)).tolist()
    start, end = around or (0, len(ids))
    start, end = max(0, start), min(len(ids), end)
    marked = range(*highlight) if highlight else range(0)
    spans = ["<span style='color:#888'>…</span>"] if start > 0 else []
    for i in range(start, end):
        if i == max(start, marked.start) and i in marked:
            spans.append(f"<span class='highlight' style='{HIGHLIGHT_STYLE}'>")
        text = html.escape(tokenizer.decode([ids[i]])).replace("\n", "↵<br>")
        style = f"background:rgba(0,150,0,{0.1 + 0.75 * fraction[i]:.2f})" if fraction[i] > 0 else "color:#aaa"
        spans.append(f"<span title='pos {i}: kept by {fraction[i]:.0%}' style='{style}'>{text}</span>")
        if i in marked and (i + 1 == marked.stop or i + 1 == end):
            spans.append("</span>")
    if end < len(ids):
        spans.append("<span style='color:#888'>…</span>")
    scope = ("all layers and heads" if layer is None
             else f"layer {layer}" + ("" if head is None else f", KV head {head}"))
    legend = (f"<div style='font-size:80%;color:#555'>green: kept (shade = fraction of {scope}); grey: dropped; "
              "red box: highlighted span</div>")
    return legend + "<div style='font-family:monospace;font-size:85%;line-height:1.6'>" + "".join(spans) + "</div>"


# Plain words in colour, not emoji: they need no emoji font and do not rest on colour alone.
VERDICTS = {True: " <span style='color:#1a7f37;font-weight:bold'>[right]</span>",
            False: " <span style='color:#b00;font-weight:bold'>[wrong]</span>"}


class ABTable(pd.DataFrame):
    """DataFrame of `compare` rows that keeps the runs (`results`, by row label) for the rich display."""

    _metadata = ["results", "tokenizer"]

    @property
    def _constructor(self):
        return ABTable

    def result(self, prompt, policy: str) -> GenerationResult:
        row = self[(self["prompt"] == prompt) & (self["policy"] == policy)]
        if row.empty:
            raise KeyError(f"no run for prompt {prompt!r} and policy {policy!r}; policies: "
                           f"{sorted(self['policy'].unique())}")
        return self.results[row.index[0]]

    def kept_view(self, prompt, policy: str, **kwargs):
        """IPython HTML of `kept_tokens_html` for one run (kwargs: layer, head, highlight, around)."""
        from IPython.display import HTML

        run = self.result(prompt, policy)
        return HTML(kept_tokens_html(self.tokenizer, run.prompt_ids[0], run.kept_indices, **kwargs))

    def _repr_html_(self):
        if getattr(self, "results", None) is None:
            return super()._repr_html_()
        cards = []
        for prompt, rows in self.groupby("prompt", sort=False):
            boxes = []
            for _, row in rows.iterrows():
                mark = "" if pd.isna(row["correct"]) else VERDICTS[bool(row["correct"])]
                boxes.append(
                    "<div style='flex:1;min-width:12em;border:1px solid #ccc;border-radius:4px;padding:4px'>"
                    f"<b>{html.escape(row['policy'])}</b>{mark}<br><span style='font-size:80%;color:#555'>"
                    f"{row['kv_bytes'] / 2**20:.1f} MiB KV, {_speed(row['decode_ms_per_token'])}</span>"
                    f"<div style='white-space:pre-wrap'>{html.escape(str(row['answer']))}</div></div>")
            cards.append(f"<div><b>prompt {html.escape(str(prompt))}</b> ({rows['prompt_tokens'].iloc[0]} tokens)"
                         f"<div style='display:flex;gap:6px'>{''.join(boxes)}</div></div>")
        metrics = pd.DataFrame(self).drop(columns=["answer"])._repr_html_()
        return "<div>" + "".join(cards) + "</div><br>" + metrics


def _speed(ms_per_token: float) -> str:
    return "no decode step" if pd.isna(ms_per_token) else f"{ms_per_token:.0f} ms/token"


def _as_item(prompt, index: int) -> dict:
    item = dict(prompt) if isinstance(prompt, dict) and "prompt" in prompt else dict(prompt=prompt)
    item.setdefault("name", index)
    return item


def compare(model, tokenizer, prompts, policies=(FullCache(), SnapKV()), *, max_new_tokens: int = 64,
            progress: bool = True) -> ABTable:
    """Run every prompt with every policy, from one full prefill per prompt: one row per (prompt, policy, question).

    prompts: a list of prompts (text, chat messages, ids, or a batch: a list of prompts, of different lengths or
        not, or a (batch, n) tensor, decoded together and reported one row per prompt, named "name/row"),
        or of dicts {"prompt", "answer" (expected text,
        optional: correct = it appears in the output, case-insensitive), "question" (optional: query-agnostic
        mode, appended after compression; a list of questions is compress once, ask many, and "answer" then a
        list too), "name" (optional row label)}.
    Each prompt is prefilled once with the full cache while every policy's scores are recorded; each policy
    then decodes on a compressed copy (the same cache `compress` would build), so an A/B of k policies costs
    one prefill, their selections (plus any extra scoring pass, e.g. KVzip's, paid once per prompt and in the
    selection_s of the first policy that needs it: KVzip at four budgets reconstructs once) and k decodes.
    Columns: prompt, policy (its label: name, non-default settings, budget), mode, question, answer, expected,
    correct, kv_bytes (after prefill), kv_ratio (the prompt's largest cache / this one), cache_length, kv_entries
    (KV entries held after the prompt's compression, summed over layers and KV heads), kv_share (of the uncompressed
    cache's), budget_share (the nominal budget's share), over_budget (more held than the budget beyond rounding:
    compression.entries), prompt_tokens, prefill_s (the shared prefill), selection_s, decode_ms_per_token, new_tokens.
    """
    labels = [policy.label for policy in policies]
    if len(set(labels)) < len(labels):
        raise ValueError(f"two policies share a label (the same settings): {labels}")
    items = [_as_item(p, i) for i, p in enumerate(prompts)]
    asked = sum(len(item["question"]) if several_questions(item.get("question")) else 1 for item in items)
    rows, results = [], {}
    bar = progress_bar(total=asked * len(policies), desc="compare", disable=not progress)
    eos = eos_ids(model, tokenizer)
    order = {policy.label: i for i, policy in enumerate(policies)}
    for item in items:
        batch = encode_batch(tokenizer, item["prompt"]).to(model.device)
        ids, mask = batch.ids, (None if batch.pads is None else batch.mask)
        questions, extras = encode_questions(model, tokenizer, ids, item.get("question"), max_new_tokens)
        expected = item.get("answer")
        expected = list(expected) if isinstance(expected, (list, tuple)) else [expected] * len(questions)
        shared = SharedPrefill.run(model, tokenizer, ids, policies, mask=mask)
        modes = ("query-aware",) if extras == [None] else ("query-agnostic",)
        runs = []
        for run in answer_runs(model, tokenizer, shared, extras, policies, modes, max_new_tokens, full=False,
                               texts=questions):
            runs.append(run)
            bar.update()
        for run in sorted(runs, key=lambda run: (order[run.policy.label], run.question_index)):  # policy by policy
            answer = expected[run.question_index]
            row_runs = run.rows(eos) if ids.shape[0] > 1 else [run]  # a batch: one row per prompt
            for b, one in enumerate(row_runs):
                results[len(rows)] = one
                rows.append(dict(
                    prompt=item["name"] if len(row_runs) == 1 else f"{item['name']}/{b}", policy=run.policy.label,
                    mode=run.mode, question=one.question, answer=one.text, expected=answer,
                    correct=pd.NA if answer is None else answer.lower() in one.text.lower(),
                    kv_bytes=one.kv_bytes, cache_length=max(one.cache_lengths), **one.entries.columns(),
                    prompt_tokens=one.prompt_ids.shape[1],
                    prefill_s=shared.seconds, selection_s=one.selection_seconds,
                    decode_ms_per_token=one.decode_ms_per_token, new_tokens=one.token_ids.shape[1]))
    bar.close()
    table = ABTable(rows)
    table["kv_ratio"] = table.groupby("prompt").kv_bytes.transform("max") / table.kv_bytes
    table.results, table.tokenizer = results, tokenizer
    return table
