"""Per-model trained scorer weights (KVzap's surrogates, Fast KVzip's gates): where a model's file is found, the
refusal that names the command training it, and one loaded copy per model and file.

A policy's `prepare(model, tokenizer)` loads its weights into a `LoadedWeights`, so that scoring needs only the
prompt's model; the files are found in the package first (weights the lab trained and ships), then in the cache
folder (weights trained on this machine by scripts/train_kvzap.py).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from pathlib import Path

from torch import nn

from ..core.models import cache_dir

PACKAGED = Path(__file__).parent / "weights"


def find_file(kind: str, name: str) -> Path | None:
    """The file `name` of `kind` (trained weights: "kvzap", "fastkvzip"; measured calibrations and statistics:
    "retrieval_heads", "query_filters", "expected_attention"): shipped in the package, else written into the cache
    folder; None when neither exists."""
    return next((path for path in (PACKAGED / kind / name, cache_dir() / kind / name) if path.exists()), None)


def model_label(model) -> str:
    """The name scripts/train_kvzap.py takes for `model` (a bundled model's short name, else its path or Hub id)."""
    return Path(str(getattr(model.config, "name_or_path", "") or "MODEL")).name


def weights_path(weights: str | None, find: Callable[[], Path | None], refusal: Callable[[], str]) -> Path:
    """The file a policy scores with: `weights` (a path the user passed), else `find()` (the model's own); neither is
    a ValueError whose message, `refusal()`, names the command that trains them."""
    if weights is not None:
        return Path(weights)
    found = find()
    if found is None:
        raise ValueError(refusal())
    return found


class LoadedWeights:
    """Loaded weights by model (held weakly) and file. `load(path, model)` builds the module and checks it fits the
    model (raising ValueError where it does not)."""

    def __init__(self, load: Callable[[Path, object], nn.Module]):
        self._load = load
        self._loaded: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def prepare(self, model, path: Path) -> None:
        loaded = self._loaded.setdefault(model, {})
        if path not in loaded:
            loaded[path] = self._load(path, model).to(model.device)

    def get(self, model, path: Path, label: str) -> nn.Module:
        module = self._loaded.get(model, {}).get(path)
        if module is None:
            raise RuntimeError(f"{label}: the model was not prepared (policy.prepare(model, tokenizer))")
        return module
