"""Compression policies, one small module per method or family of methods, and their registry.

POLICIES maps each shipped policy's plain name to its class; every one can be built from `capacity=` alone,
and the tests parametrise over it, so a new method is tested the moment it is registered here.
"""

from .base import NO_POSITION, AttentionCall, FullCache, Policy
from .adakv import AdaKV
from .baselines import RandomKeep, StreamingLLM
from .decoding import DecodingEviction
from .expected_attention import ExpectedAttention
from .h2o import H2O
from .kvzip import KVzip
from .pyramidkv import PyramidKV
from .snapkv import SnapKV, SnapKVNoPooling

POLICIES: dict[str, type[Policy]] = {cls.__name__: cls for cls in (
    FullCache, SnapKV, SnapKVNoPooling, H2O, StreamingLLM, RandomKeep, PyramidKV, AdaKV, ExpectedAttention, KVzip,
    DecodingEviction,
)}

__all__ = ["NO_POSITION", "POLICIES", "AttentionCall", "Policy", *POLICIES]
