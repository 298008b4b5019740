"""Reading a multi-turn run (evaluation.multiturn): scores by turn, and the three contrasts docs/multi-turn.md asks.

    comparisons = turn_comparisons(table)     # the family's rows of the run (evaluation.family)
    scores, pairs, ranks = turn_scores(table), contrasts(table), turn_rank(table)

A multi-turn table has one row per (example, policy, ratio, mode, feed, compress, turn); a `setting` names one
feed, compress option and turn ("feed=gold compress=once turn=3"). Each comparison pairs two settings of one policy
at one ratio and mode, by example (one score per example and setting: 0 or 100 on the generated suite), at the last
turn T (every example has T turns):

- "turn": turn T against turn 1, under each feed and compress option: does the cache lose what later questions ask?
- "compress": every-turn against once, at turn T, under each feed (the policies compress_again takes);
- "feed": the model's own answers against the gold ones in the cache, at turn T, under each compress option.

A difference is the policy side's score less the baseline side's (points), over examples: mean, t 95% interval
(core.ratio_intervals) and the exact sign-flip p (summary.sign_flip_test), on every example and on the examples the
full cache answers (summary.answered_examples: every turn under every feed). `turn_rank` asks whether a policy's
turn-1 score predicts its turn-T score: Spearman's rho over the policies of one mode, feed and compress option, and
its exact permutation p (scipy.stats.permutation_test over every pairing).

The figure set `multi-turn` is registered here: score by turn per policy, one panel per feed x compress option
(`snapkv-lab figures --only multi-turn`; `--recompute` reruns the eval, long).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from ..core.figure_files import FigureSet, register, write_png
from ..core.ratio_intervals import interval_text, mean_t_interval
from .summary import answered_examples, example_scores, sign_flip_test

TABLE = "eval_scbench_multiturn.csv"
BALANCED_TABLE = "eval_scbench_multiturn_balanced.csv"  # the same haystacks, the needles asked in the balanced order
KINDS = ("turn", "compress", "feed")
SUBSETS = ("answered", "all")
SUITES = "~/.cache/snapkv_lab/scbench_turns"  # the generated suites' folders (the essays are never committed)
# The runs docs/multi-turn.md reports, by table: the suite each reads (tasks.turn_needles; its folder under SUITES,
# written by `recompute` where missing, as scripts/scbench_turns.py writes it) and its eval options.
RUN = dict(datasets=["scbench"], tasks=["scbench_qa_eng"], multi_turn=True, ratios=[0.5],
           policies=["SnapKV", "StreamingLLM", "H2O", "KVzip", "AdaKV(SnapKV)"])
RUNS = {TABLE: dict(folder="essays-500", suite=dict(words=500, order="shuffled"), limit=8, name="scbench_multiturn"),
        BALANCED_TABLE: dict(folder="essays-500-balanced", suite=dict(words=500, order="balanced"), limit=6,
                             name="scbench_multiturn_balanced")}
SUITE_ROWS = 12


def setting(feed: str, compress: str, turn: int) -> str:
    """One feed, compress option and turn as a family row writes it (parse_setting reads it back)."""
    return f"feed={feed} compress={compress} turn={int(turn)}"


def parse_setting(text: str) -> dict:
    """{"feed", "compress", "turn"} of a setting (setting's inverse)."""
    parts = dict(part.split("=", 1) for part in text.split() if "=" in part)
    if set(parts) != {"feed", "compress", "turn"} or not parts["turn"].isdigit():
        raise ValueError(f"a setting is 'feed=F compress=C turn=T', not {text!r}")
    return dict(parts, turn=int(parts["turn"]))


def is_multi_turn(table: pd.DataFrame) -> bool:
    return "turn" in table.columns


def last_turn(table: pd.DataFrame) -> int:
    """T, the turns every example has; refused where examples have different numbers of turns (no common last turn
    to pair)."""
    turns = table.groupby(["task", "example"]).turn.max().unique()
    if len(turns) != 1:
        raise ValueError(f"the examples have {sorted(turns)} turns: the contrasts pair every example at one last turn")
    return int(turns[0])


def turn_comparisons(table: pd.DataFrame) -> pd.DataFrame:
    """The run's comparisons (module doc): kind, policy, baseline (the same policy), ratio, mode, setting (the policy
    side) and baseline_setting, in the order turn, compress, feed. The full cache is no comparison (it has no ratio):
    its scores by turn are read beside them."""
    last = last_turn(table)
    runs = table.loc[table["mode"] != "full", ["policy", "ratio", "mode", "feed", "compress"]].drop_duplicates()
    rows = []
    for r in runs.itertuples(index=False):
        rows.append(("turn", r.policy, r.ratio, r.mode, setting(r.feed, r.compress, last),
                     setting(r.feed, r.compress, 1)))
    held = set(map(tuple, runs.values))
    for r in runs.itertuples(index=False):
        if r.compress == "every-turn" and (r.policy, r.ratio, r.mode, r.feed, "once") in held:
            rows.append(("compress", r.policy, r.ratio, r.mode, setting(r.feed, "every-turn", last),
                         setting(r.feed, "once", last)))
    for r in runs.itertuples(index=False):
        if r.feed == "model" and (r.policy, r.ratio, r.mode, "gold", r.compress) in held:
            rows.append(("feed", r.policy, r.ratio, r.mode, setting("model", r.compress, last),
                         setting("gold", r.compress, last)))
    out = pd.DataFrame(rows, columns=["kind", "policy", "ratio", "mode", "setting", "baseline_setting"])
    return out.assign(baseline=out.policy)


def _at(table: pd.DataFrame, policy: str, ratio: float, mode: str, text: str) -> pd.DataFrame:
    """The rows of one policy at one setting."""
    s = parse_setting(text)
    rows = table[(table.policy == policy) & np.isclose(table.ratio.astype(float), ratio) & (table["mode"] == mode)
                 & (table.feed == s["feed"]) & (table.compress == s["compress"]) & (table.turn == s["turn"])]
    if rows.empty:
        raise ValueError(f"the table has no rows of {policy} at ratio {ratio:g}, {mode}, {text}")
    return rows


SIDE, BASE = "policy side", "baseline side"


def sides(table: pd.DataFrame, comparison) -> pd.DataFrame:
    """One comparison's rows (a turn_comparisons row: policy, baseline, ratio, mode, setting, baseline_setting) as a
    two-policy table, the policy side relabelled SIDE and the baseline's BASE, so that summary's pairing by example
    (paired_difference, example_scores) reads them as two policies at one budget and mode."""
    return pd.concat([_at(table, comparison.policy, comparison.ratio, comparison.mode, comparison.setting)
                      .assign(policy=SIDE),
                      _at(table, comparison.baseline, comparison.ratio, comparison.mode, comparison.baseline_setting)
                      .assign(policy=BASE)], ignore_index=True)


def _paired_scores(table: pd.DataFrame, comparison) -> pd.DataFrame:
    """Per example: task, example, side (the policy side's score, 0-100) and base (the baseline side's)."""
    scores = example_scores(sides(table, comparison))
    wide = scores.pivot_table(index=["task", "example"], columns="policy", values="score")
    return wide.rename(columns={SIDE: "side", BASE: "base"}).dropna().reset_index()


def contrasts(table: pd.DataFrame) -> pd.DataFrame:
    """Per subset ("answered", "all") and comparison (turn_comparisons): n examples, the two sides' mean scores,
    difference (side less baseline, points) with its t 95% interval, the exact sign-flip p, the nonzero differences,
    and each side's mean kv_entries and kv_share at its turn's prompt (kv_entries, kv_share; baseline_kv_entries,
    baseline_kv_share): compressing every turn holds fewer entries at a later turn than appending does."""
    answered = answered_examples(table)
    keep = set(zip(answered.task, answered.example))
    rows = []
    for comparison in turn_comparisons(table).itertuples(index=False):
        paired = _paired_scores(table, comparison)
        held = _at(table, comparison.policy, comparison.ratio, comparison.mode, comparison.setting)
        other = _at(table, comparison.baseline, comparison.ratio, comparison.mode, comparison.baseline_setting)
        for subset in SUBSETS:
            part = paired if subset == "all" else paired[[pair in keep for pair in zip(paired.task, paired.example)]]
            n = len(part)
            base = dict(subset=subset, **comparison._asdict(), n=n, kv_entries=held.kv_entries.mean(),
                        kv_share=held.kv_share.mean(), baseline_kv_entries=other.kv_entries.mean(),
                        baseline_kv_share=other.kv_share.mean())
            if n == 0:
                rows.append(dict(base, p=1.0, p_method="no examples", nonzero=0))
                continue
            difference = (part.side - part.base).to_numpy(dtype=float)
            mean, low, high = mean_t_interval(difference)
            p, method = sign_flip_test(difference, np.full(n, 1 / n))
            rows.append(dict(base, score=part.side.mean(), baseline_score=part.base.mean(), difference=mean,
                             low=low, high=high, p=p, p_method=method, nonzero=int(np.count_nonzero(difference))))
    return pd.DataFrame(rows)


def turn_scores(table: pd.DataFrame) -> pd.DataFrame:
    """Per policy (the full cache included, compress "none"), ratio, mode, feed, compress option and turn: n
    examples, the mean score (0-100) with its t 95% interval over examples, and the mean kv_entries and kv_share at
    that turn's prompt."""
    rows = []
    keys = ["policy", "ratio", "mode", "feed", "compress", "turn"]
    for key, part in table.groupby(keys, sort=False):
        per_example = part.groupby(["task", "example"]).score.mean().to_numpy(dtype=float) * 100
        mean, low, high = mean_t_interval(per_example)
        rows.append(dict(zip(keys, key), n=len(per_example), score=mean, low=low, high=high,
                         kv_entries=part.kv_entries.mean(), kv_share=part.kv_share.mean()))
    return pd.DataFrame(rows)


def answer_kinds(table: pd.DataFrame) -> pd.DataFrame:
    """What the answers hold, per policy, mode, feed, compress option and turn (shares of its examples, 0-100):
    `right` (scored right), `other_needle` (not right, but holding another turn's reference: the suite's needles
    are asked one per turn, so a later turn can answer an earlier or later question's value) and `no_number` (no
    run of 7 digits, the suite's values: a first answer that talks past SCBench's 40 tokens)."""
    references = table.groupby(["task", "example", "turn"]).references.first().map(json.loads)
    rows = []
    keys = ["policy", "mode", "feed", "compress", "turn"]
    for key, part in table.groupby(keys, sort=False):
        other = [not score and any(value in prediction for t, values in references.loc[(task, example)].items()
                                   if t != turn for value in values)
                 for task, example, turn, score, prediction in zip(part.task, part.example, part.turn, part.score,
                                                                   part.prediction)]
        rows.append(dict(zip(keys, key), n=len(part), right=100 * part.score.mean(), other_needle=100 * np.mean(other),
                         no_number=100 * (~part.prediction.str.contains(r"\d{7}")).mean()))
    return pd.DataFrame(rows)


def _spearman_p(first: np.ndarray, last: np.ndarray) -> tuple[float, float]:
    """Spearman's rho of two (policies,) score vectors and its two-sided p over every pairing (exact: n! of them)."""
    from scipy.stats import pearsonr, permutation_test, rankdata, spearmanr

    if len(first) < 3 or np.ptp(first) == 0 or np.ptp(last) == 0:  # no ranking to predict, or none to find
        return float("nan"), float("nan")
    rho = spearmanr(first, last).statistic
    # Spearman's rho is Pearson's r of the (average-tie) ranks, and re-pairing the values re-pairs their ranks: the
    # ranks are taken once and every pairing's r computed in one vectorized call (spearmanr per pairing took minutes).
    result = permutation_test((rankdata(first), rankdata(last)), lambda x, y, axis: pearsonr(x, y, axis=axis).statistic,
                              permutation_type="pairings", n_resamples=np.inf, alternative="two-sided", vectorized=True)
    return float(rho), float(result.pvalue)


def turn_rank(table: pd.DataFrame) -> pd.DataFrame:
    """Per mode, feed and compress option: does a policy's turn-1 score predict its turn-T score? policies (n), their
    scores at turn 1 and T (JSON-free: "policy a -> b; ..."), Spearman's rho and its exact permutation p (NaN under
    3 policies or where either turn's scores are all equal)."""
    last = last_turn(table)
    scores = turn_scores(table[table["mode"] != "full"])
    rows = []
    for (mode, feed, compress), part in scores.groupby(["mode", "feed", "compress"], sort=False):
        wide = part.pivot_table(index="policy", columns="turn", values="score")[[1, last]].dropna()
        rho, p = _spearman_p(wide[1].to_numpy(), wide[last].to_numpy())
        shown = "; ".join(f"{policy} {row[1]:.0f} -> {row[last]:.0f}" for policy, row in wide.iterrows())
        rows.append(dict(mode=mode, feed=feed, compress=compress, policies=len(wide), scores=shown, rho=rho, p=p))
    return pd.DataFrame(rows)


def _cell(row) -> str:
    """A difference as the page prints it: mean [t 95%], exact sign-flip p (~ drawn), nonzero of n."""
    if row.n == 0:
        return "no example"
    interval = "" if np.isnan(row.low) else f" [{row.low:+.0f}, {row.high:+.0f}]"
    drawn = "" if row.p_method == "exact" else "~"
    return f"{row.difference:+.0f}{interval}, p {drawn}{row.p:.2g} ({row.nonzero} of {row.n})"


def report(table: pd.DataFrame) -> str:
    """Markdown for docs/multi-turn.md: the run's size and the full cache's answered examples; the score by turn
    per run (mean over examples [t 95%], KV entries and share at the prompt); the three contrasts on every example
    and on the answered ones (unadjusted p: the family adjusts them); Spearman's rho of turn 1 against turn T."""
    last = last_turn(table)
    scores, pairs, ranks = turn_scores(table), contrasts(table), turn_rank(table)
    n = table.groupby(["task", "example"]).ngroups
    answered = len(answered_examples(table))
    ratio = table.loc[table["mode"] != "full", "ratio"].astype(float).unique()
    lines = [f"{n} examples of {last} turns, ratio {', '.join(f'{r:g}' for r in ratio)}, {table.model.iloc[0]}; the "
             f"full cache answers every turn under both feeds on {answered} of them (\"answered\").", "",
             "Score by turn (0-100, mean over examples [t 95%]), and the KV entries held at the turn's prompt (summed "
             "over layers and KV heads; share of the uncompressed cache's):", "",
             "| policy | mode | feed | compress | " + " | ".join(f"turn {t}" for t in range(1, last + 1))
             + " | KV entries (share), turn 1 -> last |", "|---|---|---|---|" + "---:|" * last + "---|"]
    for key, part in scores.groupby(["policy", "mode", "feed", "compress"], sort=False):
        part = part.set_index("turn")
        cells = [interval_text(r.score, r.low, r.high) for r in part.reindex(range(1, last + 1)).itertuples()]
        first, end = part.loc[1], part.loc[last]
        held = f"{first.kv_entries:,.0f} ({first.kv_share:.2f}) -> {end.kv_entries:,.0f} ({end.kv_share:.2f})"
        lines.append(f"| {key[0]} | {key[1].removeprefix('query-')} | {key[2]} | {key[3]} | " + " | ".join(cells)
                     + f" | {held} |")
    kinds = answer_kinds(table).assign(run=lambda k: np.where(k.policy == "FullCache", "full cache", "compressed"))
    lines += ["", "What the answers hold (share of answers, percent; compressed: the mean over every compressed run "
                  "of the feed): right; another turn's needle value instead; no 7-digit number at all:", "",
              "| feed | cache | " + " | ".join(f"turn {t}: right / other needle / none" for t in range(1, last + 1))
              + " |", "|---|---|" + "---|" * last]
    for (feed, run), part in kinds.groupby(["feed", "run"], sort=False):
        means = part.groupby("turn")[["right", "other_needle", "no_number"]].mean()
        lines.append(f"| {feed} | {run} | " + " | ".join(f"{r.right:.0f} / {r.other_needle:.0f} / {r.no_number:.0f}"
                                                          for r in means.itertuples()) + " |")
    titles = {"turn": f"turn {last} less turn 1", "compress": f"every-turn less once, at turn {last}",
              "feed": f"model feed less gold feed, at turn {last}"}
    for kind in KINDS:
        part = pairs[pairs.kind == kind]
        if part.empty:
            continue
        lines += ["", f"**{titles[kind]}** (points, per example: mean [t 95%], exact sign-flip p unadjusted, "
                      "nonzero differences of n; the KV entries each side holds at its prompt, share of the "
                      "uncompressed cache's):", "",
                  "| policy | mode | " + ("feed | compress" if kind == "turn" else "feed" if kind == "compress"
                                          else "compress") + " | KV entries (share): side vs baseline | all examples "
                                                             "| answered |",
                  "|---|---|" + ("---|---|" if kind == "turn" else "---|") + "---|---|---|"]
        for _, group in part.groupby(["policy", "mode", "setting"], sort=False):
            row = {s: r for s, r in zip(group.subset, group.itertuples())}
            s = parse_setting(row["all"].setting)
            said = (f"{s['feed']} | {s['compress']}" if kind == "turn" else s["feed"] if kind == "compress"
                    else s["compress"])
            r = row["all"]
            held = (f"{r.kv_entries:,.0f} ({r.kv_share:.2f}) vs {r.baseline_kv_entries:,.0f} "
                    f"({r.baseline_kv_share:.2f})")
            lines.append(f"| {r.policy} | {r.mode.removeprefix('query-')} | {said} | {held} | {_cell(r)} | "
                         f"{_cell(row['answered'])} |")
    lines += ["", f"Does a policy's turn-1 score predict its turn-{last} score? Spearman's rho over the policies "
                  "(all examples) and its exact permutation p (every pairing; none under 3 policies):", "",
              "| mode | feed | compress | policies | turn 1 -> last | rho | p |", "|---|---|---|---:|---|---:|---:|"]
    for r in ranks.itertuples():
        rho = "-" if np.isnan(r.rho) else f"{r.rho:+.2f}"
        p = "-" if np.isnan(r.p) else f"{r.p:.2g}"
        lines.append(f"| {r.mode.removeprefix('query-')} | {r.feed} | {r.compress} | {r.policies} | {r.scores} | "
                     f"{rho} | {p} |")
    return "\n".join(lines)


def depth_scores(table: pd.DataFrame) -> pd.DataFrame:
    """The full cache's score by turn and by the depth band the turn asked, per feed, on a run of the balanced suite
    (tasks.turn_needles.balanced_order: example i asks band balanced_order(i, T)[t - 1] at turn t; band 0 nearest the
    start): n examples, the mean score (0-100) and its t 95% interval over them."""
    from ..tasks.turn_needles import balanced_order

    full = table[table.policy == "FullCache"]
    last = last_turn(table)
    band = [balanced_order(int(e), last)[int(t) - 1] for e, t in zip(full.example, full.turn)]
    rows = []
    for (feed, turn, depth), part in full.assign(band=band).groupby(["feed", "turn", "band"]):
        mean, low, high = mean_t_interval(part.groupby(["task", "example"]).score.mean().to_numpy(float) * 100)
        rows.append(dict(feed=feed, turn=int(turn), band=int(depth), n=part.example.nunique(), score=mean, low=low,
                         high=high))
    return pd.DataFrame(rows)


def depth_report(table: pd.DataFrame) -> str:
    """Markdown: depth_scores as one table per feed, turns across, bands down."""
    scores = depth_scores(table)
    last = last_turn(table)
    lines = ["The full cache's score by the depth band each turn asked (band 0 nearest the start of the haystack; "
             "mean over the examples that asked it [t 95%], n):", "",
             "| feed | band | " + " | ".join(f"turn {t}" for t in range(1, last + 1)) + " |",
             "|---|---:|" + "---|" * last]
    for (feed, band), part in scores.groupby(["feed", "band"]):
        part = part.set_index("turn").reindex(range(1, last + 1))
        cells = ["-" if np.isnan(r.n) else f"{interval_text(r.score, r.low, r.high)} (n {r.n:.0f})"
                 for r in part.itertuples()]
        lines.append(f"| {feed} | {band} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def recompute(options: dict) -> None:
    """Rerun the runs the docs report (RUNS), each on its generated suite (written first where its folder lacks it),
    resuming from their cells, into options' data_dir."""
    from ..tasks.turn_needles import turn_needle_rows, write_suite
    from .run import evaluate

    for run in RUNS.values():
        folder = Path(SUITES).expanduser() / run["folder"]
        if not (folder / "scbench_qa_eng.jsonl").is_file():
            write_suite(folder, turn_needle_rows(SUITE_ROWS, **run["suite"]))
        evaluate(options.get("model"), source=str(folder), data_dir=options.get("data_dir", "data"),
                 limit=run["limit"], name=run["name"], **RUN)


def draw(data_dir, figures_dir) -> list[Path]:
    """multiturn_turns.png (the seeded-order run) and multiturn_turns_balanced.png (the balanced one), each where its
    table is: score by turn (mean over examples), one line per policy and mode (query-aware solid, query-agnostic
    dashed; the full cache dotted black), one panel per feed x compress option. Each line is shifted a little along
    the turn axis, so that lines of equal scores stay visible side by side."""
    from .run import read_results

    drawn = []
    for name, out in ((TABLE, "multiturn_turns.png"), (BALANCED_TABLE, "multiturn_turns_balanced.png")):
        if (Path(data_dir) / name).is_file():
            drawn.append(_draw(read_results(Path(data_dir) / name), Path(figures_dir) / out,
                               "balanced order" if name == BALANCED_TABLE else "seeded order"))
    return drawn


def _draw(table: pd.DataFrame, out: Path, order: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..views.palette import line_style

    scores = turn_scores(table)
    feeds = [f for f in ("gold", "model") if f in set(scores.feed)]
    options = [c for c in ("once", "every-turn") if c in set(scores.compress)]
    policies = [p for p in dict.fromkeys(scores.policy) if p != "FullCache"]
    figure, axes = plt.subplots(len(feeds), len(options), figsize=(5 * len(options), 3.8 * len(feeds)),
                                sharex=True, sharey=True, squeeze=False, layout="constrained")
    n = table.groupby(["task", "example"]).ngroups
    for row, feed in enumerate(feeds):
        for column, compress in enumerate(options):
            axis = axes[row][column]
            full = scores[(scores.policy == "FullCache") & (scores.feed == feed)]
            axis.plot(full.turn, full.score, color="black", ls=":", marker="o", label="full cache", zorder=3)
            lines = [(i, policy, mode, dash) for i, policy in enumerate(policies)
                     for mode, dash in (("query-aware", "-"), ("query-agnostic", "--"))]
            for j, (i, policy, mode, dash) in enumerate(lines):
                style = line_style(i)
                part = scores[(scores.policy == policy) & (scores["mode"] == mode) & (scores.feed == feed)
                              & (scores.compress == compress)]
                if len(part):
                    shift = 0.15 * (j / max(len(lines) - 1, 1) - 0.5)
                    axis.plot(part.turn + shift, part.score, color=style["color"], marker=style["marker"], ls=dash,
                              label=f"{policy}, {mode.removeprefix('query-')}")
            axis.set_title(f"feed {feed}, compress {compress}", fontsize=10)
            axis.set_ylim(-5, 105)
            axis.set_xticks(sorted(scores.turn.unique()))
            if row == len(feeds) - 1:
                axis.set_xlabel("turn")
            if column == 0:
                axis.set_ylabel("score (mean over examples)")
    handles = {}
    for axis in axes.flat:
        for handle, label in zip(*axis.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    figure.legend(list(handles.values()), list(handles), loc="outside right center", fontsize=7, frameon=False)
    ratio = table.loc[table["mode"] != "full", "ratio"].astype(float).iloc[0]
    figure.suptitle(f"SCBench multi-turn, generated suite ({order}): score by turn, n = {n} examples, ratio "
                    f"{ratio:g} ({table.model.iloc[0]})", fontsize=10)
    write_png(figure, out)
    plt.close(figure)
    return out


register(FigureSet(name="multi-turn", recompute=recompute, draw=draw, recompute_by_default=False))
