"""Verdicts on the paper's four findings, per split (dev, held-out, and both pooled) and mode, from the committed
tables.

Every value is pooled over layers and heads (sum of numerators / sum of supports) with a 95% t interval over prompts
or documents (`overlap.summarise`, `core.ratio_intervals`: a percentile bootstrap over 4-8 prompts undercovers); every
comparison is the paired t interval of a difference over the same prompts (`overlap.difference`), with its two-sided
t-test p. Each split is reported alone, then both pooled (their prompts are distinct, so pooling doubles n).

Baselines beside chance (`experiments.BASELINES`): recency (the last k prefix positions), a random earlier segment
(the paper's selection voted by an earlier segment of the voters' length) and the hindsight oracle (the best k
positions given the generation's own attention). A claim that the window predicts generation must beat the first two,
not only chance: any prompt segment reaches several times chance.

A finding *holds* only where its interval clears chance and the comparison the paper makes holds too:

(a) the last prompt segment (the observation window) is above chance and better than every other segment (each
    difference > 0);
(b) every segment of the generation is above chance, and the window's selection beats recency and a random earlier
    segment over all generated tokens (the decay from the first to the last segment is reported);
(c) both placements are above chance and the difference between them is *shown equivalent to 0*: inside
    +-EQUIVALENCE_MARGIN by TOST at level ALPHA (the 90% t interval inside the margin), not merely not rejected;
(d) the overlap between different questions' selections is below the overlap between two halves of one
    question's rows (selections depend on the question).
"No effect" claims ((b)'s window sizes, (c), the compressor "as consistent" as the paper's selection) are TOST
equivalence tests with the same margin; a failure to reject is "not shown", never "holds".

Two measures for (a)-(c): the paper's hit rate with sinks kept, and recall with sinks excluded (theta-free).

A model with sliding-window layers (Gemma 3: 512 tokens in 15 of 18 layers) gets its verdicts for the global and
the sliding layers apart: a sliding layer's generated tokens cannot attend to a prompt position more than a window
back, so what its observation window can predict is bounded by the window, not by the prompt.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from ..core.overlap import difference, summarise
from ..core.ratio_intervals import tost
from .legacy import read_table, upgrade_options

CI = 0.95
ALPHA = 0.05  # TOST's level: equivalence is shown where the (1 - 2 ALPHA) = 90% t interval lies inside the margin
# The equivalence margin of every "no effect" verdict, fixed on 2026-11-29 before the tables with t intervals and
# baselines were computed, from the measures' scale and not from any difference: 0.05 is one chance level, the share
# of attention (or of hits) that a random selection of the same size (top 5% of the prefix) captures. A difference
# smaller than what a random 5% selection holds in all is taken as no practical difference.
EQUIVALENCE_MARGIN = 0.05
MEASURES = {"paper's hit rate, sinks kept": ("hit_rate", "kept"), "recall, sinks excluded": ("recall", "excluded")}
CLAIMS = {"a": "(a) the last prompt segment agrees best", "b": "(b) consistent during generation",
          "b_windows": "(b) observation window size has no effect", "b_selection": "(b) the compressor's selection",
          "c": "(c) question position does not matter", "d": "(d) different questions select differently"}
SPLITS = {"dev": "dev", "heldout": "held-out", "both": "both pooled"}
QUESTION_FREE = ("recency", "random segment")  # the baselines a window must beat; the oracle bounds them all


def _fmt(value, low, high) -> str:
    return f"{value:.2f} [{low:.2f}, {high:.2f}]"


def _signed(value, low, high) -> str:
    """A difference with its interval, to 3 decimals where 2 would print a real difference as 0.00."""
    digits = 3 if max(abs(value), abs(low), abs(high)) < 0.01 else 2
    return f"{value:+.{digits}f} [{low:+.{digits}f}, {high:+.{digits}f}]"


def _p(p: float) -> str:
    return "p n/a" if np.isnan(p) else f"p {p:.2g}" if p >= 0.001 else "p < 0.001"


def _gap(row) -> str:
    """A paired difference: value [95% t interval], p."""
    return f"{_signed(row['difference'], row['ci_low'], row['ci_high'])}, {_p(row['p'])}"


def _clears(row, chance) -> bool:
    return bool(row["ci_low"] > chance)


class Undefined(ValueError):
    """A pooled value the verdict needs has too little support (metrics.MIN_SUPPORT)."""


def _pooled(table: pd.DataFrame, by) -> pd.DataFrame:
    s = summarise(table, by=by, ci=CI).set_index(list(by))
    if s["value"].isna().any():
        raise Undefined(f"undefined {', '.join(map(str, by))}: {s.index[s['value'].isna()].tolist()}")
    return s


def _paired(a: pd.DataFrame, b: pd.DataFrame) -> pd.Series:
    """The paired difference (pooled a) - (pooled b) over the prompts both hold: difference, ci_low, ci_high, se, p,
    n_samples (`overlap.difference`)."""
    both = pd.concat([a.assign(_side="a"), b.assign(_side="b")], ignore_index=True)
    return difference(both, ("_side", "a", "b"), by=("metric",), ci=CI).iloc[0]


def _equivalent(gap: pd.Series) -> tuple[bool, float]:
    """(shown equivalent to 0 within EQUIVALENCE_MARGIN at level ALPHA, TOST p) of a `_paired` difference."""
    p = float(tost(np.array([gap["difference"]]), np.array([gap["se"]]), np.array([gap["n_samples"]]),
                   EQUIVALENCE_MARGIN)[0])
    return bool(p < ALPHA), p


def _selection(part: pd.DataFrame, name: str) -> pd.DataFrame:
    """The rows of one selection ("paper": the window's; or a baseline); a table without a `selection` column (written
    before the baselines) holds the paper's selection alone."""
    if "selection" not in part:
        return part if name == "paper" else part.iloc[0:0]
    return part[part["selection"] == name]


def _baselines(window: pd.DataFrame, baselines: pd.DataFrame) -> tuple[str, str, list[str]]:
    """The window's rows against the baselines' rows (same prompts and keys): (the baselines' values, chance first;
    the window minus each question-free baseline and its share of the oracle; the question-free baselines the
    window does not beat). Empty texts where the table holds no baselines."""
    values = [f"chance {summarise(window, by=('metric',))['chance'].iloc[0]:.2f}"]
    gaps, not_beaten = [], []
    for name in (*QUESTION_FREE, "oracle"):
        rows = _selection(baselines, name)
        if rows.empty:
            continue
        value = summarise(rows, by=("metric",))["value"].iloc[0]
        values.append(f"{name} {value:.2f}")
        gap = _paired(window, rows)
        if np.isnan(gap["difference"]):
            continue
        if name == "oracle":
            gaps.append(f"{gap['value_a'] / gap['value_b']:.0%} of the oracle")
            continue
        gaps.append(f"window - {name} {_gap(gap)}")
        if not gap["ci_low"] > 0:
            not_beaten.append(name)
    return " · ".join(values), "; ".join(gaps), not_beaten


def _against(not_beaten: list[str]) -> str:
    return f"not above {' or '.join(not_beaten)}" if not_beaten else ""


def _a(part: pd.DataFrame, baselines: pd.DataFrame) -> tuple[str, float, str, str]:
    window_rows = _selection(part, "paper")
    s = _pooled(window_rows, ("segment",))
    last = s.loc[-1]
    others = [w for w in s.index if w != -1]
    gaps = pd.concat([difference(window_rows, ("segment", -1, w), by=("metric",)).assign(other=w) for w in others])
    best = s.loc[others, "value"].idxmax()
    closest = gaps.loc[gaps["other"] == best].iloc[0]
    values, versus, not_beaten = _baselines(window_rows[window_rows["segment"] == -1], baselines)
    text = (f"last {_fmt(last['value'], last['ci_low'], last['ci_high'])}; best other segment ({best}) "
            f"{s.loc[best, 'value']:.2f}; last - best other {_gap(closest)}" + (f"; {versus}" if versus else ""))
    if not _clears(last, last["chance"]):
        verdict = "does not hold: the last segment is not above chance"
    elif (gaps["ci_low"] > 0).all():
        verdict = "holds" + (f" among the segments, but {_against(not_beaten)}" if not_beaten else "")
    elif (gaps["ci_high"] < 0).any():
        better = sorted(gaps.loc[gaps["ci_high"] < 0, "other"])
        verdict = f"does not hold: segments {better} agree better"
    else:
        ties = len(gaps[gaps["ci_low"] <= 0])
        verdict = f"not shown: the last segment is not clearly better than {ties} of the {len(gaps)} other segments"
    return text, float(last["chance"]), values, verdict


def _b(part: pd.DataFrame, baselines: pd.DataFrame) -> tuple[str, float, str, str]:
    s = _pooled(part, ("segment",))
    first, last = s.index.min(), s.index.max()
    decay = difference(part, ("segment", last, first), by=("metric",)).iloc[0]
    values, versus, not_beaten = _baselines(part, baselines)
    text = ("segments " + ", ".join(f"{s.loc[w, 'value']:.2f}" for w in s.index) +
            f" (segment 1 {_fmt(*s.loc[first, ['value', 'ci_low', 'ci_high']])}, segment {last} "
            f"{_fmt(*s.loc[last, ['value', 'ci_low', 'ci_high']])}); last - first {_gap(decay)}"
            + (f"; all generated tokens: {versus}" if versus else ""))
    chance = float(s["chance"].max())
    below = [w for w in s.index if not _clears(s.loc[w], s.loc[w, "chance"])]
    if below:
        return text, chance, values, f"does not hold: segment(s) {below} not above chance"
    if not_beaten:
        return text, chance, values, f"above chance only: {_against(not_beaten)}"
    trend = ("decays" if decay["ci_high"] < 0 else "rises" if decay["ci_low"] > 0 else None)
    return text, chance, values, "holds" + (f" (above chance in every segment, but it {trend} from the first to the "
                                            "last)" if trend else "")


def _equivalence_verdict(gap: pd.Series, what: str) -> str:
    """The verdict of a "no difference" claim from a `_paired` difference: TOST within EQUIVALENCE_MARGIN."""
    equivalent, p = _equivalent(gap)
    differs = gap["ci_low"] > 0 or gap["ci_high"] < 0
    inside = f"inside +-{EQUIVALENCE_MARGIN} (TOST {_p(p)})"
    if equivalent and not differs:
        return f"holds: {what} {inside}"
    if equivalent:
        return f"holds within the margin: {what} differs from 0 ({_p(gap['p'])}) but lies {inside}"
    if differs:
        return (f"does not hold: {what} differs from 0 ({_p(gap['p'])}), not shown inside +-{EQUIVALENCE_MARGIN} "
                f"(TOST {_p(p)})")
    return (f"not shown: {what} neither differs from 0 ({_p(gap['p'])}) nor is shown inside +-{EQUIVALENCE_MARGIN} "
            f"(TOST {_p(p)}) on {int(gap['n_samples'])} samples")


def _b_windows(part: pd.DataFrame, baselines: pd.DataFrame) -> tuple[str, float, str, str] | None:
    part = _selection(part, "paper")
    if part["obs_window"].nunique() < 2:
        return None  # one window size: nothing to compare
    s = _pooled(part, ("obs_window",))
    reference = 32 if 32 in s.index else s.index[0]
    gaps = pd.concat([difference(part, ("obs_window", w, reference), by=("metric",)).assign(other=w)
                      for w in s.index if w != reference], ignore_index=True)
    text = ", ".join(f"{w}: {_fmt(*s.loc[w, ['value', 'ci_low', 'ci_high']])}" for w in s.index)
    largest = gaps.loc[gaps["difference"].abs().idxmax()]
    text += f"; largest difference {int(largest.other)} - {reference} = {_gap(largest)}"
    verdicts = {int(row.other): _equivalence_verdict(row, f"{int(row.other)} - {reference}")
                for _, row in gaps.iterrows()}
    heads = {w: short_verdict(v) for w, v in verdicts.items()}
    if all(h.startswith("holds") for h in heads.values()):
        verdict = f"holds: every size within +-{EQUIVALENCE_MARGIN} of {reference} (TOST at level {ALPHA})"
    elif any(h == "does not hold" for h in heads.values()):
        bad = [w for w, h in heads.items() if h == "does not hold"]
        verdict = (f"does not hold: size(s) {bad} differ from {reference} and are not shown inside "
                   f"+-{EQUIVALENCE_MARGIN}")
    else:
        open_ = [w for w, h in heads.items() if h == "not shown"]
        verdict = (f"not shown: size(s) {open_} neither differ from {reference} nor are shown inside "
                   f"+-{EQUIVALENCE_MARGIN}")
    return text, float(s["chance"].mean()), "as (b)", verdict


def _b_selection(part: pd.DataFrame, baselines: pd.DataFrame, obs_window: int) -> tuple[str, float, str, str] | None:
    part = part[part["obs_window"] == obs_window]
    if not {"paper", "compressor"} <= set(part["selection"]):
        return None  # the compressor's selection was not run
    s = _pooled(part[part["selection"].isin(["paper", "compressor"])], ("selection",))
    gap = _paired(part[part["selection"] == "compressor"], part[part["selection"] == "paper"])
    compressor = part[part["selection"] == "compressor"]
    _, versus, not_beaten = _baselines(compressor, part)
    text = (f"paper {_fmt(*s.loc['paper', ['value', 'ci_low', 'ci_high']])}, compressor "
            f"{_fmt(*s.loc['compressor', ['value', 'ci_low', 'ci_high']])}; compressor - paper {_gap(gap)}"
            + (f"; {versus.replace('window', 'compressor')}" if versus else ""))
    equivalent, p = _equivalent(gap)
    if not _clears(s.loc["compressor"], s.loc["compressor", "chance"]):
        verdict = "the compressor's selection is not above chance"
    elif gap["ci_high"] < 0:
        verdict = "above chance, less consistent than the paper's selection"
    elif gap["ci_low"] > 0:
        verdict = "above chance, more consistent than the paper's selection"
    elif equivalent:
        verdict = f"above chance, as consistent as the paper's selection (inside +-{EQUIVALENCE_MARGIN}, TOST {_p(p)})"
    else:
        verdict = f"above chance; not shown whether as consistent as the paper's selection (TOST {_p(p)})"
    if not_beaten:
        verdict += f"; {_against(not_beaten)}"
    return text, float(s["chance"].mean()), "as (b)", verdict


def _c(part: pd.DataFrame, baselines: pd.DataFrame) -> tuple[str, float, str, str]:
    window = _selection(part, "paper")
    s = _pooled(window, ("placement",))
    gap = difference(window, ("placement", "back", "front"), by=("metric",)).iloc[0]
    values, clauses, weak = [], [], []
    for placement, name in (("back", "after"), ("front", "before")):
        held, versus, not_beaten = _baselines(window[window["placement"] == placement],
                                              baselines[baselines["placement"] == placement])
        values.append(f"{name}: {held}")
        clauses += [f"{name}: {versus}"] if versus else []
        weak += [f"{name} {_against(not_beaten)}"] if not_beaten else []
    text = (f"after {_fmt(*s.loc['back', ['value', 'ci_low', 'ci_high']])}, before "
            f"{_fmt(*s.loc['front', ['value', 'ci_low', 'ci_high']])}; after - before {_gap(gap)}"
            + "".join(f"; {c}" for c in clauses))
    below = [p for p in s.index if not _clears(s.loc[p], s.loc[p, "chance"])]
    if below:
        verdict = f"does not hold: question {'/'.join(below)} not above chance"
    else:
        verdict = _equivalence_verdict(gap, "after - before")
        if verdict.startswith("does not hold"):  # both placements work; the claim that position does not matter fails
            verdict = "partly: above chance both ways, but the placement matters: " + verdict.split(": ", 1)[1]
    if weak:
        verdict += "; " + "; ".join(weak)
    return text, float(s["chance"].max()), "; ".join(values), verdict


def _d(part: pd.DataFrame, baselines: pd.DataFrame) -> tuple[str, float, str, str]:
    paper = part[(part["comparison"] == "different questions") & (part["voters"] == "all rows")]
    halves = part[part["voters"] == "alternate rows"]
    s = _pooled(paper, ("metric",)).iloc[0]
    gap = difference(halves, ("comparison", "same question", "different questions"), by=("metric",)).iloc[0]
    text = (f"H between questions {_fmt(s['value'], s['ci_low'], s['ci_high'])}; alternate rows: same question "
            f"{gap['value_a']:.2f} vs different questions {gap['value_b']:.2f}, same - different {_gap(gap)}")
    values = [f"chance {s['chance']:.2f}"]
    for name in QUESTION_FREE:
        rows = part[part["comparison"] == f"question vs {name}"]
        if rows.empty:
            continue
        values.append(f"question vs {name} {summarise(rows, by=('metric',))['value'].iloc[0]:.2f}")
        shared = _paired(paper, rows)
        text += f"; H between questions - H(question, {name}) {_gap(shared)}"
    if gap["ci_low"] > 0:
        verdict = (f"holds: selections depend on the question, yet different questions share {s['value']:.0%} of "
                   "their positions")
    elif _equivalent(gap)[0]:
        verdict = f"does not hold: different questions select as one question does (inside +-{EQUIVALENCE_MARGIN})"
    else:
        verdict = "not shown: " + _equivalence_verdict(gap, "same - different").split(": ", 1)[1]
    return text, float(s["chance"]), " · ".join(values), verdict


def layer_groups(table: pd.DataFrame, sliding_layers=()) -> dict[str, pd.DataFrame]:
    """{"all": table} for a model without sliding-window layers, else {"global": ..., "sliding": ...} by `layer`."""
    if not len(sliding_layers):
        return {"all": table}
    sliding = table["layer"].isin(list(sliding_layers))
    return {"global": table[~sliding], "sliding": table[sliding]}


def verdicts(tables: dict[str, pd.DataFrame], obs_window: int = 32, sliding_layers=()) -> pd.DataFrame:
    """One row per (finding, measure, layers, split, mode): n (prompts or documents), result (values and paired
    differences with t intervals), chance, baselines, verdict. split: each split alone, then "both" (every split's
    prompts pooled) where there are several. layers: "all", or "global" and "sliding" apart when `sliding_layers`
    names the model's sliding-window layers."""
    baselines = _baseline_tables(tables, obs_window)
    rows = []
    for key, whole in tables.items():
        groups, base_groups = layer_groups(whole, sliding_layers), layer_groups(baselines[key], sliding_layers)
        for layers, table in groups.items():
            rows += [dict(row, layers=layers) for row in _table_verdicts(key, table, base_groups[layers], obs_window)]
    order = {k: i for i, k in enumerate(CLAIMS)}
    splits = {k: i for i, k in enumerate(SPLITS)}
    return pd.DataFrame(rows).sort_values(["finding", "mode", "measure", "layers", "split"],
                                          key=lambda c: c.map(order) if c.name == "finding" else
                                          c.map(splits) if c.name == "split" else c,
                                          kind="stable").reset_index(drop=True)


def _baseline_tables(tables: dict[str, pd.DataFrame], obs_window: int) -> dict[str, pd.DataFrame]:
    """Where each finding's baselines are: (b)'s in the (b) variants (pooled over heads, at the reference window),
    every other finding's in its own table."""
    out = dict(tables)
    if "b" in tables:
        variants = tables.get("b_variants", tables["b"].iloc[0:0])
        out["b"] = variants[variants["obs_window"] == obs_window] if "obs_window" in variants else variants
    return out


def _table_verdicts(key: str, table: pd.DataFrame, baselines: pd.DataFrame, obs_window: int) -> list[dict]:
    """The verdict rows of one findings table (key "a", "b", "b_variants", "c" or "d"), its baselines' rows beside."""
    measures = {"overlap, sinks excluded": ("overlap", "excluded")} if key == "d" else MEASURES
    checks = ({"b_windows": _b_windows, "b_selection": lambda t, base: _b_selection(t, base, obs_window)}
              if key == "b_variants" else {key: {"a": _a, "b": _b, "c": _c, "d": _d}[key]})
    rows = []
    for mode, by_mode in table.groupby("mode"):
        base_mode = baselines[baselines["mode"] == mode]
        splits = [(split, part) for split, part in by_mode.groupby("split")]
        splits += [("both", by_mode)] if len(splits) > 1 else []
        for split, part in splits:
            base = base_mode if split == "both" else base_mode[base_mode["split"] == split]
            for measure, (metric, sinks) in measures.items():
                chosen = part[(part["metric"] == metric) & (part["sinks"] == sinks)]
                if chosen.empty:
                    continue
                chosen_base = base[(base["metric"] == metric) & (base["sinks"] == sinks)]
                for finding, check in checks.items():
                    try:
                        checked = check(chosen, chosen_base)
                    except Undefined as err:
                        checked = str(err), float("nan"), "", "undefined: too little support"
                    if checked is None:
                        continue
                    result, chance, beside, verdict = checked
                    rows.append(dict(finding=finding, claim=CLAIMS[finding], measure=measure, split=split, mode=mode,
                                     n=int(chosen["sample"].nunique()), result=result, chance=round(chance, 3),
                                     baselines=beside, verdict=verdict))
    return rows


def read_tables(data_dir="data") -> dict[str, pd.DataFrame]:
    """The findings tables in data_dir, {"a", "b", "b_variants", "c", "d"} (those present)."""
    data_dir = Path(data_dir)
    names = ("a", "b", "b_variants", "c", "d")
    tables = {k: read_table(data_dir / f"findings_{k}.csv") for k in names if (data_dir / f"findings_{k}.csv").exists()}
    # (a)'s baselines have no segment: integers with gaps, not floats
    return {k: t.astype({"segment": "Int64"}) if "segment" in t else t for k, t in tables.items()}


def read_run(data_dir="data") -> dict:
    """The settings of the run that wrote data_dir's findings tables (findings_run.json; {} without one), with this
    version's option names."""
    path = Path(data_dir) / "findings_run.json"
    return upgrade_options(json.loads(path.read_text())) if path.exists() else {}


def report(data_dir="data") -> pd.DataFrame:
    """`verdicts` of the tables in data_dir, with the observation window and sliding-window layers of their run
    (`read_run`)."""
    run = read_run(data_dir)
    return verdicts(read_tables(data_dir), obs_window=int(run.get("obs_window", 32)),
                    sliding_layers=run.get("sliding_layers", ()))


def _with_layers(table: pd.DataFrame) -> pd.DataFrame:
    """A verdicts table with its `layers` column ("all" for one written before layer groups existed)."""
    return table if "layers" in table.columns else table.assign(layers="all")


def markdown(table: pd.DataFrame) -> str:
    """The verdicts as a markdown table: one row per (finding, measure, mode, layers, split), dev, held-out and both
    pooled one under the other."""
    lines = ["| finding | measure | split (n) | result: value [95% t interval]; paired differences [95% t interval], "
             "t-test p | chance and baselines (same size as the window's selection) | verdict |",
             "|---|---|---|---|---|---|"]
    table = _with_layers(table)
    for (_finding, measure, mode, group), part in table.groupby(["finding", "measure", "mode", "layers"], sort=False):
        claim = (part["claim"].iloc[0] + ("" if mode == "generated" else f" ({mode})")
                 + ("" if group == "all" else f", {group} layers"))
        for _, row in part.iterrows():
            beside = row.get("baselines", "") or f"chance {row['chance']:.2f}"
            n = f" ({row['n']})" if "n" in row else ""
            lines.append(f"| {claim} | {measure} | {SPLITS.get(row['split'], row['split'])}{n} | {row['result']} | "
                         f"{beside} | **{row['verdict']}** |")
    return "\n".join(lines)


def short_verdict(verdict: str) -> str:
    """A verdict's headline: its text before the first ':' or '(' ("holds", "does not hold", "not shown", ...)."""
    return verdict.split(":")[0].split(" (")[0].strip()


def side_by_side(reports: dict[str, pd.DataFrame]) -> str:
    """Verdicts of several models as one markdown table: a row per (finding, measure) of the generated mode, a
    column per model and layer group ("global"/"sliding" for a model with sliding-window layers), each cell
    "dev / held-out / both pooled" headlines. reports: {model name: `report(...)` of its tables}."""
    columns, cells = [], {}
    for model, table in reports.items():
        table = table[table["mode"] == "generated"]
        for (finding, measure, group), part in _with_layers(table).groupby(["finding", "measure", "layers"],
                                                                           sort=False):
            column = model if group == "all" else f"{model}, {group} layers"
            columns += [column] if column not in columns else []
            by_split = part.set_index("split")["verdict"]
            cells.setdefault((finding, measure), {})[column] = " / ".join(
                short_verdict(by_split[split]) if split in by_split.index else "-" for split in SPLITS)
    lines = ["| finding | measure | " + " | ".join(columns) + " |", "|---|---|" + "---|" * len(columns)]
    order = {k: i for i, k in enumerate(CLAIMS)}
    for (finding, measure), row in sorted(cells.items(), key=lambda item: (order[item[0][0]], item[0][1])):
        lines.append(f"| {CLAIMS[finding]} | {measure} | " + " | ".join(row.get(c, "-") for c in columns) + " |")
    return "\n".join(lines)
