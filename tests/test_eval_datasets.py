"""The Hub benchmarks, offline: rows from tests/fixtures/eval/<dataset>/<task>.jsonl (tiny invented rows in each
set's own schema) become the official prompts, split into context and question; the Hub path through a stand-in
`datasets` module. Expected prompts are written out by hand from the official templates."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
from conftest import ByteTokenizer

from snapkv_lab.evaluation import hub
from snapkv_lab.evaluation.examples import Example
from snapkv_lab.evaluation.hub import NEEDLE_HUB, RULER_HUB, load_rows
from snapkv_lab.evaluation.infinitebench import INFINITEBENCH
from snapkv_lab.evaluation.longbench import LONGBENCH, LONGBENCH_E, LONGBENCH_V2
from snapkv_lab.evaluation.loogle import LOOGLE
from snapkv_lab.evaluation.scbench import SCBENCH

FIXTURES = Path(__file__).parent / "fixtures" / "eval"


@pytest.fixture(autouse=True)
def fresh_cache():
    load_rows.cache_clear()  # rows are cached per process: each test reads its own source
    yield
    load_rows.cache_clear()


def test_every_fixture_example_is_scored_by_a_reproduced_metric():
    from snapkv_lab.evaluation.metrics import METRICS
    from snapkv_lab.evaluation.registry import DATASETS

    for folder in sorted(FIXTURES.iterdir()):
        benchmark = DATASETS[folder.name.removesuffix("-multiturn")]  # SCBench's multi-turn rows: SCBench's schema
        for path in sorted(folder.rglob("*.jsonl")):
            task = path.stem
            if task not in benchmark.tasks:
                continue
            lengths = (2000,) if folder.name == "needle-hub" else ()  # ruler-hub's fixture is its 4096 config
            for spec in benchmark.specs(task, source=str(folder), lengths=lengths):
                example = benchmark.example(spec, ByteTokenizer())
                for question in example.questions:
                    assert (question.metric or example.metric) in METRICS, (folder.name, task)


def first(benchmark, task: str, index: int = 0) -> Example:
    source = str(FIXTURES / benchmark.name)
    return benchmark.example(dict(dataset=benchmark.name, task=task, index=index, source=source), None)


def prompt(example: Example, question: int = 0) -> str:
    return example.context + example.questions[question].text


def fake_datasets(rows: list[dict], calls: list):
    """A stand-in for the datasets package: load_dataset records its arguments and returns `rows`."""
    def load_dataset(path, name=None, **kwargs):
        calls.append((path, name, kwargs))
        return rows
    return types.SimpleNamespace(load_dataset=load_dataset, Features=dict, Value=lambda dtype: dtype,
                                 Sequence=lambda feature: [feature])


# LongBench (LongBench/config/dataset2prompt.json, dataset2maxlen.json, eval.py, pred.py)

def test_longbench_specs_count_and_limit():
    source = str(FIXTURES / "longbench")
    official = dict(truncation="official", predictions="official")  # the protocol options, pred.py's by default
    assert LONGBENCH.specs("narrativeqa", source=source) == [
        dict(dataset="longbench", task="narrativeqa", source=source, index=0, **official),
        dict(dataset="longbench", task="narrativeqa", source=source, index=1, **official)]
    # the lab's former way is recorded by leaving the option out, as in the specs of tables written before it
    assert LONGBENCH.specs("narrativeqa", limit=1, source=source, truncation="context")[0] == dict(
        dataset="longbench", task="narrativeqa", source=source, index=0, predictions="official")
    with pytest.raises(ValueError, match="truncation must be one of"):
        LONGBENCH.specs("narrativeqa", source=source, truncation="middle")
    with pytest.raises(ValueError, match="longbench has no option sizing"):
        LONGBENCH.specs("narrativeqa", source=source, sizing="fill")
    assert len(LONGBENCH.specs("narrativeqa", limit=1, lengths=(4096,), seed=3, source=source)) == 1
    assert len(LONGBENCH.specs("narrativeqa", limit=10, source=source)) == 2


def test_longbench_narrativeqa_is_the_official_prompt_split_after_the_story():
    example = first(LONGBENCH, "narrativeqa")
    assert example.context == (
        "You are given a story, which can be either a novel or a movie script, and a question. Answer the question "
        "asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nStory: Mara "
        "kept bees behind the mill. One winter the hives went quiet. In spring she found the queen alive under the "
        "floorboards.")
    assert example.questions[0].text == (
        "\n\nNow, answer the question based on the story asconcisely as you can, using a single phrase if possible. "
        "Do not provide any explanation.\n\nQuestion: Where did Mara find the queen?\n\nAnswer:")
    assert example.questions[0].answers == ("under the floorboards",)
    assert (example.id, example.metric, example.max_new_tokens, example.chat) == (
        "narrativeqa-0000", "qa_f1_score", 128, True)
    assert example.meta == {"all_classes": None, "length": 22, "language": "en", "_id": "narrativeqa-0000"}


def test_longbench_chinese_prompt():
    example = first(LONGBENCH, "multifieldqa_zh")
    assert prompt(example) == ("阅读以下文字并用中文简短回答：\n\n小镇的钟楼建于一八九零年。钟声每天正午响一次。\n\n"
                               "现在请基于上面的文章回答下面的问题，只告诉我答案，不要输出任何其他字词。\n\n问题：钟楼建于哪一年？\n回答：")
    assert example.context.endswith("钟声每天正午响一次。")
    assert (example.metric, example.max_new_tokens, example.meta["language"]) == ("qa_f1_zh_score", 64, "zh")


def test_longbench_templates_that_split_specially():
    trec = first(LONGBENCH, "trec")  # {context}\n{input}: the few-shot examples are the context
    assert trec.context == ("Please determine the type of the question below. Here are some examples of questions.\n\n"
                            "Question: Who painted the chapel ceiling ?\nType: Individual\n"
                            "Question: How far is the moon ?\nType: Distance")
    assert trec.questions[0].text == "\nQuestion: Where is the old lighthouse ?\nType:"
    assert trec.meta["all_classes"] == ["Individual", "Distance", "Other location"]
    assert trec.meta["first_line"] is True
    lcc = first(LONGBENCH, "lcc")  # no {input}
    assert lcc.context == ("Please complete the code given below. \ndef area(w, h):\n    return w * h\n\n"
                           "def perimeter(w, h):\n")
    assert lcc.questions[0].text == "Next line of code:\n"
    repobench = first(LONGBENCH, "repobench-p")  # {context}{input}: the file being completed is the question
    assert repobench.context == ("Please complete the code given below. \n# path: shapes/square.py\nclass Square:\n"
                                 "    def __init__(self, side):\n        self.side = side\n")
    assert repobench.questions[0].text == ("# path: shapes/main.py\nfrom shapes.square import Square\ns = Square(3)\n"
                                           "Next line of code:\n")
    gov = first(LONGBENCH, "gov_report")
    assert gov.questions[0].text == "\n\nNow, write a one-page summary of the report.\n\nSummary:"
    count = first(LONGBENCH, "passage_count", 1)
    assert prompt(count) == (
        "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please carefully read "
        "these paragraphs and determine how many unique paragraphs there are after removing duplicates. In other "
        "words, how many non-repeating paragraphs are there in total?\n\nParagraph 1: Salt melts ice.\n\nParagraph 2: "
        "Sand gives grip.\n\nPlease enter the final count of unique paragraphs after removing duplicates. The output "
        "format should only contain the number, such as 1, 2, 3, and so on.\n\nThe final answer is: ")
    assert (count.metric, count.max_new_tokens) == ("count_score", 32)


def test_longbench_lengths_metrics_and_raw_text_tasks():
    raw = {"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"}
    row = dict(input="q", context="c", answers=["a"], length=1, dataset="x", language="en", all_classes=None, _id="i")
    examples = {task: LONGBENCH.build(task, row, 0) for task in LONGBENCH.tasks}
    assert len(examples) == 21
    assert {task for task, example in examples.items() if not example.chat} == raw
    assert {task: (examples[task].max_new_tokens, examples[task].metric) for task in
            ("qasper", "hotpotqa", "dureader", "gov_report", "vcsum", "trec", "triviaqa", "samsum", "lsht",
             "passage_retrieval_en", "passage_retrieval_zh", "repobench-p")} == {
        "qasper": (128, "qa_f1_score"), "hotpotqa": (32, "qa_f1_score"), "dureader": (128, "rouge_zh_score"),
        "gov_report": (512, "rouge_score"), "vcsum": (512, "rouge_zh_score"), "trec": (64, "classification_score"),
        "triviaqa": (32, "qa_f1_score"), "samsum": (128, "rouge_score"), "lsht": (64, "classification_score"),
        "passage_retrieval_en": (32, "retrieval_score"), "passage_retrieval_zh": (32, "retrieval_zh_score"),
        "repobench-p": (64, "code_sim_score")}


def test_longbench_e_reads_the_e_configs(monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "datasets", fake_datasets([{"x": 1}], calls))
    assert len(LONGBENCH_E.specs("qasper")) == 1
    assert calls == [("THUDM/LongBench", "qasper_e", {"split": "test", "trust_remote_code": True})]
    assert "narrativeqa" not in LONGBENCH_E.tasks and len(LONGBENCH_E.tasks) == 13
    samsum = first(LONGBENCH_E, "samsum")
    assert samsum.questions[0].text == "\n\nDialogue: Cy: Lost my keys. Di: Check the car.\nSummary: "
    assert (samsum.chat, samsum.dataset, samsum.meta["length"]) == (False, "longbench-e", 15)
    assert first(LONGBENCH_E, "qasper", 1).questions[0].answers == ("no",)


def test_longbench_v2_zero_shot_prompt():
    example = first(LONGBENCH_V2, "0shot")  # pred.py strips the context, the question and the choices
    assert example.context == ("Please read the following text and answer the question below.\n\n<text>\nThe keeper "
                               "heard that his brother's boat was late. He kept the lamp lit until dawn. The boat came "
                               "in at six.")
    assert example.questions[0].text == (
        "\n</text>\n\nWhat is the correct answer to this question: Why did the keeper leave the lamp lit?\nChoices:\n"
        "(A) To guide a late boat\n(B) He forgot\n(C) To scare gulls\n(D) For warmth\n\nFormat your response as "
        "follows: \"The correct answer is (insert answer here)\".")
    assert example.questions[0].answers == ("A",)
    assert (example.metric, example.max_new_tokens, example.id) == ("choice_accuracy", 128, "v2-0000")
    assert (example.meta["difficulty"], example.meta["length"]) == ("easy", "short")
    assert first(LONGBENCH_V2, "0shot", 1).meta["difficulty"] == "hard"


# InfiniteBench (src/prompt.py yarn_mistral_templates, src/eval_utils.py)

def test_infinitebench_passkey():
    example = first(INFINITEBENCH, "passkey")
    assert example.context == ("There is an important info hidden inside a lot of irrelevant text. Find it and "
                               "memorize it. I will quiz you about the important information.\n\nThe grass is green. "
                               "The sky is blue. The pass key is 71432. Remember it. The grass is green.")
    assert example.questions[0].text == "\n\nWhat is the pass key?\n\nThe pass key is"
    assert (example.questions[0].answers, example.metric, example.max_new_tokens, example.chat) == (
        ("71432",), "infinitebench_passkey", 6, False)


def test_infinitebench_choice_keeps_text_and_letter():
    example = first(INFINITEBENCH, "longbook_choice_eng")
    assert example.questions[0].text == ("\n\nQuestion: What did Tess buy at the fair?\nA. A boat\nB. A goat\n"
                                         "C. A net\nD. A coat\n\nThe letter of the correct answer is")
    assert example.questions[0].answers == ("A goat", "B")
    assert example.meta == {"options": ["A boat", "A goat", "A net", "A coat"]}
    assert first(INFINITEBENCH, "longbook_choice_eng", 1).questions[0].answers == ("Wheat", "C")


def test_infinitebench_question_first_templates_are_all_context():
    math = first(INFINITEBENCH, "math_find")
    assert math.context == ("What is the largest number in the following list?\n\n[3, 17, 5, 9]\n\nGive one number "
                            "only. The largest number of the list is:")
    assert math.questions[0].text == ""
    assert first(INFINITEBENCH, "math_find", 1).context.startswith("What is the smallest number in the following list?")
    code = first(INFINITEBENCH, "code_run")
    assert code.context == ("There is a function called func_2 in the following Python code.\n\ndef func_1(x):\n    "
                            "return x + 1\n\ndef func_2(x):\n    return func_1(x) * 2\n\nPlease compute the exact "
                            "value of func_2(4). The value of func_2(4) is")
    assert code.questions[0].text == ""
    assert "func_7(-2). The value of func_7(-2) is" in first(INFINITEBENCH, "code_run", 1).context
    assert (math.max_new_tokens, code.max_new_tokens) == (3, 5)


def test_infinitebench_lengths_and_hub_schema(monkeypatch):
    row = {"id": 7, "context": "1 + 2", "input": "", "answer": ["3"], "options": []}
    calc = INFINITEBENCH.build("math_calc", row, 0)
    assert (calc.max_new_tokens, calc.metric, calc.id) == (30000, "infinitebench_math_calc", "7")
    assert calc.questions[0].text == "\nValues:"
    assert INFINITEBENCH.build("longbook_sum_eng", row, 0).max_new_tokens == 1200
    calls = []
    monkeypatch.setitem(sys.modules, "datasets", fake_datasets([row], calls))
    assert INFINITEBENCH.example(dict(task="math_calc", index=0), None) == calc
    assert calls == [("xinrongzhang2022/InfiniteBench", None, {"split": "math_calc", "features": {
        "id": "int64", "context": "string", "input": "string", "answer": ["string"], "options": ["string"]}})]


# LooGLE (config/task2prompt.json, task2maxlen.json)

def test_loogle_questions_share_one_context():
    example = first(LOOGLE, "shortdep_qa")
    assert example.context == ("Please answer the question based on the long texts below. \nThe canal opened in 1822. "
                               "Barges carried coal to the city. The towpath is now a cycle route.")
    assert [question.text for question in example.questions] == [
        "\nQuestion: When did the canal open?\nAnswer: ", "\nQuestion: What did the barges carry?\nAnswer: "]
    assert [question.answers for question in example.questions] == [("In 1822.",), ("Coal.",)]
    assert (example.metric, example.max_new_tokens, example.chat, example.meta) == (
        "loogle_rouge_l", 300, False, {"title": "Old Canal"})
    assert len(first(LOOGLE, "shortdep_qa", 1).questions) == 1


def test_loogle_cloze_summary_and_long_dependency():
    cloze = first(LOOGLE, "shortdep_cloze")
    assert cloze.context == (
        "Please fill in the clozes based on the given long texts below. Each of the placeholder '<mask-n>' in the "
        "question could be an entity of Person, Location or Organiocation. The same masks represent the same entity. "
        "Output a json format answer, for example: {'<mask-0>': 'Bob', '<mask-1>': 'Gorrosion Magazine','<mask-2>': "
        "'Bethel Horizon'}\nRosa Lind founded the Harbor Choir in Vetta. Rosa led it for ten years.")
    assert cloze.questions[0].text == ("\n Question: <mask-0> founded the Harbor Choir in <mask-1>. What are the "
                                       "masked entities? \nAnswer:")
    assert cloze.questions[0].answers == ('{"<mask-0>": "Rosa Lind", "<mask-1>": "Vetta"}',)
    assert (cloze.metric, cloze.max_new_tokens) == ("loogle_exact_match", 50)
    summary = first(LOOGLE, "longdep_summarization")
    assert prompt(summary) == ("Please generate a summary of the below paper. \nAbstract. We count birds on two "
                               "islands for a year and find that the smaller island has more species.\n"
                               " Summarization: ")
    assert summary.questions[0].answers == (
        "A year of bird counts on two islands shows more species on the smaller one.",)
    assert summary.max_new_tokens == 500
    long = first(LOOGLE, "longdep_qa")
    assert long.meta["types"] == ["timeline_reorder", "computation"]
    assert long.questions[0].text == "\nQuestion: Which came first?\n1. the bakery\n2. the move\nAnswer: "
    assert long.max_new_tokens == 500


# SCBench (scbench/eval_utils.py, same-context-different-query mode)

def test_scbench_turns_become_questions_of_one_context():
    example = first(SCBENCH, "scbench_qa_eng")
    assert example.context == ("Read the book and answer the question. Be very concise in your answer.\n\nNell sailed "
                               "west for nine days. On the tenth she saw an island with a red tower.")
    assert [question.text for question in example.questions] == [
        "Question: How many days did Nell sail?\nAnswer:", "Question: What color was the tower?\nAnswer:",
        "Question: Which way did Nell sail?\nAnswer:"]
    assert [question.answers for question in example.questions] == [("nine",), ("red",), ("west",)]
    assert (example.metric, example.max_new_tokens, example.chat, example.id) == ("scbench_qa_eng", 40, True, "0")
    kv = first(SCBENCH, "scbench_kv")
    assert kv.context == ('Extract the value corresponding to the specified key in the JSON object below.\n\n'
                          '{"a1": "x9", "b2": "y8", "c3": "z7"}')
    assert kv.questions[1].text == 'Key: "c3"\nThe value associated with the specified key is: '
    assert (kv.questions[1].answers, kv.max_new_tokens) == (("z7",), 150)


def test_scbench_choice_and_number_lists():
    choice = first(SCBENCH, "scbench_choice_eng")
    assert choice.questions[1].text == ("Question: How was Pim paid?\nA. In gold\nB. In bread\nC. In salt\n"
                                        "D. In wool\n\nThe the correct answer is")
    assert [question.answers for question in choice.questions] == [("Beans", "B"), ("In salt", "C")]
    mf = first(SCBENCH, "scbench_mf")  # the first turn's input opens the context, as in the official template
    assert mf.context == "Answer with one number. The smallest value in the list is\n\n[4, 11, 2, 7]"
    assert mf.questions[1].text == ("What is the largest value in the list?\n\nAnswer with one number. The largest "
                                    "value in the list is")
    assert (mf.questions[0].answers, mf.max_new_tokens) == (("2",), 5)


def test_scbench_mixed_set_scores_each_turn_by_its_kind_and_turn_limit():
    mixed = first(SCBENCH, "scbench_summary_with_needles")
    assert mixed.context == "The harbour froze in March. The pass key is 4471. Boats waited for the thaw."
    assert [q.text for q in mixed.questions] == ["Summarize the text in one sentence.", "What is the pass key?"]
    assert [q.metric for q in mixed.questions] == ["scbench_summary", "scbench_passkey"]
    assert mixed.max_new_tokens == 800  # the longer of its turns' lengths (summary 800, passkey 15)
    assert first(SCBENCH, "scbench_summary_with_needles", 1).max_new_tokens == 15  # its one turn is a pass key
    # metric not reproduced
    assert "scbench_repoqa" not in SCBENCH.tasks and "scbench_repoqa_and_kv" not in SCBENCH.tasks
    row = {"id": 3, "context": "c", "multi_turns": [{"input": f"q{i}", "answer": f"a{i}"} for i in range(7)]}
    assert ([question.text for question in SCBENCH.build("scbench_vt", row, 0).questions]
            == ["q0", "q1", "q2", "q3", "q4"])


# kvpress's pre-rendered sets

def test_ruler_hub_reads_a_length_config_and_keeps_the_task(monkeypatch):
    source = str(FIXTURES / "ruler-hub")
    assert RULER_HUB.specs("qa_1", source=source) == [
        dict(dataset="ruler-hub", task="qa_1", source=source, length=4096, index=i) for i in range(2)]
    qa = RULER_HUB.example(RULER_HUB.specs("qa_1", source=source)[1], None)
    assert qa.context.endswith("Document 1:\nThe Tarn mine closed in 1931.\n\n")
    assert qa.questions[0].answer_prefix == "Answer:"
    assert (qa.questions[0].answers, qa.metric, qa.max_new_tokens) == (("1931",), "string_match_part", 32)
    niah = RULER_HUB.example(dict(task="niah_single_1", index=0, source=source, length=4096), None)
    assert (niah.metric, niah.max_new_tokens, niah.questions[0].answers) == ("string_match_all", 128, ("4417201",))
    assert {"qa_1", "qa_2", "niah_multiquery", "vt", "cwe", "fwe"} <= set(RULER_HUB.tasks)
    calls = []
    rows = [{"task": "vt"}, {"task": "qa_2"}, {"task": "qa_2"}]
    monkeypatch.setitem(sys.modules, "datasets", fake_datasets(rows, calls))
    assert len(RULER_HUB.specs("qa_2", lengths=(8192, 16384))) == 4
    assert calls == [("simonjegou/ruler", "8192", {"split": "test"}), ("simonjegou/ruler", "16384", {"split": "test"})]


def test_needle_hub_puts_the_needle_at_a_depth():
    source = str(FIXTURES / "needle-hub")
    needle = " The secret ingredient is smoked paprika. "
    with pytest.raises(ValueError, match="lengths"):
        NEEDLE_HUB.specs("needle_in_haystack", source=source)
    specs = NEEDLE_HUB.specs("needle_in_haystack", lengths=(150 + len(needle) + 21,), source=source)
    assert [spec["depth"] for spec in specs] == [0, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100]
    assert ([s["depth"] for s in NEEDLE_HUB.specs("needle_in_haystack", limit=3, lengths=(1,), source=source)]
            == [0, 50, 100])
    start, end = (NEEDLE_HUB.example(specs[i], ByteTokenizer()) for i in (0, -1))
    # 21 tokens (bytes) of the haystack are kept: the length less the needle and kvpress's 150 for the framing
    assert start.context == ("This is a very long story book: <book>  The secret ingredient is smoked paprika. The "
                             "hills were quiet. </book>.")
    assert end.context == ("This is a very long story book: <book> The hills were quiet. The secret ingredient is "
                           "smoked paprika.  </book>.")
    assert end.questions[0].text == "What is the secret ingredient?"
    assert (end.questions[0].answers, end.questions[0].answer_prefix) == ((needle,), "Answer:")
    assert (end.metric, end.max_new_tokens, end.meta["depth"]) == ("needle_rouge", 32, 100)


# Errors

def test_missing_source_file_says_what_is_expected(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"qasper\.jsonl not found: --source .*<task>\.jsonl.*THUDM/LongBench"):
        LONGBENCH.specs("qasper", source=str(tmp_path))


def test_unknown_task_lists_the_tasks():
    with pytest.raises(ValueError, match="longbench has no task 'narrative_qa'; its tasks: narrativeqa, qasper"):
        LONGBENCH.specs("narrative_qa", source=str(FIXTURES / "longbench"))
    with pytest.raises(ValueError, match="scbench has no task 'kv'"):
        load_rows(SCBENCH, "kv", str(FIXTURES / "scbench"))


def test_missing_datasets_package_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` then raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'snapkv_lab\[eval\]'"):
        SCBENCH.specs("scbench_kv")


def test_offline_hub_says_it_needs_the_hub_or_a_source(monkeypatch):
    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'microsoft/SCBench' on the Hub (LocalEntryNotFoundError)")
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=offline))
    with pytest.raises(RuntimeError,
                       match=r"microsoft/SCBench \(scbench_kv.*Couldn't reach.*needs the Hub.*--source DIR"):
        SCBENCH.specs("scbench_kv")


def test_rows_are_read_once_per_task_and_source(monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "datasets", fake_datasets([{"id": 0, "context": "c", "multi_turns": [
        {"input": "q", "answer": "a"}]}] * 3, calls))
    specs = SCBENCH.specs("scbench_vt")
    assert [SCBENCH.example(spec, None).questions[0].text for spec in specs] == ["q", "q", "q"]
    assert len(calls) == 1
    assert hub.load_rows(SCBENCH, "scbench_vt") is hub.load_rows(SCBENCH, "scbench_vt")
