"""Compression policies, one small module per method or family of methods, and their registry.

POLICIES maps each shipped policy's plain name to its class; every one can be built from `capacity=` alone,
and the tests parametrise over it, so a new method is tested the moment it is registered here.
`policy_config` writes a policy as JSON-able values (a grid cell's key), `policy_from_config` builds it back;
`parse_policy` reads one from the command line: "SnapKV", "SnapKV(window_size=64)", "AdaKV(ExpectedAttention)".
"""

import ast
import dataclasses

from .base import ADDED_LATER, NO_POSITION, AttentionCall, FullCache, Policy
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
    a wrapped policy (AdaKV's, ChunkKV's, ...) as a nested config of its own.

    Defaults are written so that a changed default changes every grid cell's key. The one exception is a field
    added after results were stored whose default reproduces the former behaviour (`ADDED_LATER` in its
    metadata): at its default it is left out, so the stored cells keep their keys and resume."""
    config = {"name": type(policy).__name__}
    for field in dataclasses.fields(policy):
        value = getattr(policy, field.name)
        if field.metadata.get(ADDED_LATER) and value == field.default:
            continue
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


def parse_policy(text: str) -> Policy:
    """A policy written as a call: a registered name, with keyword settings of literal values and at most one
    positional argument, the wrapped policy (itself written the same way): "SnapKV", "SnapKV(window_size=64,
    kernel_size=7)", "AdaKV(ExpectedAttention)", "ChunkKV(AdaKV(SnapKV(window_size=16)))". Nothing is evaluated:
    anything else is refused with the registered names."""
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except SyntaxError as error:
        raise ValueError(f"cannot read the policy {text!r}: write Name or Name(setting=value, ...)") from error
    return _policy_from_node(tree, text)


def _policy_from_node(node, text: str) -> Policy:
    if isinstance(node, ast.Name):
        return policy_from_config({"name": node.id})
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or len(node.args) > 1:
        raise ValueError(f"cannot read the policy {text!r}: write Name or Name(inner policy, setting=value, ...), "
                         f"with names among {', '.join(POLICIES)}")
    config = {"name": node.func.id}
    if node.args:
        config["policy"] = policy_config(_policy_from_node(node.args[0], text))
    for keyword in node.keywords:
        try:
            config[keyword.arg] = ast.literal_eval(keyword.value)
        except ValueError as error:
            raise ValueError(f"the setting {keyword.arg} of {text!r} must be a literal (number, string, None, ...)") from error
    try:
        return policy_from_config(config)
    except TypeError as error:  # an unknown setting: name the ones there are
        fields = [f.name for f in dataclasses.fields(POLICIES[config["name"]])]
        raise ValueError(f"{text!r}: {error}; {config['name']} takes {', '.join(fields)}") from error


__all__ = ["ADDED_LATER", "NO_POSITION", "POLICIES", "AttentionCall", "Policy", "parse_policy", "policy_config", "policy_from_config",
           *POLICIES]
