"""The four experiments on a tiny GQA Llama: tidy tables, end-to-end checks against eager attention, sinks defined
once per prompt, the compressor's selection, cells that resume, and the figures drawn from the tables."""

from __future__ import annotations

import json
import math

import matplotlib
import pandas as pd
import pytest
import torch
from conftest import ByteTokenizer, eager_twin, make_tiny_llama
from reference import assert_same_selection, reference_kept

from snapkv_lab import SnapKV, capture, generate
from snapkv_lab.core.overlap import THETA, SinkRule
from snapkv_lab.findings.experiments import (
    draw,
    findings_tables,
    generation_consistency,
    prompt_segments,
    question_dependence,
    question_placement,
    run_findings,
    select_mask,
)
from snapkv_lab.findings.findings_plots import figure_d, layer_groups, layer_ranges


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_llama()


@pytest.fixture(scope="module")
def traces(tiny):
    """A greedy and a teacher-forced trace of the same 200-token prompt (24 continuation tokens)."""
    prompt = torch.arange(3, 203)
    byte_tokenizer = ByteTokenizer()
    greedy = capture(tiny, byte_tokenizer, prompt, max_new_tokens=24, stop_at_eos=False, progress=False)
    forced = capture(tiny, byte_tokenizer, prompt, continuation=torch.arange(40, 64), progress=False)
    return {"generated": greedy, "teacher-forced": forced}


def eager_map(model, trace, layer, head):
    with torch.no_grad():
        return eager_twin(model)(trace.token_ids[None], output_attentions=True).attentions[layer][0, head]


def test_experiment_tables_are_tidy(traces):
    trace = traces["generated"]
    a = prompt_segments(trace, segment=16, n_prompt_segments=5)
    assert set(a["segment"]) == {-1, -2, -3, -4, -5} and set(a["metric"]) == {"hit_rate", "recall"}
    assert len(a) == 2 * 5 * 4 * 2 * 2  # layers x prompt segments x heads x metrics x sink variants
    b = generation_consistency(trace, obs_window=[8, 16], gen_segment=8, n_gen_segments=3,
                               selection=["paper", "compressor"])
    assert set(b["segment"]) == {1, 2, 3} and "coarse" in set(b["metric"])
    # layers x observation windows x selections x generated segments x heads x metrics x sinks
    assert len(b) == 2 * 2 * 2 * 3 * 4 * 3 * 2
    assert ((b["value"].isna()) | ((b["value"] >= 0) & (b["value"] <= 1))).all()
    assert (b.loc[b["support"] < 5, "value"].isna()).all()  # undefined, never 0 or 1
    with pytest.raises(ValueError, match="needs a prompt of more than"):
        prompt_segments(trace, segment=64, n_prompt_segments=20)
    with pytest.raises(ValueError, match="selection must be one of"):
        generation_consistency(trace, obs_window=8, selection="pooled")


def test_generation_consistency_equals_eager_by_hand(tiny, traces):
    """Layer 1, head 2, first generated segment: the hit rate and recall rebuilt from transformers' eager attention."""
    trace = traces["generated"]
    n, obs, layer, head = trace.prompt_len, 8, 1, 2
    attn = eager_map(tiny, trace, layer, head)
    prefix = n - obs
    k = max(1, int(0.05 * prefix))
    selected = set(torch.topk(attn[prefix:n, :prefix].sum(0), k).indices.tolist())
    rows = attn[n : n + 8, :prefix]
    above = [(r, p) for r in range(rows.shape[0]) for p in range(prefix) if rows[r, p] > THETA]
    hits = sum(p in selected for _, p in above)
    table = generation_consistency(trace, obs_window=obs, gen_segment=8, n_gen_segments=1)
    mine = table[(table.layer == layer) & (table["head"] == head) & (table.sinks == "kept")].set_index("metric")
    assert (mine.loc["hit_rate", "numerator"], mine.loc["hit_rate", "support"]) == (hits, len(above))
    assert (mine.loc["hit_rate", "chance"] == pytest.approx(k / prefix) if len(above) >= 5
            else math.isnan(mine.loc["hit_rate", "chance"]))
    expected = (rows[:, sorted(selected)].sum(1) / rows.sum(1)).mean()
    assert mine.loc["recall", "value"] == pytest.approx(expected.item(), abs=1e-5)


def test_sinks_are_one_set_per_prompt_from_all_generated_rows(traces):
    """Every segment of a prompt's generation, the short last one included, excludes the same sinks: those of all
    generated rows.

    A share near the tiny model's uniform attention (1/200) makes the rule pick many positions, so that sets found on
    each segment's own rows would differ (checked below): the test can fail."""
    trace, rule, obs = traces["generated"], SinkRule(first=2, share=0.0044), 8
    prefix = trace.prompt_len - obs
    table = generation_consistency(trace, obs_window=obs, gen_segment=9, n_gen_segments=3,
                                   sink_rule=rule)  # 9, 9, 6 rows
    excluded = table[(table.sinks == "excluded") & (table.metric == "recall")]
    differs_per_segment = False
    for layer in trace.layers:
        attn = trace.attention(layer, queries=trace.generated, keys=slice(0, prefix))
        sinks = rule.mask(attn)  # (heads, prefix), from all 24 generated rows
        votes = trace.column_sums(layer, queries=slice(prefix, trace.prompt_len))[:, :prefix]
        selected = select_mask(votes, 0.05, "paper", trace.n_kv_heads)
        # chance = share of eligible positions held
        expected = ((selected & ~sinks).sum(-1) / (~sinks).sum(-1)).tolist()
        for segment in (1, 2, 3):
            rows = excluded[(excluded.layer == layer) & (excluded.segment == segment)].sort_values("head")
            assert rows["chance"].tolist() == pytest.approx(expected, abs=1e-6)
        segments = (slice(0, 9), slice(9, 18), slice(18, 24))
        differs_per_segment |= any(not torch.equal(rule.mask(attn[:, w]), sinks) for w in segments)
    assert differs_per_segment  # the per-segment rule would have given other sets


def test_compressor_selection_is_what_snapkv_keeps(tiny):
    """select_mask(..., "compressor") on a trace equals the prompt positions SnapKV keeps in the live cache (ties
    apart)."""
    ids, window = torch.arange(3, 163)[None], 8
    trace = capture(tiny, ByteTokenizer(), ids[0], max_new_tokens=1, stop_at_eos=False, progress=False)
    prefix = ids.shape[1] - window
    k = int(0.05 * prefix)
    kept = generate(tiny, ByteTokenizer(), ids, policy=SnapKV(window_size=window, capacity=k + window),
                    max_new_tokens=1).kept_indices
    ref_kept, ref_scores = reference_kept(tiny, ids, window, k + window, pooling="max", kernel=7)
    for layer in trace.layers:
        votes = trace.column_sums(layer, queries=slice(prefix, ids.shape[1]))[:, :prefix]
        mask = select_mask(votes, 0.05, "compressor", trace.n_kv_heads)  # (heads, prefix), one set per KV head
        group = trace.n_heads // trace.n_kv_heads
        assert all(torch.equal(mask[h], mask[h - h % group]) for h in range(trace.n_heads))
        mine = torch.stack([m.nonzero()[:, 0] for m in mask[::group]])
        mine = torch.cat([mine, torch.arange(prefix, ids.shape[1]).expand(mine.shape[0], -1)], dim=-1)[None]
        assert_same_selection([mine], [ref_kept[layer]], [ref_scores[layer]], window)
        assert_same_selection([kept[layer]], [ref_kept[layer]], [ref_scores[layer]], window)


def test_question_placement_and_dependence(tiny, traces):
    c = question_placement({"front": traces["generated"], "back": traces["teacher-forced"]}, obs_window=8, sample="doc")
    assert set(c["placement"]) == {"front", "back"} and set(c["segment"]) == {1} and set(c["sample"]) == {"doc"}
    greedy, forced = traces["generated"], traces["teacher-forced"]
    d = question_dependence([greedy, forced], (10, 150), [150, 150], sample="doc")
    assert set(d["pair"]) == {"q0-q1", "q1-q0", "q0-q0", "q1-q1"}
    assert set(zip(d["comparison"], d["voters"])) == {("different questions", "all rows"),
                                                      ("different questions", "alternate rows"),
                                                      ("same question", "alternate rows")}
    assert d["chance"].dropna().between(0.04, 0.06).all()  # 7 of 140 positions, sinks kept or excluded

    def top_positions(trace, layer, head, rows):  # rows vote on document positions 10..149, top 5% = 7
        return set(eager_map(tiny, trace, layer, head)[rows, 10:150].sum(0).topk(7).indices.tolist())

    n = greedy.n_tokens
    for layer, head in ((0, 1), (1, 3)):
        part = d[(d.layer == layer) & (d["head"] == head) & (d.sinks == "kept")].set_index(["pair", "voters"])
        a, b = top_positions(greedy, layer, head, slice(150, n)), top_positions(forced, layer, head, slice(150, n))
        assert (part.loc[("q0-q1", "all rows"), "numerator"],
                part.loc[("q0-q1", "all rows"), "support"]) == (len(a & b), 7)
        even, odd = (top_positions(greedy, layer, head, list(range(start, n, 2))) for start in (150, 151))
        assert part.loc[("q0-q0", "alternate rows"), "numerator"] == len(even & odd)
    # The two continuations differ, so their selections must not all coincide.
    assert (d.loc[(d.sinks == "kept") & (d.comparison == "different questions"), "value"] < 1).any()


def test_figures_follow_the_tables_any_layers_and_windows(traces, tmp_path):
    """Figures from tables of a 2-layer model with 4 prompt windows and 2 generation windows; no backend switch."""
    a = pd.concat([prompt_segments(t, segment=16, n_prompt_segments=4, sample=f"p{i}").assign(mode=m, table="a")
                   for i, (m, t) in enumerate(traces.items())])
    b = pd.concat([generation_consistency(t, obs_window=[8, 16], gen_segment=8, n_gen_segments=2,
                                          selection=["paper", "compressor"],
                                          sample=f"p{i}").assign(mode="generated", table="b")
                   for i, t in enumerate(traces.values())])
    raw = {"ab": pd.concat([a, b]).assign(split="dev", model="tiny-llama")}
    tables = findings_tables(raw, obs_window=8)
    for key in ("a", "b", "b_variants"):
        tables[key].to_csv(tmp_path / f"findings_{key}.csv", index=False)
    (tmp_path / "findings_run.json").write_text(json.dumps(dict(prompt_segment=16, gen_segment=8, obs_window=8)))
    backend = matplotlib.get_backend()
    written = sorted(p.name for p in draw(tmp_path, tmp_path))
    assert matplotlib.get_backend() == backend
    expected = {f"findings_{name}.{ext}" for name in ("a", "b", "b_windows", "b_selection", "heads")
                for ext in ("png", "html")}
    assert set(written) == expected | {"findings_a_teacher-forced.png", "findings_a_teacher-forced.html"}
    assert all((tmp_path / name).stat().st_size > 1000 for name in written)
    assert "tiny-llama" in (tmp_path / "findings_b.html").read_text()  # the title names the model of the tables


def test_figure_d_merges_identical_sink_panels_and_names_its_lines():
    rows = [dict(layer=layer, pair="q0-q1", comparison=c, voters=v, metric="overlap", sinks=s, numerator=5.0,
                 chance_numerator=0.5, support=10.0, sample=f"doc{i}", split="dev", model="m")
            for layer in range(3) for c, v in (("different questions", "all rows"), ("same question", "alternate rows"))
            for s in ("kept", "excluded") for i in range(3)]
    grid = figure_d(pd.DataFrame(rows), "generated", {})
    assert grid.columns == [("dev", "kept")] and "no document position is a sink" in grid.notes[("dev", "kept")]
    assert not any("window" in label for label in grid.hue_label.values())


def test_figure_panels_name_the_series_they_leave_out_and_the_ones_they_hide(tmp_path):
    from snapkv_lab.findings.findings_plots import Grid, _coinciding, _panel_title, draw_png

    summary = pd.DataFrame([dict(split="dev", sinks="kept", metric="recall", layer=layer, segment=w,
                                 defined=not (w == 2 and layer == 1), support=3 if (w == 2 and layer == 1) else 100,
                                 value=0.5, chance=0.1) for layer in range(4) for w in (1, 2)])
    grid = Grid(summary, "layer", "segment", "t", "layer", {1: "first", 2: "second"})
    assert "not drawn: second: layers 1" in _panel_title(grid, "dev", "kept", "recall").replace("\n", " ")
    lines = {"a": pd.Series([1.0, 1.0]), "b": pd.Series([1.0, 0.999]), "c": pd.Series([0.2, 0.3])}
    assert _coinciding(lines) == [["a", "b"]]
    assert draw_png(grid, tmp_path / "f.png").stat().st_size > 0  # the two series coincide: drawn with that note


def test_layer_helpers():
    assert layer_ranges([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"
    assert set(layer_groups(range(30)).values()) == {"layers 0-9", "layers 10-19", "layers 20-29"}
    assert set(layer_groups(range(7)).values()) == {"layers 0-2", "layers 3-4", "layers 5-6"}


@pytest.fixture(scope="module")
def chat_tokenizer():
    from transformers import AutoTokenizer

    from snapkv_lab.core.models import bundled_checkpoint

    return AutoTokenizer.from_pretrained(bundled_checkpoint())


def test_run_findings_stores_cells_and_resumes(chat_tokenizer, tmp_path, monkeypatch):
    """Both splits, every table with sample and split; a rerun captures nothing and writes the same tables; a
    lost cell is the only one rerun."""
    from snapkv_lab.findings import experiments
    from snapkv_lab.tasks.prompts import load_recipes

    model = make_tiny_llama(vocab_size=len(chat_tokenizer), max_position_embeddings=2048)
    recipes = load_recipes()
    recipes["chat"].update(turn_tokens=40, continuation_tokens=16)
    recipes["qa"]["doc_tokens"] = 80
    (tmp_path / "prompt_recipes.json").write_text(json.dumps(recipes))
    options = dict(samples=1, placement_documents=1, dependence_documents=1, questions=2, obs_windows=(8, 16),
                   obs_window=8, prompt_segment=8, n_prompt_segments=3, gen_segment=4, n_gen_segments=2,
                   qa_new_tokens=6)
    calls = []
    real_capture = experiments.capture
    monkeypatch.setattr(experiments, "capture",
                        lambda *a, **k: calls.append(1) or real_capture(*a, progress=False, **k))
    first = run_findings(model, chat_tokenizer, data_dir=tmp_path, **options)
    assert len(calls) == 2 * (1 + 2 + 2)  # per split: 1 chat, (c) front and back, (d) 2 questions at the back
    for key, table in first.items():
        assert set(table["split"]) == {"dev", "heldout"} and table.groupby("split")["sample"].nunique().eq(1).all(), key
    written = {key: (tmp_path / f"findings_{key}.csv").read_text() for key in first}
    calls.clear()
    run_findings(model, chat_tokenizer, data_dir=tmp_path, **options)
    assert not calls and written == {key: (tmp_path / f"findings_{key}.csv").read_text() for key in first}
    next((tmp_path / "cells" / "findings").glob("*.parquet")).unlink()
    run_findings(model, chat_tokenizer, data_dir=tmp_path, **options)
    assert 0 < len(calls) <= 2 and written == {key: (tmp_path / f"findings_{key}.csv").read_text() for key in first}


def test_run_findings_refuses_unknown_modes(tiny, byte_tokenizer, tmp_path):
    with pytest.raises(ValueError, match="modes must be"):
        run_findings(tiny, byte_tokenizer, data_dir=tmp_path, modes=("sampled",))
