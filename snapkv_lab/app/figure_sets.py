"""`snapkv-lab figures`: every figure set of the project (core.figure_files), drawn from the tidy tables saved in
data/, recomputed first if asked: `make_figures`. The sets live in the studies (findings, pressure, evaluation) and
register themselves when their module is imported; this table names those modules."""

from __future__ import annotations

import importlib
import sys
import time
from pathlib import Path

from ..core.checks import check_names
from ..core.figure_files import FIGURE_SETS, FigureSet, model_data_folders, model_folders

# The figure sets by name: the module whose import registers the set (it calls `register`) and what the set
# draws. A plain table, so that `snapkv-lab figures --help` lists the names without importing torch.
FIGURE_MODULES = {
    "findings": ("snapkv_lab.findings.experiments", "the paper's four observations (a)-(d), generated and "
                                                    "teacher-forced"),
    "pressure": ("snapkv_lab.pressure", "needle grid heatmaps, accuracy vs budget, RULER-style suite, lines ablation"),
    "eval": ("snapkv_lab.evaluation", "benchmark runs (snapkv-lab eval): score vs compression ratio, task x policy, "
                                      "gap to the full cache"),
    "heads": ("snapkv_lab.findings.heads_study", "which heads retrieve: Wu et al.'s retrieval score per layer "
                                                 "and head"),
    "causal": ("snapkv_lab.findings.causal_plots", "every policy's causal coverage against its attention coverage on "
                                                   "needle prompts (finding (e); its recompute is long)"),
    "scorer-allocation": ("snapkv_lab.app.scorer_allocation_plots", "every scorer under every allocation at matched KV "
                                                              "entries (snapkv-lab scorer-allocation)"),
    "multi-turn": ("snapkv_lab.evaluation.turns", "SCBench's multi-turn mode on the generated suite: score by turn per "
                                                  "policy, feed x compress option"),
    "non-literal": ("snapkv_lab.evaluation.literal_gap", "nolima's generated needles: each policy's loss to the full "
                                                         "cache, literal vs non-literal question"),
    "score-bytes": ("snapkv_lab.pressure.score_bytes_plots", "needles found against the KV bytes held: "
                                                            "eviction, merging, key channels, quantization, combined"),
}


def load_figure_sets() -> dict[str, FigureSet]:
    for module, _ in FIGURE_MODULES.values():
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as err:
            if err.name != module:  # a real missing dependency, not a module not written yet
                raise
    return FIGURE_SETS


def make_figures(data_dir="data", figures_dir="figures", *, recompute: bool = False, only=None,
                 options: dict | None = None) -> list[Path]:
    """Draw every registered figure set (or those named in `only`); recompute their tables first if asked.

    options["model"] (None: the default model) picks the model: its tables are recomputed and drawn in its own
    folders (`model_folders`). With no model named, the default model's tables are recomputed if asked, and every
    model's tables found in data_dir are drawn. With recompute, a set with recompute_by_default=False is rerun
    only when `only` names it.
    """
    sets = load_figure_sets()
    check_names(only or [], list(sets), "figure sets")
    model = (options or {}).get("model")
    data_dir, figures_dir = Path(data_dir), Path(figures_dir)
    options = {**(options or {}), "recipes_path": data_dir / "prompt_recipes.json"}
    folders = [model_folders(data_dir, figures_dir, model)]
    if model is None:
        folders += [(data_dir / name, figures_dir / name) for name in model_data_folders(data_dir)]
    written = []
    for i, (model_data, model_figures) in enumerate(folders):
        written += _make_model_figures(sets, model_data, model_figures, recompute=recompute and i == 0, only=only,
                                       options=options)
    return written


def _make_model_figures(sets: dict, data_dir: Path, figures_dir: Path, *, recompute: bool, only,
                        options: dict) -> list[Path]:
    figures_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, figure_set in sets.items():
        if only and name not in only:
            continue
        if recompute and (figure_set.recompute_by_default or name in (only or [])):
            figure_set.recompute({**options, "data_dir": data_dir})
        elif recompute:
            print(f"{name}: redrawn from its tables in {data_dir}/ (its recompute is long: name it to rerun, "
                  f"--recompute --only {name})", file=sys.stderr)
        # Drawing every set takes tens of seconds: say so, rather than go silent at the end of a long run.
        print(f"{name}: drawing its figures into {figures_dir}/ ...", file=sys.stderr, flush=True)
        began = time.perf_counter()
        files = figure_set.draw(data_dir, figures_dir)
        print(f"{name}: {len(files)} files in {time.perf_counter() - began:.0f} s", file=sys.stderr, flush=True)
        written += files
    return written
