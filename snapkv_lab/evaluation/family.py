"""The family of comparisons: every paired comparison the README and docs report, across models, lengths and runs,
named in one file (data/comparison_family.csv) before its results are read, each tested once and Holm-adjusted over
the whole family, not run by run.

A comparison is one policy against a baseline (SnapKV) at one compression ratio and mode, on one committed run: an
eval table of the data folder (`table`, relative to it), which holds one model, dataset and prompt length. The
family file has one row per comparison: model, dataset, length, table, policy, baseline, ratio, mode, and

- `examples`: the run's example set, `task:ID ID ...; task:...`, a stretch of IDs as `PREFIX-A..B` (RULER's
  `4096-0-0..15`: length, seed, indices 0 to 15). check_family refuses a table that holds other examples than its
  rows name: a run grown since the family was written is declared again, not read silently.
- `evidence`: "primary", or "same examples as TABLE". One comparison (the same model, dataset, length, policy,
  baseline, ratio and mode) asked in two runs that share examples is not two pieces of evidence: one run is its
  primary and the other names it. check_family refuses a family where two primary rows of one comparison share an
  example, or where a row names a run that is not that comparison's primary, or shares no example with it.

family_results reads every row three ways (`analysis`):

- "answered", the primary analysis: the examples the full cache answers (summary.answered_examples: its score 100,
  every question answered whole by the task's metric, as the answered runs' tasks were chosen), each example
  weighing the same: the mean paired difference, its sign-flip p (summary.sign_flip_test: exact, or drawn past 20
  nonzero differences of several sizes, as `p_method` says), and `p_holm`, Holm over every primary row of the
  family.
- "task mean": every task of the run, the leaderboard's statistic (the mean over tasks of each task's mean), its p
  and its own `p_holm` over the family's primary rows. A task the full cache fails weighs as much as one it answers.
- "task": one task at a time (in a run of several), the mean over its examples and its p, for reading beside the
  other two; not adjusted.

Rows whose evidence is not primary are computed the same way and shown, with no `p_holm`: their examples are
counted where the comparison is primary.

A multi-turn run (evaluation.multiturn: a table with a `turn` column, SCBench's texts, no length) compares a policy
with itself in two settings, `setting` against `baseline_setting` ("feed=gold compress=once turn=3", one feed,
compress option and turn each: evaluation.turns), paired by example; its comparisons are turns.turn_comparisons',
its length empty. Both columns are empty on every other row (a family file written before them reads as such).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pandas as pd

from .summary import N_RESAMPLES, _budget, answered_examples, example_scores, holm, paired_difference
from .turns import BASE, is_multi_turn, parse_setting, sides, turn_comparisons

FAMILY = "comparison_family.csv"
RESULTS = "comparison_family_results.csv"
COLUMNS = ["model", "dataset", "length", "table", "policy", "baseline", "ratio", "mode", "evidence", "examples",
           "setting", "baseline_setting"]
SETTINGS = ["setting", "baseline_setting"]  # a multi-turn comparison's two sides; empty elsewhere
COMPARISON = ["model", "dataset", "length", "policy", "baseline", "ratio", "mode", *SETTINGS]  # one hypothesis
NAMED = ["table", "policy", "baseline", "ratio", "mode", *SETTINGS]  # one row of the family
PRIMARY = "primary"
SAME = "same examples as "
ANALYSES = ("answered", "task mean", "task")
ALPHA = 0.05


def format_examples(examples: pd.DataFrame) -> str:
    """A run's example set as the family file writes it: `task:ID ...; task:...`, tasks in order of appearance,
    consecutive IDs PREFIX-i, ..., PREFIX-j written PREFIX-i..j (parse_examples reads it back). examples: task and
    example columns."""
    parts = []
    for task, ids in examples.drop_duplicates(["task", "example"]).groupby("task", sort=False).example:
        words: list = []  # an ID as written, or a stretch [prefix, first, last]
        for example in map(str, ids):
            if re.search(r"[\s;]|\.\.", example) or ":" in str(task):
                raise ValueError(f"{task}:{example} cannot be written in an example set (no space, ';', '..' in an "
                                 f"ID, no ':' in a task)")
            number = re.fullmatch(r"(.*-)(0|[1-9]\d*)", example)
            if number and words and isinstance(words[-1], list) and words[-1][0] == number[1] \
                    and words[-1][2] + 1 == int(number[2]):
                words[-1][2] = int(number[2])
            else:
                words.append([number[1], int(number[2]), int(number[2])] if number else example)
        written = [w if isinstance(w, str) else f"{w[0]}{w[1]}" + (f"..{w[2]}" if w[2] > w[1] else "") for w in words]
        parts.append(f"{task}:" + " ".join(written))
    return "; ".join(parts)


def parse_examples(text: str) -> set[tuple[str, str]]:
    """The (task, example) pairs a family row's `examples` names (format_examples' inverse)."""
    pairs = set()
    for part in text.split(";"):
        task, sep, words = part.strip().partition(":")
        if not sep or not task:
            raise ValueError(f"an example set is 'task:ID ...; task:...', not {part.strip()!r}")
        for word in words.split():
            stretch = re.fullmatch(r"(.*-)(\d+)\.\.(\d+)", word)
            ids = [f"{stretch[1]}{i}" for i in range(int(stretch[2]), int(stretch[3]) + 1)] if stretch else [word]
            pairs.update((task, i) for i in ids)
    return pairs


def _typed(frame: pd.DataFrame) -> pd.DataFrame:
    """Family or results columns as the code compares them: length an integer (NA for a multi-turn run of fixed
    texts), ratio a float, the settings text ("" where a row has none, or a file predates them)."""
    frame = frame.assign(**{c: frame[c].fillna("").astype(str) if c in frame else "" for c in SETTINGS})
    return frame.astype({"length": "Int64", "ratio": float})


def read_family(path) -> pd.DataFrame:
    """The family file, its columns checked and typed (_typed)."""
    family = pd.read_csv(path, dtype={"examples": str, "evidence": str, "setting": str, "baseline_setting": str})
    missing = [c for c in COLUMNS if c not in family.columns and c not in SETTINGS]
    if missing:
        raise ValueError(f"{path} lacks the family's columns {missing}: it has {list(family.columns)}")
    return _typed(family)[COLUMNS]


def comparisons(table: pd.DataFrame, baseline: str = "SnapKV") -> pd.DataFrame:
    """The comparisons a run's table holds against `baseline`: every other compressor at every ratio and mode where
    the baseline ran too (the full cache is no comparison: it has no ratio). Columns: policy, ratio, mode."""
    if _budget(table) != "ratio":
        raise ValueError("the family compares runs at compression ratios; this table's budgets are capacities")
    runs = table.loc[table["mode"] != "full", ["policy", "ratio", "mode"]].drop_duplicates()
    at = runs.loc[runs.policy == baseline, ["ratio", "mode"]]
    if at.empty:
        raise ValueError(f"the table has no rows of the baseline {baseline!r}: its policies are "
                         f"{sorted(set(runs.policy))}")
    return runs[runs.policy != baseline].merge(at, on=["ratio", "mode"]).reset_index(drop=True)


def rows_for(data_dir, table: str, baseline: str | None = "SnapKV", evidence: str = PRIMARY) -> pd.DataFrame:
    """The family rows of one committed run (`table`, relative to data_dir): every comparison it holds against
    `baseline`, with its model, dataset, length and example set: how a run's rows are written into the family. A
    multi-turn run's comparisons are each policy against itself at another turn or setting (turn_comparisons), so
    its `baseline` must be None; any other run's must be a policy."""
    from .run import read_results

    results = read_results(Path(data_dir) / table)
    if "length" not in results.columns:
        raise ValueError(f"{table} has no length column: the family holds runs of generated sets (RULER), one length "
                         f"each")
    multi_turn = is_multi_turn(results)
    if multi_turn != (baseline is None):
        raise ValueError(f"{table} is {'' if multi_turn else 'not '}a multi-turn run: its baseline is "
                         f"{'None (each policy against itself)' if multi_turn else 'a policy'}, not {baseline!r}")
    design = {c: results[c].dropna().unique() for c in ("model", "dataset", "length")}
    for column, values in design.items():
        if len(values) != 1 and not (column == "length" and multi_turn and len(values) == 0):
            raise ValueError(f"{table} holds {len(values)} values of {column} ({list(values)}): a family row is one "
                             f"model, dataset and length; split the table")
    held = (turn_comparisons(results).drop(columns="kind") if multi_turn
            else comparisons(results, baseline).assign(baseline=baseline, setting="", baseline_setting=""))
    length = int(design["length"][0]) if len(design["length"]) else pd.NA
    return _typed(held.assign(model=design["model"][0], dataset=design["dataset"][0], length=length, table=table,
                              evidence=evidence, examples=format_examples(results)))[COLUMNS]


def holm_size(family: pd.DataFrame) -> int:
    """How many comparisons Holm adjusts over (family_results): the family's primary rows, every baseline's and the
    multi-turn runs' (each policy against itself) alike. family: the family file's rows (read_family)."""
    return int((family.evidence == PRIMARY).sum())


def _refuse(condition: bool, message: str) -> None:
    if condition:
        raise ValueError(message)


def _check_run(rows: pd.DataFrame, data_dir, table: str, baseline: str | None) -> None:
    """Refuses (ValueError) family rows of one run that do not say what its table holds now (rows_for): its model,
    dataset, length, examples, or its comparisons against `baseline` (None: a multi-turn run's, each policy against
    itself)."""
    wanted = rows_for(data_dir, table, baseline)
    for column in ("model", "dataset", "length", "examples"):
        said = {"" if pd.isna(value) else str(value) for value in rows[column]}  # a multi-turn run's length: NA
        held = wanted[column].iloc[0]
        _refuse(said != {"" if pd.isna(held) else str(held)},
                f"{table} holds {column} {wanted[column].iloc[0]!r} where its family rows say {set(rows[column])}: "
                f"a run that changed is declared again (evaluation.family.rows_for)")
    key = ["policy", "ratio", "mode", *SETTINGS]
    have, held = set(map(tuple, rows[key].values)), set(map(tuple, wanted[key].values))
    _refuse(have != held, f"{table}'s comparisons against {baseline or 'themselves'} and its family rows differ: "
                          f"in the table only "
                          f"{sorted(held - have)}, in the family only {sorted(have - held)}")


def check_family(family: pd.DataFrame, data_dir) -> None:
    """Refuses (ValueError) a family that does not say what its tables hold or counts examples twice: a row named
    twice; a table whose comparisons, model, dataset, length or examples are not those of its rows (rows_for); an
    evidence that is neither "primary" nor "same examples as TABLE"; two primary rows of one comparison whose runs
    share an example; a non-primary row whose TABLE is not that comparison's primary or shares no example with it."""
    named = family.duplicated(NAMED, keep=False)
    _refuse(named.any(), f"the family names these comparisons twice:\n{family[named]}")
    for table, rows in family.groupby("table", sort=False):
        if rows.setting.eq("").all():  # a run's policies against its baseline(s)
            for baseline, part in rows.groupby("baseline", sort=False):
                _check_run(part, data_dir, table, baseline)
        else:  # a multi-turn run: each policy against itself, every comparison read from the table (rows_for)
            _check_run(rows, data_dir, table, None)
    bad = ~(family.evidence.eq(PRIMARY) | family.evidence.str.startswith(SAME))
    _refuse(bad.any(), f"evidence is {PRIMARY!r} or '{SAME}TABLE', not {sorted(set(family.evidence[bad]))}")
    examples = {table: parse_examples(text) for table, text in zip(family.table, family.examples)}
    primary = family[family.evidence == PRIMARY]
    for comparison, rows in primary.groupby(COMPARISON, sort=False, dropna=False):
        tables = list(rows.table)
        for i, first in enumerate(tables):
            for second in tables[i + 1:]:
                shared = sorted(examples[first] & examples[second])
                _refuse(bool(shared), f"{first} and {second} both count as primary evidence for {comparison} but "
                                      f"share {len(shared)} examples (e.g. {shared[:1]}): mark one "
                                      f"'{SAME}<the other>'")
    primaries = {(*key, table) for key, table in zip(map(tuple, primary[COMPARISON].values), primary.table)}
    for row in family[family.evidence != PRIMARY].itertuples(index=False):
        other = row.evidence.removeprefix(SAME)
        key = tuple(getattr(row, c) for c in COMPARISON)
        _refuse((*key, other) not in primaries,
                f"{row.table}'s {key} names {other!r}, which does not hold that comparison as primary evidence")
        _refuse(not examples[row.table] & examples[other],
                f"{row.table} shares no example with {other}: its {key} is separate evidence, mark it {PRIMARY!r}")


def _table_results(data_dir: Path, table: str, baseline: str, n_boot: int, seed: int,
                   n_resamples: int) -> pd.DataFrame:
    """Every comparison of one run against `baseline`, read the three ways (module docstring), with the full
    cache's score on the same examples (the answered examples' is 100 by definition, or NaN where there are none)."""
    from .run import read_results

    results = read_results(data_dir / table)
    key = ["policy", "ratio", "mode"]
    options = dict(baseline=baseline, n_boot=n_boot, seed=seed, n_perm=n_resamples)
    full = example_scores(results[results["mode"] == "full"]).drop_duplicates(["task", "example"])
    examples = answered_examples(results)
    answered = results.merge(examples, on=list(examples.columns))
    parts = [paired_difference(answered, average="examples", **options).assign(analysis="answered", full_cache=100.0)
             if len(answered) else pd.DataFrame(columns=key),
             paired_difference(results, **options).assign(
                 analysis="task mean", full_cache=full.groupby("task").score.mean().mean())]
    for task, rows in results.groupby("task", sort=False) if results.task.nunique() > 1 else ():
        parts.append(paired_difference(rows, **options).assign(
            analysis="task", task=task, full_cache=full.loc[full.task == task, "score"].mean()))
    out = pd.concat([p for p in parts if len(p)], ignore_index=True)
    # a comparison with no answered example still has its answered row: no difference, nothing to reject
    nothing = comparisons(results, baseline).merge(out.loc[out.analysis == "answered", key], how="left", indicator=True)
    nothing = nothing[nothing._merge == "left_only"].drop(columns="_merge")
    empty = nothing.assign(baseline=baseline, analysis="answered", examples=0, nonzero=0, tasks=0, p=1.0,
                           p_method="no examples")
    return pd.concat([out, empty], ignore_index=True).assign(table=table, setting="", baseline_setting="")


def _turn_results(data_dir: Path, table: str, n_boot: int, seed: int, n_resamples: int) -> pd.DataFrame:
    """Every comparison of a multi-turn run (turns.turn_comparisons): its two settings paired by example, read on the
    examples the full cache answers (every turn under every feed) and on all of them ("task mean": the run has one
    task), with the full cache's score at the policy side's feed and turn on the same examples."""
    from .run import read_results

    results = read_results(data_dir / table)
    examples = answered_examples(results)
    answered = results.merge(examples, on=list(examples.columns))
    options = dict(baseline=BASE, n_boot=n_boot, seed=seed, n_perm=n_resamples, average="examples")
    parts = []
    for comparison in turn_comparisons(results).itertuples(index=False):
        said = dict(policy=comparison.policy, baseline=comparison.baseline, setting=comparison.setting,
                    baseline_setting=comparison.baseline_setting)
        turn = parse_setting(comparison.setting)
        full = results[(results["mode"] == "full") & (results.feed == turn["feed"]) & (results.turn == turn["turn"])]
        for analysis, rows in (("answered", answered), ("task mean", results)):
            paired = paired_difference(sides(rows, comparison), **options) if len(rows) else pd.DataFrame()
            if paired.empty:
                parts.append(pd.DataFrame([dict(said, ratio=comparison.ratio, mode=comparison.mode, examples=0,
                                                 nonzero=0, tasks=0, p=1.0, p_method="no examples",
                                                 analysis=analysis)]))
                continue
            score = 100.0 if analysis == "answered" else 100 * full.score.mean()
            parts.append(paired.assign(analysis=analysis, full_cache=score, **said))
    return pd.concat(parts, ignore_index=True).assign(table=table)


RESULT_COLUMNS = ["model", "dataset", "length", "table", "policy", "baseline", "ratio", "mode", *SETTINGS, "evidence",
                  "analysis", "task", "tasks", "examples", "nonzero", "full_cache", "difference", "low", "high",
                  "p", "p_method", "p_holm", "separated"]


def family_results(data_dir="data", family=None, n_boot: int = 2000, seed: int = 0,
                   n_resamples: int = N_RESAMPLES) -> pd.DataFrame:
    """The family's comparisons read from the committed tables (check_family first): per family row, its
    "answered", "task mean" and per-"task" rows (module docstring) with the difference (points, policy less
    baseline), its 95% bootstrap interval, the examples, the nonzero differences the sign flip enumerates or draws
    from, the full cache's score on the same examples, p and p_method; p_holm (Holm over the family's primary rows,
    answered and task-mean analyses each on their own) and `separated` (p_holm < 0.05) on primary rows only.
    family: a DataFrame of the family file's columns, or None for data_dir's comparison_family.csv."""
    data_dir = Path(data_dir)
    family = read_family(data_dir / FAMILY) if family is None else family
    check_family(family, data_dir)
    parts = []
    for table, rows in family.groupby("table", sort=False):
        if rows.setting.ne("").any():
            parts.append(_turn_results(data_dir, table, n_boot, seed, n_resamples))
        else:
            parts += [_table_results(data_dir, table, baseline, n_boot, seed, n_resamples)
                      for baseline in rows.baseline.unique()]
    per_table = pd.concat(parts, ignore_index=True)
    out = family.drop(columns="examples").merge(per_table.drop(columns=["dataset", "length"]), on=NAMED, how="left")
    out = out.assign(p_holm=np.nan)
    for analysis in ("answered", "task mean"):
        rows = (out.analysis == analysis) & (out.evidence == PRIMARY)
        out.loc[rows, "p_holm"] = holm(out.loc[rows, "p"].to_numpy(dtype=float))
    out["separated"] = out.p_holm.lt(ALPHA).where(out.p_holm.notna())
    order = {name: i for i, name in enumerate(ANALYSES)}
    out = out.assign(_row=out.groupby(NAMED, sort=False).ngroup(),
                     _analysis=out.analysis.map(order))
    # a family of one-task runs alone has no per-task rows: its task column is empty
    return out.sort_values(["_row", "_analysis"], kind="stable").reindex(columns=RESULT_COLUMNS).reset_index(drop=True)


def write_results(data_dir="data", **options) -> Path:
    """Recompute the family's results from the committed tables and write them beside them (RESULTS), the file
    the docs' tables read their adjusted p from. A minute or two: exact sign flips of up to 2^20 patterns, and
    100,000 drawn ones past that where the differences have several sizes."""
    path = Path(data_dir) / RESULTS
    family_results(data_dir, **options).to_csv(path, index=False, float_format="%.6g")
    return path


def read_family_results(data_dir="data") -> pd.DataFrame:
    """The committed family results (write_results), typed as family_results returns them."""
    results = pd.read_csv(Path(data_dir) / RESULTS, dtype={"task": str, "p_method": str, "evidence": str,
                                                           "setting": str, "baseline_setting": str})
    return _typed(results)


class Adjustment(NamedTuple):
    """The family's adjusted p for one run's comparisons, as a figure of that run marks them (run_adjustment).

    p_holm: policy, ratio, mode, `p_holm` (the mean over tasks, the leaderboard's statistic) and `p_holm_answered`
    (the examples the full cache answers), each Holm over the family's primary rows; no rows where the family does
    not count this run. says: whose adjustment it is, or why there is none, in words for a title."""

    p_holm: pd.DataFrame
    says: str


def run_adjustment(path, baseline: str = "SnapKV") -> Adjustment:
    """The family's adjustment of the run whose table is `path`: the family (FAMILY and RESULTS) is looked for in the
    table's folder and the folders above it, and names the table by its path relative to its own folder (data/'s
    family names gemma-3-270m/eval_ruler_4k_ratios.csv). Nothing is adjusted, and `says` tells why, where no family
    names the run, where the family counts its comparisons on another run (same examples), or where the table no
    longer holds what the family declared (a run grown or replaced since: declare it again, rows_for, and rewrite the
    results, write_results). A p adjusted over one run alone is never given: it would let a comparison pass in a
    small family that fails in the whole one."""
    path = Path(path).resolve()
    empty = pd.DataFrame(columns=["policy", "ratio", "mode", "p_holm", "p_holm_answered"])
    folder = next((f for f in path.parents if (f / FAMILY).exists() and (f / RESULTS).exists()), None)
    if folder is None:
        return Adjustment(empty, f"no family of comparisons ({FAMILY} with {RESULTS}) beside or above "
                                 f"{path.name}: no adjusted p")
    table = path.relative_to(folder).as_posix()
    family = read_family(folder / FAMILY)
    rows = family[(family.table == table) & (family.baseline == baseline) & (family.setting == "")]
    if rows.empty:
        return Adjustment(empty, f"not in the family of comparisons ({folder.name}/{FAMILY}): no adjusted p")
    try:
        _check_run(rows, folder, table, baseline)
    except ValueError:
        return Adjustment(empty, f"the table is no longer the run {folder.name}/{FAMILY} declares: no adjusted p "
                                 f"until it is declared again and the results rewritten")
    evidence = rows.evidence.iloc[0]
    if evidence != PRIMARY:
        return Adjustment(empty, f"its comparisons are counted on {evidence.removeprefix(SAME)} (same examples): "
                                 f"no adjusted p here")
    results = read_family_results(folder)
    results = results[(results.table == table) & (results.baseline == baseline) & (results.evidence == PRIMARY)]
    key = ["policy", "ratio", "mode"]
    means, answered = (results.loc[results.analysis == a, [*key, "p_holm"]] for a in ("task mean", "answered"))
    adjusted = means.merge(answered.rename(columns={"p_holm": "p_holm_answered"}), on=key, how="outer")
    return Adjustment(adjusted.reset_index(drop=True),
                      f"Holm over the family's {holm_size(family)} primary comparisons ({folder.name}/{FAMILY})")
