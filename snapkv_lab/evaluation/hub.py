"""Benchmarks read from the Hugging Face Hub, row by row, in each set's own schema.

A `HubBenchmark` names where its rows are published (Hub id, config and split per task) and how one row becomes
an `Example` (each family's module: longbench, infinitebench, loogle, scbench). Rows come from the Hub through
`datasets.load_dataset`, or, with `source=DIR`, from `DIR/<task>.jsonl` in the same schema, one row a line:
an offline machine with a downloaded copy (and the tests' fixtures) goes through the same row -> Example code.

The sets kvpress re-published ready to run (context / question / answer_prefix columns) are here too:
"ruler-hub" (simonjegou/ruler, configs by context length) and "needle-hub" (Paul Graham's essays with a needle
put in at a depth, kvpress's evaluation/benchmarks/needle_in_haystack/utils.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable

from ..core.tokens import encode
from .examples import Example, Question

INSTALL_HINT = "pip install 'snapkv_lab[eval]'"


@dataclass(frozen=True, eq=False)
class HubSource:
    """Where a set's rows are published.

    hub_id, config, split: config and split are format strings of {task} (and of {length} where configs are
        context lengths); config None for a set without configs.
    features: the set's schema as {column: dtype or [dtype]}, cast at load time where the set's files disagree
        with each other (InfiniteBench's maintainers ask for it, OpenBMB/InfiniteBench issue #19).
    load_kwargs: more arguments of datasets.load_dataset (trust_remote_code for sets still loaded by a script).
    task_column: where one config holds every task (kvpress's RULER), the column that says which.
    """

    hub_id: str
    config: str | None = "{task}"
    split: str = "test"
    features: dict | None = None
    load_kwargs: dict | None = None
    task_column: str | None = None


@dataclass(frozen=True, eq=False)  # compared by identity: load_rows caches rows per benchmark object
class HubBenchmark:
    """A benchmark whose examples are the rows of a Hub dataset.

    build(task, row, index, **options): the Example of one row, in the set's exact schema.
    lengths: for sets whose configs are context lengths, the lengths run when the caller names none.
    options: how the set's official script runs it, where the lab also offers another way: {name: its values, the
        official first} (LongBench's truncation and predictions); build gets their values.
    legacy: each option's value before the option existed (the lab's former way). A spec records an option's value
        where it is not that one; a spec without it (a table written before the option) means that one.
    """

    name: str
    tasks: tuple[str, ...]
    default_tasks: tuple[str, ...]
    hub: HubSource
    build: Callable[..., Example]
    lengths: tuple[int, ...] = ()
    options: dict = field(default_factory=dict)
    legacy: dict = field(default_factory=dict)

    def specs(self, task: str, *, limit: int | None = None, lengths: tuple[int, ...] = (), seed: int = 0,
              source: str | None = None, **options) -> list[dict]:
        """One spec per row of `task` (the first `limit`); per length too where configs are lengths. options: values
        of self.options (the official ones where not given); another name is refused."""
        check_task(self, task)
        chosen = check_options(self, options)
        specs = []
        for length in (lengths or self.lengths) if self.lengths else (None,):
            base = dict(dataset=self.name, task=task, source=source) | ({} if length is None else {"length": length})
            rows = load_rows(self, task, source, length)
            recorded = {name: value for name, value in chosen.items() if value != self.legacy.get(name)}
            specs += [base | {"index": i} | recorded
                      for i in range(len(rows) if limit is None else min(limit, len(rows)))]
        return specs

    def example(self, spec: dict, tokenizer=None) -> Example:
        """The Example of the spec's row (sets read from the Hub need no tokenizer)."""
        rows = load_rows(self, spec["task"], spec.get("source"), spec.get("length"))
        options = check_options(self, {name: spec.get(name, self.legacy.get(name)) for name in self.options})
        return self.build(spec["task"], rows[spec["index"]], spec["index"], **options)


def check_options(benchmark, options: dict) -> dict:
    """{name: value} for every option of the benchmark (`options` given, the official value otherwise), each checked."""
    declared = getattr(benchmark, "options", {})
    unknown = set(options) - set(declared)
    if unknown:
        raise ValueError(f"{benchmark.name} has no option {', '.join(sorted(unknown))}; its options: "
                         f"{', '.join(declared) or 'none'}")
    chosen = {name: options.get(name, values[0]) for name, values in declared.items()}
    for name, value in chosen.items():
        if value not in declared[name]:
            raise ValueError(f"{benchmark.name}: {name} must be one of {declared[name]} (the first is the official "
                             f"script's), got {value!r}")
    return chosen


def check_task(benchmark, task: str) -> None:
    if task not in benchmark.tasks:
        raise ValueError(f"{benchmark.name} has no task {task!r}; its tasks: {', '.join(benchmark.tasks)}")


@lru_cache(maxsize=4)  # every example of a task is built separately; a few tasks' rows at a time (some are GBs)
def load_rows(benchmark, task: str, source: str | None = None,
              length: int | None = None) -> tuple[dict, ...]:
    """The rows of one task: from the Hub, or from `<source>/<task>.jsonl` (`<source>/<length>/<task>.jsonl`
    for sets whose configs are context lengths)."""
    check_task(benchmark, task)
    hub = benchmark.hub
    if source is None:
        rows = _hub_rows(benchmark, task, length)
    else:
        rows = _local_rows(benchmark, Path(source, *([] if length is None else [str(length)]), f"{task}.jsonl"))
    if hub.task_column:
        rows = [row for row in rows if row[hub.task_column] == task]
    return tuple(rows)


def _local_rows(benchmark, path: Path) -> list[dict]:
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: --source for {benchmark.name} must be a folder of <task>.jsonl "
                                f"files, one row of {benchmark.hub.hub_id} a line, in that set's own schema")
    with path.open(encoding="utf-8") as lines:
        return [json.loads(line) for line in lines if line.strip()]


def _hub_rows(benchmark, task: str, length: int | None) -> list[dict]:
    try:
        import datasets  # imported here: only runs that read the Hub need it
    except ImportError as error:
        raise ImportError(f"{benchmark.name} is read from the Hugging Face Hub, which needs the datasets package: "
                          f"{INSTALL_HINT} (or give --source DIR, a folder of <task>.jsonl files)") from error
    hub = benchmark.hub
    config = None if hub.config is None else hub.config.format(task=task, length=length)
    kwargs = dict(hub.load_kwargs or {})
    if hub.features:
        kwargs["features"] = datasets.Features({column: _feature(datasets, dtype)
                                                for column, dtype in hub.features.items()})
    try:
        rows = datasets.load_dataset(hub.hub_id, config, split=hub.split.format(task=task), **kwargs)
    except Exception as error:  # offline, unknown config, a datasets too new for a script-loaded set: all say so
        raise RuntimeError(f"could not load {hub.hub_id} ({config or 'default'}, task {task}) from the "
                           f"Hugging Face Hub: {error}. {benchmark.name} needs the Hub (network access), or a local "
                           f"copy: --source DIR with DIR/<task>.jsonl in the set's own schema") from error
    return list(rows)


def _feature(datasets, dtype):
    return datasets.Sequence(datasets.Value(dtype[0])) if isinstance(dtype, list) else datasets.Value(dtype)


def split_template(template: str, fields: dict, document: str = "context") -> tuple[str, str]:
    """(context, question) of an official `str.format` template: the template rendered up to and including
    {document}, and the rest, so that context + question == template.format(**fields) exactly."""
    head, marker, tail = template.partition("{" + document + "}")
    if not marker:
        raise ValueError(f"the template has no {{{document}}}: {template!r}")
    return head.format(**fields) + format(fields[document]), tail.format(**fields)


# kvpress's RULER (NVIDIA/kvpress evaluation/benchmarks/ruler): RULER's 13 tasks rendered once with Llama-3.1's
# tokenizer, split by kvpress into context / question / answer_prefix; configs "4096", "8192", "16384".
RULER_TASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
               "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2")


def _ruler_example(task: str, row: dict, index: int) -> Example:
    # kvpress's ruler/calculate_metrics.py: string_match_part for the qa tasks, string_match_all for the others
    return Example(dataset="ruler-hub", task=task, id=str(index), context=row["context"],
                   questions=(Question(row["question"], tuple(row["answer"]), row["answer_prefix"]),),
                   metric="string_match_part" if task.startswith("qa") else "string_match_all",
                   max_new_tokens=int(row["max_new_tokens"]))


RULER_HUB = HubBenchmark(name="ruler-hub", tasks=RULER_TASKS, default_tasks=RULER_TASKS,
                         hub=HubSource("simonjegou/ruler", config="{length}", task_column="task"),
                         build=_ruler_example, lengths=(4096,))


@dataclass(frozen=True, eq=False)
class NeedleHub:
    """kvpress's needle in a haystack: the set's one essay collection, cut to `length` tokens (less the needle and
    150 tokens for the framing), with the needle put in at `depth` percent of it, in kvpress's own wrapper.

    specs: per length, `limit` depths spread evenly over 0..100 (11 when no limit: 0, 10, ..., 100); kvpress runs one
    depth a run (--needle_depth), so the grid is ours. Built with the model's tokenizer, like kvpress.
    """

    name: str = "needle-hub"
    tasks: tuple[str, ...] = ("needle_in_haystack",)
    default_tasks: tuple[str, ...] = ("needle_in_haystack",)
    hub: HubSource = HubSource("alessiodevoto/paul_graham_essays", config=None)
    wrapper: str = "This is a very long story book: <book> {context} </book>."  # kvpress's context_wrapper

    def specs(self, task: str, *, limit: int | None = None, lengths: tuple[int, ...] = (), seed: int = 0,
              source: str | None = None) -> list[dict]:
        check_task(self, task)
        if not lengths:
            raise ValueError("needle-hub is cut to a length in tokens: give one or more lengths")
        count = 11 if limit is None else limit
        depths = [50] if count == 1 else [round(100 * i / (count - 1)) for i in range(count)]
        return [dict(dataset=self.name, task=task, source=source, index=0, length=length, depth=depth)
                for length in lengths for depth in depths]

    def example(self, spec: dict, tokenizer) -> Example:
        row = load_rows(self, spec["task"], spec.get("source"))[spec["index"]]
        needle = encode(tokenizer, row["needle"])
        haystack = encode(tokenizer, row["context"])[:spec["length"] - len(needle) - 150]
        at = int(len(haystack) * spec["depth"] / 100)
        text = tokenizer.decode(haystack[:at] + needle + haystack[at:], skip_special_tokens=True)
        # kvpress scores ROUGE between the needle and the answer (needle_in_haystack/calculate_metrics.py)
        return Example(dataset=self.name, task=spec["task"], id=f"{spec['length']}-{spec['depth']}",
                       context=self.wrapper.format(context=text),
                       questions=(Question(row["question"], (row["needle"],), row["answer_prefix"]),),
                       metric="needle_rouge", max_new_tokens=int(row["max_new_tokens"]),
                       meta={"length": spec["length"], "depth": spec["depth"]})


NEEDLE_HUB = NeedleHub()
