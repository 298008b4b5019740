"""InfiniteBench (OpenBMB/InfiniteBench at 88b3daa), as its scripts run open models.

Rows: `xinrongzhang2022/InfiniteBench`, one split per task, fields id, context, input, answer, options, loaded
with the explicit schema the maintainers give (issue #19). Prompts: src/prompt.py's `yarn_mistral_templates`, the
ones src/eval_utils.py's `create_prompt` uses for every open model (yarn-mistral, Yi-200k, ChatGLM3); those scripts
send the prompt as raw text (no chat template), so chat is False. Generation lengths: eval_utils.py's
DATA_NAME_TO_MAX_NEW_TOKENS. Metrics: src/compute_scores.py's get_score_one_<task>, one each, named
infinitebench_<task>.

Two templates ask before the document: math_find ("{prefix}" = "What is the largest number in the following
list?") and code_run ("There is a function called {func} ..."). Their whole prompt is the context and the question
text is empty, so that a query-agnostic run never compresses with the question hidden from it (query-agnostic and
query-aware are then the same run).
"""

from __future__ import annotations

import re

from .examples import Example, Question
from .hub import HubBenchmark, HubSource, split_template

# src/prompt.py, yarn_mistral_templates, verbatim
PROMPTS = {
    "passkey": "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. I will quiz you about the important information.\n\n{context}\n\n{input}\n\nThe pass key is",  # noqa: E501
    "number_string": "There is an important info hidden inside a lot of irrelevant text. Find it. I will quiz you about the important information there.\n\n{context}\n\n{input}\n\nThe sequence of digits is",  # noqa: E501
    "kv_retrieval": "Extract the value corresponding to the specified key in the JSON object below.\n\n{context}\n\n{input}",  # noqa: E501
    "longbook_sum_eng": "Summarize the book below.\n\n{context}\n\nSummary:",
    "longbook_choice_eng": "Read the book and answer the question.\n\n{context}\n\nQuestion: {question}\nA. {OPTION_A}\nB. {OPTION_B}\nC. {OPTION_C}\nD. {OPTION_D}\n\nThe letter of the correct answer is",  # noqa: E501
    "longbook_qa_eng": "Read the book and answer the question. Be very concise in your answer.\n\n{context}\n\nQuestion: {question}\nAnswer:",  # noqa: E501
    "longbook_qa_chn": "阅读以下书籍然后回答问题。\n\n{context}\n\n问题：{question}\n答案：",
    "math_find": "{prefix}\n\n{context}\n\n{input}",
    "math_calc": "Let us calculate the intermediate values of an expression.\n\nExpression: 1 + 3 + 4\nValues: [1, 4, 8]\n\nExpression: 8 - 3 + 2 - 4\nValues: [8, 5, 7, 3]\n\nExpression: {context}\nValues:",  # noqa: E501
    "code_run": "There is a function called {func} in the following Python code.\n\n{context}\n\nPlease compute the exact value of {func_call}. The value of {func_call} is",  # noqa: E501
    "code_debug": "Following is a Python code where exactly one of the functions/methods has a deliberate error that makes it crash.\n\n{context}\n\nOptions:\nA. {OPTION_A}\nB. {OPTION_B}\nC. {OPTION_C}\nD. {OPTION_D}\n\nThe correct option is:",  # noqa: E501
    "longdialogue_qa_eng": "Below is a dialogue script where one random occurrence of a character name is replaced with \"$$MASK$$\", and you should try to guess who that character is.\n\n{context}\n\nThe name that has been replaced with $$MASK$$ is likely",  # noqa: E501
}

# src/eval_utils.py, DATA_NAME_TO_MAX_NEW_TOKENS
MAX_NEW_TOKENS = {
    "passkey": 6, "number_string": 12, "kv_retrieval": 50, "longbook_sum_eng": 1200, "longbook_choice_eng": 40,
    "longbook_qa_eng": 40, "longbook_qa_chn": 40, "longdialogue_qa_eng": 40, "math_find": 3, "math_calc": 30000,
    "code_run": 5, "code_debug": 5,
}

TASKS = tuple(MAX_NEW_TOKENS)
QUESTION_FIRST = frozenset({"math_find", "code_run"})
CHOICE = frozenset({"longbook_choice_eng", "code_debug"})


def _fields(task: str, row: dict) -> dict:
    """The template's fields, as create_prompt (src/eval_utils.py) fills them."""
    fields = {"context": row["context"], "input": row["input"], "question": row["input"]}
    if task in CHOICE:
        fields |= {f"OPTION_{letter}": option for letter, option in zip("ABCD", row["options"])}
    if task == "code_run":
        call = re.findall(r"func_[0-9]+\(\-?[0-9]+\)", row["input"])[0]
        fields |= {"func": call.split("(")[0], "func_call": call}
    if task == "math_find":
        target = re.findall(r"The .+ of", row["input"])[0].lower()[:-3]
        fields["prefix"] = f"What is {target} in the following list?"
    return fields


def _answers(task: str, row: dict) -> tuple[str, ...]:
    # eval_utils.py's get_answer: a choice is right as its text or its letter
    if task in CHOICE:
        return row["answer"][0], "ABCD"[row["options"].index(row["answer"][0])]
    return tuple(str(answer) for answer in row["answer"])


def _example(task: str, row: dict, index: int) -> Example:
    fields = _fields(task, row)
    if task in QUESTION_FIRST:
        context, question = PROMPTS[task].format(**fields), ""
    else:
        context, question = split_template(PROMPTS[task], fields)
    meta = {"options": list(row["options"])} if task in CHOICE else {}
    return Example(dataset="infinitebench", task=task, id=str(row["id"]), context=context,
                   questions=(Question(question, _answers(task, row)),), metric=f"infinitebench_{task}",
                   max_new_tokens=MAX_NEW_TOKENS[task], chat=False, meta=meta)


INFINITEBENCH = HubBenchmark(
    name="infinitebench", tasks=TASKS, default_tasks=TASKS, build=_example,
    hub=HubSource("xinrongzhang2022/InfiniteBench", config=None, split="{task}",
                  features={"id": "int64", "context": "string", "input": "string", "answer": ["string"],
                            "options": ["string"]}))
