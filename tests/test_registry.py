"""Every policy in snapkv_lab.POLICIES, the moment it is registered: built from `capacity=` alone, it runs,
shrinks the cache to its budget, is the plain model when the budget covers the prompt, and the three ways
of running it (generate, model.generate under compress, compare from one shared prefill) agree."""

from __future__ import annotations

import pytest
import torch

import snapkv_lab
from conftest import make_tiny_llama
from snapkv_lab.policies import NO_POSITION

N, NEW = 160, 6  # a 25% budget (40) exceeds the default window (32)
NAMES = sorted(snapkv_lab.POLICIES)


def tiny():
    return make_tiny_llama(initializer_range=0.3, num_hidden_layers=3)


def prompt(batch=1, seed=0, n=N):
    return torch.randint(2, 256, (batch, n), generator=torch.Generator().manual_seed(seed))


def build(name, **settings):
    cls = snapkv_lab.POLICIES[name]
    return cls(**settings) if name != "FullCache" else cls()


@pytest.fixture(scope="module")
def model():
    return tiny()


@pytest.mark.parametrize("name", NAMES)
def test_built_from_capacity_alone_keeps_its_budget(name, model, byte_tokenizer):
    policy = build(name, capacity=0.25)
    full = snapkv_lab.generate(model, byte_tokenizer, prompt(), max_new_tokens=NEW)
    run = snapkv_lab.generate(model, byte_tokenizer, prompt(), policy=policy, max_new_tokens=NEW)
    if name == "FullCache":
        assert run.cache_lengths == [N] * 3 and run.kv_bytes == full.kv_bytes
        return
    assert sum(run.cache_lengths) == pytest.approx(3 * N // 4, abs=3)  # per-layer/head budgets average out
    assert run.kv_bytes / full.kv_bytes == pytest.approx(0.25, abs=0.02)
    for kept in run.kept_indices:
        for row in kept.reshape(-1, kept.shape[-1]):
            row = row[row != NO_POSITION]
            assert torch.equal(row, row.unique()) and 0 <= int(row.min()) and int(row.max()) < N + NEW


@pytest.mark.parametrize("name", NAMES)
def test_budget_covering_the_prompt_is_the_plain_model(name, model, byte_tokenizer):
    ids = prompt(seed=1, n=60)
    plain = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False, eos_token_id=None)
    run = snapkv_lab.generate(model, byte_tokenizer, ids, policy=build(name, capacity=60 + NEW), max_new_tokens=NEW)
    assert torch.equal(run.token_ids, plain[:, 60:])


@pytest.mark.parametrize("name", NAMES)
def test_generate_compress_and_compare_agree(name, model, byte_tokenizer):
    """Live compression at each layer's prefill call, model.generate under it, and compare's compressed copies
    of one full prefill: the same kept positions and tokens (KVzip and Surprisal, which score after the prefill, are refused
    inside model.generate)."""
    policy = build(name, capacity=40, window_size=8)
    ids = prompt(batch=2, seed=2)
    ours = snapkv_lab.generate(model, byte_tokenizer, ids, policy=policy, max_new_tokens=NEW)
    if policy.scores_after_prefill:
        with pytest.raises(NotImplementedError, match="scores after the prefill"):
            with snapkv_lab.compress(model, policy):
                pass
    else:
        with snapkv_lab.compress(model, policy) as state:
            theirs = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=state.cache,
                                    max_new_tokens=NEW, do_sample=False, eos_token_id=None)
        assert torch.equal(theirs[:, N:], ours.token_ids)
    table = snapkv_lab.compare(model, byte_tokenizer, [ids[:1]], policies=[policy], max_new_tokens=NEW, progress=False)
    single = snapkv_lab.generate(model, byte_tokenizer, ids[:1], policy=policy, max_new_tokens=NEW)
    assert table.answer.item() == single.text
    run = table.results[0]
    assert all(torch.equal(a, b) for a, b in zip(run.kept_indices, single.kept_indices, strict=True))


def test_registry_names_are_class_names_and_exported():
    for name, cls in snapkv_lab.POLICIES.items():
        assert cls.__name__ == name and getattr(snapkv_lab, name) is cls


@pytest.mark.parametrize("name", NAMES)
def test_a_policy_config_survives_json_and_builds_the_same_policy(name):
    import json

    from snapkv_lab.policies import policy_config, policy_from_config

    policy = build(name, capacity=256)
    config = json.loads(json.dumps(policy_config(policy)))
    assert config["name"] == name and policy_from_config(config) == policy
    assert policy_from_config({"name": name}) == snapkv_lab.POLICIES[name]()


def test_a_policy_config_keeps_a_wrapped_policys_settings_and_refuses_unknown_names():
    from snapkv_lab.policies import policy_config, policy_from_config

    wrapped = snapkv_lab.AdaKV(capacity=512, policy=snapkv_lab.SnapKV(kernel_size=15, gqa="max"))
    config = policy_config(wrapped)
    assert config["policy"]["kernel_size"] == 15 and config["policy"]["gqa"] == "max"
    assert policy_from_config(config) == wrapped
    with pytest.raises(ValueError, match="unknown policy 'Snapkv'.*SnapKV, SnapKVNoPooling"):
        policy_from_config({"name": "Snapkv"})


def test_a_field_added_later_is_left_out_at_its_default_so_stored_cells_keep_their_keys():
    from snapkv_lab.policies import policy_config, policy_from_config
    from snapkv_lab.sweep import Cell

    default, variant = snapkv_lab.KVzip(capacity=256), snapkv_lab.KVzip(capacity=256, repeat_prompts="kvpress")
    assert "repeat_prompts" not in policy_config(default) and policy_config(variant)["repeat_prompts"] == "kvpress"
    assert policy_from_config(policy_config(default)) == default and policy_from_config(policy_config(variant)) == variant
    # a key written before the field existed (the config of commit bd58935) is the key of today's default
    before = {"name": "KVzip", "capacity": 256, "window_size": 0, "per_query_head": False, "pooling": None,
              "kernel_size": 1, "gqa": "mean", "chunk_size": 2000, "sinks": None, "allocation": "global"}
    assert Cell("eval", {"policies": [policy_config(default)]}).key == Cell("eval", {"policies": [before]}).key
    assert Cell("eval", {"policies": [policy_config(variant)]}).key != Cell("eval", {"policies": [before]}).key


WRAPPERS = ("AdaKV", "ChunkKV", "CriticalKV")
INNER = [name for name in NAMES if name not in ("FullCache", "DecodingEviction")]


@pytest.mark.parametrize("inner", INNER)
@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_wrappers_compose_with_every_registered_policy(wrapper, inner, model, byte_tokenizer):
    """AdaKV, ChunkKV and CriticalKV wrap any registered scorer, those that score after the prefill (KVzip, Surprisal)
    and wrappers (CriticalKV(AdaKV(...)), kvpress's CriticalAdaKV) included: the composition runs, holds its budget
    and gives the same kept positions live, from one shared prefill (compare) and under generate."""
    if wrapper == inner == "CriticalKV":
        with pytest.raises(TypeError, match="cannot wrap another CriticalKV"):
            snapkv_lab.CriticalKV(policy=snapkv_lab.CriticalKV())
        return
    policy = snapkv_lab.POLICIES[wrapper](policy=build(inner), capacity=0.25)
    assert policy.label.startswith(f"{wrapper}(policy={inner}") or (inner == "SnapKV" and policy.label == f"{wrapper}@0.25")
    ids = prompt(seed=3)
    run = snapkv_lab.generate(model, byte_tokenizer, ids, policy=policy, max_new_tokens=NEW)
    full_bytes = 3 * 2 * 2 * N * 16 * 4  # layers x (K, V) x KV heads x tokens x head_dim x fp32
    whole_chunks = wrapper == "ChunkKV"  # whole chunks: up to chunk_size - 1 positions under the budget
    assert 0.25 - (0.06 if whole_chunks else 0.01) <= run.kv_bytes / full_bytes <= 0.25 + 0.01
    table = snapkv_lab.compare(model, byte_tokenizer, [ids], policies=[policy], max_new_tokens=NEW, progress=False)
    shared = table.results[0]
    assert all(torch.equal(a, b) for a, b in zip(run.kept_indices, shared.kept_indices, strict=True))
    assert torch.equal(run.token_ids, shared.token_ids)
    for kept in run.kept_indices:
        valid = kept[kept != NO_POSITION]
        assert 0 <= int(valid.min()) and int(valid.max()) < N
