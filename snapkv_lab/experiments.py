"""The paper's four observation experiments, each a function from captured traces to a tidy table, and
the "findings" figure set (`snapkv-lab figures`).

(a) prompt_windows:        the last `n_windows` prompt windows, each voting on a common prefix, vs the
                           attention of all generated tokens; x = window (-1 is the observation window).
(b) generation_consistency: the observation window's selection vs each of `n_gen_windows` windows of
                           generated tokens.
(c) question_placement:    (b) with one window of all generated tokens, question before vs after the document.
(d) question_dependence:   selections over the document made by (question + its answer), H(M_A, M_B)
                           between the selections of different questions.

Selections are `selection.select_from_trace` top-p (default 5%) per query head, without pooling, as in the
paper's observation code; metrics come from `metrics` with their chance levels, sinks kept and excluded.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import pandas as pd

from . import metrics
from .capture import capture
from .figures import FigureSet, register, write_html
from .inputs import check_context_length
from .metrics import SinkRule, metric_rows, selection_overlap, selection_vs_generation, summarise, to_mask
from .selection import select, select_from_trace
from .progress import progress_bar

TOP_P = 0.05
MODES = ("generated", "teacher-forced")
DEFAULTS = dict(samples=2, obs_window=32, prompt_window=128, gen_window=128, n_windows=20, n_gen_windows=4,
                questions=3, qa_new_tokens=48, split="dev", modes=MODES)


def _require(trace, needed: int, what: str) -> None:
    if trace.prompt_len < needed:
        raise ValueError(f"{what} needs a prompt of more than {needed} tokens, got {trace.prompt_len}")


def prompt_windows(trace, *, window=128, n_windows=20, p=TOP_P, sample=0) -> pd.DataFrame:
    """(a) Each of the last `n_windows` prompt windows votes on the common prefix before the earliest one."""
    prefix_len = trace.prompt_len - window * n_windows
    _require(trace, window * n_windows + 1, "prompt_windows")
    rows = []
    for layer in trace.layers:
        attn = trace.attention(layer, queries=trace.generated, keys=slice(0, prefix_len))
        for j in range(1, n_windows + 1):
            start = trace.prompt_len - window * j
            selected = to_mask(select_from_trace(trace, layer, slice(start, start + window), p, prefix_len=prefix_len), prefix_len)
            rows += selection_vs_generation(attn, selected, layer=layer, window=-j)
    return pd.DataFrame(rows).assign(sample=sample)


def generation_consistency(trace, *, obs_window=32, gen_window=128, n_gen_windows=4, p=TOP_P, sample=0) -> pd.DataFrame:
    """(b) The observation window's top-p selection vs each window of `gen_window` generated tokens."""
    prefix_len = trace.prompt_len - obs_window
    _require(trace, obs_window + 1, "generation_consistency")
    observation = slice(prefix_len, trace.prompt_len)
    windows = [slice(trace.prompt_len + i * gen_window, trace.prompt_len + (i + 1) * gen_window) for i in range(n_gen_windows)]
    windows = [w for w in windows if w.start < trace.n_tokens]
    rows, prefix = [], slice(0, prefix_len)
    for layer in trace.layers:
        selected = to_mask(select_from_trace(trace, layer, observation, p), prefix_len)
        observed = trace.attention(layer, queries=observation, keys=prefix)
        for i, rows_i in enumerate(windows):
            attn = trace.attention(layer, queries=slice(rows_i.start, min(rows_i.stop, trace.n_tokens)), keys=prefix)
            rows += selection_vs_generation(attn, selected, layer=layer, window=i + 1, observed=observed)
    return pd.DataFrame(rows).assign(sample=sample)


def question_placement(traces: dict[str, list], *, obs_window=32, p=TOP_P) -> pd.DataFrame:
    """(c) {"front": traces, "back": traces} -> observation-window hit rates against all generated tokens."""
    runs = [(placement, i, t) for placement, ts in traces.items() for i, t in enumerate(ts)]
    tables = [generation_consistency(t, obs_window=obs_window, gen_window=t.n_generated, n_gen_windows=1, p=p, sample=i)
              .assign(placement=placement) for placement, i, t in progress_bar(runs, desc="(c) metrics per QA trace")]
    return pd.concat(tables, ignore_index=True)


def question_dependence(traces: list, document: tuple[int, int], question_starts: list[int], *, p=TOP_P,
                        sink_rule=SinkRule(first=0)) -> pd.DataFrame:
    """(d) Traces of one document with different questions after it (same document positions).

    Each trace votes with the rows of its question and answer (question_starts[i] to the end) on the
    document span, top-p per head; H(M_A, M_B) for every ordered pair. The sink variant drops document
    positions that take `sink_rule.share` of attention in every voting row of either trace.
    """
    start, end = document
    rows = []
    for layer in progress_bar(traces[0].layers, desc="(d) metrics per layer"):
        masks, sinks = [], []
        for trace, q_start in zip(traces, question_starts):
            voters = slice(q_start, trace.n_tokens)
            votes = trace.column_sums(layer, queries=voters)[:, start:end]
            masks.append(to_mask(select(votes, p, pooling=None), end - start))
            sinks.append(sink_rule.mask(trace.attention(layer, queries=voters, keys=slice(start, end))))
        for a, b in itertools.permutations(range(len(traces)), 2):
            for label, eligible in (("kept", None), ("excluded", ~(sinks[a] | sinks[b]))):
                rows += metric_rows(selection_overlap(masks[a], masks[b], eligible=eligible), layer=layer,
                                    window=f"q{a}-q{b}", metric="overlap", sinks=label)
    return pd.DataFrame(rows)


# ---- running everything -----------------------------------------------------------------------
def run_findings(model, tokenizer, *, data_dir="data", **options) -> dict[str, pd.DataFrame]:
    """Capture the prompt sets and compute the four tables; writes data/findings_{a,b,c,d}.csv and a run log."""
    from .prompts import chat_prompts, load_recipes, qa_prompts

    o = {**DEFAULTS, **{k: v for k, v in options.items() if v is not None}}
    if not o["modes"] or set(o["modes"]) - set(MODES):
        raise ValueError(f"modes must be a non-empty subset of {MODES}, got {o['modes']!r}")
    data_dir = Path(data_dir)
    recipes = load_recipes(data_dir / "prompt_recipes.json")
    began = time.perf_counter()
    chats = chat_prompts(tokenizer, recipes, split=o["split"], samples=o["samples"])
    qa = {placement: qa_prompts(tokenizer, recipes, split=o["split"], questions=o["questions"], placement=placement)
          for placement in ("front", "back")}
    # Every prompt is checked before the first capture, not after an hour of them.
    planned = [(p, o["gen_window"] * o["n_gen_windows"]) for p in chats]
    planned += [(p, o["qa_new_tokens"]) for prompts in qa.values() for p in prompts]
    for prompt, new_tokens in planned:
        check_context_length(model, prompt.n_tokens + new_tokens, what=f"prompt {prompt.name} with {new_tokens} new tokens")
    tables = {"a": [], "b": []}
    runs = [(mode, i, prompt) for mode in o["modes"] for i, prompt in enumerate(chats)]
    for mode, i, prompt in progress_bar(runs, desc="(a, b) chat prompts"):
        forced = prompt.continuation if mode == "teacher-forced" else None
        trace = capture(model, tokenizer, prompt.ids, max_new_tokens=o["gen_window"] * o["n_gen_windows"],
                        continuation=forced, stop_at_eos=False)
        tables["a"].append(prompt_windows(trace, window=o["prompt_window"], n_windows=o["n_windows"], sample=i).assign(mode=mode))
        tables["b"].append(generation_consistency(trace, obs_window=o["obs_window"], gen_window=o["gen_window"],
                                                  n_gen_windows=o["n_gen_windows"], sample=i).assign(mode=mode))
        del trace
    tables["c"], tables["d"] = [], []
    answers = None
    for mode in MODES:  # greedy first: its answers are the teacher-forced references
        placed = _qa_traces(model, tokenizer, qa, o["qa_new_tokens"], answers)
        answers = {placement: [t.token_ids[t.generated] for t in traces] for placement, traces in placed.items()}
        if mode in o["modes"]:
            tables["c"].append(question_placement(placed, obs_window=o["obs_window"]).assign(mode=mode))
            tables["d"].append(question_dependence(placed["back"], qa["back"][0].spans["document"],
                                                   [q.spans["question"][0] for q in qa["back"]]).assign(mode=mode))
        del placed
        if "teacher-forced" not in o["modes"]:
            break
    out = {k: pd.concat(v, ignore_index=True).assign(model=model.config.name_or_path, split=o["split"]) for k, v in tables.items()}
    data_dir.mkdir(parents=True, exist_ok=True)
    for key, table in out.items():
        table.to_csv(data_dir / f"findings_{key}.csv", index=False)
    seconds = time.perf_counter() - began
    (data_dir / "findings_run.json").write_text(pd.Series({**{k: str(v) for k, v in o.items()}, "seconds": round(seconds),
                                                           "model": model.config.name_or_path}).to_json(indent=1))
    return out


def _qa_traces(model, tokenizer, qa: dict[str, list], new_tokens: int, answers: dict | None = None) -> dict[str, list]:
    """Traces of the QA prompts {"front": [Prompt], "back": [Prompt]}: greedy, or teacher-forced on `answers`.

    The essays come without reference answers, so the teacher-forced reference of a (question, placement)
    is the model's own greedy answer to that question in the *other* placement (answers: {placement: [(n,)
    ids]}): (c) then compares the placements on answers that neither prompt wrote itself, and (d) votes
    with answers written under another prompt.
    """
    other = {"front": "back", "back": "front"}
    mode = "greedy" if answers is None else "teacher-forced"
    return {placement: [capture(model, tokenizer, q.ids, max_new_tokens=new_tokens,
                                continuation=None if answers is None else answers[other[placement]][i])
                        for i, q in enumerate(progress_bar(prompts, desc=f"(c, d) QA {mode}, question {placement}"))]
            for placement, prompts in qa.items()}


def _recompute(options: dict) -> None:
    from .models import load_model

    if (options.get("executor") or "local") != "local":
        raise ValueError("the findings run in this process (--executor local): only the pressure grid runs as cells "
                         "on Ray so far (snapkv-lab needle --executor ray)")

    model, tokenizer = load_model(options.get("model"))
    run_findings(model, tokenizer, data_dir=options["data_dir"], samples=options.get("samples"),
                 obs_window=options.get("obs_window"), prompt_window=options.get("prompt_window"),
                 gen_window=options.get("gen_window"), split=options.get("split"))


# ---- figures -------------------------------------------------------------------------------------
EXPERIMENTS = {
    "a": ("window", "(a) Prompt windows vote, generation attends: the last window agrees best?"),
    "b": ("window", "(b) Observation window vs 4 windows of generated tokens"),
    "c": ("placement", "(c) Question before vs after the document"),
    "d": ("window", "(d) Different questions, same document: H between their selections"),
}
SHOWN_LAYERS = [0, 5, 10, 15, 20, 25, 29]


def _summary(table: pd.DataFrame, key: str) -> pd.DataFrame:
    hue = EXPERIMENTS[key][0]
    if key == "d":
        table = table.assign(window="all pairs")
    return summarise(table, by=("mode", "layer", hue, "metric", "sinks"))


def draw(data_dir, figures_dir) -> list[Path]:
    """PNG (matplotlib) and HTML (plotly) per experiment and mode from data/findings_*.csv.

    Generated mode is figures/findings_{key}.png/.html; teacher-forced is findings_{key}_teacher-forced.*.
    """
    written = []
    for key, (_, title) in EXPERIMENTS.items():
        path = Path(data_dir) / f"findings_{key}.csv"
        if not path.exists():
            continue
        for mode, summary in _summary(pd.read_csv(path), key).groupby("mode"):
            suffix = "" if mode == "generated" else f"_{mode}"
            written += _draw_one(summary, key, f"{title}  [{mode}; dashed: chance]", Path(figures_dir) / f"findings_{key}{suffix}")
    return written


def _draw_one(summary: pd.DataFrame, key: str, title: str, stem: Path) -> list[Path]:
    """One experiment in one mode: a PNG grid (rows: metrics, columns: sinks kept / excluded) and its HTML twin."""
    import matplotlib.pyplot as plt  # no matplotlib.use(): drawing must not switch a live notebook's backend
    import plotly.express as px

    hue = EXPERIMENTS[key][0]
    metric_names = [m for m in ("hit_rate", "recall", "overlap") if m in set(summary["metric"])]
    fig, axes = plt.subplots(len(metric_names), 2, figsize=(12, 3.6 * len(metric_names)), squeeze=False, sharex=True)
    for r, metric in enumerate(metric_names):
        for c, sinks in enumerate(("kept", "excluded")):
            ax, part = axes[r][c], summary[(summary.metric == metric) & (summary.sinks == sinks)]
            if key == "a":  # x = window, one line per shown layer, as in the paper
                for layer in SHOWN_LAYERS:
                    line = part[part.layer == layer].sort_values("window")
                    ax.plot(line["window"], line["value"], marker=".", label=f"layer {layer}")
                chance = part.groupby("window")["chance"].mean()
                ax.set_xlabel("prompt window (-1 = observation window)")
            else:
                for value, line in part.groupby(hue):
                    ax.plot(line["layer"], line["value"], marker=".", label=f"{hue} {value}")
                chance = part.groupby("layer")["chance"].mean()
                ax.set_xlabel("layer")
            ax.plot(chance.index, chance.values, "k--", label="chance")
            # NaN (undefined) cells leave gaps in the lines; name them so a gap is not read as missing data.
            undefined = sorted(set(part.loc[~part["defined"], "layer"]))
            if undefined:
                ax.text(0.01, 0.02, f"undefined (support < {metrics.MIN_SUPPORT}): layers {undefined}",
                        transform=ax.transAxes, fontsize=7)
            ax.set_ylim(-0.02, 1.02)
            ax.set_title(f"{metric}, sinks {sinks}", fontsize=10)
            ax.grid(alpha=0.3)
    axes[0][1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1, 0.5))
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    png, html = stem.with_suffix(".png"), stem.with_suffix(".html")
    fig.savefig(png, dpi=110)
    plt.close(fig)
    x, color = ("window", "layer") if key == "a" else ("layer", hue)
    shown = summary[summary.layer.isin(SHOWN_LAYERS)] if key == "a" else summary
    chance = (shown.groupby(["metric", "sinks", x], as_index=False)["chance"].mean()
              .assign(value=lambda t: t["chance"], **{color: "chance"}))
    figure = px.line(pd.concat([shown.assign(**{color: shown[color].astype(str)}), chance]), x=x, y="value",
                     color=color, facet_row="metric", facet_col="sinks", markers=True, title=title,
                     hover_data=["chance", "support", "n_cells"])
    figure.for_each_trace(lambda trace: trace.update(line=dict(dash="dash", color="black"), marker=dict(size=1))
                          if trace.name == "chance" else None)
    write_html(figure, html)
    return [png, html]


register(FigureSet(name="findings", recompute=_recompute, draw=draw))
