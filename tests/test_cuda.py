"""The library on a CUDA GPU, each result checked against a reference: the same computation on a CPU copy, a
CPU run of the same weights, attention written out in fp32, or transformers' eager attention.

Run with `python3 -m pytest -q -m cuda`. Every test is skipped where torch sees no CUDA GPU; the
flash_attention_2 tests also where flash_attn does not import.
"""

from __future__ import annotations

import dataclasses
import importlib

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import ByteTokenizer, eager_twin, make_tiny_llama

import snapkv_lab as sl
from snapkv_lab import AttentionTrace, capture
from snapkv_lab.core.overlap import SinkRule, selection_vs_generation, to_mask
from snapkv_lab.core.selection import select_from_trace

ATOL = 1e-5  # fp32: CUDA vs CPU
FP32_RECOMPUTE_ATOL = 1e-6  # a bf16 trace's maps vs the same stored queries and keys written out in fp32
# Recomputing in fp32 from bf16 queries and keys vs eager bf16 output_attentions, whose probabilities are rounded
# to bf16: docs/capture.md states up to 0.026 (measured on CPU with SmolLM2); on the tiny model below it is about 0.005.
BF16_EAGER_ATOL = 0.03
WINDOW, CAPACITY = 8, 40


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]
needs_flash = pytest.mark.skipif(not _importable("flash_attn"),
                                 reason="needs flash-attn for flash_attention_2 (pip install 'snapkv_lab[gpu]')")


def peaked_llama(attn: str = "sdpa", **overrides):
    """The tiny test Llama with an init of 0.1 instead of 0.02: its attention is peaked (maps differ from uniform
    by 0.25-0.5), so a wrong map cannot pass the bf16 bound, yet bf16 rounding stays about 6x below that bound."""
    return make_tiny_llama(attn, initializer_range=0.1, **overrides)


def flash_llama():
    model = peaked_llama().to("cuda", torch.bfloat16)
    model.set_attn_implementation("flash_attention_2")
    return model


def on_cpu(trace: AttentionTrace) -> AttentionTrace:
    return dataclasses.replace(trace, token_ids=trace.token_ids.cpu(), queries=[q.cpu() for q in trace.queries],
                               keys=[k.cpu() for k in trace.keys])


def to_cpu(result):
    return tuple(to_cpu(r) for r in result) if isinstance(result, tuple) else result.cpu()


def plain_attention(query: torch.Tensor, key: torch.Tensor, scaling: float) -> torch.Tensor:
    """Causal softmax attention of a whole sequence written out in fp32 on CPU, KV heads repeated per group."""
    query = query.float().cpu()
    key = key.float().cpu().repeat_interleave(query.shape[0] // key.shape[0], dim=0)
    logits = query @ key.transpose(1, 2) * scaling
    future = torch.ones(logits.shape[-2:], dtype=torch.bool).triu(1)
    return logits.masked_fill(future, float("-inf")).softmax(-1)


def assert_matches_eager_bf16(model, trace: AttentionTrace) -> None:
    """The trace's maps vs the eager bf16 output_attentions of the same weights over the trace's tokens."""
    twin = eager_twin(model).to(torch.bfloat16)
    with torch.no_grad():
        maps = twin(trace.token_ids[None].to("cuda"), output_attentions=True).attentions
    n = trace.n_tokens
    uniform = torch.ones(n, n).tril() / torch.arange(1, n + 1)[:, None]
    for layer, reference in zip(trace.layers, maps):
        reference = reference[0].float().cpu()
        assert float((reference - uniform).abs().max()) > 5 * BF16_EAGER_ATOL  # the bound can tell maps apart
        torch.testing.assert_close(trace.attention(layer).cpu(), reference, atol=BF16_EAGER_ATOL, rtol=0)


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(3, 256, (57,), generator=torch.Generator().manual_seed(1))


def run_capture(model, prompt, **kwargs) -> AttentionTrace:
    return capture(model, ByteTokenizer(), prompt, max_new_tokens=12, stop_at_eos=False, progress=False, **kwargs)


@pytest.fixture(scope="module")
def cuda_trace(prompt):
    return run_capture(peaked_llama().to("cuda"), prompt, store_device=None)


# ---- capture and the trace on CUDA (fp32) -----------------------------------------------------------------
def test_capture_keeps_the_trace_on_cuda_and_matches_a_cpu_run(cuda_trace, prompt):
    assert all(t.is_cuda for t in cuda_trace.queries + cuda_trace.keys)
    cpu_trace = run_capture(peaked_llama(), prompt)  # test_capture checks CPU traces against eager attention
    assert cuda_trace.token_ids.tolist() == cpu_trace.token_ids.tolist()
    for layer in cpu_trace.layers:
        torch.testing.assert_close(cuda_trace.attention(layer).cpu(), cpu_trace.attention(layer), atol=ATOL, rtol=0)


@pytest.mark.parametrize("compute", [
    pytest.param(lambda t: t.attention(1), id="attention"),
    pytest.param(lambda t: t.attention(1, heads=[3, 0], queries=slice(40, 50), keys=[0, 2, 45, 61]),
                 id="attention-block"),
    pytest.param(lambda t: t.attention(0, heads=2, queries=[5, 60], keys=t.prompt), id="attention-rows"),
    pytest.param(lambda t: t.column_sums(1, queries=slice(49, 57)), id="column_sums"),
    pytest.param(lambda t: t.column_sums(0, queries=t.generated, heads=[1, 2]), id="column_sums-heads"),
    pytest.param(lambda t: t.row_topk(1, 4, queries=[0, 2, 60]), id="row_topk"),
    pytest.param(lambda t: select_from_trace(t, 1, slice(49, 57), 10), id="select_from_trace"),
])
def test_trace_computations_on_cuda_equal_a_cpu_copy(cuda_trace, compute):
    torch.testing.assert_close(to_cpu(compute(cuda_trace)), compute(on_cpu(cuda_trace)), atol=ATOL, rtol=0)


def pooled_scores(trace: AttentionTrace, layer: int, voters: slice, kv_heads: int | None = None) -> torch.Tensor:
    """SnapKV's ranking of the prefix before voters, as the paper defines it: window votes, max-pooled (kernel 7),
    averaged over each KV head's query heads: (heads or kv_heads, prefix)."""
    votes = trace.attention(layer, queries=voters)[..., :voters.start].sum(1)
    pooled = torch.nn.functional.max_pool1d(votes[:, None], 7, stride=1, padding=3)[:, 0]
    return pooled if kv_heads is None else pooled.unflatten(0, (kv_heads, -1)).mean(1)


def assert_top_k_of(scores: torch.Tensor, kept: torch.Tensor) -> None:
    """`kept` (rows, k) holds a top k of `scores` (rows, n): the k largest scores, whichever members of a tied
    plateau (max pooling makes them) a device's torch.topk took at the boundary."""
    torch.testing.assert_close(scores.gather(-1, kept.cpu()).sort(-1).values,
                               scores.topk(kept.shape[-1]).values.sort(-1).values, atol=ATOL, rtol=0)


def test_max_pooled_gqa_selection_on_cuda_is_a_top_k_of_the_cpu_scores(cuda_trace):
    """Max pooling makes plateaus of equal scores; torch.topk (the official code's and kvpress's choice, kept here)
    breaks ties differently on CUDA and CPU, so the kept scores, not the positions, must agree."""
    cpu_trace, voters = on_cpu(cuda_trace), slice(49, 57)
    scores = pooled_scores(cpu_trace, 0, voters, kv_heads=2)
    mine = select_from_trace(cuda_trace, 0, voters, 0.25, pooling="max", kv_heads=2)
    assert mine.is_cuda
    assert_top_k_of(scores, mine)
    assert_top_k_of(scores, select_from_trace(cpu_trace, 0, voters, 0.25, pooling="max", kv_heads=2))


def test_metrics_on_a_cuda_trace_equal_a_cpu_copy(cuda_trace):
    def metric_table(trace):
        window = slice(trace.prompt_len - WINDOW, trace.prompt_len)
        prefix = slice(0, window.start)
        rows = []
        for layer in trace.layers:
            kept = to_mask(select_from_trace(trace, layer, window, 16), window.start)
            attn = trace.attention(layer, queries=trace.generated, keys=prefix)
            rows += selection_vs_generation(attn, {"snapkv": kept}, sinks=SinkRule().mask(attn), layer=layer,
                                            observed=trace.attention(layer, queries=window, keys=prefix))
        return pd.DataFrame(rows)

    expected = metric_table(on_cpu(cuda_trace))
    assert expected["value"].notna().any()  # NaN cells would compare equal whatever the values
    pd.testing.assert_frame_equal(metric_table(cuda_trace), expected, check_exact=False, atol=ATOL, rtol=0)


def test_plots_of_a_cuda_trace_equal_a_cpu_copy(cuda_trace):
    cpu_trace = on_cpu(cuda_trace)
    plots = pytest.importorskip("snapkv_lab.plots", reason="the figures need plotly")  # not in the lent GPU's image
    for draw in (lambda t: plots.attention_heatmap(t, 1, 2), lambda t: plots.attention_heatmap(t, 0, 1, max_cells=20)):
        np.testing.assert_allclose(draw(cuda_trace).data[0].z, draw(cpu_trace).data[0].z, atol=ATOL, rtol=0)
    # The window figure draws log10 p: compared as probabilities.
    window = [10 ** plots.window_attention_figure(t, window=WINDOW).data[0].z for t in (cuda_trace, cpu_trace)]
    np.testing.assert_allclose(*window, atol=ATOL, rtol=0)
    query = cuda_trace.prompt_len
    weights = plots.token_attention(cpu_trace, query)
    torch.testing.assert_close(plots.token_attention(cuda_trace, query).cpu(), weights, atol=ATOL, rtol=0)
    top = int(torch.argmax(weights[1:])) + 1
    assert f"{top:>6} " in plots.spotlight(cuda_trace, query, top=3).data


def test_load_onto_cuda_round_trip(tmp_path, cuda_trace):
    loaded = AttentionTrace.load(cuda_trace.save(tmp_path / "trace.safetensors"), device="cuda")
    assert all(t.is_cuda for t in loaded.queries + loaded.keys)
    assert (loaded.tokens, loaded.prompt_len, loaded.layers, loaded.scaling, loaded.meta) == (
        cuda_trace.tokens, cuda_trace.prompt_len, cuda_trace.layers, cuda_trace.scaling, cuda_trace.meta)
    assert loaded.token_ids.tolist() == cuda_trace.token_ids.tolist()
    for mine, original in zip(loaded.queries + loaded.keys, cuda_trace.queries + cuda_trace.keys):
        assert torch.equal(mine, original)
    torch.testing.assert_close(loaded.attention(1), cuda_trace.attention(1), atol=0, rtol=0)


def test_explorer_on_a_cuda_trace_equals_a_cpu_copy(tmp_path, cuda_trace):
    """The exact passes and zooms run on the trace's device; what is drawn equals a CPU trace's, lazily loaded too."""
    explore = pytest.importorskip("snapkv_lab.explorer", reason="the explorer needs plotly").explore

    lazy = AttentionTrace.load(cuda_trace.save(tmp_path / "trace.safetensors"), device="cuda", lazy=True)
    for trace in (cuda_trace, lazy):
        cpu_view = explore(on_cpu(cuda_trace), layer=1, head="mean", max_cells=16, progress=False)  # a zoom moves it
        view = explore(trace, layer=1, head="mean", max_cells=16, progress=False)
        np.testing.assert_allclose(view.drawn(), cpu_view.drawn(), atol=ATOL, rtol=0)
        rows, cols = slice(trace.prompt_len - 8, trace.n_tokens), slice(0, 12)
        overview = view.block
        np.testing.assert_allclose(view.zoom(rows=rows, cols=cols).drawn(),
                                   cpu_view.zoom(rows=rows, cols=cols).drawn(), atol=ATOL, rtol=0)
        assert view.block == cpu_view.block < overview  # 21 x 12 tokens in at most 16 cells: blocks of 2


# ---- compression on CUDA (fp32) -----------------------------------------------------------------------------
@pytest.mark.parametrize("per_query_head", [False, True])
def test_snapkv_generate_on_cuda_equals_cpu(per_query_head):
    """Without pooling (no tied scores) every kept position and token is the CPU run's."""
    ids = torch.randint(2, 256, (2, 96), generator=torch.Generator().manual_seed(1))
    policy = sl.SnapKVNoPooling(capacity=CAPACITY, window_size=WINDOW, per_query_head=per_query_head)
    cpu = sl.generate(peaked_llama(), ByteTokenizer(), ids, policy=policy, max_new_tokens=16)
    gpu = sl.generate(peaked_llama().to("cuda"), ByteTokenizer(), ids, policy=policy, max_new_tokens=16)
    assert torch.equal(gpu.token_ids, cpu.token_ids)
    assert len(gpu.kept_indices) == len(cpu.kept_indices) == 2
    assert all(torch.equal(g.cpu(), c) for g, c in zip(gpu.kept_indices, cpu.kept_indices))
    assert gpu.cache_lengths == cpu.cache_lengths == [CAPACITY] * 2
    assert gpu.kv_bytes == cpu.kv_bytes


def test_max_pooled_snapkv_on_cuda_keeps_a_top_k_of_the_cpu_scores():
    """SnapKV as the paper defines it (max pooling): per layer and row, the CUDA run keeps the window and a top k of
    the prefix scores that a CPU trace of the same prompt gives (the prefill attends to the whole prompt, so each
    layer's scores do not depend on what earlier layers kept)."""
    ids = torch.randint(2, 256, (2, 96), generator=torch.Generator().manual_seed(1))
    gpu = sl.generate(peaked_llama().to("cuda"), ByteTokenizer(), ids,
                      policy=sl.SnapKV(capacity=CAPACITY, window_size=WINDOW), max_new_tokens=4)
    prefix, model = ids.shape[1] - WINDOW, peaked_llama()
    for row in range(ids.shape[0]):
        trace = run_capture(model, ids[row])
        for layer in trace.layers:
            kept = gpu.kept_indices[layer][row].cpu()  # (kv_heads, CAPACITY) sorted
            assert torch.equal(kept[:, -WINDOW:], torch.arange(prefix, ids.shape[1]).expand(kept.shape[0], -1))
            scores = pooled_scores(trace, layer, slice(prefix, ids.shape[1]), kv_heads=kept.shape[0])
            assert_top_k_of(scores, kept[:, :-WINDOW])


def test_compress_and_model_generate_on_cuda_equal_generate():
    model = peaked_llama().to("cuda")
    ids = torch.randint(2, 256, (2, 80), generator=torch.Generator().manual_seed(6)).to("cuda")
    policy = sl.SnapKV(capacity=CAPACITY, window_size=WINDOW)
    ours = sl.generate(model, ByteTokenizer(), ids, policy=policy, max_new_tokens=16)
    with sl.compress(model, policy) as state:
        theirs = model.generate(ids, past_key_values=state.cache, max_new_tokens=16, do_sample=False, eos_token_id=None)
    assert torch.equal(theirs[:, 80:].cpu(), ours.token_ids)
    assert all(torch.equal(state.kept_indices[i].cpu(), ours.kept_indices[i]) for i in range(2))


# ---- snapkv-lab eval on CUDA (fp32) --------------------------------------------------------------------------
def ruler_rows(device: str):
    """run_example on one generated RULER needle of 1024 byte tokens: the full cache and every registered compressor
    at ratio 0.5, both modes, on the peaked tiny model placed on `device`."""
    from snapkv_lab.evaluation import eval_cells, run_example

    [cell] = eval_cells(None, ["ruler"], ["niah_single_1"], ["all"], ratios=[0.5], limit=1, lengths=(1024,))
    model = peaked_llama(max_position_embeddings=2048).to(device)
    return run_example(model, ByteTokenizer(), cell.config).set_index(["policy", "ratio", "mode"]).sort_index()


def test_every_policy_in_an_eval_run_on_cuda_keeps_and_answers_as_on_cpu():
    """The eval path (one shared prefill, both modes, the official metric) on CUDA: the CPU run's rows, each with the
    same prompt and kept tokens; answers compared on their first 16 tokens, where fp32 rounding has not yet
    compounded through greedy decoding. A policy whose scores tie (max pooling) may keep other positions of equal
    score on CUDA (test_max_pooled_snapkv_... above), hence a share of agreeing answers, not all."""
    cpu, gpu = ruler_rows("cpu"), ruler_rows("cuda")
    assert list(gpu.index) == list(cpu.index) and len(cpu) == 1 + 2 * (len(sl.POLICIES) - 1)
    for column in ("context_tokens", "prompt_tokens", "kept_tokens"):
        assert gpu[column].tolist() == cpu[column].tolist(), column
    assert gpu.score.between(0, 1).all() and (gpu.decode_ms_per_token > 0).all()
    start = lambda table: table.prediction.str.slice(0, 16)  # noqa: E731  (about 16 byte tokens)
    same = start(gpu) == start(cpu)
    assert same.loc["FullCache"].all()
    assert same.mean() >= 0.75, same[~same].index.tolist()


# ---- bf16 -----------------------------------------------------------------------------------------------------
def test_bf16_trace_recomputes_its_stored_queries_and_keys_exactly(prompt):
    trace = run_capture(peaked_llama().to("cuda", torch.bfloat16), prompt, store_device=None)
    assert trace.queries[0].dtype == torch.bfloat16 and trace.meta["dtype"] == "bfloat16"
    for entry, layer in enumerate(trace.layers):
        expected = plain_attention(trace.queries[entry], trace.keys[entry], trace.scaling)
        torch.testing.assert_close(trace.attention(layer).cpu(), expected, atol=FP32_RECOMPUTE_ATOL, rtol=0)


def test_bf16_trace_matches_eager_bf16_output_attentions(prompt):
    model = peaked_llama().to("cuda", torch.bfloat16)
    assert_matches_eager_bf16(model, run_capture(model, prompt, store_device=None))


# ---- flash_attention_2 (bf16) --------------------------------------------------------------------------------
@needs_flash
def test_flash_capture_matches_eager_bf16(prompt):
    model = flash_llama()
    trace = run_capture(model, prompt, store_device=None)
    assert trace.meta["attn_implementation"] == "flash_attention_2"
    assert_matches_eager_bf16(model, trace)


@needs_flash
def test_flash_generate_with_snapkv_keeps_capacity_and_sdpa_selection():
    model = flash_llama()
    ids = torch.randint(2, 256, (1, 96), generator=torch.Generator().manual_seed(1))
    policy = sl.SnapKV(capacity=CAPACITY, window_size=WINDOW)
    flash = sl.generate(model, ByteTokenizer(), ids, policy=policy, max_new_tokens=8)
    assert flash.cache_lengths == [CAPACITY] * model.config.num_hidden_layers
    model.set_attn_implementation("sdpa")
    sdpa = sl.generate(model, ByteTokenizer(), ids, policy=policy, max_new_tokens=8)
    # Layer 0 sees the same queries and keys under both backends, so it keeps the same positions. Later layers
    # inherit bf16 rounding differences from the attention outputs: most prefix picks agree (eager vs sdpa on
    # CPU: 90%), where a wrong selection would share about 32 / 88 of them by chance.
    assert torch.equal(flash.kept_indices[0], sdpa.kept_indices[0])
    for mine, reference in zip(flash.kept_indices[1:], sdpa.kept_indices[1:]):
        mine, reference = mine[..., :-WINDOW], reference[..., :-WINDOW]
        assert (mine[..., :, None] == reference[..., None, :]).any(-1).float().mean() > 0.75


@needs_flash
def test_flash_refuses_a_padded_batch():
    model = flash_llama()
    ids = torch.randint(2, 256, (2, 60), generator=torch.Generator().manual_seed(2)).to("cuda")
    policy = sl.SnapKV(capacity=CAPACITY, window_size=WINDOW)
    unpadded = torch.ones_like(ids)
    with sl.compress(model, policy) as state:  # the same batch without padding is compressed
        model.generate(ids, attention_mask=unpadded, past_key_values=state.cache, max_new_tokens=2, do_sample=False)
    assert state.kept_indices[0].shape == (2, model.config.num_key_value_heads, CAPACITY)
    padded = unpadded.clone()
    padded[1, :10] = 0
    with pytest.raises(NotImplementedError, match="padded batches are not supported"):
        with sl.compress(model, policy) as state:
            model.generate(ids, attention_mask=padded, past_key_values=state.cache, max_new_tokens=2, do_sample=False)
