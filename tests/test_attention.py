"""The blockwise recompute against a plain dense computation (causal, sliding window, soft-cap, GQA), position
selectors, and what a trace file must hold."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tiny_llama
from safetensors.torch import save_file

from snapkv_lab import AttentionTrace, capture
from snapkv_lab.core.attention import AttentionSettings, attention_column_sums, attention_probs, attention_row_topk
from snapkv_lab.core.trace import positions


def dense_attention(query, key, scaling, *, sliding_window=None, softcap=None):
    """The whole (heads, n, n) map in float64, written from the definition: logits, soft-cap, mask, softmax."""
    groups = query.shape[0] // key.shape[0]
    key = key.double().repeat_interleave(groups, dim=0)  # query head h reads KV head h // groups
    logits = query.double() @ key.transpose(1, 2) * scaling  # (heads, n, n)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    q = torch.arange(query.shape[1])[:, None]
    k = torch.arange(key.shape[1])[None, :]
    visible = k <= q
    if sliding_window is not None:
        visible &= k > q - sliding_window  # the row sees its last `sliding_window` keys, itself included
    return logits.masked_fill(~visible, float("-inf")).softmax(-1)


@pytest.mark.parametrize("options",
                         [dict(), dict(sliding_window=5), dict(softcap=3.0), dict(sliding_window=7, softcap=2.0)],
                         ids=["causal", "sliding", "softcap", "both"])
@pytest.mark.parametrize("block_elements", [1, 1 << 20], ids=["row-blocks", "one-block"])
def test_blockwise_equals_dense(options, block_elements):
    torch.manual_seed(0)
    query, key = torch.randn(6, 40, 8) * 2, torch.randn(3, 40, 8) * 2
    rows = torch.arange(40)
    dense = dense_attention(query, key, 0.4, **options).float()
    probs = attention_probs(query, key, 0.4, rows, block_elements=block_elements, **options)
    torch.testing.assert_close(probs, dense, atol=1e-6, rtol=0)
    sums = attention_column_sums(query, key, 0.4, rows, block_elements=block_elements, **options)
    torch.testing.assert_close(sums, dense.sum(1), atol=1e-5, rtol=0)
    values, indices = attention_row_topk(query, key, 0.4, rows, 6, block_elements=block_elements, **options)
    window = options.get("sliding_window") or 40
    for row in (0, 3, 20, 39):
        seen = min(6, row + 1, window)  # keys the row can see at all
        expected = dense[:, row].topk(seen, dim=-1)
        torch.testing.assert_close(values[:, row, :seen], expected.values, atol=1e-6, rtol=0)
        assert torch.equal(indices[:, row, :seen], expected.indices)
        assert (indices[:, row, seen:] == -1).all() and (values[:, row, seen:] == 0).all()


def test_sliding_window_hides_old_keys_only():
    torch.manual_seed(1)
    probs = attention_probs(torch.randn(2, 30, 4), torch.randn(2, 30, 4), 1.0, torch.arange(30), sliding_window=4)
    assert (probs[:, 20, 17:21] > 0).all() and (probs[:, 20, :17] == 0).all() and (probs[:, 20, 21:] == 0).all()


def test_position_selectors():
    assert positions(None, 4).tolist() == [0, 1, 2, 3]
    assert positions(-1, 4).tolist() == [3]
    assert positions(slice(1, 3), 4).tolist() == [1, 2]
    assert positions([0, -1], 4).tolist() == [0, 3]
    # A boolean mask picks where it is True (it used to be read as the indices 0 and 1).
    assert positions(torch.tensor([False, True, False, True]), 4).tolist() == [1, 3]
    assert positions([True, False, False, True], 4).tolist() == [0, 3]
    with pytest.raises(ValueError, match="boolean mask of positions must have shape"):
        positions(torch.tensor([True, False]), 4)
    with pytest.raises(TypeError, match="integers or a boolean mask"):
        positions(torch.tensor([0.5]), 4)


def test_boolean_mask_selects_the_same_block_as_indices(byte_tokenizer):
    trace = capture(make_tiny_llama(), byte_tokenizer, torch.arange(3, 40), max_new_tokens=3, stop_at_eos=False,
                    progress=False)
    mask = torch.zeros(trace.n_tokens, dtype=torch.bool)
    mask[[2, 5, 30]] = True
    torch.testing.assert_close(trace.attention(1, queries=mask, keys=mask), trace.attention(1, queries=[2, 5, 30],
                                                                                            keys=[2, 5, 30]))


@pytest.fixture
def saved(tmp_path, byte_tokenizer):
    trace = capture(make_tiny_llama(), byte_tokenizer, torch.arange(3, 40), max_new_tokens=4, stop_at_eos=False,
                    progress=False)
    return trace, trace.save(tmp_path / "trace.safetensors")


def _rewrite(path, target, header_change=None, drop=None):
    """Copy a saved trace with its header edited (a value None removes the entry) or a tensor left out."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        header = json.loads(f.metadata()["snapkv_lab"])
        tensors = {name: f.get_tensor(name) for name in f.keys() if name != drop}
    for name, value in (header_change or {}).items():
        if value is None:
            del header[name]
        else:
            header[name] = value
    save_file(tensors, str(target), metadata={"snapkv_lab": json.dumps(header)})
    return target


def test_settings_survive_save_and_load(saved, tmp_path):
    trace, path = saved
    trace.attention_settings = [AttentionSettings(trace.scaling, sliding_window=9, softcap=4.0)] * 2
    loaded = AttentionTrace.load(trace.save(tmp_path / "sliding.safetensors"))
    assert loaded.layer_settings(1) == AttentionSettings(trace.scaling, 9, 4.0)
    torch.testing.assert_close(loaded.attention(1), dense_attention(trace.queries[1], trace.keys[1], trace.scaling,
                                                                   sliding_window=9, softcap=4.0).float(), atol=1e-6,
                               rtol=0)


def test_format_1_traces_read_as_full_causal_attention(saved, tmp_path):
    trace, path = saved
    old = _rewrite(path, tmp_path / "v1.safetensors",
                   {"format": "snapkv_lab.AttentionTrace/1", "scaling": trace.scaling, "attention_settings": None})
    loaded = AttentionTrace.load(old)
    assert loaded.attention_settings == [AttentionSettings(trace.scaling)] * 2
    torch.testing.assert_close(loaded.attention(0), trace.attention(0), atol=0, rtol=0)


def test_corrupt_and_inconsistent_files_are_refused(saved, tmp_path):
    trace, path = saved
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
    with pytest.raises(ValueError, match="not a readable snapkv_lab trace"):
        AttentionTrace.load(truncated)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="not a readable snapkv_lab trace"):
        AttentionTrace.load(garbage)
    other = tmp_path / "other.safetensors"
    save_file({"x": torch.zeros(1)}, str(other))
    with pytest.raises(ValueError, match="not a snapkv_lab trace"):
        AttentionTrace.load(other)
    with pytest.raises(ValueError, match="missing layers.1.keys"):
        AttentionTrace.load(_rewrite(path, tmp_path / "no-keys.safetensors", drop="layers.1.keys"))
    # A prompt longer than the tokens would make n_generated negative.
    with pytest.raises(ValueError, match="prompt_len 500 outside"):
        AttentionTrace.load(_rewrite(path, tmp_path / "long-prompt.safetensors", {"prompt_len": 500}))
    with pytest.raises(ValueError, match="decoded tokens for"):
        AttentionTrace.load(_rewrite(path, tmp_path / "tokens.safetensors", {"tokens": trace.tokens[:-1]}))
    with pytest.raises(FileNotFoundError):
        AttentionTrace.load(tmp_path / "absent.safetensors")
