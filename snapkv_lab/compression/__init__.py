"""Applying compression policies (snapkv_lab.policies) to a live transformers KV cache.

    layers.py       cache layers holding kept positions (dense, or ragged per head), fork, bytes
    compressor.py   compress(): the hook callback that compresses at prefill and routes later calls
    recorder.py     ScoreRecorder: scores of many policies from one prefill
    generation.py   generate(): greedy decoding over a compressed cache, one context and many questions
    shared.py       SharedPrefill: one full prefill serving many policies (compare, the pressure tests)
    answering.py    answer_runs: the full cache and every policy x mode answering each question of one prefilled context
    reference.py    masked_decode: the plain definition the fast path is tested against (the full cache, each head's
                    evicted positions hidden, eager attention)
"""

from .compressor import CompressionState, applied, compress
from .generation import GenerationResult, branch, decode_text, forward, generate, greedy_decode, prefill
from .layers import CompressedLayer, HeadwiseLayer, cache_bytes, cache_lengths, compressed_copy, fork, gather_kv
from .recorder import ScoreRecorder, kept_from_scores
from .shared import SharedPrefill

__all__ = ["CompressedLayer", "CompressionState", "GenerationResult", "HeadwiseLayer", "ScoreRecorder", "SharedPrefill", "applied",
           "branch", "cache_bytes", "cache_lengths", "compress", "compressed_copy", "decode_text", "fork", "forward",
           "gather_kv", "generate", "greedy_decode", "kept_from_scores", "prefill"]
