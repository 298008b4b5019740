"""Every policy in snapkv_lab.POLICIES, the moment it is registered: built from `capacity=` alone, it runs,
shrinks the cache to its budget, is the plain model when the budget covers the prompt, and the three ways
of running it (generate, model.generate under compress, compare from one shared prefill) agree."""

from __future__ import annotations

import pytest
import torch
from conftest import build_with_tail, make_tiny_llama

import snapkv_lab
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
    if policy.capacity_sets_entries:
        assert sum(run.cache_lengths) == pytest.approx(3 * N // 4, abs=3)  # per-layer/head budgets average out
        assert run.kv_bytes / full.kv_bytes == pytest.approx(0.25, abs=0.02)
    else:  # what it holds is its own decision (SimLayerKV's busy layers, DMS's threshold): tests/test_layerwise.py
        assert run.kv_bytes <= full.kv_bytes and max(run.cache_lengths) <= N + NEW
    for kept in run.kept_indices:
        for row in kept.reshape(-1, kept.shape[-1]):
            row = row[row != NO_POSITION]
            assert torch.equal(row, row.unique()) and 0 <= int(row.min()) and int(row.max()) < N + NEW


@pytest.mark.parametrize("name", NAMES)
def test_budget_covering_the_prompt_is_the_plain_model(name, model, byte_tokenizer):
    ids = prompt(seed=1, n=60)
    plain = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                           eos_token_id=None)
    policy = build(name, capacity=60 + NEW)
    run = snapkv_lab.generate(model, byte_tokenizer, ids, policy=policy, max_new_tokens=NEW)
    if policy.storage is not None and policy.storage.prunes_channels:
        # ThinK prunes key channels whatever the prompt's length, as its official code (kv_pruning_utils.py:97-101):
        # every position stays
        assert all(int((kept >= 0).sum(-1).min()) >= 60 for kept in run.kept_indices)
        return
    assert torch.equal(run.token_ids, plain[:, 60:])


@pytest.mark.parametrize("name", NAMES)
def test_generate_compress_and_compare_agree(name, model, byte_tokenizer):
    """Live compression at each layer's prefill call, model.generate under it, and compare's compressed copies
    of one full prefill: the same kept positions and tokens (policies that compress after the prefill, KVzip's and
    Surprisal's scores from the whole prompt, CAKE's budgets across layers, are refused inside model.generate)."""
    policy = build_with_tail(name, 8, capacity=40)
    ids = prompt(batch=2, seed=2)
    ours = snapkv_lab.generate(model, byte_tokenizer, ids, policy=policy, max_new_tokens=NEW)
    if policy.compresses_after_prefill:
        with pytest.raises(NotImplementedError, match="after the prefill"):
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


@pytest.mark.parametrize("name", [name for name in NAMES if name != "FullCache"])
def test_budgets_sharing_one_prefill_keep_what_each_keeps_alone(name, model, byte_tokenizer):
    """compare (and every eval) scores policies that differ only in budget once per prefill (Policy.score_table,
    scoring_key). A scorer whose scores depend on its budget (Compactor's blending, the compression ratio; CAM's
    sinks, half the budget) must not be served another budget's: each budget keeps what it keeps run alone."""
    policies = [build_with_tail(name, 8, capacity=capacity) for capacity in (40, 100)]
    ids = prompt(seed=4)
    table = snapkv_lab.compare(model, byte_tokenizer, [ids], policies=policies, max_new_tokens=1, progress=False)
    for policy, row in zip(policies, table.itertuples(), strict=True):
        assert row.policy == policy.label
        alone = snapkv_lab.generate(model, byte_tokenizer, ids, policy=policy, max_new_tokens=1)
        shared = table.results[row.Index]
        assert all(torch.equal(a, b) for a, b in zip(shared.kept_indices, alone.kept_indices, strict=True)), \
            f"{policy.label} kept other positions beside another budget than alone"


@pytest.mark.parametrize("name", [name for name in NAMES if name != "FullCache"])
def test_query_aware_over_a_prefill_split_by_its_question_is_the_live_compressor_over_the_whole_prompt(
        name, model, byte_tokenizer):
    """A context prefilled once for many questions, a question fed after it on a fork (evaluate's and the needle
    suites' query-aware runs), then compressed: the same kept positions and tokens as the live compressor fed context
    and question in one call, as kvpress runs a query-aware press. Whole-prompt scorers (NonCausalAttn, Compactor,
    PerChunk, Blockwise) are served by the prompt fed again in one call (SharedPrefill.serving); windows spanning the
    split take the context's last queries (compression.recorder)."""
    from snapkv_lab.compression import SharedPrefill
    from snapkv_lab.compression.generation import answer_runs

    policy = build_with_tail(name, 8, capacity=40)
    ids = prompt(seed=3)
    shared = SharedPrefill.run(model, byte_tokenizer, ids[:, :130], [policy])
    split, = answer_runs(model, byte_tokenizer, shared, [ids[:, 130:]], [policy], ["query-aware"], max_new_tokens=NEW,
                         full=False)
    live = snapkv_lab.generate(model, byte_tokenizer, ids, policy=policy, max_new_tokens=NEW)
    assert torch.equal(split.token_ids, live.token_ids)
    assert all(torch.equal(a, b) for a, b in zip(split.kept_indices, live.kept_indices, strict=True))


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


def test_the_voters_and_the_kept_tail_are_separate_settings():
    """SnapKV's observation window votes; its kept tail is what it keeps by right (by default the same tokens, as the
    authors'). kept_tail=0 keeps the top `capacity` of the same votes over the whole prompt, the voters included."""
    from snapkv_lab.policies import SnapKVNoPooling

    scores = torch.rand(6, 100, generator=torch.Generator().manual_seed(5))  # 6 query heads, 2 KV heads
    group_mean = scores.view(2, 3, 100).mean(1)
    authors = SnapKVNoPooling(capacity=40, window_size=8)
    variant = SnapKVNoPooling(capacity=40, window_size=8, kept_tail=0)
    assert (authors.voters, authors.tail(40), variant.voters, variant.tail(40)) == (8, 8, 8, 0)
    assert variant.label == "SnapKVNoPooling(kept_tail=0, window_size=8)@40"
    kept = authors.keep(scores, 100, 2, 0, 1)
    expected = torch.cat([group_mean[:, :92].topk(32).indices.sort().values, torch.arange(92, 100).expand(2, -1)], 1)
    assert torch.equal(kept, expected)
    assert torch.equal(variant.keep(scores, 100, 2, 0, 1), group_mean.topk(40).indices.sort().values)
    # a wrapper leaves the inner policy's tail alone unless told; the window is the inner policy's own
    assert snapkv_lab.AdaKV(policy=snapkv_lab.TOVA()).tail(40) == 0
    assert snapkv_lab.AdaKV(policy=snapkv_lab.TOVA(), kept_tail=4).policy.kept_tail == 4
    assert snapkv_lab.AdaKV(policy=snapkv_lab.SnapKV(window_size=16), capacity=40).policy.voters == 16
    with pytest.raises(ValueError, match="window_size is the observation window"):
        snapkv_lab.policies.parse_policy("TOVA(window_size=1)")


def test_configs_stored_under_the_former_window_size_read_as_today(tmp_path):
    """Before the kept tail had its own name, `window_size` named it on every policy, and a wrapper copied its inner
    SnapKV's window: such configs, and eval tables holding them, read as the same policies today."""
    import json

    import pandas as pd

    from snapkv_lab.evaluation import read_results
    from snapkv_lab.policies import policy_config, policy_from_config, upgrade_config

    old_tova = {"name": "TOVA", "capacity": 40, "window_size": 1, "per_query_head": False, "pooling": None,
                "kernel_size": 1, "gqa": "mean", "per_layer": True, "interval": None}
    old_ada = {"name": "AdaKV", "capacity": 40, "window_size": 8, "per_query_head": False, "pooling": None,
               "kernel_size": 1, "gqa": "mean", "alpha_safeguard": 0.2, "allocation": "paper",
               "policy": {"name": "SnapKV", "capacity": 40, "window_size": 8, "per_query_head": False,
                          "pooling": "max", "kernel_size": 7, "gqa": "mean"}}
    today = [snapkv_lab.TOVA(capacity=40, kept_tail=1, interval=None),
             snapkv_lab.AdaKV(policy=snapkv_lab.SnapKV(window_size=8), capacity=40)]
    for old, policy in zip((old_tova, old_ada), today):
        assert policy_from_config(upgrade_config(old)) == policy
        assert upgrade_config(policy_config(policy)) == policy_config(policy)  # today's configs pass unchanged
    path = tmp_path / "old.csv"
    pd.DataFrame({"policy": [p.label for p in today], "policy_config": [json.dumps(c) for c in (old_tova, old_ada)],
                  "prediction": ["7", "8"]}).to_csv(path, index=False)
    assert list(read_results(path).policy_config) == [json.dumps(policy_config(p)) for p in today]


def test_a_field_added_later_is_left_out_at_its_default_so_stored_cells_keep_their_keys():
    from snapkv_lab.policies import policy_config, policy_from_config, upgrade_config
    from snapkv_lab.sweep import Cell

    default, variant = snapkv_lab.KVzip(capacity=256), snapkv_lab.KVzip(capacity=256, repeat_prompts="kvpress")
    assert "repeat_prompts" not in policy_config(default) and policy_config(variant)["repeat_prompts"] == "kvpress"
    assert (policy_from_config(policy_config(default)) == default
            and policy_from_config(policy_config(variant)) == variant)
    # a config written before the field existed (commit bd58935), read as today's (its kept tail was then called
    # window_size: upgrade_config), is the key of today's default
    before = upgrade_config({"name": "KVzip", "capacity": 256, "window_size": 0, "per_query_head": False,
                             "pooling": None, "kernel_size": 1, "gqa": "mean", "chunk_size": 2000, "sinks": None,
                             "allocation": "global"})
    assert Cell("eval", {"policies": [policy_config(default)]}).key == Cell("eval", {"policies": [before]}).key
    assert Cell("eval", {"policies": [policy_config(variant)]}).key != Cell("eval", {"policies": [before]}).key


WRAPPERS = ("AdaKV", "ChunkKV", "CriticalKV")
INNER = [name for name in NAMES if name not in ("FullCache", "DecodingEviction")]


@pytest.mark.parametrize("inner", INNER)
@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_wrappers_compose_with_every_registered_policy(wrapper, inner, model, byte_tokenizer):
    """AdaKV, ChunkKV and CriticalKV wrap any registered scorer, those that score after the prefill (KVzip, Surprisal)
    and wrappers (CriticalKV(AdaKV(...)), kvpress's CriticalAdaKV) included: the composition runs, holds its budget
    and gives the same kept positions live, from one shared prefill (compare) and under generate. A selection across
    layers (KVzip's global allocation, KVCompose) is refused; KVzip's and FastKVzip's uniform allocation is wrapped."""
    if wrapper == inner == "CriticalKV":
        with pytest.raises(TypeError, match="cannot wrap another CriticalKV"):
            snapkv_lab.CriticalKV(policy=snapkv_lab.CriticalKV())
        return
    inner_cls = snapkv_lab.POLICIES[inner]
    # its own allocation across layers (CAKE) or its own decision of what to hold (SimLayerKV, DMS): refused, not
    # ignored
    if inner_cls.layers_share_budget or not inner_cls.capacity_sets_entries:
        with pytest.raises(TypeError, match="cannot be wrapped"):
            snapkv_lab.POLICIES[wrapper](policy=build(inner))
        return
    scorer = build(inner)
    if not scorer.keeps_by_ranking:  # a keep its ranking does not carry (EntropyGatedChunkKV's gate): refused
        with pytest.raises(TypeError, match="silently dropped"):
            snapkv_lab.POLICIES[wrapper](policy=scorer)
        return
    if scorer.selects_across_layers:  # one selection over every layer (KVzip's global): refused, not replaced
        with pytest.raises(TypeError, match="would silently replace"):
            snapkv_lab.POLICIES[wrapper](policy=scorer)
        if not hasattr(scorer, "allocation"):
            return
        scorer = build(inner, allocation="uniform")
    policy = snapkv_lab.POLICIES[wrapper](policy=scorer, capacity=0.25)
    assert (policy.label.startswith(f"{wrapper}(policy={inner}")
            or (inner == "SnapKV" and policy.label == f"{wrapper}@0.25"))
    ids = prompt(seed=3)
    run = snapkv_lab.generate(model, byte_tokenizer, ids, policy=policy, max_new_tokens=NEW)
    full_bytes = 3 * 2 * 2 * N * 16 * 4  # layers x (K, V) x KV heads x tokens x head_dim x fp32
    whole_chunks = wrapper == "ChunkKV"  # whole chunks: up to chunk_size - 1 positions under the budget
    low = 0.25 - (0.06 if whole_chunks else 0.01)
    if wrapper == "AdaKV" and inner in ("HeadKV", "LUKV"):  # AdaKV's blend round((1 - alpha) c_h + floor(alpha b))
        # takes b, the inner's smallest head budget, for every head's (uniform in the official code): over HeadKV's and
        # LU-KV's uneven budgets it holds less than the label, at least (1 - alpha) of it (0.234 here with HeadKV's
        # official window of 8, 0.225 with LU-KV's curve)
        low = (1 - 0.2) * 0.25
    assert low <= run.kv_bytes / full_bytes <= 0.25 + 0.01
    table = snapkv_lab.compare(model, byte_tokenizer, [ids], policies=[policy], max_new_tokens=NEW, progress=False)
    shared = table.results[0]
    assert all(torch.equal(a, b) for a, b in zip(run.kept_indices, shared.kept_indices, strict=True))
    assert torch.equal(run.token_ids, shared.token_ids)
    for kept in run.kept_indices:
        valid = kept[kept != NO_POSITION]
        assert 0 <= int(valid.min()) and int(valid.max()) < N


# kvpress 0.5.5's `kvpress/__init__.py` exports, every class whose name ends in Press (transcribed from the installed
# package, ~/.cache/snapkv_lab/kvpress-venv: the list the lab must cover, issue 54).
KVPRESS_055 = """AdaKVPress BasePress BlockPress CAMPress CURPress CapPress ChunkKVPress ChunkPress CompactorPress
ComposedPress CompressionRatioDecodingPress CriticalAdaKVPress CriticalKVPress DMSPress DecodingPress DuoAttentionPress
EntropyGatedChunkKVPress ExpectedAttentionPress ExpectedAttentionStatsPress FastKVzipPress FinchPress KVComposePress
KVgradPress KVzapPress KVzipPress KeyDiffPress KeyRerotationPress KnormPress LUKVPress LagKVPress LeverageScorePress
MergingPress NonCausalAttnPress ObservedAttentionPress PerLayerCompressionPress PrefillDecodingPress PyramidKVPress
QFilterPress RandomPress RestoreKVPress ScorerPress SimLayerKVPress SnapKVPress StreamingLLMPress TOVAPress
ThinKPress""".split()


def test_every_kvpress_press_has_an_equivalent_or_says_why_not():
    from snapkv_lab.policies import BASE_PRESSES, KVPRESS, KVPRESS_NOT_YET

    assert len(KVPRESS_055) == 46
    assert not set(KVPRESS) & set(KVPRESS_NOT_YET) and not set(KVPRESS) & set(BASE_PRESSES)
    assert sorted([*KVPRESS, *KVPRESS_NOT_YET, *BASE_PRESSES]) == sorted(KVPRESS_055)
    assert set(KVPRESS.values()) <= set(snapkv_lab.policies.POLICY_NAMES)
    assert all(len(why) > 20 for why in KVPRESS_NOT_YET.values())


@pytest.mark.parametrize("wrapper", ["AdaKV", "ThinK", "Merging", "KIVI", "ChunkKV"])
def test_a_budget_given_to_the_wrapped_policy_alone_is_refused_not_replaced(wrapper):
    """A wrapper's budget is its own and is set on the policy it wraps: SnapKV(capacity=51) inside a wrapper with no
    budget of its own would silently keep the wrapper's default instead (ThinK's, every position). Given to the
    wrapper, or to both alike, it holds."""
    inner = snapkv_lab.SnapKV(capacity=51)
    with pytest.raises(ValueError, match=f"give it capacity=51 \\({wrapper}\\(policy=SnapKV"):
        snapkv_lab.POLICIES[wrapper](policy=inner)
    assert snapkv_lab.POLICIES[wrapper](policy=inner, capacity=51).policy.capacity == 51
    assert snapkv_lab.POLICIES[wrapper](policy=snapkv_lab.SnapKV(), capacity=51).policy.capacity == 51
