"""The pressure figure set: the needle grid and the lines ablation (`snapkv-lab needle`, `figures`)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from ..figures import FigureSet, register, write_html
from ..policies import AdaKV, PyramidKV, SnapKV, SnapKVNoPooling, StreamingLLM, TOVA
from .ablations import ABLATION_CAPACITY, ABLATION_LENGTH, ABLATION_SAMPLES, run_ablations
from .ablations import draw as draw_ablations
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
    """Accuracy by mode, policy and capacity (rows) and prompt length (columns), the full cache on top."""
    table = table.copy()
    full = table[table.policy == "FullCache"]
    expanded = pd.concat([full.assign(mode=m) for m in MODES if m in set(table["mode"])] + [table[table.policy != "FullCache"]])
    expanded["budget"] = expanded.capacity.map(lambda c: "full" if pd.isna(c) else str(int(c)))
    return expanded.pivot_table(index=["mode", "policy", "budget"], columns="length", values="correct", aggfunc="mean")


def draw(data_dir: Path, figures_dir: Path) -> list[Path]:
    """Heatmaps (depth x length) per policy and budget for each mode, accuracy-vs-budget lines, lines ablation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import plotly.express as px

    data_dir, figures_dir = Path(data_dir), Path(figures_dir)
    written = []
    needle_path = data_dir / "pressure_needle.csv"
    if needle_path.exists():
        table = pd.read_csv(needle_path)
        table["budget"] = table.capacity.map(lambda c: "full" if pd.isna(c) else str(int(c)))
        for mode in MODES:
            part = pd.concat([table[table.policy == "FullCache"], table[table["mode"] == mode]])
            policies = [p for p in part.policy.unique() if p != "FullCache"]
            budgets = [b for b in part.budget.unique() if b != "full"]
            cells = part.groupby(["policy", "budget", "depth", "length"], as_index=False).correct.mean()
            fig, axes = plt.subplots(len(policies) + 1, len(budgets), figsize=(2.6 * len(budgets), 2.2 * (len(policies) + 1)),
                                     squeeze=False, sharex=True, sharey=True)
            for r, policy in enumerate(["FullCache", *policies]):
                for c, budget in enumerate(budgets):
                    ax = axes[r, c]
                    sel = cells[(cells.policy == policy) & (cells.budget == ("full" if policy == "FullCache" else budget))]
                    grid = sel.pivot(index="depth", columns="length", values="correct")
                    ax.imshow(grid.values, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
                    ax.set_xticks(range(len(grid.columns)), [str(x) for x in grid.columns])
                    ax.set_yticks(range(len(grid.index)), [f"{d:.0%}" for d in grid.index])
                    ax.set_title(f"{policy} ({'full' if policy == 'FullCache' else budget})", fontsize=8)
            fig.supxlabel("prompt length (tokens)")
            fig.supylabel("needle depth")
            fig.suptitle(f"Needle retrieval, SmolLM2-135M, {mode} (green = found)")
            fig.tight_layout()
            png = figures_dir / f"pressure_needle_{mode}.png"
            fig.savefig(png, dpi=110)
            plt.close(fig)
            interactive = px.density_heatmap(cells[cells.policy != "FullCache"], x="length", y="depth", z="correct",
                                             facet_row="policy", facet_col="budget", histfunc="avg", range_color=(0, 1),
                                             color_continuous_scale="RdYlGn", title=f"Needle retrieval, {mode}",
                                             category_orders={"budget": budgets})
            written += [png, write_html(interactive, figures_dir / f"pressure_needle_{mode}.html")]
        summary = accuracy_table(table).stack().rename("accuracy").reset_index()
        summary = summary[summary.policy != "FullCache"].assign(budget=lambda d: d.budget.astype(int))
        full = table[table.policy == "FullCache"].groupby("length").correct.mean()
        fig = px.line(summary, x="budget", y="accuracy", color="policy", facet_col="length", facet_row="mode", markers=True,
                      log_x=True, title="Needle accuracy vs KV budget (dotted: full cache)")
        for i, length in enumerate(sorted(full.index)):
            for row in (1, 2):
                fig.add_hline(y=full[length], line_dash="dot", row=row, col=i + 1)
        html = write_html(fig, figures_dir / "pressure_needle_budget.html")
        png = figures_dir / "pressure_needle_budget.png"
        _budget_png(summary, full, png)
        written += [png, html]
    written += draw_ablations(data_dir, figures_dir)
    ruler_path = data_dir / "pressure_ruler.csv"
    if ruler_path.exists():
        ruler = pd.read_csv(ruler_path)
        ruler["run"] = _run_label(ruler)
        grades = ruler.melt(id_vars=["task", "value_kind", "run"], value_vars=["correct", "exact"], var_name="grade",
                            value_name="accuracy").groupby(["task", "value_kind", "run", "grade"], as_index=False).accuracy.mean()
        fig = px.bar(grades, x="run", y="accuracy", color="grade", barmode="group", facet_row="task", facet_col="value_kind",
                     title=f"RULER-style needles, {RULER_LENGTH} tokens, budget {RULER_CAPACITY} (correct: RULER's substring "
                           "grade; exact: the value as a whole token)", height=900)
        written += [write_html(fig, figures_dir / "pressure_ruler.html")]
        png = figures_dir / "pressure_ruler.png"
        cells = grades[grades.grade == "correct"].pivot_table(index=["task", "value_kind"], columns="run", values="accuracy")
        fig, ax = plt.subplots(figsize=(1.1 * len(cells.columns) + 3, 0.45 * len(cells) + 1.5))
        ax.imshow(cells.values, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(cells.columns)), cells.columns, rotation=45, ha="right", fontsize=8)
        ax.set_yticks(range(len(cells.index)), [f"{t} / {k}" for t, k in cells.index], fontsize=8)
        ax.set_title("RULER-style needles: accuracy (green = found)", fontsize=9)
        fig.tight_layout()
        fig.savefig(png, dpi=110)
        plt.close(fig)
        written.append(png)
    lines_path = data_dir / "pressure_lines.csv"
    if lines_path.exists():
        lines = pd.read_csv(lines_path)
        lines["budget"] = lines.capacity.map(lambda c: "full" if pd.isna(c) else str(int(c)))
        acc = lines.groupby(["policy", "budget"], as_index=False).agg(accuracy=("correct", "mean"), value_kept=("value_kept", "mean"))
        fig, ax = plt.subplots(figsize=(6, 3.2))
        for policy, part in acc[acc.policy != "FullCache"].groupby("policy"):
            part = part.assign(b=part.budget.astype(int)).sort_values("b")
            ax.plot(part.b, part.accuracy, marker="o", label=policy)
        ax.axhline(acc[acc.policy == "FullCache"].accuracy.mean(), ls=":", color="k", label="FullCache")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("KV budget (tokens)")
        ax.set_ylabel("accuracy")
        ax.set_title("LongEval-Lines-style retrieval: pooling ablation")
        ax.legend(fontsize=8)
        fig.tight_layout()
        png = figures_dir / "pressure_lines.png"
        fig.savefig(png, dpi=110)
        plt.close(fig)
        bars = px.bar(acc, x="budget", y="accuracy", color="policy", barmode="group", hover_data=["value_kept"],
                      title="Lines retrieval: SnapKV with and without pooling")
        written += [png, write_html(bars, figures_dir / "pressure_lines.html")]
    return written


def _budget_png(summary: pd.DataFrame, full: pd.Series, path: Path) -> None:
    import matplotlib.pyplot as plt

    modes, lengths = sorted(summary["mode"].unique()), sorted(summary.length.unique())
    fig, axes = plt.subplots(len(modes), len(lengths), figsize=(3.4 * len(lengths), 2.8 * len(modes)), squeeze=False,
                             sharex=True, sharey=True)
    for r, mode in enumerate(modes):
        for c, length in enumerate(lengths):
            ax = axes[r, c]
            part = summary[(summary["mode"] == mode) & (summary.length == length)]
            for policy, line in part.groupby("policy"):
                line = line.sort_values("budget")
                ax.plot(line.budget, line.accuracy, marker="o", label=policy)
            ax.axhline(full[length], ls=":", color="k", label="FullCache")
            ax.set_xscale("log", base=2)
            ax.set_title(f"{mode}, {length} tokens", fontsize=9)
    axes[0, -1].legend(fontsize=7)
    fig.supxlabel("KV budget (tokens per head)")
    fig.supylabel("needle accuracy")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


register(FigureSet(name="pressure", recompute=recompute, draw=draw, recompute_by_default=False))
