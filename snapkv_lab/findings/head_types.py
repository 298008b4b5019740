"""Do the observation-window findings differ between retrieval heads and the others?

    table = findings_by_head_type(findings_b, retrieval)     # per split, head type, metric and sinks rule

findings_b is finding (b)'s per-head table (`experiments`, data/findings_b.csv: each (layer, head)'s hit rate, recall
and coarse overlap of SnapKV's window selection with the generation's attention, per prompt); retrieval is a
`retrieval_heads` table of the same model. A head is a retrieval head when its retrieval score passes `threshold`
(Wu et al. call heads above 0.1 retrieval heads); the rest, streaming heads in DuoAttention's words, include heads
that never hit. Each value pools its heads and prompts (`metrics.summarise`), with a bootstrap interval over prompts,
and the difference between the two head types is paired over the same prompts (`metrics.difference`).
"""

from __future__ import annotations

import pandas as pd

from ..core.overlap import difference, summarise

RETRIEVAL_THRESHOLD = 0.1
HEAD_TYPES = ("retrieval", "other")


def head_types(retrieval: pd.DataFrame, threshold: float = RETRIEVAL_THRESHOLD) -> pd.Series:
    """(layer, head) -> "retrieval" where the retrieval score passes `threshold`, else "other" (NaN scores too)."""
    score = retrieval.set_index(["layer", "head"]).retrieval_score
    return (score > threshold).map({True: HEAD_TYPES[0], False: HEAD_TYPES[1]}).rename("head_type")


def findings_by_head_type(findings_b: pd.DataFrame, retrieval: pd.DataFrame, threshold: float = RETRIEVAL_THRESHOLD,
                          *, ci: float = 0.95, seed: int = 0) -> pd.DataFrame:
    """One row per split, metric, sinks rule and head type ("retrieval", "other", and "retrieval - other"): value,
    chance (the value's chance level; none for the difference), ci_low, ci_high, n_heads, n_samples."""
    types = head_types(retrieval, threshold)
    table = findings_b.join(types, on=["layer", "head"])
    if table.head_type.isna().any():
        raise ValueError("findings_b has heads the retrieval table lacks: are they of one model?")
    by = ["metric", "sinks"]
    rows = []
    for split, part in table.groupby("split", sort=True):
        pooled = summarise(part, by=["head_type", *by], ci=ci, seed=seed)
        pooled["n_heads"] = pooled.head_type.map(types.value_counts())
        paired = difference(part, ("head_type", *HEAD_TYPES), by=by, ci=ci, seed=seed)
        paired = paired.rename(columns={"difference": "value"}).assign(head_type=f"{HEAD_TYPES[0]} - {HEAD_TYPES[1]}")
        rows += [pooled.assign(split=split), paired.assign(split=split)]
    columns = ["split", "head_type", *by, "value", "chance", "ci_low", "ci_high", "n_heads", "n_samples"]
    return pd.concat(rows, ignore_index=True).reindex(columns=columns)
