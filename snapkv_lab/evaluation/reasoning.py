"""The reasoning sets kvpress evaluates decoding-time compression on: AIME25 and MATH500, as kvpress re-published
them on the Hub (alessiodevoto/aime25: the 30 problems of AIME 2025 I and II; alessiodevoto/math500: PRM800K's
500-problem MATH test split), each one task named as the set, split "test", kvpress's columns: context, question,
answer_prefix, answer, max_new_tokens (32000 for AIME25, 4096 for MATH500), and MATH500's subject, level and
unique_id. kvpress's evaluate_kvzap.py sends the question as the user's turn and lets the model reason until it
writes its \\boxed{} answer.

Scoring (evaluation.math_answers): AIME25 by kvpress's own rule (the last boxed answer equals the integer as a
string); MATH500 by MATH's grader as PRM800K grades it (`grader="prm800k"`, the default: equivalent answers count,
\\frac12 = 0.5 = 1/2, unreduced fractions do not), or by kvpress's exact string rule (`grader="kvpress"`).

Both are read from the Hub or from `--source DIR` holding DIR/aime25.jsonl or DIR/math500.jsonl in that schema; with
neither, the run is refused and says so (evaluation.hub).
"""

from __future__ import annotations

from .examples import Example, Question
from .hub import HubBenchmark, HubSource


def _reasoning_example(task: str, row: dict, index: int, *, grader: str = "prm800k") -> Example:
    metric = {"aime25": "kvpress_aime", "math500": "math_equal" if grader == "prm800k" else "kvpress_math500"}[task]
    return Example(dataset=task, task=task, id=str(row.get("unique_id", index)), context=row["context"],
                   questions=(Question(row["question"], (str(row["answer"]),), row["answer_prefix"]),),
                   metric=metric, max_new_tokens=int(row["max_new_tokens"]),
                   meta={key: row[key] for key in ("subject", "level") if key in row})


AIME25 = HubBenchmark(name="aime25", tasks=("aime25",), default_tasks=("aime25",),
                      hub=HubSource("alessiodevoto/aime25", config=None), build=_reasoning_example)
MATH500 = HubBenchmark(name="math500", tasks=("math500",), default_tasks=("math500",),
                       hub=HubSource("alessiodevoto/math500", config=None), build=_reasoning_example,
                       options={"grader": ("prm800k", "kvpress")}, legacy={})
