"""A generated multi-turn suite in SCBench's schema, on the lab's own offline texts: several needles in one haystack,
asked one per turn.

    rows = turn_needle_rows(16, words=1500, needles=3, seed=0)   # [{id, context, multi_turns: [{input, answer}]}]

Each row is a `microsoft/SCBench` row of scbench_qa_eng (fields id, context, multi_turns), so the SCBench loader reads
it from a folder (`--source`) and scores it with SCBench's metric for that task (an upper-cased reference found in
the upper-cased answer). The haystack is `words` words of running text from corpus.SOURCES (Paul Graham's essays by
default: read at run time, never committed, which is why the suite is written to a folder, not shipped); the needles
are RULER's sentence (" One of the special magic numbers for {key} is: {value}. ") with adjective-noun keys and
7-digit values, one per depth band (needle i of k in the band [i/k, (i+1)/k) of the text, at a sentence end).

The order the turns ask for them (`order`):
- "balanced" (the default): a Latin square over each k consecutive rows, so that in every k rows each band is asked at
  each turn once; its direction alternates between blocks of k rows (for k = 3 every 6 rows hold all 6 orders), so
  that which band follows which is balanced too. A turn's score then averages over depths, where a seeded order let
  depth and turn go together (docs/multi-turn.md: the full cache finds the first band's needle 2 times in 16);
- "shuffled": a seeded permutation per row (the suite's only order until 2026-11-29, which the committed SmolLM2 run
  used).
Either way a row's haystack, needles and places are the same. Seeded: the same arguments give the same rows.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from .corpus import SOURCES
from .haystacks import word_key
from .ruler_needles import NEEDLE, QUESTION

_PIECE = re.compile(r"\S+\s*")


def _haystack(rng: random.Random, source: str, words: int) -> list[str]:
    """`words` whitespace-ended words of the source's documents joined, from a seeded sentence start."""
    pieces = _PIECE.findall("\n\n".join(SOURCES[source]().values()))
    if len(pieces) < 2 * words:
        raise ValueError(f"{source} holds {len(pieces)} words: too few for haystacks of {words}")
    start = rng.randrange(len(pieces) - words)
    while start < len(pieces) - words and not pieces[start - 1].rstrip().endswith("."):
        start += 1
    return pieces[start:start + words]


ORDERS = ("balanced", "shuffled")


def balanced_order(index: int, needles: int) -> list[int]:
    """The bands row `index` asks, turn by turn: row j of each block of `needles` rows starts at band j and steps by
    +1 (even blocks) or -1 (odd blocks), modulo `needles`."""
    start, step = index % needles, 1 if (index // needles) % 2 == 0 else -1
    return [(start + step * turn) % needles for turn in range(needles)]


def turn_needle_rows(n_rows: int, *, words: int = 1500, needles: int = 3, seed: int = 0,
                     source: str = "essays", order: str = "balanced") -> list[dict]:
    """n_rows SCBench rows (module doc), each `words` words of `source` with `needles` needles, one turn each, asked
    in `order` ("balanced" or "shuffled")."""
    if source not in SOURCES:
        raise ValueError(f"source must be one of {sorted(SOURCES)}, got {source!r}")
    if order not in ORDERS:
        raise ValueError(f"order must be one of {list(ORDERS)}, got {order!r}")
    if n_rows < 1 or needles < 1 or words < 10 * needles:
        raise ValueError(f"need n_rows >= 1, needles >= 1 and words >= 10 per needle; got {n_rows}, {needles}, {words}")
    rows = []
    for index in range(n_rows):
        rng = random.Random(f"turn-needles-{source}-{words}-{needles}-{seed}-{index}")
        pieces = _haystack(rng, source, words)
        keys, values = [], []
        while len(keys) < needles:  # distinct keys and values: no needle answers another's question
            key, value = word_key(rng), str(rng.randint(1_000_000, 9_999_999))
            if key not in keys and value not in values:
                keys.append(key)
                values.append(value)
        # one needle per depth band, after the last sentence end at or before a seeded point of the band
        cuts = []
        for band in range(needles):
            at = int(len(pieces) * (band + rng.random()) / needles)
            while at > 0 and not pieces[at - 1].rstrip().endswith("."):
                at -= 1
            cuts.append(max(at, cuts[-1] if cuts else 0))
        text = pieces[:]
        for band in reversed(range(needles)):  # from the end, so earlier cuts keep their places
            text.insert(cuts[band], NEEDLE.format(kind="number", key=keys[band], value=values[band]).strip() + " ")
        if order == "balanced":
            asked = balanced_order(index, needles)
        else:  # the row's last draw, so the haystack, needles and places above are the same under both orders
            asked = list(range(needles))
            rng.shuffle(asked)
        rows.append(dict(id=index, context="".join(text).strip(), multi_turns=[
            dict(input=QUESTION.format(kind="number", key=keys[i]), answer=values[i]) for i in asked]))
    return rows


def write_suite(folder, rows: list[dict]) -> Path:
    """`rows` (turn_needle_rows') as a SCBench --source folder: <folder>/scbench_qa_eng.jsonl, one JSON row a line.
    Returns the file."""
    folder = Path(folder).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "scbench_qa_eng.jsonl"
    with path.open("w", encoding="utf-8") as out:
        out.writelines(json.dumps(row) + "\n" for row in rows)
    return path
