"""DecodingEviction(merging="cam"), kvpress 0.5.5's CAMPress, against references written from its code
(kvpress/presses/cam_press.py, as installed in the peer venv): the merge on a hand-worked case, and a whole decode on
a tiny random model over a masked full cache (kvpress's decoding presses keep nothing at prefill, which the side by
side compares: no peer row)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import eager_twin, make_tiny_llama
from test_decoding import masked_step

import snapkv_lab
from snapkv_lab.policies.decoding_merge import merge_into_next_kept

N, TARGET, INTERVAL, BUDGET, NEW, SEED = 40, 24, 4, 4, 14, 11


def test_merge_by_hand():
    """Two KV heads, six slots, head_dim 1, merge_budget 2; slots 1, 3, 4 kept, 0, 2, 5 evicted, ranked 5, 5, 1.
    count 3 merges all three (cam_press.py:147-152), each into the next two kept (:159-169):
    head 0: slot 0 (A 0.4 over the mean 0.2 of slots 1 and 3: p = 2, clamped to 1) adds 10 / 2 to slots 1 and 3;
    slot 2 (A 0) adds nothing. Head 1: slot 0 is 0 / 0 = nan -> 0; slot 2, 0.3 over a window of no attention, is
    inf -> 1 (:181-182) and adds 200 / 2 to slots 3 and 4. Slot 5 has no kept slot after it: nothing, whatever its
    draw (:193). count 1 merges the later of the two equal best, slot 2 (:148-151), so head 0 stays as it was."""
    value = torch.tensor([[10.0, 1.0, 20.0, 2.0, 3.0, 30.0], [100.0, 1.0, 200.0, 2.0, 3.0, 300.0]])[..., None]
    attention = torch.tensor([[0.4, 0.2, 0.0, 0.2, 0.6, 0.3], [0.0, 0.0, 0.3, 0.0, 0.0, 0.5]])
    ranking = torch.tensor([5.0, 9.0, 5.0, 9.0, 9.0, 1.0])
    kept = torch.tensor([1, 3, 4])
    merged = merge_into_next_kept(value, attention, ranking, kept, count=3, merge_budget=2)
    expected = torch.tensor([[10.0, 6.0, 20.0, 7.0, 3.0, 30.0], [100.0, 1.0, 200.0, 102.0, 103.0, 300.0]])
    assert torch.equal(merged[..., 0], expected)
    assert value[0, 1, 0] == 1.0  # the input is left as it was
    later = merge_into_next_kept(value, attention, ranking, kept, count=1, merge_budget=2)
    assert torch.equal(later[..., 0], torch.stack([value[0, :, 0], expected[1]]))


def cam_press_reference(model, prompt: torch.Tensor, target: int, interval: int, merge_budget: int, new: int):
    """CAMPress(base_press=KnormPress(), compression_interval, target_size, merge_budget) on a one-layer model, the
    evicted hidden by a (1, 1, 1, n) mask (one kept set for every KV head makes one mask enough). Written from
    cam_press.py: the prefill untouched (:242-249); each decode call's last-query attention, each KV head's query heads
    averaged, added to a running sum (:258-283); after `interval` calls, once more than `target` positions are held
    (:285-290): KnormPress's scores (-||k||, knorm_press.py) averaged over the KV heads (:142), the `target` best kept
    (:154), and the best-scored `calls since the last eviction` of the others (the later first among equals, :147-152)
    merged, each into the next `merge_budget` kept (:159-169) with probability clamp(A_x / mean A of that window, 0, 1)
    (:171-183), drawn as one torch.bernoulli over (batch, kv_heads, merged) (:186), v / window size added (:189-202).
    Returns (tokens, positions held after the last eviction, the cache's values, the draws)."""
    eager = eager_twin(model)
    kv_heads = model.config.num_key_value_heads
    with torch.no_grad():
        out = eager(prompt, use_cache=True)
    cache, token, tokens, draws = out.past_key_values, out.logits[0, -1].argmax(), [], []
    n = prompt.shape[1]
    held, calls = list(range(n)), 0
    running = torch.zeros(kv_heads, n + new)  # by position; an evicted one's entry is never read again
    for step in range(new):
        tokens.append(int(token))
        if step == new - 1:
            break
        position = n + step
        held.append(position)
        out = masked_step(eager, cache, token, position, held, output_attentions=True)
        last = out.attentions[0][0, :, -1]  # (heads, position + 1), 0 where masked
        running[:, : position + 1] += last.view(kv_heads, -1, position + 1).mean(1)
        calls += 1
        if calls >= interval and len(held) > target:
            keys, values = cache.layers[0].keys[0], cache.layers[0].values[0]  # (kv_heads, position + 1, head_dim)
            score = {p: float(-keys[:, p].norm(dim=-1).mean()) for p in held}
            by_score = sorted(held, key=lambda p: -score[p])
            kept, evicted = sorted(by_score[:target]), by_score[target:]
            movers = sorted(sorted(evicted, key=lambda p: (-score[p], -p))[:calls])
            windows = [[p for p in kept if p > x][:merge_budget] for x in movers]
            odds = torch.zeros(1, kv_heads, len(movers))
            for h in range(kv_heads):
                for i, (x, window) in enumerate(zip(movers, windows, strict=True)):
                    ratio = running[h, x] / (running[h, window].sum() / max(len(window), 1))
                    odds[0, h, i] = 0.0 if ratio.isnan() else 1.0 if ratio.isinf() else min(max(float(ratio), 0), 1)
            draw = torch.bernoulli(odds)[0]
            draws.append(draw)
            for h in range(kv_heads):
                for i, (x, window) in enumerate(zip(movers, windows, strict=True)):
                    for t in window:
                        values[h, t] += draw[h, i] * values[h, x] / len(window)
            held, calls = kept, 0
            evicted_to = list(held)
        token = out.logits[0, -1].argmax()
    return tokens, evicted_to, cache.layers[0].values[0], torch.cat(draws, dim=-1)


@pytest.fixture(scope="module")
def gqa_model():
    """One layer (one mask hides what was evicted), 4 query heads over 2 KV heads."""
    return make_tiny_llama(initializer_range=0.3, num_hidden_layers=1)


def run_lab(model, prompt, policy):
    torch.manual_seed(SEED)
    with snapkv_lab.compress(model, policy) as state:
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), past_key_values=state.cache,
                             max_new_tokens=NEW, do_sample=False, eos_token_id=None)
    return out[0, prompt.shape[1]:].tolist(), state


def test_cam_press_matches_kvpress_code(gqa_model):
    prompt = torch.randint(2, 256, (1, N), generator=torch.Generator().manual_seed(5))
    torch.manual_seed(SEED)
    ref_tokens, ref_held, ref_values, draws = cam_press_reference(gqa_model, prompt, TARGET, INTERVAL, BUDGET, NEW)
    assert 0 < draws.sum() < draws.numel()  # some merged, some not: the draws decide
    policy = snapkv_lab.DecodingEviction(policy=snapkv_lab.KNorm(), capacity=None, target=TARGET, interval=INTERVAL,
                                         merging="cam", merge_budget=BUDGET)
    assert policy.label == "DecodingEviction(policy=KNorm, interval=4, target=24, merging='cam', merge_budget=4)"
    tokens, state = run_lab(gqa_model, prompt, policy)
    assert tokens == ref_tokens
    held = state.kept_indices[0][0]
    assert held.tolist() == [ref_held] * 2 and max(ref_held) >= N
    values = state.cache.layers[0].values[0]
    torch.testing.assert_close(values[:, :TARGET], ref_values[:, ref_held], rtol=1e-5, atol=1e-6)
    _, plain = run_lab(gqa_model, prompt, dataclasses.replace(policy, merging=None, merge_budget=32))
    assert plain.kept_indices[0][0][0].tolist() != plain.kept_indices[0][0][1].tolist()  # DecodingPress: per head


@pytest.mark.peer
@pytest.mark.slow
def test_cam_press_equals_kvpress_itself(tmp_path):
    """kvpress 0.5.5's CAMPress run by kvpress in its venv (benchmarks/_kvpress_cam_worker.py) on the same weights,
    prompt and seed, two layers (the second reads what the first merged): the same greedy tokens, and the same cache
    at the end (3 evictions per layer). Measured 2026-11-29: keys and values equal to 2e-6 (0 in layer 0)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import kvpress_peer as peer

    venv = peer.default_venv()
    if problem := peer.venv_problem(venv):
        pytest.skip(problem)
    model = make_tiny_llama(initializer_range=0.3)
    model.save_pretrained(tmp_path / "model")
    prompt = torch.randint(2, 256, (1, N), generator=torch.Generator().manual_seed(5))
    request = {"model": str(tmp_path / "model"), "ids": prompt, "new": NEW, "seed": SEED,
               "press": {"compression_interval": INTERVAL, "target_size": TARGET, "merge_budget": BUDGET}}
    torch.save(request, tmp_path / "request.pt")
    worker = Path(__file__).resolve().parents[1] / "benchmarks" / "_kvpress_cam_worker.py"
    subprocess.run([str(venv / "bin" / "python"), str(worker), str(tmp_path / "request.pt"), str(tmp_path / "out.pt")],
                   check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    theirs = torch.load(tmp_path / "out.pt")
    policy = snapkv_lab.DecodingEviction(policy=snapkv_lab.KNorm(), capacity=None, target=TARGET, interval=INTERVAL,
                                         merging="cam", merge_budget=BUDGET)
    tokens, state = run_lab(model, prompt, policy)
    assert tokens == theirs["tokens"].tolist()
    for layer, ours in enumerate(state.cache.layers):
        torch.testing.assert_close(ours.keys, theirs["keys"][layer], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours.values, theirs["values"][layer], rtol=1e-5, atol=1e-5)


def test_cam_press_refusals():
    with pytest.raises(ValueError, match="merging must be"):
        snapkv_lab.DecodingEviction(capacity=None, target=64, merging="CaM")
    with pytest.raises(ValueError, match="set merging='cam' too"):
        snapkv_lab.DecodingEviction(capacity=None, target=64, merge_budget=8)
    with pytest.raises(TypeError, match="one set for every KV head"):
        snapkv_lab.DecodingEviction(policy=snapkv_lab.AdaKV(), capacity=None, target=64, merging="cam")
