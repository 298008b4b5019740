"""One hook point: the attention function a transformers layer calls.

Inside `intercept_attention(model, callback)`, every attention call of the model first hands its inputs
to `callback`, then runs the model's own attention function unchanged:

    callback(module, query, key, value, attention_mask, **kwargs)
        module: the attention layer (module.layer_idx is its index)
        query: (batch, heads, q_len, head_dim), after RoPE
        key, value: (batch, kv_heads, kv_len, head_dim), after RoPE, before the GQA repeat; they already
            hold the whole cache, so the last q_len positions are the new tokens'.
        kwargs: scaling, dropout, sliding_window, ... as the layer passes them.

The patch wraps the entry of the backend the model already uses (eager, sdpa, flash_attention_2, ...)
in transformers' attention-function registry, under the same name: the mask functions registered for
that name keep working, so logits are unchanged. Registering a new name instead would silently drop the
causal mask. The patch is undone on exit, also on error, and it is never applied at import time.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import contextmanager

from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS


def _model_eager_function(module) -> Callable:
    """The eager attention function of a module's model family (not in the registry: each family has its own)."""
    function = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if function is None:
        raise NotImplementedError(
            f"{type(module).__name__} defines no eager_attention_forward; run this model with attn_implementation='sdpa'."
        )
    return function


@contextmanager
def intercept_attention(model, callback: Callable):
    """Call `callback` with the inputs of every attention call of `model` inside the block (see module doc)."""
    name = model.config._attn_implementation
    if name is None:
        raise ValueError("model.config._attn_implementation is not set; load the model with from_pretrained.")
    registry = ALL_ATTENTION_FUNCTIONS._local_mapping
    had_local, previous_local = name in registry, registry.get(name)
    original = ALL_ATTENTION_FUNCTIONS[name] if name in ALL_ATTENTION_FUNCTIONS else None

    def attention_with_callback(module, query, key, value, attention_mask, **kwargs):
        callback(module, query, key, value, attention_mask, **kwargs)
        function = original if original is not None else _model_eager_function(module)
        return function(module, query, key, value, attention_mask, **kwargs)

    registry[name] = attention_with_callback
    try:
        yield
    finally:
        if had_local:
            registry[name] = previous_local
        else:
            del registry[name]
