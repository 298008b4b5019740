"""Score against bytes (pressure.score_bytes): every row's bytes are the bytes its cache holds, counted three ways (the
cache the policy builds on its own, the storages of its tensors, positions x channels x bits from the papers' layout);
the axes; resuming skips the needles done; the figure drawn from a table. Tiny random model, byte tokenizer."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
import torch

from snapkv_lab import KIVI, Merging, SnapKV, ThinK, compress
from snapkv_lab.compression.layers import cache_bytes
from snapkv_lab.policies import FullCache, KVzip, StreamingLLM
from snapkv_lab.pressure import score_bytes, wilson
from snapkv_lab.pressure.grid import build_context
from snapkv_lab.pressure.score_bytes import PLAN, axis, needle_rows, read_table, short_label, study
from snapkv_lab.pressure.score_bytes_plots import draw, markdown, summary
from tests.conftest import make_tiny_llama
from tests.test_storage import F32, _expected_bytes, _held_bytes

LENGTH = 500  # bytes of the tiny needles: room for the frame, needle, question and a haystack
SPEC = dict(builder="needle", n_tokens=LENGTH, depth=0.5, sample=0)
# (policy, its layout for _expected_bytes: share of positions kept, ThinK's pruned ratio, bits, KIVI residual)
CASES = {
    "eviction": (SnapKV(capacity=0.5), dict(share=0.5)),
    "merging": (Merging(capacity=0.5), dict(share=0.5)),
    "channels": (ThinK(key_channel_ratio=0.5), dict(ratio=0.5)),
    "quantization": (KIVI(key_bits=4, value_bits=4, residual_length=32),
                     dict(key_bits=4, value_bits=4, residual=32)),
    "combined": (KIVI(policy=ThinK(key_channel_ratio=0.25), capacity=0.5, residual_length=32),
                 dict(share=0.5, ratio=0.25, key_bits=2, value_bits=2, residual=32)),
}


def test_axes_and_labels():
    assert axis(FullCache()) == "full"
    assert {name: axis(policy) for name, (policy, _) in CASES.items()} == {name: name for name in CASES}
    assert axis(ThinK(capacity=0.5)) == axis(KIVI(capacity=0.25)) == "combined"
    assert axis(KIVI(policy=Merging(), capacity=0.5)) == "combined"
    assert {axis(p) for p in PLAN} == {"eviction", "merging", "channels", "quantization", "combined"}
    triple = KIVI(policy=ThinK(), capacity=0.25, key_bits=4, value_bits=4)
    assert short_label(triple) == "SnapKV 0.25 + ThinK 0.4 + KIVI-4"
    assert short_label(KIVI(key_bits=4, value_bits=2)) == "KIVI K4/V2"
    assert short_label(Merging(capacity=0.5)) == "SnapKV 0.5 + Merging"
    assert short_label(FullCache()) == "FullCache"
    with pytest.raises(ValueError, match="no axis"):
        axis(SnapKV(capacity=None))
    assert len({p.label for p in PLAN}) == len(PLAN)


def test_reported_bytes_are_the_bytes_each_cache_holds(byte_tokenizer):
    """Each row's kv_bytes equals cache_bytes of the cache the policy builds by itself on the same prompt (the context
    and question query-aware, the context alone query-agnostic), the bytes of the storages its tensors hold (a
    zeroed or padded full-size tensor would count whole) and positions x channels x bits of the papers' layout; the
    full cache's row is the full_bytes of every row of its prompt length."""
    model = make_tiny_llama()
    context = build_context(byte_tokenizer, SPEC)
    table = needle_rows(model, byte_tokenizer, SPEC, [policy for policy, _ in CASES.values()], max_new_tokens=2)
    prompts = {"query-aware": context.context_ids + context.queries[0].question_ids,
               "query-agnostic": context.context_ids}
    per_position = 2 * 2 * 16 * 2 * F32  # layers x KV heads x head_dim x (key, value) x fp32
    full = table[table["mode"] == "full"].iloc[0]
    assert full.kv_bytes == full.full_bytes == len(prompts["query-aware"]) * per_position and full.axis == "full"
    for name, (policy, layout) in CASES.items():
        for mode, ids in prompts.items():
            row = table[(table.label == policy.label) & (table["mode"] == mode)].iloc[0]
            with torch.inference_mode(), compress(model, policy) as state:
                model(torch.tensor([ids]), past_key_values=state.cache)
            n = len(ids)
            kept = math.floor(layout.get("share", 1.0) * n)  # a float capacity keeps floor(share x n)
            expected = _expected_bytes(kept, 16, **{k: v for k, v in layout.items() if k != "share"})
            assert row.kv_bytes == cache_bytes(state.cache) == _held_bytes(state.cache) == expected, (name, mode)
            assert row.full_bytes == n * per_position
            assert row.bytes_share == pytest.approx(expected / (n * per_position))
            assert row.axis == name and row.short == short_label(policy)
    quantized = table[table.axis == "quantization"]
    assert (quantized.kv_share == 1.0).all() and (quantized.bytes_share < 0.3).all()  # every position, fewer bytes


def test_study_resumes_and_refuses(byte_tokenizer, tmp_path, monkeypatch):
    model = make_tiny_llama()
    kwargs = dict(samples=1, length=LENGTH, modes=("query-aware",), max_new_tokens=2, progress=False)
    trial = study(model, byte_tokenizer, tmp_path, policies=[SnapKV(capacity=0.5)], needles=1, **kwargs)
    assert len(trial) == 2 and trial.depth.tolist() == [0.0, 0.0]
    first = study(model, byte_tokenizer, tmp_path, policies=[SnapKV(capacity=0.5)], **kwargs)
    assert len(first) == 5 * 2 and sorted(first.depth.unique()) == [0.0, 0.25, 0.5, 0.75, 1.0]
    runs = json.loads((tmp_path / score_bytes.RUN).read_text())
    assert [run["needles_done"] for run in runs] == [1, 5] and runs[1]["length"] == LENGTH  # each run's record
    calls = []
    real = score_bytes.needle_rows
    monkeypatch.setattr(score_bytes, "needle_rows",
                        lambda *args, **kw: calls.append([p.label for p in args[3]]) or real(*args, **kw))
    again = study(model, byte_tokenizer, tmp_path, policies=[SnapKV(capacity=0.5)], **kwargs)
    assert calls == [] and again.equals(first)
    assert read_table(tmp_path / score_bytes.TABLE).equals(first)
    more = study(model, byte_tokenizer, tmp_path, policies=[SnapKV(capacity=0.5), KIVI(residual_length=32)], **kwargs)
    assert calls == [["KIVI(residual_length=32)"]] * 5  # only the missing policy runs, on each needle
    assert len(more) == 5 * 3 and not more.duplicated(["depth", "sample", "mode", "label"]).any()
    pd.testing.assert_frame_equal(read_table(tmp_path / score_bytes.TABLE), more)
    for bad in ([FullCache()], [SnapKV(capacity=0.5)] * 2, [SnapKV(capacity=None)]):
        with pytest.raises(ValueError):
            study(model, byte_tokenizer, tmp_path, policies=bad, **kwargs)
    with pytest.raises(ValueError, match="a data folder of its own"):  # not mixed into a table of another length
        study(model, byte_tokenizer, tmp_path, policies=[SnapKV(capacity=0.5)], **{**kwargs, "length": 450})


def _made_up_table() -> pd.DataFrame:
    """A table as the study writes it, answers made up: 5 needles, the full cache and three policies, both modes."""
    rows = []
    policies = [FullCache(), KVzip(capacity=0.25), StreamingLLM(capacity=0.25), KIVI(key_bits=4, value_bits=4)]
    for needle in range(5):
        for policy in policies:
            for mode in ("full",) if isinstance(policy, FullCache) else ("query-aware", "query-agnostic"):
                share = {"full": 1.0, "eviction": 0.25, "quantization": 0.14 + 0.01 * needle}[axis(policy)]
                found = needle < {"FullCache": 5, "KVzip@0.25": 4, "StreamingLLM@0.25": 1}.get(policy.label, 3)
                rows.append(dict(model="tiny", length=4000, depth=needle / 4, sample=0, mode=mode,
                                 policy=policy.scorer_label, label=policy.label,
                                 short=short_label(policy), axis=axis(policy), correct=found, exact=found,
                                 kv_bytes=round(share * 1000), full_bytes=1000, bytes_share=share,
                                 kv_share=1.0 if axis(policy) == "quantization" else share))
    return pd.DataFrame(rows)


def test_summary_and_figure_from_a_table(tmp_path):
    table = _made_up_table()
    points = summary(table)
    assert list(points["mode"].unique()) == ["query-aware", "query-agnostic"]
    assert len(points) == 2 * 4  # the full cache in each mode's panel
    kvzip = points[(points.label == "KVzip@0.25") & (points["mode"] == "query-aware")].iloc[0]
    assert (kvzip.found, kvzip.asked, kvzip.share_found) == (4, 5, 0.8)
    assert (kvzip.low, kvzip.high) == pytest.approx(wilson(4, 5))
    kivi = points[points.axis == "quantization"].iloc[0]
    assert (kivi.bytes_share, kivi.bytes_share_min, kivi.bytes_share_max) == pytest.approx((0.16, 0.14, 0.18))
    table.to_csv(tmp_path / score_bytes.TABLE, index=False)
    written = draw(tmp_path, tmp_path)
    assert [p.name for p in written] == ["score_bytes.png", "score_bytes.html"]
    assert all(p.stat().st_size > 0 for p in written)
    assert "KVzip 0.25" in (tmp_path / "score_bytes.html").read_text()
    assert len(pd.read_csv(tmp_path / "score_bytes_summary.csv")) == 8
    assert draw(tmp_path / "empty", tmp_path) == []
    text = markdown(table)
    assert text.index("**query-aware**") < text.index("**query-agnostic**")
    assert "| KVzip 0.25 | eviction | 0.250 [0.250, 0.250] | 0.0 | 0.250 | 4/5 [0.38, 0.96] |" in text
    assert "| KIVI-4 | quantization | 0.160 [0.140, 0.180] | 0.0 | 1.000 | 3/5 [0.23, 0.88] |" in text
