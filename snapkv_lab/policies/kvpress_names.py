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
    "ExpectedAttentionStatsPress": "ExpectedAttention",  # ExpectedAttention(statistics="shipped")
    "KVComposePress": "KVCompose",
    # kvpress's own CaM form: DecodingEviction(policy=scorer, capacity=None, interval=512, target=2048,
    # merging="cam"); the authors' CaM (zyxxmu/cam) is the lab's `CAM`, another method (policies.decoding_merge)
    "CAMPress": "DecodingEviction",
    "LUKVPress": "LUKV",  # the curve given (curve=PATH): none is made or shipped for the bundled models
}

# kvpress 0.5.5's presses with no lab equivalent yet, and why (docs/faithfulness.md, "Not yet in the lab").
KVPRESS_NOT_YET: dict[str, str] = {
    "RestoreKVPress": "KVzip plus 8 restore tokens encoded once through a LoRA adapter (arXiv 2608.01247, "
                      "restorekv_press.py:18-100); kvpress ships inference only and loads the trained embeddings and "
                      "adapters from the Hub (higokri/RestoreKV-<model>: Llama-3.1-8B-Instruct, Qwen3-8B; :46-58). "
                      "Training them for a bundled model is self-distillation from the full-cache teacher through "
                      "KVzip's eviction, each step a KVzip reconstruction (454 s for one 4096-token prompt on SmolLM2 "
                      "here) plus forward and backward passes over the context: hours of this CPU, not minutes; "
                      "not written",
}

