"""KVzap (NVIDIA 2026, arXiv 2601.07891): a small model trained per LLM predicts, from each attention layer's input
hidden states, the KVzip+ score of every position, so KVzip's reconstruction pass is never run.

KVzip+ is KVzip's score (the largest attention any query of a repetition of the context pays a position) with each
attention weight divided by the norm of the query token's hidden state and multiplied by the norm of the position's
value through the output projection, ||W_o^h v_i||, then logged. The surrogate is per layer: linear (ridge) or a
two-layer MLP (hidden 512, GELU), from hidden_size to kv_heads. What the paper leaves open follows the official code,
NVIDIA/kvpress @8bb29b9 (cited as file:line): kvzap/data.py (targets), kvzap/train.py (fits),
kvpress/presses/kvzap_press.py (scoring); the lab's fits and targets: `kvzap_training`.

The published weights (Hub: nvidia/KVzap-{linear,mlp}-<model>) exist for 8B-class models only and this lab runs
offline: weights are trained per model with `python3 scripts/train_kvzap.py` from the lab's own texts. The linear
surrogates of the bundled models ship in the package (policies/weights/kvzap/, about 200 kB); the MLPs (tens of MB)
are rebuilt by the same command into the cache folder. A model without weights is refused, naming that command.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ..core.models import cache_dir, measured_cache_path
from .base import Policy, Prompt
from .trained_weights import PACKAGED, LoadedWeights, find_file, model_label, weights_path

MODEL_TYPES = ("linear", "mlp")  # kvpress/presses/kvzap_press.py:60 (default "mlp")
HIDDEN_DIM = 512  # the MLP's hidden width, kvzap/train.py:133
SHIPPED = PACKAGED / "kvzap"  # weights trained by the lab, in the package
TRAIN_COMMAND = "python3 scripts/train_kvzap.py --model {model} --model-type {model_type}"


class Surrogate(nn.Module):
    """KVzap's scorer, one module per trained layer (kvpress's KVzapModel, kvzap_press.py:26-48, keyed by layer so that
    layers never compressed, Gemma 3's sliding ones, need none): hidden_size -> kv_heads, linear or
    Linear-GELU-Linear.

    forward(layer, hidden): hidden (n, hidden_size) -> (n, kv_heads) predicted log KVzip+ scores."""

    def __init__(self, layers: list[int], input_dim: int, output_dim: int, hidden_dim: int | None = None):
        super().__init__()
        self.input_dim, self.output_dim, self.hidden_dim = input_dim, output_dim, hidden_dim

        def module():
            if hidden_dim is None:
                return nn.Linear(input_dim, output_dim)
            return nn.Sequential(nn.Linear(input_dim, hidden_dim), nn.GELU(), nn.Linear(hidden_dim, output_dim))

        self.layers = nn.ModuleDict({str(layer): module() for layer in layers})

    @property
    def model_type(self) -> str:
        return "linear" if self.hidden_dim is None else "mlp"

    @property
    def trained_layers(self) -> list[int]:
        return [int(layer) for layer in self.layers]

    def forward(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        return self.layers[str(layer)](hidden)

    def save(self, path: Path, record: dict | None = None) -> None:
        """Write the weights as safetensors, their shapes (and `record`, JSON-able) in its metadata."""
        path.parent.mkdir(parents=True, exist_ok=True)
        metadata = {"layers": json.dumps(self.trained_layers), "input_dim": str(self.input_dim),
                    "output_dim": str(self.output_dim), "hidden_dim": json.dumps(self.hidden_dim),
                    "record": json.dumps(record or {})}
        save_file({k: v.detach().float().contiguous() for k, v in self.state_dict().items()}, str(path), metadata)

    @classmethod
    def load(cls, path: Path) -> Surrogate:
        from safetensors import safe_open

        with safe_open(str(path), "pt") as file:
            metadata = file.metadata()
        surrogate = cls(json.loads(metadata["layers"]), int(metadata["input_dim"]), int(metadata["output_dim"]),
                        json.loads(metadata["hidden_dim"]))
        surrogate.load_state_dict(load_file(str(path)))
        return surrogate.eval()


def weights_name(model, model_type: str) -> str:
    """The file name of `model`'s KVzap weights: its name and a hash of a sample of its weights (two models of one
    name never share them)."""
    return measured_cache_path("kvzap", model, {"model_type": model_type}, "safetensors").name


def trained_path(model, model_type: str) -> Path:
    """Where scripts/train_kvzap.py writes `model`'s weights by default (the cache folder)."""
    return cache_dir() / "kvzap" / weights_name(model, model_type)


def find_weights(model, model_type: str) -> Path | None:
    """`model`'s KVzap weights of `model_type`: shipped in the package first, then trained into the cache folder."""
    return find_file("kvzap", weights_name(model, model_type))


def _load(path: Path, model) -> Surrogate:
    surrogate = Surrogate.load(path)
    if surrogate.input_dim != model.config.hidden_size:
        raise ValueError(f"{path} was trained on hidden states of {surrogate.input_dim} dimensions; this model's have "
                         f"{model.config.hidden_size}")
    return surrogate


_SURROGATES = LoadedWeights(_load)


@dataclass
class KVzap(Policy):
    """Keep, per layer and KV head, the positions whose KVzap-predicted (log KVzip+) score is highest.

    score: {layer: (1, kv_heads, n)} = surrogate_layer(h)^T, h (n, hidden_size) the layer's attention input (after its
        input norm), as kvpress's KVzapPress (kvzap_press.py:70-82). Reads no attention weights.
    model_type: "mlp" (kvpress's default, kvzap_press.py:60) or "linear".
    weights: None: the weights trained for this model (shipped, else in the cache folder; refused, naming the command
        that trains them, when there are none); a path: that safetensors file (another training).
    kept_tail: 0, as KVzapPress alone, a ScorerPress keeping the top n (1 - ratio) per head (scorer_press.py). The
        paper runs it under a threshold (kvpress's DMSPress) that keeps the last 128 tokens besides: kept_tail=128 is
        that window, budgets remain per head (the threshold's head-wise budgets: AdaKV(policy=KVzap())).
    """

    kept_tail: int = 0
    model_type: str = "mlp"
    weights: str | None = None

    needs: ClassVar[frozenset[str]] = frozenset({"layer_inputs"})
    scores_query_heads: ClassVar[bool] = False

    def __post_init__(self):
        super().__post_init__()
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"model_type must be one of {MODEL_TYPES}, got {self.model_type!r}")
        if self.weights is not None and not Path(self.weights).is_file():
            raise ValueError(f"KVzap weights {self.weights!r}: no such file")

    def _path(self, model) -> Path:
        return weights_path(self.weights, lambda: find_weights(model, self.model_type), lambda: (
            f"{self.label} has no {self.model_type} KVzap weights for the model {model_label(model)!r} (its "
            f"published weights are on the Hugging Face Hub, for other models): train them with `"
            f"{TRAIN_COMMAND.format(model=model_label(model), model_type=self.model_type)}` (about 10 minutes on "
            f"2 CPU cores; writes {trained_path(model, self.model_type)}), or pass weights=PATH"))

    def prepare(self, model, tokenizer) -> None:
        path = self._path(model)
        _SURROGATES.prepare(model, path)
        surrogate = _SURROGATES.get(model, path, self.label)
        if surrogate.model_type != self.model_type:
            raise ValueError(f"{path} holds a {surrogate.model_type} KVzap surrogate, not {self.model_type}")

    def prompt_scores(self, prompt: Prompt) -> dict[int, torch.Tensor]:
        """{layer: (1, kv_heads, n)} float32 predicted scores of every layer the cache compresses (sliding-window
        layers are left out, never compressed)."""
        surrogate = _SURROGATES.get(prompt.model, self._path(prompt.model), self.label)
        scores = {}
        for layer, cache_layer in enumerate(prompt.cache.layers):
            if getattr(cache_layer, "is_sliding", False):
                continue
            if str(layer) not in surrogate.layers:
                raise ValueError(f"{self.label}: its weights have no module for layer {layer}")
            with torch.no_grad():
                scores[layer] = surrogate(layer, prompt.layer_inputs[layer][0].float()).T[None]
        return scores
