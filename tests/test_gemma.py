"""The second real model, Gemma 3 270M base: MQA (4 query heads, 1 KV head), 15 sliding-window layers (512) and
3 global ones, no chat template. The family matrix's checks on the real weights (capture against eager, SnapKV
against a plain reference, the cache lengths of sliding layers), and retrieval through the plain-text framing."""

from __future__ import annotations

import pytest
import torch
from conftest import eager_twin, gguf_reference
from reference import assert_same_selection, eager_maps, reference_kept

import snapkv_lab
from snapkv_lab.core.framing import bos_text
from snapkv_lab.core.tokens import encode
from snapkv_lab.tasks.corpus import haystack_ids
from snapkv_lab.tasks.needles import found_exactly, needle_context

pytestmark = pytest.mark.slow
GLOBAL_LAYERS = (5, 11, 17)


def real_text(tokenizer, n: int, start: int = 3) -> torch.Tensor:
    """(n,) ids: BOS and n - 1 tokens of the essays."""
    return torch.tensor(encode(tokenizer, bos_text(tokenizer)) + haystack_ids(tokenizer, n - 1, start=start))


def test_gemma_loads_by_name_as_the_base_model_it_is(gemma):
    model, tokenizer = gemma
    config = model.config
    assert model.config.name_or_path == "gemma-3-270m" and not tokenizer.chat_template
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (18, 4, 1)
    assert config.sliding_window == 512 and config.max_position_embeddings == 32768
    assert [i for i, kind in enumerate(config.layer_types) if kind == "full_attention"] == list(GLOBAL_LAYERS)


def test_gemma_converted_copy_equals_gguf_model(gemma):
    from snapkv_lab.core.models import bundled_gguf_path

    reference = gguf_reference(bundled_gguf_path("gemma-3-270m"))
    ids = real_text(gemma[1], 64)[None]
    with torch.no_grad():
        torch.testing.assert_close(gemma[0](ids).logits, reference(ids).logits, atol=1e-4, rtol=0)


def test_gemma_capture_matches_eager_past_the_sliding_window(gemma):
    """700 prompt tokens (past the 512-token window) and 8 greedy ones: every layer's map, sliding and global,
    equals eager output_attentions over the same tokens; sliding rows give no weight past their window."""
    model, tokenizer = gemma
    trace = snapkv_lab.capture(model, tokenizer, real_text(tokenizer, 700), max_new_tokens=8, stop_at_eos=False,
                               progress=False)
    reference = eager_maps(eager_twin(model), trace.token_ids)
    for layer in (0, 4, 5, 11, 16, 17):
        torch.testing.assert_close(trace.attention(layer), reference[layer], atol=2e-5, rtol=0,
                                   msg=lambda m, layer=layer: f"layer {layer}: {m}")
    last = trace.attention(0, queries=[trace.n_tokens - 1])
    assert last[..., : trace.n_tokens - 512].abs().max() == 0 and last[..., -512:].sum(-1).allclose(torch.ones(1))
    assert trace.attention(5, queries=[trace.n_tokens - 1])[..., :100].sum() > 0  # a global row sees the start


def test_gemma_snapkv_keeps_the_reference_positions_and_leaves_sliding_layers_bounded(gemma):
    """On the global layers SnapKV keeps what a plain SnapKV over eager maps keeps; the sliding layers keep the
    model's own bounded cache (their last 511 positions), named as such."""
    model, tokenizer = gemma
    ids = real_text(tokenizer, 900, start=11)[None]
    window, capacity = 32, 256
    result = snapkv_lab.generate(model, tokenizer, ids, policy=snapkv_lab.SnapKV(capacity=capacity, window_size=window),
                                 max_new_tokens=2)
    ref_kept, ref_scores = reference_kept(eager_twin(model), ids, window, capacity, pooling="max", kernel=7)
    assert_same_selection([result.kept_indices[i] for i in GLOBAL_LAYERS], [ref_kept[i] for i in GLOBAL_LAYERS],
                          [ref_scores[i] for i in GLOBAL_LAYERS], window, layers=GLOBAL_LAYERS)
    for layer, length in enumerate(result.cache_lengths):
        assert length == (capacity if layer in GLOBAL_LAYERS else 511), layer


@pytest.mark.parametrize("depth", [0.2, 0.8])
def test_gemma_finds_a_needle_in_plain_framing_with_the_small_budget_policies(gemma, depth):
    """A base model, framed as "Question: ... Answer: <opening words>": the full cache and the small-budget policies
    at 25% of 2000 tokens (SnapKVFactKernel query-aware, Surprisal in both modes) answer the needle's value."""
    from snapkv_lab.pressure.runner import run_retrieval

    model, tokenizer = gemma
    context = needle_context(tokenizer, 2000, depth, sample=5)
    assert tokenizer.decode(context.queries[0].question_ids).startswith("\n\nQuestion: What is the special "
                                                                        "magic number")
    table = run_retrieval(model, tokenizer, [context], policies=[snapkv_lab.SnapKVFactKernel(), snapkv_lab.Surprisal()],
                          capacities=[500], max_new_tokens=16, progress=False)
    runs = {(row.policy, row.mode): found_exactly(row.expected, row.output) for row in table.itertuples()}
    expected_runs = {("FullCache", "full"), ("SnapKVFactKernel", "query-aware"), ("Surprisal", "query-aware"),
                     ("Surprisal", "query-agnostic")}
    assert expected_runs <= set(runs)
    assert all(runs[run] for run in expected_runs), table[["policy", "mode", "output"]]
