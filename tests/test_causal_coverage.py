"""causal_coverage against sums worked by hand on small masks, and its bounds: coverage <= oracle, chance = the kept
share, on a policy's real selection."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from snapkv_lab.views.causal import causal_coverage


def effects(*rows):
    return pd.DataFrame(rows, columns=["start", "end", "kl"])


def test_shares_worked_by_hand():
    # 1 layer, 2 heads, 8 positions; spans [0,4) effect 3, [4,8) effect 1
    table = effects((0, 4, 3.0), (4, 8, 1.0))
    mask = torch.zeros(1, 2, 8, dtype=torch.bool)
    mask[0, 0, :4] = True  # head 0 keeps the first span, head 1 nothing: the first span half kept
    out = causal_coverage(table, mask)
    assert out["coverage"] == pytest.approx((3 * 0.5 + 1 * 0) / 4)
    assert out["chance"] == out["kept_share"] == pytest.approx(4 / 16)
    # 2 positions' worth kept: the oracle spends them on the first span (0.75 per position against 0.25)
    assert out["oracle"] == pytest.approx(3 * 2 / 4 / 4)
    assert out["total_effect"] == 4


def test_the_oracle_spills_into_the_next_span_and_bounds_coverage():
    table = effects((0, 2, 1.0), (2, 6, 2.0), (6, 8, 0.0))
    mask = torch.zeros(2, 1, 8, dtype=torch.bool)
    mask[:, 0, 1:5] = True  # 4 of 8 positions in both layers
    out = causal_coverage(table, mask)
    # per position: 0.5, 0.5, 0: the oracle takes span 0 (2 positions) then 2 of span 1's 4 (1.0 of its 2.0)
    assert out["oracle"] == pytest.approx((1.0 + 1.0) / 3)
    assert out["coverage"] == pytest.approx((1.0 * 0.5 + 2.0 * 0.75) / 3)
    assert out["coverage"] <= out["oracle"] + 1e-12  # here equal: this kept set is one of the oracle's ties
    with pytest.raises(ValueError, match="negative"):
        causal_coverage(table.assign(kl=[-1.0, 0, 0]), mask)
    with pytest.raises(ValueError, match="missing"):
        causal_coverage(table.assign(kl=[float("nan"), 0, 0]), mask)
    # overlapping spans would count positions 1-2's effect twice, and the oracle would fall below the coverage
    with pytest.raises(ValueError, match="disjoint"):
        causal_coverage(effects((0, 3, 1.0), (2, 6, 2.0)), mask)
    with pytest.raises(ValueError, match="covers 8 positions"):  # a mask shorter than the spans' context
        causal_coverage(table, mask, n_tokens=10)


def test_a_generation_results_kept_positions_are_read(byte_tokenizer):
    from conftest import make_tiny_llama

    import snapkv_lab

    model = make_tiny_llama(initializer_range=0.3, num_hidden_layers=2)
    ids = torch.randint(2, 256, (1, 96), generator=torch.Generator().manual_seed(0))
    run = snapkv_lab.generate(model, byte_tokenizer, ids, policy=snapkv_lab.StreamingLLM(capacity=0.5, kept_tail=8),
                              max_new_tokens=1)
    table = effects(*[(s, s + 16, float(i + 1)) for i, s in enumerate(range(0, 96, 16))])
    out = causal_coverage(table, run)
    assert out["kept_share"] == pytest.approx(0.5) and out["coverage"] <= out["oracle"] + 1e-9
