"""The field's benchmarks, run the way the field runs them: `snapkv-lab eval`, `evaluate(...)`, a leaderboard.

    examples.py     Example and Question (a benchmark item split where compression happens), the Benchmark protocol
    registry.py     DATASETS: every benchmark by name
    ruler.py        RULER generated offline: the niah family, variable tracking, common and frequent words
    hub.py          sets read from the Hugging Face Hub (or a local copy): longbench.py, infinitebench.py, loogle.py,
                    scbench.py, and kvpress's own RULER copy
    metrics.py      METRICS: each benchmark's official metrics by its own names, (prediction, references) -> [0, 1]
    prompting.py    an example as a model's token ids: framed (chat or plain) and cut from the middle
    run.py          evaluate: one resumable sweep cell per example, one prefill for every policy x ratio x mode
    summary.py      task scores, the leaderboard and the gap to the full cache, with bootstrap intervals
    explain.py      explain: one row of a table rerun, with the full cache's attention, its coverage and kept tokens
    figures.py      score vs compression ratio, task x policy heatmap, gap per task (the `eval` figure set)
"""

from pathlib import Path

import pandas as pd

from ..figures import FigureSet, register
from .examples import Benchmark, Example, Question
from .explain import Explanation, explain
from .prompting import EncodedExample, encode_example
from .run import RATIOS, budgets, eval_cells, evaluate, read_results, reuse_rows, run_example
from .summary import full_cache_fails, gap_to_full, leaderboard, paired_difference, task_scores


def __getattr__(name):
    # DATASETS and METRICS import their modules on first use: `snapkv-lab eval --help` stays instant.
    if name == "DATASETS":
        from .registry import DATASETS

        return DATASETS
    if name == "METRICS":
        from .metrics import METRICS

        return METRICS
    raise AttributeError(name)


def draw(data_dir, figures_dir, names=None) -> list[Path]:
    """Every benchmark figure of data_dir's eval_*.csv tables (evaluation.figures, imported when drawing)."""
    from .figures import draw as draw_figures

    return draw_figures(data_dir, figures_dir, names)


# The committed leaderboard: RULER at 4k on the bundled model, every policy, kvpress's ratios, both modes.
LEADERBOARD = dict(datasets=["ruler"], lengths=[4096], ratios=list(RATIOS), modes=["query-aware", "query-agnostic"])


# The committed run's policies, in the groups they joined it in. A cell's key names its policies, so a policy
# registered later joins through cells of its own over the same examples instead of starting the run over.
LEADERBOARD_GROUPS = (
    ("SnapKV", "SnapKVNoPooling", "SnapKVFactKernel", "H2O", "StreamingLLM", "RandomKeep", "TOVA", "KNorm", "PyramidKV",
     "AdaKV", "ChunkKV", "CriticalKV", "ExpectedAttention", "KVzip", "Surprisal", "DecodingEviction"),
    ("KeyDiff", "LagKV", "QFilters"),
    ("HeadKV", "DuoAttention", "CAKE"),
    ("RKV", "LookaheadQCache"),
)


def leaderboard_policies() -> list[str]:
    return [name for group in LEADERBOARD_GROUPS for name in group]


def recompute(options: dict) -> None:
    """Rerun the committed leaderboard (LEADERBOARD, every group of LEADERBOARD_GROUPS) into options' data_dir (the
    model's own folder), resuming from its cells; options["samples"]: examples per task (default the generated
    sets' 10); options["reuse"]: the examples the existing eval_ruler.csv answers whole count as done (run.reuse_rows).
    The groups' tables are joined into eval_ruler.csv, the full cache's rows (every group's cells answer
    with it) once."""
    data_dir = Path(options.get("data_dir", "data"))
    committed = data_dir / "eval_ruler.csv"
    reuse = read_results(committed) if options.get("reuse") and committed.exists() else None
    tables = [evaluate(options.get("model"), **LEADERBOARD, policies=list(group), limit=options.get("samples"),
                       data_dir=data_dir, executor=options.get("executor") or "local",
                       ray_address=options.get("ray_address"), write=False, reuse=reuse)
              for group in LEADERBOARD_GROUPS]
    joined_tables(tables).to_csv(data_dir / "eval_ruler.csv", index=False)


def joined_tables(tables) -> pd.DataFrame:
    """evaluate's tables of one set of examples under different policies, as one: each example's full-cache rows from
    the first table that has them (the others answered the same prompts with the same model)."""
    seen, parts = set(), []
    for table in tables:
        examples = pd.Series(list(zip(table.dataset, table.task, table.example)), index=table.index)
        parts.append(table[(table.policy != "FullCache") | ~examples.isin(seen)])
        seen |= set(examples[table.policy == "FullCache"])
    return pd.concat(parts, ignore_index=True)


register(FigureSet(name="eval", recompute=recompute, draw=draw, recompute_by_default=False))

__all__ = ["DATASETS", "LEADERBOARD", "METRICS", "RATIOS", "Benchmark", "EncodedExample", "Example", "Explanation",
           "Question", "budgets", "draw", "encode_example", "explain", "eval_cells", "evaluate", "full_cache_fails", "gap_to_full",
           "leaderboard", "paired_difference", "read_results", "recompute", "reuse_rows", "run_example", "task_scores"]
