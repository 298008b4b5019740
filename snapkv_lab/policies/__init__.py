"""Compression policies, one small module per method or family of methods, and their registry.

POLICIES maps each shipped policy's plain name to its class; every one can be built from `capacity=` alone,
and the tests parametrise over it, so a new method is tested the moment it is registered here.
`policy_config` writes a policy as JSON-able values (a grid cell's key), `policy_from_config` builds it back.
"""

import dataclasses

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
from .snapkv import SnapKV, SnapKVFactKernel, SnapKVNoPooling
from .surprisal import Surprisal
from .tova import TOVA

POLICIES: dict[str, type[Policy]] = {cls.__name__: cls for cls in (
    FullCache, SnapKV, SnapKVNoPooling, SnapKVFactKernel, H2O, StreamingLLM, RandomKeep, TOVA, KNorm, PyramidKV, AdaKV, ChunkKV,
    CriticalKV, ExpectedAttention, KVzip, Surprisal, DecodingEviction,
)}



def policy_config(policy: Policy) -> dict:
    """Every field of the policy, defaults included, as JSON-able values: {"name": class name, field: value, ...};
    a wrapped policy (AdaKV's, ChunkKV's, ...) as a nested config of its own."""
    config = {"name": type(policy).__name__}
    for field in dataclasses.fields(policy):
        value = getattr(policy, field.name)
        config[field.name] = policy_config(value) if isinstance(value, Policy) else value
    return config


def policy_from_config(config: dict) -> Policy:
    """The policy `config` describes ({"name": "SnapKV"} alone gives the defaults); an unknown name is refused
    with the list of registered names."""
    fields = {k: policy_from_config(v) if isinstance(v, dict) else v for k, v in config.items() if k != "name"}
    name = config.get("name")
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; registered policies (snapkv_lab.POLICIES): {', '.join(POLICIES)}")
    return POLICIES[name](**fields)


__all__ = ["NO_POSITION", "POLICIES", "AttentionCall", "Policy", "policy_config", "policy_from_config", *POLICIES]
