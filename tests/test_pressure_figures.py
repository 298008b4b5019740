"""The pressure figures as a reader gets them: numeric order, counts and intervals, colour scales, the model's name,
offline HTML; and the committed figures themselves."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
import pytest

from snapkv_lab.pressure import accuracy_table, budget_labels, wilson
from snapkv_lab.pressure.pressure_plots import draw

ROOT = Path(__file__).resolve().parents[1]
BUDGETS = (1024, 256, 2048, 512)  # written out of order on purpose: text order would put 1024 first
LENGTHS = (4000, 2000)


def _decoded(value):
    """Plotly's JSON with its base64 arrays ({"dtype", "bdata", "shape"}) turned back into lists."""
    if isinstance(value, dict) and "bdata" in value:
        array = np.frombuffer(base64.b64decode(value["bdata"]), dtype=value["dtype"])
        return array.reshape([int(n) for n in str(value.get("shape", len(array))).split(",")]).tolist()
    if isinstance(value, dict):
        return {k: _decoded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decoded(v) for v in value]
    return value


def plotly_data(page: Path) -> tuple[list, dict]:
    """The traces and layout of the figure in a page written by figures.write_html."""
    text = page.read_text()
    start = text.index("[", text.index("Plotly.newPlot("))
    decoder = json.JSONDecoder()
    traces, end = decoder.raw_decode(text, start)
    layout, _ = decoder.raw_decode(text, text.index("{", end))
    return _decoded(traces), layout


@pytest.fixture(scope="module")
def drawn(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pressure")
    rows = []
    for length in LENGTHS:
        for depth in (1.0, 0.0, 0.5):
            for sample in range(3):
                rows.append(dict(task="needle", length=length, depth=depth, sample=sample, policy="FullCache",
                                 capacity=None, mode="full", correct=sample < 2, value_kept=1.0, fact_kept=1.0,
                                 model="org/Tiny-1B"))
                for policy in ("SnapKV", "H2O"):
                    for budget in BUDGETS:
                        for mode in ("query-aware", "query-agnostic"):
                            rows.append(dict(task="needle", length=length, depth=depth, sample=sample, policy=policy,
                                             capacity=budget, mode=mode, correct=sample * 1000 < budget,
                                             value_kept=budget / 4096, fact_kept=budget / 4096, model="org/Tiny-1B"))
    table = pd.DataFrame(rows)
    table.to_csv(folder / "pressure_needle.csv", index=False)
    table[table["mode"] != "query-agnostic"].assign(task="lines").to_csv(folder / "pressure_lines.csv", index=False)
    backend = matplotlib.get_backend()
    matplotlib.use("svg")  # a backend drawing must not switch (a notebook's inline backend, say)
    try:
        written = draw(folder, folder)
        assert matplotlib.get_backend() == "svg"
    finally:
        matplotlib.use(backend)
    return folder, table, written


def test_budgets_sort_as_numbers():
    labels = budget_labels(pd.Series([1024, None, 256, 2048, 512]))
    assert list(labels.cat.categories) == ["full", "256", "512", "1024", "2048"]
    table = pd.DataFrame(dict(policy=["FullCache"] + ["SnapKV"] * 4, capacity=[None, *BUDGETS], length=[4000] * 5,
                              correct=[1, 0, 1, 0, 1], mode=["full"] + ["query-aware"] * 4))
    assert [b for _, _, b in accuracy_table(table).index] == ["full", "256", "512", "1024", "2048"]


def test_the_first_24_policy_lines_all_look_different():
    from snapkv_lab.views.palette import line_style

    styles = [tuple(sorted(line_style(i).items())) for i in range(24)]  # a leaderboard of every policy draws 24
    assert len(set(styles)) == 24
    assert all(style["ls"] != ":" for style in map(line_style, range(48)))  # dotted is the full cache's line


def test_every_figure_is_written_with_plotly_beside_it(drawn):
    folder, _, written = drawn
    names = {p.name for p in written}
    assert names == {f"pressure_{n}.{e}"
                     for n in ("needle_query-aware", "needle_query-agnostic", "needle_budget", "lines")
                     for e in ("png", "html")}
    assert (folder / "plotly.min.js").exists()
    for page in folder.glob("*.html"):
        assert "cdn" not in page.read_text().lower()


def test_budget_figure_in_numeric_order_with_wilson_intervals(drawn):
    folder, table, _ = drawn
    traces, layout = plotly_data(folder / "pressure_needle_budget.html")
    assert "org/Tiny-1B" in layout["title"]["text"] and "n = 9" in layout["title"]["text"]
    for trace in traces:
        assert trace["x"] == sorted(BUDGETS)  # numeric order: no zig-zag
    snap = next(t for t in traces if t["name"] == "SnapKV" and "mode=query-aware" in t["hovertemplate"]
                and "length=2000" in t["hovertemplate"])
    found = [int(sum(s * 1000 < b for s in range(3))) * 3 for b in sorted(BUDGETS)]  # 3 depths x the samples under b
    low, high = zip(*(wilson(f, 9) for f in found))
    assert snap["y"] == pytest.approx([f / 9 for f in found])
    assert snap["error_y"]["array"] == pytest.approx([h - f / 9 for h, f in zip(high, found)])
    assert snap["error_y"]["arrayminus"] == pytest.approx([f / 9 - lo for lo, f in zip(low, found)])
    ticks = [layout[k]["ticktext"] for k in layout if k.startswith("xaxis")]
    assert all(t == ["256", "512", "1024", "2048"] for t in ticks)


def test_needle_heatmaps_viridis_with_counts_and_one_full_cache_panel(drawn):
    folder, _, _ = drawn
    traces, layout = plotly_data(folder / "pressure_needle_query-aware.html")
    assert len(traces) == 1 + 2 * len(BUDGETS)  # the full cache once, not once per budget
    assert layout["coloraxis"]["colorbar"]["title"]["text"] and layout["coloraxis"]["cmin"] == 0
    assert layout["coloraxis"]["colorscale"][0][1].lower() == "#440154"  # viridis, not red-green
    full = traces[0]
    assert full["x"] == ["2000", "4000"] and full["y"] == ["0%", "50%", "100%"]
    assert full["text"] == [["2/3", "2/3"]] * 3
    titles = [a["text"] for a in layout["annotations"] if a["text"].startswith(("SnapKV", "H2O", "FullCache"))]
    assert titles[:1] == ["FullCache, full cache"] and [t for t in titles if t.startswith("SnapKV")] == [
        f"SnapKV, budget {b}" for b in sorted(BUDGETS)]


def test_committed_html_figures_work_offline():
    pages = sorted((ROOT / "figures").glob("**/*.html"))
    assert pages and (ROOT / "figures" / "plotly.min.js").exists()
    assert sorted(p.relative_to(ROOT) for p in (ROOT / "figures").glob("**/plotly.min.js")) == [
        Path("figures/plotly.min.js")]  # one copy: a model's folder loads its parent's
    for page in pages:
        text = page.read_text()
        # every script the page loads is the one copy, none from a CDN (the data itself may hold "cdn")
        expected = "plotly.min.js" if page.parent == ROOT / "figures" else "../plotly.min.js"
        assert re.findall(r'<script[^>]*\ssrc="([^"]*)"', text) == [expected], page.name
        assert (page.parent / expected).is_file(), page.name
        assert not re.search(r"<script[^>]*(integrity|crossorigin)", text), page.name


def methods_rows() -> pd.DataFrame:
    """A methods-suite table worked by hand: the full cache finds 3 of 3; A finds 2 of 3 query-aware and 0 of 3
    query-agnostic; B finds 1 of 3 query-aware; coverage and needle attention set per row."""
    rows = [dict(policy="FullCache", mode="full", correct=True, cache_length=4000, coverage=np.nan, oracle=np.nan,
                 value_attention=np.nan, value_attention_kept=np.nan, model="tiny") for _ in range(3)]
    for policy, mode, found in (("A", "query-aware", 2), ("A", "query-agnostic", 0), ("B", "query-aware", 1)):
        for i in range(3):
            rows.append(dict(policy=policy, mode=mode, correct=i < found, cache_length=1024 + i, coverage=0.2 * (i + 1),
                             oracle=0.8, value_attention=0.5, value_attention_kept=0.1 * i, model="tiny"))
    return pd.DataFrame(rows)


def test_methods_table_counts_intervals_and_means_by_hand():
    from snapkv_lab.pressure.tables import methods_table

    summary = methods_table(methods_rows()).set_index(["policy", "mode"])
    assert list(dict.fromkeys(summary.index.get_level_values(0))) == ["FullCache", "A", "B"]
    assert (summary.loc[("A", "query-aware"), ["correct", "asked"]] == [2, 3]).all()
    assert summary.loc[("A", "query-agnostic"), "correct"] == 0
    assert (summary.loc[("B", "query-aware"), ["correct_low", "correct_high"]].tolist()
            == pytest.approx(list(wilson(1, 3))))
    assert summary.loc[("A", "query-aware"), "cache_length"] == pytest.approx(1025)
    assert summary.loc[("A", "query-aware"), "coverage_of_oracle"] == pytest.approx((0.2 + 0.4 + 0.6) / 3 / 0.8)
    assert summary.loc[("B", "query-aware"), "value_served"] == pytest.approx((0 + 0.2 + 0.4) / 3)


def presses_rows() -> pd.DataFrame:
    """4 needles, the full cache answers 3 (n3 it misses); SnapKV finds n0 n1, A n1 n2 n3, B none (query-agnostic)."""
    found = {"FullCache": [1, 1, 1, 0], "SnapKV": [1, 1, 0, 0], "A": [0, 1, 1, 1], "B": [0, 0, 0, 0]}
    share = {"FullCache": 1.0, "SnapKV": 0.256, "A": 0.256, "B": 0.2}
    return pd.DataFrame([dict(key=f"n{i}", sample=0, depth=0.25 * i, policy=policy,
                              mode="full" if policy == "FullCache" else "query-agnostic", correct=bool(hit),
                              kv_share=share[policy] + 0.001 * i * (policy == "B"))
                         for policy, hits in found.items() for i, hit in enumerate(hits)])


def test_paired_table_counts_the_answered_needles_and_the_discordant_pairs_by_hand():
    from snapkv_lab.pressure.tables import paired_table

    summary = paired_table(presses_rows()).set_index("policy")
    assert (summary.answered == 3).all() and (summary.asked == 3).all()  # n3, which the full cache misses, is left out
    assert summary.loc["A", ["correct", "only_policy", "only_baseline"]].tolist() == [2, 1, 1]  # n2 / n0 (not n3)
    assert summary.loc["B", ["correct", "only_policy", "only_baseline"]].tolist() == [0, 0, 2]
    assert summary.loc["SnapKV", ["correct", "only_policy", "only_baseline"]].tolist() == [2, 0, 0]
    assert summary.loc["A", ["correct_low", "correct_high"]].tolist() == pytest.approx(list(wilson(2, 3)))
    assert summary.loc["B", ["kv_share_min", "kv_share_max"]].tolist() == pytest.approx([0.2, 0.202])


def test_presses_figure_and_docs_block_from_the_table(tmp_path):
    """The presses suite (no coverage columns) is drawn like the methods suite and read by its own docs block."""
    from snapkv_lab.app import docs_tables

    presses_rows().assign(cache_length=1024, model="M").to_csv(tmp_path / "pressure_presses.csv", index=False)
    written = draw(tmp_path, tmp_path)
    assert {p.name for p in written} == {"pressure_presses.png", "pressure_presses.html"}
    traces, _ = plotly_data(tmp_path / "pressure_presses.html")
    assert sorted(round(x, 3) for trace in traces for x in trace["x"]) == [0.0, 0.5, 0.75]  # B, SnapKV, A of all 4
    block = docs_tables.rendered("presses", tmp_path)
    assert "answers: 3." in block and "| A | 2/3 [" in block and "| 1 / 1 |" in block
    assert "| 0 / 2 | 0.200-0.202 |" in block and "query-aware" not in block  # one mode run: its columns alone


def test_the_presses_docs_block_reads_each_mode_beside_the_other(tmp_path):
    """Both modes: per press, each mode's found and discordant pairs with SnapKV in that mode, then its KV shares."""
    from snapkv_lab.app import docs_tables

    agnostic = presses_rows()
    aware = agnostic[agnostic.policy != "FullCache"].assign(mode="query-aware", kv_share=0.25)
    aware.loc[(aware.policy == "A") & (aware.key == "n0"), "correct"] = True  # A finds all 3 with the question
    aware.loc[(aware.policy == "SnapKV") & (aware.key == "n0"), "correct"] = False
    pd.concat([agnostic, aware]).assign(cache_length=1024, model="M").to_csv(tmp_path / "pressure_presses.csv",
                                                                             index=False)
    block = docs_tables.rendered("presses", tmp_path)
    assert "| press | query-aware: found [95%] | it alone / SnapKV alone | query-agnostic: found [95%] |" in block
    assert "| A | 3/3 [0.44, 1.00] | 2 / 0 | 2/3 [0.21, 0.94] | 1 / 1 | 0.250 / 0.256 |" in block
    assert "| SnapKV | 1/3 [" in block and "| - | 2/3 [" in block


def test_methods_figure_and_docs_block_from_the_table(tmp_path):
    from snapkv_lab.app import docs_tables

    methods_rows().to_csv(tmp_path / "pressure_methods.csv", index=False)
    written = draw(tmp_path, tmp_path)
    assert {p.name for p in written} >= {"pressure_methods.png", "pressure_methods.html"}
    traces, _ = plotly_data(tmp_path / "pressure_methods.html")
    assert sorted(round(x, 3) for trace in traces for x in trace["x"]) == [0.0, 0.333, 0.667]
    block = docs_tables.rendered("methods", tmp_path)
    assert "| A | 2/3 [" in block and "| 0/3 [" in block and "| B | 1/3 [" in block and "| - |" in block
