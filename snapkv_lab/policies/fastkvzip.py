"""Fast KVzip (Kim, Han, Yun 2026, arXiv 2601.17668): per layer, a small gate trained on KVzip's scores predicts each
position's score from the layer's attention input, so KVzip's reconstruction pass is never run.

The gate is a tiny attention of its own (Janghyun1230/FastKVzip @7d78b34, prefill/attention/gate.py:48-94; kvpress's
FastKVzipGate, fastkvzip_press.py:25-73): per KV head, 16-dimensional RMS-normed keys k_i and one query per query head
of its group q_i^g from the hidden state x_i, scored against 16 learned sink keys s_j:
score_i = mean_g 1 / (1 + sum_j exp(s_j.q_i^g / 4 - k_i.q_i^g / 4 - b^g)), a value in (0, 1) as KVzip's scores are.
Trained with a binary cross-entropy against KVzip's scores (`fastkvzip_training`). Inference (kvpress
fastkvzip_press.py:213-228, :240-256, the official code's defaults): the first 4 positions and the last 2% of the
prompt are kept (score 1), then one selection over all layers and KV heads (KVzip's global allocation).

The published gates (Hub: Jang-Hyun/Fast-KVzip) exist for 7-8B models only and this lab runs offline: gates are
trained per model with `python3 scripts/train_kvzap.py --method fastkvzip` from the lab's own KVzip runs, and a model
without gates is refused, naming that command.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from ..core.checks import check_int
from ..core.models import cache_dir, measured_cache_path
from .base import LayerBudget, Policy, Prompt
from .global_allocation import keep_globally
from .kvzip import ALLOCATIONS
from .trained_weights import PACKAGED, LoadedWeights, find_file, model_label, weights_path

DIM, SINK = 16, 16  # the gate's key/query width and its sink keys: the published gates' q{g}_dim16_sink16
SINKS, WINDOW_RATIO = 4, 0.02  # kvpress FastKVzipPress n_sink, window_ratio (fastkvzip_press.py:176-178)
RMS_EPS = 1e-6  # Qwen3RMSNorm's
SHIPPED = PACKAGED / "fastkvzip"
TRAIN_COMMAND = "python3 scripts/train_kvzap.py --method fastkvzip --model {model}"


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dimension, in float32 (Qwen3RMSNorm, which the gates use)."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + RMS_EPS))


class Gate(nn.Module):
    """One layer's gate (module doc). forward: x (n, hidden_size) -> (kv_heads, n) scores in (0, 1)."""

    def __init__(self, input_dim: int, kv_heads: int, group: int, dim: int = DIM, sink: int = SINK):
        super().__init__()
        self.kv_heads, self.group, self.dim = kv_heads, group, dim
        self.q_proj = nn.Linear(input_dim, kv_heads * group * dim, bias=True)
        self.k_proj = nn.Linear(input_dim, kv_heads * dim, bias=False)
        self.q_norm, self.k_norm = RMSNorm(dim), RMSNorm(dim)
        self.k_base = nn.Parameter(torch.zeros(kv_heads, 1, sink, dim))
        self.b = nn.Parameter(torch.zeros(kv_heads, 1, group))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        queries = self.q_norm(self.q_proj(x).view(n, self.kv_heads, self.group, self.dim))  # (n, kv, g, dim)
        keys = self.k_norm(self.k_proj(x).view(n, self.kv_heads, 1, self.dim))  # (n, kv, 1, dim)
        queries = queries.permute(1, 0, 3, 2)  # (kv, n, dim, g)
        scale = math.sqrt(self.dim)
        logit = keys.transpose(0, 1) @ queries / scale + self.b.unsqueeze(2)  # (kv, n, 1, g)
        base = self.k_base @ queries / scale  # (kv, n, sink, g)
        score = 1 / (1 + torch.exp(base - logit).sum(2))  # (kv, n, g)
        return score.mean(-1)


class Gates(nn.Module):
    """Every trained layer's gate, keyed by layer (sliding-window layers, never compressed, have none)."""

    def __init__(self, layers: list[int], input_dim: int, kv_heads: int, group: int):
        super().__init__()
        self.shape = (input_dim, kv_heads, group)
        self.layers = nn.ModuleDict({str(layer): Gate(input_dim, kv_heads, group) for layer in layers})

    @classmethod
    def drawn(cls, layers: list[int], input_dim: int, kv_heads: int, group: int, seed: int = 0) -> Gates:
        """Untrained gates of these shapes under `seed`: the projections at PyTorch's initialisation, the sink keys
        and biases from N(0, 1) and the norms' weights from U(0.5, 1.5) (initial zeros and ones would score every
        position's sink term alike; larger draws saturate the scores at 0 and 1, where ties decide). What the tests
        and the kvpress side by side hand a model that has no trained gates."""
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            gates = cls(layers, input_dim, kv_heads, group)
            with torch.no_grad():
                for gate in gates.layers.values():
                    gate.k_base.normal_()
                    gate.b.normal_()
                    gate.q_norm.weight.uniform_(0.5, 1.5)
                    gate.k_norm.weight.uniform_(0.5, 1.5)
        return gates.eval()

    @property
    def trained_layers(self) -> list[int]:
        return [int(layer) for layer in self.layers]

    def forward(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return self.layers[str(layer)](x)

    def save(self, path: Path, record: dict | None = None) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        metadata = {"layers": json.dumps(self.trained_layers), "shape": json.dumps(self.shape),
                    "record": json.dumps(record or {})}
        save_file({k: v.detach().float().contiguous() for k, v in self.state_dict().items()}, str(path), metadata)

    @classmethod
    def load(cls, path: Path) -> Gates:
        with safe_open(str(path), "pt") as file:
            metadata = file.metadata()
        gates = cls(json.loads(metadata["layers"]), *json.loads(metadata["shape"]))
        gates.load_state_dict(load_file(str(path)))
        return gates.eval()


def weights_name(model) -> str:
    """The file name of `model`'s gates: its name and a hash of a sample of its weights."""
    return measured_cache_path("fastkvzip", model, {"dim": DIM, "sink": SINK}, "safetensors").name


def trained_path(model) -> Path:
    return cache_dir() / "fastkvzip" / weights_name(model)


def find_weights(model) -> Path | None:
    """`model`'s gates: shipped in the package first, then trained into the cache folder."""
    return find_file("fastkvzip", weights_name(model))


def _load(path: Path, model) -> Gates:
    gates = Gates.load(path)
    if gates.shape[0] != model.config.hidden_size:
        raise ValueError(f"{path} was trained on hidden states of {gates.shape[0]} dimensions; this model's have "
                         f"{model.config.hidden_size}")
    return gates


_GATES = LoadedWeights(_load)


@dataclass
class FastKVzip(Policy):
    """Keep the positions of highest gate score, one selection over all layers and KV heads (module doc).

    sinks: the first positions kept (score 1; kvpress n_sink 4). window_ratio: the last max(1, int(n * ratio))
        positions kept (kvpress window_ratio 0.02, below 32k tokens; its 4096-token window beyond is for chunked
        prefill, which is not here). allocation: "global" (kvpress layerwise=False, the default) or "uniform" (every
        layer and KV head keeps the budget; kvpress's layerwise=True shares each layer's budget between its KV heads:
        AdaKV(FastKVzip(allocation="uniform"), alpha_safeguard=0.0)). weights: None: the gates trained for this model
        (refused, naming the command that trains them, when there are none); a path: that safetensors file.
    """

    kept_tail: int = 0
    sinks: int = SINKS
    window_ratio: float = WINDOW_RATIO
    allocation: str = "global"
    weights: str | None = None

    needs: ClassVar[frozenset[str]] = frozenset({"layer_inputs"})
    scores_query_heads: ClassVar[bool] = False

    def __post_init__(self):
        super().__post_init__()
        check_int("sinks", self.sinks, 0)
        if not 0 <= self.window_ratio < 1:
            raise ValueError(f"window_ratio must lie in [0, 1), got {self.window_ratio}")
        if self.allocation not in ALLOCATIONS:
            raise ValueError(f"allocation must be one of {ALLOCATIONS}, got {self.allocation!r}")
        if self.weights is not None and not Path(self.weights).is_file():
            raise ValueError(f"FastKVzip weights {self.weights!r}: no such file")

    @property
    def selects_across_layers(self) -> bool:
        return self.allocation == "global"

    @property
    def scoring_key(self) -> str:
        """The allocation acts after scoring: variants differing only in it share one pass."""
        return Policy.scoring_key.fget(dataclasses.replace(self, allocation="global"))

    def _path(self, model) -> Path:
        return weights_path(self.weights, lambda: find_weights(model), lambda: (
            f"{self.label} has no gates for the model {model_label(model)!r} (its published gates are on the "
            f"Hugging Face Hub, for other models): train them with `{TRAIN_COMMAND.format(model=model_label(model))}`"
            f" (writes {trained_path(model)}), or pass weights=PATH"))

    def prepare(self, model, tokenizer) -> None:
        _GATES.prepare(model, self._path(model))

    def prompt_scores(self, prompt: Prompt) -> dict[int, torch.Tensor]:
        """{layer: (1, kv_heads, n)} float32 gate scores, +inf on the sinks and the last window (sliding-window layers
        left out, never compressed)."""
        gates = _GATES.get(prompt.model, self._path(prompt.model), self.label)
        n = prompt.n_tokens
        window = max(1, int(n * self.window_ratio)) if self.window_ratio else 0
        scores = {}
        for layer, cache_layer in enumerate(prompt.cache.layers):
            if getattr(cache_layer, "is_sliding", False):
                continue
            if str(layer) not in gates.layers:
                raise ValueError(f"{self.label}: its gates have no module for layer {layer}")
            with torch.no_grad():
                layer_scores = gates(layer, prompt.layer_inputs[layer][0]).float()[None]
            layer_scores[..., :self.sinks] = math.inf
            layer_scores[..., n - window:] = math.inf
            scores[layer] = layer_scores
        return scores

    def keep_layers(self, scores: dict[int, torch.Tensor], budget: LayerBudget) -> dict[int, torch.Tensor]:
        """allocation="global": one top count over every layer and KV head (fastkvzip_press.py:240-256); "uniform":
        each layer by `keep`."""
        if self.allocation == "uniform":
            return super().keep_layers(scores, budget)
        return keep_globally(self, scores, budget)
