"""RULER (Hsieh et al. 2024, arXiv 2404.06654, github.com/NVIDIA/RULER), generated offline with the model's tokenizer.

    from snapkv_lab.evaluation.ruler import RULER
    spec = RULER.specs("niah_multikey_2", limit=2, lengths=(4096, 16384))[0]
    example = RULER.example(spec, tokenizer)   # an evaluation.examples.Example

The 13 official tasks (scripts/config_tasks.sh), by their official names, all run by default: niah_single_1..3,
niah_multikey_1..3, niah_multivalue, niah_multiquery, vt, cwe, fwe (generated here offline: SYNTHETIC_TASKS) and qa_1
(SQuAD 2.0's dev set), qa_2 (HotpotQA's distractor dev set), built as qa.py builds them from those sets read from the
Hugging Face Hub through evaluation.hub (QA_SOURCES; offline, `source=` a folder holding qa_1.jsonl and qa_2.jsonl in
the Hub sets' schemas). RULER's published averages are over the 13 (evaluation.summary shows the 11 synthetic ones'
beside them).

What follows RULER exactly (NVIDIA/RULER at c3f5e3b, July 2026; files and lines are cited where used):
- the prompt templates, answer prefixes and tokens_to_generate (scripts/data/synthetic/constants.py), the
  per-task settings (scripts/synthetic.yaml), the metrics (scripts/eval/synthetic/constants.py);
- how each generator builds its text: needle sentences, haystacks ("noise": one repeated sentence; "essay": Paul
  Graham's essays joined and cut into sentences, needles put between sentences at RULER's 40 depths; "needle":
  other key/value needle sentences), keys and values (wonderwords adjective-noun pairs, 7-digit numbers, uuid4s),
  the singular template of one-needle tasks, variable-tracking chains with their in-context example, common
  words with their few-shot example (in a turn of its own: cwe_shots="turn"), coded words drawn by a zeta law, and
  qa's documents (the question's own, its article's other paragraphs, others at random, "Document i:" each);
- the sizing (sizing="official", the default): RULER sizes the haystack once per task and length, by a binary search
  over probes with draws of their own (niah.py lines 224-257; fwe: its own step search), then cuts an example that
  overflows by whole steps of `incremental` (500 essay words, 25 lines, 10 words or documents: lines 263-273), so
  that many examples end several percent (a step) short of the length; the lab's earlier sizing, every example
  filled to the largest haystack that fits, is sizing="fill".

The length convention (RULER's `max_seq_length`): RULER counts the tokens of the whole input text, the template
and the answer prefix included, and keeps `tokens + tokens_to_generate <= max_seq_length` (niah.py line 245,
variable_tracking.py line 241, common_words_extraction.py line 157, freq_words_extraction.py line 113), growing the
haystack as far as that allows. Here the prompt is `context + question.text + answer_prefix`, counted with
`tokenizer(text, add_special_tokens=False)` (RULER's HF tokenizer counts `tokenizer.tokenize(text)`, no special
tokens), and `prompt tokens + max_new_tokens <= length`. RULER also counts its model template (`[INST] ... [/INST]`,
Llama 3's header tokens: scripts/data/template.py) when one is configured; here the chat frame is added later by
`evaluate`, so it is not counted: a framed prompt is longer than `length - max_new_tokens` by the frame's few tokens.

Where this differs from RULER, and why:
- Random draws within a sizing: RULER's probes and its examples draw from one global stream, so its probes' needles
  are other draws than its examples'; here each probe and each example draws from its own seeded stream (below),
  and an example cut by a step keeps its needles (RULER draws new ones at every try). sizing="fill" finds each
  example's largest haystack by interpolation search (`largest_fitting`: 4 to 10 tokenizations per example).
- Sentences: RULER cuts essays with nltk's punkt; nltk is not a dependency, so `split_sentences` cuts after
  '.', '?' or '!' (and closing quotes or brackets) followed by a space, except after a few abbreviations and
  initials. Needles land between sentences as in RULER; the boundaries can differ from punkt's at rare places.
- Essays: RULER's PaulGrahamEssays.json holds the 49 essays of gkamradt's repository (the ones
  snapkv_lab.tasks.corpus.paul_graham_essays() reads, in the same file order) followed by 169 essays downloaded from
  paulgraham.com; only the 49 are available offline, so the haystack repeats them (about 150k tokens) where RULER
  would go on with the others. Up to that length the essay haystack is RULER's own.
- Random draws: RULER seeds global `random`/`numpy` once per task file (seed 42) and re-shuffles some lists with a
  fixed seed; here every example draws from its own `random.Random(f"ruler-{seed}-{task}-{length}-{index}")`, so
  one spec gives the same example on every call and machine, whatever else ran before. Keys of one example are
  distinct, and the "needle" haystack's distractor keys never equal an inserted key (RULER leaves both to chance).
- cwe at lengths past what wonderwords' 8166 words can fill (about 190k tokens with SmolLM2's tokenizer; 128k
  takes 5.5k words): RULER then samples the randleword list json/english_words.json, a git-lfs file of its
  repository; it is not available offline, so such an example raises ValueError.
- vt's in-context example: RULER sizes it to at most 500 tokens and hangs where even its smallest form (5 noise
  lines) is longer (a byte-level tokenizer); here that smallest form is used. RULER draws it once per task and
  renames its variables per example; here each example (and each sizing probe) draws its own.
- qa: the Hub's rows of SQuAD 2.0's dev set are its questions flattened, so an article's paragraphs are its title's
  rows' (SQuAD's dev titles are distinct); a paragraph without a question, which the dev file does not have, could
  not be seen. RULER shuffles every example's documents with random.Random(42) (its seed), here 42 + the lab's seed
  (seed 0: RULER's order). Where even `step` documents overflow, RULER retries forever; here it raises.
"""

from __future__ import annotations

import math
import random
import re
import string
import uuid
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Callable, ClassVar

from ..core.tokens import encode
from ..tasks.corpus import paul_graham_essays
from .examples import Example, Question
from .hub import HubSource, load_rows

DATASET = "ruler"
DEFAULT_LIMIT = 10  # examples per length when `limit` is None (RULER's own NUM_SAMPLES is 500: scripts/config_tasks.sh)
DEFAULT_LENGTHS = (4096,)  # RULER's SEQ_LENGTHS run from 4096 to 131072 (scripts/config_models.sh)


# --- The official strings ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TaskTemplate:
    """One entry of TASKS in scripts/data/synthetic/constants.py: the prompt, with {context} and {query} (and the
    task's own fields) to fill, the answer prefix RULER appends to it, and the tokens it lets the model generate."""

    template: str
    answer_prefix: str
    tokens_to_generate: int


# scripts/data/synthetic/constants.py, lines 24-54, verbatim.
TEMPLATES = {
    "niah": TaskTemplate(  # lines 25-29
        template="Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
                 "I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic "
                 "{type_needle_v} for {query} mentioned in the provided text?",
        answer_prefix=" The special magic {type_needle_v} for {query} mentioned in the provided text are",
        tokens_to_generate=128,
    ),
    "variable_tracking": TaskTemplate(  # lines 31-35
        template="Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
                 "Question: Find all variables that are assigned the value {query} in the text above.",
        answer_prefix=" Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables "
                      "are assigned the value {query}, they are: ",
        tokens_to_generate=30,
    ),
    "common_words_extraction": TaskTemplate(  # lines 37-41
        template="Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
                 "ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above "
                 "list?",
        answer_prefix=" Answer: The top 10 words that appear most often in the list are:",
        tokens_to_generate=120,
    ),
    "freq_words_extraction": TaskTemplate(  # lines 43-47
        template="Read the following coded text and track the frequency of each coded word. Find the three most "
                 "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore "
                 "the dots '....'. What are the three most frequently appeared words in the above coded text?",
        answer_prefix=" Answer: According to the coded text above, the three most frequently appeared words are:",
        tokens_to_generate=50,
    ),
    "qa": TaskTemplate(  # lines 49-53 (for the module that reads qa_1 and qa_2 from the Hub)
        template="Answer the question based on the given documents. Only give me the answer and do not output any "
                 "other words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the "
                 "given documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}",
        answer_prefix=" Answer:",
        tokens_to_generate=32,
    ),
}

# scripts/eval/synthetic/constants.py, lines 33-49: every synthetic family is scored with string_match_all (the share
# of the references found in the prediction), qa with string_match_part (any reference found).
METRICS = {"niah": "string_match_all", "variable_tracking": "string_match_all", "common_words_extraction":
           "string_match_all", "freq_words_extraction": "string_match_all", "qa": "string_match_part"}

# The haystacks: niah.py lines 83-93 (the needle sentence and the noise sentence), variable_tracking.py line 86.
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


def _depths() -> tuple[int, ...]:
    """niah.py line 105: np.round(np.linspace(0, 100, num=40, endpoint=True)).astype(int), the 40 depths (percent)."""
    import numpy as np

    return tuple(int(d) for d in np.round(np.linspace(0, 100, num=40, endpoint=True)).astype(int))


DEPTHS = _depths()


# --- The task settings: scripts/synthetic.yaml -----------------------------------------------------------------


@dataclass(frozen=True)
class NiahConfig:
    """niah.py's arguments (lines 66-71). type_haystack: noise, essay or needle; needle types: words, numbers, uuids."""

    family: ClassVar[str] = "niah"
    type_haystack: str
    type_needle_k: str
    type_needle_v: str
    num_needle_k: int = 1
    num_needle_v: int = 1
    num_needle_q: int = 1


@dataclass(frozen=True)
class VariableTrackingConfig:
    """variable_tracking.py's arguments (lines 67-70); add_fewshot is True as main() runs it (lines 303-314)."""

    family: ClassVar[str] = "variable_tracking"
    type_haystack: str = "noise"
    num_chains: int = 1
    num_hops: int = 4


@dataclass(frozen=True)
class CommonWordsConfig:
    """common_words_extraction.py's arguments (lines 61-64). Below 4096 tokens RULER uses 6 and 1 repeats instead
    of freq_cw and freq_ucw, and a smaller few-shot example (lines 102-111)."""

    family: ClassVar[str] = "common_words_extraction"
    freq_cw: int = 30
    freq_ucw: int = 3
    num_cw: int = 10
    num_fewshot: int = 1


@dataclass(frozen=True)
class FreqWordsConfig:
    """freq_words_extraction.py's arguments (lines 61-63); vocab_size -1 means
    (max_seq_length - tokens_to_generate) // 50 (line 114)."""

    family: ClassVar[str] = "freq_words_extraction"
    alpha: float = 2.0
    coded_wordlen: int = 6
    vocab_size: int = -1


@dataclass(frozen=True)
class QAConfig:
    """qa.py's dataset (squad or hotpotqa), read from the Hub (QA_SOURCES)."""

    family: ClassVar[str] = "qa"
    dataset: str


# scripts/synthetic.yaml, lines 15-122 (niah.py raises num_needle_k to num_needle_q, line 77: multiquery has 4 keys).
CONFIGS = {
    "niah_single_1": NiahConfig("noise", "words", "numbers"),
    "niah_single_2": NiahConfig("essay", "words", "numbers"),
    "niah_single_3": NiahConfig("essay", "words", "uuids"),
    "niah_multikey_1": NiahConfig("essay", "words", "numbers", num_needle_k=4),
    "niah_multikey_2": NiahConfig("needle", "words", "numbers"),
    "niah_multikey_3": NiahConfig("needle", "uuids", "uuids"),
    "niah_multivalue": NiahConfig("essay", "words", "numbers", num_needle_v=4),
    "niah_multiquery": NiahConfig("essay", "words", "numbers", num_needle_q=4),
    "vt": VariableTrackingConfig(type_haystack="noise", num_chains=1, num_hops=4),
    "cwe": CommonWordsConfig(freq_cw=30, freq_ucw=3, num_cw=10),
    "fwe": FreqWordsConfig(alpha=2.0),
    "qa_1": QAConfig("squad"),
    "qa_2": QAConfig("hotpotqa"),
}
TASKS = tuple(CONFIGS)
SYNTHETIC_TASKS = tuple(task for task, config in CONFIGS.items() if not isinstance(config, QAConfig))


# --- Shared pieces ---------------------------------------------------------------------------------------------


@dataclass
class _Prompt:
    """One rendered prompt: the solved examples (each its text and answer, followed by a newline), then context +
    question + answer_prefix, is RULER's input text without its model template."""

    context: str
    question: str
    answer_prefix: str
    answers: tuple[str, ...]
    meta: dict
    shots: tuple[tuple[str, str], ...] = ()

    @property
    def text(self) -> str:
        return "".join(shot + answer + "\n" for shot, answer in self.shots) + self.context + self.question + \
            self.answer_prefix


def _split_template(template: TaskTemplate, **fields) -> tuple[str, str, str]:
    """The template's text before {context}, after it, and the answer prefix, their fields filled."""
    head, tail = template.template.split("{context}")
    return head.format(**fields), tail.format(**fields), template.answer_prefix.format(**fields)


def _join(pieces: list[tuple[str, object]], sep: str, offset: int = 0) -> tuple[str, dict]:
    """Join pieces (text, tag) with sep; the [start, end) characters of each tagged piece, shifted by offset."""
    spans, position = {}, offset
    for i, (text, tag) in enumerate(pieces):
        position += len(sep) if i else 0
        if tag is not None:
            spans[tag] = [position, position + len(text)]
        position += len(text)
    return sep.join(text for text, _ in pieces), spans


@lru_cache(maxsize=1)
def _wonderwords() -> dict[str, tuple[str, ...]]:
    """wonderwords' noun, adjective and verb lists, each deduplicated and sorted. RULER reads the same files with
    wonderwords.random_word._get_words_from_text_file (niah.py lines 97-98, common_words_extraction.py lines 72-74);
    RandomWord().filter(include_categories=...) gives the same sets through the public API."""
    from wonderwords import RandomWord

    words = RandomWord()
    return {category: tuple(sorted(set(words.filter(include_categories=[category]))))
            for category in ("nouns", "adjectives", "verbs")}


def _random_needle(rng: random.Random, kind: str) -> str:
    """niah.py lines 108-128: a 7-digit number, an adjective-noun pair, or a uuid4.

    RULER picks uniformly from sorted(set(f"{adj}-{noun}")) (6.17 million strings); picking the adjective and the noun
    uniformly is the same draw without building that list."""
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "words":
        lists = _wonderwords()
        return f"{rng.choice(lists['adjectives'])}-{rng.choice(lists['nouns'])}"
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"needle type must be numbers, words or uuids, got {kind!r}")


def _distinct(draw: Callable[[], str], count: int, avoid=()) -> list[str]:
    drawn: list[str] = []
    while len(drawn) < count:
        item = draw()
        if item not in drawn and item not in avoid:
            drawn.append(item)
    return drawn


# --- Essays and their sentences ----------------------------------------------------------------------------------

# Abbreviations after which a period does not end a sentence (a few of punkt's English ones), lower case, no final dot.
ABBREVIATIONS = frozenset({"mr", "mrs", "ms", "dr", "prof", "st", "jr", "sr", "vs", "e.g", "i.e", "a.m", "p.m", "u.s",
                           "u.k", "inc", "corp", "ltd", "vol", "fig", "cf", "al", "approx", "jan", "feb", "mar", "apr",
                           "jun", "jul", "aug", "sep", "sept", "oct", "nov", "dec"})
_SENTENCE_END = re.compile(r"[.?!][\"')\]]* ")


def split_sentences(text: str) -> list[tuple[int, int]]:
    """[start, end) characters of each sentence of a text with single spaces (RULER uses nltk's sent_tokenize).

    A sentence ends after '.', '?' or '!' (and any closing quotes or brackets) followed by a space, unless the word
    ending with the period is an abbreviation (ABBREVIATIONS) or a single letter (an initial)."""
    spans, start = [], 0
    for match in _SENTENCE_END.finditer(text):
        if text[match.start()] == ".":
            word = text[text.rfind(" ", 0, match.start()) + 1:match.start()].lstrip("\"'([").lower()
            if word in ABBREVIATIONS or (len(word) == 1 and word.isalpha()):
                continue
        spans.append((start, match.end() - 1))
        start = match.end()
    if start < len(text):
        spans.append((start, len(text)))
    return spans


@lru_cache(maxsize=1)
def essay_words() -> tuple[str, ...]:
    """RULER's essay haystack as words: the essays joined as they are (download_paulgraham_essay.py's `text +=
    f.read()`), re.sub(r'\\s+', ' ', essay).split(' ') (niah.py line 87)."""
    return tuple(re.sub(r"\s+", " ", "".join(paul_graham_essays().values())).split(" "))


def _essay_text(n_words: int) -> str:
    """The first n_words of the essay haystack, repeated as needed (niah.py lines 148-155), stripped."""
    words = essay_words()
    repeats = -(-n_words // len(words))
    return " ".join((words * repeats)[:n_words]).strip()


def _insert_between_sentences(text: str, needles: list[str], depths: list[int]) -> tuple[str, list[list[int]]]:
    """niah.py lines 155-166: needle i after the sentence at
    int(sentences * depth / 100), the sorted depths taken in order; groups of sentences and needles joined by ' '.
    Returns the text and each needle's [start, end)."""
    sentences = split_sentences(text)
    cuts = [0] + sorted(int(len(sentences) * (depth / 100)) for depth in depths) + [len(sentences)]
    pieces: list[tuple[str, object]] = []
    for i in range(1, len(cuts)):
        group = sentences[cuts[i - 1]:cuts[i]]
        pieces.append((text[group[0][0]:group[-1][1]] if group else "", None))
        if i - 1 < len(needles):
            pieces.append((needles[i - 1], i - 1))
    joined, spans = _join(pieces, " ")
    return joined, [spans[i] for i in range(len(needles))]


def _insert_at_random_lines(lines: list[str], needles: list[str], rng: random.Random) -> tuple[list[str], list[int]]:
    """niah.py lines 179-181: needles inserted at sorted(random.sample(range(len(lines)), k), reverse=True).
    Returns the lines and each needle's line index."""
    tagged: list[tuple[str, object]] = [(line, None) for line in lines]
    indexes = sorted(rng.sample(range(len(lines)), len(needles)), reverse=True)
    for index, (i, needle) in zip(indexes, enumerate(needles)):
        tagged.insert(index, (needle, i))
    where = {tag: k for k, (_, tag) in enumerate(tagged) if tag is not None}
    return [text for text, _ in tagged], [where[i] for i in range(len(needles))]


def _line_spans(lines: list[str], which: list[int], offset: int) -> list[list[int]]:
    """[start, end) of lines[k] for k in which, in "\\n".join(lines) shifted by offset."""
    starts, position = [], offset
    for line in lines:
        starts.append(position)
        position += len(line) + 1
    return [[starts[k], starts[k] + len(lines[k])] for k in which]


# --- Sizing ------------------------------------------------------------------------------------------------------


def largest_fitting(count: Callable[[int], int], budget: int, lo: int, hi: int) -> int | None:
    """The largest n in [lo, hi] with count(n) <= budget (count non-decreasing in n), or None if count(lo) > budget.

    RULER binary-searches n (niah.py lines 233-255). A prompt's tokens grow almost linearly with its haystack, so
    each probe here goes where the line through the nearest known counts reaches the budget; when the upper end of
    the bracket has not moved for two probes, the next probe goes twice as far past the fitting end as predicted, to
    close the bracket from above. 4 to 10 tokenizations instead of RULER's 10 to 17. Only a count that fits is
    returned, so the result fits even where tokenization makes the count slightly non-monotone."""
    known: dict[int, int] = {}

    def at(n: int) -> int:
        if n not in known:
            known[n] = count(n)
        return known[n]

    if at(lo) > budget:
        return None
    good, bad, stale = lo, None, 0  # count(good) <= budget < count(bad); stale: probes since bad last moved
    while good < hi and (bad is None or bad - good > 1) and len(known) < 64:
        if bad is None:  # the slope through the last two fitting counts (through the first alone: all of it per unit)
            fits = sorted(n for n, c in known.items() if c <= budget)
            slope = (known[fits[-1]] - known[fits[-2]]) / (fits[-1] - fits[-2]) if len(fits) > 1 else known[good] / good
        else:
            slope = (known[bad] - known[good]) / (bad - good)
        step = max(1, math.floor((budget - known[good]) / max(slope, 1e-9)))
        guess = good + (2 * step + 1 if stale >= 2 else step)
        guess = min(guess, hi) if bad is None else min(guess, bad - 1)
        if at(guess) <= budget:
            good, stale = guess, stale + 1
        else:
            bad, stale = guess, 0
    return good


def _fit(render: Callable[[int], _Prompt], tokenizer, budget: int, lo: int, hi: int, what: str) -> _Prompt:
    """sizing="fill": the prompt of the largest haystack size n in [lo, hi] whose prompt has at most `budget` tokens."""
    prompts: dict[int, tuple[_Prompt, int]] = {}

    def count(n: int) -> int:
        prompt = render(n)
        prompts[n] = (prompt, _tokens(tokenizer, prompt))
        return prompts[n][1]

    n = largest_fitting(count, budget, lo, hi)
    if n is None:
        raise ValueError(f"{what}: the smallest prompt ({lo} haystack units) takes {prompts[lo][1]} tokens, over the "
                         f"{budget} that the length leaves (length - tokens_to_generate): ask for a longer length")
    prompt, tokens = prompts[n]
    prompt.meta.update(units=n, prompt_tokens=tokens)
    return prompt


def _tokens(tokenizer, prompt: _Prompt) -> int:
    return len(encode(tokenizer, prompt.text))


@dataclass(frozen=True)
class Haystack:
    """One example's prompt as a function of its haystack's size, and what each sizing needs.

    render(n): the prompt with n haystack units (essay words, noise or needle lines, cwe words, fwe words, qa
    documents). lo, hi: the sizes sizing="fill" searches between. step: RULER's `incremental`, by which an overflowing
    example is cut (sizing="official"). bare(n): the prompt RULER's size search counts where it is not render's
    (vt: the task's prompt without its solved example), and apart: text it counts apart, added (vt: the solved
    example, variable_tracking.py line 241). limit: the largest size that can be built offline (cwe: wonderwords'
    words), None where any can."""

    render: Callable[[int], _Prompt]
    lo: int
    hi: int
    step: int
    bare: Callable[[int], _Prompt] | None = None
    apart: str = ""
    limit: int | None = None


def bisect(count: Callable[[int], int], budget: int, lo: int, hi: int) -> int | None:
    """RULER's binary search (niah.py lines 242-255; the same loop in variable_tracking.py lines 238-251,
    common_words_extraction.py lines 154-167, qa.py lines 177-190): the last fitting mid of a bisection of [lo, hi],
    or None where no probe fitted."""
    found = None
    while lo <= hi:
        mid = (lo + hi) // 2
        if count(mid) <= budget:
            found, lo = mid, mid + 1
        else:
            hi = mid - 1
    return found


def searched_size(probe: Callable[[int], Haystack], tokenizer, budget: int, length: int, estimate_at: int | None = None,
                  twice: bool = False) -> int:
    """RULER's haystack size for a whole task (sizing="official"), found once before its examples are drawn:
    niah.py lines 224-257 (variable_tracking.py lines 221-253, qa.py lines 159-192 the same; common_words_extraction.py
    lines 137-169 with twice=True and estimate_at=4096).

    probe(k): a haystack with draws of its own (RULER draws new needles at every call); probe(0) gives the estimate:
    tokens per unit of a prompt of estimate_at units (default: step), from which the search's upper end is 3 x
    length / (tokens per unit) (twice: 2 x (length // tokens per unit)); the lower end is step. The bisection's
    probe at mid is probe(mid).render(mid). No fitting probe: step (RULER's `else incremental`)."""
    first = probe(0)
    at = estimate_at or first.step
    per_unit = _tokens(tokenizer, (first.bare or first.render)(at)) / at
    upper = int(length // per_unit) * 2 if twice else int((length / per_unit) * 3)

    def count(n: int) -> int:
        haystack = probe(n)
        if haystack.limit is not None and n > haystack.limit:
            return budget + 1  # RULER would go on with words no offline list has: not buildable, so not fitting
        apart = len(encode(tokenizer, haystack.apart)) if haystack.apart else 0
        return _tokens(tokenizer, (haystack.bare or haystack.render)(n)) + apart

    found = bisect(count, budget, first.step, max(upper, first.step * 2))
    return first.step if found is None else found


def stepped(haystack: Haystack, tokenizer, budget: int, start: int, what: str) -> _Prompt:
    """One example at RULER's task size `start`, cut by whole steps while it overflows (niah.py lines 263-273 and the
    same loop in every generator): the first of start, start - step, ... whose prompt fits. RULER retries forever
    where even `step` units overflow; this raises."""
    n = start
    while True:
        prompt = haystack.render(n)
        tokens = _tokens(tokenizer, prompt)
        if tokens <= budget:
            prompt.meta.update(units=n, prompt_tokens=tokens)
            return prompt
        if n <= haystack.step:
            raise ValueError(f"{what}: {n} haystack units take {tokens} tokens, over the {budget} that the length "
                             "leaves (length - tokens_to_generate): ask for a longer length")
        n -= haystack.step


def fwe_size(probe: Haystack, tokenizer, budget: int, coded_wordlen: int) -> int:
    """fwe's word count for a whole task (freq_words_extraction.py lines 99-106 as sys_kwext calls it, lines 116-122):
    from budget // coded_wordlen up by steps of budget // 32 until the prompt reaches the budget, then one step
    back. Its examples are then cut by the same step while they overflow (lines 93-98)."""
    n = budget // coded_wordlen
    while _tokens(tokenizer, probe.render(n)) < budget:
        n += probe.step
    return n - probe.step


# --- The task families -------------------------------------------------------------------------------------------


def _singular(text: str) -> str:
    """niah.py lines 193-197: one needle asked about (num_needle_q * num_needle_v == 1) makes the template singular."""
    return text.replace("Some", "A").replace("are all", "is").replace("are", "is").replace("answers", "answer")


def niah(config: NiahConfig, name: str, budget: int, length: int) -> Haystack:
    """Needle in a haystack, niah.py's generate_input_output (lines 130-206): num_needle_k keys with num_needle_v
    values each, one needle sentence per (key, value), shuffled and spread over the haystack; num_needle_q of the keys
    asked at once; the answers are their values. RULER's step (lines 214-222): 500 essay words, 25 lines of noise or
    needles, 5 lines below 4096 tokens."""
    rng = random.Random(name)
    num_k = max(config.num_needle_k, config.num_needle_q)  # niah.py line 77
    keys = _distinct(lambda: _random_needle(rng, config.type_needle_k), num_k)
    values = [[_random_needle(rng, config.type_needle_v) for _ in range(config.num_needle_v)] for _ in keys]
    needles = [(NEEDLE.format(type_needle_v=config.type_needle_v, key=key, value=value), k)
               for k, (key, vals) in enumerate(zip(keys, values)) for value in vals]
    rng.shuffle(needles)  # niah.py line 144
    asked = rng.sample(range(num_k), config.num_needle_q)  # lines 186-189
    answers = tuple(value for k in asked for value in values[k])
    queries = [keys[k] for k in asked]
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]

    template, type_needle_v = TEMPLATES["niah"], config.type_needle_v
    if config.num_needle_q * config.num_needle_v == 1:
        template = TaskTemplate(_singular(template.template), _singular(template.answer_prefix),
                                template.tokens_to_generate)
        type_needle_v = type_needle_v[:-1]
    head, question, answer_prefix = _split_template(template, type_needle_v=type_needle_v, query=query)
    texts = [text for text, _ in needles]
    depths = rng.sample(DEPTHS, len(needles))  # line 157
    distractors: list[str] = []  # the "needle" haystack's sentences, drawn once and in order (lines 171-176)
    haystack_rng = random.Random(f"{name}-haystack")

    def render(n: int) -> _Prompt:
        if config.type_haystack == "essay":
            body, spans = _insert_between_sentences(_essay_text(n), texts, depths)
            spans = [[start + len(head), end + len(head)] for start, end in spans]
        else:
            if config.type_haystack == "noise":
                lines = [NOISE] * n
            elif config.type_haystack == "needle":
                while len(distractors) < n:
                    key = _distinct(lambda: _random_needle(haystack_rng, config.type_needle_k), 1, avoid=keys)[0]
                    distractors.append(NEEDLE.format(type_needle_v=config.type_needle_v, key=key,
                                                     value=_random_needle(haystack_rng, config.type_needle_v)))
                lines = distractors[:n]
            else:
                raise ValueError(f"type_haystack must be noise, essay or needle, got {config.type_haystack!r}")
            lines, where = _insert_at_random_lines(lines, texts, random.Random(f"{name}-positions-{n}"))
            body = "\n".join(lines)  # line 182
            spans = _line_spans(lines, where, len(head))
        meta = dict(needle_spans=spans, asked_spans=[span for span, (_, k) in zip(spans, needles) if k in asked],
                    keys=queries)
        return _Prompt(head + body, question, answer_prefix, answers, meta)

    step = 500 if config.type_haystack == "essay" else 5 if length < 4096 else 25
    return Haystack(render, lo=len(needles), hi=max(budget, len(needles)), step=step)


def _chain(rng: random.Random, num_hops: int, letters: int, taken: set[str]) -> tuple[list[str], list[str]]:
    """variable_tracking.py lines 93-114: num_hops + 1 distinct variables of `letters` capitals, the first assigned a
    5-digit value (np.random.randint(10000, 99999)), each next one the previous one (with RULER's trailing space)."""
    names = _distinct(lambda: "".join(rng.choices(string.ascii_uppercase, k=letters)), num_hops + 1, avoid=taken)
    taken.update(names)
    lines = [f"VAR {names[0]} = {rng.randint(10000, 99998)}"]
    lines += [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(num_hops)]
    return names, lines


def _vt_prompt(chains: list[tuple[list[str], list[str]]], num_hops: int, n: int, rng: random.Random,
               prefix: str = "") -> _Prompt:
    """variable_tracking.py lines 130-177 with the noise haystack: each chain's lines inserted in order at sorted
    random lines of n noise sentences (lines 152-157), the value of the first chain asked."""
    value = chains[0][1][0].split("=")[-1].strip()
    head, question, answer_prefix = _split_template(TEMPLATES["variable_tracking"], query=value, num_v=num_hops + 1)
    tagged: list[tuple[str, object]] = [(NOISE, None)] * n
    for c, (_, lines) in enumerate(chains):
        positions = sorted(rng.sample(range(len(tagged)), len(lines)))
        for j, (position, line) in enumerate(zip(positions, lines)):
            tagged.insert(position + j, (line, (c, j)))
    # RULER then replaces ". \n" by ".\n" (line 159): a no-op here, as no line ends with ". ".
    body, spans = _join(tagged, "\n", offset=len(prefix) + len(head))
    chain_spans = [spans[(0, j)] for j in range(len(chains[0][1]))]
    meta = dict(needle_spans=chain_spans, asked_spans=chain_spans, prompt_start=len(prefix))
    return _Prompt(prefix + head + body, question, answer_prefix, tuple(chains[0][0]), meta)


def _vt_chains(config: VariableTrackingConfig, name: str) -> tuple[list, list]:
    """The chains of one vt example, drawn from random.Random(name): those of its solved example (3-letter
    variables, at most 10 hops), then its own (5-letter)."""
    if config.type_haystack != "noise":
        raise ValueError(f"only RULER's official noise haystack is generated for vt, got {config.type_haystack!r}")
    rng, taken = random.Random(name), set()
    icl_chains = [_chain(rng, min(10, config.num_hops), 3, taken) for _ in range(config.num_chains)]
    return icl_chains, [_chain(rng, config.num_hops, 5, taken) for _ in range(config.num_chains)]


def vt_icl(config: VariableTrackingConfig, name: str) -> Haystack:
    """vt's solved example as a haystack: its prompt is sized to at most 500 tokens with nothing to generate, by
    steps of 5 noise lines (variable_tracking.py lines 303-307 call lines 191-254 so)."""
    icl_chains, _ = _vt_chains(config, name)
    lines = (config.num_hops + 1) * config.num_chains
    return Haystack(lambda n: _vt_prompt(icl_chains, config.num_hops, n, random.Random(f"{name}-icl-{n}")),
                    lo=lines, hi=500, step=5)


def variable_tracking(config: VariableTrackingConfig, name: str, budget: int, length: int,
                      size_icl: Callable[[Haystack], _Prompt]) -> Haystack:
    """Variable tracking, variable_tracking.py: num_chains chains of num_hops assignments in noise; all the variables
    of the first chain are the answer. As RULER's main() runs it (lines 303-314), the prompt opens with one solved
    in-context example (`vt_icl`, sized by size_icl), followed by its answer (line 218) and a newline (line 265);
    RULER then renames its variables and value at random (randomize_icl, lines 179-189): here they are drawn at random
    to begin with. RULER's step: 10 noise lines, 5 below 4096 tokens (lines 201-208); its size search counts the
    task's prompt without the solved example, and the solved example's tokens apart (lines 219-241)."""
    _, chains = _vt_chains(config, name)
    lines = (config.num_hops + 1) * config.num_chains
    icl = size_icl(vt_icl(config, name))
    solved = icl.text + " " + " ".join(icl.answers) + "\n"  # line 218

    def render(n: int, prefix: str = solved + "\n") -> _Prompt:
        return _vt_prompt(chains, config.num_hops, n, random.Random(f"{name}-positions-{n}"), prefix)

    return Haystack(render, lo=lines, hi=max(budget, lines), step=5 if length < 4096 else 10,
                    bare=lambda n: render(n, ""), apart=solved)


def _numbered(words: list[str]) -> str:
    """common_words_extraction.py line 96: "1. word1 2. word2 3. word3 ..."."""
    return " ".join(f"{i + 1}. {word}" for i, word in enumerate(words))


def _word_list(common: list[str], uncommon: list[str], common_repeats: int, uncommon_repeats: int,
               rng: random.Random) -> str:
    """common_words_extraction.py lines 85-98: common words repeated common_repeats times, the others
    uncommon_repeats times, shuffled and numbered."""
    word_list = common * common_repeats + uncommon * uncommon_repeats
    rng.shuffle(word_list)
    return _numbered(word_list)


def common_words(config: CommonWordsConfig, name: str, length: int, shots: str = "turn") -> Haystack:
    """Common words extraction, common_words_extraction.py: n words of wonderwords' nouns, adjectives and verbs
    (lines 72-77), num_cw of them repeated freq_cw times and the rest freq_ucw times; the answer is the num_cw common
    ones. The prompt opens with num_fewshot solved examples of 40 words (10 and 3 repeats), or below 4096 tokens 20
    words (3 and 1) with 6 and 1 repeats in the question itself (lines 100-129). RULER's step: 10 words (line 131).

    shots: where the solved examples go. "turn" (RULER's): each is the whole template, model template included,
    followed by its answer (lines 115-120, the template being prepare.py line 101's model template + task template
    + answer prefix): with a chat template, a user turn and an assistant turn of its own before the task's; the
    Example holds them in `shots`, framed by evaluation.prompting. "inline" (the lab's before 2026-11-29): their text
    opens the context, inside the task's one user turn. Without a chat template both give the same text."""
    lists = _wonderwords()
    words = sorted(set(lists["nouns"] + lists["adjectives"] + lists["verbs"]))
    rng = random.Random(name)
    if length < 4096:
        shot_words, shot_repeats, repeats = 20, (3, 1), (6, 1)
    else:
        shot_words, shot_repeats, repeats = 40, (10, 3), (config.freq_cw, config.freq_ucw)
    template = TEMPLATES["common_words_extraction"]
    if shots not in CWE_SHOTS:
        raise ValueError(f"cwe_shots must be one of {CWE_SHOTS}, got {shots!r}")
    head, question, answer_prefix = _split_template(template)
    solved = []
    for _ in range(config.num_fewshot):
        sample = rng.sample(words, shot_words)
        common, uncommon = sample[:config.num_cw], sample[config.num_cw:]
        solved.append((head + _word_list(common, uncommon, *shot_repeats, rng) + question,
                       answer_prefix + " " + _numbered(common)))
    prefix = "" if shots == "turn" else "".join(shot + answer + "\n" for shot, answer in solved)
    order = rng.sample(words, len(words))  # the first n of a random order: a random sample of n words
    answers = tuple(order[:config.num_cw])

    def render(n: int) -> _Prompt:
        body = _word_list(list(answers), order[config.num_cw:n], *repeats, random.Random(f"{name}-order-{n}"))
        return _Prompt(prefix + head + body, question, answer_prefix, answers, dict(prompt_start=len(prefix)),
                       shots=tuple(solved) if shots == "turn" else ())

    return Haystack(render, lo=config.num_cw, hi=len(words), step=10, limit=len(words))


def _zeta(s: float) -> float:
    """Riemann's zeta for s > 1 (RULER uses scipy.special.zeta): pi^2 / 6 at 2, else Euler-Maclaurin at 1000 terms."""
    if s == 2.0:
        return math.pi ** 2 / 6
    n = 1000
    return (math.fsum(k ** -s for k in range(1, n)) + n ** (1 - s) / (s - 1) + n ** -s / 2 + s * n ** (-s - 1) / 12
            - s * (s + 1) * (s + 2) * n ** (-s - 3) / 720)


def freq_words(config: FreqWordsConfig, name: str, budget: int) -> Haystack:
    """Frequent words extraction, freq_words_extraction.py (lines 74-107): a vocabulary of random coded words of
    coded_wordlen letters, the first replaced by '...' (noise); the k-th word appears int(n * k^-alpha / zeta(alpha))
    times, shuffled; the answer is words 2 to 4, the three most frequent ones after the dots. RULER's step:
    budget // 32 words (line 121), and its own search of the task's size (`fwe_size`)."""
    rng = random.Random(name)
    vocab_size = budget // 50 if config.vocab_size == -1 else config.vocab_size  # line 114
    vocab = _distinct(lambda: "".join(rng.choices(string.ascii_lowercase, k=config.coded_wordlen)), vocab_size)
    vocab[0] = "..."  # line 81
    zeta = _zeta(config.alpha)
    head, question, answer_prefix = _split_template(TEMPLATES["freq_words_extraction"])

    def render(n: int) -> _Prompt:
        text = [word for k, word in enumerate(vocab, 1) for _ in range(int(n * (k ** -config.alpha) / zeta))]
        random.Random(f"{name}-order-{n}").shuffle(text)
        return _Prompt(head + " ".join(text), question, answer_prefix, tuple(vocab[1:4]), {})

    return Haystack(render, lo=1, hi=2 * budget + vocab_size, step=max(1, budget // 32))


# --- qa_1 and qa_2: SQuAD and HotpotQA from the Hub ---------------------------------------------------------------

DOCUMENT = "Document {i}:\n{document}"  # qa.py line 116
RULER_SEED = 42  # RULER's --random_seed default (prepare.py line 58): qa.py shuffles every example's documents with it

# The sets qa.py reads (json/download_qa_dataset.sh: SQuAD 2.0's dev-v2.0.json, HotpotQA's
# hotpot_dev_distractor_v1.json), as the Hub publishes them: one row per question, in the files' order.
QA_SOURCES = {"qa_1": HubSource("rajpurkar/squad_v2", config=None, split="validation"),
              "qa_2": HubSource("hotpotqa/hotpot_qa", config="distractor", split="validation")}


@dataclass(frozen=True, eq=False)
class _QASet:
    """Where one qa task's rows are read (hub.load_rows): the Hub, or `<source>/<task>.jsonl` in the same schema."""

    task: str

    @property
    def name(self) -> str:  # what the Hub's errors name
        return f"RULER's {self.task} ({QA_SOURCES[self.task].hub_id})"

    @property
    def tasks(self) -> tuple[str, ...]:
        return (self.task,)

    @property
    def hub(self) -> HubSource:
        return QA_SOURCES[self.task]


_QA_SETS = {task: _QASet(task) for task in QA_SOURCES}


@dataclass(frozen=True)
class QAData:
    """qa.py's QAS and DOCS: per question its query, outputs, context (its documents' indexes) and more_context (the
    other paragraphs of its SQuAD article); the documents, distinct and sorted."""

    questions: tuple[dict, ...]
    documents: tuple[str, ...]


def squad_data(rows) -> QAData:
    """qa.py read_squad (lines 73-94) from rajpurkar/squad_v2's validation rows (title, context, question,
    answers.text): every paragraph is a document; the answerable questions (is_impossible: no answer text), each with
    its paragraph and the other paragraphs of its article (the rows of its title, in order)."""
    documents = sorted({row["context"] for row in rows})
    index = {document: i for i, document in enumerate(documents)}
    articles: dict[str, list[int]] = {}
    for row in rows:
        paragraphs = articles.setdefault(row["title"], [])
        if index[row["context"]] not in paragraphs:
            paragraphs.append(index[row["context"]])
    questions = tuple(dict(query=row["question"], outputs=list(row["answers"]["text"]), context=[index[row["context"]]],
                           more_context=[i for i in articles[row["title"]] if i != index[row["context"]]])
                      for row in rows if row["answers"]["text"])
    return QAData(questions, tuple(documents))


def hotpotqa_data(rows) -> QAData:
    """qa.py read_hotpotqa (lines 97-113) from hotpotqa/hotpot_qa's distractor validation rows (question, answer,
    context.title, context.sentences): a document is a title, a newline and its sentences joined as they are; every
    question, with its ten paragraphs (gold and distractors) as its documents."""
    def paragraphs(row) -> list[str]:
        return [f"{title}\n{''.join(sentences)}"
                for title, sentences in zip(row["context"]["title"], row["context"]["sentences"], strict=True)]

    documents = sorted({document for row in rows for document in paragraphs(row)})
    index = {document: i for i, document in enumerate(documents)}
    questions = tuple(dict(query=row["question"], outputs=[row["answer"]],
                           context=[index[document] for document in paragraphs(row)]) for row in rows)
    return QAData(questions, tuple(documents))


@lru_cache(maxsize=4)
def qa_data(task: str, source: str | None = None) -> QAData:
    """The questions and documents of qa_1 (SQuAD) or qa_2 (HotpotQA): from the Hub, or from `<source>/<task>.jsonl`
    holding rows in the Hub set's schema."""
    rows = load_rows(_QA_SETS[task], task, source)
    return squad_data(rows) if task == "qa_1" else hotpotqa_data(rows)


def qa(data: QAData, index: int, name: str, budget: int, seed: int) -> Haystack:
    """qa.py's generate_input_output (lines 125-150) for question `index`: n documents, its own first, then (SQuAD)
    the other paragraphs of its article, then others drawn at random from the rest (or, where n leaves room for fewer
    than the article's, some of those drawn at random); n at or above the number of documents: all of them, repeated
    to n. Shuffled with random.Random(42 + seed) (RULER's seed: the same order for every example of a size), each as
    "Document i:\n<text>", joined by blank lines. RULER's step: 10 documents (line 153). Draws: random.Random(f"{name}-
    documents-{n}"), RULER's global random here."""
    item, documents = data.questions[index], data.documents
    gold, more = list(item["context"]), list(item.get("more_context", []))
    head, question, answer_prefix = _split_template(TEMPLATES["qa"], query=item["query"])

    def render(n: int) -> _Prompt:
        if n < len(documents):
            rng = random.Random(f"{name}-documents-{n}")
            if n - len(gold) > len(more):
                taken = set(gold + more)
                chosen = gold + more + rng.sample([i for i in range(len(documents)) if i not in taken],
                                                  max(0, n - len(gold) - len(more)))
            else:
                chosen = gold + rng.sample(more, n - len(gold))
            texts = [documents[i] for i in chosen]
        else:
            texts = (list(documents) * -(-n // len(documents)))[:n]
        random.Random(RULER_SEED + seed).shuffle(texts)
        context = "\n\n".join(DOCUMENT.format(i=i + 1, document=text) for i, text in enumerate(texts))
        return _Prompt(head + context, question, answer_prefix, tuple(item["outputs"]), {})

    return Haystack(render, lo=len(gold), hi=max(budget, len(gold)), step=10)


# --- The benchmark -----------------------------------------------------------------------------------------------


HAYSTACKS = {"common_words_extraction": "words", "freq_words_extraction": "coded words", "qa": "documents"}
SIZINGS = ("official", "fill")
CWE_SHOTS = ("turn", "inline")
# What a spec written before these options meant (the lab's generator before 2026-11-29): read so, an older table's
# examples are rebuilt as they were run.
LEGACY = {"sizing": "fill", "cwe_shots": "inline"}


def _haystack(task: str, name: str, length: int, seed: int, index: int, tokenizer, sizing: str, cwe_shots: str,
              source: str | None) -> Haystack:
    """The haystack of one example (or of one of RULER's sizing probes, named so)."""
    config = CONFIGS[task]
    budget = length - TEMPLATES[config.family].tokens_to_generate
    if isinstance(config, NiahConfig):
        return niah(config, name, budget, length)
    if isinstance(config, VariableTrackingConfig):
        return variable_tracking(config, name, budget, length,
                                 lambda icl: _sized_icl(icl, task, length, seed, tokenizer, sizing, name))
    if isinstance(config, CommonWordsConfig):
        return common_words(config, name, length, cwe_shots)
    if isinstance(config, FreqWordsConfig):
        return freq_words(config, name, budget)
    return qa(qa_data(task, source), index, name, budget, seed)


def _sized_icl(icl: Haystack, task: str, length: int, seed: int, tokenizer, sizing: str, name: str) -> _Prompt:
    """vt's solved example, sized to 500 tokens; where even its smallest form is longer (a byte-level tokenizer),
    that smallest form (RULER hangs there)."""
    what = f"{name} (in-context example)"
    try:
        if sizing == "fill":
            return _fit(icl.render, tokenizer, 500, icl.lo, icl.hi, what)
        return stepped(icl, tokenizer, 500, _icl_size(task, length, seed, tokenizer), what)
    except ValueError:
        return icl.render(icl.lo)


@lru_cache(maxsize=64)
def _icl_size(task: str, length: int, seed: int, tokenizer) -> int:
    """RULER's size of vt's solved example, found once per task (variable_tracking.py lines 303-307)."""
    return searched_size(lambda k: vt_icl(CONFIGS[task], f"ruler-{seed}-{task}-{length}-icl-probe-{k}"),
                         tokenizer, 500, 500)


@lru_cache(maxsize=64)
def task_size(task: str, length: int, seed: int, tokenizer, source: str | None = None) -> int:
    """sizing="official": RULER's haystack size for every example of a task at one length, found once from probes
    with draws of their own (qa: question 0's, as qa.py line 179 probes)."""
    config = CONFIGS[task]
    budget = length - TEMPLATES[config.family].tokens_to_generate

    def probe(k: int) -> Haystack:
        return _haystack(task, f"ruler-{seed}-{task}-{length}-probe-{k}", length, seed, 0, tokenizer, "official",
                         "turn", source)

    if isinstance(config, FreqWordsConfig):
        return fwe_size(probe(0), tokenizer, budget, config.coded_wordlen)
    if isinstance(config, CommonWordsConfig):
        return searched_size(probe, tokenizer, budget, length, estimate_at=4096, twice=True)
    return searched_size(probe, tokenizer, budget, length)


class RulerBenchmark:
    """RULER's 13 tasks: the 11 synthetic ones generated offline, qa_1 and qa_2 built from SQuAD and HotpotQA read
    from the Hub (or `source`, a folder holding qa_1.jsonl and qa_2.jsonl in the Hub sets' schemas).

    specs(task, limit=, lengths=, seed=, source=, sizing=, cwe_shots=): `limit` examples (None: DEFAULT_LIMIT; qa: at
    most its questions) per length in tokens (empty: DEFAULT_LENGTHS), each dict(dataset="ruler", task=..., length=...,
    seed=..., index=..., sizing=...), cwe's with cwe_shots, qa's with source.
    - sizing: "official" (RULER's: the haystack sized once per task and length, an example that overflows cut by whole
      steps: `task_size`, `stepped`) or "fill" (the lab's before 2026-11-29: every example filled to the largest
      haystack that fits, `largest_fitting`).
    - cwe_shots: "turn" (RULER's: the solved example in a turn of its own) or "inline" (see `common_words`).
    A spec records an option where its value is not the lab's former one (LEGACY): a spec without the key means that
    one, so the tables written before these options and the runs that ask for the former way share their specs (and
    resume each other's cells).
    example(spec, tokenizer): the Example, sized with the tokenizer to prompt tokens + max_new_tokens <= length.

    An Example's id is f"{length}-{seed}-{index}"; its one Question holds RULER's query part (the template after
    {context}), outputs and answer prefix (leading space kept: RULER appends it to the input as is, call_api.py
    line 305). Its meta: length, seed, index, sizing, haystack ("noise", "essay", "needle", "words", "coded words",
    "documents"), config (the task's synthetic.yaml settings), units (the haystack size: essay words, noise or needle
    lines, cwe words, fwe's word count, qa documents), prompt_tokens (the solved examples + context + question + answer
    prefix, unframed); niah and vt: needle_spans and
    asked_spans, [start, end) characters in the context of every needle sentence and of the asked ones (vt: the
    asked chain's assignments, all asked), and niah's keys (the asked keys); vt and cwe: prompt_start, where the
    task's own prompt begins after its solved example.
    """

    name = DATASET
    tasks = TASKS
    default_tasks = TASKS
    options = {"sizing": SIZINGS, "cwe_shots": CWE_SHOTS}  # the official value first

    def specs(self, task: str, *, limit: int | None = None, lengths: tuple[int, ...] = (), seed: int = 0,
              source: str | None = None, sizing: str = "official", cwe_shots: str = "turn") -> list[dict]:
        _check_task(task)
        _check_option("sizing", sizing, SIZINGS)
        _check_option("cwe_shots", cwe_shots, CWE_SHOTS)
        limit = DEFAULT_LIMIT if limit is None else limit
        lengths = tuple(lengths) or DEFAULT_LENGTHS
        if limit < 0 or any(int(length) != length or length <= 0 for length in lengths):
            raise ValueError(f"limit must be >= 0 and lengths positive integers, got {limit!r} and {lengths!r}")
        options = {"sizing": sizing} | ({"cwe_shots": cwe_shots} if task == "cwe" else {})
        options = {name: value for name, value in options.items() if value != LEGACY[name]}
        if isinstance(CONFIGS[task], QAConfig):
            options, limit = options | {"source": source}, min(limit, len(qa_data(task, source).questions))
        return [dict(dataset=DATASET, task=task, length=int(length), seed=int(seed), index=index, **options)
                for length in lengths for index in range(limit)]

    def example(self, spec: dict, tokenizer) -> Example:
        task = spec["task"]
        _check_task(task)
        config = CONFIGS[task]
        sizing, cwe_shots = spec.get("sizing", LEGACY["sizing"]), spec.get("cwe_shots", LEGACY["cwe_shots"])
        _check_option("sizing", sizing, SIZINGS)
        length, seed, index = int(spec["length"]), int(spec["seed"]), int(spec["index"])
        template = TEMPLATES[config.family]
        budget = length - template.tokens_to_generate
        name = f"ruler-{seed}-{task}-{length}-{index}"
        source = spec.get("source")
        haystack = _haystack(task, name, length, seed, index, tokenizer, sizing, cwe_shots, source)
        if sizing == "fill":
            prompt = _fit(haystack.render, tokenizer, budget, haystack.lo, haystack.hi, name)
        else:
            prompt = stepped(haystack, tokenizer, budget, task_size(task, length, seed, tokenizer, source), name)
        if haystack.limit is not None and prompt.meta["units"] >= haystack.limit:
            raise ValueError(f"{name}: all {haystack.limit} of wonderwords' words fit in {length} tokens; RULER then "
                             "samples the randleword list json/english_words.json (common_words_extraction.py lines "
                             "81-89), a git-lfs file of its repository that is not available offline: use a shorter "
                             "length")
        meta = dict(length=length, seed=seed, index=index, sizing=sizing,
                    haystack=getattr(config, "type_haystack", HAYSTACKS.get(config.family)),
                    config=asdict(config), **prompt.meta)
        return Example(dataset=DATASET, task=task, id=f"{length}-{seed}-{index}", context=prompt.context,
                       questions=(Question(prompt.question, prompt.answers, prompt.answer_prefix),),
                       metric=METRICS[config.family], max_new_tokens=template.tokens_to_generate, meta=meta,
                       shots=prompt.shots)


def _check_option(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed} (the first is RULER's own), got {value!r}")


def _check_task(task: str) -> None:
    if task not in CONFIGS:
        raise ValueError(f"unknown RULER task {task!r}: one of {', '.join(TASKS)}")


RULER = RulerBenchmark()
