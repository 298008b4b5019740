"""LU-KV (policies.lukv) against kvpress 0.5.5's LUKVPress.compress written plainly (kvpress/presses/lukv_press.py:
124-179): over KNorm's scores (-||k|| of the cached keys, kvpress's KnormPress), the protected first `sink` and last
`window` positions given max + 1, one stable descending sort per head, and each head's count from the curve's row
for the ratio. Our implementation ranks with a top-k over protected values ordered by position instead: the two
must keep the same positions, head by head."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import eager_twin, make_tiny_llama

import snapkv_lab as C
from snapkv_lab.policies import NO_POSITION, lukv


def tiny():
    return make_tiny_llama(initializer_range=0.3)


def ref_keep(keys: torch.Tensor, prune: np.ndarray, sink: int, window: int) -> list[set[int]]:
    """Per KV head, the positions LUKVPress keeps of one layer's keys (kv_heads, n, d) at prune ratios (kv_heads,)."""
    kv_heads, n = keys.shape[0], keys.shape[1]
    scores = -keys.float().norm(dim=-1)  # KnormPress.score
    protected = scores.max().item() + 1
    scores[:, :min(sink, n)] = protected
    if window > 0:
        scores[:, max(0, n - window):] = protected
    ideal = (1.0 - torch.as_tensor(prune, dtype=torch.float32)).clamp(0, 1) * n
    total = max(kv_heads, min(kv_heads * n, int(torch.round(ideal.sum()).item())))
    base = torch.floor(ideal).long()
    remainder = total - int(base.sum())
    if remainder > 0:
        base[torch.topk(ideal - base, k=min(remainder, kv_heads)).indices] += 1
    keep = base.clamp(min=1, max=n)
    order = torch.argsort(scores, dim=-1, descending=True, stable=True)
    return [set(order[h, :int(keep[h])].tolist()) for h in range(kv_heads)]


def kept_sets(kept: torch.Tensor) -> list[set[int]]:
    return [set(row[row != NO_POSITION].tolist()) for row in kept.reshape(-1, kept.shape[-1])]


def curve_file(tmp_path, layers: int, kv_heads: int, seed: int = 0, low=0.0, high=1.0) -> str:
    """A (99, layers, kv_heads) curve of prune ratios drawn uniformly from [low, high), seeded."""
    rng = np.random.default_rng(seed)
    path = tmp_path / f"curve_{seed}.npy"
    np.save(path, rng.uniform(low, high, (99, layers, kv_heads)).astype(np.float32))
    return str(path)


@pytest.mark.parametrize("n, capacity, sink, window", [(150, 0.25, 4, 1), (150, 60, 4, 1), (97, 0.5, 0, 3),
                                                       (120, 0.9, 2, 0)])
def test_lukv_keeps_each_heads_curve_share_of_its_scorers_top_positions(n, capacity, sink, window, tmp_path,
                                                                        byte_tokenizer):
    model = tiny()
    config = model.config
    path = curve_file(tmp_path, config.num_hidden_layers, config.num_key_value_heads, seed=n)
    policy = C.LUKV(policy=C.KNorm(), capacity=capacity, sink=sink, window=window, curve=path)
    ids = torch.randint(2, 256, (1, n), generator=torch.Generator().manual_seed(n))
    result = C.generate(model, byte_tokenizer, ids, policy=policy, max_new_tokens=1)
    with torch.no_grad():
        cached = eager_twin(model)(ids, use_cache=True).past_key_values.layers
    ratio = 1 - (capacity if isinstance(capacity, float) else capacity / n)
    row = max(0, min(98, int(round(ratio * 100)) - 1))
    curve = np.load(path)
    counts = set()
    for layer, kept in enumerate(result.kept_indices):
        expected = ref_keep(cached[layer].keys[0], curve[row, layer], sink, window)
        assert kept_sets(kept) == expected, f"layer {layer}"
        counts |= {len(s) for s in expected}
    assert len(counts) > 1  # heads kept different counts: the curve, not a uniform budget


def test_a_head_keeping_fewer_than_its_protected_positions_keeps_the_first_ones(tmp_path, byte_tokenizer):
    """kvpress's stable sort takes tied protected positions in order: a head kept to 2 positions keeps the first two
    sinks, not the window."""
    model = tiny()
    config = model.config
    path = curve_file(tmp_path, config.num_hidden_layers, config.num_key_value_heads, low=0.99, high=0.995)
    ids = torch.randint(2, 256, (1, 150), generator=torch.Generator().manual_seed(1))
    result = C.generate(model, byte_tokenizer, ids, policy=C.LUKV(policy=C.KNorm(), capacity=0.5, curve=path),
                        max_new_tokens=1)
    for kept in result.kept_indices:  # ideal (1 - 0.99x) * 150 < 1.5: each head keeps one or two
        for positions in kept_sets(kept):
            assert positions in ({0}, {0, 1})


def test_a_model_without_a_curve_or_with_a_wrong_one_is_refused(tmp_path, byte_tokenizer, monkeypatch):
    monkeypatch.setattr(lukv, "find_curve", lukv.find_curve.original)  # no synthetic curve (conftest)
    model = tiny()
    model.config.name_or_path = "some/model"
    ids = torch.randint(2, 256, (1, 80), generator=torch.Generator().manual_seed(2))
    with pytest.raises(ValueError, match="no budget curve for the model 'model'.*curve=PATH"):
        C.generate(model, byte_tokenizer, ids, policy=C.LUKV(capacity=0.5), max_new_tokens=1)
    wrong = curve_file(tmp_path, model.config.num_hidden_layers + 1, model.config.num_key_value_heads)
    with pytest.raises(ValueError, match=r"shape \(99, 3, 2\), where this model needs \(99, 2, 2\)"):
        C.generate(model, byte_tokenizer, ids, policy=C.LUKV(capacity=0.5, curve=wrong), max_new_tokens=1)
    with pytest.raises(ValueError, match="no such file"):
        C.LUKV(capacity=0.5, curve=str(tmp_path / "missing.npy"))
    with pytest.raises(ValueError, match="set window, not kept_tail"):
        C.LUKV(capacity=0.5, kept_tail=4)
    assert lukv.find_curve(model) is None
