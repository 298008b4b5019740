"""Does a policy keep the facts at a small budget? Every needle the full cache finds, at 1024 of 4000 tokens,
on the dev needles (the needle grid's samples 0-2) and on held-out ones (`snapkv-lab needle --suites facts`).

The target of FactKV (policies/factkv.py): query-aware, every needle the full cache finds; query-agnostic, at
least 80% of them. The held-out needles (other haystack starts, keys and values) were never looked at while
the policy was designed: they say whether the design generalises or was fitted to the dev needles.
"""

from __future__ import annotations

import pandas as pd

from ..policies import FactKV, KVzip
from .intervals import wilson
from .runner import run_retrieval
from .tasks import needle_context

FACT_LENGTH, FACT_CAPACITY = 4000, 1024
FACT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
FACT_SAMPLES = {"dev": (0, 1, 2), "heldout": (3,)}
FACT_POLICIES = (FactKV(), KVzip())  # KVzip alone: what the fact-long pooling adds
TARGETS = {"query-aware": 1.0, "query-agnostic": 0.8}
NEW_TOKENS = 12  # a 7-digit value is 7 tokens


def fact_contexts(tokenizer, samples=FACT_SAMPLES) -> list:
    return [needle_context(tokenizer, FACT_LENGTH, depth, sample) for split in samples for sample in samples[split]
            for depth in FACT_DEPTHS]


def run_facts(model, tokenizer, samples=FACT_SAMPLES, policies=FACT_POLICIES, on_context=None) -> pd.DataFrame:
    """run_retrieval's table over the fact contexts at FACT_CAPACITY, with a `split` column (dev / heldout)."""
    split_of = {sample: split for split in samples for sample in samples[split]}

    def with_split(table):
        return table.assign(split=table["sample"].map(split_of))

    table = run_retrieval(model, tokenizer, fact_contexts(tokenizer, samples), policies=policies,
                          capacities=(FACT_CAPACITY,), max_new_tokens=NEW_TOKENS,
                          on_context=None if on_context is None else lambda rows: on_context(with_split(rows)))
    return with_split(table)


def facts_table(table: pd.DataFrame, grade: str = "correct") -> pd.DataFrame:
    """Per split, policy and mode: needles the full cache finds (`full_found`), how many of those the policy finds
    (`kept`), the share with its Wilson interval, the target and whether it is met."""
    keys = ["length", "depth", "sample"]
    full = table[table["mode"] == "full"].set_index(keys)[grade].astype(bool)
    rows = []
    for (split, policy, mode), part in table[table["mode"] != "full"].groupby(["split", "policy", "mode"], sort=False):
        found = part.set_index(keys)[grade].astype(bool)
        asked = full.reindex(found.index)
        kept = int((found & asked).sum())
        low, high = wilson(kept, int(asked.sum()))
        share = kept / asked.sum() if asked.sum() else float("nan")
        rows.append(dict(split=split, policy=policy, mode=mode, prompts=len(part), full_found=int(asked.sum()),
                         kept=kept, share=share, low=low, high=high, found_without_full=int((found & ~asked).sum()),
                         target=TARGETS[mode], met=share >= TARGETS[mode]))
    return pd.DataFrame(rows)
