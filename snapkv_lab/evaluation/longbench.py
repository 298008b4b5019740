"""LongBench, LongBench-E and LongBench v2 (THUDM/LongBench), as their own scripts run them.

LongBench and LongBench-E (LongBench/pred.py at 2e00731): rows of `THUDM/LongBench`, config <task> (LongBench-E:
<task>_e), split "test", fields input, context, answers, length, dataset, language, all_classes, _id; the prompt is
`dataset2prompt[task].format(**row)` (LongBench/config/dataset2prompt.json), the generation length
dataset2maxlen.json, the metric eval.py's dataset2metric; trec, triviaqa, samsum, lsht, lcc and repobench-p are
sent as raw text, without the chat template. Every template has {context} before {input}, so the context is the
template up to the end of {context} and the question the rest: context + question is the official prompt.

As pred.py runs them (the defaults; each former behaviour of the lab is an option that a spec records):
- truncation="official": the whole prompt, longer than max_length, keeps its first and last max_length / 2 tokens
  (lines 57-62; evaluation.prompting), max_length being model2maxlen.json's (`max_length`: the window less about
  500); "context": the lab's before 2026-11-29, the context alone cut to the window less the answer's tokens.
- framing: pred.py's build_chat (lines 21-42, 63-64): LongBench's own template for the models it names
  (CHAT_TEMPLATES), the prompt as it is for any other (so no chat template for SmolLM2 or Gemma); `framing="chat"`
  at run time gives the tokenizer's template instead (the lab's before 2026-11-29).
- predictions="official": the answer as pred.py decodes it (line 91, no strip: eval.py only lstrip('\n')s the
  four few-shot tasks, whose first line it scores), and samsum's answer ends at its first newline token once one
  token is out (lines 73-82); "strip": the lab's before 2026-11-29, the answer stripped and samsum not stopped.

LongBench v2 (pred.py and prompts/0shot.txt at the repository root): rows of `THUDM/LongBench-v2`, split "train",
fields _id, domain, sub_domain, difficulty, length, question, choice_A..D, answer, context; 0-shot, 128 new tokens;
$DOC$ comes before $Q$, so the split is the same.
"""

from __future__ import annotations

from .examples import Example, Question
from .hub import HubBenchmark, HubSource, split_template

# LongBench/config/dataset2prompt.json, verbatim (narrativeqa's "asconcisely" included: the string defines the set).
PROMPTS = {
    "narrativeqa": "You are given a story, which can be either a novel or a movie script, and a question. Answer the question asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nStory: {context}\n\nNow, answer the question based on the story asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:",  # noqa: E501
    "qasper": "You are given a scientific article and a question. Answer the question as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write \"unanswerable\". If the question is a yes/no question, answer \"yes\", \"no\", or \"unanswerable\". Do not provide any explanation.\n\nArticle: {context}\n\n Answer the question based on the above article as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write \"unanswerable\". If the question is a yes/no question, answer \"yes\", \"no\", or \"unanswerable\". Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:",  # noqa: E501
    "multifieldqa_en": "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question based on the above text, only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",  # noqa: E501
    "multifieldqa_zh": "阅读以下文字并用中文简短回答：\n\n{context}\n\n现在请基于上面的文章回答下面的问题，只告诉我答案，不要输出任何其他字词。\n\n问题：{input}\n回答：",  # noqa: E501
    "hotpotqa": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",  # noqa: E501
    "2wikimqa": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",  # noqa: E501
    "musique": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",  # noqa: E501
    "dureader": "请基于给定的文章回答下述问题。\n\n文章：{context}\n\n请基于上述文章回答下面的问题。\n\n问题：{input}\n回答：",  # noqa: E501
    "gov_report": "You are given a report by a government agency. Write a one-page summary of the report.\n\nReport:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:",  # noqa: E501
    "qmsum": "You are given a meeting transcript and a query containing a question or instruction. Answer the query in one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above meeting transcript in one or more sentences.\n\nQuery: {input}\nAnswer:",  # noqa: E501
    "multi_news": "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}\n\nNow, write a one-page summary of all the news.\n\nSummary:",  # noqa: E501
    "vcsum": "下面有一段会议记录，请你阅读后，写一段总结，总结会议的内容。\n会议记录：\n{context}\n\n会议总结：",
    "trec": "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n{input}",  # noqa: E501
    "triviaqa": "Answer the question based on the given passage. Only give me the answer and do not output any other words. The following are some examples.\n\n{context}\n\n{input}",  # noqa: E501
    "samsum": "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n{input}",  # noqa: E501
    "lsht": "请判断给定新闻的类别，下面是一些例子。\n\n{context}\n{input}",
    "passage_count": "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please carefully read these paragraphs and determine how many unique paragraphs there are after removing duplicates. In other words, how many non-repeating paragraphs are there in total?\n\n{context}\n\nPlease enter the final count of unique paragraphs after removing duplicates. The output format should only contain the number, such as 1, 2, 3, and so on.\n\nThe final answer is: ",  # noqa: E501
    "passage_retrieval_en": "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph the abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\nPlease enter the number of the paragraph that the abstract is from. The answer format must be like \"Paragraph 1\", \"Paragraph 2\", etc.\n\nThe answer is: ",  # noqa: E501
    "passage_retrieval_zh": "以下是若干段落文字，以及其中一个段落的摘要。请确定给定的摘要出自哪一段。\n\n{context}\n\n下面是一个摘要\n\n{input}\n\n请输入摘要所属段落的编号。答案格式必须是\"段落1\"，\"段落2\"等格式\n\n答案是：",  # noqa: E501
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}

# LongBench/config/dataset2maxlen.json
MAX_NEW_TOKENS = {
    "narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "multifieldqa_zh": 64, "hotpotqa": 32, "2wikimqa": 32,
    "musique": 32, "dureader": 128, "gov_report": 512, "qmsum": 512, "multi_news": 512, "vcsum": 512, "trec": 64,
    "triviaqa": 32, "samsum": 128, "lsht": 64, "passage_count": 32, "passage_retrieval_en": 32,
    "passage_retrieval_zh": 32, "lcc": 64, "repobench-p": 64,
}

# LongBench/eval.py, dataset2metric
METRICS = {
    "narrativeqa": "qa_f1_score", "qasper": "qa_f1_score", "multifieldqa_en": "qa_f1_score",
    "multifieldqa_zh": "qa_f1_zh_score", "hotpotqa": "qa_f1_score", "2wikimqa": "qa_f1_score",
    "musique": "qa_f1_score", "dureader": "rouge_zh_score", "gov_report": "rouge_score", "qmsum": "rouge_score",
    "multi_news": "rouge_score", "vcsum": "rouge_zh_score", "trec": "classification_score",
    "triviaqa": "qa_f1_score", "samsum": "rouge_score", "lsht": "classification_score",
    "passage_retrieval_en": "retrieval_score", "passage_count": "count_score",
    "passage_retrieval_zh": "retrieval_zh_score", "lcc": "code_sim_score", "repobench-p": "code_sim_score",
}

# pred.py: "chat models are better off without build prompts on these tasks"
RAW_TEXT = frozenset({"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"})
# eval.py scores only the first line of the prediction on these (the few-shot tasks)
FIRST_LINE = frozenset({"trec", "triviaqa", "samsum", "lsht"})

TASKS = tuple(PROMPTS)  # pred.py's order
E_TASKS = ("qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "gov_report", "multi_news", "trec", "triviaqa",
           "samsum", "passage_count", "passage_retrieval_en", "lcc", "repobench-p")  # pred.py --e


# pred.py lines 73-82: samsum's answer also ends at a newline token, and not before one token is out
STOP = {"samsum": ("\n",)}

# pred.py build_chat (lines 21-42) for the models of config/model2path.json, by Hub id: (name, before, after) the
# prompt. longchat and vicuna: FastChat's get_conversation_template("vicuna") ("vicuna_v1.1": the system message,
# " USER: ", the prompt, " ASSISTANT:"). The chatglm models are framed by their tokenizers' own remote code
# (build_prompt, build_chat_input): not reproduced here.
_VICUNA = ("vicuna", "A chat between a curious user and an artificial intelligence assistant. The assistant gives "
           "helpful, detailed, and polite answers to the user's questions. USER: ", " ASSISTANT:")
CHAT_TEMPLATES = {
    "meta-llama/Llama-2-7b-chat-hf": ("llama2", "[INST]", "[/INST]"),
    "lmsys/longchat-7b-v1.5-32k": _VICUNA,
    "lmsys/vicuna-7b-v1.5-16k": _VICUNA,
    "Salesforce/xgen-7b-8k-inst": ("xgen", "A chat between a curious human and an artificial intelligence assistant. "
                                   "The assistant gives helpful, detailed, and polite answers to the human's "
                                   "questions.\n\n ### Human: ", "\n###"),
    "internlm/internlm-chat-7b-8k": ("internlm", "<|User|>:", "<eoh>\n<|Bot|>:"),
}
NOT_REPRODUCED_CHAT = ("THUDM/chatglm2-6b", "THUDM/chatglm2-6b-32k", "THUDM/chatglm3-6b-32k")


def longbench_frame(tokenizer) -> tuple[str, str, str]:
    """(framing name, text before the prompt, text after it) of pred.py's build_chat for this tokenizer's model
    (its name_or_path, a Hub id of config/model2path.json): LongBench's template, or ("plain", "", "") for a model
    LongBench does not name (build_chat returns the prompt as it is)."""
    model = getattr(tokenizer, "name_or_path", "")
    if model in NOT_REPRODUCED_CHAT:
        raise ValueError(f"LongBench frames {model} with its tokenizer's own build_prompt (remote code), which is not "
                         "reproduced here: run it with framing='chat' or 'plain'")
    if model not in CHAT_TEMPLATES:
        return "plain", "", ""
    name, head, tail = CHAT_TEMPLATES[model]
    return f"longbench-{name}", head, tail


def max_length(window: int) -> int:
    """LongBench's max_length for a model of `window` positions: config/model2maxlen.json gives each of its models
    its window in thousands of tokens (4k, 8k, 16k, 32k: 4096 ... 32768 positions) x 1000, less 500 (3500, 7500,
    15500, 31500); the same rule for any other model."""
    return window // 1024 * 1000 - 500


TRUNCATIONS = ("official", "context")
PREDICTIONS = ("official", "strip")
OPTIONS = {"truncation": TRUNCATIONS, "predictions": PREDICTIONS}  # the official value first
LEGACY = {"truncation": "context", "predictions": "strip"}  # what a spec written before these options meant


def _longbench_example(dataset: str):
    def build(task: str, row: dict, index: int, truncation: str = "official", predictions: str = "official") -> Example:
        official = predictions == "official"
        context, question = split_template(PROMPTS[task], row)
        meta = {key: row[key] for key in ("all_classes", "length", "language", "_id")}
        return Example(dataset=dataset, task=task, id=row["_id"], context=context,
                       questions=(Question(question, tuple(row["answers"])),), metric=METRICS[task],
                       max_new_tokens=MAX_NEW_TOKENS[task], chat=task not in RAW_TEXT,
                       meta=meta | ({"first_line": True} if task in FIRST_LINE else {}),
                       truncation="prompt" if truncation == "official" else "context",
                       frame="longbench",
                       stop=STOP.get(task, ()) if official else (), raw_prediction=official)
    return build


# THUDM/LongBench is loaded by its LongBench.py script: datasets >= 2.16 and < 4 with trust_remote_code
LONGBENCH = HubBenchmark(name="longbench", tasks=TASKS, default_tasks=TASKS,
                         hub=HubSource("THUDM/LongBench", load_kwargs={"trust_remote_code": True}),
                         build=_longbench_example("longbench"), options=OPTIONS, legacy=LEGACY)
LONGBENCH_E = HubBenchmark(name="longbench-e", tasks=E_TASKS, default_tasks=E_TASKS,
                           hub=HubSource("THUDM/LongBench", config="{task}_e",
                                         load_kwargs={"trust_remote_code": True}),
                           build=_longbench_example("longbench-e"), options=OPTIONS, legacy=LEGACY)

# prompts/0shot.txt, verbatim (no newline at its end)
V2_PROMPT = ("Please read the following text and answer the question below.\n\n<text>\n$DOC$\n</text>\n\n"
             "What is the correct answer to this question: $Q$\nChoices:\n"
             "(A) $C_A$\n(B) $C_B$\n(C) $C_C$\n(D) $C_D$\n\n"
             "Format your response as follows: \"The correct answer is (insert answer here)\".")
V2_FIELDS = {"$Q$": "question", "$C_A$": "choice_A", "$C_B$": "choice_B", "$C_C$": "choice_C", "$C_D$": "choice_D"}


def _v2_example(task: str, row: dict, index: int) -> Example:
    # pred.py fills the template with str.replace, each field stripped
    head, _, tail = V2_PROMPT.partition("$DOC$")
    for marker, field in V2_FIELDS.items():
        tail = tail.replace(marker, row[field].strip())
    meta = {key: row[key] for key in ("_id", "domain", "sub_domain", "difficulty", "length")}
    return Example(dataset="longbench-v2", task=task, id=row["_id"], context=head + row["context"].strip(),
                   questions=(Question(tail, (row["answer"],)),), metric="choice_accuracy", max_new_tokens=128,
                   meta=meta)


# One task, named after the prompt it runs (prompts/0shot.txt): the set is one split of 503 questions.
LONGBENCH_V2 = HubBenchmark(name="longbench-v2", tasks=("0shot",), default_tasks=("0shot",),
                            hub=HubSource("THUDM/LongBench-v2", config=None, split="train"), build=_v2_example)
