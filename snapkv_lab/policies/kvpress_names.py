"""NVIDIA kvpress 0.5.5's press classes and the registered name of each one's lab equivalent.

Keys are kvpress's class names as `kvpress/__init__.py` exports them; values are names in `POLICY_NAMES`. A press
whose equivalent is another policy's setting maps to that policy (the setting is in benchmarks/kvpress_peer.py's
row and docs/faithfulness.md). `BASE_PRESSES` are kvpress's abstract classes, which compress nothing themselves;
`KVPRESS_NOT_YET` the presses with no equivalent yet, each with why. The three together are every press class
kvpress 0.5.5 exports (tests/test_registry.py).
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
    "MergingPress": "Merging",
    "LeverageScorePress": "LeverageScore",
    "NonCausalAttnPress": "NonCausalAttn",
    "CompactorPress": "Compactor",
    "CURPress": "CUR",
    "CapPress": "Cap",
    "ObservedAttentionPress": "ObservedAttention",
    "FinchPress": "Finch",
    "EntropyGatedChunkKVPress": "EntropyGatedChunkKV",
    "KVgradPress": "KVgrad",
    "SimLayerKVPress": "SimLayerKV",
    "DMSPress": "DMS",  # kvpress's dense-prefill DMS without trained evictors; prefill only
    # DecodingEviction compresses the prompt with its scorer, then cuts back while decoding: the pair kvpress builds as
    # PrefillDecodingPress(prefilling_press=..., decoding_press=DecodingPress(...)) (docs/faithfulness.md)
    "PrefillDecodingPress": "DecodingEviction",
    "KVzapPress": "KVzap",
    "FastKVzipPress": "FastKVzip",
    "ThinKPress": "ThinK",  # kvpress zeroes the pruned channels; ours stores only the kept ones
    # kvpress's wrappers around any press
    "PerLayerCompressionPress": "PerLayer",
    "ChunkPress": "PerChunk",  # not the lab's prefill_chunk (docs/faithfulness.md)
    "ComposedPress": "Composed",
    "KeyRerotationPress": "KeyRerotation",  # kept keys at n - k.., kvpress's at 0..k-1: the same distances
    "CompressionRatioDecodingPress": "DecodingEviction",  # DecodingEviction(target_ratio=1 - its ratio)
    "BlockPress": "Blockwise",
}

# kvpress 0.5.5's presses with no lab equivalent yet, and why (docs/faithfulness.md, "Not yet in the lab").
KVPRESS_NOT_YET: dict[str, str] = {
    "CAMPress": "kvpress's own form (every 512 steps, one kept set for all heads, the k best evicted merged); the "
                "lab's CAM is the authors' form (zyxxmu/cam), a different method, so the name is not mapped to it",
    "KVComposePress": "composite tokens from extra question passes under eager attention: not written",
    "LUKVPress": "needs LU-KV's published budget curves, on GitHub only: not written",
    "ExpectedAttentionStatsPress": "ExpectedAttention with the query statistics precomputed on the Hub: not written",
    "RestoreKVPress": "LoRA-adapted restore tokens: not written",
}

