"""The fast path (`generate` over gathered or ragged caches) against the plain definition of decoding over a
compressed cache (`compression.reference.masked_decode`: the full cache, each head's evicted prompt positions hidden,
eager attention), for every registered policy whose kept set is fixed after prefill."""

from __future__ import annotations

import pytest
import torch
from conftest import build_with_tail, make_tiny_llama

import snapkv_lab
from snapkv_lab.compression.reference import masked_decode
from snapkv_lab.policies.decoding import EvictsWhileDecoding

N, NEW = 160, 8
# ThinK and KIVI change what a kept position holds (key channels, bits), which a masked decode cannot express: their
# storage (channels kept, quantizer, layout, bytes) is checked against its definitions in tests/test_storage.py.
FIXED = sorted(name for name, cls in snapkv_lab.POLICIES.items()
               if not issubclass(cls, EvictsWhileDecoding) and name not in ("ThinK", "KIVI"))


@pytest.fixture(scope="module")
def model():
    return make_tiny_llama(initializer_range=0.3, num_hidden_layers=3)


def prompt(seed=0):
    return torch.randint(2, 256, (1, N), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", FIXED)
def test_every_fixed_policy_decodes_as_its_definition(name, model, byte_tokenizer):
    policy = build_with_tail(name, 8, capacity=40)
    ids = prompt(seed=3)
    fast = snapkv_lab.generate(model, byte_tokenizer, ids, policy=policy, max_new_tokens=NEW)
    plain = masked_decode(model, ids, fast, NEW)  # never stops early: compare up to the fast run's end of answer
    assert torch.equal(fast.token_ids, plain[:, :fast.token_ids.shape[1]]), policy.label


@pytest.mark.parametrize("layout", ["per KV head", "per query head", "ragged (AdaKV)"])
def test_layouts_decode_as_their_definition(layout, model, byte_tokenizer):
    policy = {"per KV head": snapkv_lab.SnapKV(capacity=40, window_size=8),
              "per query head": snapkv_lab.SnapKV(capacity=40, window_size=8, per_query_head=True),
              "ragged (AdaKV)": snapkv_lab.AdaKV(policy=snapkv_lab.SnapKV(window_size=8), capacity=40)}[layout]
    for seed in range(3):
        ids = prompt(seed)
        fast = snapkv_lab.generate(model, byte_tokenizer, ids, policy=policy, max_new_tokens=NEW)
        assert torch.equal(fast.token_ids, masked_decode(model, ids, fast, NEW)), (layout, seed)


def test_the_definition_is_not_the_full_cache_and_refuses_what_it_cannot_describe(model, byte_tokenizer):
    ids = prompt(seed=1)
    full = snapkv_lab.generate(model, byte_tokenizer, ids, max_new_tokens=NEW)
    few = snapkv_lab.generate(model, byte_tokenizer, ids, policy=snapkv_lab.StreamingLLM(capacity=12, kept_tail=8),
                              max_new_tokens=NEW)
    assert torch.equal(masked_decode(model, ids, full, NEW), full.token_ids)
    assert not torch.equal(masked_decode(model, ids, few, NEW), full.token_ids)  # hiding positions changes answers
    h2o = snapkv_lab.generate(model, byte_tokenizer, ids, policy=snapkv_lab.H2O(capacity=40), max_new_tokens=NEW)
    with pytest.raises(ValueError, match="while decoding"):
        masked_decode(model, ids, h2o, NEW)
