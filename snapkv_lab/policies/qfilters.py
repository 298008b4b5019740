"""Q-Filters (Godey et al. 2025, arXiv 2503.02812): a key's projection on the main direction of its head's queries
estimates the attention it will draw, so the cache keeps the keys that project furthest along it. Reads no
attention weights, so it fits a FlashAttention serving stack; the directions are measured once per model
(`snapkv_lab.query_filters`)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..core.checks import check_int
from ..core.hooks import attention_modules
from .base import AttentionCall, Policy
from .query_filters import TOKENS, find_filters, query_filters

# attention module -> {calibration tokens: (kv_heads, head_dim) its filters}: set by `prepare`, so that scoring needs
# only the call's module
_FILTERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass
class QFilters(Policy):
    """Keep the keys of largest projection <k_j, u> on their KV head's query direction u, per KV head.

    score: (kv_heads, n_keys) = <k_j, u_h>, post-RoPE keys; u_h from `query_filters(model, tokenizer,
    tokens=calibration_tokens)`, calibrated at the first prefill of a model and cached (kvpress's QFilterPress
    scores -<f, k> with the authors' published filters, which point the other way: kvpress 0.5.5
    presses/qfilter_press.py, lines 176-178). No kept tail, as kvpress's press: every position competes;
    kept_tail=w keeps the last w tokens besides (our variant, named in the label).
    """

    kept_tail: int = 0
    calibration_tokens: int = TOKENS

    scores_query_heads: ClassVar[bool] = False

    def __post_init__(self):
        super().__post_init__()
        check_int("calibration_tokens", self.calibration_tokens, 1)

    def prepare(self, model, tokenizer) -> None:
        modules = attention_modules(model)
        if all(self.calibration_tokens in _FILTERS.get(m, {}) for m in modules.values()):
            return
        if tokenizer is None and find_filters(model, self.calibration_tokens) is None:  # shipped, or measured before
            raise ValueError(f"{self.label} calibrates its query directions on text the first time it meets a model: "
                             "pass tokenizer= to compress, or run snapkv_lab.generate / compare once")
        with torch.inference_mode(False):  # prepared inside generate, scored later perhaps under autograd too
            filters = query_filters(model, tokenizer, tokens=self.calibration_tokens).clone()
        for layer, module in modules.items():
            _FILTERS.setdefault(module, {})[self.calibration_tokens] = filters[layer]

    def score(self, call: AttentionCall):
        filters = _FILTERS.get(call.module, {}).get(self.calibration_tokens)
        if filters is None:
            raise RuntimeError(f"{self.label}: the model was not prepared (policy.prepare(model, tokenizer)), so its "
                               "query directions are unknown")
        return torch.einsum("hnd,hd->hn", call.key.float(), filters)
