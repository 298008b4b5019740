"""The policies that budget by heads from the model's retrieval scores, each against a plain reference written from
its official code, with the scores handed to it: HeadKV (FYYFU/HeadKV at 3ec9653, headkv/snapkv_utils.py,
ReasonSnapKVCluster: the capacities in __init__, the per-head top-k plus window in update_kv) over transformers'
eager attention maps, and DuoAttention (mit-han-lab/duo-attention at 03dca84: full heads by the `sparsity` quantile
of their gates over all layers, duo_attn/utils.py:353-373; streaming heads' first sink_size and last recent_size
tokens, duo_attn/patch/static_kv_cache.py:127-160)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import ByteTokenizer, make_tiny_llama
from reference import eager_attentions, official_capacities

import snapkv_lab as C
from snapkv_lab.compression.packed import PackedHeadwiseLayer
from snapkv_lab.compression.reference import masked_decode
from snapkv_lab.core.hooks import intercept_attention, model_eager_function, returned_cache, with_cache
from snapkv_lab.policies import headkv, policy_config, policy_from_config, retrieval_heads, upgrade_config

WINDOW, CAPACITY, N = 8, 40, 96  # WINDOW: the official LongBench run's (FYYFU/HeadKV at 0862a09, run_longbench.py:217)


def scored(model, scores):
    """`model` with retrieval scores (layers, query heads) handed in, as if measured (a named model: conftest's
    synthetic scores are for unnamed ones)."""
    model.config.name_or_path = "tiny-with-scores"
    retrieval_heads._GRIDS[model] = torch.as_tensor(scores, dtype=torch.float64)
    return model


def official_kept(model, ids, capacities):
    """Per layer (kv_heads, widest) kept positions, -1 padded: SnapKV's window votes (the mean of the last WINDOW rows
    of the eager maps over the prefix, max-pooled with kernel 7) per query head, each KV head ranking by its query
    heads' mean vote and keeping the mean of their capacities (the official's per query head, reduced as the lab's
    GQA-aware SnapKV and AdaKV reduce), its top positions, then the window."""
    prefix = ids.shape[1] - WINDOW
    kept = []
    for layer, attn in enumerate(eager_attentions(model, ids)):  # (1, heads, n, n)
        votes = F.max_pool1d(attn[0, :, -WINDOW:, :prefix].mean(1)[:, None], 7, stride=1, padding=3)[:, 0]
        kv = model.config.num_key_value_heads
        votes = votes.view(kv, -1, prefix).mean(1)
        caps = torch.round(torch.tensor(capacities[layer], dtype=torch.float64).view(kv, -1).mean(1))
        rows = []
        for head_votes, cap in zip(votes, caps.long().clamp(max=prefix).tolist()):
            top = head_votes.topk(cap).indices.sort().values
            rows.append(torch.cat([top, torch.arange(prefix, ids.shape[1])]))
        widest = max(len(r) for r in rows)
        kept.append(torch.stack([F.pad(r, (0, widest - len(r)), value=-1) for r in rows]))
    return kept


def test_the_default_is_the_official_run_and_the_former_window_is_named():
    """The official run sets SnapKV's window to 8, kernel 7, max pooling (run_longbench.py:217-226, over the cluster's
    own default of 32): HeadKV() is that. The former default (window 32) keeps a label of its own, which reads back
    as the same policy (committed tables computed with it carry that label)."""
    inner = C.HeadKV().policy
    assert (type(inner), inner.window_size, inner.kernel_size, inner.pooling) == (C.SnapKV, WINDOW, 7, "max")
    assert (C.HeadKV().beta, C.HeadKV().temperature) == (1.005, 1.0)  # head_start_llama3.sh: betas[0], temp=1
    assert C.HeadKV(policy=C.SnapKV(window_size=8)).label == C.HeadKV().label == "HeadKV@1024"
    former = C.HeadKV(policy=C.SnapKV(), redistribute=True)
    assert former.scorer_label == "HeadKV(policy=SnapKV(window_size=32), redistribute=True)"
    assert C.policies.parse_policy(former.scorer_label) == dataclasses.replace(former, capacity=1024)
    assert C.AdaKV(policy=C.SnapKV(window_size=8)).scorer_label == "AdaKV(policy=SnapKV(window_size=8))"  # AdaKV's: 32


@pytest.mark.parametrize("beta,temperature", [(1.005, 1.0), (2.0, 1.0), (1.2, 2.0)])
def test_capacities_are_the_official_allocation(beta, temperature):
    scores = [[0.0, 0.4, 0.1, 0.05], [0.3, 0.0, 0.02, 0.9], [0.01, 0.2, 0.0, 0.0]]
    expected = official_capacities(scores, CAPACITY, WINDOW, beta, temperature)
    shares = headkv.head_shares(torch.tensor(scores), temperature)
    assert headkv.head_capacities(shares, CAPACITY - WINDOW, beta).tolist() == expected
    assert abs(sum(map(sum, expected)) - 12 * (CAPACITY - WINDOW)) <= 12 / 2  # the uniform total, up to rounding


@pytest.mark.parametrize("beta", [1.005, 1.5])
def test_each_head_keeps_its_top_positions_under_its_capacity(beta):
    scores = torch.tensor([[0.05, 0.6, 0.0, 0.2], [0.3, 0.1, 0.45, 0.0]], dtype=torch.float64)
    model = scored(make_tiny_llama(initializer_range=0.3), scores)  # peaked attention: few ties among votes
    ids = torch.randint(2, 256, (1, N), generator=torch.Generator().manual_seed(3))
    policy = C.HeadKV(capacity=CAPACITY, beta=beta)
    state_kept = C.generate(model, ByteTokenizer(), ids, policy=policy, max_new_tokens=1).kept_indices
    capacities = official_capacities(scores.tolist(), CAPACITY, WINDOW, beta, 1.0)
    for layer, reference in enumerate(official_kept(model, ids, capacities)):
        assert torch.equal(state_kept[layer][0], reference), layer
    held = torch.cat([(k[0] >= 0).sum(-1) for k in state_kept])  # per head, every layer
    assert held.max() > CAPACITY > held.min()  # the budget moved between heads and layers


def test_kv_bytes_stay_within_the_uniform_budget():
    model = scored(make_tiny_llama(), [[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 3.0]])
    ids = torch.randint(2, 256, (1, N), generator=torch.Generator().manual_seed(4))
    run = C.generate(model, ByteTokenizer(), ids, policy=C.HeadKV(capacity=CAPACITY), max_new_tokens=1)
    uniform = C.generate(model, ByteTokenizer(), ids, policy=C.SnapKV(capacity=CAPACITY, window_size=WINDOW),
                         max_new_tokens=1)
    # b = 32: 31 of it pooled over 8 heads (248), a floor of 1. Query heads: layer 0 head 0 gets
    # round(248 / 4 + 1) = 63, layer 1 head 3 round(3 * 248 / 4 + 1) = 187, the others 1. KV heads keep their pair's
    # mean: layer 0 32 and 1, layer 1 1 and 94, which passes its 88-position prefix: it keeps the prefix, the rest of
    # its share is lost (as officially), so the cache holds less than the uniform budget.
    held = [int((k[0] >= 0).sum()) for k in run.kept_indices]
    assert held == [32 + 1 + 2 * WINDOW, 1 + 88 + 2 * WINDOW]
    assert run.kv_bytes < uniform.kv_bytes


def test_a_model_whose_heads_score_nothing_is_refused():
    model = scored(make_tiny_llama(), torch.zeros(2, 4))
    ids = torch.randint(2, 256, (1, N), generator=torch.Generator().manual_seed(5))
    with pytest.raises(ValueError, match="retrieval scores"):
        C.generate(model, ByteTokenizer(), ids, policy=C.HeadKV(capacity=CAPACITY), max_new_tokens=1)
    with pytest.raises(ValueError, match="beta"):
        C.HeadKV(capacity=CAPACITY, beta=0.5)
    with pytest.raises(ValueError, match="per_query_head"):
        C.HeadKV(capacity=CAPACITY, per_query_head=True)
    assert math.isclose(float(headkv.head_shares(torch.tensor([[1.0, float("nan")]])).sum()), 1.0)


def official_full_heads(gates: np.ndarray, sparsity: float) -> np.ndarray:
    """(layers, KV heads) bool, the full-attention heads: duo_attn/utils.py:353-373 at 03dca84
    (sparsify_attention_heads) line by line. Noise below 1e-6 breaks ties (the official draws it from numpy's global
    generator; the gates here differ by more, so the draw changes nothing), the heads at or above the `sparsity`
    quantile of all gates are full, sparsity >= 1 makes none full and <= 0 all."""
    gates = gates + np.random.default_rng(0).uniform(0, 1e-6, gates.shape)
    threshold = np.quantile(gates, sparsity)
    if sparsity >= 1:
        threshold = 2
    if sparsity <= 0:
        threshold = -1
    return gates >= threshold


def official_pattern_within(gates: np.ndarray, n: int, budget: int, sink: int, recent: int) -> np.ndarray:
    """The official pattern at the least sparsity whose cache holds at most L K `budget` positions, a full head
    holding all n and a streaming one min(sink + recent, budget): the official sets the sparsity by hand
    (eval/LongBench/pred.py:49, 215-216), the lab's budget chooses it. Sparsities scanned in steps of 1e-3 (the count
    changes in steps of 1 / (heads - 1) of sparsity: 1/15 at the finest here)."""
    streaming = min(sink + recent, budget)
    for sparsity in np.linspace(0.0, 1.0, 1001):
        full = official_full_heads(gates, sparsity)
        if full.sum() * n + (~full).sum() * streaming <= gates.size * budget:
            return full
    raise AssertionError("no sparsity fits: even all-streaming heads pass the budget")


def kv_gates(scores, kv_heads: int) -> np.ndarray:
    """(layers, KV heads) gates from (layers, query heads) retrieval scores: a KV head's query heads' mean (kvpress's
    on-the-fly reduction, duo_attention_press.py:209), as the lab's stand-in for the learned gates."""
    scores = np.asarray(scores, dtype=float)
    return scores.reshape(scores.shape[0], kv_heads, -1).mean(-1)


def official_duo_kept(full: np.ndarray, n: int, budget: int, sink: int, recent: int):
    """Per layer (kv_heads, widest) kept positions, -1 padded: a full head keeps every position; a streaming one its
    first `sink` and last `recent` (duo_attn/patch/static_kv_cache.py:127-160 at 03dca84,
    compress_and_replace_streaming_kv, after the prefill). A budget short of sink + recent (the official sets none):
    the lab's documented split, floor(budget x sink / (sink + recent)) sinks and the rest recent."""
    if budget < sink + recent:
        sink = (budget * sink) // (sink + recent)
        recent = budget - sink
    kept = []
    for layer in full:
        rows = [list(range(n)) if is_full else list(range(sink)) + list(range(n - recent, n)) for is_full in layer]
        widest = max(map(len, rows))
        kept.append(torch.tensor([r + [-1] * (widest - len(r)) for r in rows]))
    return kept


@pytest.mark.parametrize("capacity,sink,recent", [(48, 4, 12), (0.5, 4, 20), (12, 4, 12), (20, 16, 0), (30, 128, 256)])
def test_duoattention_keeps_everything_in_its_best_heads_and_sinks_and_recent_in_the_others(capacity, sink, recent):
    scores = [[0.0, 0.7, 0.2, 0.1], [0.4, 0.5, 0.0, 0.0]]  # KV-head gates: layer 0 0.35 / 0.15, layer 1 0.45 / 0.0
    model = scored(make_tiny_llama(), scores)
    ids = torch.randint(2, 256, (1, N), generator=torch.Generator().manual_seed(6))
    policy = C.DuoAttention(capacity=capacity, sink_size=sink, recent_size=recent)
    run = C.generate(model, ByteTokenizer(), ids, policy=policy, max_new_tokens=2)
    budget = capacity if isinstance(capacity, int) else int(capacity * N)
    full = official_pattern_within(kv_gates(scores, 2), N, budget, sink, recent)
    for layer, reference in enumerate(official_duo_kept(full, N, budget, sink, recent)):
        assert torch.equal(run.kept_indices[layer][0], reference), layer
    held = sum(int((k[0] >= 0).sum()) for k in run.kept_indices)
    assert held <= 2 * 2 * budget  # layers x KV heads x budget: never more than the label's budget
    # and short of it by less than one head's n - s positions (heads are whole: the floor in full_count), the bound
    # evaluation.audit.BUDGET_DEPARTURES states for DuoAttention
    assert held > 2 * 2 * budget - (N - min(sink + recent, budget))


@pytest.mark.parametrize("seed", range(4))
def test_duoattention_chooses_its_full_heads_by_the_official_quantile_rule(seed):
    """On 4 layers x 4 KV heads of distinct random gates, at budgets from all-streaming to nearly all full: the heads
    DuoAttention keeps whole are the official rule's (official_full_heads) at the least sparsity the budget pays for."""
    generator = torch.Generator().manual_seed(seed)
    scores = torch.rand(4, 8, generator=generator, dtype=torch.float64)  # 8 query heads, 2 per KV head
    model = scored(make_tiny_llama(num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4), scores)
    gates = kv_gates(scores, 4)
    for capacity, sink, recent in [(24, 4, 12), (40, 4, 12), (56, 8, 8), (72, 4, 12), (90, 4, 12), (30, 16, 32)]:
        policy = C.DuoAttention(capacity=capacity, sink_size=sink, recent_size=recent)
        policy.prepare(model, None)
        expected = official_pattern_within(gates, N, capacity, sink, recent)
        assert policy.full_head_mask(N).numpy().tolist() == expected.tolist(), (seed, capacity)


def official_duo_decode(model, ids, full: np.ndarray, sink: int, recent: int, steps: int) -> torch.Tensor:
    """(1, steps) greedy tokens under the official DuoAttention cache (mit-han-lab/duo-attention at 03dca84,
    duo_attn/patch/llama.py:146-290, the tuple cache): the prefill attends the whole prompt in every head (:224-232);
    a streaming KV head's cache is then cut to its first `sink` and last `recent` positions (:273-290); at every step
    the new token is appended to it (:203-214), attended with it, and the cache cut back again. A full head keeps
    everything. Each streaming head's cache is kept here as a plain list of the positions it holds, and every step is
    eager attention over the whole cache with the positions outside that list hidden."""
    n = ids.shape[1]
    lists: dict[int, list] = {}

    def cut(held):
        return held if len(held) <= sink + recent else held[:sink] + held[len(held) - recent:]

    def attend(function, module, query, key, value, attention_mask, **kwargs):
        n_keys = key.shape[2]
        if n_keys <= n:
            return function(module, query, key, value, attention_mask, **kwargs)
        held = lists.setdefault(module.layer_idx, [None if whole else cut(list(range(n)))
                                                   for whole in full[module.layer_idx]])
        visible = torch.ones(len(held), n_keys, dtype=torch.bool)
        for head, positions in enumerate(held):
            if positions is not None:
                positions.append(n_keys - 1)
                visible[head] = False
                visible[head, positions] = True
                held[head] = cut(positions)
        visible = visible.repeat_interleave(query.shape[1] // len(held), dim=0)[None, :, None]  # query heads
        mask = torch.zeros(visible.shape, dtype=query.dtype).masked_fill(~visible, torch.finfo(query.dtype).min)
        return model_eager_function(module)(module, query, key, value, mask, **kwargs)

    tokens = []
    with torch.no_grad(), intercept_attention(model, None, attend=attend):
        out = model(ids, use_cache=True)
        cache, token = returned_cache(out), out.logits[:, -1].argmax(-1)
        for step in range(steps):
            tokens.append(token)
            out = model(token[:, None], **with_cache(model, cache), use_cache=True,
                        position_ids=torch.tensor([[n + step]]))
            token = out.logits[:, -1].argmax(-1)
    return torch.stack(tokens, 1)


@pytest.mark.parametrize("capacity", [48, 16])  # ragged (one head full, 1 of 4), every head streaming (dense)
def test_duoattention_streaming_heads_roll_as_the_official_cache(capacity):
    """Decoding: each streaming head keeps its sinks and its last recent_size tokens at every step, as the official
    cache does (official_duo_decode), with recent_size short enough that the window slides off the prompt. The former
    behaviour, the prefill's set frozen and every generated token kept, is DuoAttention(rolling=False): the plain
    masked decode (compression.reference) with the prefill's kept set."""
    scores = [[0.0, 0.7, 0.2, 0.1], [0.4, 0.5, 0.0, 0.0]]
    model = scored(make_tiny_llama(initializer_range=0.3), scores)
    ids = torch.randint(2, 256, (1, N), generator=torch.Generator().manual_seed(9))
    sink, recent, steps = 4, 12, 16
    rolling = C.generate(model, ByteTokenizer(), ids, max_new_tokens=steps,
                         policy=C.DuoAttention(capacity=capacity, sink_size=sink, recent_size=recent))
    full = official_pattern_within(kv_gates(scores, 2), N, capacity, sink, recent)
    assert int(full.sum()) == (1 if capacity == 48 else 0)
    assert torch.equal(rolling.token_ids, official_duo_decode(model, ids, full, sink, recent, steps))
    frozen_policy = C.DuoAttention(capacity=capacity, sink_size=sink, recent_size=recent, rolling=False)
    frozen = C.generate(model, ByteTokenizer(), ids, policy=frozen_policy, max_new_tokens=steps)
    assert frozen_policy.label == f"DuoAttention(sink_size=4, recent_size=12, rolling=False)@{capacity}"
    stored = {k: v for k, v in policy_config(frozen_policy).items() if k != "rolling"}  # a table's, before rolling
    assert policy_from_config(upgrade_config(stored)) == frozen_policy  # reads back as what it ran
    assert torch.equal(frozen.token_ids, masked_decode(model, ids, frozen, steps))
    assert not torch.equal(frozen.token_ids, rolling.token_ids)  # the window matters on this prompt
    assert all(torch.equal(a, b) for a, b in zip(frozen.kept_indices, rolling.kept_indices))  # the same prefill


def test_duoattention_at_a_budget_that_pays_for_full_heads_gives_them_to_the_best_scores():
    model = scored(make_tiny_llama(), [[0.0, 0.7, 0.2, 0.1], [0.4, 0.5, 0.0, 0.0]])
    ids = torch.randint(2, 256, (1, N), generator=torch.Generator().manual_seed(7))
    run = C.generate(model, ByteTokenizer(), ids, policy=C.DuoAttention(capacity=48, sink_size=4, recent_size=12),
                     max_new_tokens=2)
    # (4 x (48 - 16)) // (96 - 16) = 1 full head: layer 1's first KV head (gate 0.45), the others stream.
    full = [[int((k[0, h] >= 0).sum()) == N for h in range(2)] for k in run.kept_indices]
    assert full == [[False, False], [True, False]]
    with pytest.raises(ValueError, match="per_query_head"):
        C.DuoAttention(capacity=48, per_query_head=True)
    with pytest.raises(ValueError, match="no head scored"):
        C.generate(scored(make_tiny_llama(), torch.zeros(2, 4)), ByteTokenizer(), ids,
                   policy=C.DuoAttention(capacity=48, sink_size=4, recent_size=12), max_new_tokens=1)
    tail = C.generate(model, ByteTokenizer(), ids, policy=C.DuoAttention(capacity=48, sink_size=4, recent_size=12,
                                                                         kept_tail=8), max_new_tokens=2)
    assert all(torch.equal(a, b) for a, b in zip(tail.kept_indices, run.kept_indices))  # the tail is recent anyway


def test_sliding_layers_share_no_budget(monkeypatch):
    """The compressor leaves sliding-window layers their own bounded cache, so their heads are out of the shared
    budget: HeadKV pools over the other layers' heads alone, and DuoAttention never makes a sliding head full."""
    monkeypatch.setattr(headkv, "sliding_layers", lambda model: [0])  # as if layer 0 slid (Gemma 3: 5 of 6 layers)
    scores = [[0.9, 0.0, 0.0, 0.0], [0.1, 0.3, 0.0, 0.2]]
    ids = torch.randint(2, 256, (1, N), generator=torch.Generator().manual_seed(8))
    model = scored(make_tiny_llama(initializer_range=0.3), scores)
    run = C.generate(model, ByteTokenizer(), ids, policy=C.HeadKV(capacity=CAPACITY), max_new_tokens=1)
    layer_one = torch.tensor(official_capacities([scores[1]], CAPACITY, WINDOW, 1.005, 1.0)[0], dtype=torch.float64)
    expected = torch.round(layer_one.view(2, 2).mean(-1)).long().clamp(max=N - WINDOW) + WINDOW
    assert torch.equal((run.kept_indices[1][0] >= 0).sum(-1), expected)
    duo = C.generate(model, ByteTokenizer(), ids, policy=C.DuoAttention(capacity=56, sink_size=4, recent_size=12),
                     max_new_tokens=1)
    # 2 compressed KV heads: (2 x (56 - 16)) // (96 - 16) = 1 full, layer 1's first (0.2 against 0.1); never layer 0's
    # first, the best score of all (0.45)
    full = [[int((k[0, h] >= 0).sum()) == N for h in range(2)] for k in duo.kept_indices]
    assert full == [[False, False], [True, False]]


def test_redistributed_by_hand():
    # b = 10 pooled whole over 4 heads (40): shares 0.7 / 0.1 / 0.1 / 0.1 ask 28 / 4 / 4 / 4; a prefix of 12 holds the
    # first to 12 and its 16 spare go to the others by their (equal) shares: 9.33 each, 40 in integers: 12, 10, 9, 9.
    shares = torch.tensor([[0.7, 0.1, 0.1, 0.1]], dtype=torch.float64)
    capacities = headkv.head_capacities(shares, 10, 1.0)
    assert capacities.tolist() == [[28, 4, 4, 4]]
    sharing = torch.ones(1, 4, dtype=torch.bool)
    assert headkv.redistributed(capacities, shares, 12, sharing).tolist() == [[12, 10, 9, 9]]
    # shares of 0 get an equal split of what the scored heads cannot hold; a head outside the pool gets nothing
    zeros = torch.tensor([[1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    outside = torch.tensor([[True, True, True, False]])
    assert headkv.redistributed(torch.tensor([[40, 0, 0, 0]]), zeros, 12, outside).tolist() == [[12, 12, 12, 0]]


def test_redistribute_keeps_the_labelled_budget():
    """The same scores as test_kv_bytes_stay_within_the_uniform_budget: the official slicing loses a head's share past
    its prefix; redistribute=True hands it to the heads with room, and the cache holds the uniform budget."""
    model = scored(make_tiny_llama(), [[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 3.0]])
    ids = torch.randint(2, 256, (1, N), generator=torch.Generator().manual_seed(4))
    policy = C.HeadKV(capacity=CAPACITY, redistribute=True)
    assert "redistribute=True" in policy.label and "redistribute" not in C.policies.policy_config(C.HeadKV())
    run = C.generate(model, ByteTokenizer(), ids, policy=policy, max_new_tokens=1)
    held = [(k[0] >= 0).sum(-1) - WINDOW for k in run.kept_indices]  # prefix positions per KV head
    assert int(sum(h.sum() for h in held)) == 4 * (CAPACITY - WINDOW)  # 4 KV heads x b, as SnapKV's uniform cache
    assert max(int(h.max()) for h in held) == N - WINDOW  # the strongest head holds its whole prefix


def test_think_over_ragged_heads_attends_as_zeroed_channels():
    """ThinK over DuoAttention's ragged heads (compression.packed.PackedHeadwiseLayer): decoding with the streaming
    heads' window rolling gives, step by step, the logits of DuoAttention's own cache whose kept keys have each head's
    pruned channels zeroed (kvpress's ThinK, think_press.py:90-92), read from the channels each head stored. The
    window rolls under the wrapper too (Wrapper.decode_window: it once froze, as rolling=False, under ThinK's label)."""
    model = scored(make_tiny_llama(initializer_range=0.3), [[0.0, 0.7, 0.2, 0.1], [0.4, 0.5, 0.0, 0.0]])
    ids = torch.randint(2, 256, (1, N), generator=torch.Generator().manual_seed(9))
    duo = C.DuoAttention(capacity=48, sink_size=4, recent_size=12)
    think = C.ThinK(policy=duo, capacity=48, key_channel_ratio=0.5, recent_size=0)
    steps = 16  # recent_size 12: the streaming heads' window slides off the prompt
    tokens, ours, theirs = [], [], []

    def step(cache, token, at):
        return model(token, past_key_values=cache, position_ids=torch.tensor([[N + at]])).logits[:, -1]

    with torch.inference_mode(), C.compress(model, think) as packed:
        token = model(ids, past_key_values=packed.cache).logits[:, -1].argmax(-1, keepdim=True)
        for at in range(steps):
            tokens.append(token)
            ours.append(step(packed.cache, token, at))
            token = ours[-1].argmax(-1, keepdim=True)
    with torch.inference_mode(), C.compress(model, duo) as plain:
        model(ids, past_key_values=plain.cache)
        ragged = 0
        for stored, held in zip(packed.cache.layers, plain.cache.layers, strict=True):
            if isinstance(stored, PackedHeadwiseLayer):  # each head's own channels, its own keys
                ragged += 1
                assert torch.equal(stored.kept, held.kept)
                pairs = [(head.key_blocks[0].channels[0, 0], keys) for head, keys in
                         zip(stored.heads[0], held.prompt_keys[0], strict=True)]
            else:  # every head streaming: a dense packed layer
                pairs = [(stored.key_blocks[0].channels[0, h], held.keys[0, h]) for h in range(held.keys.shape[1])]
            for channels, keys in pairs:
                pruned = torch.ones(keys.shape[-1], dtype=torch.bool)
                pruned[channels] = False
                assert int(pruned.sum()) == keys.shape[-1] // 2
                keys[:, pruned] = 0  # a view of the plain layer's kept keys: zeroed in place
        assert ragged == 1  # layer 1: one head whole, one streaming
        theirs = [step(plain.cache, token, at) for at, token in enumerate(tokens)]
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
