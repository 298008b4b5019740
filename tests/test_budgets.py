"""Budget-shaping methods (PyramidKV: per layer, AdaKV: per head), each against a plain reference written from its
paper's equations or official code, plus the ragged head-wise cache against a masked full cache,
and one registry-wide memory check (every POLICIES entry at capacity 0.25 on SmolLM2)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import eager_twin, make_tiny_llama
from reference import eager_attentions, kv_heads, official_capacities, top_with_tail

import snapkv_lab as C
from snapkv_lab.compression.layers import HeadwiseLayer
from snapkv_lab.policies import retrieval_heads

WINDOW, CAPACITY = 8, 40


def tiny(attn="sdpa"):
    return make_tiny_llama(attn, initializer_range=0.3)  # peaked attention: few ties among votes


def prompt(n=96, batch=1, seed=1):
    return torch.randint(2, 256, (batch, n), generator=torch.Generator().manual_seed(seed))


def smollm_prompt(tokenizer, n):
    from snapkv_lab.tasks.corpus import haystack_ids

    return torch.tensor([haystack_ids(tokenizer, n, start=3)])


# ----- plain references ---------------------------------------------------------------------------------

def snapkv_votes(model, ids, window, kernel=7):
    """Per layer (batch, kv_heads, prefix) SnapKV votes from eager attention maps: window rows summed,
    max-pooled along positions, averaged over each KV head's query heads."""
    prefix = ids.shape[1] - window
    votes = []
    for attn in eager_attentions(model, ids):  # (batch, heads, n, n)
        v = attn[:, :, -window:, :prefix].sum(dim=2)  # (batch, heads, prefix)
        v = F.max_pool1d(v, kernel, stride=1, padding=kernel // 2)
        votes.append(v.reshape(v.shape[0], kv_heads(model.config), -1, prefix).mean(dim=2))
    return votes


def pyramid_budgets(capacity, window, n_layers, n, beta=20):
    """PyramidKV's per-layer budgets (window included) as its official code computes them: Zefan-Cai/KVCache-Factory
    @c97f9d7, pyramidkv/pyramidkv_utils.py, PyramidKVCluster.update_kv, lines 360-375 (integer floor divisions; the
    flat SnapKV budget when the prompt is shorter than twice the prefix budget)."""
    min_num = (capacity - window) // beta
    max_num = (capacity - window) * 2 - min_num
    if max_num >= n - window:
        max_num = n - window
        min_num = (capacity - window) * 2 - max_num
    steps = (max_num - min_num) // (n_layers - 1)
    if n < (capacity - window) * 2:
        return [capacity] * n_layers
    return [window + max_num - layer * steps for layer in range(n_layers)]


def adakv_reference(scores, share, alpha=0.2):
    """AdaKV for one layer and batch row as its official code allocates: FFY0/AdaKV @efe4e2e,
    adaptive_snapkv/monkeypatch/snapkv_utils.py, lines 303-305 and 445-460. scores: (kv_heads, prefix); share: the
    uniform prefix budget per head b. One top kv_heads * b over all heads' scores counts each head's c_h; head h keeps
    its own top round(c_h (1 - alpha) + int(b alpha)) positions. Returns per head the sorted kept prefix positions."""
    heads, prefix = scores.shape
    ranked = sorted(((float(scores[h, p]), h, p) for h in range(heads) for p in range(prefix)), reverse=True)
    counts = [sum(1 for _, h2, _ in ranked[: heads * share] if h2 == h) for h in range(heads)]
    budgets = torch.round(torch.tensor(counts) * (1 - alpha) + int(share * alpha)).int().tolist()
    return [sorted(scores[h].topk(budgets[h]).indices.tolist()) for h in range(heads)]


def adakv_safeguard_reference(scores, budget, window, alpha=0.2):
    """kvpress's rule (kvpress 0.5.5, presses/adakv_press.py, AdaKVPress.compress, lines 54-81) over SnapKV's scores,
    whose window gets the maximum + 1 (snapkv_press.py line 103): each head's own top int(alpha * budget) scores set
    to the largest float, then the lowest kv_heads * (n - budget) of all heads together dropped. scores:
    (kv_heads, prefix). Returns per head the sorted kept prefix positions (the window is kept whole here)."""
    heads, prefix = scores.shape
    full = F.pad(scores, (0, window), value=float(scores.max()) + 1)
    n = prefix + window
    safe = full.topk(int(budget * alpha), dim=-1).indices
    full = full.scatter(-1, safe, torch.finfo(full.dtype).max)
    dropped = (-full).flatten().topk(heads * (n - budget)).indices
    kept = torch.ones(heads * n, dtype=torch.bool)
    kept[dropped] = False
    kept = kept.view(heads, n)
    assert bool(kept[:, prefix:].all())
    return [kept[h, :prefix].nonzero().flatten().tolist() for h in range(heads)]


def assert_same_rows(kept, ref, scores, rtol=1e-4):
    """Per (batch, head) row: the same kept positions (NO_POSITION ignored); positions tied in score at the
    top-k boundary may swap (then the sorted scores of both sets agree)."""
    for b in range(kept.shape[0]):
        for h in range(kept.shape[1]):
            mine = kept[b, h][kept[b, h] >= 0]
            theirs = torch.as_tensor(ref[b][h])
            if not torch.equal(mine, theirs):
                assert mine.shape == theirs.shape, (b, h)
                torch.testing.assert_close(scores[b, h, mine].sort().values, scores[b, h, theirs].sort().values,
                                           rtol=rtol, atol=1e-6)
                assert (torch.isin(mine, theirs)).float().mean() > 0.9, (b, h)


def assert_same_pairs(kept, ref, scores, rtol=1e-4):
    """AdaKV: heads compete, so a tie at the boundary may move a position from one head to another. Per batch
    row: the same kept (head, position) pairs, or equal sorted scores of both sets and >90% of pairs shared."""
    for b in range(kept.shape[0]):
        mine = {(h, int(p)) for h in range(kept.shape[1]) for p in kept[b, h] if p >= 0}
        theirs = {(h, int(p)) for h in range(kept.shape[1]) for p in ref[b][h]}
        if mine != theirs:
            assert len(mine) == len(theirs), b
            def values(pairs):
                return torch.tensor(sorted(float(scores[b, h, p]) for h, p in pairs))

            torch.testing.assert_close(values(mine), values(theirs), rtol=rtol, atol=1e-6)
            assert len(mine & theirs) > 0.9 * len(mine), b


# ----- PyramidKV ----------------------------------------------------------------------------------------

def test_pyramid_budgets_follow_the_official_code():
    policy = C.PyramidKV(capacity=0.25)  # window 8, as the official LongBench script
    budgets = [policy.layer_budget(1000, layer, 30) for layer in range(30)]
    assert budgets == pyramid_budgets(250, 8, 30, 1000)
    assert budgets[0] == 8 + 2 * 242 - 242 // 20 and budgets[1] - budgets[0] == -((2 * 242 - 2 * (242 // 20)) // 29)
    assert all(a > b for a, b in zip(budgets, budgets[1:]))
    assert 0 <= sum(budgets) / 30 - 250 <= 29 / 2  # the floored step keeps a little more than the capacity on average
    # The bottom layer cannot keep more than the prompt: capped, the slope is then gentler.
    capped = [C.PyramidKV(capacity=40, window_size=8).layer_budget(64, layer, 2) for layer in range(2)]
    assert capped == pyramid_budgets(40, 8, 2, 64) == [64, 16]
    # A prompt shorter than twice the prefix budget: SnapKV's flat budget in every layer (the official rule); kvpress
    # falls back only when its smallest layer would drop below the window.
    assert [C.PyramidKV(capacity=40, window_size=8).layer_budget(60, layer, 2) for layer in range(2)] == [40, 40]
    kvpress = C.PyramidKV(capacity=40, window_size=8, schedule="kvpress")
    assert [kvpress.layer_budget(60, layer, 2) for layer in range(2)] == [52, 28]
    assert [C.PyramidKV(capacity=250, window_size=64, schedule="kvpress").layer_budget(1000, layer, 30)
            for layer in (0, 29)] == [250, 250]  # 250 / 20 < 64: flat, as kvpress's get_layer_budget


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_pyramidkv_kept_matches_reference(attn, byte_tokenizer):
    model = tiny(attn)
    ids = prompt(96, batch=2)
    result = C.generate(model, byte_tokenizer, ids, policy=C.PyramidKV(capacity=CAPACITY, window_size=WINDOW),
                        max_new_tokens=2)
    budgets = pyramid_budgets(CAPACITY, WINDOW, 2, 96)
    assert result.cache_lengths == budgets == [71, 9]  # 96 >= 2 (40 - 8): a pyramid, steps floored
    for layer, votes in enumerate(snapkv_votes(model, ids, WINDOW)):
        ref = top_with_tail(votes, budgets[layer] - WINDOW, 96)
        assert_same_rows(result.kept_indices[layer], ref.tolist(), votes)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_layers_of_different_lengths_decode_as_the_masked_full_cache(attn, byte_tokenizer):
    """Each layer its own length, so a mask built for one layer reaches another (eager: rebuilt by attend_cache):
    our loop and model.generate must both equal decoding on the full cache with each layer's dropped positions
    masked (the oracle: a per-layer visibility applied through the model's own eager attention)."""
    model = tiny(attn)
    ids = prompt(96, batch=2, seed=2)
    policy = C.PyramidKV(capacity=CAPACITY, window_size=WINDOW)
    ours = C.generate(model, byte_tokenizer, ids, policy=policy, max_new_tokens=12)
    with C.compress(model, policy) as state:
        theirs = model.generate(ids, past_key_values=state.cache, max_new_tokens=12, do_sample=False, eos_token_id=None)
    assert torch.equal(theirs[:, 96:], ours.token_ids)
    assert torch.equal(masked_decode(model, ids, ours.kept_indices, 12), ours.token_ids)


# ----- the masked-full-cache oracle ---------------------------------------------------------------------

def masked_decode(model, ids, kept, steps, question=None):
    """Greedy tokens (batch, steps) of the eager twin over the FULL cache of ids (batch, n), each layer's and
    head's dropped prompt positions hidden by an additive mask added inside its attention (kept: per layer
    (batch, kv_heads, k) NO_POSITION-padded). A question (batch, m) is fed after the prompt first."""
    from snapkv_lab.core.hooks import intercept_attention

    twin = eager_twin(model)
    batch, n = ids.shape
    heads, groups = twin.config.num_attention_heads, twin.config.num_attention_heads // kv_heads(twin.config)
    hidden = []  # per layer (batch, heads, 1, n): -inf on dropped prompt positions
    for positions in kept:
        visible = torch.zeros(batch, positions.shape[1], n + 1, dtype=torch.bool)
        visible.scatter_(-1, positions.clamp(min=-1) % (n + 1), True)  # NO_POSITION lands in the spare column
        mask = torch.zeros(visible.shape[:2] + (n,)).masked_fill(~visible[..., :n], float("-inf"))
        hidden.append(mask.repeat_interleave(groups, dim=1)[:, :, None])

    def attend(function, module, query, key, value, attention_mask, **kwargs):
        extra = torch.zeros(query.shape[0], heads, query.shape[2], key.shape[2])
        extra[..., :n] = hidden[module.layer_idx]
        return function(module, query, key, value, attention_mask + extra, **kwargs)

    with torch.no_grad():
        out = twin(ids, use_cache=True)
        cache, start, logits = out.past_key_values, n, out.logits[:, -1]
        with intercept_attention(twin, None, attend=attend):
            if question is not None:
                logits = twin(question, past_key_values=cache,
                              position_ids=torch.arange(n, n + question.shape[1])[None]).logits[:, -1]
                start += question.shape[1]
            tokens = []
            for step in range(steps):
                token = logits.argmax(-1)
                tokens.append(token)
                logits = twin(token[:, None], past_key_values=cache,
                              position_ids=torch.tensor([[start + step]])).logits[:, -1]
    return torch.stack(tokens, 1)


# ----- AdaKV --------------------------------------------------------------------------------------------

def test_adakv_kept_matches_reference(byte_tokenizer):
    model = tiny()
    ids = prompt(96, batch=2, seed=3)
    result = C.generate(model, byte_tokenizer, ids,
                        policy=C.AdaKV(capacity=CAPACITY, policy=C.SnapKV(window_size=WINDOW)), max_new_tokens=2)
    counts = []
    for layer, votes in enumerate(snapkv_votes(model, ids, WINDOW)):
        kept = result.kept_indices[layer]  # (batch, kv_heads, widest), NO_POSITION-padded
        ref = [[rows + list(range(88, 96)) for rows in adakv_reference(votes[b], CAPACITY - WINDOW)]
               for b in range(2)]
        assert_same_pairs(kept, ref, F.pad(votes, (0, WINDOW), value=math.inf))
        budgets = [[len(rows) for rows in adakv_reference(votes[b], CAPACITY - WINDOW)] for b in range(2)]
        assert ((kept >= 0).sum(-1) - WINDOW).tolist() == budgets  # each head's official blend, exactly
        for row in kept.reshape(-1, kept.shape[-1]):  # each row: its positions ascending, then the padding
            valid = row[row >= 0]
            assert torch.equal(valid, valid.sort().values) and bool((row[len(valid):] == -1).all())
        counts.append((kept >= 0).sum(-1))
    counts = torch.stack(counts)  # (layers, batch, kv_heads)
    assert bool(((counts.sum(-1) - 2 * CAPACITY).abs() <= 1).all())  # the layer's total budget, shared out (rounded)
    assert bool((counts >= WINDOW + int(0.2 * (CAPACITY - WINDOW))).all())  # the floor
    assert bool((counts != CAPACITY).any())  # budgets really differ between heads (else the test is vacuous)
    assert bool((result.kept_indices[0] == -1).any())


def test_adakv_safeguard_allocation_matches_kvpress_rule(byte_tokenizer):
    model = tiny()
    ids = prompt(96, batch=2, seed=3)
    policy = C.AdaKV(capacity=CAPACITY, policy=C.SnapKV(window_size=WINDOW), allocation="safeguard")
    assert policy.label == "AdaKV(policy=SnapKV(window_size=8), allocation='safeguard')@40"
    result = C.generate(model, byte_tokenizer, ids, policy=policy, max_new_tokens=2)
    paper = C.generate(model, byte_tokenizer, ids,
                       policy=C.AdaKV(capacity=CAPACITY, policy=C.SnapKV(window_size=WINDOW)), max_new_tokens=2)
    for layer, votes in enumerate(snapkv_votes(model, ids, WINDOW)):
        ref = [[rows + list(range(88, 96)) for rows in adakv_safeguard_reference(votes[b], CAPACITY, WINDOW)]
               for b in range(2)]
        assert_same_pairs(result.kept_indices[layer], ref, F.pad(votes, (0, WINDOW), value=math.inf))
        assert ((result.kept_indices[layer] >= 0).sum(-1).sum(-1) == 2 * CAPACITY).all()  # the total, exactly
    assert any((a >= 0).sum(-1).tolist() != (b >= 0).sum(-1).tolist()
               for a, b in zip(result.kept_indices, paper.kept_indices))  # the two allocations differ here


def test_adakv_stores_only_kept_positions(byte_tokenizer):
    model = tiny()
    ids = prompt(96, batch=2, seed=3)
    # its totals are exact
    policy = C.AdaKV(capacity=CAPACITY, policy=C.SnapKV(window_size=WINDOW), allocation="safeguard")
    with C.compress(model, policy) as state, torch.no_grad():
        model(ids, past_key_values=state.cache, use_cache=True)
    n_kept = sum(int((kept >= 0).sum()) for kept in state.kept_indices.values())
    assert C.compression.cache_bytes(state.cache) == n_kept * 2 * 16 * 4  # K and V, head_dim 16, fp32: no padding
    assert n_kept == 2 * 2 * 2 * CAPACITY  # layers x batch x kv_heads x capacity, as a uniform budget would
    layer = state.cache.layers[0]
    assert isinstance(layer, HeadwiseLayer)
    stored = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
              for rows in (layer.prompt_keys, layer.prompt_values) for row in rows for t in row}
    stored.update({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in (layer.keys, layer.values)})
    assert sum(stored.values()) == C.compression.layers.layer_nbytes(layer)  # nothing else held alive


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_headwise_cache_decodes_as_the_masked_full_cache(attn, byte_tokenizer):
    """Ragged per-head budgets, batch of 2 (different selections per row), GQA groups of 2 and a question of
    several rows appended after compression: tokens must equal the eager full cache with each head's dropped
    positions masked; model.generate under compress must equal our loop."""
    model = tiny(attn)
    context, question = prompt(96, batch=2, seed=4), prompt(7, seed=5)[0]  # one question, asked of both rows
    policy = C.AdaKV(capacity=CAPACITY, policy=C.SnapKV(window_size=WINDOW))
    asked = C.generate(model, byte_tokenizer, context, question=question, policy=policy, max_new_tokens=10)
    assert torch.equal(masked_decode(model, context, asked.kept_indices, 10, question=question.expand(2, -1)),
                       asked.token_ids)
    plain = C.generate(model, byte_tokenizer, context, policy=policy, max_new_tokens=10)
    assert torch.equal(masked_decode(model, context, plain.kept_indices, 10), plain.token_ids)
    with C.compress(model, policy) as state:
        theirs = model.generate(context, past_key_values=state.cache, max_new_tokens=10, do_sample=False,
                                eos_token_id=None)
    assert torch.equal(theirs[:, 96:], plain.token_ids)
    uniform = C.generate(model, byte_tokenizer, context, policy=C.SnapKV(capacity=CAPACITY, window_size=WINDOW),
                         max_new_tokens=10)
    assert not torch.equal(uniform.token_ids, plain.token_ids) or not torch.equal(
        uniform.kept_indices[0], plain.kept_indices[0])  # the oracle compared something other than SnapKV's cache


def test_headwise_attention_keeps_the_model_dtype(byte_tokenizer):
    model = tiny().to(torch.bfloat16)
    ids = prompt(96, seed=6)
    result = C.generate(model, byte_tokenizer, ids,
                        policy=C.AdaKV(capacity=CAPACITY, policy=C.SnapKV(window_size=WINDOW)), max_new_tokens=6)
    assert result.token_ids.shape == (1, 6)
    assert result.kv_bytes == sum(int((k >= 0).sum()) for k in result.kept_indices) * 2 * 16 * 2  # bf16


# ----- SmolLM2 ------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_budget_methods_match_references_smollm(smollm):
    model, tokenizer = smollm
    ids = smollm_prompt(tokenizer, 600)
    n, capacity = ids.shape[1], 200
    pyramid = C.generate(model, tokenizer, ids, policy=C.PyramidKV(capacity=capacity), max_new_tokens=1)
    budgets = pyramid_budgets(capacity, 8, 30, n)  # PyramidKV's window: 8, as its official script
    assert pyramid.cache_lengths == budgets
    ada = C.generate(model, tokenizer, ids, policy=C.AdaKV(capacity=capacity), max_new_tokens=1)  # SnapKV's window, 32
    for layer, (votes8, votes32) in enumerate(zip(snapkv_votes(model, ids, 8), snapkv_votes(model, ids, 32),
                                                  strict=True)):
        ref = top_with_tail(votes8, budgets[layer] - 8, n)
        assert_same_rows(pyramid.kept_indices[layer], ref.tolist(), votes8)
        ada_ref = [[rows + list(range(n - 32, n)) for rows in adakv_reference(votes32[0], capacity - 32)]]
        assert_same_pairs(ada.kept_indices[layer], ada_ref, F.pad(votes32, (0, 32), value=math.inf))
    assert pyramid.kv_bytes == sum(budgets) * 2 * 3 * 64 * 4  # fp32, the official floors: a little over 200 per layer
    assert ada.kv_bytes == sum(int((k >= 0).sum()) for k in ada.kept_indices) * 2 * 64 * 4
    assert abs(ada.kv_bytes / (30 * 2 * 3 * capacity * 64 * 4) - 1) < 0.01  # the blend's rounding only


@pytest.fixture(scope="module")
def quarter_prefill(smollm):
    """One full 1000-token SmolLM2 prefill serving every registered policy at capacity 0.25 (SharedPrefill:
    what compress() would build, from recorded scores; one prefill instead of one per policy keeps this fast)."""
    from snapkv_lab.compression.shared import SharedPrefill

    model, tokenizer = smollm
    ids = smollm_prompt(tokenizer, 1000)
    policies = {name: cls() if cls is C.FullCache else cls(capacity=0.25) for name, cls in C.POLICIES.items()}
    return ids, policies, SharedPrefill.run(model, tokenizer, ids, list(policies.values()))


HEADKV_SHARE, HEADKV_WHOLE = 0.119, 5  # SmolLM2's measured retrieval scores at 25% of 1000 tokens, window 8


def headkv_held(scores: torch.Tensor, n: int, capacity: int, window: int, kv_heads: int) -> torch.Tensor:
    """(layers, KV heads) positions HeadKV holds, from the official capacities per query head (official_capacities:
    ReasonSnapKVCluster.__init__, beta 1.005, temp 1) and our documented GQA reduction: a KV head keeps the mean of its
    query heads' capacities (rounded), at most its prefix (the official slicing drops the rest), then the window.
    scores: (layers, query heads) the retrieval scores the policy read (NaN: no copy step seen, i.e. 0)."""
    capacities = torch.tensor(official_capacities(scores.nan_to_num(0.0).tolist(), capacity, window, 1.005, 1.0),
                              dtype=torch.float64)
    per_kv_head = torch.round(capacities.view(capacities.shape[0], kv_heads, -1).mean(-1))
    return per_kv_head.clamp(max=n - window).long() + window


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(C.POLICIES))
def test_every_registered_policy_keeps_a_quarter_of_the_bytes(name, quarter_prefill, smollm):
    """Every POLICIES entry, built from capacity=0.25 alone, holds the bytes of what it keeps and no more: 25% of the
    full cache (measured: 11,520,000 of 46,080,000 bytes, 0.2500), or, for PyramidKV (and PyramidAllocation, its
    allocation over any scorer), the mean of its official layer budgets (integer-floored steps: 26.25% here); HeadKV
    exactly the official capacities' bytes, which the official slicing holds under 25% (HEADKV_SHARE here: heads
    allotted more than their prefix lose the rest)."""
    ids, policies, shared = quarter_prefill
    policy = policies[name]
    state = shared.state(policy)
    kv_bytes = C.compression.cache_bytes(state.cache)
    # layers x (K, V) x kv_heads x tokens x head_dim x fp32
    n, full_bytes = ids.shape[1], 30 * 2 * 3 * ids.shape[1] * 64 * 4
    held = sum(int((kept >= 0).sum()) for kept in state.kept_indices.values())
    if policy.storage is not None and policy.storage.packs:  # ThinK, KIVI: fewer channels or bits per position held
        assert kv_bytes < held * 2 * 64 * 4  # (their bytes: tests/test_storage.py); the positions are this test's
        kv_bytes = held * 2 * 64 * 4
    assert kv_bytes == held * 2 * 64 * 4  # exactly the positions held: nothing padded or faked
    ratio = kv_bytes / full_bytes
    print(f"{name}: kv_bytes {kv_bytes} / {full_bytes} = {ratio:.4f}")
    if not policy.capacity_sets_entries:  # SimLayerKV's busy layers, DMS's threshold: held as chosen (test_layerwise)
        assert ratio <= 1.0
        return
    expected = 1.0 if name == "FullCache" else sum(policy.layer_budget(n, layer, 30) for layer in range(30)) / (30 * n)
    if name == "HeadKV":
        model, tokenizer = smollm
        scores = retrieval_heads.retrieval_score_grid(model, tokenizer)
        per_head = headkv_held(scores, n, int(0.25 * n), 8, kv_heads=3)  # window 8: the official run's
        assert kv_bytes == int(per_head.sum()) * 2 * 64 * 4
        assert round(ratio, 3) == HEADKV_SHARE and int((per_head == n).sum()) == HEADKV_WHOLE
        return
    assert abs(ratio - expected) <= 0.03 * expected, ratio
    # PyramidAllocation is PyramidKV's layer budgets over any scorer: the same floored schedule
    assert name in ("FullCache", "PyramidKV", "PyramidAllocation") or expected == 0.25
