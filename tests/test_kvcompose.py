"""KVCompose against a reference written from its authors' code, NVIDIA kvpress 0.5.5's KVComposePress
(presses/kvcompose_press.py, cited as :line; contributed by the paper's first author, kvpress pull request #137), with
transformers' eager attention over the prompt fed again as the oracle of every attention probability."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import eager_twin, make_tiny_llama

import snapkv_lab as C
from snapkv_lab.compression.shared import SharedPrefill
from snapkv_lab.policies import NO_POSITION, kvcompose

N, CAPACITY = 64, 16
RATIO = 1 - CAPACITY / N  # kvpress's compression_ratio for the same budget: 0.75


@pytest.fixture(scope="module")
def tiny():
    """A tiny random Llama, 3 layers (peaked attention: init 0.3), and two prompts of N tokens."""
    model = make_tiny_llama(initializer_range=0.3, num_hidden_layers=3)
    ids = torch.randint(2, 256, (2, N), generator=torch.Generator().manual_seed(54))
    return model, ids


def reference_scores(model, ids, *, v_norm=False, mean_across_heads=True) -> torch.Tensor:
    """(layers, kv_heads, n) kvpress's self.scores for one prompt ids (1, n): the eager prefill, then the prompt fed
    again over that cache (:410-418, at the positions after it); forward_hook (:198-213) keeps each query head's
    attention over the first n keys, maxed over the fed tokens (MaxAggregator, :69-76); compute_scores (:222-233)
    means each KV head's query heads; enhance_scores (:235-246) multiplies by the values' norms, then adds the mean
    over KV heads."""
    eager, n = eager_twin(model), ids.shape[1]
    kv = model.config.num_key_value_heads
    with torch.no_grad():
        cache = eager(ids, use_cache=True).past_key_values
        values = [layer.values[0].clone() for layer in cache.layers]  # (kv, n, d), before the feed
        attentions = eager(ids, past_key_values=copy.deepcopy(cache), output_attentions=True,
                           position_ids=torch.arange(n, 2 * n)[None]).attentions
    scores = []
    for layer, attention in enumerate(attentions):  # (1, heads, n, 2n)
        per_head = attention[0, :, :, :n].amax(1)  # (heads, n)
        score = per_head.view(kv, -1, n).mean(1)
        if v_norm:
            score = score * values[layer].norm(dim=-1)
        if mean_across_heads:
            score = score + score.mean(0, keepdim=True)
        scores.append(score)
    return torch.stack(scores)


def reference_kept(scores: torch.Tensor, ratio: float, *, structured=True, lower_bound=0) -> list[list[set[int]]]:
    """Per layer, per KV head, the positions kvpress keeps from (layers, kv_heads, n) scores: compute_composite_scores
    (:248-266), compute_important_per_layer (:268-292, kvpress.utils.compute_n_kept) and prepare_important_masks
    (:294-320), written from them."""
    layers, kv, n = scores.shape
    per_head = scores.sort(dim=-1, descending=True).values  # (layers, kv, n)
    if structured:
        composite = per_head.mean(1)  # agg_head "mean" of the sorted rows
        composite[..., :lower_bound] += 1e9
        composite[0] = composite.max(0).values
        total = max(1, int(composite.numel() * (1 - ratio)))
        counts = torch.bincount(composite.reshape(-1).topk(total).indices // n, minlength=layers)
        counts = counts.clamp(min=max(1, lower_bound))[:, None].expand(layers, kv)
    else:
        composite = per_head.clone()
        composite[..., :lower_bound] += 1e9
        total = max(1, int(composite.numel() * (1 - ratio)))
        counts = torch.bincount(composite.reshape(-1).topk(total).indices // n, minlength=layers * kv).view(layers, kv)
    return [[set(torch.argsort(scores[i, h], descending=True)[:int(counts[i, h])].tolist()) for h in range(kv)]
            for i in range(layers)]


def our_kept(result, row: int) -> list[list[set[int]]]:
    return [[set(r[r != NO_POSITION].tolist()) for r in kept[row]] for kept in result.kept_indices]


@pytest.mark.parametrize("by_parts", [True, False])
def test_scores_match_the_authors_code(by_parts, tiny, byte_tokenizer, monkeypatch):
    """From the fused kernel's parts (float32 on a CPU) and from the softmax itself (every other case)."""
    model, ids = tiny
    if not by_parts:
        monkeypatch.setattr(kvcompose, "by_parts_supported", lambda query, settings: False)
    for v_norm, mean_across_heads in ((False, True), (True, False)):
        policy = C.KVCompose(add_v_norm=v_norm, add_mean_across_heads=mean_across_heads)
        with torch.no_grad():
            scores = policy.prompt_scores(SharedPrefill.run(model, byte_tokenizer, ids[:1], []).prompt())
        ours = torch.stack([scores[layer][0] for layer in sorted(scores)])
        reference = reference_scores(model, ids[:1], v_norm=v_norm, mean_across_heads=mean_across_heads)
        torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-4)  # float rounding over three layers


@pytest.mark.parametrize("settings", [{}, {"structured": False}, {"keep_token_lower_bound": 12},
                                      {"add_v_norm": True, "add_mean_across_heads": False}])
def test_kept_positions_match_the_authors_code(settings, tiny, byte_tokenizer):
    """Both prompts of a batch, each against kvpress's selection over its own eager scores."""
    model, ids = tiny
    policy = C.KVCompose(capacity=CAPACITY, **settings)
    result = C.generate(model, byte_tokenizer, ids, policy=policy, max_new_tokens=1)
    for row in range(ids.shape[0]):
        scores = reference_scores(model, ids[row:row + 1], v_norm=policy.add_v_norm,
                                  mean_across_heads=policy.add_mean_across_heads)
        reference = reference_kept(scores, RATIO, structured=policy.structured,
                                   lower_bound=policy.keep_token_lower_bound)
        assert our_kept(result, row) == reference
        counts = [[len(head) for head in layer] for layer in reference]
        if policy.structured:  # one count per layer, layer 0 the largest, and the layers' counts differ
            assert all(len(set(layer)) == 1 for layer in counts)
            # layer 0's composite scores copy the largest layer's, position by position: a tie at the boundary may
            # go to that layer
            assert counts[0][0] >= max(c[0] for c in counts) - 1 and len({c[0] for c in counts}) > 1
        else:
            assert len({c for layer in counts for c in layer}) > 1  # heads keep their own counts
        if policy.keep_token_lower_bound:
            assert min(c for layer in counts for c in layer) >= policy.keep_token_lower_bound
        else:
            assert sum(c for layer in counts for c in layer) == CAPACITY * len(counts) * len(counts[0])


def test_label_and_refusals():
    assert C.KVCompose(capacity=16).label == "KVCompose@16"
    assert C.KVCompose(capacity=16, structured=False).label == "KVCompose(structured=False)@16"
    assert C.KVCompose(structured=False).scoring_key == C.KVCompose().scoring_key  # one pass for both allocations
    with pytest.raises(ValueError, match="keep_token_lower_bound"):
        C.KVCompose(keep_token_lower_bound=-1)
    with pytest.raises(ValueError, match="structured"):
        C.KVCompose(structured="yes")
