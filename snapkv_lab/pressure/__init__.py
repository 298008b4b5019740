"""Pressure tests on real text: needle in a haystack, and LongEval-Lines-style key/value retrieval.

    tasks.py    the contexts and questions (chat-templated, with the token spans of each fact and value), grading
    ruler.py    RULER-style variants: multi-key, multi-value, multi-query; number, word and uuid values
    runner.py   run_retrieval: every question x policy x budget x mode from one prefill per context
    intervals.py  Wilson intervals of accuracies (both grades)
    ablations.py  SnapKV's settings and the other methods at 25%, each run explained by attention coverage
    grid.py     the suites (needle grid, lines, window and method ablations, RULER) as one table, SUITES; each context
                is a cell of a resumable grid (snapkv_lab.sweep), run by `snapkv-lab needle`
    tables.py   the suites' tables summarised: accuracy by policy, budget and length; RULER grades per task
    figures.py  their figures; with grid.recompute, the `pressure` figure set registered here
    score_bytes.py  score against bytes: eviction, merging, key channels (ThinK), quantization (KIVI) and their
                compositions on the dev needles, by the KV bytes each cache holds (`python -m
                snapkv_lab.pressure.score_bytes`; figure set `score-bytes` in score_bytes_plots.py, imported on its own)
    long_generation.py  copy a numbered list from the prompt: what eviction while decoding loses in a long output
                (imported on its own, and run as `python -m snapkv_lab.pressure.long_generation`)

Query-aware: the question is part of the prompt, so SnapKV's window votes with the question.
Query-agnostic (kvpress's protocol): the context alone is compressed, the question appended after.
The full cache is the same in both modes. The prefill logits are the full cache's in every case
(as in the paper, the prompt is processed uncompressed), so the first answer token never differs.
Results are tidy tables (one row per question x policy x budget x mode) in data/pressure_*.csv.
"""

from ..core.figure_files import FigureSet, register
from ..tasks.needles import Context, Query, found, found_exactly, lines_context, needle_context
from ..tasks.ruler_needles import TASKS, VALUE_KINDS, ruler_context
from .grid import SUITES, Suite, grid_cells, recompute, run_context
from .intervals import accuracy_intervals, wilson
from .pressure_plots import draw
from .runner import CAPACITIES, DEFAULT_POLICIES, MODES, run_retrieval
from .tables import accuracy_table, budget_labels, ruler_table, run_label

register(FigureSet(name="pressure", recompute=recompute, draw=draw, recompute_by_default=False))

__all__ = ["SUITES", "Suite", "grid_cells", "run_context", "CAPACITIES", "DEFAULT_POLICIES", "MODES", "TASKS",
           "VALUE_KINDS", "ruler_context", "Context", "Query", "accuracy_table", "draw", "found", "found_exactly",
           "lines_context", "needle_context", "recompute", "ruler_table", "run_label", "budget_labels", "run_retrieval",
           "accuracy_intervals", "wilson"]
