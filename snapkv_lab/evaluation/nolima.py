"""NoLiMa (Modarressi et al. 2025, arXiv 2502.05167; adobe-research/NoLiMa at 7532e4e), and the lab's generated
non-literal needles beside their literal controls.

Tasks:
- "onehop", "twohop": NoLiMa's own needle set, by its question types, read in its schema (below) from the Hub
  (amodaresi/NoLiMa, as data/download_NoLiMa_data.sh fetches it) or, offline, from `source=DIR` laid out as that
  script lays it out: DIR/needlesets/needle_set.json and DIR/haystack/rand_shuffle/*.txt (the tests' fixture is one).
- "generated": the lab's non-literal needles (tasks.nonliteral), offline, seeded, at any length, on the lab's
  essays; "generated_literal": the same items (same haystack, needle, depth and answer) asked with the literal
  control question, so that one model and policy is read literal against non-literal, item by item.

The needle set's schema, as evaluation/run_tests.py reads it (lines 49-79): a JSON list of experiments, each with
"id" (its first four characters a number: the seed's offset), "system_prompt", "needle" (with "{CHAR}" for the
character and "{1}", "{2}", ... for a test's arguments), "questions" ({question type: text with the same
placeholders}), "tests" ({test id: {"input_args": [...], optional "gold_answers"}}), optional "character_set" (the
names {CHAR} is drawn from), "task_template" and "distractors". Each experiment x question type x test is one test;
run_tests.py runs every test on every haystack file (lines 81-113) at `document_depth_percent_intervals` depths
from 0 to 100 percent (async_evaluate.py line 185; 26 in every run_config), drawing the character per depth from
np.random seeded with 42 + the id's number + the haystack's place (run_tests.py lines 61 and 108; async_evaluate.py
lines 138 and 188-193). The gold answer is the drawn character where the needle has {CHAR}, else the test's
gold_answers (line 238). Placement is book_haystack.py's (lines 50-99): a window of `length` tokens of the book
(the model's tokenizer) around the first line end at or past `depth` of it, the needle put there on a line of its
own. The prompt is DEFAULT_TASK_TEMPLATE (run_tests.py line 19) unless the experiment has its own.

Metric: async_evaluate.py's _evaluate_response (lines 114-126), by the run configs' `metric` ("contains" in every
one: the gold answer as a case-sensitive substring of the response): nolima_contains here (nolima_em,
nolima_lastline_em and nolima_lastline_contains are its other three).

Where this differs from the official run, and why:
- The system prompt is not sent: the lab frames a prompt with the model's chat template (or plain text for a base
  model, evaluation.prompting) and has no system turn; SmolLM2's template puts in its own default system prompt.
- run_tests.py reproduces a quirk (line 72): a question's placeholders are replaced from the original question at
  each argument, so only the last argument present survives; needle_set.json's questions have one placeholder each.
- Haystack files are taken in name order (run_tests.py: os.listdir's order, which the OS decides).
- The generated tasks are the lab's: 16 new tokens stopped at a line end (an answer is a name; the official model
  configs let 192 tokens come), the lab's essays as haystack (NoLiMa's books are filtered of every word a question
  could match; the essays are not, but they hold none of the bank's names or places: tasks.nonliteral).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from ..core.tokens import encode
from ..tasks.nonliteral import nonliteral_item, place_needle
from .examples import Example, Question
from .hub import INSTALL_HINT, check_task, split_template

HUB_ID = "amodaresi/NoLiMa"
NEEDLE_SET = "needlesets/needle_set.json"
BOOKS = tuple(f"haystack/rand_shuffle/rand_book_{i}.txt" for i in range(1, 6))  # download_NoLiMa_data.sh
DEFAULT_TASK_TEMPLATE = (  # evaluation/run_tests.py line 19, verbatim
    "You will answer a question based on the following book snippet:\n\n{haystack}\n\nUse the information provided "
    "in the book snippet to answer the question. Your answer should be short and based on either explicitly stated "
    "facts or strong, logical inferences.\n\nQuestion: {question}\n\n Return only the final answer with no additional "
    "explanation or reasoning.")
DEPTHS = 26  # document_depth_percent_intervals of every run_config
BASE_SEED = 42  # run_tests.py --base_seed
MAX_TOKENS = 192  # model_configs/*.json "max_tokens"
OFFICIAL_TASKS = ("onehop", "twohop")
GENERATED_TASKS = ("generated", "generated_literal")
GENERATED_NEW_TOKENS = 16
DEFAULT_LIMIT = DEPTHS  # generated items per length when no limit is given: one per official depth


def depths(count: int = DEPTHS) -> np.ndarray:
    """async_evaluate.py line 185: np.linspace(min, max, intervals) percent, as shares of the haystack."""
    return np.linspace(0, 100, count) / 100


# --- NoLiMa's needle set -----------------------------------------------------------------------------------------


def needle_tests(needle_set: list[dict]) -> list[dict]:
    """run_tests.py lines 49-79: one test per experiment x question type x test id, each with question_type,
    test_name, needle, question, gold_answers ("" where the needle's character is the answer), character_set, seed,
    task_template."""
    tests = []
    for experiment in needle_set:
        for question_type, question in experiment["questions"].items():
            for test_id, test in experiment["tests"].items():
                needle, full_question = experiment["needle"], question
                for number, argument in enumerate(test["input_args"], 1):
                    placeholder = "{" + str(number) + "}"
                    if placeholder in question:
                        full_question = question.replace(placeholder, argument)  # line 72, as it is
                    needle = needle.replace(placeholder, argument)
                tests.append(dict(question_type=question_type,
                                  test_name=f"{experiment['id']}_{test_id}_{question_type}", needle=needle,
                                  question=full_question, gold_answers=test.get("gold_answers", ""),
                                  character_set=experiment.get("character_set", ""),
                                  seed=BASE_SEED + int(experiment["id"][:4]),
                                  task_template=experiment.get("task_template", DEFAULT_TASK_TEMPLATE)))
    return tests


def _read(source: str | None, name: str) -> Path:
    """A file of the set: DIR/name with source=DIR, else downloaded from the Hub (huggingface_hub's cache)."""
    if source is not None:
        path = Path(source, name)
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: --source for nolima is a folder laid out as NoLiMa's "
                                    f"data/download_NoLiMa_data.sh lays it out ({NEEDLE_SET}, {BOOKS[0]}, ...)")
        return path
    try:
        from huggingface_hub import hf_hub_download
    except ImportError as error:
        raise ImportError(f"nolima's needle set is read from the Hugging Face Hub, which needs huggingface_hub: "
                          f"{INSTALL_HINT} (or give --source DIR)") from error
    try:
        return Path(hf_hub_download(HUB_ID, name, repo_type="dataset"))
    except Exception as error:  # offline, gated, moved: all say so
        raise RuntimeError(f"could not read {name} of {HUB_ID} from the Hugging Face Hub: {error}. nolima's "
                           f"onehop and twohop need the Hub (network access) or a local copy: --source DIR with "
                           f"{NEEDLE_SET} and {', '.join(BOOKS)}; the generated tasks need neither") from error


@lru_cache(maxsize=2)
def load_tests(source: str | None) -> tuple[dict, ...]:
    return tuple(needle_tests(json.loads(_read(source, NEEDLE_SET).read_text(encoding="utf-8"))))


@lru_cache(maxsize=2)
def _books(source: str | None) -> tuple[Path, ...]:
    """The haystack files in name order: every *.txt of DIR/haystack/rand_shuffle, or the Hub's five books."""
    if source is None:
        return tuple(_read(None, name) for name in BOOKS)
    books = tuple(sorted(Path(source, "haystack", "rand_shuffle").glob("*.txt")))
    if not books:
        raise FileNotFoundError(f"no haystack in {Path(source, 'haystack', 'rand_shuffle')}: nolima's books are "
                                f"*.txt files there ({', '.join(BOOKS)} on the Hub)")
    return books


@lru_cache(maxsize=8)
def _book_ids(tokenizer, path: Path) -> tuple[tuple[int, ...], np.ndarray]:
    """book_haystack.py lines 50-57: the book's tokens and the line-end positions (tokens holding a newline, 0
    first)."""
    ids = tuple(encode(tokenizer, path.read_text(encoding="utf-8")))
    ends = [0] + [i for i, token in enumerate(ids) if "\n" in tokenizer.decode([token])]
    return ids, np.array(ends)


def book_placement(tokenizer, path: Path, needle: str, length: int, depth: float) -> str:
    """book_haystack.py lines 58-94 (static_depth -1, shift 0): the text of `length` tokens of the book, the needle put
    on a line of its own after the first line end at or past `depth` of them."""
    ids, ends = _book_ids(tokenizer, path)
    delta = ends / (length + 1) - depth
    delta[delta < 0] = np.inf
    at = int(ends[np.argmin(delta)])
    start = at - int(np.round(length * depth))
    end = start + length
    if start < 0 or end > len(ids):  # the official asserts (lines 86-87)
        raise ValueError(f"{path.name} ({len(ids)} tokens) is too short for a {length}-token window at depth {depth}")
    before = tokenizer.decode(list(ids[start:at + 1]))
    before = before[:max(before.rfind("\n"), 0)]
    return before + " " + needle + "\n" + tokenizer.decode(list(ids[at + 1:end]))


def _characters(seed: int, count: int, character_set) -> list[str]:
    """async_evaluate.py lines 138 and 188-191: np.random seeded once per test and haystack, one draw per depth."""
    np.random.seed(seed)
    return [str(np.random.choice(character_set)) for _ in range(count)]


# --- The benchmark -----------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class NoLiMaBenchmark:
    name: str = "nolima"
    tasks: tuple[str, ...] = OFFICIAL_TASKS + GENERATED_TASKS
    default_tasks: tuple[str, ...] = GENERATED_TASKS  # the ones that run offline
    lengths: tuple[int, ...] = (4096,)

    def specs(self, task: str, *, limit: int | None = None, lengths: tuple[int, ...] = (), seed: int = 0,
              source: str | None = None) -> list[dict]:
        """Generated tasks: `limit` items (26 by default) per length, from `seed`. NoLiMa's: every test x haystack x
        depth of the task's question type, in run_tests.py's order (haystack, test, depth), the first `limit`."""
        check_task(self, task)
        lengths = lengths or self.lengths
        if task in GENERATED_TASKS:
            count = DEFAULT_LIMIT if limit is None else limit
            return [dict(dataset=self.name, task=task, length=length, seed=seed, index=i)
                    for length in lengths for i in range(count)]
        tests = [i for i, test in enumerate(load_tests(source)) if test["question_type"] == task]
        grid = [(length, book, test, depth) for length in lengths for book in range(len(_books(source)))
                for test in tests for depth in range(DEPTHS)]
        return [dict(dataset=self.name, task=task, source=source, length=length, book=book, test=test, depth=depth)
                for length, book, test, depth in grid[:limit]]

    def example(self, spec: dict, tokenizer) -> Example:
        if spec["task"] in GENERATED_TASKS:
            return generated_example(tokenizer, spec)
        test = load_tests(spec.get("source"))[spec["test"]]
        book = _books(spec.get("source"))[spec["book"]]
        depth = depths()[spec["depth"]]
        needle, answers = test["needle"], test["gold_answers"]
        question = test["question"]
        if "{CHAR}" in needle:
            if not isinstance(test["character_set"], list):
                raise ValueError(f"{test['test_name']}: its needle has {{CHAR}} but the experiment no character_set")
            character = _characters(test["seed"] + spec["book"], DEPTHS, test["character_set"])[spec["depth"]]
            needle, question, answers = needle.replace("{CHAR}", character), question.replace("{CHAR}", character), \
                [character]
        answers = [answers] if isinstance(answers, str) else answers
        if not answers or answers == [""]:
            raise ValueError(f"{test['test_name']}: no gold answer (neither {{CHAR}} in the needle nor gold_answers)")
        haystack = book_placement(tokenizer, book, needle, spec["length"], depth)
        context, rest = split_template(test["task_template"], dict(haystack=haystack, question=question), "haystack")
        return Example(dataset=self.name, task=spec["task"], id=f"{spec['length']}-{spec['book']}-{spec['test']}-"
                       f"{spec['depth']}", context=context, questions=(Question(rest, tuple(answers)),),
                       metric="nolima_contains", max_new_tokens=MAX_TOKENS,
                       meta=dict(length=spec["length"], depth=float(depth), test=test["test_name"]))


def generated_example(tokenizer, spec: dict) -> Example:
    """The lab's item (seed, index) in NoLiMa's template, at most `length` tokens in all with the answer's tokens
    (RULER's convention: prompt + new tokens <= length, unframed), the needle at NoLiMa's depth index % 26. The
    literal task asks the control question of the same item, on the same haystack."""
    length, index = spec["length"], spec["index"]
    item = nonliteral_item(spec["seed"], index)
    question = item.literal_question if spec["task"] == "generated_literal" else item.question
    depth = float(depths()[index % DEPTHS])

    def haystack(room: int) -> str:
        before, after = place_needle(tokenizer, room, depth, sample=index)
        return f"{before.rstrip()} {item.needle} {after.lstrip()}"

    # Both tasks size the haystack with the longer question, so the literal and non-literal contexts are one text.
    longest = max((item.question, item.literal_question), key=lambda q: len(encode(tokenizer, q)))
    frame = len(encode(tokenizer, DEFAULT_TASK_TEMPLATE.format(haystack=item.needle, question=longest)))
    room = length - GENERATED_NEW_TOKENS - frame
    if room < 1:
        raise ValueError(f"a nolima item of {length} tokens leaves no room for a haystack: the template, needle, "
                         f"question and {GENERATED_NEW_TOKENS} answer tokens take {length - room}")
    text = haystack(room)
    over = len(encode(tokenizer, DEFAULT_TASK_TEMPLATE.format(haystack=text, question=longest))) \
        + GENERATED_NEW_TOKENS - length
    if over > 0:  # the decoded haystack re-tokenised a few tokens longer: cut as many more
        text = haystack(room - over)
    context, rest = split_template(DEFAULT_TASK_TEMPLATE, dict(haystack=text, question=question), "haystack")
    return Example(dataset="nolima", task=spec["task"], id=f"{length}-{spec['seed']}-{index}", context=context,
                   questions=(Question(rest, (item.answer,)),), metric="nolima_contains",
                   max_new_tokens=GENERATED_NEW_TOKENS, stop=("\n",),
                   meta=dict(length=length, depth=depth, pair=item.pair))


NOLIMA = NoLiMaBenchmark()
