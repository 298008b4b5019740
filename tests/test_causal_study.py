"""The every-policy causal study on a tiny model: each row's causal coverage is causal_coverage of its policy's kept
mask against the stored span effects, StreamingLLM's kept set is its sinks and its tail, a rerun resumes; finding (e)'s
statistics against scipy's t interval and a hand-made table whose verdicts are known; the figure set draws."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import ByteTokenizer, make_tiny_llama
from scipy import stats

from snapkv_lab.findings import causal_finding
from snapkv_lab.views import causal_study
from snapkv_lab.views.causal import causal_coverage


@pytest.fixture(scope="module")
def studied(tmp_path_factory):
    data = tmp_path_factory.mktemp("causal")
    table = causal_study.study(make_tiny_llama(), ByteTokenizer(), data, prompts=1, length=400, block=64,
                               policies=["StreamingLLM", "SnapKV"], max_new_tokens=3, progress=False)
    return data, table


def test_rows_are_causal_coverage_of_each_kept_set(studied):
    data, table = studied
    effects = pd.read_csv(data / causal_study.EFFECTS)
    assert len(table) == 2 * 2 and set(table["mode"]) == {"query-aware", "query-agnostic"}
    row = table[(table.policy == "StreamingLLM@0.5") & (table["mode"] == "query-agnostic")].iloc[0]
    spans = effects[(effects.prompt == row.prompt) & (effects["mode"] == row["mode"])]
    n = int(spans.end.max())
    # StreamingLLM at half the context keeps its 4 sinks and the most recent positions, in every layer and KV head
    policy = causal_study.study_policies(make_tiny_llama(), ByteTokenizer(), ["StreamingLLM"])[0][0]
    budget = policy.budget(n)
    mask = torch.zeros(2, 2, n, dtype=torch.bool)
    mask[..., :policy.sinks] = True
    mask[..., n - (budget - policy.sinks):] = True
    expected = causal_coverage(spans, mask)
    assert row.coverage == pytest.approx(expected["coverage"]) and row.oracle == pytest.approx(expected["oracle"])
    assert row.kept_entries == int(mask.sum()) and row.context_entries == mask.numel()
    assert (table.coverage <= table.oracle + 1e-9).all() and table.chance.between(0, 1).all()
    assert (table.attention_coverage <= table.attention_oracle + 1e-6).all()


def test_a_rerun_skips_the_stored_cells(studied, monkeypatch):
    data, table = studied

    def refuse(*args, **kwargs):
        raise AssertionError("a stored cell was recomputed")

    with monkeypatch.context() as patch:
        patch.setattr(causal_study, "prompt_cells", refuse)
        again = causal_study.study(make_tiny_llama(), ByteTokenizer(), data, prompts=1, length=400,
                                   policies=["StreamingLLM", "SnapKV"], progress=False)
    assert len(again) == len(table)
    # a policy added later runs alone, on the stored prompts, and their effects are kept once
    more = causal_study.study(make_tiny_llama(), ByteTokenizer(), data, prompts=1, length=400,
                              policies=["StreamingLLM", "SnapKV", "H2O"], max_new_tokens=3, progress=False)
    assert sorted(more.policy) == ["H2O@0.5"] * 2 + ["SnapKV@0.5"] * 2 + ["StreamingLLM@0.5"] * 2
    effects = pd.read_csv(data / causal_study.EFFECTS)
    assert not effects.duplicated(["prompt", "mode", "start", "end"]).any()


def test_mean_interval_is_scipys_t_interval():
    values = np.array([0.2, 0.5, 0.1, 0.7, 0.4])
    out = causal_finding.mean_interval(values, margin=0.3)
    low, high = stats.t.interval(0.95, 4, loc=values.mean(), scale=stats.sem(values))
    assert (out["ci_low"], out["ci_high"]) == pytest.approx((low, high))
    assert out["p"] == pytest.approx(stats.ttest_1samp(values, 0).pvalue)
    # TOST: the larger of the two one-sided p values against +-0.3
    upper = stats.ttest_1samp(values, 0.3, alternative="less").pvalue
    lower = stats.ttest_1samp(values, -0.3, alternative="greater").pvalue
    assert out["tost_p"] == pytest.approx(max(upper, lower))


def _table(coverage_of, prompts=6, policies=8, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for prompt in range(prompts):
        attention = rng.uniform(0.2, 0.9, policies)
        for policy, a in enumerate(attention):
            rows.append(dict(prompt=prompt, mode="query-agnostic", policy=f"P{policy}", ratio=0.5, model="m",
                             full_correct=True, correct=True, attention_coverage=a, attention_low=0,
                             coverage=coverage_of(a, rng), oracle=1.0, chance=0.5, needle_kept=1.0))
    return pd.DataFrame(rows)


def test_verdicts_on_known_relations():
    monotone = causal_finding.relation(_table(lambda a, rng: a ** 2)).set_index("mode")
    assert monotone.loc["query-agnostic", "value"] == pytest.approx(1.0)
    assert monotone.loc["query-agnostic", "verdict"] == "predicts"
    inverted = causal_finding.relation(_table(lambda a, rng: 1 - a)).set_index("mode")
    assert inverted.loc["query-agnostic", "verdict"] == "inverted"
    unrelated = _table(lambda a, rng: rng.uniform(), prompts=40, policies=40, seed=3)
    assert causal_finding.relation(unrelated).set_index("mode").loc["query-agnostic", "verdict"] == "does not predict"
    # too few prompts and policies to show either
    few = _table(lambda a, rng: rng.uniform(), prompts=3, policies=5, seed=1)
    assert causal_finding.relation(few).set_index("mode").loc["query-agnostic", "verdict"] == "not shown either way"


def test_markdown_and_figure_set(studied, tmp_path):
    from snapkv_lab.core.figure_files import FIGURE_SETS
    from snapkv_lab.findings import causal_plots  # noqa: F401  (registers the set)

    data, table = studied
    assert FIGURE_SETS["causal"].draw(data, tmp_path) == []  # the random model answers nothing: no analysis
    with pytest.raises(ValueError, match="answers none"):
        causal_finding.markdown(table)
    table.assign(full_correct=True).to_csv(tmp_path / causal_study.TABLE, index=False)
    text = causal_finding.markdown(table.assign(full_correct=True))
    assert "| StreamingLLM@0.5 |" in text and "mean per-prompt rho" in text
    files = FIGURE_SETS["causal"].draw(tmp_path, tmp_path)
    assert sorted(path.name for path in files) == ["causal_coverage.html", "causal_coverage.png"]


def test_a_sliding_model_is_scored_on_its_compressed_layers(tmp_path):
    """On Gemma 3's layout (a sliding layer holds its last window - 1 positions under every policy and the full cache
    alike) the study evicts spans from, and reads kept masks and attention over, the full-attention layer only: its
    effects are span_effects with layers=[1] (not those of every layer), StreamingLLM's row is causal_coverage of its
    kept set in that layer, and the run's record names the layer."""
    from families import FULL, GEMMA_SCALE, GQA, SLIDING, SLIDING_WINDOW, make
    from transformers import Gemma3TextConfig

    from snapkv_lab.compression.span_effects import span_effects
    from snapkv_lab.tasks.needles import needle_context

    model = make(Gemma3TextConfig, sliding_window=SLIDING_WINDOW, layer_types=[SLIDING, FULL, SLIDING],
                 max_position_embeddings=1024, **GEMMA_SCALE, **GQA)
    assert causal_study.scored_layers(model) == [1] and causal_study.scored_layers(make_tiny_llama()) is None
    table = causal_study.study(model, ByteTokenizer(), tmp_path, prompts=1, length=400, policies=["StreamingLLM"],
                               modes=("query-agnostic",), max_new_tokens=3, progress=False)
    assert json.loads((tmp_path / causal_study.RUN).read_text())["scored_layers"] == [1]
    context = needle_context(ByteTokenizer(), 400, 0.25, sample=0)
    ids, question = torch.tensor([context.context_ids]), context.queries[0].question_ids
    n = ids.shape[1]
    run = dict(block=64, max_new_tokens=3, progress=False)
    effects = pd.read_csv(tmp_path / causal_study.EFFECTS)
    scored = span_effects(model, ByteTokenizer(), ids, question, layers=[1], **run)
    every = span_effects(model, ByteTokenizer(), ids, question, **run)
    assert effects.kl.to_numpy() == pytest.approx(scored.kl.to_numpy(), abs=1e-6)
    # the last block lies in the sliding layers' window: evicting it there too would change the answer's logits
    assert every.kl.iloc[-1] != pytest.approx(scored.kl.iloc[-1], abs=1e-6)
    policy = causal_study.study_policies(model, ByteTokenizer(), ["StreamingLLM"])[0][0]
    mask = torch.zeros(1, 2, n, dtype=torch.bool)  # the full layer's two KV heads: sinks and the recent positions
    mask[..., :policy.sinks] = True
    mask[..., n - (policy.budget(n) - policy.sinks):] = True
    row = table.iloc[0]
    assert row.context_entries == mask.numel() and row.kept_entries == int(mask.sum())
    assert row.coverage == pytest.approx(causal_coverage(effects, mask)["coverage"])


def test_no_policy_chooses_in_a_sliding_layer():
    """The premise of scoring the compressed layers only: on the tiny Gemma 3 layout, every policy the study builds
    there (those needing head scores of a longer context or shipped weights are skipped) leaves each sliding layer
    holding its last window - 1 positions, the full cache's, after a shared prefill."""
    from families import FULL, GEMMA_SCALE, GQA, SLIDING, SLIDING_WINDOW, make
    from transformers import Gemma3TextConfig

    from snapkv_lab.compression import SharedPrefill
    from snapkv_lab.compression.kept import kept_mask

    model = make(Gemma3TextConfig, sliding_window=SLIDING_WINDOW, layer_types=[SLIDING, FULL, SLIDING],
                 max_position_embeddings=1024, **GEMMA_SCALE, **GQA)
    policies, _ = causal_study.study_policies(model, ByteTokenizer(), ["all"])
    assert len(policies) >= 40
    ids = torch.randint(2, 250, (1, 200), generator=torch.Generator().manual_seed(0))
    shared = SharedPrefill.run(model, ByteTokenizer(), ids, policies)
    window = torch.zeros(2, 200, dtype=torch.bool)
    window[:, 200 - (SLIDING_WINDOW - 1):] = True
    for policy in policies:
        held = kept_mask(shared.state(policy), 200)
        assert torch.equal(held[0], window) and torch.equal(held[2], window), policy.label
        assert held[1].float().mean() < 1 or policy.label.startswith(("SimLayerKV", "DMS")), policy.label
