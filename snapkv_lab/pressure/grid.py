"""The pressure figure set: the needle grid and the lines ablation (`snapkv-lab needle`, `figures`)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from ..figures import FigureSet, register
from ..policies import AdaKV, PyramidKV, SnapKV, SnapKVNoPooling, StreamingLLM, TOVA
from .ablations import ABLATION_CAPACITY, ABLATION_LENGTH, ABLATION_SAMPLES, run_ablations
from .ruler import TASKS, VALUE_KINDS, ruler_context
from .runner import MODES, run_retrieval
from .tasks import lines_context, needle_context

NEEDLE_LENGTHS = (2000, 4000, 7500)
NEEDLE_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
NEEDLE_SAMPLES = 3  # haystacks per (length, depth): the committed grid
LINES_SAMPLES = 1


SUITES = ("needle", "lines", "ruler", "windows", "ablations")
WINDOW_ABLATION = (16, 32, 64, 128)  # SnapKV observation windows at a 25% budget of the 4000-token needles
RULER_LENGTH = 4000
RULER_POLICIES = (SnapKV(), AdaKV(), PyramidKV(), TOVA(), StreamingLLM())
RULER_CAPACITY = 1024  # 25% of the RULER contexts


def recompute(options: dict) -> None:
    """Run the suites in options["suites"] (default all): the needle grid, the lines ablation and the RULER-style
    variants, writing data/pressure_needle.csv, data/pressure_lines.csv and data/pressure_ruler.csv."""
    from ..models import load_model

    data_dir = Path(options.get("data_dir", "data"))
    data_dir.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_model(options.get("model"))
    suites = set(options.get("suites") or SUITES) - ({"lines"} if options.get("skip_lines") else set())
    # Samples differ in needles (keys, values) and haystack start; first_sample lets a long grid run in pieces.
    first = options.get("first_sample") or 0
    save = lambda name: (lambda table: table.to_csv(data_dir / name, index=False))  # noqa: E731
    if "needle" in suites:
        samples = range(first, first + (options.get("samples") or NEEDLE_SAMPLES))
        contexts = [needle_context(tokenizer, n, d, s) for n in options.get("lengths") or NEEDLE_LENGTHS
                    for d in options.get("depths") or NEEDLE_DEPTHS for s in samples]
        save("pressure_needle.csv")(run_retrieval(model, tokenizer, contexts, on_context=save("pressure_needle.csv")))
    if "lines" in suites:
        lines = [lines_context(tokenizer, n, n_queries=options.get("line_queries") or 8, sample=s)
                 for n in options.get("lines_lengths") or (2000,) for s in range(first, first + LINES_SAMPLES)]
        table = run_retrieval(model, tokenizer, lines, policies=(SnapKV(), SnapKVNoPooling()),
                              capacities=(256, 512, 1024), modes=("query-aware",), on_context=save("pressure_lines.csv"))
        save("pressure_lines.csv")(table)
    if "windows" in suites:
        samples = range(first, first + (options.get("samples") or 1))
        contexts = [needle_context(tokenizer, 4000, d, s) for d in NEEDLE_DEPTHS for s in samples]
        save("pressure_windows.csv")(run_retrieval(model, tokenizer, contexts, policies=[SnapKV(window_size=w) for w in WINDOW_ABLATION],
                                                   capacities=(1024,), on_context=save("pressure_windows.csv")))
    if "ablations" in suites:
        samples = range(first, first + (options.get("samples") or ABLATION_SAMPLES))
        contexts = [needle_context(tokenizer, ABLATION_LENGTH, d, s) for s in samples for d in NEEDLE_DEPTHS]
        save("pressure_ablations.csv")(run_ablations(model, tokenizer, contexts, capacity=ABLATION_CAPACITY,
                                                     on_context=save("pressure_ablations.csv")))
    if "ruler" in suites:
        samples = range(first, first + (options.get("samples") or 1))
        contexts = [ruler_context(tokenizer, RULER_LENGTH, task, kind, sample=s) for task in TASKS for kind in VALUE_KINDS
                    for s in samples]
        save("pressure_ruler.csv")(run_retrieval(model, tokenizer, contexts, policies=RULER_POLICIES,
                                                 capacities=(RULER_CAPACITY,), on_context=save("pressure_ruler.csv")))


def _run_label(table: pd.DataFrame) -> pd.Series:
    """"FullCache" for the full cache's rows, else "<policy> <mode>"."""
    return table.policy.where(table["mode"] == "full", table.policy + " " + table["mode"])


def ruler_table(table: pd.DataFrame) -> pd.DataFrame:
    """Accuracy (RULER's substring grade and the strict one) per task and value kind (rows) for the full cache
    and each policy and mode (columns); `full_cache_fails` marks the tasks the uncompressed model already fails."""
    table = table.assign(run=_run_label(table))
    grades = table.pivot_table(index=["task", "value_kind"], columns="run", values=["correct", "exact"], aggfunc="mean")
    full = table[table["mode"] == "full"].groupby(["task", "value_kind"]).correct.mean()
    return grades.assign(full_cache_fails=full.reindex(grades.index) < 1)


def accuracy_table(table: pd.DataFrame) -> pd.DataFrame:
    """Accuracy by mode, policy and budget (rows; budgets in numeric order, "full" first) and prompt length
    (columns, numeric order), the full cache expanded into every mode."""
    table = table.copy()
    full = table[table.policy == "FullCache"]
    expanded = pd.concat([full.assign(mode=m) for m in MODES if m in set(table["mode"])] + [table[table.policy != "FullCache"]],
                         ignore_index=True)
    expanded["budget"] = budget_labels(expanded.capacity)
    return expanded.pivot_table(index=["mode", "policy", "budget"], columns="length", values="correct", aggfunc="mean",
                                observed=True)


def budget_labels(capacity: pd.Series) -> pd.Series:
    """Capacities as labels ("full" where there is none) that sort in numeric order, full first: an ordered
    categorical, so that tables and figures never order budgets as text (1024 before 256)."""
    budgets = sorted(int(c) for c in capacity.dropna().unique())
    labels = capacity.map(lambda c: "full" if pd.isna(c) else str(int(c)))
    return pd.Series(pd.Categorical(labels, categories=["full", *map(str, budgets)], ordered=True), index=capacity.index)


def draw(data_dir: Path, figures_dir: Path) -> list[Path]:
    """Every pressure figure whose table exists in data_dir (`pressure.figures`, imported when drawing)."""
    from .figures import draw as draw_figures

    return draw_figures(data_dir, figures_dir)


register(FigureSet(name="pressure", recompute=recompute, draw=draw, recompute_by_default=False))
