"""KeyRerotation (kvpress's KeyRerotationPress): the kept keys re-rotated to contiguous positions, against the RoPE
equations as kvpress writes them (kvpress 0.5.5, presses/key_rerotation_press.py:81-86 and :128), on the tiny random
Llama: the stored keys, and decoding over them as kvpress's pipeline decodes (kept key i at position i, the next
tokens from position k on: pipeline.py:237-238, :289-312), which ours does from the prompt's length n with kept key i at
n - k + i, the same distances."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_llama
from transformers import DynamicCache

import snapkv_lab

N, CAPACITY, NEW = 96, 40, 8


@pytest.fixture(scope="module")
def model():
    return make_tiny_llama(initializer_range=0.3)


def prompt(seed=0):
    return torch.randint(2, 256, (1, N), generator=torch.Generator().manual_seed(seed))


def rotate_half(x):
    """Llama's quarter turn of each pair (i, i + d/2): (-x2, x1)."""
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def rerotated(keys, old, new, theta):
    """kvpress's rerotate_keys: keys (kv_heads, k, d) post-RoPE at positions old (kv_heads, k), rotated by new - old
    with inv_freq = theta^(-2i/d) (Llama's default RoPE): k cos(delta f) + rotate_half(k) sin(delta f)."""
    d = keys.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = (new - old).float()[..., None] * inv_freq  # (kv_heads, k, d/2)
    emb = torch.cat([angles, angles], dim=-1)
    return keys * emb.cos() + rotate_half(keys) * emb.sin()


def knorm_kept(keys, k):
    """KNorm's kept set, from its definition: per KV head the k keys of lowest L2 norm, sorted (no kept tail)."""
    return (-keys.norm(dim=-1)).topk(k, dim=-1).indices.sort(dim=-1).values


def decode(model, cache, first_logits, start, steps):
    """(steps + 1, vocab): the first logits, then greedy steps fed at positions start, start + 1, ..."""
    logits, token = [first_logits], first_logits.argmax()
    for step in range(steps):
        out = model(token.view(1, 1), past_key_values=cache, position_ids=torch.tensor([[start + step]]),
                    use_cache=True)
        logits.append(out.logits[0, -1])
        token = out.logits[0, -1].argmax()
    return torch.stack(logits)


def reference_cache(full, kept, positions, theta):
    """A DynamicCache of each layer's kept keys re-rotated to `positions(k)` (k,) and their values."""
    cache = DynamicCache()
    for layer, (keys, values) in enumerate(full):
        held = kept[layer]
        gathered = keys[0].gather(1, held[..., None].expand(-1, -1, keys.shape[-1]))
        new = positions(held.shape[-1]).expand_as(held)
        cache.update(rerotated(gathered, held, new, theta)[None],
                     values[0].gather(1, held[..., None].expand(-1, -1, values.shape[-1]))[None], layer)
    return cache


@torch.no_grad()
def test_kept_keys_are_rerotated_and_decode_as_kvpress(model):
    ids, theta = prompt(), model.config.rope_parameters["rope_theta"]
    out = model(ids, use_cache=True)
    full = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
    kept = [knorm_kept(keys[0], CAPACITY) for keys, _ in full]
    policy = snapkv_lab.KeyRerotation(policy=snapkv_lab.KNorm(), capacity=CAPACITY)
    with snapkv_lab.compress(model, policy) as state:
        ours_out = model(ids, past_key_values=state.cache, use_cache=True)
        for layer, (keys, _) in enumerate(full):
            assert torch.equal(state.kept_indices[layer][0], kept[layer])
            want = rerotated(keys[0].gather(1, kept[layer][..., None].expand(-1, -1, keys.shape[-1])), kept[layer],
                             torch.arange(N - CAPACITY, N).expand_as(kept[layer]), theta)
            assert torch.allclose(state.cache.layers[layer].keys[0], want, atol=1e-5)
        ours = decode(model, state.cache, ours_out.logits[0, -1], N, NEW)
    # kvpress's way: kept key i at position i, decoding from position k = CAPACITY
    kvpress = decode(model, reference_cache(full, kept, lambda k: torch.arange(k), theta), out.logits[0, -1],
                     CAPACITY, NEW)
    assert torch.allclose(ours, kvpress, atol=1e-4)
    # the comparison can fail: the same kept keys left where RoPE put them answer otherwise
    with snapkv_lab.compress(model, snapkv_lab.KNorm(capacity=CAPACITY)) as state:
        plain = decode(model, state.cache, model(ids, past_key_values=state.cache).logits[0, -1], N, NEW)
    assert (plain - kvpress).abs().max() > 1e-2


def test_key_rerotation_keeps_what_its_policy_keeps_and_refuses_what_it_cannot_rotate(model, byte_tokenizer):
    ids = prompt(1)
    inner = snapkv_lab.SnapKV(window_size=8, capacity=CAPACITY)
    ours = snapkv_lab.generate(model, byte_tokenizer, ids,
                               policy=snapkv_lab.KeyRerotation(policy=inner, capacity=CAPACITY), max_new_tokens=2)
    alone = snapkv_lab.generate(model, byte_tokenizer, ids, policy=inner, max_new_tokens=2)
    for a, b in zip(ours.kept_indices, alone.kept_indices, strict=True):
        assert torch.equal(a, b)
    assert ours.policy.label == "KeyRerotation(policy=SnapKV(window_size=8))@40"
    with pytest.raises(ValueError, match="per_query_head"):
        snapkv_lab.KeyRerotation(per_query_head=True)
    with pytest.raises(ValueError, match="evicts while decoding"):
        snapkv_lab.KeyRerotation(policy=snapkv_lab.H2O())
