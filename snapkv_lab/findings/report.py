"""Verdicts on the paper's four findings, per split and mode, from the committed tables.

Every value is pooled over layers and heads (sum of numerators / sum of supports) with a 95% bootstrap interval
over prompts or documents (`metrics.summarise`); every comparison is a paired bootstrap interval of a
difference (`metrics.difference`). A finding *holds* only where the interval clears chance and the comparison
the paper makes holds too:

(a) the last prompt segment (the observation window) is above chance and better than every other segment (each
    difference > 0);
(b) every segment of the generation is above chance (the decay from the first to the last segment is reported);
(c) both placements are above chance and the difference between them is not distinguishable from 0;
(d) the overlap between different questions' selections is below the overlap between two halves of one
    question's rows (selections depend on the question).

Two measures for (a)-(c): the paper's hit rate with sinks kept, and recall with sinks excluded (theta-free).

A model with sliding-window layers (Gemma 3: 512 tokens in 15 of 18 layers) gets its verdicts for the global and
the sliding layers apart: a sliding layer's generated tokens cannot attend to a prompt position more than a window
back, so what its observation window can predict is bounded by the window, not by the prompt.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from ..core.overlap import difference, summarise
from .legacy import read_table, upgrade_options

CI = 0.95
MEASURES = {"paper's hit rate, sinks kept": ("hit_rate", "kept"), "recall, sinks excluded": ("recall", "excluded")}
CLAIMS = {"a": "(a) the last prompt segment agrees best", "b": "(b) consistent during generation",
          "b_windows": "(b) observation window size has no effect", "b_selection": "(b) the compressor's selection",
          "c": "(c) question position does not matter", "d": "(d) different questions select differently"}


def _fmt(value, low, high) -> str:
    return f"{value:.2f} [{low:.2f}, {high:.2f}]"


def _signed(value, low, high) -> str:
    """A difference with its interval, to 3 decimals where 2 would print a real difference as 0.00."""
    digits = 3 if max(abs(value), abs(low), abs(high)) < 0.01 else 2
    return f"{value:+.{digits}f} [{low:+.{digits}f}, {high:+.{digits}f}]"


def _clears(row, chance) -> bool:
    return bool(row["ci_low"] > chance)


class Undefined(ValueError):
    """A pooled value the verdict needs has too little support (metrics.MIN_SUPPORT)."""


def _pooled(table: pd.DataFrame, by) -> pd.DataFrame:
    s = summarise(table, by=by, ci=CI).set_index(list(by))
    if s["value"].isna().any():
        raise Undefined(f"undefined {', '.join(map(str, by))}: {list(s.index[s['value'].isna()])}")
    return s


def _a(part: pd.DataFrame) -> tuple[str, float, str]:
    s = _pooled(part, ("segment",))
    last = s.loc[-1]
    others = [w for w in s.index if w != -1]
    gaps = pd.concat([difference(part, ("segment", -1, w), by=("metric",)).assign(other=w) for w in others])
    best = s.loc[others, "value"].idxmax()
    closest = gaps.loc[gaps["other"] == best].iloc[0]
    text = (f"last {_fmt(last['value'], last['ci_low'], last['ci_high'])}; best other segment ({best}) "
            f"{s.loc[best, 'value']:.2f}; last - best other "
            f"{_signed(closest['difference'], closest['ci_low'], closest['ci_high'])}")
    if not _clears(last, last["chance"]):
        verdict = "does not hold: the last segment is not above chance"
    elif (gaps["ci_low"] > 0).all():
        verdict = "holds"
    elif (gaps["ci_high"] < 0).any():
        better = sorted(gaps.loc[gaps["ci_high"] < 0, "other"])
        verdict = f"does not hold: segments {better} agree better"
    else:
        ties = len(gaps[gaps["ci_low"] <= 0])
        verdict = f"not shown: the last segment is not clearly better than {ties} of the {len(gaps)} other segments"
    return text, float(last["chance"]), verdict


def _b(part: pd.DataFrame) -> tuple[str, float, str]:
    s = _pooled(part, ("segment",))
    first, last = s.index.min(), s.index.max()
    decay = difference(part, ("segment", last, first), by=("metric",)).iloc[0]
    text = ("segments " + ", ".join(f"{s.loc[w, 'value']:.2f}" for w in s.index) +
            f" (segment 1 {_fmt(*s.loc[first, ['value', 'ci_low', 'ci_high']])}, segment {last} "
            f"{_fmt(*s.loc[last, ['value', 'ci_low', 'ci_high']])}); last - first "
            f"{_signed(decay['difference'], decay['ci_low'], decay['ci_high'])}")
    chance = float(s["chance"].max())
    below = [w for w in s.index if not _clears(s.loc[w], s.loc[w, "chance"])]
    if below:
        return text, chance, f"does not hold: segment(s) {below} not above chance"
    trend = ("decays" if decay["ci_high"] < 0 else "rises" if decay["ci_low"] > 0 else None)
    return text, chance, "holds" + (f" (above chance in every segment, but it {trend} from the first to the last)"
                                    if trend else "")


def _b_windows(part: pd.DataFrame) -> tuple[str, float, str]:
    part = part[part["selection"] == "paper"]
    s = _pooled(part, ("obs_window",))
    reference = 32 if 32 in s.index else s.index[0]
    gaps = pd.concat([difference(part, ("obs_window", w, reference), by=("metric",)).assign(other=w)
                      for w in s.index if w != reference], ignore_index=True)
    text = ", ".join(f"{w}: {_fmt(*s.loc[w, ['value', 'ci_low', 'ci_high']])}" for w in s.index)
    effect = gaps[(gaps["ci_low"] > 0) | (gaps["ci_high"] < 0)]
    largest = gaps.loc[gaps["difference"].abs().idxmax()]
    size = f"{int(largest.other)} - {reference} = {_signed(largest.difference, largest.ci_low, largest.ci_high)}"
    verdict = (f"holds: no size differs from {reference} beyond its interval (largest: {size})" if effect.empty else
               f"does not hold strictly: {len(effect)} of {len(gaps)} sizes differ from {reference}, by at most "
               f"{gaps['difference'].abs().max():.3f} ({size})")
    return text, float(s["chance"].mean()), verdict


def _b_selection(part: pd.DataFrame, obs_window: int) -> tuple[str, float, str]:
    part = part[part["obs_window"] == obs_window]
    s = _pooled(part, ("selection",))
    gap = difference(part, ("selection", "compressor", "paper"), by=("metric",)).iloc[0]
    text = (f"paper {_fmt(*s.loc['paper', ['value', 'ci_low', 'ci_high']])}, compressor "
            f"{_fmt(*s.loc['compressor', ['value', 'ci_low', 'ci_high']])}; compressor - paper "
            f"{_signed(gap['difference'], gap['ci_low'], gap['ci_high'])}")
    above = _clears(s.loc["compressor"], s.loc["compressor", "chance"])
    if not above:
        verdict = "the compressor's selection is not above chance"
    elif gap["ci_high"] < 0:
        verdict = "above chance, less consistent than the paper's selection"
    elif gap["ci_low"] > 0:
        verdict = "above chance, more consistent than the paper's selection"
    else:
        verdict = "above chance, as consistent as the paper's selection"
    return text, float(s["chance"].mean()), verdict


def _c(part: pd.DataFrame) -> tuple[str, float, str]:
    s = _pooled(part, ("placement",))
    gap = difference(part, ("placement", "back", "front"), by=("metric",)).iloc[0]
    text = (f"after {_fmt(*s.loc['back', ['value', 'ci_low', 'ci_high']])}, before "
            f"{_fmt(*s.loc['front', ['value', 'ci_low', 'ci_high']])}; after - before "
            f"{_signed(gap['difference'], gap['ci_low'], gap['ci_high'])}")
    below = [p for p in s.index if not _clears(s.loc[p], s.loc[p, "chance"])]
    if below:
        verdict = f"does not hold: question {'/'.join(below)} not above chance"
    elif gap["ci_low"] > 0 or gap["ci_high"] < 0:
        verdict = "partly: above chance both ways, but the placement matters"
    else:
        verdict = "holds"
    return text, float(s["chance"].max()), verdict


def _d(part: pd.DataFrame) -> tuple[str, float, str]:
    paper = part[(part["comparison"] == "different questions") & (part["voters"] == "all rows")]
    halves = part[part["voters"] == "alternate rows"]
    s = _pooled(paper, ("metric",)).iloc[0]
    gap = difference(halves, ("comparison", "same question", "different questions"), by=("metric",)).iloc[0]
    text = (f"H between questions {_fmt(s['value'], s['ci_low'], s['ci_high'])}; alternate rows: same question "
            f"{gap['value_a']:.2f} vs different questions {gap['value_b']:.2f}, same - different "
            f"{_signed(gap['difference'], gap['ci_low'], gap['ci_high'])}")
    if gap["ci_low"] > 0:
        verdict = (f"holds: selections depend on the question, yet different questions share {s['value']:.0%} of "
                   "their positions")
    else:
        verdict = "does not hold: different questions select as one question does"
    return text, float(s["chance"]), verdict


def layer_groups(table: pd.DataFrame, sliding_layers=()) -> dict[str, pd.DataFrame]:
    """{"all": table} for a model without sliding-window layers, else {"global": ..., "sliding": ...} by `layer`."""
    if not len(sliding_layers):
        return {"all": table}
    sliding = table["layer"].isin(list(sliding_layers))
    return {"global": table[~sliding], "sliding": table[sliding]}


def verdicts(tables: dict[str, pd.DataFrame], obs_window: int = 32, sliding_layers=()) -> pd.DataFrame:
    """One row per (finding, measure, layers, split, mode): result (values with intervals), chance, verdict.
    layers: "all", or "global" and "sliding" apart when `sliding_layers` names the model's sliding-window layers."""
    rows = [dict(row, layers=layers) for key, whole in tables.items()
            for layers, table in layer_groups(whole, sliding_layers).items()
            for row in _table_verdicts(key, table, obs_window)]
    order = {k: i for i, k in enumerate(CLAIMS)}
    return pd.DataFrame(rows).sort_values(["finding", "mode", "measure", "layers", "split"],
                                          key=lambda c: c.map(order) if c.name == "finding" else c,
                                          kind="stable").reset_index(drop=True)


def _table_verdicts(key: str, table: pd.DataFrame, obs_window: int) -> list[dict]:
    """The verdict rows of one findings table (key "a", "b", "b_variants", "c" or "d")."""
    measures = {"overlap, sinks excluded": ("overlap", "excluded")} if key == "d" else MEASURES
    checks = ({"b_windows": _b_windows, "b_selection": lambda t: _b_selection(t, obs_window)}
              if key == "b_variants" else {key: {"a": _a, "b": _b, "c": _c, "d": _d}[key]})
    rows = []
    for (split, mode), part in table.groupby(["split", "mode"]):
        for measure, (metric, sinks) in measures.items():
            chosen = part[(part["metric"] == metric) & (part["sinks"] == sinks)]
            if chosen.empty:
                continue
            for finding, check in checks.items():
                try:
                    result, chance, verdict = check(chosen)
                except Undefined as err:
                    result, chance, verdict = str(err), float("nan"), "undefined: too little support"
                rows.append(dict(finding=finding, claim=CLAIMS[finding], measure=measure, split=split, mode=mode,
                                 result=result, chance=round(chance, 3), verdict=verdict))
    return rows


def read_tables(data_dir="data") -> dict[str, pd.DataFrame]:
    """The findings tables in data_dir, {"a", "b", "b_variants", "c", "d"} (those present)."""
    data_dir = Path(data_dir)
    names = ("a", "b", "b_variants", "c", "d")
    return {k: read_table(data_dir / f"findings_{k}.csv") for k in names if (data_dir / f"findings_{k}.csv").exists()}


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
    """The verdicts as a markdown table: one row per (finding, measure, mode), the splits side by side."""
    lines = ["| finding | measure | chance | dev: value [95% interval] | dev verdict "
             "| held-out: value [95% interval] | held-out verdict |",
             "|---|---|---|---|---|---|---|"]
    for (_finding, measure, mode, group), part in _with_layers(table).groupby(["finding", "measure", "mode", "layers"],
                                                                             sort=False):
        by_split = part.set_index("split")
        cells = []
        for split in ("dev", "heldout"):
            row = by_split.loc[split] if split in by_split.index else None
            cells += ["-", "-"] if row is None else [row["result"], f"**{row['verdict']}**"]
        claim = (part["claim"].iloc[0] + ("" if mode == "generated" else f" ({mode})")
                 + ("" if group == "all" else f", {group} layers"))
        lines.append(f"| {claim} | {measure} | {part['chance'].max():.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def short_verdict(verdict: str) -> str:
    """A verdict's headline: its text before the first ':' or '(' ("holds", "does not hold", "not shown", ...)."""
    return verdict.split(":")[0].split(" (")[0].strip()


def side_by_side(reports: dict[str, pd.DataFrame]) -> str:
    """Verdicts of several models as one markdown table: a row per (finding, measure) of the generated mode, a
    column per model and layer group ("global"/"sliding" for a model with sliding-window layers), each cell
    "dev / held-out" headlines. reports: {model name: `report(...)` of its tables}."""
    columns, cells = [], {}
    for model, table in reports.items():
        table = table[table["mode"] == "generated"]
        for (finding, measure, group), part in _with_layers(table).groupby(["finding", "measure", "layers"],
                                                                            sort=False):
            column = model if group == "all" else f"{model}, {group} layers"
            columns += [column] if column not in columns else []
            by_split = part.set_index("split")["verdict"]
            cells.setdefault((finding, measure), {})[column] = " / ".join(
                short_verdict(by_split[split]) if split in by_split.index else "-" for split in ("dev", "heldout"))
    lines = ["| finding | measure | " + " | ".join(columns) + " |", "|---|---|" + "---|" * len(columns)]
    order = {k: i for i, k in enumerate(CLAIMS)}
    for (finding, measure), row in sorted(cells.items(), key=lambda item: (order[item[0][0]], item[0][1])):
        lines.append(f"| {CLAIMS[finding]} | {measure} | " + " | ".join(row.get(c, "-") for c in columns) + " |")
    return "\n".join(lines)
