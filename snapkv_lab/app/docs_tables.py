"""The docs' tables that come from data/ (and the benchmarks' committed results beside it): each written by code
between markers in its page, so that a page never says other numbers than the committed tables (tests/test_docs.py
checks every block; `snapkv-lab figures` rewrites them whenever it draws).

In a page a block reads

    <!-- generated: NAME (snapkv_lab.app.docs_tables; do not edit by hand) -->
    ...
    <!-- /generated: NAME -->

and `BLOCKS[NAME]` says which page holds it and how it is written from a data folder.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..core.ratio_intervals import interval_text


@dataclass(frozen=True)
class Block:
    """A generated part of a docs page: the page (relative to the docs folder), the tables it reads (relative to the
    data folder; a block whose tables are missing is left as it is) and how it is written."""

    page: str
    reads: tuple[str, ...]
    render: Callable[[Path], str]


def _findings(data_dir: Path) -> str:
    from ..findings.report import markdown, report

    return markdown(report(data_dir))


def _findings_side_by_side(data_dir: Path) -> str:
    from ..findings.report import report, side_by_side

    return side_by_side({"SmolLM2-135M": report(data_dir), "Gemma 3 270M": report(data_dir / "gemma-3-270m")})


def _causal_coverage(data_dir: Path, model: str = "") -> str:
    """Finding (e): attention coverage against causal coverage over every policy studied (findings.causal_finding),
    on the model whose folder is data_dir/model."""
    from ..findings.causal_finding import markdown
    from ..views.causal_study import TABLE, read_table

    return markdown(read_table(data_dir / model / TABLE))


def _scorer_allocation(data_dir: Path, model: str = "") -> str:
    """The scorer x allocation study's scores and each method's decomposition (app.scorer_allocation_plots.report), of
    the model whose folder under data_dir is `model` (SmolLM2's: data_dir itself)."""
    import pandas as pd

    from .scorer_allocation import TABLE
    from .scorer_allocation_plots import report

    return report(pd.read_csv(data_dir / model / TABLE, dtype={"example": str, "prediction": str}))


def _nolima(data_dir: Path, model: str = "") -> str:
    """nolima's generated items, literal vs non-literal, per policy and mode (evaluation.literal_gap.report)."""
    from ..evaluation.literal_gap import read_runs, report

    return report(*read_runs(data_dir / model))


def _multi_turn(data_dir: Path, table: str = "", depths: bool = False) -> str:
    """A multi-turn run (default the seeded-order one, evaluation.turns.TABLE): score by turn, the three contrasts,
    turn 1 against the last; with `depths`, the full cache's score by the depth band each turn asked (a run of the
    balanced suite: evaluation.turns.depth_report)."""
    from ..evaluation import read_results
    from ..evaluation.turns import TABLE, depth_report, report

    results = read_results(data_dir / (table or TABLE))
    return report(results) + ("\n\n" + depth_report(results) if depths else "")


def _leaderboard(data_dir: Path, name: str = "ruler", model: str = "") -> str:
    """A committed RULER run (<model>/eval_<name>.csv: the 4k leaderboard, the 8k run, Gemma's): its size, the score
    per policy, mode and ratio (a run of all 13 tasks: RULER's average over them, and over the 11 synthetic ones
    beside it), and the full cache per task."""
    from ..evaluation import read_results
    from ..evaluation.leaderboard_plots import counted
    from ..evaluation.summary import averages

    table = read_results(data_dir / model / f"eval_{name}.csv")
    boards = averages(table)
    both = set(boards.average) == {"13 tasks", "11 synthetic"}  # a run of all 13: RULER's average, the 11 beside it
    board = boards[boards.average == ("13 tasks" if both else boards.average.iloc[0])]
    synthetic = boards[boards.average == "11 synthetic"].set_index(["policy", "mode", "ratio"]).score if both else None
    full, compressed = board[board.policy == "FullCache"], board[board.policy != "FullCache"]
    columns = [(mode, ratio) for mode in ("query-agnostic", "query-aware")
               for ratio in sorted(compressed.ratio.unique())]
    examples = table.drop_duplicates(["task", "example"]).groupby("task", sort=False).size()
    per_task = f"{examples.min()}" if examples.min() == examples.max() else f"{examples.min()} to {examples.max()}"
    mean = ("the mean over RULER's 13 tasks [95% interval] / over its 11 synthetic ones (without qa_1, qa_2)" if both
            else "the mean over tasks, [95% interval]")
    lines = [f"{counted(len(examples), 'task')}, {counted(int(examples.sum()), 'example')} ({per_task} per task); "
             f"score (0-100) per policy, mode and compression ratio, {mean} over examples where a task has two or "
             "more:", "",
             "| policy | " + " | ".join(f"{mode.removeprefix('query-')} {ratio:g}" for mode, ratio in columns) + " |",
             "|---|" + "---|" * len(columns)]

    def cell(row, policy, mode, ratio) -> str:
        text = interval_text(row.score, row.low, row.high)
        text = text if synthetic is None else f"{text} / {synthetic[(policy, mode, ratio)]:.0f}"
        return text + (" †" if bool(getattr(row, "over_budget", False)) else "")

    base = full.iloc[0]
    lines.append("| FullCache | " + " | ".join(cell(base, "FullCache", base["mode"], base.ratio) for _ in columns)
                 + " |")
    for policy, part in compressed.groupby("policy", sort=False):
        part = part.set_index(["mode", "ratio"])
        lines.append(f"| {policy} | " + " | ".join(
            cell(part.loc[c], policy, *c) if c in part.index else "-" for c in columns) + " |")
    if "over_budget" in board:  # the run recorded (or an audit filled) the KV entries its rows held
        over = int(board.over_budget.eq(True).sum())
        lines += ["", f"† held more KV entries than its budget allows beyond rounding, in some example ({over} of "
                      f"{len(compressed)} cells; `over_budget`): not a comparison at matched totals. The policies' "
                      "mean share of the full cache's KV entries held, least to most, per ratio: " + "; ".join(
                          f"{ratio:g}: {part.kv_share.min():.3f} to {part.kv_share.max():.3f}"
                          for ratio, part in compressed.groupby("ratio"))]
        unbudgeted = compressed.budget_share >= 1  # a threshold or a layer test decides what it holds
        under = compressed[~unbudgeted & (compressed.kv_share < compressed.budget_share - UNDER_BUDGET)]
        cells = {policy: ", ".join(f"{mode.removeprefix('query-')} {ratio:g}" for mode, ratio in zip(part["mode"],
                                                                                                    part.ratio))
                 for policy, part in under.groupby("policy", sort=False)}
        if cells:  # fair to the others, but not matched totals either
            lines[-1] += (f". Held under budget by more than {UNDER_BUDGET} of the full cache on average: "
                          + "; ".join(f"{policy} ({where})" for policy, where in cells.items()))
        free = compressed[unbudgeted].groupby("policy", sort=False).kv_share
        if len(free):  # no budget to be under: what it held is said instead
            lines[-1] += (". No budget (the ratio is not theirs to hold; the share held, least to most): "
                          + "; ".join(f"{policy} {low:.3f} to {high:.3f}" for policy, (low, high) in
                                      free.agg(["min", "max"]).iterrows()))
    return "\n".join(lines + ["", _full_cache_per_task(table)])


def _full_cache_per_task(table) -> str:
    """The full cache's score per task of an eval table, and the tasks it fails (evaluation.full_cache_fails:
    under 50)."""
    from ..evaluation import full_cache_fails, task_scores
    from ..evaluation.summary import lengths

    fails = full_cache_fails(table)
    scores = task_scores(table[table["mode"] == "full"])
    by_length = len(lengths(table)) > 1
    lines = ["The full cache per task (what compression can be judged on: "
             + ("it fails " + ", ".join(fails) if fails else "it fails none") + "):", "",
             "| task | " + ("length | " if by_length else "") + "full cache | examples |",
             "|---|" + ("---:|" if by_length else "") + "---|---|"]
    for _, row in scores.iterrows():
        lines.append(f"| {row.task} | " + (f"{row.length} | " if by_length else "")
                     + f"{interval_text(row.score, row.low, row.high)} | {row.examples} |")
    return "\n".join(lines)


def _full_cache_tasks(data_dir: Path, name: str, model: str = "") -> str:
    """The full cache per task of a committed eval run (<model>/eval_<name>.csv) that asks every task."""
    from ..evaluation import read_results

    return _full_cache_per_task(read_results(data_dir / model / f"eval_{name}.csv"))


def _p_cell(row) -> str:
    """A sign-flip p as the docs print it: ~ where it was drawn (Monte Carlo) rather than enumerated."""
    return f"{'' if row.p_method == 'exact' else '~'}{row.p:.2g}"


def _differences(data_dir: Path, name: str = "ruler", model: str = "", every_budget: bool = False) -> str:
    """A committed RULER run's paired differences to SnapKV as the family of comparisons holds them (evaluation.family,
    data/comparison_family_results.csv), with the leaderboard's statistic (the mean over tasks): per policy, mode
    (and ratio: the middle one, or every one), the difference [95% interval] and the sign-flip p, bold where Holm
    over the family's primary comparisons leaves it under 0.05. A run that shares its examples with the comparisons'
    primary run says so and bolds nothing."""
    from ..evaluation.family import FAMILY, PRIMARY, SAME, holm_size, parse_examples, read_family, read_family_results
    from ..evaluation.leaderboard_plots import BASELINE, _modes, by_difference

    table = f"{model}/eval_{name}.csv" if model else f"eval_{name}.csv"
    results = read_family_results(data_dir)
    family = read_family(data_dir / FAMILY)
    means = results[(results.analysis == "task mean") & (results.baseline == BASELINE)]
    rows = means[means.table == table]
    ratios = sorted(rows.ratio.unique())
    steps = ratios if every_budget else [ratios[len(ratios) // 2]]
    rows = rows[rows.ratio.isin(steps)]
    columns = [(mode, step) for mode in _modes(rows) for step in steps]
    policies = by_difference(rows)
    others = sorted({e.removeprefix(SAME) for e in rows.evidence if e != PRIMARY})
    where = "per ratio" if every_budget else f"at ratio {steps[0]:g}"
    head = (f"Score less {BASELINE}'s on the same examples {where} (points, the mean over tasks), [95% bootstrap "
            f"interval] and the p of a paired sign-flip test (exact; ~ drawn: Monte Carlo, past 20 nonzero "
            f"differences of several sizes)")
    if others:
        examples = family.drop_duplicates("table").set_index("table").examples
        own = parse_examples(examples[table])
        shared = ", ".join(f"{len(own & parse_examples(examples[other]))} of its {len(own)} examples are {other}'s"
                           for other in others)
        head += (f". Not separate evidence ({shared}): these comparisons are counted on that run, and nothing here is "
                 f"bold (\"The family of comparisons\" below):")
    else:
        head += (f"; bold where it holds after Holm's adjustment over the family's {holm_size(family)} primary "
                 f"comparisons (every run the docs report: \"The family of comparisons\" below), p_holm < 0.05:")
    lines = [head, "", "| policy | " + " | ".join(mode.removeprefix("query-") + (f" {step:g}" if every_budget else "")
                                                  for mode, step in columns) + " |",
             "|---|" + "---|" * len(columns)]
    rows = rows.set_index(["policy", "mode", "ratio"])
    for policy in policies:
        cells = []
        for mode, step in columns:
            if (policy, mode, step) not in rows.index:
                cells.append("-")
                continue
            row = rows.loc[(policy, mode, step)]
            cell = f"{interval_text(row.difference, row.low, row.high)}, p {_p_cell(row)}"
            cells.append(f"**{cell}**" if row.p_holm < 0.05 else cell)  # NaN (not primary): never bold
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _length(length) -> str:
    """A run's prompt length as the family's tables print it: "-" for a multi-turn run of fixed texts (none)."""
    import pandas as pd

    return "-" if pd.isna(length) else str(length)


def _family_runs(data_dir: Path) -> str:
    """The family of comparisons per run: its model, length, tasks, examples and the examples the full cache
    answers, its comparisons and their evidence, and how many hold past Holm over the family on the answered examples
    and on the task mean; above it, the counts and the fewest agreeing examples that can pass."""
    from ..evaluation.family import (
        ALPHA,
        FAMILY,
        PRIMARY,
        SAME,
        SETTINGS,
        holm_size,
        parse_examples,
        read_family,
        read_family_results,
    )

    results = read_family_results(data_dir)
    family = read_family(data_dir / FAMILY)
    examples = family.drop_duplicates("table").set_index("table").examples
    answered, means = (results[results.analysis == a].set_index(["table", "policy", "ratio", "mode", *SETTINGS])
                       for a in ("answered", "task mean"))
    both = (answered.separated.eq(True) & means.separated.eq(True)).sum()
    m = holm_size(family)
    fewest = next(n for n in range(1, 64) if 2 / 2 ** n <= ALPHA / m)
    lines = [f"{len(answered)} comparisons (every policy against SnapKV at every ratio and mode; in a multi-turn run, "
             f"each policy against itself at another turn, feed or compress option) in "
             f"{answered.index.get_level_values('table').nunique()} runs: {m} primary, {len(answered) - m} on examples "
             f"counted in another run. Past Holm's adjustment over the {m} (p_holm < {ALPHA:g}): "
             f"{int(answered.separated.eq(True).sum())} on the examples the full cache answers, "
             f"{int(means.separated.eq(True).sum())} on the mean over every task, {int(both)} on both. The smallest "
             f"threshold Holm sets is {ALPHA:g} / {m} = {ALPHA / m:.2g}: an exact sign flip reaches it with {fewest} "
             f"agreeing examples at least (2 / 2^{fewest} = {2 / 2 ** fewest:.2g}), so a run of fewer answered "
             f"examples places its policies but cannot separate them.", "",
             "| model | length | run | tasks | examples | answered | comparisons | evidence | "
             "hold: answered / task mean |",
             "|---|---:|---|---:|---:|---:|---:|---|---|"]
    for table, rows in answered.groupby(level="table", sort=False):
        run = means.loc[table]
        evidence = rows.evidence.iloc[0]
        if evidence == PRIMARY:
            held = f"{int(rows.separated.eq(True).sum())} / {int(run.separated.eq(True).sum())}"
        else:
            other = evidence.removeprefix(SAME)
            shared = len(parse_examples(examples[table]) & parse_examples(examples[other]))
            evidence, held = f"{evidence} ({shared} of its {int(run.examples.max())})", "-"
        lines.append(f"| {rows.model.iloc[0]} | {_length(rows.length.iloc[0])} | {table} | {int(run.tasks.max())} | "
                     f"{int(run.examples.max())} | {int(rows.examples.max())} | {len(rows)} | {evidence} | {held} |")
    return "\n".join(lines)


def _family_holds(data_dir: Path) -> str:
    """Every primary comparison of the family that holds past Holm on the answered examples or on the task mean:
    per model, length, mode, ratio and policy, each analysis's examples, difference, p and p_holm."""
    from ..evaluation.family import PRIMARY, SETTINGS, read_family_results

    results = read_family_results(data_dir)
    results = results[results.evidence == PRIMARY]
    key = ["model", "length", "table", "mode", "ratio", "policy", *SETTINGS]
    answered, means = (results[results.analysis == a].set_index(key) for a in ("answered", "task mean"))
    held = answered[answered.separated.eq(True) | means.separated.eq(True)].index
    lines = ["Each comparison that holds in either reading, policy less SnapKV in points (positive: the policy keeps "
             "more), the p of the sign flip (~ drawn) and Holm's p over the family, bold under 0.05:", "",
             "| model | length | mode | ratio | policy | answered: examples | difference | p | p_holm | "
             "task mean: examples | difference | p | p_holm |",
             "|---|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def shown(row) -> str:
        adjusted = f"{row.p_holm:.2g}"
        return (f"{int(row.examples)} | {row.difference:+.0f} | {_p_cell(row)} | "
                + (f"**{adjusted}**" if row.separated else adjusted))

    order = answered.loc[held].reset_index().sort_values(["model", "length", "mode", "ratio", "difference"],
                                                         ascending=[True, True, True, True, False], kind="stable")
    for row in order.itertuples(index=False):
        index = tuple(getattr(row, c) for c in key)
        policy = row.policy + (f" ({row.setting} vs {row.baseline_setting})" if row.setting else "")
        lines.append(f"| {row.model} | {_length(row.length)} | {row.mode.removeprefix('query-')} | {row.ratio:g} | "
                     f"{policy} | {shown(answered.loc[index])} | {shown(means.loc[index])} |")
    return "\n".join(lines)


def _family_tasks(data_dir: Path) -> str:
    """Per task of each primary run of several tasks: its examples, those the full cache answers, the full cache's
    score, the weight an average gives the task (the task mean: one task's share; the answered mean: its answered
    examples' share), and in how many of the run's comparisons the task alone gives p < 0.05 (unadjusted)."""
    from ..evaluation import answered_examples, read_results
    from ..evaluation.family import PRIMARY, read_family_results
    from ..evaluation.leaderboard_plots import counted

    results = read_family_results(data_dir)
    tasks = results[(results.analysis == "task") & (results.evidence == PRIMARY)]
    lines = []
    for table, rows in tasks.groupby("table", sort=False):
        answered = answered_examples(read_results(data_dir / table)).groupby("task").size()
        per_task = rows.groupby("task", sort=False).agg(examples=("examples", "max"), full=("full_cache", "first"),
                                                        below=("p", lambda p: int((p < 0.05).sum())))
        per_task = per_task.assign(answered=answered.reindex(per_task.index, fill_value=0)).astype(
            {"examples": int, "answered": int, "below": int})
        comparisons = rows.groupby(["policy", "ratio", "mode"]).ngroups
        fails = per_task.full < 50
        lines += [f"{table} ({rows.model.iloc[0]}, {rows.length.iloc[0]} tokens): the tasks its full cache fails "
                  f"(under 50) weigh {fails.mean():.0%} of the mean over tasks and "
                  f"{per_task.answered[fails].sum() / per_task.answered.sum():.0%} of the mean over answered "
                  f"examples; of its {counted(comparisons, 'comparison')}, how many give p < 0.05 on one task alone "
                  f"(unadjusted):", "",
                  "| task | examples | answered | full cache | weight: task mean | weight: answered | p < 0.05 alone |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for task, row in per_task.iterrows():
            lines.append(f"| {task} | {row.examples} | {row.answered} | {row.full:.0f} | {1 / len(per_task):.0%} | "
                         f"{row.answered / per_task.answered.sum():.0%} | {row.below} |")
        lines.append("")
    return "\n".join(lines)


# The benchmark scripts' committed results sit beside data/ in the repository: blocks read them from there.
RESULTS = "../benchmarks/results"


def _kvpress_timing(data_dir: Path) -> str:
    import pandas as pd

    table = pd.read_csv(data_dir / RESULTS / "kvpress_timing.csv")
    lines = ["| method | tokens | kept | lab s | kvpress s | lab / kvpress | same answers |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for row in table.itertuples():
        ratio = f"{row.lab_over_kvpress:.2f}"  # the script's own (from unrounded times); bold where the lab is ahead
        lines.append(f"| {row.method} | {row.tokens} | {row.kept} | {row.lab_s:.2f} | {row.kvpress_s:.2f} | "
                     f"{f'**{ratio}**' if row.lab_over_kvpress <= 1 else ratio} | {row.same_answers:.2f} |")
    return "\n".join(lines)


def _kvpress_timing_summary(data_dir: Path) -> str:
    import pandas as pd

    table = pd.read_csv(data_dir / RESULTS / "kvpress_timing.csv")
    ratios = table.pivot(index="method", columns="tokens", values="lab_over_kvpress").reindex(table.method.unique())
    lines = ["| lab time / kvpress time | " + " | ".join(f"{n} tokens" for n in ratios.columns) + " |",
             "|---|" + "---:|" * len(ratios.columns)]
    lines += [f"| {method} | " + " | ".join(f"{value:.2f}" for value in row) + " |"
              for method, row in ratios.iterrows()]
    return "\n".join(lines)


def _end_to_end_gpu(data_dir: Path) -> str:
    """bench_end_to_end.py on the random 8B shape (bf16, CUDA): per batch and policy, prefill, scoring, decode and
    peak memory, the prefill and decode also over the full cache's."""
    import pandas as pd

    from ..core.timing import over_full_cache

    table = over_full_cache(pd.read_csv(data_dir / RESULTS / "end_to_end_llama3-8b_bf16_sdpa_cuda.csv"))
    lines = ["| tokens | batch | policy | prefill s (x full) | scoring s | decode ms/token (x full) | KV MiB | "
             "peak GPU GiB | status |", "|---:|---:|---|---:|---:|---:|---:|---:|---|"]
    for (tokens, batch), part in table.groupby(["tokens", "batch"], sort=True):
        for row in part.itertuples():
            if row.status != "ok":
                lines.append(f"| {tokens} | {batch} | {row.policy} | | | | | | {row.status} |")
                continue
            lines.append(f"| {tokens} | {batch} | {row.policy} | {row.prefill_s:.2f} ({row.prefill_s_vs_full:.2f}) "
                         f"| {row.scoring_s:.2f} | {row.decode_ms:.1f} ({row.decode_ms_vs_full:.2f}) | "
                         f"{row.kv_mib:.0f} | {row.peak_mb / 1024:.1f} | ok |")
    return "\n".join(lines)


def _head_types(data_dir: Path, model: str = "") -> str:
    """Finding (b) on retrieval heads and the others, per split: value [95% interval] per metric and sinks rule, from
    the model's folder of data_dir ("" for the default model)."""
    import pandas as pd

    from ..findings.head_types import findings_by_head_type
    from ..findings.legacy import read_table

    data_dir = data_dir / model
    table = findings_by_head_type(read_table(data_dir / "findings_b.csv"),
                                  pd.read_csv(data_dir / "retrieval_heads.csv"))
    heads = table.dropna(subset=["n_heads"]).drop_duplicates("head_type").set_index("head_type").n_heads
    lines = [f"Retrieval heads (score > 0.1): {heads.get('retrieval', 0):.0f} of {heads.sum():.0f}; value [95% "
             "interval over prompts], chance in parentheses:", "",
             "| split | metric | sinks | retrieval heads | other heads | retrieval - other |",
             "|---|---|---|---|---|---|"]
    for (split, metric, sinks), part in table.groupby(["split", "metric", "sinks"], sort=True):
        cells = part.set_index("head_type")
        shown = [f"{r.value:.3f} [{r.ci_low:.3f}, {r.ci_high:.3f}]"
                 + ("" if pd.isna(r.chance) else f" ({r.chance:.3f})")
                 for r in (cells.loc[t] for t in ("retrieval", "other", "retrieval - other"))]
        lines.append(f"| {split} | {metric} | {sinks} | " + " | ".join(shown) + " |")
    return "\n".join(lines)


def _share_range(low: float, high: float) -> str:
    """A share of the full cache's KV entries held, least to most, to 3 decimals (one number where they round alike)."""
    return f"{low:.3f}" if round(low, 3) == round(high, 3) else f"{low:.3f}-{high:.3f}"


def _presses(data_dir: Path, table: str = "pressure_presses.csv") -> str:
    """The presses suite per press and mode on the needles the full cache answers: found [95% Wilson], the needles it
    and SnapKV find alone in that mode (discordant pairs; descriptive, not in the family), and the KV entries held."""
    import pandas as pd

    from ..pressure.tables import paired_table

    summary = paired_table(pd.read_csv(data_dir / table))
    modes = [m for m in ("query-aware", "query-agnostic") if m in set(summary["mode"])]
    by_mode = {mode: summary[summary["mode"] == mode].set_index("policy") for mode in modes}
    head = " | ".join(f"{mode}: found [95%] | it alone / SnapKV alone" for mode in modes)
    lines = [f"Needles the full cache answers: {int(summary.answered.iloc[0])}.", "",
             f"| press | {head} | KV entries held (share; {' / '.join(modes)}) |",
             "|---|" + "---|---:|" * len(modes) + "---:|"]
    for policy in dict.fromkeys(summary.policy):
        cells, shares = [], []
        for mode in modes:
            if policy not in by_mode[mode].index:  # a press not run in this mode
                cells += ["-", "-"]
                continue
            r = by_mode[mode].loc[policy]
            cells += [f"{r.correct}/{r.asked} [{r.correct_low:.2f}, {r.correct_high:.2f}]",
                      "-" if policy == "SnapKV" else f"{r.only_policy} / {r.only_baseline}"]
            shares.append(_share_range(r.kv_share_min, r.kv_share_max))
        lines.append(f"| {policy} | {' | '.join(cells)} | {' / '.join(shares)} |")
    return "\n".join(lines)


def _long_generation(data_dir: Path, table: str = "long_generation.csv") -> str:
    """A long-generation run per policy: codes copied, output length, KV footprint, each with its interval."""
    import pandas as pd

    from ..pressure.long_generation import long_generation_markdown

    return long_generation_markdown(pd.read_csv(data_dir / table))


def _methods(data_dir: Path) -> str:
    """The methods suite per method: needles found [95% Wilson interval] in each mode, kept tokens and the coverage
    columns of the query-aware runs."""
    import pandas as pd

    from ..pressure.tables import methods_table

    table = pd.read_csv(data_dir / "pressure_methods.csv")
    summary = methods_table(table)
    found = {(r.policy, r.mode): f"{int(r.correct)}/{int(r.asked)} [{r.correct_low:.2f}, {r.correct_high:.2f}]"
             for r in summary.itertuples()}
    aware = summary[summary["mode"].isin(["query-aware", "full"])].set_index("policy")
    # the share of the full cache's KV entries held (kv_share, recorded or filled by the budget audit), query-aware
    held = (table[table["mode"].isin(["query-aware", "full"])].groupby("policy").kv_share.agg(["min", "max"])
            if "kv_share" in table else None)

    def share(policy):
        if held is None:
            return "-"
        return _share_range(*held.loc[policy])

    lines = ["| method | query-aware: found [95%] | query-agnostic: found [95%] | kept tokens (longest layer) | "
             "KV entries held (share) | coverage / oracle | needle attention served |",
             "|---|---|---|---:|---:|---:|---:|"]
    for policy in dict.fromkeys(summary.policy):
        row = aware.loc[policy]
        if policy == "FullCache":
            lines.append(f"| FullCache | {found[(policy, 'full')]} | (the same run) | {row.cache_length:.0f} | "
                         f"{share(policy)} | 1 | 1 |")
            continue
        lines.append(f"| {policy} | {found[(policy, 'query-aware')]} | {found.get((policy, 'query-agnostic'), '-')} | "
                     f"{row.cache_length:.0f} | {share(policy)} | {row.coverage_of_oracle:.2f} | "
                     f"{row.value_served:.2f} |")
    return "\n".join(lines)


def _score_bytes(data_dir: Path) -> str:
    """Score against bytes per mode and policy: bytes held, positions held, needles found (score_bytes_plots)."""
    from ..pressure.score_bytes import TABLE, read_table
    from ..pressure.score_bytes_plots import markdown

    return markdown(read_table(data_dir / TABLE))


def _budget_audit(data_dir: Path) -> str:
    """The budget audit of SmolLM2's 4k tables (scripts/audit_entries.py --entries-only): per policy, the share of the
    KV entries held against its budget's (evaluation.audit.held_against_budget)."""
    import pandas as pd

    from ..evaluation.audit import example_keys, held_against_budget

    entries = pd.read_csv(data_dir / BUDGET_AUDIT)
    held = held_against_budget(entries)
    lines = [f"{example_keys(entries).nunique()} examples, {len(entries)} rows (the full "
             "cache's among them).", "",
             "| policy | examples | rows | held - budget, least | held - budget, most | rows over budget |",
             "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r.policy} | {r.examples} | {r.rows} | {r.least:+.4f} | {r.most:+.4f} | {r.over_budget} |"
              for r in held.itertuples()]
    return "\n".join(lines)


def _needle_audit(data_dir: Path) -> str:
    """The needle tables' budget audit (pressure.needle_audit), per model: the tables it filled and, per policy, the
    share of the KV entries held against its budget's (evaluation.audit.held_against_budget; contexts, not
    examples)."""
    import pandas as pd

    from ..evaluation.audit import held_against_budget

    lines = []
    for name in NEEDLE_AUDITS:
        entries = pd.read_csv(data_dir / name)
        held = held_against_budget(entries)
        folder = Path("data", name).parent
        lines += [f"**{entries.model.dropna().iloc[0]}** (`data/{name}`): {entries.spec.nunique()} contexts, "
                  f"{len(entries)} rows of {', '.join(sorted(entries.table.unique()))} in {folder}/; rows whose "
                  f"rebuild departs from what their run recorded: {int((~entries.agrees).sum())}.", "",
                  "| policy | contexts | rows | held - budget, least | held - budget, most | rows over budget |",
                  "|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {r.policy} | {r.examples} | {r.rows} | {r.least:+.4f} | {r.most:+.4f} | {r.over_budget} |"
                  for r in held.itertuples()]
        lines.append("")
    return "\n".join(lines[:-1])


def _budget_records(data_dir: Path) -> str:
    """Which committed tables of runs record the KV entries their rows held (evaluation.audit.budget_records)."""
    from ..evaluation.audit import budget_records

    records = budget_records(data_dir)
    kinds = records.record.str.replace(r" as .*", "", regex=True).value_counts()
    lines = [f"{len(records)} tables of runs in data/: " + ", ".join(f"{n} {kind}" for kind, n in kinds.items()) + ".",
             "", "| table | rows | examples | KV entries held | examples audited | to fill it |",
             "|---|---:|---:|---|---:|---|"]
    for r in records.itertuples():
        examples = "-" if r.examples is None or r.examples != r.examples else int(r.examples)  # None or NaN: none
        tool = ("-" if r.known else "scripts/audit_entries.py" if r.auditable
                else "a rerun (no audit tool reads its rows)")
        audited = "-" if examples == "-" or r.record.startswith("recorded") else r.audited
        lines.append(f"| {r.table} | {r.rows} | {examples} | {r.record} | {audited} | {tool} |")
    return "\n".join(lines)


BUDGET_AUDIT = "budget_audit_smollm2_4k.csv"
NEEDLE_AUDITS = ("budget_audit_needles_smollm2.csv", "gemma-3-270m/budget_audit_needles.csv")
UNDER_BUDGET = 0.01  # a leaderboard cell's mean held share this far below its budget's is named as under budget
# The family of comparisons (evaluation.family.FAMILY and RESULTS): every difference block reads its p from there.
FAMILY_FILES = ("comparison_family.csv", "comparison_family_results.csv")
# evaluation.turns.TABLE and BALANCED_TABLE (copies, as NOLIMA_TABLES)
MULTI_TURN_TABLE = "eval_scbench_multiturn.csv"
MULTI_TURN_BALANCED_TABLE = "eval_scbench_multiturn_balanced.csv"
# evaluation.literal_gap.TABLES (a copy: importing it here would import the evaluation package for every page)
NOLIMA_TABLES = {"nonliteral": "eval_nolima_4k_nonliteral.csv", "literal": "eval_nolima_4k_literal.csv"}

BLOCKS = {
    "findings": Block("findings.md", ("findings_a.csv",), _findings),
    "findings-side-by-side": Block("findings.md", ("findings_a.csv", "gemma-3-270m/findings_a.csv"),
                                   _findings_side_by_side),
    "causal-coverage": Block("findings.md", ("causal_coverage.csv",), _causal_coverage),
    "causal-coverage-gemma": Block("causal.md", ("gemma-3-270m/causal_coverage.csv",),
                                   functools.partial(_causal_coverage, model="gemma-3-270m")),
    "leaderboard": Block("benchmarks.md", ("eval_ruler.csv",), _leaderboard),
    "difference": Block("benchmarks.md", ("eval_ruler.csv", *FAMILY_FILES), _differences),
    "leaderboard-answered": Block("benchmarks.md", ("eval_ruler_4k_answered.csv",),
                                  functools.partial(_leaderboard, name="ruler_4k_answered")),
    "difference-answered": Block("benchmarks.md", ("eval_ruler_4k_answered.csv", *FAMILY_FILES),
                                 functools.partial(_differences, name="ruler_4k_answered")),
    "difference-answered-gemma": Block("benchmarks.md", ("gemma-3-270m/eval_ruler_4k_answered.csv", *FAMILY_FILES),
                                       functools.partial(_differences, name="ruler_4k_answered",
                                                         model="gemma-3-270m")),
    "leaderboard-ratios": Block("benchmarks.md", ("eval_ruler_4k_ratios.csv",),
                                functools.partial(_leaderboard, name="ruler_4k_ratios")),
    "leaderboard-presses": Block("benchmarks.md", ("eval_ruler_4k_presses.csv",),
                                 functools.partial(_leaderboard, name="ruler_4k_presses")),
    "difference-presses": Block("benchmarks.md", ("eval_ruler_4k_presses.csv", *FAMILY_FILES),
                                functools.partial(_differences, name="ruler_4k_presses", every_budget=True)),
    "difference-ratios": Block("benchmarks.md", ("eval_ruler_4k_ratios.csv", *FAMILY_FILES),
                               functools.partial(_differences, name="ruler_4k_ratios", every_budget=True)),
    "leaderboard-ratios-gemma": Block("benchmarks.md", ("gemma-3-270m/eval_ruler_4k_ratios.csv",),
                                      functools.partial(_leaderboard, name="ruler_4k_ratios", model="gemma-3-270m")),
    "difference-ratios-gemma": Block("benchmarks.md", ("gemma-3-270m/eval_ruler_4k_ratios.csv", *FAMILY_FILES),
                                     functools.partial(_differences, name="ruler_4k_ratios", model="gemma-3-270m",
                                                       every_budget=True)),
    "leaderboard-8k": Block("benchmarks.md", ("eval_ruler_8k.csv",), functools.partial(_leaderboard, name="ruler_8k")),
    "leaderboard-8k-answered": Block("benchmarks.md", ("eval_ruler_8k_answered.csv",),
                                     functools.partial(_leaderboard, name="ruler_8k_answered")),
    "difference-8k-answered": Block("benchmarks.md", ("eval_ruler_8k_answered.csv", *FAMILY_FILES),
                                    functools.partial(_differences, name="ruler_8k_answered", every_budget=True)),
    "full-cache-gemma": Block("benchmarks.md", ("gemma-3-270m/eval_ruler_4k_tasks.csv",),
                              functools.partial(_full_cache_tasks, name="ruler_4k_tasks", model="gemma-3-270m")),
    "leaderboard-gemma": Block("benchmarks.md", ("gemma-3-270m/eval_ruler_4k.csv",),
                               functools.partial(_leaderboard, name="ruler_4k", model="gemma-3-270m")),
    "full-cache-gemma-long": Block("benchmarks.md", ("gemma-3-270m/eval_ruler_long.csv",),
                                   functools.partial(_full_cache_tasks, name="ruler_long", model="gemma-3-270m")),
    "leaderboard-16k-gemma": Block("benchmarks.md", ("gemma-3-270m/eval_ruler_16k.csv",),
                                   functools.partial(_leaderboard, name="ruler_16k", model="gemma-3-270m")),
    "family-runs": Block("benchmarks.md", FAMILY_FILES, _family_runs),
    "family-holds": Block("benchmarks.md", FAMILY_FILES, _family_holds),
    "family-tasks": Block("benchmarks.md", FAMILY_FILES, _family_tasks),
    "nolima": Block("non-literal.md", tuple(NOLIMA_TABLES.values()), _nolima),
    "nolima-gemma": Block("non-literal.md", tuple(f"gemma-3-270m/{t}" for t in NOLIMA_TABLES.values()),
                          functools.partial(_nolima, model="gemma-3-270m")),
    "multi-turn": Block("multi-turn.md", (MULTI_TURN_TABLE,), _multi_turn),
    "multi-turn-balanced": Block("multi-turn.md", (MULTI_TURN_BALANCED_TABLE,),
                                 functools.partial(_multi_turn, table=MULTI_TURN_BALANCED_TABLE, depths=True)),
    "multi-turn-balanced-gemma": Block("multi-turn.md", (f"gemma-3-270m/{MULTI_TURN_BALANCED_TABLE}",),
                                       functools.partial(_multi_turn, table=f"gemma-3-270m/{MULTI_TURN_BALANCED_TABLE}",
                                                         depths=True)),
    "methods": Block("pressure.md", ("pressure_methods.csv",), _methods),
    "presses": Block("pressure.md", ("pressure_presses.csv",), _presses),
    "presses-gemma": Block("pressure.md", ("gemma-3-270m/pressure_presses.csv",),
                           functools.partial(_presses, table="gemma-3-270m/pressure_presses.csv")),
    "long-generation": Block("long-generation.md", ("long_generation.csv",), _long_generation),
    "long-generation-gemma": Block("long-generation.md", ("gemma-3-270m/long_generation.csv",),
                                   functools.partial(_long_generation, table="gemma-3-270m/long_generation.csv")),
    "budget-audit": Block("benchmarks.md", (BUDGET_AUDIT,), _budget_audit),
    "budget-records": Block("benchmarks.md", (BUDGET_AUDIT,), _budget_records),
    "needle-audit": Block("benchmarks.md", NEEDLE_AUDITS, _needle_audit),
    "score-bytes": Block("score_bytes.md", ("score_bytes.csv",), _score_bytes),
    "scorer-allocation": Block("scorer_allocation.md", ("scorer_allocation.csv",), _scorer_allocation),
    "scorer-allocation-gemma": Block("scorer_allocation.md", ("gemma-3-270m/scorer_allocation.csv",),
                                     functools.partial(_scorer_allocation, model="gemma-3-270m")),
    "head-types": Block("explorer.md", ("findings_b.csv", "retrieval_heads.csv"), _head_types),
    "head-types-gemma": Block("explorer.md", ("gemma-3-270m/findings_b.csv", "gemma-3-270m/retrieval_heads.csv"),
                              functools.partial(_head_types, model="gemma-3-270m")),
    "kvpress-timing": Block("performance.md", (f"{RESULTS}/kvpress_timing.csv",), _kvpress_timing),
    "end-to-end-gpu": Block("performance.md", (f"{RESULTS}/end_to_end_llama3-8b_bf16_sdpa_cuda.csv",),
                            _end_to_end_gpu),
    "kvpress-timing-summary": Block("../README.md", (f"{RESULTS}/kvpress_timing.csv",), _kvpress_timing_summary),
}


def _markers(name: str) -> tuple[str, str]:
    return (f"<!-- generated: {name} (snapkv_lab.app.docs_tables; do not edit by hand) -->",
            f"<!-- /generated: {name} -->")


def _span(text: str, name: str, page: Path) -> tuple[int, int]:
    start, end = _markers(name)
    if text.count(start) != 1 or text.count(end) != 1:
        raise ValueError(f"{page} must hold the markers of block {name!r} once each: {start} ... {end}")
    return text.index(start) + len(start), text.index(end)


def rendered(name: str, data_dir="data") -> str | None:
    """Block `name` as written from `data_dir`, or None when its tables are not there."""
    block = BLOCKS[name]
    data_dir = Path(data_dir)
    if not all((data_dir / table).exists() for table in block.reads):
        return None
    return "\n" + block.render(data_dir).strip() + "\n"


def stale(docs_dir="docs", data_dir="data") -> list[str]:
    """Names of the blocks whose page says something else than their tables do now."""
    out = []
    for name, block in BLOCKS.items():
        page = Path(docs_dir) / block.page
        if not page.exists():
            continue  # as in write: a docs folder without that page has nothing to keep
        text = page.read_text()
        start, end = _span(text, name, page)
        new = rendered(name, data_dir)
        if new is not None and text[start:end] != new:
            out.append(name)
    return out


def write(docs_dir="docs", data_dir="data") -> list[Path]:
    """Rewrite every block from its tables; returns the pages changed."""
    changed = []
    for name, block in BLOCKS.items():
        page = Path(docs_dir) / block.page
        if not page.exists():
            continue  # outside the repository (e.g. a figures run elsewhere): no docs to keep
        text = page.read_text()
        start, end = _span(text, name, page)
        new = rendered(name, data_dir)
        if new is not None and text[start:end] != new:
            page.write_text(text[:start] + new + text[end:])
            changed.append(page)
    return changed

