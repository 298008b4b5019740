"""Capture and AttentionTrace against transformers' own eager attention (output_attentions=True)."""

from __future__ import annotations

import pytest
import torch
from conftest import eager_twin, make_tiny_llama
from reference import eager_maps
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from snapkv_lab import AttentionTrace, capture, intercept_attention
from snapkv_lab.core.attention import attention_column_sums, attention_probs

ATOL = 1e-5


@pytest.fixture
def prompt_ids():
    torch.manual_seed(1)
    return torch.randint(3, 256, (57,))


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_generated_trace_matches_eager_output_attentions(backend, prompt_ids, byte_tokenizer):
    model = make_tiny_llama(backend)
    trace = capture(model, byte_tokenizer, prompt_ids, max_new_tokens=12, stop_at_eos=False, progress=False)
    assert (trace.prompt_len, trace.n_generated, trace.n_layers) == (57, 12, 2)
    assert (trace.n_heads, trace.n_kv_heads, trace.head_dim) == (4, 2, 16)
    for layer, reference in enumerate(eager_maps(model, trace.token_ids)):
        torch.testing.assert_close(trace.attention(layer), reference, atol=ATOL, rtol=0)
        generated_rows = trace.attention(layer, queries=trace.generated)
        torch.testing.assert_close(generated_rows, reference[:, trace.generated], atol=ATOL, rtol=0)


def test_generated_tokens_are_greedy_generate(prompt_ids, byte_tokenizer, tiny_model):
    trace = capture(tiny_model, byte_tokenizer, prompt_ids, max_new_tokens=10, stop_at_eos=False, progress=False)
    expected = tiny_model.generate(prompt_ids[None], max_new_tokens=10, do_sample=False, min_new_tokens=10)
    assert trace.token_ids.tolist() == expected[0].tolist()


def test_decode_step_rows_match_generate_output_attentions(prompt_ids, byte_tokenizer, tiny_model):
    """The rows of generated tokens equal what eager `generate` returns at each decode step."""
    trace = capture(tiny_model, byte_tokenizer, prompt_ids, max_new_tokens=6, stop_at_eos=False, progress=False)
    out = eager_twin(tiny_model).generate(prompt_ids[None], max_new_tokens=6, do_sample=False, min_new_tokens=6,
                                          output_attentions=True, return_dict_in_generate=True)
    for step in range(1, 6):  # step s feeds generated token s-1, at position prompt_len + s - 1
        row = trace.prompt_len + step - 1
        for layer in range(2):
            decode_row = out.attentions[step][layer][0, :, 0]  # (heads, keys so far)
            torch.testing.assert_close(trace.attention(layer, queries=row, keys=slice(0, row + 1))[:, 0], decode_row,
                                       atol=ATOL, rtol=0)


def test_sdpa_and_eager_traces_agree(prompt_ids, byte_tokenizer):
    sdpa = capture(make_tiny_llama("sdpa"), byte_tokenizer, prompt_ids, continuation=[5, 6, 7, 8], progress=False)
    eager = capture(make_tiny_llama("eager"), byte_tokenizer, prompt_ids, continuation=[5, 6, 7, 8], progress=False)
    for layer in range(2):
        torch.testing.assert_close(sdpa.attention(layer), eager.attention(layer), atol=ATOL, rtol=0)


def test_teacher_forced_continuation(prompt_ids, byte_tokenizer, tiny_model):
    trace = capture(tiny_model, byte_tokenizer, prompt_ids, continuation="hello", progress=False)
    assert trace.meta["mode"] == "teacher-forced"
    assert trace.token_ids[trace.prompt_len:].tolist() == list(b"hello")
    assert trace.generated_text == "hello"
    reference = eager_maps(tiny_model, trace.token_ids)
    torch.testing.assert_close(trace.attention(1, queries=trace.generated), reference[1][:, trace.generated], atol=ATOL,
                               rtol=0)


def test_blocks_heads_and_columns(prompt_ids, byte_tokenizer, tiny_model):
    trace = capture(tiny_model, byte_tokenizer, prompt_ids, max_new_tokens=5, stop_at_eos=False, progress=False)
    reference = eager_maps(tiny_model, trace.token_ids)[1]
    block = trace.attention(1, heads=[3, 0], queries=slice(40, 50), keys=[0, 2, 45, 61])
    torch.testing.assert_close(block, reference[[3, 0]][:, 40:50][:, :, [0, 2, 45, 61]], atol=ATOL, rtol=0)
    # Rows are normalised over all keys they see: the selected columns alone do not sum to one.
    assert float(block.sum(-1).max()) < 1.0
    # Column sums of a window: the SnapKV vote before pooling.
    torch.testing.assert_close(trace.column_sums(1, queries=slice(30, 57)), reference[:, 30:57].sum(1), atol=ATOL,
                               rtol=0)
    # Per-row top-k, with causal padding for early rows.
    values, indices = trace.row_topk(1, 4, queries=[0, 2, 60])
    expected = torch.topk(reference[:, [0, 2, 60]], 4, dim=-1)
    torch.testing.assert_close(values[:, 2], expected.values[:, 2], atol=ATOL, rtol=0)
    assert torch.equal(indices[:, 2], expected.indices[:, 2])
    assert indices[:, 0].tolist() == [[0, -1, -1, -1]] * 4 and float(values[:, 0, 1:].abs().sum()) == 0


def test_small_blocks_equal_one_block():
    torch.manual_seed(2)
    q, k = torch.randn(6, 40, 8), torch.randn(3, 40, 8)
    rows = torch.arange(40)
    one = attention_column_sums(q, k, 0.3, rows)
    many = attention_column_sums(q, k, 0.3, rows, block_elements=1)
    torch.testing.assert_close(one, many)
    probs = attention_probs(q, k, 0.3, rows)
    torch.testing.assert_close(probs.sum(-1), torch.ones(6, 40))
    assert float(probs.triu(diagonal=1).abs().sum()) == 0.0


def test_layers_subset_and_unrecorded_layer(prompt_ids, byte_tokenizer, tiny_model):
    trace = capture(tiny_model, byte_tokenizer, prompt_ids, max_new_tokens=2, layers=[1], progress=False)
    assert trace.layers == [1]
    with pytest.raises(KeyError, match="layer 0 was not recorded"):
        trace.attention(0)


def test_save_load_round_trip(tmp_path, prompt_ids, byte_tokenizer, tiny_model):
    trace = capture(tiny_model, byte_tokenizer, prompt_ids, max_new_tokens=4, stop_at_eos=False, progress=False)
    loaded = AttentionTrace.load(trace.save(tmp_path / "t.safetensors"))
    assert loaded.tokens == trace.tokens and loaded.prompt_len == trace.prompt_len and loaded.meta == trace.meta
    assert torch.equal(loaded.token_ids, trace.token_ids) and loaded.scaling == trace.scaling
    torch.testing.assert_close(loaded.attention(1), trace.attention(1), atol=0, rtol=0)
    assert loaded.attention_settings == trace.attention_settings


def test_intercept_is_reversible_and_leaves_logits_alone(prompt_ids, tiny_model):
    before = dict(ALL_ATTENTION_FUNCTIONS._local_mapping)
    calls = []
    with torch.no_grad():
        plain = tiny_model(prompt_ids[None]).logits
        with pytest.raises(RuntimeError, match="boom"):
            with intercept_attention(tiny_model, lambda m, *a, **k: calls.append(m.layer_idx)):
                hooked = tiny_model(prompt_ids[None]).logits
                raise RuntimeError("boom")
    assert calls == [0, 1]
    assert torch.equal(plain, hooked)
    assert ALL_ATTENTION_FUNCTIONS._local_mapping == before


def test_bad_prompts(byte_tokenizer, tiny_model):
    with pytest.raises(ValueError, match="one prompt"):
        capture(tiny_model, byte_tokenizer, torch.ones(2, 5, dtype=torch.long), progress=False)
    with pytest.raises(ValueError, match="empty"):
        capture(tiny_model, byte_tokenizer, [], progress=False)


def test_stops_at_eos(prompt_ids, byte_tokenizer, tiny_model):
    trace = capture(tiny_model, byte_tokenizer, prompt_ids, max_new_tokens=30, stop_at_eos=False, progress=False)
    first = trace.token_ids[trace.prompt_len:].tolist()
    # Pretend the 3rd generated token is EOS: generation must stop right after it.
    byte_tokenizer.eos_token_id = first[2]
    tiny_model.generation_config.eos_token_id = first[2]
    stopped = capture(tiny_model, byte_tokenizer, prompt_ids, max_new_tokens=30, progress=False)
    assert stopped.token_ids[stopped.prompt_len:].tolist() == first[:3]


# What "exact" means in bf16. The recompute is the float32 softmax of the model's own stored bf16 q/k:
# it matches a float64 computation from the same q/k to float32 rounding (1.2e-6 measured). Eager bf16 attention rounds
# its logits and probabilities to bf16, so it differs from the recompute by a model-dependent amount: measured max |dp|
# 0.0035 on this tiny model (init 0.1) and 0.080 on SmolLM2-135M (docs/capture.md, "What exact means").
BF16_RECOMPUTE_ATOL = 2e-6
BF16_EAGER_ATOL = {"tiny": 0.01, "smollm2": 0.1}


def float64_attention(trace, entry: int) -> torch.Tensor:
    """(heads, n, n) causal softmax in float64 from the trace's stored queries and keys."""
    query, key = trace.queries[entry].double(), trace.keys[entry].double()
    key = key.repeat_interleave(query.shape[0] // key.shape[0], dim=0)
    logits = query @ key.transpose(1, 2) * trace.scaling
    future = torch.ones(logits.shape[-1], logits.shape[-1], dtype=torch.bool).triu(1)
    return logits.masked_fill(future, float("-inf")).softmax(-1)


def assert_bf16_bounds(model, tokenizer, prompt, eager_atol):
    trace = capture(model, tokenizer, prompt, max_new_tokens=8, stop_at_eos=False, progress=False)
    assert trace.queries[0].dtype == torch.bfloat16
    with torch.no_grad():
        eager = eager_twin(model)(trace.token_ids[None], output_attentions=True).attentions
    for entry, layer in enumerate(trace.layers):
        recomputed = trace.attention(layer)
        torch.testing.assert_close(recomputed.double(), float64_attention(trace, entry), atol=BF16_RECOMPUTE_ATOL,
                                   rtol=0)
        torch.testing.assert_close(recomputed, eager[layer][0].float(), atol=eager_atol, rtol=0)


def test_bf16_recompute_is_exact_and_eager_bf16_within_its_bound(byte_tokenizer):
    model = make_tiny_llama(initializer_range=0.1).to(torch.bfloat16)
    assert_bf16_bounds(model, byte_tokenizer, torch.randint(3, 256, (200,), generator=torch.Generator().manual_seed(0)),
                       BF16_EAGER_ATOL["tiny"])


@pytest.mark.slow
def test_bf16_bounds_on_smollm():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from snapkv_lab.core.models import bundled_checkpoint
    from snapkv_lab.tasks.corpus import pydoc_topics

    tokenizer = AutoTokenizer.from_pretrained(bundled_checkpoint())
    model = AutoModelForCausalLM.from_pretrained(bundled_checkpoint(), dtype=torch.bfloat16).eval()
    prompt = [{"role": "user", "content": pydoc_topics()["assert"][:1200] + "\n\nSummarise the text above."}]
    assert_bf16_bounds(model, tokenizer, prompt, BF16_EAGER_ATOL["smollm2"])
