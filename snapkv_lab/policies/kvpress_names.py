"""NVIDIA kvpress 0.5.5's press classes and the registered name of each one's lab equivalent.

Keys are kvpress's class names as `kvpress/__init__.py` exports them; values are names in `POLICY_NAMES`. A press
whose equivalent is another policy's setting maps to that policy (the setting is in benchmarks/kvpress_peer.py's
row and docs/faithfulness.md). `BASE_PRESSES` are kvpress's abstract classes, which compress nothing themselves.
"""

BASE_PRESSES = ("BasePress", "ScorerPress")

KVPRESS: dict[str, str] = {
    "SnapKVPress": "SnapKV",
    "StreamingLLMPress": "StreamingLLM",
    "KnormPress": "KNorm",
    "TOVAPress": "TOVA",
    "PyramidKVPress": "PyramidKV",
    "AdaKVPress": "AdaKV",
    "ChunkKVPress": "ChunkKV",
    "CriticalKVPress": "CriticalKV",
    "CriticalAdaKVPress": "CriticalKV",  # CriticalKV(policy=AdaKV(...)): kvpress's one class for the composition
    "ExpectedAttentionPress": "ExpectedAttention",
    "RandomPress": "RandomKeep",
    "KVzipPress": "KVzip",
    "KeyDiffPress": "KeyDiff",
    "LagKVPress": "LagKV",
    "QFilterPress": "QFilters",
    "DuoAttentionPress": "DuoAttention",
    "DecodingPress": "DecodingEviction",
    "ThinKPress": "ThinK",  # kvpress zeroes the pruned channels; ours stores only the kept ones
}
