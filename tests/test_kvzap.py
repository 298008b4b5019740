"""KVzap: its training targets (KVzip+) against the official formula on transformers' eager attention, a surrogate
trained on a toy setting learning them, and the policy's kept positions against the surrogate applied by hand to the
layers' inputs, on the tiny random Llama."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import eager_twin, make_tiny_llama
from reference import assert_same_selection

import snapkv_lab as C
from snapkv_lab.policies import kvzap
from snapkv_lab.policies.kvzap_training import collect, fit_linear, fit_mlp, kvzip_plus, repeat_prompt

WORDS = "alpha beta gamma delta the cat sat on a mat while rivers flow to seas and hills rise".split()
CAPACITY = 40


def toy_texts(n: int, seed: int, words: int = 60) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n)]


@pytest.fixture(scope="module")
def toy():
    """The tiny model (peaked attention), its KVzip+ data on 16 training and 4 held-out toy texts."""
    model = make_tiny_llama(initializer_range=0.3)
    from conftest import ByteTokenizer

    tokenizer = ByteTokenizer()
    train = collect(model, tokenizer, toy_texts(16, 0), n_tokens=200, seed=0)
    test = collect(model, tokenizer, toy_texts(4, 1), n_tokens=200, seed=1)
    return model, tokenizer, train, test


def official_kvzip_plus(model, ids, prompt, repeat):
    """kvzap/data.py:173-221 (NVIDIA/kvpress @8bb29b9) on transformers' eager run: attention weights of the repeat's
    rows to the prompt's columns, / ||x_t|| (the attention's input hidden state), * ||W_o^h v_i||, max over the rows
    and each KV head's query heads, log; inputs: the layer's input_layernorm of the residual stream."""
    twin = eager_twin(model)
    with torch.no_grad():
        out = twin(ids, output_attentions=True, output_hidden_states=True, use_cache=True)
    xs, ys = {}, {}
    config = twin.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    for layer, block in enumerate(twin.model.layers):
        with torch.no_grad():
            hidden = block.input_layernorm(out.hidden_states[layer])  # (1, L, hidden)
        scores = out.attentions[layer] / hidden.norm(dim=-1)[:, None, :, None]
        w_o = block.self_attn.o_proj.weight.T.reshape(heads, -1, config.hidden_size)
        v = out.past_key_values.layers[layer].values.repeat_interleave(heads // kv_heads, dim=1)
        wov = torch.einsum("hij,bhti->bhtj", w_o, v).norm(dim=-1)  # (1, heads, L)
        scores = (scores * wov[:, :, None, :])[:, :, repeat, prompt].amax(dim=2)
        ys[layer] = scores.reshape(1, kv_heads, heads // kv_heads, -1).amax(dim=2).log()[0].T
        xs[layer] = hidden[0, prompt]
    return xs, ys


def test_kvzip_plus_targets_match_the_official_formula(toy):
    model, tokenizer, _, _ = toy
    ids, prompt, repeat = repeat_prompt(tokenizer, toy_texts(1, 5)[0])
    assert tokenizer.decode(ids[0, prompt].tolist()) == tokenizer.decode(ids[0, repeat].tolist())
    x, y = kvzip_plus(model, ids, prompt, repeat)
    ref_x, ref_y = official_kvzip_plus(model, ids, prompt, repeat)
    assert sorted(x) == sorted(ref_x) == [0, 1]
    for layer in x:
        torch.testing.assert_close(x[layer], ref_x[layer], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(y[layer], ref_y[layer], atol=1e-4, rtol=1e-4)


def top_half_jaccard(predicted: torch.Tensor, target: torch.Tensor) -> float:
    """Mean over layers and heads of the Jaccard of the top halves by predicted and by target (N, layers, heads);
    two independent halves: 1/3."""
    k = predicted.shape[0] // 2
    values = []
    for layer in range(predicted.shape[1]):
        for head in range(predicted.shape[2]):
            a = set(predicted[:, layer, head].topk(k).indices.tolist())
            b = set(target[:, layer, head].topk(k).indices.tolist())
            values.append(len(a & b) / len(a | b))
    return sum(values) / len(values)


@pytest.mark.parametrize("model_type", ["linear", "mlp"])
def test_a_surrogate_trained_on_a_toy_setting_learns_kvzip_plus(toy, model_type):
    _, _, (layers, x, y), (_, x_test, y_test) = toy
    if model_type == "linear":
        surrogate = fit_linear(layers, x, y)
    else:
        surrogate, losses = fit_mlp(layers, x, y, hidden_dim=64, batch_size=128, steps=300)
        assert losses[-1] < losses[0]
    with torch.no_grad():
        predicted = torch.stack([surrogate(layer, x_test[:, i].float()) for i, layer in enumerate(layers)], 1)
    untrained = kvzap.Surrogate(layers, x.shape[-1], y.shape[-1], surrogate.hidden_dim)
    with torch.no_grad():
        guessed = torch.stack([untrained(layer, x_test[:, i].float()) for i, layer in enumerate(layers)], 1)
    learned, chance = top_half_jaccard(predicted, y_test), top_half_jaccard(guessed, y_test)
    assert learned > 0.6 and learned > chance + 0.2, (learned, chance)


def test_policy_keeps_the_surrogates_top_positions(toy, tmp_path):
    """KVzapPress (kvpress/presses/kvzap_press.py:70-82): scores = surrogate(layer input hidden states), the top
    n (1 - ratio) per KV head, no window; the layer inputs here from transformers' own hidden states and norms."""
    model, tokenizer, (layers, x, y), _ = toy
    path = tmp_path / "toy.safetensors"
    fit_linear(layers, x, y).save(path)
    surrogate = kvzap.Surrogate.load(path)
    ids = torch.tensor([list(toy_texts(1, 9, 30)[0].encode())[:96]])
    result = C.generate(model, tokenizer, ids, policy=C.KVzap(capacity=CAPACITY, model_type="linear",
                                                              weights=str(path)), max_new_tokens=1)
    with torch.no_grad():
        states = model(ids, output_hidden_states=True).hidden_states
        ref_scores = [surrogate(i, block.input_layernorm(states[i])[0]).T[None]
                      for i, block in enumerate(model.model.layers)]
    ref_kept = [s.topk(CAPACITY, dim=-1).indices.sort(dim=-1).values for s in ref_scores]
    assert_same_selection(result.kept_indices, ref_kept, ref_scores, 0)


def test_a_model_without_weights_is_refused_with_the_command(tiny_model, byte_tokenizer, monkeypatch, tmp_path):
    monkeypatch.setattr(kvzap, "find_weights", kvzap.find_weights.original)  # conftest's stand-in undone
    monkeypatch.setenv("SNAPKV_LAB_CACHE", str(tmp_path))
    tiny_model.config.name_or_path = "some-org/unseen-model"
    with pytest.raises(ValueError, match=r"scripts/train_kvzap.py --model unseen-model --model-type mlp"):
        C.generate(tiny_model, byte_tokenizer, torch.tensor([list(b"x" * 80)]), policy=C.KVzap(capacity=CAPACITY),
                   max_new_tokens=1)


def test_settings_are_checked(tmp_path):
    with pytest.raises(ValueError, match="model_type"):
        C.KVzap(model_type="cubic")
    with pytest.raises(ValueError, match="no such file"):
        C.KVzap(weights=str(tmp_path / "absent.safetensors"))


def test_shipped_linear_weights_score_smollm2(smollm):
    """The linear surrogate shipped for SmolLM2 (scripts/train_kvzap.py --ship) loads and compresses its prompt."""
    model, tokenizer = smollm
    ids = tokenizer("The quick brown fox jumps over the lazy dog. " * 12, return_tensors="pt")["input_ids"]
    result = C.generate(model, tokenizer, ids, policy=C.KVzap(capacity=32, model_type="linear"), max_new_tokens=1)
    assert all(kept.shape[-1] == 32 for kept in result.kept_indices)
