"""intercept_attention is scoped to one model, nests, and restores transformers' registry in any exit order."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_llama
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from snapkv_lab import intercept_attention


def run(model):
    with torch.no_grad():
        return model(torch.arange(3, 20)[None]).logits


def test_other_models_are_not_intercepted():
    watched, other = make_tiny_llama(seed=0), make_tiny_llama(seed=1)
    calls = []
    with intercept_attention(watched, lambda module, *a, **k: calls.append(module)):
        run(other)
        assert calls == []
        run(watched)
    assert calls == [layer.self_attn for layer in watched.model.layers]


def test_nested_interceptions_each_see_their_own_model():
    a, b = make_tiny_llama(seed=0), make_tiny_llama(seed=1)
    seen = {"a": [], "b": [], "a2": []}
    with intercept_attention(a, lambda m, *x, **k: seen["a"].append(m.layer_idx)):
        with intercept_attention(b, lambda m, *x, **k: seen["b"].append(m.layer_idx)):
            with intercept_attention(a, lambda m, *x, **k: seen["a2"].append(m.layer_idx)):
                run(a)
            run(b)
    assert seen == {"a": [0, 1], "b": [0, 1], "a2": [0, 1]}


def test_out_of_order_exits_restore_the_registry():
    before = dict(ALL_ATTENTION_FUNCTIONS._local_mapping)
    a, b = make_tiny_llama(seed=0), make_tiny_llama(seed=1)
    plain = run(a)
    calls = []
    first = intercept_attention(a, lambda m, *x, **k: calls.append("a"))
    second = intercept_attention(b, lambda m, *x, **k: calls.append("b"))
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)  # the outer one ends first
    run(a)
    assert calls == []  # a's callback is gone, b's interception is still active
    run(b)
    assert calls == ["b", "b"]
    assert ALL_ATTENTION_FUNCTIONS._local_mapping != before
    second.__exit__(None, None, None)
    assert ALL_ATTENTION_FUNCTIONS._local_mapping == before
    assert torch.equal(run(a), plain)


def test_errors_inside_restore_the_registry():
    before = dict(ALL_ATTENTION_FUNCTIONS._local_mapping)
    model = make_tiny_llama()
    with pytest.raises(RuntimeError, match="boom"):
        with intercept_attention(model, lambda *a, **k: None):
            raise RuntimeError("boom")
    assert ALL_ATTENTION_FUNCTIONS._local_mapping == before
