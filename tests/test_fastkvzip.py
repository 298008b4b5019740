"""Fast KVzip: its gate against kvpress's FastKVzipGate formula, gates trained on a toy setting learning KVzip's
scores, and the policy's kept positions against the gates applied by hand, on the tiny random Llama."""

from __future__ import annotations

import math
import random

import pytest
import torch
from conftest import ByteTokenizer, make_tiny_llama

import snapkv_lab as C
from snapkv_lab.compression.shared import SharedPrefill
from snapkv_lab.policies import fastkvzip
from snapkv_lab.policies.fastkvzip_training import fit_gates, kvzip_targets

WORDS = "alpha beta gamma delta the cat sat on a mat while rivers flow to seas and hills rise".split()


def toy_texts(n: int, seed: int, words: int = 50) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n)]


def targets(model, tokenizer, texts):
    parts = [kvzip_targets(SharedPrefill.run(model, tokenizer, torch.tensor([list(t.encode())]), [],
                                             layer_inputs=True).prompt()) for t in texts]
    return parts[0][0], torch.cat([p[1] for p in parts]), torch.cat([p[2] for p in parts])


@pytest.fixture(scope="module")
def toy():
    model, tokenizer = make_tiny_llama(initializer_range=0.3), ByteTokenizer()
    return model, tokenizer, targets(model, tokenizer, toy_texts(10, 0)), targets(model, tokenizer, toy_texts(3, 1))


def official_gate(gate: fastkvzip.Gate, x: torch.Tensor) -> torch.Tensor:
    """kvpress 0.5.5 FastKVzipGate.forward (fastkvzip_press.py:51-66; the official prefill/attention/gate.py:77-94),
    written out with its RMSNorm (Qwen3RMSNorm: x * rsqrt(mean x^2 + 1e-6) * weight)."""
    def rms(t, weight):
        return weight * (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6))

    n, kv, g, d = x.shape[0], gate.kv_heads, gate.group, gate.dim
    queries = rms(gate.q_proj(x).view(n, kv, -1, d), gate.q_norm.weight).transpose(0, 1).transpose(-1, -2)
    keys = rms(gate.k_proj(x).view(n, kv, -1, d), gate.k_norm.weight).transpose(0, 1)
    logit = torch.matmul(keys, queries) / math.sqrt(d) + gate.b.unsqueeze(2)
    logit_base = torch.matmul(gate.k_base, queries) / math.sqrt(d)
    score = 1 / (1 + torch.exp(logit_base - logit).sum(2, keepdim=True))
    assert score.shape == (kv, n, 1, g)
    return score.mean(-1).squeeze(-1)


def test_gate_matches_kvpress_formula():
    torch.manual_seed(0)
    gate = fastkvzip.Gate(24, 2, 3)
    with torch.no_grad():
        for parameter in gate.parameters():
            parameter.normal_()
    x = torch.randn(7, 24)
    torch.testing.assert_close(gate(x), official_gate(gate, x))


def top_half_jaccard(predicted: torch.Tensor, target: torch.Tensor) -> float:
    """Mean over layers and KV heads of the Jaccard of the top halves of (N, layers, heads); chance 1/3."""
    k, values = predicted.shape[0] // 2, []
    for layer in range(predicted.shape[1]):
        for head in range(predicted.shape[2]):
            a = set(predicted[:, layer, head].topk(k).indices.tolist())
            b = set(target[:, layer, head].topk(k).indices.tolist())
            values.append(len(a & b) / len(a | b))
    return sum(values) / len(values)


def test_gates_trained_on_a_toy_setting_learn_kvzip(toy):
    _, _, (layers, x, y), (_, x_test, y_test) = toy
    gates, losses = fit_gates(layers, x, y, group=2, steps=200, batch_size=64)
    assert losses[-1] < losses[0]
    with torch.no_grad():
        predicted = torch.stack([gates(layer, x_test[:, i]).T for i, layer in enumerate(layers)], 1)
        untrained = fastkvzip.Gates(layers, x.shape[-1], y.shape[-1], 2)
        torch.manual_seed(1)
        for parameter in untrained.parameters():
            parameter.normal_()
        guessed = torch.stack([untrained(layer, x_test[:, i]).T for i, layer in enumerate(layers)], 1)
    learned, chance = top_half_jaccard(predicted, y_test), top_half_jaccard(guessed, y_test)
    assert learned > 0.55 and learned > chance + 0.15, (learned, chance)


def test_policy_keeps_the_gates_top_positions_globally(toy, tmp_path):
    """FastKVzipPress (fastkvzip_press.py:213-256): the first 4 and the last int(0.02 n) positions score 1, then the
    lowest scores over all layers and KV heads are pruned; here with gates applied by hand to transformers' own layer
    inputs (input_layernorm of the residual stream)."""
    model, tokenizer, (layers, x, y), _ = toy
    gates, _ = fit_gates(layers, x, y, group=2, steps=50, batch_size=128)
    path = tmp_path / "gates.safetensors"
    gates.save(path)
    gates = fastkvzip.Gates.load(path)
    ids = torch.tensor([list(toy_texts(1, 9, 40)[0].encode())[:200]])
    n, capacity = ids.shape[1], 50
    result = C.generate(model, tokenizer, ids, policy=C.FastKVzip(capacity=capacity, weights=str(path)),
                        max_new_tokens=1)
    with torch.no_grad():
        states = model(ids, output_hidden_states=True).hidden_states
        scores = torch.stack([gates(i, block.input_layernorm(states[i])[0])
                              for i, block in enumerate(model.model.layers)])  # (layers, kv_heads, n)
    scores[..., :4] = 1.0
    scores[..., n - max(1, int(n * 0.02)):] = 1.0
    pruned = torch.topk(-scores.reshape(-1), int(scores.numel() * (1 - capacity / n))).indices
    kept = torch.ones(scores.numel(), dtype=torch.bool)
    kept[pruned] = False
    kept = kept.view_as(scores)
    mine = torch.zeros_like(kept)
    for layer, positions in enumerate(result.kept_indices):
        for head in range(scores.shape[1]):
            row = positions[0, head]
            mine[layer, head, row[row >= 0]] = True
    # The same selection up to exact ties (the toy's first layer sees embeddings alone: repeated bytes tie)
    assert int(mine.sum()) == int(kept.sum()) == capacity * scores.shape[0] * scores.shape[1]
    assert mine[..., :4].all() and mine[..., n - max(1, int(n * 0.02)):].all()
    assert scores[mine].min() >= scores[~mine].max()
    torch.testing.assert_close(scores[mine].sort().values, scores[kept].sort().values)
    assert (mine == kept).float().mean() > 0.95


def test_a_model_without_gates_is_refused_with_the_command(tiny_model, byte_tokenizer, monkeypatch, tmp_path):
    monkeypatch.setattr(fastkvzip, "find_weights", fastkvzip.find_weights.original)  # conftest's stand-in undone
    monkeypatch.setenv("SNAPKV_LAB_CACHE", str(tmp_path))
    tiny_model.config.name_or_path = "some-org/unseen-model"
    with pytest.raises(ValueError, match=r"scripts/train_kvzap.py --method fastkvzip --model unseen-model"):
        C.generate(tiny_model, byte_tokenizer, torch.tensor([list(b"x" * 80)]), policy=C.FastKVzip(capacity=40),
                   max_new_tokens=1)


@pytest.mark.parametrize("bundled", ["smollm", "gemma"])
def test_shipped_gates_compress_the_bundled_models(request, bundled):
    """The gates shipped for both bundled models (scripts/train_kvzap.py --method fastkvzip --ship) are the ones found
    for them, and compress a prompt to its budget: one selection over every compressed layer and KV head, which
    holds capacity x layers x KV heads in all (sliding-window layers keep their own window)."""
    model, tokenizer = request.getfixturevalue(bundled)
    path = fastkvzip.find_weights.original(model)
    assert path is not None and path.parent == fastkvzip.SHIPPED
    ids = tokenizer("The quick brown fox jumps over the lazy dog. " * 12, return_tensors="pt")["input_ids"]
    result = C.generate(model, tokenizer, ids, policy=C.FastKVzip(capacity=32), max_new_tokens=1)
    layers = fastkvzip.Gates.load(path).trained_layers
    held = sum(int((result.kept_indices[layer] >= 0).sum()) for layer in layers)
    assert held == 32 * len(layers) * model.config.num_key_value_heads
