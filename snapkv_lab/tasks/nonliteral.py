"""Non-literal needles in the manner of NoLiMa (Modarressi et al. 2025, arXiv 2502.05167), generated offline.

NoLiMa's one-hop needles tie a character to a fact that the question names only through a latent association: the
needle says "Actually, Yuki lives next to the Semper Opera House.", the question asks "Which character has been to
Dresden?". The question and the needle share no content word, so a reader that matches surface tokens finds
nothing to match. BANK is the lab's own small hand-made set of such pairs (not NoLiMa's needle set, which is read by
evaluation.nolima); each also has a literal question, the control: the same answer, asked with the needle's own
key words ("Which character lives next to the Semper Opera House?"), as NoLiMa's own "direct" needle set does
(needle_set_ONLYDirect.json, adobe-research/NoLiMa data/download_NoLiMa_data.sh).

    item = nonliteral_item(seed=0, index=3)      # a NonLiteralItem: needle, questions, answer (a name)
    before, after = place_needle(tokenizer, 3000, depth=0.4, sample=3)   # the haystack's text around the needle

The answer is the character's name; NAMES leaves out names the essays hold (Gary, Ingrid), so that a name read off
the haystack is never right by chance. Needles go after a sentence end of the lab's haystack texts
(tasks.haystacks: essays by default), at any depth and length in tokens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from .haystacks import boundary, haystack_tokens
from .needles import sentence_start


@dataclass(frozen=True)
class NonLiteralPair:
    """One entry of the bank: the needle ({name} to fill), the non-literal question, the literal control question,
    and the latent link a reader must know (for the docs: Semper Opera House -> Dresden)."""

    needle: str
    question: str
    literal_question: str
    link: str


# Each question shares no content word with its needle (tests/test_nonliteral.py checks it, with its own stop-words
# and stemmer); each literal question shares the needle's key words.
BANK = (
    NonLiteralPair("Actually, {name} lives next to the Semper Opera House.", "Which character has been to Dresden?",
                   "Which character lives next to the Semper Opera House?", "Semper Opera House -> Dresden"),
    NonLiteralPair("Actually, {name} has been a vegan for years.", "Which character cannot eat fish-based meals?",
                   "Which character has been a vegan for years?", "vegan -> no fish"),
    NonLiteralPair("{name} finally climbed the Eiffel Tower last spring.", "Which character has been to France?",
                   "Which character climbed the Eiffel Tower?", "Eiffel Tower -> France"),
    NonLiteralPair("Actually, {name} lives right beside the Kiasma museum.", "Which character has been to Helsinki?",
                   "Which character lives beside the Kiasma museum?", "Kiasma -> Helsinki"),
    NonLiteralPair("{name} once took a photo in front of the Colosseum.", "Which character has been to Italy?",
                   "Which character took a photo in front of the Colosseum?", "Colosseum -> Italy"),
    NonLiteralPair("At dawn, {name} walked up to the Parthenon.", "Which character has been to Greece?",
                   "Which character walked up to the Parthenon?", "Parthenon -> Greece"),
    NonLiteralPair("{name} spent a week hiking around Machu Picchu.", "Which character has been to Peru?",
                   "Which character spent a week hiking around Machu Picchu?", "Machu Picchu -> Peru"),
    NonLiteralPair("{name} plays the cello every evening.", "Which character is a musician?",
                   "Which character plays the cello?", "cello -> musician"),
    NonLiteralPair("{name} admired the Taj Mahal at sunrise.", "Which character has been to India?",
                   "Which character admired the Taj Mahal?", "Taj Mahal -> India"),
    NonLiteralPair("{name} mailed a postcard from the steps of the Sydney Opera House.",
                   "Which character has been to Australia?",
                   "Which character mailed a postcard from the Sydney Opera House?", "Sydney Opera House -> Australia"),
    NonLiteralPair("{name} is lactose intolerant.", "Which character should avoid dairy?",
                   "Which character is lactose intolerant?", "lactose intolerant -> no dairy"),
    NonLiteralPair("{name} had a picnic beside the Brandenburg Gate.", "Which character has been to Germany?",
                   "Which character had a picnic beside the Brandenburg Gate?", "Brandenburg Gate -> Germany"),
    NonLiteralPair("{name} rode a camel near the pyramids of Giza.", "Which character has been to Egypt?",
                   "Which character rode a camel near the pyramids of Giza?", "Giza -> Egypt"),
    NonLiteralPair("{name} learned to surf on Copacabana beach.", "Which character has been to Brazil?",
                   "Which character learned to surf on Copacabana beach?", "Copacabana -> Brazil"),
    NonLiteralPair("{name} crossed the Charles Bridge on foot.", "Which character has been to Prague?",
                   "Which character crossed the Charles Bridge?", "Charles Bridge -> Prague"),
    NonLiteralPair("{name} studied for a year at Kyoto University.", "Which character has been to Japan?",
                   "Which character studied at Kyoto University?", "Kyoto -> Japan"),
)

NAMES = ("Yuki", "Stuart", "Katie", "Veronica", "Megan", "Calvin", "Mandy", "Diana", "Caleb", "Nadia", "Tobias",
         "Rafael", "Leona", "Mateo", "Priya", "Oskar", "Elena", "Desmond")


@dataclass(frozen=True)
class NonLiteralItem:
    """One generated item: the needle sentence, its non-literal question, the literal control question, the answer
    (the character's name) and the bank entry it came from (`pair`, an index of BANK)."""

    needle: str
    question: str
    literal_question: str
    answer: str
    pair: int


def nonliteral_item(seed: int = 0, index: int = 0) -> NonLiteralItem:
    """Item `index` of a seeded stream: bank entries in turn from a seeded offset (n items cover the bank evenly),
    the name drawn from NAMES. The same (seed, index) gives the same item on every machine."""
    if index < 0:
        raise ValueError(f"index must be >= 0, got {index}")
    rng = random.Random(f"nolima-{seed}-{index}")
    pair = (index + random.Random(f"nolima-{seed}").randrange(len(BANK))) % len(BANK)
    entry, name = BANK[pair], rng.choice(NAMES)
    return NonLiteralItem(entry.needle.format(name=name), entry.question, entry.literal_question, name, pair)


def place_needle(tokenizer, n_tokens: int, depth: float, sample: int = 0, haystack: str = "essays") -> tuple[str, str]:
    """(before, after): the text of n_tokens haystack tokens (tasks.haystacks' kind, `sample` picking where it starts)
    cut at the sentence end (line end) at or before `depth` (0 = first sentence, 1 = after the last), so that a needle
    put between them is a sentence of its own."""
    if not 0 <= depth <= 1:
        raise ValueError(f"depth is a share of the haystack in [0, 1], got {depth}")
    if n_tokens < 1:
        raise ValueError(f"a haystack needs at least one token, got n_tokens={n_tokens}")
    hay = haystack_tokens(tokenizer, haystack, n_tokens, sample)
    at = sentence_start(tokenizer, hay, round(depth * len(hay)), boundary(haystack))
    return tokenizer.decode(hay[:at]), tokenizer.decode(hay[at:])
