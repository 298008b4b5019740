"""Two hook points: the attention function a transformers layer calls, and the decoder's output.

Inside `intercept_attention(model, callback)`, every attention call of the model first hands its inputs
to `callback`, then runs the model's own attention function unchanged:

    callback(module, query, key, value, attention_mask, **kwargs)
        module: the attention layer (module.layer_idx is its index)
        query: (batch, heads, q_len, head_dim), after RoPE
        key, value: (batch, kv_heads, kv_len, head_dim), after RoPE, before the GQA repeat; they already
            hold the whole cache, so the last q_len positions are the new tokens'.
        kwargs: scaling, dropout, sliding_window, ... as the layer passes them.

`intercept_attention(model, callback, attend=attend)` also replaces the call itself (the compressor does, for
layers whose cache the model's own function cannot read):

    attend(function, module, query, key, value, attention_mask, **kwargs) -> (output, weights)
        function: the backend's own attention function, to call (perhaps with other arguments) or not

The patch wraps the entry of the backend the model already uses (eager, sdpa, flash_attention_2, ...)
in transformers' attention-function registry, under the same name: the mask functions registered for
that name keep working, so logits are unchanged. Registering a new name instead would silently drop the
causal mask. The registry is process-wide, so one dispatcher per backend name routes each call to the
callbacks of the model that owns the calling module. The patch is undone when the last interception of
that backend ends, also on error, and it is never applied at import time.

`capture_final_hidden(model)` collects the decoder's final hidden states (the output of its final norm, what
`last_hidden_state` holds and the output head turns into logits) of every forward inside the block, even one
run with `logits_to_keep=1`, so that scores needing every position's logits cost no second forward:

    with capture_final_hidden(model) as hidden:
        model(ids, logits_to_keep=1)
    hidden[0]  # (batch, n, hidden_size), one tensor per forward

`capture_layer_inputs(model)` collects what each attention layer reads, its input hidden states (after the decoder
layer's input norm), what KVzap's and Fast KVzip's trained scorers read:

    with capture_layer_inputs(model) as inputs:
        model(ids)
    inputs[layer][0]  # (batch, n, hidden_size), one tensor per forward
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from contextlib import contextmanager

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS


def with_cache(model, cache) -> dict:
    """`cache` as the keyword argument `model`'s forward takes it by: `cache` from transformers 5.24 on, whose
    `past_key_values` warns that it is deprecated, `past_key_values` before."""
    return {_cache_keyword(type(model)): cache}


@functools.cache
def _cache_keyword(model_class) -> str:
    # Read once per class: a signature costs about 50 us, and every decode step passes its cache.
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def returned_cache(output):
    """The cache a forward returned: `output.cache` from transformers 5.24 on, `output.past_key_values` before."""
    return output.cache if "cache" in output else output.past_key_values


def model_eager_function(module) -> Callable:
    """The eager attention function of a module's model family (not in the registry: each family has its own)."""
    function = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if function is None:
        raise NotImplementedError(
            f"{type(module).__name__} defines no eager_attention_forward; run this model with "
            f"attn_implementation='sdpa'."
        )
    return function


def attention_modules(model) -> dict[int, object]:
    """{layer index: attention module} of a transformers model (the modules whose calls the hooks see)."""
    return {m.layer_idx: m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "o_proj")}


class _Dispatcher:
    """Stands in the registry under one backend name while any interception of that name is active:
    calls the callbacks registered for the calling module's model, then the backend's own function."""

    def __init__(self, name: str):
        registry = ALL_ATTENTION_FUNCTIONS._local_mapping
        self.name = name
        self.had_local, self.previous_local = name in registry, registry.get(name)
        self.original = ALL_ATTENTION_FUNCTIONS[name] if name in ALL_ATTENTION_FUNCTIONS else None
        self.entries: list[tuple[frozenset[int], Callable | None, Callable | None]] = []
        registry[name] = self

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        function = self.original if self.original is not None else model_eager_function(module)
        attend = None
        for modules, callback, override in list(self.entries):
            if id(module) in modules:
                if callback is not None:
                    callback(module, query, key, value, attention_mask, **kwargs)
                attend = override or attend
        if attend is not None:
            return attend(function, module, query, key, value, attention_mask, **kwargs)
        return function(module, query, key, value, attention_mask, **kwargs)

    def restore(self) -> None:
        registry = ALL_ATTENTION_FUNCTIONS._local_mapping
        if self.had_local:
            registry[self.name] = self.previous_local
        else:
            del registry[self.name]


# Backend name -> its dispatcher, while at least one interception of that backend is active.
_DISPATCHERS: dict[str, _Dispatcher] = {}


@contextmanager
def intercept_attention(model, callback: Callable | None, *, attend: Callable | None = None):
    """Call `callback` with the inputs of every attention call of `model` inside the block, and compute the
    call with `attend` instead of the backend's function if given (see module doc).

    Only `model`'s own attention modules reach the callback: another model in the process runs untouched.
    Interceptions nest and may end in any order; the registry is restored when the last one ends.
    """
    name = model.config._attn_implementation
    if name is None:
        raise ValueError("model.config._attn_implementation is not set; load the model with from_pretrained.")
    if name not in _DISPATCHERS:
        _DISPATCHERS[name] = _Dispatcher(name)
    dispatcher = _DISPATCHERS[name]
    entry = (frozenset(id(m) for m in model.modules()), callback, attend)
    dispatcher.entries.append(entry)
    try:
        yield
    finally:
        dispatcher.entries.remove(entry)
        if not dispatcher.entries:
            dispatcher.restore()
            del _DISPATCHERS[name]


@contextmanager
def capture_final_hidden(model):
    """Inside the block, append the decoder's final hidden states (batch, q_len, hidden_size) of every forward of
    `model` to the list this yields (see module doc). A forward hook on `model.get_decoder()`, removed on exit."""
    captured: list[torch.Tensor] = []

    def keep(module, args, output):
        captured.append(output[0])  # last_hidden_state, whether the decoder returns a ModelOutput or a tuple

    handle = model.get_decoder().register_forward_hook(keep)
    try:
        yield captured
    finally:
        handle.remove()


@contextmanager
def capture_layer_inputs(model):
    """Inside the block, append each attention layer's input hidden states (batch, q_len, hidden_size) of every
    forward of `model` to the dict this yields, {layer: [tensor per forward]} (see module doc). Forward pre-hooks on
    the attention modules, removed on exit."""
    captured: dict[int, list[torch.Tensor]] = {}

    def keep(module, args, kwargs):
        captured.setdefault(module.layer_idx, []).append(kwargs["hidden_states"] if "hidden_states" in kwargs
                                                         else args[0])

    handles = [module.register_forward_pre_hook(keep, with_kwargs=True)
               for module in attention_modules(model).values()]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()
