"""snapkv_lab: see where an LLM's attention goes, and what a SnapKV-compressed KV cache keeps.

The package's layers, bottom to top (an import never runs up them; tests/test_layers.py checks it):

    core         models, hooks, exact attention, traces, capture, inputs, timing, progress
    tasks        real offline text and the prompts built from it (needles, RULER-style variants, findings' sets)
    policies     the compression methods, their registry and their calibrations (retrieval heads, query filters)
    compression  the engine: a policy applied to a live cache, one prefill serving many policies, the answers
    views        tiles, the explorer, plots, per-head statistics, attention coverage
    sweep        resumable grids of cells, here or on Ray
    findings, pressure, evaluation   the studies: the paper's findings, pressure tests, the field's benchmarks
    app          the command line and the docs' tables
"""

# The public names are imported on first use, so that `import snapkv_lab` (and with it `snapkv-lab --help`)
# does not load torch and transformers.
import importlib
import sys

from .core import __version__ as __version__
from .core.moved import Alias

_EXPORTS = {  # public name -> its module
    "AttentionTrace": "core.trace", "capture": "core.capture", "intercept_attention": "core.hooks",
    "load_model": "core.models",
    "POLICIES": "policies", "Policy": "policies", "FullCache": "policies", "H2O": "policies", "RandomKeep": "policies",
    "SnapKV": "policies", "SnapKVNoPooling": "policies", "SnapKVFactKernel": "policies", "StreamingLLM": "policies",
    "KVzip": "policies", "Surprisal": "policies", "DecodingEviction": "policies",
    "PyramidKV": "policies", "AdaKV": "policies", "ExpectedAttention": "policies",
    "TOVA": "policies", "KNorm": "policies", "ChunkKV": "policies", "CriticalKV": "policies", "KeyDiff": "policies",
    "LagKV": "policies", "QFilters": "policies", "HeadKV": "policies", "DuoAttention": "policies", "CAKE": "policies",
    "RKV": "policies", "LookaheadQCache": "policies", "PyramidAllocation": "policies", "GlobalAllocation": "policies",
    "DuoAllocation": "policies",
    "Merging": "policies",
    "LeverageScore": "policies", "NonCausalAttn": "policies", "Compactor": "policies", "CUR": "policies",
    "Cap": "policies",
    "ObservedAttention": "policies",
    "Finch": "policies", "EntropyGatedChunkKV": "policies", "KVgrad": "policies",
    "SimLayerKV": "policies", "DMS": "policies",
    "CAM": "policies",
    "KVzap": "policies", "FastKVzip": "policies",
    "ThinK": "policies", "KIVI": "policies",
    "PerLayer": "policies", "PerChunk": "policies", "Composed": "policies",
    "KeyRerotation": "policies", "Blockwise": "policies",
    "KVCompose": "policies",
    "LUKV": "policies",
    "compress": "compression", "generate": "compression", "compare": "compression.compare",
    "span_effects": "compression.span_effects", "causal_coverage": "views.causal",
    "attention_coverage": "views.coverage", "explore": "views.explorer",
}
__all__ = list(_EXPORTS)

# `snapkv_lab.capture` is the function; the module path it also named before the layers (snapkv_lab/capture.py) stays
# importable as an alias registered here, which the import system then never binds over the function.
sys.modules.setdefault(f"{__name__}.capture", Alias(f"{__name__}.capture", ("snapkv_lab.core.capture",),
                                                    warn_on_use=True))


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
