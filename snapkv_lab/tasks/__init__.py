"""The tasks: real offline text, and the prompts built from it, by recipe (names, sizes, seeds), never stored.

    corpus.py         Paul Graham's essays (read at run time, never committed), pydoc topics, stdlib code
    prompts.py        the findings' prompt sets: multi-turn chats and essay QA, from data/prompt_recipes.json
    haystacks.py      haystacks of any length from the corpus, and the needle sentences hidden in them
    needles.py        needle-in-a-haystack and LongEval-Lines contexts with their questions and token spans; grading
    ruler_needles.py  RULER-style needle variants: multi-key, multi-value, multi-query; number, word, uuid values
"""
