"""SCBench (microsoft/MInference, scbench/ at fb56c91), in its multi-request mode.

Rows: `microsoft/SCBench`, one config per task, split "test", fields id, context and multi_turns ([{input, answer}],
plus options for scbench_choice_eng, name for the repoqa turns, task for the two mixed sets; repo and lang on the
repoqa rows). Several questions share one context: the benchmark's "same context, different query" mode
(run_scbench.py --same_context_different_query, eval_utils.py's create_scdq_prompt), where every query is asked
of the context alone, without the earlier turns' answers, is what an Example with several Questions is; its
multi-turn mode feeds each turn the previous reference answer, which an Example does not model. Context texts are
`multiturn_templates_scdq`, query texts `multiturn_follow_up_templates_in_chat_tempate` (eval_utils.py, verbatim,
"The the correct answer is" included); scripts/run_all_tasks.sh runs with --use_chat_template, so chat is True; at
most the first 5 turns (args.py --max_turns 5). Generation lengths: eval_utils.py's DATA_NAME_TO_MAX_NEW_TOKENS, per
turn kind in the mixed set (the Example takes the larger; each Question's metric is its turn's kind).
Metrics: compute_scores.py's, one per task, named after it (scbench_kv, ...). Not run: scbench_repoqa and
scbench_repoqa_and_kv, whose metric is not reproduced (metrics.NOT_REPRODUCED).

scbench_mf's context template starts with the first turn's question ("{prefix}\\n\\n{context}", prefix = that
turn's input): the official text, kept, so a query-agnostic run of scbench_mf sees its first question.
"""

from __future__ import annotations

import re

from .examples import Example, Question
from .hub import HubBenchmark, HubSource

# scripts/run_all_tasks.sh's order, less scbench_repoqa and scbench_repoqa_and_kv: repoqa's metric (tree-sitter parsing,
# pass@1 over BLEU thresholds) is not reproduced (metrics.NOT_REPRODUCED), and a score without it would be wrong.
TASKS = ("scbench_kv", "scbench_prefix_suffix", "scbench_vt", "scbench_qa_eng", "scbench_qa_chn", "scbench_choice_eng",
         "scbench_many_shot", "scbench_summary", "scbench_mf", "scbench_summary_with_needles")
MAX_TURNS = 5

# eval_utils.py, multiturn_templates_scdq: the context's text (the first of a pair)
CONTEXTS = {
    "scbench_kv": "Extract the value corresponding to the specified key in the JSON object below.\n\n{context}",
    "scbench_choice_eng": "Read the book and answer the question.\n\n{context}",
    "scbench_qa_eng": "Read the book and answer the question. Be very concise in your answer.\n\n{context}",
    "scbench_qa_chn": "阅读以下书籍然后回答问题。\n\n{context}",
    "scbench_mf": "{prefix}\n\n{context}",
    "scbench_summary": "{context}",
    "scbench_vt": "{context}",
    "scbench_many_shot": "{context}",
    "scbench_summary_with_needles": "{context}",
    "scbench_prefix_suffix": "{context}",
}

# eval_utils.py, multiturn_follow_up_templates_in_chat_tempate (the second of multiturn_templates_scdq's pairs)
QUERIES = {
    "scbench_choice_eng": "Question: {question}\nA. {OPTION_A}\nB. {OPTION_B}\nC. {OPTION_C}\nD. {OPTION_D}\n\nThe the correct answer is",  # noqa: E501
    "scbench_qa_eng": "Question: {question}\nAnswer:",
    "scbench_qa_chn": "问题：{question}\n答案：",
    "scbench_mf": "{prefix}\n\n{input}",
}

# eval_utils.py, DATA_NAME_TO_MAX_NEW_TOKENS (per turn kind in the mixed sets)
MAX_NEW_TOKENS = {
    "scbench_choice_eng": 40, "scbench_qa_eng": 40, "scbench_qa_chn": 40, "scbench_kv": 150, "scbench_mf": 5,
    "scbench_prefix_suffix": 150, "scbench_summary": 200, "scbench_vt": 30,
    "scbench_many_shot": 10, "scbench_summary_with_needles": {"scbench_summary": 800, "scbench_passkey": 15},
}
MIXED = frozenset({"scbench_summary_with_needles"})


def _query(task: str, turn: dict) -> str:
    """create_scdq_prompt's text of one query."""
    if task == "scbench_mf":
        target = re.findall(r"The .+ is", turn["input"])[0].lower()[:-3]
        return QUERIES[task].format(prefix=f"What is {target}?", input=turn["input"])
    if task in QUERIES:
        options = dict(zip(("OPTION_A", "OPTION_B", "OPTION_C", "OPTION_D"), turn.get("options", ())))
        return QUERIES[task].format(question=turn["input"], **options)
    return turn["input"]


def _answers(task: str, turn: dict) -> tuple[str, ...]:
    # eval_utils.py's get_ground_truth: a choice is right as its text or its letter; vt's answer is a list
    answer = turn["answer"]
    if task == "scbench_choice_eng":
        return answer, "ABCD"[turn["options"].index(answer)]
    return tuple(str(a) for a in answer) if isinstance(answer, list) else (str(answer),)


def _example(task: str, row: dict, index: int) -> Example:
    turns = row["multi_turns"][:MAX_TURNS]
    # str.format renders scbench_mf's context, a list of numbers, as Python writes the list, as the script does
    context = CONTEXTS[task].format(context=row["context"], prefix=turns[0]["input"])
    # a mixed set scores each question by its turn's kind (compute_scores.py)
    questions = tuple(Question(_query(task, turn), _answers(task, turn), metric=turn["task"] if task in MIXED else None)
                      for turn in turns)
    # what the multi-turn mode's gold feed puts in the cache: the previous turn's answer as the row holds it, str()
    # as create_multiturn_prompt's generic branch formats it (eval_utils.py:711; evaluation.multiturn)
    meta = {"golds": [str(turn["answer"]) for turn in turns]}
    if task == "scbench_choice_eng":
        meta["options"] = [list(turn["options"]) for turn in turns]
    if task in MIXED:
        meta["turn_tasks"] = [turn["task"] for turn in turns]
        max_new_tokens = max(MAX_NEW_TOKENS[task][kind] for kind in meta["turn_tasks"])
    else:
        max_new_tokens = MAX_NEW_TOKENS[task]
    return Example(dataset="scbench", task=task, id=str(row["id"]), context=context, questions=questions,
                   metric=task, max_new_tokens=max_new_tokens, meta=meta)


SCBENCH = HubBenchmark(name="scbench", tasks=TASKS, default_tasks=TASKS, build=_example,
                       hub=HubSource("microsoft/SCBench"))
