"""LooGLE (bigai-nlco/LooGLE at 6734382), as Prediction/pred_opensource_models.py runs it.

Rows: `bigai-nlco/LooGLE` (the README's `bigainlco/LooGLE`, since renamed), configs shortdep_qa, shortdep_cloze,
longdep_qa, longdep_summarization, split "test", fields input (the document), title, qa_pairs (a Python literal
of [{"Q", "A", "S"(, "type")}], or "none" for summarization) and output (the reference summary). The official
script asks each question of a document with the full prompt, `task2prompt[task].format(input=..., Q=...)`
(config/task2prompt.json), as raw text (no chat template), for task2maxlen.json's tokens: here one Example per
document with one Question per pair, all on the same context. Every template has {input} before {Q}.

Metrics (Evaluation/automatic_eval.py): QA and summarization are scored by "automatic_sim" (BLEU, ROUGE, METEOR,
BERTScore), cloze by "automatic_match" (exact and partial match of the masked entities).
"""

from __future__ import annotations

import ast
import json

from .examples import Example, Question
from .hub import HubBenchmark, HubSource, split_template

# config/task2prompt.json, verbatim (cloze's {{ }} are str.format's escaped braces)
PROMPTS = {
    "shortdep_qa": "Please answer the question based on the long texts below. \n{input}\nQuestion: {Q}\nAnswer: ",
    "longdep_qa": "Please answer the question based on the long texts below. \n{input}\nQuestion: {Q}\nAnswer: ",
    "longdep_summarization": "Please generate a summary of the below paper. \n{input}\n Summarization: ",
    "shortdep_cloze": "Please fill in the clozes based on the given long texts below. Each of the placeholder '<mask-n>' in the question could be an entity of Person, Location or Organiocation. The same masks represent the same entity. Output a json format answer, for example: {{'<mask-0>': 'Bob', '<mask-1>': 'Gorrosion Magazine','<mask-2>': 'Bethel Horizon'}}\n{input}\n Question: {Q} What are the masked entities? \nAnswer:",  # noqa: E501
}

# config/task2maxlen.json
MAX_NEW_TOKENS = {"shortdep_qa": 300, "longdep_qa": 500, "longdep_summarization": 500, "shortdep_cloze": 50}

TASKS = ("shortdep_qa", "shortdep_cloze", "longdep_qa", "longdep_summarization")  # the README's order
# The official automatic_sim (QA, summaries) and automatic_match (cloze) report several metrics each; an answer is
# scored here by the first that needs no download: ROUGE-L recall, and exact match of the masked entities
# (metrics.NOT_REPRODUCED: METEOR, BERTScore, GPT-4 judging).
METRICS = {"shortdep_qa": "loogle_rouge_l", "longdep_qa": "loogle_rouge_l", "longdep_summarization": "loogle_rouge_l",
           "shortdep_cloze": "loogle_exact_match"}


def _pairs(task: str, row: dict) -> list[dict]:
    if task == "longdep_summarization":
        return [{"Q": "", "A": row["output"]}]
    # the script eval()s qa_pairs; a literal parse reads the same Python literal without running it
    return ast.literal_eval(row["qa_pairs"])


def _answer(answer) -> str:
    # a cloze answer is a {mask: entity} dict: kept as JSON text, which the match metric parses back
    return answer if isinstance(answer, str) else json.dumps(answer, ensure_ascii=False)


def _example(task: str, row: dict, index: int) -> Example:
    pairs = _pairs(task, row)
    splits = [split_template(PROMPTS[task], {"input": row["input"], "Q": pair["Q"]}, document="input")
              for pair in pairs]
    questions = tuple(Question(question, (_answer(pair["A"]),)) for (_, question), pair in zip(splits, pairs))
    meta = {"title": row["title"]} | ({"types": [pair["type"] for pair in pairs]} if task == "longdep_qa" else {})
    return Example(dataset="loogle", task=task, id=str(index), context=splits[0][0], questions=questions,
                   metric=METRICS[task], max_new_tokens=MAX_NEW_TOKENS[task], chat=False, meta=meta)


# Most configs are still built by the set's LooGLE.py script: datasets >= 2.16 and < 4 with trust_remote_code
LOOGLE = HubBenchmark(name="loogle", tasks=TASKS, default_tasks=TASKS, build=_example,
                      hub=HubSource("bigai-nlco/LooGLE", load_kwargs={"trust_remote_code": True}))
