"""Prompt sets from real offline text: sizes, exact spans, splits kept apart."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from snapkv_lab.core.models import bundled_checkpoint
from snapkv_lab.tasks.prompts import (
    PACKAGED_RECIPES,
    chat_prompts,
    folder_recipes,
    load_recipes,
    make_recipes,
    qa_prompts,
    save_recipes,
)

COMMITTED = Path(__file__).resolve().parents[1] / "data" / "prompt_recipes.json"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(bundled_checkpoint())


def test_committed_recipes_are_reproducible_and_hold_no_text():
    committed = load_recipes()
    assert committed == make_recipes(committed["seed"])  # same names from the same seed (and pydoc checksum)
    for kind in ("chat", "qa"):
        assert not set(committed[kind]["dev"]) & set(committed[kind]["heldout"])
    assert max(len(name) for kind in ("chat", "qa") for name in committed[kind]["dev"]) < 40


def test_the_packaged_recipes_are_the_committed_ones_byte_for_byte(tmp_path):
    """The package's copy is data/prompt_recipes.json, and make_recipes (save_recipes) writes that same file again."""
    committed = COMMITTED.read_bytes()
    assert PACKAGED_RECIPES.read_bytes() == committed
    assert save_recipes(tmp_path / "made.json", seed=json.loads(committed)["seed"]).read_bytes() == committed


def test_a_new_data_folder_starts_from_the_packaged_recipes_and_keeps_its_own(tmp_path):
    path = tmp_path / "new" / "prompt_recipes.json"
    assert folder_recipes(path) == load_recipes(COMMITTED)
    assert path.read_bytes() == PACKAGED_RECIPES.read_bytes()  # written: the folder says what its tables came from
    edited = dict(load_recipes(COMMITTED), seed=7)
    path.write_text(json.dumps(edited))
    assert folder_recipes(path) == edited  # a folder's own recipes are never replaced


def test_chat_prompts_are_long_chats_ending_in_a_request(tokenizer):
    recipes = load_recipes()
    prompts = chat_prompts(tokenizer, recipes, samples=2)
    assert all(p.n_tokens > 3000 for p in prompts) and prompts[0].continuation
    start, end = prompts[0].spans["request"]
    assert "tutorial" in tokenizer.decode(prompts[0].ids[0, start:end])
    assert tokenizer.decode(prompts[0].ids[0, -3:]).strip().endswith("assistant")
    heldout = chat_prompts(tokenizer, recipes, split="heldout", samples=1)[0]
    assert heldout.ids.shape != prompts[0].ids.shape or not (heldout.ids == prompts[0].ids).all()


def test_qa_spans_are_exact_and_document_positions_align(tokenizer):
    recipes = load_recipes()
    back = qa_prompts(tokenizer, recipes, questions=3)
    front = qa_prompts(tokenizer, recipes, questions=1, placement="front")[0]
    assert len({p.spans["document"] for p in back}) == 1  # same document positions for every question
    s, e = back[1].spans["question"]
    assert tokenizer.decode(back[1].ids[0, s:e]).strip() == recipes["qa"]["questions"][1]
    assert front.spans["question"][1] == front.spans["document"][0]
    d0, d1 = back[0].spans["document"]
    f0, f1 = front.spans["document"]
    assert (back[0].ids[0, d0:d1] == front.ids[0, f0:f1]).all() and d1 - d0 == recipes["qa"]["doc_tokens"]
    with pytest.raises(ValueError, match="placement"):
        qa_prompts(tokenizer, recipes, placement="middle")
