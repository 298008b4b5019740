"""The benchmarks as their official code runs them (issue 53): the lab against the official functions, transcribed.

The official repositories' scripts cannot run here (RULER's need nltk and tenacity, LongBench's datasets, fastchat,
flash-attention and a GPU), so each official function the lab must agree with is transcribed below as the oracle,
statement for statement, with its file and lines at these commits:
    NVIDIA/RULER c3f5e3b      scripts/data/synthetic/{niah,common_words_extraction,freq_words_extraction,qa}.py,
                              scripts/data/prepare.py
    THUDM/LongBench 2e00731   LongBench/pred.py, LongBench/eval.py, LongBench/config/model2maxlen.json
Where an official function draws from Python's global `random`, the transcription takes the stream as an argument
(`rng`), and the lab's own draws are passed in: the oracle checks what the official code does with them.
"""

from __future__ import annotations

import copy
import random
import re
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import make_tiny_llama
from transformers import AutoTokenizer

from snapkv_lab.core.framing import chat_frame
from snapkv_lab.core.models import bundled_checkpoint
from snapkv_lab.evaluation import encode_example, run_example
from snapkv_lab.evaluation import ruler as R
from snapkv_lab.evaluation.hub import load_rows
from snapkv_lab.evaluation.longbench import LONGBENCH, PROMPTS, max_length
from snapkv_lab.evaluation.metrics import METRICS
from snapkv_lab.evaluation.prompting import frame_texts
from snapkv_lab.policies import SnapKV, policy_config

FIXTURES = Path(__file__).parent / "fixtures" / "eval"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(bundled_checkpoint())


def count(tokenizer):
    """RULER's HFTokenizer.text_to_tokens (scripts/data/tokenizer.py lines 83-85)."""
    return tokenizer.tokenize


# --- 1. qa_1 and qa_2: RULER's qa.py -----------------------------------------------------------------------------

def official_read_squad(data):
    """qa.py lines 73-94 (after `json.load`)."""
    total_docs = [p['context'] for d in data['data'] for p in d['paragraphs']]
    total_docs = sorted(list(set(total_docs)))
    total_docs_dict = {c: idx for idx, c in enumerate(total_docs)}

    total_qas = []
    for d in data['data']:
        more_docs = [total_docs_dict[p['context']] for p in d['paragraphs']]
        for p in d['paragraphs']:
            for qas in p['qas']:
                if not qas['is_impossible']:
                    total_qas.append({
                        'query': qas['question'],
                        'outputs': [a['text'] for a in qas['answers']],
                        'context': [total_docs_dict[p['context']]],
                        'more_context': [idx for idx in more_docs if idx != total_docs_dict[p['context']]]
                    })

    return total_qas, total_docs


def official_read_hotpotqa(data):
    """qa.py lines 97-113 (after `json.load`)."""
    total_docs = [f"{t}\n{''.join(p)}" for d in data for t, p in d['context']]
    total_docs = sorted(list(set(total_docs)))
    total_docs_dict = {c: idx for idx, c in enumerate(total_docs)}

    total_qas = []
    for d in data:
        total_qas.append({
            'query': d['question'],
            'outputs': [d['answer']],
            'context': [total_docs_dict[f"{t}\n{''.join(p)}"] for t, p in d['context']],
        })

    return total_qas, total_docs


DOCUMENT_PROMPT = "Document {i}:\n{document}"  # qa.py line 116


def official_qa_input_output(QAS, DOCS, index, num_docs, template, rng, random_seed):
    """qa.py lines 125-150; `random` is `rng`, args.template `template`, args.random_seed `random_seed`."""
    curr_q = QAS[index]['query']
    curr_a = QAS[index]['outputs']
    curr_docs = QAS[index]['context']
    curr_more = QAS[index].get('more_context', [])
    if num_docs < len(DOCS):
        if (num_docs - len(curr_docs)) > len(curr_more):
            addition_docs = [i for i, d in enumerate(DOCS) if i not in curr_docs + curr_more]
            all_docs = curr_docs + curr_more + rng.sample(addition_docs,
                                                          max(0, num_docs - len(curr_docs) - len(curr_more)))
        else:
            all_docs = curr_docs + rng.sample(curr_more, num_docs - len(curr_docs))

        all_docs = [DOCS[idx] for idx in all_docs]
    else:
        # Repeat DOCS as many times as needed and slice to num_docs
        repeats = (num_docs + len(DOCS) - 1) // len(DOCS)  # Ceiling division
        all_docs = (DOCS * repeats)[:num_docs]

    random.Random(random_seed).shuffle(all_docs)

    context = '\n\n'.join([DOCUMENT_PROMPT.format(i=i+1, document=d) for i, d in enumerate(all_docs)])
    input_text = template.format(
        context=context,
        query=curr_q
    )
    return input_text, curr_a


def squad_file(rows) -> dict:
    """dev-v2.0.json's layout (articles, paragraphs, qas) from the Hub's rows of it (rajpurkar/squad_v2 flattens it)."""
    articles: dict[str, dict] = {}
    for row in rows:
        paragraphs = articles.setdefault(row["title"], {})
        paragraphs.setdefault(row["context"], []).append(dict(
            question=row["question"], answers=[dict(text=text) for text in row["answers"]["text"]],
            is_impossible=not row["answers"]["text"]))
    return dict(data=[dict(title=title, paragraphs=[dict(context=c, qas=qas) for c, qas in paragraphs.items()])
                      for title, paragraphs in articles.items()])


def hotpotqa_file(rows) -> list:
    """hotpot_dev_distractor_v1.json's layout from hotpotqa/hotpot_qa's rows: context as [title, sentences] pairs."""
    return [dict(question=row["question"], answer=row["answer"],
                 context=[[t, s] for t, s in zip(row["context"]["title"], row["context"]["sentences"])])
            for row in rows]


QA = {"qa_1": (official_read_squad, squad_file), "qa_2": (official_read_hotpotqa, hotpotqa_file)}


@pytest.mark.parametrize("task", ["qa_1", "qa_2"])
def test_qa_questions_and_documents_are_qa_pys(task):
    read, layout = QA[task]
    source = str(FIXTURES / "ruler")
    questions, documents = read(layout(load_rows(R._QA_SETS[task], task, source)))
    data = R.qa_data(task, source)
    assert list(data.questions) == questions and list(data.documents) == documents
    if task == "qa_1":  # the fixture has impossible questions (left out) and articles of several paragraphs
        assert len(questions) == 5 and any(q["more_context"] for q in questions)


@pytest.mark.parametrize("task", ["qa_1", "qa_2"])
def test_qa_prompt_is_qa_pys_at_every_size(task, tokenizer):
    """Every branch of generate_input_output: fewer documents than the question's article has, more (others drawn),
    and more than the set holds (repeated); the lab's draws handed to the official code."""
    read, layout = QA[task]
    source, seed = str(FIXTURES / "ruler"), 3
    questions, documents = read(layout(load_rows(R._QA_SETS[task], task, source)))
    template = R.TEMPLATES["qa"].template + R.TEMPLATES["qa"].answer_prefix  # prepare.py line 101, base template
    data = R.qa_data(task, source)
    for index in range(len(questions)):
        name = f"ruler-{seed}-{task}-4096-{index}"
        haystack = R.qa(data, index, name, 4000, seed)
        for n in range(len(questions[index]["context"]), len(documents) + 4):
            rng = random.Random(f"{name}-documents-{n}")
            official, outputs = official_qa_input_output(questions, documents, index, n, template, rng, 42 + seed)
            prompt = haystack.render(n)
            assert prompt.text == official and list(prompt.answers) == outputs, (index, n)


def official_qa_generate_samples(num_samples, max_seq_length, tokens_to_generate, generate_input_output,
                                 sample_input_output, text_to_tokens, incremental=10, pre_samples=0):
    """qa.py lines 153-206 (model_template_token 0; the search's calls are generate_input_output(0, mid), the
    examples' sample_input_output(index, used_docs)). Returns each example's (used_docs, length)."""
    out = []
    sample_input_text, _ = generate_input_output(0, incremental)
    sample_tokens = len(text_to_tokens(sample_input_text))
    tokens_per_doc = sample_tokens / incremental
    estimated_max_docs = int((max_seq_length / tokens_per_doc) * 3)
    lower_bound = incremental
    upper_bound = max(estimated_max_docs, incremental * 2)
    optimal_num_docs = None
    while lower_bound <= upper_bound:
        mid = (lower_bound + upper_bound) // 2
        input_text, answer = generate_input_output(0, mid)
        total_tokens = len(text_to_tokens(input_text)) + tokens_to_generate
        if total_tokens <= max_seq_length:
            optimal_num_docs = mid
            lower_bound = mid + 1
        else:
            upper_bound = mid - 1
    num_docs = optimal_num_docs if optimal_num_docs is not None else incremental
    for index in range(num_samples):
        used_docs = num_docs
        while(True):
            try:
                input_text, answer = sample_input_output(index + pre_samples, used_docs)
                length = len(text_to_tokens(input_text)) + tokens_to_generate
                assert length <= max_seq_length, f"{length} exceeds max_seq_length."
                break
            except AssertionError:  # the official bare except: only this assertion can raise here
                if used_docs > incremental:
                    used_docs -= incremental
        out.append((used_docs, length))
    return out


class Probes:
    """RULER's generate_input_output as the lab draws it, for the official sizing loops: the size estimate's call
    from probe 0, each search probe from probe(mid) (RULER draws anew at every call), each example from its own
    haystack. The text is what the official loop counts at that call."""

    def __init__(self, task, length, seed, tokenizer, source=None):
        self.calls = 0
        self.args = (length, seed, tokenizer, source)
        self.task = task

    def probe(self, k):
        length, seed, tokenizer, source = self.args
        return R._haystack(self.task, f"ruler-{seed}-{self.task}-{length}-probe-{k}", length, seed, 0, tokenizer,
                           "official", "turn", source)

    def search(self, n):
        haystack = self.probe(0 if self.calls == 0 else n)
        self.calls += 1
        return haystack.render(n).text

    def example(self, index, n):
        length, seed, tokenizer, source = self.args
        haystack = R._haystack(self.task, f"ruler-{seed}-{self.task}-{length}-{index}", length, seed, index, tokenizer,
                               "official", "turn", source)
        return haystack.render(n).text


def lab_sizes(task, length, tokenizer, n, seed=0, source=None):
    examples = [R.RULER.example(spec, tokenizer) for spec in R.RULER.specs(task, limit=n, lengths=(length,), seed=seed,
                                                                         source=source)]
    return [(e.meta["units"], e.meta["prompt_tokens"] + e.max_new_tokens) for e in examples]


def test_qa_sizing_is_qa_pys(tokenizer):
    source = str(FIXTURES / "ruler")
    probes = Probes("qa_1", 1500, 0, tokenizer, source)
    official = official_qa_generate_samples(3, 1500, 32, lambda i, n: (probes.search(n), None),
                                            lambda i, n: (probes.example(i, n), None), count(tokenizer))
    assert lab_sizes("qa_1", 1500, tokenizer, 3, source=source) == official


# --- 2. cwe's solved example in a turn of its own: common_words_extraction.py, prepare.py ------------------------

def official_cwe_input(template, few_shots, context, num_cw=10):
    """common_words_extraction.py lines 113-129, its word lists given: few_shots [(context, answer words)]."""
    for n in range(len(few_shots)):
        few_shots[n] = template.format(
            num_cw=num_cw,
            context=few_shots[n][0],
            query='',
        ) + ' ' + ' '.join([f"{i + 1}. {word}" for i, word in enumerate(few_shots[n][1])])

    few_shots = "\n".join(few_shots)
    input_text = template.format(
        num_cw=num_cw,
        context=context,
        query='',
    )

    return few_shots + "\n" + input_text


@pytest.mark.parametrize("framing", ["chat", "plain"])
def test_cwe_framed_as_rulers_template_puts_it(framing, tokenizer):
    """prepare.py line 101: the template is the model template around the task's, then the answer prefix; the model
    template here is the tokenizer's chat frame (chat) or RULER's 'base' "{task_template}" (plain)."""
    example = R.RULER.example(R.RULER.specs("cwe", limit=1)[0], tokenizer)
    task = R.TEMPLATES["common_words_extraction"]
    head = task.template.split("{context}")[0]
    question = example.questions[0].text
    ((shot, answer),) = example.shots
    shot_context = shot[len(head):len(shot) - len(question)]
    shot_words = re.split(r" ?\b\d+\. ", " " + answer.split(" are: ", 1)[1])[1:]
    model_template = "{task_template}" if framing == "plain" else "{}{{task_template}}{}".format(*chat_frame(tokenizer))
    template = model_template.format(task_template=task.template) + task.answer_prefix
    official = official_cwe_input(template, [(shot_context, shot_words)], example.context[len(head):])
    context, questions, chosen = frame_texts(tokenizer, example, framing)
    assert chosen == framing and context + questions[0] == official
    inline = R.RULER.example(R.RULER.specs("cwe", limit=1, cwe_shots="inline")[0], tokenizer)
    context, questions, _ = frame_texts(tokenizer, inline, framing)
    assert (context + questions[0] == official) == (framing == "plain")  # inline differs only under a chat template


# --- 3. Sizing: niah.py, common_words_extraction.py, freq_words_extraction.py --------------------------------------

def official_niah_generate_samples(num_samples, max_seq_length, tokens_to_generate, type_haystack,
                                   generate_input_output, sample_input_output, text_to_tokens):
    """niah.py lines 209-273 (model_template_token 0; the search's calls generate_input_output(n), the examples'
    sample_input_output(index, n)). Returns each example's (used_haystack, length)."""
    out = []
    if type_haystack == 'essay':
        incremental = 500
    elif type_haystack == 'noise':
        incremental = 25
    elif type_haystack == 'needle':
        incremental = 25
    if type_haystack != 'essay' and max_seq_length < 4096:
        incremental = 5
    sample_input_text = generate_input_output(incremental)
    sample_tokens = len(text_to_tokens(sample_input_text))
    tokens_per_haystack = sample_tokens / incremental
    estimated_max_questions = int((max_seq_length / tokens_per_haystack) * 3)
    lower_bound = incremental
    upper_bound = max(estimated_max_questions, incremental * 2)
    optimal_num_haystack = None
    while lower_bound <= upper_bound:
        mid = (lower_bound + upper_bound) // 2
        input_text = generate_input_output(mid)
        total_tokens = len(text_to_tokens(input_text)) + tokens_to_generate
        if total_tokens <= max_seq_length:
            optimal_num_haystack = mid
            lower_bound = mid + 1
        else:
            upper_bound = mid - 1
    num_haystack = optimal_num_haystack if optimal_num_haystack is not None else incremental
    for index in range(num_samples):
        used_haystack = num_haystack
        while(True):
            try:
                input_text = sample_input_output(index, used_haystack)
                length = len(text_to_tokens(input_text)) + tokens_to_generate
                assert length <= max_seq_length, f"{length} exceeds max_seq_length."
                break
            except AssertionError:
                if used_haystack > incremental:
                    used_haystack -= incremental
        out.append((used_haystack, length))
    return out


def official_cwe_generate_samples(num_samples, max_seq_length, tokens_to_generate, generate_input_output,
                                  sample_input_output, text_to_tokens, incremental=10):
    """common_words_extraction.py lines 131-184 (sys_word_pair_random; model_template_token 0)."""
    out = []
    sample_input_text = generate_input_output(4096)
    sample_tokens = len(text_to_tokens(sample_input_text))
    tokens_per_words = sample_tokens / 4096
    estimated_max_words = int(max_seq_length // tokens_per_words) * 2
    lower_bound = incremental
    upper_bound = max(estimated_max_words, incremental * 2)
    optimal_num_words = None
    while lower_bound <= upper_bound:
        mid = (lower_bound + upper_bound) // 2
        input_text = generate_input_output(mid)
        total_tokens = len(text_to_tokens(input_text)) + tokens_to_generate
        if total_tokens <= max_seq_length:
            optimal_num_words = mid
            lower_bound = mid + 1
        else:
            upper_bound = mid - 1
    num_words = optimal_num_words if optimal_num_words is not None else incremental
    for index in range(num_samples):
        used_words = num_words
        while(True):
            try:
                input_text = sample_input_output(index, used_words)
                length = len(text_to_tokens(input_text)) + tokens_to_generate
                assert length <= max_seq_length, f"{length} exceeds max_seq_length."
                break
            except AssertionError:
                if used_words > incremental:
                    used_words -= incremental
        out.append((used_words, length))
    return out


def official_fwe_generate_samples(num_samples, max_seq_length, tokens_to_generate, gen_text, sample_text,
                                  text_to_tokens, coded_wordlen=6):
    """freq_words_extraction.py lines 93-107 inside sys_kwext, lines 109-137 (model_template_token 0): the task's
    word count from one vocabulary (gen_text(num_words)), then each example's own (sample_text(index, num_words))."""
    max_seq_length -= tokens_to_generate
    incremental = max_seq_length // 32
    max_len = max_seq_length
    num_words = max_len // coded_wordlen  # init
    text = gen_text(num_words)
    while len(text_to_tokens(text)) < max_len:
        num_words += incremental
        text = gen_text(num_words)
    num_words -= incremental
    num_example_words = num_words
    out = []
    for index in range(num_samples):
        num_words = num_example_words
        text = sample_text(index, num_words)
        while len(text_to_tokens(text)) > max_len:
            num_words -= incremental
            text = sample_text(index, num_words)
        out.append((num_words, len(text_to_tokens(text)) + tokens_to_generate))
    return out


@pytest.mark.parametrize("task, length", [("niah_single_1", 4096), ("niah_single_1", 2048), ("niah_single_2", 4096),
                                          ("niah_multikey_2", 4096), ("niah_multikey_3", 4096), ("cwe", 4096),
                                          ("fwe", 4096)])
def test_sizing_is_rulers(task, length, tokenizer):
    """The lab's examples take the haystack size that RULER's sizing loop gives for the same draws, and are as long."""
    probes, n = Probes(task, length, 0, tokenizer), 4
    ttg = R.TEMPLATES[R.CONFIGS[task].family].tokens_to_generate
    if task == "cwe":
        official = official_cwe_generate_samples(n, length, ttg, probes.search, probes.example, count(tokenizer))
    elif task == "fwe":
        vocabulary = probes.probe(0)
        official = official_fwe_generate_samples(n, length, ttg, lambda k: vocabulary.render(k).text, probes.example,
                                                 count(tokenizer))
    else:
        official = official_niah_generate_samples(n, length, ttg, R.CONFIGS[task].type_haystack, probes.search,
                                                  probes.example, count(tokenizer))
    assert lab_sizes(task, length, tokenizer, n) == official


def test_legacy_specs_are_the_committed_tables_examples(tokenizer):
    """A spec without the options (every committed table's) rebuilds the example as the former code did: filled."""
    for task in ("niah_single_2", "cwe"):
        legacy = dict(dataset="ruler", task=task, length=4096, seed=0, index=0)
        example = R.RULER.example(legacy, tokenizer)
        assert example.meta["sizing"] == "fill" and example.shots == ()
        assert example == R.RULER.example(R.RULER.specs(task, limit=1, sizing="fill", cwe_shots="inline")[0], tokenizer)


# --- 4. LongBench's truncation and framing: pred.py ----------------------------------------------------------------

def official_build_chat(tokenizer, prompt, model_name):
    """pred.py lines 21-42, without the chatglm branches (their tokenizers' remote code) and longchat/vicuna
    (FastChat)."""
    if "llama2" in model_name:
        prompt = f"[INST]{prompt}[/INST]"
    elif "xgen" in model_name:
        header = (
            "A chat between a curious human and an artificial intelligence assistant. "
            "The assistant gives helpful, detailed, and polite answers to the human's questions.\n\n"
        )
        prompt = header + f" ### Human: {prompt}\n###"
    elif "internlm" in model_name:
        prompt = f"<|User|>:{prompt}<eoh>\n<|Bot|>:"
    return prompt


def official_longbench_input(tokenizer, json_obj, max_length, prompt_format, dataset, model_name):
    """pred.py lines 55-71 (not chatglm3): the input ids the model is given."""
    prompt = prompt_format.format(**json_obj)
    # truncate to fit max_length (we suggest truncate in the middle, since the left and right side may contain
    # crucial instructions)
    tokenized_prompt = tokenizer(prompt, truncation=False, return_tensors="pt").input_ids[0]
    if len(tokenized_prompt) > max_length:
        half = int(max_length/2)
        prompt = (tokenizer.decode(tokenized_prompt[:half], skip_special_tokens=True)
                  + tokenizer.decode(tokenized_prompt[-half:], skip_special_tokens=True))
    # chat models are better off without build prompts on these tasks
    if dataset not in ["trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"]:
        prompt = build_chat(tokenizer, prompt, model_name)
    input = tokenizer(prompt, truncation=False, return_tensors="pt")
    return input.input_ids[0].tolist()


build_chat = official_build_chat
# config/model2path.json: LongBench's model names and their Hub ids (the string-templated ones)
MODEL2PATH = {"llama2-7b-chat-4k": "meta-llama/Llama-2-7b-chat-hf", "xgen-7b-8k": "Salesforce/xgen-7b-8k-inst",
              "internlm-7b-8k": "internlm/internlm-chat-7b-8k"}


def named(tokenizer, hub_id):
    """The bundled tokenizer standing in for a model LongBench names (its Hub id is what the lab matches)."""
    other = copy.copy(tokenizer)
    other.name_or_path = hub_id
    return other


@pytest.mark.parametrize("task", ["narrativeqa", "trec", "lcc", "gov_report", "repobench-p"])
@pytest.mark.parametrize("model_name", ["SmolLM2-135M-Instruct", "llama2-7b-chat-4k", "xgen-7b-8k", "internlm-7b-8k"])
def test_longbench_input_is_pred_pys(task, model_name, tokenizer):
    """The ids the lab gives the model (the framed, cut context, then the question) are pred.py's, cut or whole."""
    tok = named(tokenizer, MODEL2PATH[model_name]) if model_name in MODEL2PATH else tokenizer
    source = str(FIXTURES / "longbench")
    for spec in LONGBENCH.specs(task, source=source):
        example = LONGBENCH.example(spec)
        row = load_rows(LONGBENCH, task, source)[spec["index"]]
        whole = len(tokenizer(example.context + example.questions[0].text)["input_ids"])
        for limit in (whole + 5, whole - 1, 24, 9):
            official = official_longbench_input(tok, row, limit, PROMPTS[task], task, model_name)
            encoded = encode_example(tok, example, max_context=limit)
            assert encoded.context_ids + encoded.questions[0] == official, (spec["index"], limit)
            assert encoded.truncated == max(0, whole - 2 * int(limit / 2))
        chat = model_name in MODEL2PATH and example.chat
        assert encoded.framing == (f"longbench-{model_name.split('-')[0]}" if chat else "plain")
    # the lab's former framing: the tokenizer's own chat template (SmolLM2's adds its system prompt)
    if example.chat and model_name not in MODEL2PATH:
        assert encode_example(tok, example, framing="chat").framing == "chat"


def test_longbench_max_length_is_model2maxlens():
    """config/model2maxlen.json against each model's window (its config's max_position_embeddings)."""
    model2maxlen = {"llama2-7b-chat-4k": 3500, "longchat-v1.5-7b-32k": 31500, "xgen-7b-8k": 7500,
                    "internlm-7b-8k": 7500, "chatglm2-6b": 31500, "chatglm2-6b-32k": 31500, "chatglm3-6b-32k": 31500,
                    "vicuna-v1.5-7b-16k": 15500}
    windows = {"llama2-7b-chat-4k": 4096, "longchat-v1.5-7b-32k": 32768, "xgen-7b-8k": 8192, "internlm-7b-8k": 8192,
               "chatglm2-6b": 32768, "chatglm2-6b-32k": 32768, "chatglm3-6b-32k": 32768, "vicuna-v1.5-7b-16k": 16384}
    assert {name: max_length(windows[name]) for name in model2maxlen} == model2maxlen
    assert max_length(8192) == 7500 and max_length(32768) == 31500  # SmolLM2, Gemma 3 270M


def test_the_former_longbench_cut_keeps_the_question_and_the_window_less_the_answer(tokenizer):
    spec = LONGBENCH.specs("narrativeqa", limit=1, source=str(FIXTURES / "longbench"), truncation="context")[0]
    example = LONGBENCH.example(spec)
    assert example.truncation == "context"
    encoded = encode_example(tokenizer, example, framing="chat", max_context=60)
    assert len(encoded.context_ids) + len(encoded.questions[0]) == 60 and encoded.framing == "chat"


# --- 5. Predictions as pred.py decodes them and eval.py scores them -------------------------------------------------

def official_scorer(dataset, predictions, answers, all_classes):
    """eval.py lines 66-75, the metrics being the lab's (LongBench/metrics.py, checked in test_eval_metrics.py)."""
    dataset2metric = {"samsum": METRICS["rouge_score"], "lcc": METRICS["code_sim_score"],
                      "trec": METRICS["classification_score"]}
    total_score = 0.
    for (prediction, ground_truths) in zip(predictions, answers):
        score = 0.
        if dataset in ["trec", "triviaqa", "samsum", "lsht"]:
            prediction = prediction.lstrip('\n').split('\n')[0]
        for ground_truth in ground_truths:
            score = max(score, dataset2metric[dataset](prediction, [ground_truth], all_classes=all_classes))
        total_score += score
    return round(100 * total_score / len(predictions), 2)


def official_pred(model, tokenizer, input_ids, max_gen, dataset):
    """pred.py lines 72-91 (greedy, post_process a no-op for these models)."""
    input = dict(input_ids=torch.tensor([input_ids]), attention_mask=torch.ones(1, len(input_ids), dtype=torch.long))
    context_length = input["input_ids"].shape[-1]
    # prevent illegal output on samsum (model endlessly repeat "\nDialogue"), might be a prompting issue
    if dataset == "samsum":
        output = model.generate(
            **input,
            max_new_tokens=max_gen,
            num_beams=1,
            do_sample=False,
            temperature=1.0,
            min_length=context_length+1,
            eos_token_id=[tokenizer.eos_token_id, tokenizer.encode("\n", add_special_tokens=False)[-1]],
        )[0]
    else:
        output = model.generate(
            **input,
            max_new_tokens=max_gen,
            num_beams=1,
            do_sample=False,
            temperature=1.0,
        )[0]
    pred = tokenizer.decode(output[context_length:], skip_special_tokens=True)
    return pred


@pytest.fixture(scope="module")
def newline_model(tokenizer):
    """A tiny random Llama over SmolLM2's vocabulary whose greedy choice is always the newline token, and " Ann" where
    the newline is barred (a bias added to its logits)."""
    model = make_tiny_llama(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, pad_token_id=0)
    bias = torch.zeros(len(tokenizer))
    bias[tokenizer.encode("\n", add_special_tokens=False)[-1]] = 100.0
    bias[tokenizer.encode(" Ann", add_special_tokens=False)[-1]] = 50.0
    model.lm_head.register_forward_hook(lambda module, inputs, logits: logits + bias)
    return model


@pytest.mark.parametrize("task", ["samsum", "lcc"])
def test_predictions_are_pred_pys_and_score_as_eval_py(task, tokenizer, newline_model):
    """The full cache's answer is pred.py's decode of model.generate (samsum: newline stop, one token first),
    unstripped, and scores as eval.py scores it."""
    spec = LONGBENCH.specs(task, limit=1, source=str(FIXTURES / "longbench"))[0]
    example = LONGBENCH.example(spec)
    encoded = encode_example(tokenizer, example, max_context=1000)
    ids = encoded.context_ids + encoded.questions[0]
    config = dict(model=None, policies=[policy_config(SnapKV(window_size=4))], budgets=[{"ratio": 0.5}],
                  modes=["query-agnostic"], max_context=1000, framing=None, example=spec)
    rows = run_example(newline_model, tokenizer, config)
    full = rows[rows["mode"] == "full"].iloc[0]
    official = official_pred(newline_model, tokenizer, ids, example.max_new_tokens, task)
    assert full.prediction == official
    score = official_scorer(task, [official], [example.questions[0].answers], None) / 100
    assert full.score == pytest.approx(score)
    if task == "samsum":  # the newline barred first, then the answer stopped at it
        assert official == " Ann\n" and full.new_tokens == 2
    else:  # no stop: the newlines run to max_new_tokens, unstripped (eval.py's code_sim_score lstrips them itself)
        assert official == "\n" * 64 and full.new_tokens == 64


def test_the_former_predictions_were_stripped_and_samsum_ran_on(tokenizer, newline_model):
    spec = LONGBENCH.specs("samsum", limit=1, source=str(FIXTURES / "longbench"), predictions="strip")[0]
    config = dict(model=None, policies=[policy_config(SnapKV(window_size=4))], budgets=[{"ratio": 0.5}],
                  modes=["query-agnostic"], max_context=1000, framing=None, example=spec)
    full = run_example(newline_model, tokenizer, config).query("mode == 'full'").iloc[0]
    assert full.new_tokens == 128 and full.prediction == full.prediction.strip()


def test_code_sim_reads_the_indentation_that_stripping_removed():
    """Why predictions="official" matters: eval.py's code_sim_score keeps the first line's indentation."""
    reference = ["    return 2 * (w + h)"]
    raw = "    return 2 * (w + h)\n"
    assert official_scorer("lcc", [raw], [reference], None) == 100.0
    assert official_scorer("lcc", [raw.strip()], [reference], None) < 100.0


# --- 1b. RULER's average over 13 tasks beside the 11 synthetic ones ------------------------------------------------

def ruler_table(tasks) -> pd.DataFrame:
    """Two examples per task, the full cache and one policy at 0.5: every synthetic task answered, qa_1 and qa_2 not."""
    rows = [dict(model="m", dataset="ruler", task=task, example=str(i), spec="", policy_config="", question=0,
                 metric="string_match_all", policy=policy, ratio=ratio, capacity=pd.NA, mode=mode,
                 score=0.0 if task.startswith("qa") else (1.0 if policy == "FullCache" else 0.5), prediction="",
                 references="[]", length=4096)
            for task in tasks for i in range(2)
            for policy, ratio, mode in (("FullCache", 0.0, "full"), ("SnapKV", 0.5, "query-agnostic"))]
    return pd.DataFrame(rows).astype({"ratio": "Float64", "capacity": "Int64", "length": "Int64"})


def test_ruler_averages_over_13_and_11_side_by_side(tmp_path):
    from snapkv_lab.app.docs_tables import _leaderboard
    from snapkv_lab.evaluation.summary import averages

    board = averages(ruler_table(R.TASKS), n_boot=0).set_index(["average", "policy"]).score
    assert board[("13 tasks", "FullCache")] == pytest.approx(100 * 11 / 13)
    assert board[("11 synthetic", "FullCache")] == pytest.approx(100.0)
    assert board[("11 synthetic", "SnapKV")] == pytest.approx(50.0)
    eleven = averages(ruler_table(R.SYNTHETIC_TASKS), n_boot=0)
    assert set(eleven.average) == {"11 synthetic"}  # a run of the 11 alone can show only theirs
    ruler_table(R.TASKS).to_csv(tmp_path / "eval_thirteen.csv", index=False)
    text = _leaderboard(tmp_path, "thirteen")
    assert "over RULER's 13 tasks [95% interval] / over its 11 synthetic ones" in text
    assert "| FullCache | 85 [85, 85] / 100 |" in text and "| SnapKV | 42 [42, 42] / 50 | - |" in text
    ruler_table(R.SYNTHETIC_TASKS).to_csv(tmp_path / "eval_eleven.csv", index=False)
    assert "| FullCache | 100 [100, 100] |" in _leaderboard(tmp_path, "eleven")
    assert "†" not in text  # a table that records no KV entries flags nothing


def test_the_docs_leaderboard_flags_a_cell_held_over_budget(tmp_path):
    """Where the table records (or an audit filled) the KV entries held, a cell whose examples held more than the
    budget in any example is marked and counted, and the held shares are printed per ratio."""
    from snapkv_lab.app.docs_tables import _leaderboard

    table = ruler_table(R.SYNTHETIC_TASKS)
    compressed = table.policy == "SnapKV"
    first = compressed & (table.task == R.SYNTHETIC_TASKS[0]) & (table.example == "0")
    table = table.assign(kv_entries=100, kv_share=compressed.map({True: 0.5, False: 1.0}),
                         budget_share=compressed.map({True: 0.5, False: 1.0}), over_budget=first)
    table.loc[first, "kv_share"] = 0.6
    table.to_csv(tmp_path / "eval_flagged.csv", index=False)
    text = _leaderboard(tmp_path, "flagged")
    assert "| SnapKV | 50 [50, 50] † |" in text and "| FullCache | 100 [100, 100] |" in text
    assert "(1 of 1 cells; `over_budget`)" in text
    share = 0.5 + 0.1 / (2 * len(R.SYNTHETIC_TASKS))  # one of the 22 examples held 0.6
    assert f"0.5: {share:.3f} to {share:.3f}" in text
    table.assign(over_budget=False).to_csv(tmp_path / "eval_flagged.csv", index=False)
    text = _leaderboard(tmp_path, "flagged")
    assert "| SnapKV | 50 [50, 50] |" in text and "(0 of 1 cells" in text and "under budget" not in text
    table.assign(over_budget=False, kv_share=compressed.map({True: 0.4, False: 1.0})).to_csv(
        tmp_path / "eval_flagged.csv", index=False)  # a tenth of the cache short of its budget: named
    assert "Held under budget by more than 0.01 of the full cache on average: SnapKV (agnostic 0.5)" in _leaderboard(
        tmp_path, "flagged")
    # a model whose sliding-window layers keep their own cache: the budget allows more than 1 - ratio (0.7 here), and
    # a cell is under budget against what its budget allows, not against 1 - ratio
    sliding = compressed.map({True: 0.7, False: 1.0})
    table.assign(over_budget=False, budget_share=sliding, kv_share=sliding - compressed * 0.05).to_csv(
        tmp_path / "eval_flagged.csv", index=False)
    assert "Held under budget by more than 0.01 of the full cache on average: SnapKV (agnostic 0.5)" in _leaderboard(
        tmp_path, "flagged")
    table.assign(over_budget=False, budget_share=sliding, kv_share=sliding).to_csv(tmp_path / "eval_flagged.csv",
                                                                                 index=False)
    assert "under budget" not in _leaderboard(tmp_path, "flagged")
    # a policy with no budget (a threshold: budget_share is the full cache's) is not "under budget": its share is said
    table.assign(over_budget=False, budget_share=1.0, kv_share=compressed.map({True: 0.05, False: 1.0})).to_csv(
        tmp_path / "eval_flagged.csv", index=False)
    text = _leaderboard(tmp_path, "flagged")
    assert "under budget" not in text and "No budget (the ratio is not theirs to hold; the share held, least to " \
        "most): SnapKV 0.050 to 0.050" in text
