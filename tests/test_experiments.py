"""The four experiments on a tiny GQA Llama: tidy tables, an end-to-end check against eager attention, both
modes, and the figures drawn from the tables."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from conftest import ByteTokenizer, eager_twin, make_tiny_llama

from snapkv_lab import capture
from snapkv_lab.experiments import (draw, generation_consistency, prompt_windows, question_dependence,
                                    question_placement, run_findings)
from snapkv_lab.metrics import THETA


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


def test_experiment_tables_are_tidy(traces):
    trace = traces["generated"]
    a = prompt_windows(trace, window=16, n_windows=5)
    assert set(a["window"]) == {-1, -2, -3, -4, -5} and set(a["metric"]) == {"hit_rate", "recall"}
    assert len(a) == 2 * 5 * 4 * 2 * 2  # layers x windows x heads x metrics x sink variants
    b = generation_consistency(trace, obs_window=8, gen_window=8, n_gen_windows=3)
    assert set(b["window"]) == {1, 2, 3} and "coarse" in set(b["metric"])
    assert ((b["value"].isna()) | ((b["value"] >= 0) & (b["value"] <= 1))).all()
    assert (b.loc[b["support"] < 5, "value"].isna()).all()  # undefined, never 0 or 1
    with pytest.raises(ValueError, match="needs a prompt of more than"):
        prompt_windows(trace, window=64, n_windows=20)


def test_generation_consistency_equals_eager_by_hand(tiny, traces):
    """Layer 1, head 2, first generated window: the hit rate rebuilt from transformers' eager attention."""
    trace = traces["generated"]
    n, obs, layer, head = trace.prompt_len, 8, 1, 2
    with torch.no_grad():
        attn = eager_twin(tiny)(trace.token_ids[None], output_attentions=True).attentions[layer][0, head]
    prefix = n - obs
    k = max(1, int(0.05 * prefix))
    selected = set(torch.topk(attn[prefix:n, :prefix].sum(0), k).indices.tolist())
    rows = attn[n : n + 8, :prefix]
    above = [(r, p) for r in range(rows.shape[0]) for p in range(prefix) if rows[r, p] > THETA]
    hits = sum(p in selected for _, p in above)
    table = generation_consistency(trace, obs_window=obs, gen_window=8, n_gen_windows=1)
    row = table[(table.layer == layer) & (table["head"] == head) & (table.metric == "hit_rate") & (table.sinks == "kept")]
    assert (row["numerator"].item(), row["support"].item()) == (hits, len(above))
    assert row["chance"].item() == pytest.approx(k / prefix) if len(above) >= 5 else pd.isna(row["chance"].item())
    recall = table[(table.layer == layer) & (table["head"] == head) & (table.metric == "recall") & (table.sinks == "kept")]
    expected = (rows[:, sorted(selected)].sum(1) / rows.sum(1)).mean()
    assert recall["value"].item() == pytest.approx(expected.item(), abs=1e-5)


def test_question_placement_and_dependence(tiny, traces):
    c = question_placement({"front": [traces["generated"]], "back": [traces["teacher-forced"]]}, obs_window=8)
    assert set(c["placement"]) == {"front", "back"} and set(c["window"]) == {1}
    greedy, forced = traces["generated"], traces["teacher-forced"]
    d = question_dependence([greedy, forced], (10, 150), [150, 150])
    assert set(d["window"]) == {"q0-q1", "q1-q0"}
    assert d["chance"].dropna().between(0.04, 0.06).all()  # 7 of 140 positions, sinks kept or excluded

    def top_positions(trace, layer, head):  # rows 150.. vote on document positions 10..149, top 5% = 7
        with torch.no_grad():
            attn = eager_twin(tiny)(trace.token_ids[None], output_attentions=True).attentions[layer][0, head]
        return set(attn[150:, 10:150].sum(0).topk(7).indices.tolist())

    for layer, head in ((0, 1), (1, 3)):
        a, b = top_positions(greedy, layer, head), top_positions(forced, layer, head)
        row = d[(d.layer == layer) & (d["head"] == head) & (d.window == "q0-q1") & (d.sinks == "kept")]
        assert (row["numerator"].item(), row["support"].item()) == (len(a & b), 7)
    # The two continuations differ, so their selections must not all coincide.
    assert (d.loc[d.sinks == "kept", "value"] < 1).any()


def test_draw_writes_one_figure_per_experiment_and_mode(traces, tmp_path):
    for key, make in {"a": lambda t: prompt_windows(t, window=16, n_windows=4),
                      "b": lambda t: generation_consistency(t, obs_window=8, gen_window=8, n_gen_windows=2)}.items():
        tables = [make(t).assign(mode=mode) for mode, t in traces.items()]
        pd.concat(tables).to_csv(tmp_path / f"findings_{key}.csv", index=False)
    names = sorted(p.name for p in draw(tmp_path, tmp_path))
    assert names == sorted(f"findings_{k}{s}.{e}" for k in "ab" for s in ("", "_teacher-forced") for e in ("png", "html"))
    assert all((tmp_path / name).stat().st_size > 1000 for name in names)


def test_run_findings_refuses_unknown_modes(tiny, byte_tokenizer, tmp_path):
    with pytest.raises(ValueError, match="modes must be"):
        run_findings(tiny, byte_tokenizer, data_dir=tmp_path, modes=("sampled",))
