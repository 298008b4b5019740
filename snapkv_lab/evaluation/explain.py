"""One call from a benchmark score to its explanation: rerun one (example, policy) row of an `evaluate` table with the
full cache's attention captured, and show the answers, the attention coverage and the kept tokens side by side.

    table = evaluate(...)                                  # or read_results("data/eval_ruler.csv")
    why = explain(model, tokenizer, table.iloc[12])        # the row's example, policy, budget and mode
    why                                                    # in a notebook: answers, coverage, kept tokens
    why.coverage                                           # attention_coverage(trace, run): per layer and head

The row's `spec` and `policy_config` columns rebuild its example and policy exactly; the prompt is framed and cut
as the run framed and cut it, and the run is redone the way `evaluate` did it (one prefill of the context, the
question after: compression.generation.answer_runs), so its answer is the table's prediction (checked).
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass

import pandas as pd
import torch

from ..compression import SharedPrefill
from ..compression.compare import kept_tokens_html
from ..compression.generation import GenerationResult, answer_runs
from ..core.capture import capture
from ..core.tokens import token_span
from ..core.trace import AttentionTrace
from ..policies import FullCache, policy_from_config, upgrade_config
from ..tasks.corpus import redact_essays
from ..views.coverage import attention_coverage, coverage_summary
from .answer_rows import score_answer, stop_ids
from .examples import Example
from .prompting import EncodedExample, encode_example, frame_texts
from .run import _benchmark, default_max_context


@dataclass
class Explanation:
    """A row of a benchmark table, rerun and explained.

    row: the table's row. example, encoded: the example and its token ids as the run had them.
    prompt_ids: (1, n) the whole prompt (context + the row's question). run: the policy's rerun. kept_indices: its
    kept positions per layer, (1, kv_heads, kept) (query-agnostic: of the context alone). trace: the full cache's run
    over the whole prompt, every query and key kept. coverage: attention_coverage(trace, kept_indices) (one row per
    layer, head and sinks rule; query-agnostic, the question's positions count as not kept).
    spans: [start, end) token positions of the example's marked facts (RULER's needles), where it marks any.
    """

    row: pd.Series
    example: Example
    encoded: EncodedExample
    prompt_ids: torch.Tensor
    run: GenerationResult
    kept_indices: list[torch.Tensor]
    trace: AttentionTrace
    coverage: pd.DataFrame
    spans: list[tuple[int, int]]
    tokenizer: object

    @property
    def question(self):
        return self.example.questions[int(self.row["question"])]

    def summary(self) -> pd.DataFrame:
        """The full cache's and the policy's answers, scores and coverage (means over layers and heads, sinks
        excluded), with the share of each marked fact's positions kept."""
        # a full-cache row gets one line: its own run's answer
        answers = {"FullCache": self.trace.generated_text.strip(), self.row["policy"]: self.run.text}
        table = pd.DataFrame.from_dict({name: dict(answer=redact_essays(text),
                                                   score=score_answer(self.example, self.question, text))
                                        for name, text in answers.items()}, orient="index")
        covered = coverage_summary(self.coverage.assign(policy=self.row["policy"]), sinks="excluded")
        table.loc[self.row["policy"],
                  ["coverage", "oracle", "chance"]] = covered.iloc[0][["coverage", "oracle", "chance"]]
        if self.spans:
            shares = self.facts_kept().groupby("fact").kept.mean()  # every head counts alike: a fact's length each
            for i, share in shares.items():
                table.loc[self.row["policy"], f"fact {i} kept"] = share
        return table

    def facts_kept(self) -> pd.DataFrame:
        """Per layer, KV head and marked fact: the share of the fact's positions the head kept (`kept`, in [0, 1]).
        Where a policy keeps as much of a needle as random eviction on average and still loses it, this says
        which heads dropped it whole. Columns: layer, kv_head, fact, kept."""
        rows = []
        for layer, kept in enumerate(self.kept_indices):  # (1, kv_heads, kept)
            for head, positions in enumerate(kept[0]):
                for fact, (start, end) in enumerate(self.spans):
                    inside = ((positions >= start) & (positions < end)).sum().item()
                    rows.append(dict(layer=layer, kv_head=head, fact=fact, kept=inside / (end - start)))
        return pd.DataFrame(rows, columns=["layer", "kv_head", "fact", "kept"])

    def kept_view(self, layer: int | None = None, head: int | None = None, around: tuple[int, int] | None = None):
        """IPython HTML of the prompt shaded by how often each token was kept, the first marked fact boxed; `around`
        defaults to the 300 tokens about it (or the prompt's end)."""
        from IPython.display import HTML

        ids = self.prompt_ids[0]
        highlight = self.spans[0] if self.spans else None
        if around is None:
            centre = highlight[0] if highlight else len(ids) - 150
            around = (max(0, centre - 150), centre + 150)
        return HTML(kept_tokens_html(self.tokenizer, ids, self.kept_indices, layer=layer, head=head,
                                     highlight=highlight, around=around))

    def _repr_html_(self) -> str:
        row = self.row
        budget = f"ratio {row['ratio']:g}" if pd.notna(row.get("ratio")) else f"capacity {row['capacity']}"
        head = (f"<h4>{html.escape(str(row['dataset']))}/{html.escape(str(row['task']))} "
                f"#{html.escape(str(row['example']))}, "
                f"{html.escape(str(row['policy']))} at {budget}, {html.escape(str(row['mode']))}</h4>"
                f"<p>references: {html.escape(', '.join(self.question.answers))}</p>")
        return head + self.summary()._repr_html_() + self.kept_view().data


def _fact_spans(tokenizer, example: Example, encoded: EncodedExample, framing: str) -> list[tuple[int, int]]:
    """Token spans of the example's marked facts (meta "needle_spans": characters of the context); none when the
    context was cut (its positions moved) or the set marks none."""
    marked = example.meta.get("asked_spans") or example.meta.get("needle_spans") or []
    if encoded.truncated or not marked:
        return []
    context, _, _ = frame_texts(tokenizer, example, framing)
    offset = len(context) - len(example.context)
    return [token_span(tokenizer, context, offset + start, offset + end)[1] for start, end in marked]


@torch.inference_mode()
def explain(model, tokenizer, row: pd.Series, *, progress: bool = False) -> Explanation:
    """Rerun one row of an `evaluate` table (its example, question, policy, budget and mode) and the full cache's run
    with its attention captured; see the module doc. The rerun's answer must equal the row's prediction."""
    spec, config = json.loads(row["spec"]), json.loads(row["policy_config"])
    example = _benchmark(spec["dataset"]).example(spec, tokenizer)
    framing = row["framing"]
    if not row["truncated_tokens"]:
        max_context = None
    elif example.truncation == "prompt":  # cut as LongBench's pred.py cuts, to the run's default max_length
        max_context = default_max_context(model, example)
    else:
        questions = encode_example(tokenizer, example, framing=framing).questions
        max_context = int(row["context_tokens"]) + max(len(q) for q in questions)
    encoded = encode_example(tokenizer, example, framing=framing, max_context=max_context)
    question = encoded.questions[int(row["question"])]
    prompt_ids = torch.tensor([encoded.context_ids + question])
    policy = policy_from_config(upgrade_config(config))  # a table written before a field was renamed too
    policies = [] if isinstance(policy, FullCache) else [policy]
    shared = SharedPrefill.run(model, tokenizer, torch.tensor([encoded.context_ids], device=model.device), policies)
    modes = [row["mode"]] if policies else ["query-aware"]
    wanted = "full" if not policies else row["mode"]
    stops = stop_ids(tokenizer, example)
    run = next(r for r in answer_runs(model, tokenizer, shared, [torch.tensor([question], device=model.device)],
                                      policies, modes, example.max_new_tokens, end_ids=stops,
                                      min_new_tokens=1 if stops else 0) if r.mode == wanted)
    expected = str(row["prediction"])  # the table as evaluate returns it (essays' text taken out), or as read back
    if redact_essays(run.text).strip() != redact_essays(expected).strip():
        raise ValueError(f"the rerun answered {run.text!r} where the table has {expected!r}: another model, framing "
                         "or library version made this table")
    kept = run.kept_indices
    trace = capture(model, tokenizer, prompt_ids, max_new_tokens=example.max_new_tokens, progress=progress)
    coverage = attention_coverage(trace, kept)
    return Explanation(row, example, encoded, prompt_ids, run, kept, trace, coverage,
                       _fact_spans(tokenizer, example, encoded, framing), tokenizer)
