"""The compression engine: a policy (snapkv_lab.policies) applied to a live transformers KV cache, and the answers
over it. One scoring path, one way to keep and build, one answer engine:

    recorder.py     ScoreRecorder: a policy's `score` at the prefill's attention calls, for one policy or many
    engine.py       compress_layers: scores -> kept positions -> the layers holding them (batches as rows)
    layers.py       cache layers holding kept positions (dense, or ragged per head), fork, bytes
    state.py        CompressionState: a compressed cache, its phase, and every later attention call (eviction too)
    compressor.py   compress(): the live compressor, layer by layer as the prefill (or each prompt chunk) runs
    shared.py       SharedPrefill: one full prefill serving many policies, and what policies need beyond it (Prompt)
    greedy.py       feeding tokens, greedy decoding, the end of an answer
    generation.py   the answer engine: generate(), answer() over one state, answer_runs() over policies x modes
    compare.py      compare(): policies side by side on the same prompts, with a notebook display
    kept.py         kept_mask: what a compressed cache holds, as a mask over prompt positions
    entries.py      HeldEntries: the KV entries a compressed cache holds, the uncompressed cache's and the budget's
    span_effects.py span_effects, EvictionProbe: evicting spans of the cache as experiments on the answer
    span_search.py  the smallest evicting set, and one span's effect per layer and KV head
    span_gradients.py  gradient_effects: KVgrad's input x gradient estimate of span effects
    reference.py    masked_decode: the plain definition the fast path is tested against (the full cache, each head's
                    evicted positions hidden, eager attention)
"""

import warnings

from .compressor import compress
from .engine import compress_layers, kept_from_scores
from .generation import MODES, GenerationResult, answer, answer_runs, generate, prefill
from .greedy import decode_text, forward, greedy_decode
from .layers import CompressedLayer, HeadwiseLayer, build_layer, cache_bytes, cache_lengths, fork, gather_kv
from .recorder import ScoreRecorder
from .shared import SharedPrefill
from .state import CompressionState, Phase, applied

__all__ = ["MODES", "CompressedLayer", "CompressionState", "GenerationResult", "HeadwiseLayer", "Phase",
           "ScoreRecorder", "SharedPrefill", "answer", "answer_runs", "applied", "build_layer", "cache_bytes",
           "cache_lengths", "compress", "compress_layers", "decode_text", "fork", "forward", "gather_kv", "generate",
           "greedy_decode", "kept_from_scores", "prefill"]


def branch(state: CompressionState) -> CompressionState:
    """Replaced on 2026-11-28 by `state.fork()`: an alias that warns, for one release."""
    warnings.warn("compression.branch(state) is state.fork() now", DeprecationWarning, stacklevel=2)
    return state.fork()
