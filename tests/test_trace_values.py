"""capture(..., values=True): the values equal the layer's own v_proj of its input, ||W_O^h v|| equals the product
written out per head, value_attention is attention times it, and the values survive save/load (lazy too)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_llama

import snapkv_lab
from snapkv_lab.core.trace import AttentionTrace


@pytest.fixture(scope="module")
def traced(byte_tokenizer_module):
    model = make_tiny_llama(initializer_range=0.3, num_hidden_layers=2)
    ids = torch.randint(2, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    return model, ids, snapkv_lab.capture(model, byte_tokenizer_module, ids, max_new_tokens=4, values=True,
                                          stop_at_eos=False, progress=False)


@pytest.fixture(scope="module")
def byte_tokenizer_module():
    from conftest import ByteTokenizer

    return ByteTokenizer()


def test_values_are_the_layers_own_projections(traced):
    model, _, trace = traced
    ids = trace.token_ids[None]
    with torch.inference_mode():
        hidden = model(ids, output_hidden_states=True).hidden_states  # the input of each decoder layer
    config = model.config
    d = config.hidden_size // config.num_attention_heads
    for i, layer in enumerate(model.model.layers):
        with torch.inference_mode():
            projected = layer.self_attn.v_proj(layer.input_layernorm(hidden[i]))[0]
            expected = projected.view(-1, config.num_key_value_heads, d)
        torch.testing.assert_close(trace.values[i], expected.transpose(0, 1), atol=1e-5, rtol=1e-4)


def test_value_norms_and_value_attention_written_out_per_head(traced):
    model, _, trace = traced
    heads, kv = trace.n_heads, trace.n_kv_heads
    d = trace.head_dim
    for i, layer in enumerate(model.model.layers):
        weight = layer.self_attn.o_proj.weight
        for h in range(heads):
            slice_h = weight[:, h * d:(h + 1) * d]
            v = trace.values[i][h // (heads // kv)]  # (n, d)
            with torch.inference_mode():
                projected, frobenius = (v @ slice_h.T).norm(dim=-1), float(slice_h.norm())
            torch.testing.assert_close(trace.value_norms[i][h], projected, atol=1e-5, rtol=1e-4)
            assert float(trace.output_norms[i][h]) == pytest.approx(frobenius, rel=1e-5)
    weighted = trace.value_attention(1, heads=[2], queries=trace.generated, keys=slice(0, 30))
    plain = trace.attention(1, heads=[2], queries=trace.generated, keys=slice(0, 30))
    torch.testing.assert_close(weighted, plain * trace.value_norms[1][2, :30])


@pytest.mark.parametrize("lazy", [False, True])
def test_values_survive_save_and_load(traced, tmp_path, lazy):
    _, _, trace = traced
    loaded = AttentionTrace.load(trace.save(tmp_path / "t.safetensors"), lazy=lazy)
    for kind in ("values", "value_norms", "output_norms"):
        assert all(torch.equal(a, b) for a, b in zip(getattr(loaded, kind), getattr(trace, kind), strict=True))


def test_a_trace_without_values_says_how_to_get_them(byte_tokenizer_module):
    model = make_tiny_llama(num_hidden_layers=1)
    trace = snapkv_lab.capture(model, byte_tokenizer_module, torch.tensor([[5, 6, 7, 8]]), max_new_tokens=1,
                               progress=False)
    assert trace.values is None
    with pytest.raises(ValueError, match="values=True"):
        trace.value_attention(0)


def test_values_of_a_model_without_o_proj_are_refused_before_the_run(byte_tokenizer_module):
    """GPT-2 names its output projection c_proj: capture(values=True) says so at once, not a KeyError after the run."""
    from families import FAMILIES

    with pytest.raises(NotImplementedError, match="o_proj"):
        snapkv_lab.capture(FAMILIES["gpt2"](), byte_tokenizer_module, torch.tensor([[5, 6, 7, 8]]), max_new_tokens=1,
                           values=True, progress=False)
