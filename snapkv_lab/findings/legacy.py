"""Names written before a rename, read with this version's names: the findings' `window` (prompt and generation
blocks) became `segment` on 2026-11-26 (docs/glossary.md, "segment"), so that `window` means only SnapKV's
observation window. Tables and run settings written before then still read, and the findings' functions take the old
keyword names (`old_keywords`), warning; a findings cell store keyed by the old option names is not found again, and
its cells are recomputed."""

from __future__ import annotations

import warnings

import pandas as pd

from ..core.moved import renamed
from ..core.overlap import RENAMED

COLUMNS = {"window": "segment"}
OPTIONS = {"prompt_window": "prompt_segment", "n_windows": "n_prompt_segments", "gen_window": "gen_segment",
           "n_gen_windows": "n_gen_segments"}


def read_table(path) -> pd.DataFrame:
    """A findings table (CSV) with this version's column names."""
    return pd.read_csv(path).rename(columns=COLUMNS)


def upgrade_options(options: dict) -> dict:
    """Findings options or a run's settings (findings_run.json) with this version's names: an old name that is set
    warns, and counts where its new name is unset."""
    out = dict(options)
    for old, new in OPTIONS.items():
        value = out.pop(old, None)
        if value is not None:
            warnings.warn(f"findings option {old!r} is now named {new!r}", DeprecationWarning, stacklevel=3)
            if out.get(new) is None:
                out[new] = value
    return out


def old_keywords(**more: str):
    """Decorator: a findings function also takes, by its name before RENAMED, each option of OPTIONS it takes, and each
    keyword of `more` (old name=new name), warning (core.moved.renamed). Returns the decorator."""
    return renamed(RENAMED, **OPTIONS, **more)
