"""Which scorers lose most when the match is not literal: the difference of differences on nolima's generated items.

Each generated item is asked twice on one context (evaluation.nolima): its non-literal question (no content word
shared with the needle) and its literal control (the needle's own words), each in a run of its own: tables
eval_nolima_4k_nonliteral.csv and eval_nolima_4k_literal.csv, the same items, policies, ratio and modes. Per item,
policy and mode (scores 0 or 100):

    gap = (policy - full cache) on the non-literal question  -  (policy - full cache) on the literal one

negative where compression costs more when the question cannot point at the needle's words. `literal_gap` reads it
over all items and over the items the full cache answers both ways ("answered": where a compressed cache has
something to lose on both); mean, t 95% interval over items (core.ratio_intervals), and the exact paired sign-flip
p (summary.sign_flip_test). A descriptive read, not a family comparison: the family (evaluation.family) compares a
policy with SnapKV on one table.

The figure set `non-literal` is registered here: each policy's loss to the full cache, literal beside non-literal,
per mode (`snapkv-lab figures --only non-literal`; `--recompute` reruns the evals, long).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from ..core.figure_files import FigureSet, register, write_png
from ..core.ratio_intervals import mean_t_interval
from .summary import example_scores, sign_flip_test

TABLES = {"nonliteral": "eval_nolima_4k_nonliteral.csv", "literal": "eval_nolima_4k_literal.csv"}
GAP_TABLE = "nolima_literal_gap.csv"
SUBSETS = ("answered", "all")
# The run the docs report (docs/non-literal.md): what --recompute reruns.
LIMIT = 26  # items per model; the docs say how far the runs got (cells resume)
POLICIES = ("SnapKV", "H2O", "StreamingLLM", "KNorm", "ExpectedAttention")
RUN = dict(datasets=["nolima"], lengths=(4096,), ratios=[0.5], policies=POLICIES, limit=LIMIT)


def paired_items(nonliteral: pd.DataFrame, literal: pd.DataFrame) -> pd.DataFrame:
    """One row per item, compressing policy and mode: score (0-100) and full (the full cache's) for each question
    kind (`_nl`, `_l` suffixes), kv_share of the non-literal run, and gap (module doc). The two tables must hold the
    same items and policies: a mismatch is refused, not dropped."""
    frames = []
    for table, suffix in ((nonliteral, "_nl"), (literal, "_l")):
        scores = example_scores(table)
        full = scores.loc[scores.policy == "FullCache", ["example", "mode", "score"]].rename(columns={"score": "full"})
        frames.append(scores[scores.policy != "FullCache"].merge(full, on=["example", "mode"])
                      [["example", "policy", "ratio", "mode", "score", "full", "kv_share"]]
                      .rename(columns={"score": "score" + suffix, "full": "full" + suffix,
                                       "kv_share": "kv_share" + suffix}))
    keys = ["example", "policy", "ratio", "mode"]
    both = frames[0].merge(frames[1], on=keys, how="outer", indicator=True)
    if (both["_merge"] != "both").any():
        odd = both.loc[both["_merge"] != "both", keys].head(3).to_dict("records")
        raise ValueError(f"the non-literal and literal runs hold different items or policies, e.g. {odd}: run both "
                         "with the same --limit, --seed and --policies")
    both = both.drop(columns=["_merge", "kv_share_l"]).rename(columns={"kv_share_nl": "kv_share"})
    both["gap"] = (both.score_nl - both.full_nl) - (both.score_l - both.full_l)
    return both


def literal_gap(nonliteral: pd.DataFrame, literal: pd.DataFrame) -> pd.DataFrame:
    """Per subset ("answered": items the full cache answers both ways; "all"), policy, ratio and mode: n items, the
    full cache's and the policy's mean scores each way, the losses to the full cache each way, the gap's mean, its
    t 95% interval over items, the exact sign-flip p and the number of nonzero gaps, and the mean kv_share."""
    items = paired_items(nonliteral, literal)
    answered = items[(items.full_nl == 100) & (items.full_l == 100)]
    rows = []
    for subset, part in (("answered", answered), ("all", items)):
        for (policy, ratio, mode), group in part.groupby(["policy", "ratio", "mode"], sort=False):
            gap = group.gap.to_numpy(dtype=float)
            n = len(gap)
            _, low, high = mean_t_interval(gap)
            p, method = sign_flip_test(gap, np.full(n, 1 / n))
            rows.append(dict(subset=subset, policy=policy, ratio=ratio, mode=mode, n=n,
                             full_nonliteral=group.full_nl.mean(), full_literal=group.full_l.mean(),
                             policy_nonliteral=group.score_nl.mean(), policy_literal=group.score_l.mean(),
                             loss_nonliteral=(group.score_nl - group.full_nl).mean(),
                             loss_literal=(group.score_l - group.full_l).mean(), gap=gap.mean(), low=float(low),
                             high=float(high), p=p, p_method=method, nonzero=int(np.count_nonzero(gap)),
                             kv_share=group.kv_share.mean()))
    return pd.DataFrame(rows)


def _share(found: float, n: int) -> str:
    """found / n with its Wilson 95% interval in percent (scipy.stats.binomtest's)."""
    from scipy.stats import binomtest

    interval = binomtest(round(found), n).proportion_ci(method="wilson")
    return f"{found:.0f}/{n} [{100 * interval.low:.0f}, {100 * interval.high:.0f}]"


def report(nonliteral: pd.DataFrame, literal: pd.DataFrame) -> str:
    """Markdown for docs/non-literal.md: the full cache each way (answered / n, Wilson 95% in percent), then per mode
    each policy's score each way and its gap over all items and over the answered ones (mean [t 95%], sign-flip p,
    nonzero gaps)."""
    items = paired_items(nonliteral, literal)
    full = items.drop_duplicates("example")
    n = len(full)
    gaps = literal_gap(nonliteral, literal)
    both = int(((full.full_nl == 100) & (full.full_l == 100)).sum())
    lines = [f"{n} items, ratio {gaps.ratio.iloc[0]:g}. The full cache answers the literal question on "
             f"{_share(full.full_l.sum() / 100, n)}, the non-literal one on {_share(full.full_nl.sum() / 100, n)} "
             f"(answered / n [Wilson 95%, percent]); both on {both}.", ""]
    for mode in [m for m in ("query-aware", "query-agnostic") if m in set(gaps["mode"])]:
        lines += [f"**{mode}** (scores 0-100 over all items; gap = (policy - full) non-literal less (policy - full) "
                  "literal, per item: mean [t 95%], exact sign-flip p, nonzero gaps):", "",
                  "| policy | KV share | literal | non-literal | gap, all items | gap, answered both ways |",
                  "|---|---|---|---|---|---|"]
        part = gaps[gaps["mode"] == mode].set_index(["subset", "policy"])
        for policy in part.loc["all"].sort_values("gap").index:
            row = part.loc[("all", policy)]
            cells = [f"{row.kv_share:.2f}", f"{row.policy_literal:.0f}", f"{row.policy_nonliteral:.0f}"]
            for subset in ("all", "answered"):
                if (subset, policy) not in part.index:
                    cells.append("no item")
                    continue
                r = part.loc[(subset, policy)]
                interval = "" if np.isnan(r.low) else f" [{r.low:+.0f}, {r.high:+.0f}]"
                cells.append(f"{r.gap:+.0f}{interval}, p {r.p:.2g} ({r.nonzero} of {r.n})")
            lines.append(f"| {policy} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def read_runs(data_dir) -> tuple[pd.DataFrame, pd.DataFrame] | None:
    """(non-literal, literal) eval tables of a model's folder, or None where either is missing."""
    paths = [Path(data_dir) / TABLES[kind] for kind in ("nonliteral", "literal")]
    if not all(path.is_file() for path in paths):
        return None
    return tuple(pd.read_csv(path) for path in paths)


def write_gap(data_dir) -> Path | None:
    """nolima_literal_gap.csv in data_dir from its two runs (None where they are not there)."""
    runs = read_runs(data_dir)
    if runs is None:
        return None
    path = Path(data_dir) / GAP_TABLE
    literal_gap(*runs).to_csv(path, index=False, float_format="%.6g")
    return path


def recompute(options: dict) -> None:
    """Run both evals (resumable: stored cells are skipped) for options' model into its data folder, then the gap."""
    from .run import evaluate

    data_dir = options.get("data_dir", "data")
    for task, kind in (("generated", "nonliteral"), ("generated_literal", "literal")):
        evaluate(options.get("model"), tasks=[task], data_dir=data_dir,
                 name=TABLES[kind].removeprefix("eval_").removesuffix(".csv"), **RUN)
    write_gap(data_dir)


def draw(data_dir, figures_dir) -> list[Path]:
    """nolima_literal_gap.png: per mode, each policy's mean loss to the full cache (points) on the literal and the
    non-literal question, all items, with the gap's t 95% interval in the label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = write_gap(data_dir)
    if path is None:
        return []
    table = pd.read_csv(path)
    table = table[table.subset == "all"]
    modes = [m for m in ("query-aware", "query-agnostic") if m in set(table["mode"])]
    figure, axes = plt.subplots(1, len(modes), figsize=(5.5 * len(modes), 4.2), sharey=True, squeeze=False)
    policies = sorted(set(table.policy))  # one order in every panel: they share the y axis
    for axis, mode in zip(axes[0], modes, strict=True):
        part = table[table["mode"] == mode].set_index("policy").reindex(policies)
        y = np.arange(len(policies))
        axis.barh(y - 0.2, part.loss_literal, height=0.4, label="literal question", color="#4c72b0")
        axis.barh(y + 0.2, part.loss_nonliteral, height=0.4, label="non-literal question", color="#dd8452")
        for at, row in zip(y, part.itertuples(), strict=True):
            interval = "" if np.isnan(row.low) else f" [{row.low:+.0f}, {row.high:+.0f}]"
            axis.text(2, at, f"gap {row.gap:+.0f}{interval}", va="center", fontsize=8)
        axis.set_yticks(y, policies)
        axis.set_xlim(-105, 105)
        axis.axvline(0, color="black", linewidth=0.8)
        axis.set_title(f"{mode}, ratio {part.ratio.iloc[0]:g}, n = {part.n.max()} items", fontsize=10)
        axis.set_xlabel("policy less full cache (points)")
    axes[0][-1].legend(loc="lower right", fontsize=8)
    figure.suptitle("nolima generated items: loss to the full cache, literal vs non-literal", fontsize=10)
    figure.tight_layout()
    out = Path(figures_dir) / "nolima_literal_gap.png"
    write_png(figure, out)
    plt.close(figure)
    return [out]


register(FigureSet(name="non-literal", recompute=recompute, draw=draw, recompute_by_default=False))
