"""KV entries held (compression.entries): the budget's unit, counted for every policy, against counts made here from
the kept positions and the model's shape; matched totals at every ratio; an excess flagged; sliding layers and padded
batches counted as their own batch-1 runs."""

from __future__ import annotations

import pytest
import torch
from conftest import ByteTokenizer, make_tiny_llama
from families import FAMILIES, SLIDING_WINDOW, sliding_layers

import snapkv_lab
from snapkv_lab.policies import NO_POSITION

N = 160
NAMES = sorted(set(snapkv_lab.POLICIES) - {"FullCache"})


@pytest.fixture(scope="module")
def model():
    return make_tiny_llama(initializer_range=0.3, num_hidden_layers=3)


def prompt(n=N, seed=0):
    return torch.randint(2, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def kept_count(run) -> int:
    """Entries counted from the kept positions themselves: every layer's held slots, over its heads."""
    return sum(int((kept != NO_POSITION).sum()) for kept in run.kept_indices)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("capacity", [0.25, 0.5])
def test_every_policy_holds_its_budget_in_entries(name, capacity, model):
    """With one new token (no decode step), the entries are the kept positions' count; their share of layers x KV
    heads x N is the capacity within one entry per head of rounding, and no row is flagged."""
    config = model.config
    run = snapkv_lab.generate(model, ByteTokenizer(), prompt(), policy=snapkv_lab.POLICIES[name](capacity=capacity),
                              max_new_tokens=1)
    heads = config.num_hidden_layers * config.num_key_value_heads
    assert run.kv_entries == kept_count(run)
    assert run.kv_share == pytest.approx(run.kv_entries / (heads * N))
    # its own decision, counted against the full cache (tests/test_layerwise.py)
    if not run.policy.capacity_sets_entries:
        assert run.entries.budget_share == 1.0 and not run.entries.over_budget
        return
    assert run.entries.budget_share == pytest.approx(capacity)
    assert abs(run.kv_entries - capacity * heads * N) <= heads
    assert not run.entries.over_budget


def test_the_full_cache_is_the_whole_prompt_and_a_per_query_head_layout_is_flagged(model):
    """The full cache holds layers x KV heads x N entries; SnapKV keeping one selection per query head holds the GQA
    group's copies (4 query heads over 2 KV heads: twice its budget) and is flagged over budget."""
    config = model.config
    full = snapkv_lab.generate(model, ByteTokenizer(), prompt(), max_new_tokens=1)
    assert full.kv_entries == config.num_hidden_layers * config.num_key_value_heads * N and full.kv_share == 1
    group = config.num_attention_heads // config.num_key_value_heads
    assert group == 2
    wide = snapkv_lab.generate(model, ByteTokenizer(), prompt(), max_new_tokens=1,
                               policy=snapkv_lab.SnapKV(capacity=0.25, per_query_head=True))
    assert wide.kv_entries == kept_count(wide) and wide.kv_share == pytest.approx(group * 0.25, abs=0.01)
    assert wide.entries.over_budget and wide.entries.columns()["over_budget"]


def test_sliding_layers_count_their_own_window_in_the_full_cache_and_the_budget():
    """Gemma 3's sliding layers hold their last sliding_window - 1 positions under every policy: the uncompressed
    cache's count and the budget's hold them whole, so the share is (full layers' budget + windows) / (full layers'
    prompt + windows)."""
    model = FAMILIES["gemma3-sliding"]()
    config = model.config
    slides = sliding_layers(config)
    run = snapkv_lab.generate(model, ByteTokenizer(), prompt(n=120),
                              policy=snapkv_lab.SnapKV(capacity=0.5, window_size=8), max_new_tokens=1)
    window = (SLIDING_WINDOW - 1) * config.num_key_value_heads
    full_layers = config.num_hidden_layers - len(slides)
    expected_full = full_layers * config.num_key_value_heads * 120 + len(slides) * window
    assert sum(run.entries.full[0]) == expected_full
    assert [run.entries.held[0][i] for i in sorted(slides)] == [window] * len(slides)
    assert run.kv_entries == full_layers * config.num_key_value_heads * 60 + len(slides) * window
    assert run.kv_share == pytest.approx(run.kv_entries / expected_full) and not run.entries.over_budget


def test_a_padded_batch_counts_each_row_as_its_batch_1_run(model):
    """Rows of different lengths: each row's entries (pads and fill not counted) equal its own batch-1 run's."""
    prompts = [prompt(n=140, seed=1)[0].tolist(), prompt(seed=2)[0].tolist()]
    policy = snapkv_lab.AdaKV(capacity=0.25)
    batch = snapkv_lab.generate(model, ByteTokenizer(), prompts, policy=policy, max_new_tokens=1)
    for row, ids in zip(batch.rows(), prompts, strict=True):
        single = snapkv_lab.generate(model, ByteTokenizer(), torch.tensor([ids]), policy=policy, max_new_tokens=1)
        assert row.entries.held == single.entries.held and row.entries.full == single.entries.full
        assert row.kv_entries == kept_count(single)
