"""Blockwise (kvpress's BlockPress) against its loop written plainly from kvpress 0.5.5's presses/block_press.py
(:67-94) with KeyDiff inside (keydiff_press.py:45-46), on the post-RoPE keys of transformers' own cache; two budgets
of it served by one shared prefill each keep their own block-wise set (the scores depend on the budget)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import make_tiny_llama

import snapkv_lab
from snapkv_lab.compression.shared import SharedPrefill

N, BLOCK = 160, 32


def block_reference(keys, n_kept, block):
    """keys (kv_heads, n, d) -> (kv_heads, n_kept) sorted: the first n_kept positions held, then for each block from
    n_kept on, the held positions and the block scored together by KeyDiff (-cos to the mean unit key of those keys)
    and the top n_kept of them held."""
    rows = []
    for head in keys:
        held = torch.arange(n_kept)
        for start in range(n_kept, head.shape[0], block):
            candidates = torch.cat([held, torch.arange(start, min(start + block, head.shape[0]))])
            k = head[candidates].float()
            anchor = F.normalize(k, dim=-1).mean(0, keepdim=True)
            held = candidates[(-F.cosine_similarity(k, anchor, dim=-1)).topk(n_kept).indices]
        rows.append(held.sort().values)
    return torch.stack(rows)


@torch.no_grad()
def test_blockwise_keeps_kvpress_block_loop_at_each_budget(byte_tokenizer):
    model = make_tiny_llama(initializer_range=0.3)
    ids = torch.randint(2, 256, (1, N), generator=torch.Generator().manual_seed(0))
    keys = [layer.keys[0] for layer in model(ids, use_cache=True).past_key_values.layers]
    policies = [snapkv_lab.Blockwise(block_size=BLOCK, capacity=c) for c in (40, 64)]
    assert policies[0].score_table != policies[1].score_table  # one score table per budget
    alone = snapkv_lab.KeyDiff(capacity=40)  # the block loop is not one selection over the prompt
    shared = SharedPrefill.run(model, byte_tokenizer, ids, [*policies, alone])
    for policy in policies:
        state = shared.state(policy)
        for layer, layer_keys in enumerate(keys):
            assert torch.equal(state.kept_indices[layer][0], block_reference(layer_keys, policy.capacity, BLOCK))
    assert not all(torch.equal(shared.state(alone).kept_indices[layer], shared.state(policies[0]).kept_indices[layer])
                   for layer in range(len(keys)))
    with pytest.raises(TypeError, match="budgets of its own"):
        snapkv_lab.Blockwise(policy=snapkv_lab.AdaKV())
