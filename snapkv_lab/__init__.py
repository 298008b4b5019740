"""snapkv_lab: see where an LLM's attention goes, and what a SnapKV-compressed KV cache keeps."""

# The public names are imported on first use, so that `import snapkv_lab` (and with it `snapkv-lab --help`)
# does not load torch and transformers.
import importlib
import sys
import types

_EXPORTS = {  # public name -> its module
    "AttentionTrace": "trace", "capture": "capture", "intercept_attention": "hooks", "load_model": "models",
    "POLICIES": "policies", "Policy": "policies", "FullCache": "policies", "H2O": "policies", "RandomKeep": "policies",
    "SnapKV": "policies", "SnapKVNoPooling": "policies", "SnapKVFactKernel": "policies", "StreamingLLM": "policies",
    "KVzip": "policies", "Surprisal": "policies", "DecodingEviction": "policies",
    "PyramidKV": "policies", "AdaKV": "policies", "ExpectedAttention": "policies",
    "TOVA": "policies", "KNorm": "policies", "ChunkKV": "policies", "CriticalKV": "policies", "KeyDiff": "policies",
    "LagKV": "policies", "QFilters": "policies", "HeadKV": "policies", "DuoAttention": "policies", "CAKE": "policies",
    "RKV": "policies", "LookaheadQCache": "policies",
    "compress": "compression", "generate": "compression", "compare": "ab",
    "attention_coverage": "coverage", "explore": "explorer",
}
__all__ = list(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


class _Package(types.ModuleType):
    def __setattr__(self, name: str, value) -> None:
        # Importing the submodule `capture` binds it as `snapkv_lab.capture`; the function of the same
        # name must win, as it did when this file imported it eagerly.
        if isinstance(value, types.ModuleType) and _EXPORTS.get(name) == name:
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
