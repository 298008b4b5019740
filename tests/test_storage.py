"""Key channels (ThinK) and bits (KIVI): the channels and codes against the papers' official code, written here from
it, and the bytes a cache reports against the bytes of the tensors it holds.

Oracles: ThinK's channel criterion from SalesforceAIResearch/ThinK e3654136, ThinK_flash/src/kv_pruning_utils.py:11-22
(queries_norm = q[..., -32:, :]^2 mean over tokens; keys_norm = k^2 mean over tokens; the int(d * ratio) lowest of
their product pruned); KIVI's quantizer from jy-yuan/KIVI quant/new_pack.py:8-45 (`quant_and_pack_kcache`: per channel,
groups of group_size tokens; `quant_and_pack_vcache`: per token, groups of channels; scale = (max - min) / (2^b - 1),
code = round(clamp((x - min) / scale))), its layout from models/llama_kivi.py:170-195 (keys: all but n mod R
quantized; values: all but the last R)."""

from __future__ import annotations

import pytest
import torch

from snapkv_lab import KIVI, AdaKV, ChunkKV, SnapKV, ThinK, compress, generate
from snapkv_lab.compression.layers import CompressedLayer, HeadwiseLayer, cache_bytes
from snapkv_lab.compression.packed import PackedHeadwiseLayer, PackedLayer, pack, quantize, unpack
from snapkv_lab.compression.shared import SharedPrefill
from snapkv_lab.core.hooks import intercept_attention
from snapkv_lab.policies.storage import Storage
from tests.conftest import ByteTokenizer, make_tiny_llama

N = 300  # prompt tokens
F32 = 4


def _prompt(n=N, seed=1):
    return torch.randint(2, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def _kivi_oracle(x: torch.Tensor, bits: int, group: int, per_channel: bool) -> torch.Tensor:
    """KIVI's quant_and_pack_kcache / _vcache then the unpack-dequantize, without packing: x (b, h, t, d)."""
    top = 2 ** bits - 1
    if per_channel:  # (b, h, t/g, g, d): min and max over each group's tokens
        data = x.reshape(*x.shape[:2], -1, group, x.shape[-1])
        mn, mx = data.min(dim=-2, keepdim=True)[0], data.max(dim=-2, keepdim=True)[0]
    else:  # (b, h, t, d/g, g): over each group's channels
        data = x.reshape(*x.shape[:-1], -1, group)
        mn, mx = data.min(dim=-1, keepdim=True)[0], data.max(dim=-1, keepdim=True)[0]
    scale = (mx - mn) / top
    codes = ((data - mn) / scale).clamp(0, top).round()
    return (codes * scale + mn).reshape(x.shape)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("per_channel", [True, False])
def test_quantizer_matches_kivi(bits, per_channel):
    x = torch.randn(1, 2, 64, 32, generator=torch.Generator().manual_seed(bits))
    block = quantize(x, bits, 32, -2 if per_channel else -1)
    from snapkv_lab.compression.packed import dequantize
    torch.testing.assert_close(dequantize(block), _kivi_oracle(x, bits, 32, per_channel), rtol=0, atol=1e-5)
    assert block.codes.dtype == torch.uint8 and block.codes.numel() == x.numel() * bits // 8


def test_pack_round_trip_and_constant_group():
    codes = torch.randint(0, 4, (1, 2, 8, 4), dtype=torch.uint8)
    for axis in (-1, -2):
        assert torch.equal(unpack(pack(codes, 2, axis), 2, axis), codes)
    flat = torch.full((1, 1, 32, 4), 0.5)  # every group constant: the official code divides by zero here
    from snapkv_lab.compression.packed import dequantize
    assert torch.equal(dequantize(quantize(flat, 2, 32, -2)), flat)


def _captured(model, ids):
    """{layer: (post-RoPE queries (heads, n, d), keys (kv_heads, n, d))} of a full prefill."""
    seen = {}

    def record(module, query, key, value, attention_mask, **kwargs):
        seen[module.layer_idx] = (query[0], key[0])

    with torch.inference_mode(), intercept_attention(model, record):
        model(ids)
    return seen


def _think_oracle(query, keys, ratio, groups):
    """ThinK's kept channels per KV head: the official criterion, the query term averaged over each KV head's query
    heads (kvpress think_press.py:81-82)."""
    queries_norm = query[:, -32:, :].pow(2).mean(dim=1)  # (heads, d)
    queries_norm = queries_norm.view(keys.shape[0], groups, -1).mean(1)
    key = queries_norm * keys.pow(2).mean(dim=1)
    pruned = key.topk(int(keys.shape[-1] * ratio), dim=-1, largest=False).indices
    return [sorted(set(range(keys.shape[-1])) - set(row.tolist())) for row in pruned]


@pytest.mark.parametrize("ratio", [0.25, 0.5])
def test_think_keeps_the_official_channels_and_stores_only_them(ratio):
    model, ids = make_tiny_llama(), _prompt()
    reference = _captured(model, ids)
    with torch.inference_mode(), compress(model, ThinK(key_channel_ratio=ratio)) as state:
        model(ids, past_key_values=state.cache)
    d = model.config.head_dim
    for layer, (query, keys) in reference.items():
        held = state.cache.layers[layer]
        assert isinstance(held, PackedLayer)
        block = held.key_blocks[0]
        assert block.channels.tolist()[0] == _think_oracle(query, keys, ratio, 2)
        assert block.dense.shape == (1, 2, N - 32, d - int(d * ratio))  # pruned channels not stored
        assert held.key_tail.shape == (1, 2, 32, d)  # the official recent_size keeps every channel


def test_think_attends_as_zeroed_channels():
    """A pruned cache computes what kvpress's zeroed keys compute (think_press.py:90-92): same logits next step."""
    model, ids = make_tiny_llama(), _prompt()
    policy = ThinK(key_channel_ratio=0.5, recent_size=0)
    with torch.inference_mode(), compress(model, policy) as state:
        model(ids, past_key_values=state.cache)
        channels = [layer.key_blocks[0].channels for layer in state.cache.layers]
        nxt = torch.tensor([[5]])
        ours = model(nxt, past_key_values=state.cache, position_ids=torch.tensor([[N]])).logits
        full = model(ids, use_cache=True).past_key_values
        for layer, kept in zip(full.layers, channels, strict=True):
            mask = torch.zeros_like(layer.keys[:, :, 0]).scatter_(-1, kept, 1.0)  # (b, h, d)
            layer.keys = layer.keys * mask[:, :, None]
        theirs = model(nxt, past_key_values=full, position_ids=torch.tensor([[N]])).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def _held_bytes(cache) -> int:
    """The bytes of the storages a cache's layers really hold: every KV tensor's whole storage, each once (a view of
    a bigger tensor counts that tensor)."""
    storages = {}
    def held(layer):
        if isinstance(layer, PackedHeadwiseLayer):
            return [t for head in (*(h for row in layer.heads for h in row), layer.appended) for t in held(head)]
        if isinstance(layer, PackedLayer):
            return [t for b in (*layer.key_blocks, *layer.value_blocks) for t in b.tensors] + [layer.key_tail,
                                                                                              layer.value_tail]
        return [layer.keys, layer.values]

    for layer in cache.layers:
        for t in held(layer):
            if t.numel():
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def _expected_bytes(n, d, *, ratio=0.0, recent=32, key_bits=None, value_bits=None, group=32, residual=128,
                    layers=2, heads=2):
    """positions x channels x bits, plus scales, zero points and channel indices, from the layout the papers'
    code stores (see the module doc), for one prompt of n kept positions."""
    kept = d - int(d * ratio)
    pruned = n - min(n, recent) if ratio else n
    quantized = pruned - pruned % residual if key_bits else 0
    stored = pruned if ratio else quantized
    keys = (stored - quantized) * kept * F32 + (n - stored) * d * F32
    if quantized:
        keys += quantized * kept * key_bits // 8 + 2 * (quantized // group) * kept * F32
    if ratio:
        keys += kept * 8  # the kept channels' indices (int64), once per head
    coded = max(0, n - residual) if value_bits else 0
    values = (n - coded) * d * F32
    if coded:
        values += coded * d * value_bits // 8 + 2 * coded * (d // min(group, d)) * F32
    return layers * heads * (keys + values)


CASES = {
    "eviction": (SnapKV(capacity=100), dict(n=100)),
    "ThinK": (ThinK(key_channel_ratio=0.5), dict(n=N, ratio=0.5)),
    "KIVI-2": (KIVI(), dict(n=N, key_bits=2, value_bits=2)),
    "KIVI-4": (KIVI(key_bits=4, value_bits=4), dict(n=N, key_bits=4, value_bits=4)),
    "SnapKV+ThinK+4-bit values": (KIVI(policy=ThinK(key_channel_ratio=0.5), capacity=200, key_bits=None,
                                       value_bits=4, residual_length=32),
                                  dict(n=200, ratio=0.5, value_bits=4, residual=32)),
    "SnapKV+ThinK+KIVI-2": (KIVI(policy=ThinK(key_channel_ratio=0.25), capacity=250, residual_length=64),
                            dict(n=250, ratio=0.25, key_bits=2, value_bits=2, residual=64)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_reported_bytes_are_held_bytes(case):
    """Bytes are bytes: what a row reports (cache_bytes) is what the cache's tensors hold, and what the layout
    predicts, for eviction alone, ThinK alone, quantization alone and compositions; live and shared prefills agree."""
    policy, layout = CASES[case]
    model, ids = make_tiny_llama(), _prompt()
    with torch.inference_mode(), compress(model, policy) as state:
        model(ids, past_key_values=state.cache)
    expected = _expected_bytes(d=model.config.head_dim, **layout)
    assert cache_bytes(state.cache) == _held_bytes(state.cache) == expected
    shared = SharedPrefill.run(model, None, ids, [policy]).state(policy)
    assert cache_bytes(shared.cache) == _held_bytes(shared.cache) == expected


def test_one_kv_head_holds_only_its_reported_bytes():
    """A one-KV-head model (Gemma 3 270M's layout): a slice of its tokens is contiguous already, so a tail taken as a
    view would keep the whole prompt's keys alive; the stored tails are copies, and the bytes held are those reported
    and those the layout predicts, prompt and decoding alike."""
    model, ids = make_tiny_llama(num_key_value_heads=1), _prompt()
    policy = KIVI(policy=ThinK(key_channel_ratio=0.5), capacity=200, residual_length=32)
    with torch.inference_mode(), compress(model, policy) as state:
        model(ids, past_key_values=state.cache)
        assert cache_bytes(state.cache) == _held_bytes(state.cache) == _expected_bytes(
            200, 16, ratio=0.5, key_bits=2, value_bits=2, residual=32, heads=1)
        model.generate(ids, past_key_values=state.cache, max_new_tokens=20, do_sample=False, min_new_tokens=20)
    assert cache_bytes(state.cache) == _held_bytes(state.cache)


def test_kivi_quantizes_while_decoding_as_the_official_code():
    """After prefill of n, KIVI's key residual is n mod R and grows until it holds R, then is quantized whole; the
    value residual stays at R, its oldest token quantized each step (llama_kivi.py:140-168)."""
    model, ids = make_tiny_llama(), _prompt(100)
    with torch.inference_mode(), compress(model, KIVI(residual_length=32)) as state:
        model.generate(ids, past_key_values=state.cache, max_new_tokens=30, do_sample=False, min_new_tokens=30)
    layer = state.cache.layers[0]
    seen = layer.seen  # 100 + 29 fed tokens
    assert layer.key_tail.shape[-2] == seen % 32
    assert sum(b.slots for b in layer.key_blocks) == seen - seen % 32
    assert layer.value_tail.shape[-2] == 32 and sum(b.slots for b in layer.value_blocks) == seen - 32
    assert cache_bytes(state.cache) == _held_bytes(state.cache)


def test_storage_refusals():
    with pytest.raises(ValueError, match="key_channel_ratio"):
        ThinK(key_channel_ratio=1.0)
    with pytest.raises(ValueError, match="key_bits"):
        KIVI(key_bits=3)
    with pytest.raises(ValueError, match="multiple of group_size"):
        KIVI(residual_length=48)
    with pytest.raises(ValueError, match="quantizes already"):
        KIVI(policy=KIVI())


def test_storage_keeps_what_the_inner_policy_keeps():
    """KIVI and ThinK keep the inner policy's positions by its own rule: ChunkKV's whole chunks, where they once
    ranked ChunkKV's scores position by position (Policy.keep) under ChunkKV's label."""
    model, ids = make_tiny_llama(), _prompt()

    def kept(policy):
        run = generate(model, ByteTokenizer(), ids, policy=policy, max_new_tokens=1)
        return [k.tolist() for k in run.kept_indices]

    chunks = kept(ChunkKV(capacity=120))
    for wrapper in (KIVI(policy=ChunkKV(), capacity=120), ThinK(policy=ChunkKV(), capacity=120)):
        assert kept(wrapper) == chunks, wrapper.label


RAGGED = dict(ThinK=ThinK(policy=AdaKV(), capacity=0.25, key_channel_ratio=0.5),
              KIVI=KIVI(policy=AdaKV(), capacity=0.25, residual_length=32, group_size=8),
              both=KIVI(policy=ThinK(policy=AdaKV(), key_channel_ratio=0.25), capacity=0.25, key_bits=4, value_bits=4,
                        residual_length=32, group_size=8))


@pytest.mark.parametrize("case", list(RAGGED))
def test_head_wise_budgets_store_each_head_packed(case):
    """Over AdaKV's ragged heads, ThinK and KIVI store each KV head's kept positions by the papers' layout on its own:
    the positions AdaKV keeps, and bytes that are held bytes and equal the layout's, head by head (_expected_bytes,
    one head of t_h positions); live and shared prefills agree; decoding appends and quantizes as KIVI does."""
    policy = RAGGED[case]
    storage = policy.storage
    model, ids = make_tiny_llama(), _prompt()
    with torch.inference_mode(), compress(model, policy) as state:
        model(ids, past_key_values=state.cache)
    with torch.inference_mode(), compress(model, AdaKV(capacity=0.25)) as plain:
        model(ids, past_key_values=plain.cache)
    assert all(isinstance(layer, PackedHeadwiseLayer) for layer in state.cache.layers)
    for ours, theirs in zip(state.cache.layers, plain.cache.layers, strict=True):
        assert torch.equal(ours.kept, theirs.kept)
        counts = (ours.kept >= 0).sum(-1)[0].tolist()
        assert len(set(counts)) > 1  # ragged: the case this layer exists for
        expected = sum(_expected_bytes(t, model.config.head_dim, ratio=storage.key_channel_ratio,
                                       recent=storage.full_channel_recent, key_bits=storage.key_bits,
                                       value_bits=storage.value_bits, group=storage.group_size,
                                       residual=storage.residual_length, layers=1, heads=1) for t in counts)
        assert ours.nbytes() == expected < theirs.nbytes()
    assert cache_bytes(state.cache) == _held_bytes(state.cache)
    shared = SharedPrefill.run(model, None, ids, [policy]).state(policy)
    assert cache_bytes(shared.cache) == cache_bytes(state.cache)
    with torch.inference_mode(), compress(model, policy) as state:
        model.generate(ids, past_key_values=state.cache, max_new_tokens=40, do_sample=False, min_new_tokens=40)
    layer = state.cache.layers[0]
    appended, fed = layer.appended, layer.seen - N  # 39 fed: the last new token never is
    assert appended.keys.shape[-2] == fed == 39 and layer.positions.shape[-1] == layer.kept.shape[-1] + fed
    if storage.key_bits is not None:  # whole groups of residual_length quantized, the rest in full precision
        assert appended.key_tail.shape[-2] == fed % 32 and sum(b.slots for b in appended.key_blocks) == fed - fed % 32
    assert cache_bytes(state.cache) == _held_bytes(state.cache)


def test_equal_heads_store_as_a_dense_packed_layer():
    """Where every head keeps as many positions, the per-head layout stores each head exactly as a PackedLayer stores
    that head of the dense layer (codes, scales, kept channels, tails; the same bytes)."""
    generator = torch.Generator().manual_seed(0)
    keys, values = (torch.randn(1, 2, 200, 16, generator=generator) for _ in range(2))
    kept = torch.stack([torch.randperm(200, generator=generator)[:70].sort().values for _ in range(2)])[None]
    query = torch.randn(1, 4, 32, 16, generator=generator)
    storage = Storage(key_channel_ratio=0.25, key_bits=2, value_bits=4, group_size=8, residual_length=16)
    dense = CompressedLayer(keys.gather(2, kept[..., None].expand(-1, -1, -1, 16)),
                            values.gather(2, kept[..., None].expand(-1, -1, -1, 16)), kept, 200)
    packed = PackedLayer(dense, storage, storage.kept_channels(query[0], dense.keys[0])[None])
    ragged = HeadwiseLayer(keys, values, kept)
    channels = [[storage.kept_channels(query[0, 2 * h:2 * h + 2], head[None])[None] for h, head in
                 enumerate(ragged.prompt_keys[0])]]
    stored = PackedHeadwiseLayer(ragged, storage, channels)
    for h in range(2):
        torch.testing.assert_close(stored.prompt_keys[0][h], packed.keys[0, h], rtol=0, atol=0)
        torch.testing.assert_close(stored.prompt_values[0][h], packed.values[0, h], rtol=0, atol=0)
    assert stored.nbytes() == packed.nbytes()
    assert not torch.equal(stored.prompt_keys[0][0], ragged.prompt_keys[0][0])  # quantized: not the dense keys


def test_kivi_over_ragged_heads_attends_to_each_heads_quantized_prompt():
    """The next token's logits over KIVI(AdaKV) equal those over AdaKV's own cache whose kept keys and values are
    replaced, head by head, by KIVI's quantize-dequantize of the part KIVI quantizes (_kivi_oracle, from the official
    code: a head's keys but t mod R per channel in groups of G tokens, its values but the last R per token)."""
    model, ids = make_tiny_llama(), _prompt()
    residual, group = 32, 8
    policy = KIVI(policy=AdaKV(), capacity=0.25, key_bits=2, value_bits=2, residual_length=residual, group_size=group)
    token, position = torch.tensor([[7]]), torch.tensor([[N]])
    with torch.inference_mode(), compress(model, policy) as state:
        model(ids, past_key_values=state.cache)
        ours = model(token, past_key_values=state.cache, position_ids=position).logits
    with torch.inference_mode(), compress(model, AdaKV(capacity=0.25)) as plain:
        model(ids, past_key_values=plain.cache)
        quantized = 0
        for layer in plain.cache.layers:
            for keys, values in zip(layer.prompt_keys[0], layer.prompt_values[0], strict=True):  # views: in place
                t = keys.shape[0]
                whole, coded = t - t % residual, t - min(t, residual)
                if whole:
                    keys[:whole] = _kivi_oracle(keys[None, None, :whole], 2, group, per_channel=True)[0, 0]
                if coded:
                    values[:coded] = _kivi_oracle(values[None, None, :coded], 2, group, per_channel=False)[0, 0]
                quantized += whole + coded
        assert quantized > 0
        theirs = model(token, past_key_values=plain.cache, position_ids=position).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
