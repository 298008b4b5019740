"""What a benchmark item is to the lab, and what a benchmark must provide to be run by `evaluate`.

An `Example` is split where compression happens: `context` (the official template's text up to the end of the
document) is what a query-agnostic run compresses; each `Question` is the template's text after it, appended
after compression (query-agnostic) or compressed with the context (query-aware). Several questions share one
context where the benchmark asks several of one document (SCBench's turns, RULER's multiquery when asked one by
one). Texts are the official prompts, untruncated and unframed: `evaluate` truncates the context from the middle
(`--max-context`) and frames it for the model (chat template or plain text, see evaluation.prompting).

A `Benchmark` lists its tasks (by the benchmark's own names) and, for one task, the specs of its examples
(JSON-able dicts that key a sweep cell), and builds an Example from a spec. Generated sets (RULER offline) build
it with the model's tokenizer, to an exact length in tokens; sets from the Hub read a row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class Question:
    """One question about an example's context.

    text: the official template's text after the context, up to where the model answers (e.g. LongBench's
        "\\n\\nNow, answer the question ...\\n\\nQuestion: {input}\\nAnswer:").
    answers: the reference answers the metric compares the prediction with.
    answer_prefix: the answer's opening words, put after the chat template's generation prompt (RULER's
        "Answer: The special magic number for X mentioned in the provided text is"); "" for most sets.
    metric: this question's metric where it is not the example's (SCBench's mixed set scores each turn by its kind).
    """

    text: str
    answers: tuple[str, ...]
    answer_prefix: str = ""
    metric: str | None = None


@dataclass(frozen=True)
class Example:
    """One benchmark item as the lab runs it.

    dataset, task: the registry's dataset name and the benchmark's own task name ("ruler", "niah_single_1").
    id: the item's identity within its task (its index or the set's own id), a string.
    context: the template's text before the first question, instruction and document included.
    questions: one or more; each answered from the same (possibly compressed) context.
    metric: the key of the task's official metric in evaluation.METRICS.
    max_new_tokens: the official generation length of the task.
    chat: False where the official scripts send the prompt as raw text even to a chat model (LongBench's few-shot
        and code-completion tasks: trec, triviaqa, samsum, lsht, lcc, repobench-p).
    meta: what a metric or a table needs besides (e.g. LongBench's all_classes, RULER's length and seed).
    shots: solved examples that the official script frames as turns of their own before the context, each (its
        text, its answer) (RULER's cwe: each the whole model template, then its answer and a newline;
        evaluation.prompting frames them). Their text counts in the example's length.
    truncation: how the official script cuts a prompt longer than the model takes (evaluation.prompting):
        "context" (the context from its middle, the question kept: kvpress's, and the lab's for sets whose scripts
        do not cut) or "prompt" (LongBench's pred.py: the whole prompt's first and last halves).
    frame: the official framing of a chat task: "chat" (the tokenizer's own chat template, as RULER's model
        templates) or "longbench" (LongBench pred.py's build_chat: its own templates for its models, none for others).
    stop: texts whose last token also ends the answer once one token is out (LongBench's samsum: "\n").
    raw_prediction: the official scorer reads the decoded answer as it is (LongBench); else stripped.
    """

    dataset: str
    task: str
    id: str
    context: str
    questions: tuple[Question, ...]
    metric: str
    max_new_tokens: int
    chat: bool = True
    meta: dict = field(default_factory=dict)
    shots: tuple[tuple[str, str], ...] = ()
    truncation: str = "context"
    frame: str = "chat"
    stop: tuple[str, ...] = ()
    raw_prediction: bool = False


class Benchmark(Protocol):
    """A dataset `evaluate` can run (registered in evaluation.DATASETS under `name`)."""

    name: str
    tasks: tuple[str, ...]  # every task, by the benchmark's own names
    default_tasks: tuple[str, ...]  # run when --tasks is not given

    def specs(self, task: str, *, limit: int | None = None, lengths: tuple[int, ...] = (), seed: int = 0,
              source: str | None = None) -> list[dict]:
        """The examples of one task to run, as JSON-able specs (each keys a cell): the first `limit` (None: all).
        Generated sets make `limit` examples per length in `lengths` (tokens) from `seed`; sets read from the Hub
        (or, with `source`, from a local folder of JSONL files in the set's own schema) ignore lengths and seed."""
        ...

    def example(self, spec: dict, tokenizer) -> Example:
        """The Example a spec describes (the tokenizer sizes generated sets to their length in tokens)."""
        ...
