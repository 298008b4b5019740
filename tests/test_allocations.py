"""The allocation wrappers, each over a scorer it was not written for, against plain references written from the
official code: PyramidAllocation (PyramidKV's layer budgets: Zefan-Cai/KVCache-Factory pyramidkv_utils.py,
PyramidKVCluster.update_kv, and kvpress 0.5.5 pyramidkv_press.py get_layer_budget), GlobalAllocation (KVzip's one
selection over all layers and heads: kvpress 0.5.5 kvzip_press.py:384-387; snu-mllab/KVzip attention/score.py:88-102
thresholds the same way), DuoAllocation (DuoAttention's head split: mit-han-lab/duo-attention duo_attn/utils.py,
sparsify_attention_heads); each holding the uniform allocation's KV entries at the same ratio; and the compositions that
cannot be built, refused with the reason."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import ByteTokenizer, make_tiny_llama
from test_budgets import pyramid_budgets
from test_head_budgets import kv_gates, official_duo_kept, official_pattern_within, scored

import snapkv_lab as C
from snapkv_lab.policies import parse_policy
from snapkv_lab.policies.base import LayerBudget

N, LAYERS = 400, 3


@pytest.fixture(scope="module")
def model():
    return make_tiny_llama(initializer_range=0.3, num_hidden_layers=LAYERS)


def prompt(n=N, seed=0):
    return torch.randint(2, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def kept_sets(run) -> list[list[set[int]]]:
    """[layer][KV head] the kept positions of a batch-1 run."""
    return [[set(row[row >= 0].tolist()) for row in kept[0]] for kept in run.kept_indices]


def key_norms(model, ids) -> torch.Tensor:
    """(layers, KV heads, n) the L2 norms of the post-RoPE keys the full cache holds after a plain forward."""
    cache = model(ids, use_cache=True).past_key_values
    return torch.stack([layer.keys[0].float().norm(dim=-1) for layer in cache.layers])


def kvpress_pyramid_budget(n, kept, window, layer, layers, beta=20):
    """kvpress 0.5.5 PyramidKVPress.get_layer_budget (pyramidkv_press.py:47-86), its window_size our kept tail and its
    q_len * (1 - compression_ratio) our budget `kept`: the same line in floats over the whole budget, the window inside
    each layer's count."""
    max_capacity_prompt = window + kept
    min_num = (max_capacity_prompt - window) / beta
    max_num = (max_capacity_prompt - window) * 2 - min_num
    if max_num >= n - window:
        max_num = n - window
        min_num = (max_capacity_prompt - window) * 2 - max_num
    if not (n >= max_num >= min_num >= window):
        return max(1, round(kept))
    steps = (max_num - min_num) / (layers - 1)
    return round(max_num - layer * steps)


# ----- PyramidAllocation ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("n, budget, tail", [(4096, 2048, 0), (4096, 1024, 32), (4096, 3072, 0), (1000, 250, 8),
                                             (400, 100, 8), (400, 300, 0)])
def test_pyramid_budgets_are_the_official_and_kvpress_lines(n, budget, tail):
    """Each layer's budget, on 30 layers, under either schedule: the official integers (the fallback to the flat
    budget included) and kvpress's floats; kvpress's hold the uniform total to rounding, the official's floored step
    keeps a little more."""
    inner = C.SnapKV(window_size=tail) if tail else C.KNorm()
    paper = C.PyramidAllocation(policy=inner)
    kvpress = C.PyramidAllocation(policy=inner, schedule="kvpress")
    at = [LayerBudget(n, 3, layer, 30, budget) for layer in range(30)]
    official = [paper.layer_budget(b) for b in at]
    assert official == pyramid_budgets(budget, tail, 30, n)
    lines = [kvpress.layer_budget(b) for b in at]
    assert lines == [kvpress_pyramid_budget(n, budget, tail, layer, 30) for layer in range(30)]
    assert abs(sum(lines) - 30 * budget) <= 30 / 2
    assert 0 <= sum(official) - 30 * budget <= 29 * 30 / 2


def test_pyramid_over_snapkv_is_pyramidkv(model):
    """PyramidKV is SnapKV's votes under PyramidKV's budgets: the wrapper over SnapKV with PyramidKV's window keeps
    the same positions, under either schedule."""
    for schedule in ("paper", "kvpress"):
        ours = C.PyramidAllocation(policy=C.SnapKV(window_size=8), schedule=schedule, capacity=0.5)
        theirs = C.PyramidKV(schedule=schedule, capacity=0.5)
        a, b = (C.generate(model, ByteTokenizer(), prompt(seed=1), policy=p, max_new_tokens=1) for p in (ours, theirs))
        assert kept_sets(a) == kept_sets(b)
        assert len({len(s) for layer in kept_sets(a) for s in layer}) == LAYERS  # a budget per layer


def test_pyramid_over_knorm_keeps_each_layers_lowest_norms(model):
    """PyramidAllocation(KNorm): layer l keeps, per KV head, the official budget_l keys of lowest L2 norm (KNorm's rule,
    no kept tail), from a plain forward's cache."""
    ids, budget = prompt(seed=2), 200
    run = C.generate(model, ByteTokenizer(), ids, policy=C.PyramidAllocation(policy=C.KNorm(), capacity=budget),
                     max_new_tokens=1)
    norms = key_norms(model, ids)
    for layer, count in enumerate(pyramid_budgets(budget, 0, LAYERS, N)):
        expected = [set((-norms[layer, h]).topk(count).indices.tolist()) for h in range(norms.shape[1])]
        assert kept_sets(run)[layer] == expected, layer


# ----- GlobalAllocation -----------------------------------------------------------------------------------------

def kvpress_global_kept(scores: torch.Tensor, compression_ratio: float) -> list[list[set[int]]]:
    """kvpress KVzipPress.compress with layerwise=False (kvzip_press.py:384-387): the int(numel x ratio) lowest scores
    of all layers, heads and positions together are pruned. scores: (layers, KV heads, n). [layer][head] kept."""
    n_pruned = int(scores.numel() * compression_ratio)
    pruned = torch.topk(-scores.reshape(-1), n_pruned).indices
    kept = torch.ones(scores.numel(), dtype=torch.bool)
    kept[pruned] = False
    kept = kept.view(scores.shape)
    return [[set(kept[layer, h].nonzero().flatten().tolist()) for h in range(scores.shape[1])]
            for layer in range(scores.shape[0])]


@pytest.mark.parametrize("capacity", [0.25, 0.5])
def test_global_over_knorm_is_kvpress_global_selection(model, capacity):
    """GlobalAllocation(KNorm): kvpress's global pruning over the negated key norms of every layer and head; layers and
    heads keep different counts and the total is the uniform one."""
    ids = prompt(seed=3)
    run = C.generate(model, ByteTokenizer(), ids, policy=C.GlobalAllocation(policy=C.KNorm(), capacity=capacity),
                     max_new_tokens=1)
    assert kept_sets(run) == kvpress_global_kept(-key_norms(model, ids), 1 - capacity)
    assert len({len(s) for layer in kept_sets(run) for s in layer}) > 1
    uniform = C.generate(model, ByteTokenizer(), ids, policy=C.KNorm(capacity=capacity), max_new_tokens=1)
    assert run.kv_entries == uniform.kv_entries and not run.entries.over_budget


def test_global_over_kvzip_is_kvzips_own_global_allocation(model):
    """KVzip's allocation="global" (tests/test_kvzip.py checks it against kvpress and the official) is this wrapper over
    its uniform scorer."""
    ids = prompt(seed=4)
    ours = C.GlobalAllocation(policy=C.KVzip(allocation="uniform"), capacity=0.3)
    a, b = (C.generate(model, ByteTokenizer(), ids, policy=p, max_new_tokens=1) for p in (ours, C.KVzip(capacity=0.3)))
    assert kept_sets(a) == kept_sets(b)


def test_global_selection_compresses_after_the_prefill_only(model):
    policy = C.GlobalAllocation(policy=C.KNorm(), capacity=0.5)
    assert policy.compresses_after_prefill
    with pytest.raises(NotImplementedError, match="every layer's scores"):
        with C.compress(model, policy):
            pass


# ----- DuoAllocation --------------------------------------------------------------------------------------------

SINK, RECENT = 4, 12


def test_duo_over_streaming_is_duoattention():
    """DuoAttention's streaming heads keep sinks and recent tokens: StreamingLLM's order with sink_size sinks, under
    DuoAttention's split, keeps what DuoAttention keeps."""
    scores = [[0.05, 0.6, 0.0, 0.2], [0.3, 0.1, 0.45, 0.0], [0.2, 0.2, 0.9, 0.1]]
    model = scored(make_tiny_llama(initializer_range=0.3, num_hidden_layers=LAYERS), scores)
    ids = prompt(seed=5)
    ours = C.DuoAllocation(policy=C.StreamingLLM(sinks=SINK, kept_tail=0), sink_size=SINK, recent_size=RECENT,
                           capacity=0.3)
    theirs = C.DuoAttention(sink_size=SINK, recent_size=RECENT, capacity=0.3)
    a, b = (C.generate(model, ByteTokenizer(), ids, policy=p, max_new_tokens=1) for p in (ours, theirs))
    assert kept_sets(a) == kept_sets(b)
    full = official_pattern_within(kv_gates(scores, 2), N, int(0.3 * N), SINK, RECENT)
    reference = official_duo_kept(full, N, int(0.3 * N), SINK, RECENT)
    assert kept_sets(a) == [[set(row[row >= 0].tolist()) for row in layer] for layer in reference]


@pytest.mark.parametrize("hold_total", [False, True])
def test_duo_over_knorm_gives_full_heads_everything_and_the_others_knorms_top(hold_total):
    """The full heads (DuoAttention's, from the official split) keep the whole prompt; each streaming head keeps its s
    keys of lowest norm; under hold_total the streaming heads share exactly what the full heads leave of the uniform
    total, else the cache holds less than it by under one head's n - s."""
    scores = [[0.05, 0.6, 0.0, 0.2], [0.3, 0.1, 0.45, 0.0], [0.2, 0.2, 0.9, 0.1]]
    model = scored(make_tiny_llama(initializer_range=0.3, num_hidden_layers=LAYERS), scores)
    ids, capacity = prompt(seed=6), 0.3
    policy = C.DuoAllocation(policy=C.KNorm(), sink_size=SINK, recent_size=RECENT, capacity=capacity,
                             hold_total=hold_total)
    run = C.generate(model, ByteTokenizer(), ids, policy=policy, max_new_tokens=1)
    budget, s = int(capacity * N), SINK + RECENT
    official = official_duo_kept(official_pattern_within(kv_gates(scores, 2), N, budget, SINK, RECENT), N, budget,
                                 SINK, RECENT)
    full = [[int((row >= 0).sum()) == N for row in layer] for layer in official]
    heads, n_full = LAYERS * 2, sum(map(sum, full))
    assert 0 < n_full < heads
    norms = key_norms(model, ids)
    kept = kept_sets(run)
    counts = [len(kept[layer][h]) for layer in range(LAYERS) for h in range(2) if not full[layer][h]]
    if hold_total:
        assert sum(counts) + n_full * N == heads * budget and max(counts) - min(counts) <= 1
    else:
        assert counts == [s] * len(counts)
        assert 0 <= heads * budget - run.kv_entries < N - s
    for layer in range(LAYERS):
        for h in range(2):
            count = N if full[layer][h] else len(kept[layer][h])
            assert kept[layer][h] == set((-norms[layer, h]).topk(count).indices.tolist()), (layer, h)
    assert not run.entries.over_budget


# ----- matched totals and refusals ------------------------------------------------------------------------------

def test_every_allocation_holds_the_uniform_total(model):
    """Each allocation over SnapKV, at three ratios: the KV entries the uniform allocation holds, to rounding (AdaKV
    rounds each head's share: at most one entry per head less), never flagged over budget."""
    ids = prompt(seed=7)
    for capacity in (0.25, 0.5, 0.75):
        uniform = C.generate(model, ByteTokenizer(), ids, policy=C.SnapKV(window_size=8, capacity=capacity),
                             max_new_tokens=1)
        for text in ("PyramidAllocation(SnapKV(window_size=8), schedule='kvpress')", "AdaKV(SnapKV(window_size=8))",
                     "GlobalAllocation(SnapKV(window_size=8))", "HeadKV(SnapKV(window_size=8), redistribute=True)",
                     f"DuoAllocation(SnapKV(window_size=8), sink_size={SINK}, recent_size={RECENT}, hold_total=True)"):
            policy = dataclasses.replace(parse_policy(text), capacity=capacity)
            run = C.generate(model, ByteTokenizer(), ids, policy=policy, max_new_tokens=1)
            assert 0 <= uniform.kv_entries - run.kv_entries <= LAYERS * 2, (text, capacity)
            assert not run.entries.over_budget


@pytest.mark.parametrize("text, reason", [
    ("PyramidAllocation(PyramidKV)", "PyramidKV sets budgets of its own"),
    ("PyramidAllocation(AdaKV(KNorm))", "AdaKV(PyramidAllocation"),
    ("GlobalAllocation(AdaKV)", "AdaKV sets budgets of its own"),
    ("GlobalAllocation(HeadKV(KNorm))", "HeadKV sets budgets of its own"),
    ("DuoAllocation(DuoAttention)", "DuoAttention sets budgets of its own"),
    ("DuoAllocation(PyramidAllocation(KNorm))", "PyramidAllocation sets budgets of its own"),
    ("AdaKV(GlobalAllocation(KNorm))", "cannot be wrapped"),
    ("GlobalAllocation(CAKE)", "cannot be wrapped"),
    ("GlobalAllocation(KNorm, per_query_head=True)", "per_query_head"),
])
def test_a_combination_that_cannot_be_built_is_refused_with_its_reason(text, reason):
    with pytest.raises(ValueError, match=reason.replace("(", r"\(")) as error:
        parse_policy(text)
    assert "takes capacity" not in str(error.value)  # a refused composition, not an unknown setting


def test_a_per_head_allocation_outside_the_pyramid_composes(model):
    """AdaKV(PyramidAllocation(KNorm)): each layer holds its pyramid budget, shared among its heads by AdaKV."""
    policy = C.AdaKV(policy=C.PyramidAllocation(policy=C.KNorm()), capacity=200, alpha_safeguard=0.0)
    run = C.generate(model, ByteTokenizer(), prompt(seed=8), policy=policy, max_new_tokens=1)
    assert [sum(map(len, layer)) for layer in kept_sets(run)] == [2 * b for b in pyramid_budgets(200, 0, LAYERS, N)]
