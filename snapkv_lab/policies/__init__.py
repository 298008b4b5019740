"""Compression policies, one small module per method or family of methods, and their registry.

POLICIES maps each shipped policy's plain name to its class; every one can be built from `capacity=` alone,
and the tests parametrise over it, so a new method is tested the moment it is registered here.
"""

from .base import NO_POSITION, AttentionCall, FullCache, Policy
from .adakv import AdaKV
from .baselines import RandomKeep, StreamingLLM
from .chunkkv import ChunkKV
from .criticalkv import CriticalKV
from .decoding import DecodingEviction
from .expected_attention import ExpectedAttention
from .h2o import H2O
from .knorm import KNorm
from .kvzip import KVzip
from .pyramidkv import PyramidKV
from .snapkv import SnapKV, SnapKVNoPooling
from .tova import TOVA

POLICIES: dict[str, type[Policy]] = {cls.__name__: cls for cls in (
    FullCache, SnapKV, SnapKVNoPooling, H2O, StreamingLLM, RandomKeep, TOVA, KNorm, PyramidKV, AdaKV, ChunkKV,
    CriticalKV, ExpectedAttention, KVzip, DecodingEviction,
)}

__all__ = ["NO_POSITION", "POLICIES", "AttentionCall", "Policy", *POLICIES]
