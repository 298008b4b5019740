"""Compression policies, one small module per method or family of methods, and their registry.

POLICIES maps each shipped policy's plain name to its class; every one can be built from `capacity=` alone,
and the tests parametrise over it, so a new method is tested the moment it is registered here.
`policy_config` writes a policy as JSON-able values (a grid cell's key), `policy_from_config` builds it back
(`upgrade_config` reads a config stored under former field names);
`parse_policy` reads one from the command line: "SnapKV", "SnapKV(window_size=64)", "AdaKV(ExpectedAttention)".

The classes are imported on first use (they need torch); `POLICY_NAMES` and `policy_spec` do not, so that the
command line refuses a misspelt policy before it pays for importing torch.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib

from ..core.checks import did_you_mean

# The registry, in its order: each policy's name and the module that holds it.
_MODULES = {
    "FullCache": "base", "SnapKV": "snapkv", "SnapKVNoPooling": "snapkv", "SnapKVFactKernel": "snapkv", "H2O": "h2o",
    "StreamingLLM": "baselines", "RandomKeep": "baselines", "TOVA": "tova", "KNorm": "knorm", "PyramidKV": "pyramidkv",
    "AdaKV": "adakv", "ChunkKV": "chunkkv", "CriticalKV": "criticalkv", "ExpectedAttention": "expected_attention",
    "KVzip": "kvzip", "Surprisal": "surprisal", "DecodingEviction": "decoding", "KeyDiff": "keydiff", "LagKV": "lagkv",
    "QFilters": "qfilters", "HeadKV": "headkv", "DuoAttention": "duoattention", "CAKE": "cake",
    "RKV": "rkv", "LookaheadQCache": "lookahead",
    # Allocations alone, over any scorer (AdaKV and HeadKV above are wrappers too): scorer x allocation studies.
    "PyramidAllocation": "pyramid_allocation", "GlobalAllocation": "global_allocation",
    "DuoAllocation": "duo_allocation",
    # Merging instead of eviction: the evicted values folded into kept ones (issue 54).
    "Merging": "merging",
    # Compactor and its two halves (issue 54)
    "LeverageScore": "leverage", "NonCausalAttn": "non_causal", "Compactor": "compactor",
    "CUR": "cur", "Cap": "cap",  # CurDKV, CAPKV (issue 54)
    "ObservedAttention": "observed_attention",
    "Finch": "finch", "EntropyGatedChunkKV": "entropy_gated_chunkkv", "KVgrad": "kvgrad",
    # Layer-level and threshold budgets (issue 54): what the cache holds is the method's decision, not its capacity.
    "SimLayerKV": "simlayerkv", "DMS": "dms",
    # Merging while decoding: the token leaving a StreamingLLM window folded into those after it (issue 54).
    "CAM": "cam",
    "KVzap": "kvzap", "FastKVzip": "fastkvzip",  # trained scorers (issue 54), weights in policies/weights/
    # How kept positions are stored, over any positional policy: key channels pruned (ThinK), bits (KIVI).
    "ThinK": "think", "KIVI": "kivi",
    # kvpress's wrappers around any press (issue 54): a budget per layer.
    "PerLayer": "per_layer", "PerChunk": "per_chunk", "Composed": "composed",
    "KeyRerotation": "key_rerotation",  # kept keys re-rotated to contiguous positions (issue 54)
    "Blockwise": "blockwise",  # kvpress's BlockPress: block-wise selection simulated over one prefill (issue 54)
    "KVCompose": "kvcompose",  # composite tokens from the prompt fed again, budgets across layers (issue 54)
    "LUKV": "lukv",  # head-wise budgets read off an LU-KV budget curve, over any scorer (issue 54)
}
POLICY_NAMES: tuple[str, ...] = tuple(_MODULES)
# Written in a list of policies in place of every compressor the registry holds (all but the full cache).
ALL_POLICIES = "all"
_FROM_BASE = ("ADDED_LATER", "NO_POSITION", "AttentionCall", "Policy")


def __getattr__(name: str):
    if name in ("KVPRESS", "KVPRESS_NOT_YET", "BASE_PRESSES"):
        value = getattr(importlib.import_module(".kvpress_names", __name__), name)
    elif name == "POLICIES":
        value = {policy: __getattr__(policy) for policy in POLICY_NAMES}
    elif name in _MODULES or name in _FROM_BASE:
        value = getattr(importlib.import_module(f".{_MODULES.get(name, 'base')}", __name__), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


def policy_config(policy) -> dict:
    """Every field of the policy, defaults included, as JSON-able values: {"name": class name, field: value, ...};
    a wrapped policy (AdaKV's, ChunkKV's, ...) as a nested config of its own.

    Defaults are written so that a changed default changes every grid cell's key. The one exception is a field
    added after results were stored whose default reproduces the former behaviour (`ADDED_LATER` in its
    metadata): at its default it is left out, so the stored cells keep their keys and resume."""
    from .base import ADDED_LATER, Policy

    config = {"name": type(policy).__name__}
    for field in dataclasses.fields(policy):
        value = getattr(policy, field.name)
        if field.metadata.get(ADDED_LATER) and value == field.default:
            continue
        if isinstance(value, tuple) and value and all(isinstance(v, Policy) for v in value):
            value = [policy_config(v) for v in value]  # a sequence of policies (Composed's stages)
        config[field.name] = policy_config(value) if isinstance(value, Policy) else value
    return config


def policy_from_config(config: dict):
    """The policy `config` describes ({"name": "SnapKV"} alone gives the defaults); an unknown name is refused
    with the list of registered names."""
    fields = {k: policy_from_config(v) if isinstance(v, dict) else
              [policy_from_config(x) for x in v] if isinstance(v, list) and v and all(isinstance(x, dict) for x in v)
              else v for k, v in config.items() if k != "name"}
    _check_name(config.get("name"))
    return __getattr__(config["name"])(**fields)


def upgrade_config(config: dict) -> dict:
    """A config stored before a change of meaning, as it reads today. A DuoAttention config without `rolling` is the
    frozen one it ran (rolling=False). Before the kept tail had its own name (2026-11-26), `window_size` named both
    SnapKV's voters and the last tokens every policy keeps by right: it stays `window_size` on SnapKV's family (whose
    tail is that window) and becomes `kept_tail` elsewhere; a wrapper's copy of its inner policy's window is dropped
    (a wrapper now leaves the inner policy's tail alone unless told). Today's configs come back unchanged."""
    config = {k: upgrade_config(v) if isinstance(v, dict) else v for k, v in config.items()}
    if config.get("name") == "DuoAttention" and "rolling" not in config:  # stored before its streaming heads rolled
        config["rolling"] = False  # (2026-11-29): what the prefill kept stayed, every generated token with it
    if "window_size" not in config:
        return config
    from .base import has_observation_window

    if has_observation_window(__getattr__(config["name"])):
        return config
    value = config.pop("window_size")
    if "policy" not in config:
        config["kept_tail"] = value
    return config


def _check_name(name) -> None:
    if name not in _MODULES:
        raise ValueError(f"unknown policy {name!r}{did_you_mean([name], POLICY_NAMES)}; registered policies "
                         f"(snapkv_lab.POLICIES): {', '.join(POLICY_NAMES)}")


def policy_spec(text: str) -> dict:
    """The config (as `policy_from_config` takes it) of a policy written as a call: a registered name, with keyword
    settings of literal values and at most one positional argument, the wrapped policy (itself written the same
    way, or as a label writes it, `policy=...`): "SnapKV", "SnapKV(window_size=64, kernel_size=7)",
    "AdaKV(ExpectedAttention)", "ChunkKV(AdaKV(SnapKV(window_size=16)))", "HeadKV(policy=SnapKV(window_size=32))".
    Nothing is evaluated and no policy is built (torch is not imported): a syntax or a name outside the registry is
    refused; the settings' values are checked by `parse_policy`."""
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except SyntaxError as error:
        raise ValueError(f"cannot read the policy {text!r}: write Name or Name(setting=value, ...)") from error
    return _spec_from_node(tree, text)


def _spec_from_node(node, text: str) -> dict:
    if isinstance(node, ast.Name):
        _check_name(node.id)
        return {"name": node.id}
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or len(node.args) > 1 or \
            any(keyword.arg is None for keyword in node.keywords):
        raise ValueError(f"cannot read the policy {text!r}: write Name or Name(inner policy, setting=value, ...), "
                         f"with names among {', '.join(POLICY_NAMES)}")
    _check_name(node.func.id)
    config = {"name": node.func.id}
    if node.args:
        config["policy"] = _spec_from_node(node.args[0], text)
    for keyword in node.keywords:
        if keyword.arg == "policy" and isinstance(keyword.value, (ast.Name, ast.Call)):  # as labels write it
            if node.args:
                raise ValueError(f"cannot read the policy {text!r}: the inner policy is given twice")
            config["policy"] = _spec_from_node(keyword.value, text)
            continue
        try:
            config[keyword.arg] = ast.literal_eval(keyword.value)
        except ValueError as error:
            raise ValueError(f"the setting {keyword.arg} of {text!r} must be a literal (number, string, None, "
                             "...)") from error
    return config


def expand_policies(policies) -> list:
    """`policies` (names, written forms or Policy objects) with each ALL_POLICIES ("all") replaced by the name of
    every registered compressor, in the registry's order: what `--policies all` and `evaluate(policies=["all"])`
    run."""
    every = [name for name in POLICY_NAMES if name != "FullCache"]
    return [name for entry in policies for name in (every if entry == ALL_POLICIES else [entry])]


def _former_window(config: dict) -> bool:
    """Whether a config, or one it wraps, gives window_size to a class without an observation window."""
    inner = any(_former_window(v) for v in config.values() if isinstance(v, dict))
    if "window_size" not in config or config.get("name") not in _MODULES:
        return inner
    from .base import has_observation_window

    return inner or not has_observation_window(__getattr__(config["name"]))


def parse_policy(text: str):
    """The policy `policy_spec(text)` describes, built: a setting the policy does not take, or a value it refuses,
    is refused with the settings it takes."""
    config = policy_spec(text)
    if _former_window(config):  # the classes take it, warning, for code written before; a command line is told
        raise ValueError(f"{text!r}: window_size is the observation window of SnapKV's family, the last tokens kept "
                         f"by right are kept_tail")
    try:
        return policy_from_config(config)
    except TypeError as error:
        if "unexpected keyword argument" not in str(error):  # a composition refused (a wrapper's inner): said as is
            raise ValueError(f"{text!r}: {error}") from error
        # an unknown setting: name the ones there are
        fields = [f.name for f in dataclasses.fields(__getattr__(config["name"]))]
        hint = ("; window_size is the observation window of SnapKV's family, the last tokens kept by right are "
                "kept_tail") if "window_size" in str(error) else ""
        raise ValueError(f"{text!r}: {error}; {config['name']} takes {', '.join(fields)}{hint}") from error


__all__ = ["ADDED_LATER", "ALL_POLICIES", "BASE_PRESSES", "KVPRESS", "KVPRESS_NOT_YET", "NO_POSITION", "POLICIES",
           "POLICY_NAMES", "AttentionCall", "Policy", "expand_policies", "parse_policy",
           "policy_config", "policy_from_config", "policy_spec", "upgrade_config", *POLICY_NAMES]
