"""KVgrad (openreview cg1wTCJjjk; NVIDIA kvpress 0.5.5's KVgradPress, presses/kvgrad_press.py): KVzip's reconstruction
of the context, each KV pair scored by input x gradient attribution: how much it writes into the residual stream of a
reconstruction token, times how much the model's last hidden states depend on that stream.

    S_{l,c} = max_p  A^l_{p,c} * ||v^l_c W_O^l||_2 * ||grad_{a^l_p} Phi||_2,   Phi = sum_p ||h^L_p||^2

over reconstruction tokens p and the query heads of each KV head (kvgrad_press.py:77-88, _update_scores :247-272):
A the restricted softmax KVzip scores with ([sinks, chunk, feed], kvzip_press.py:287-313), ||v W_O|| the L2 norm of
what c's value adds through the head's slice of the output projection (:315-323), and the gradient of Phi (the last
decoder layer's output, before the final norm) with respect to the layer's attention output at p (:199-204). kvpress
is the reference (no other code was found); its defaults are ours: KVzip's protocol with kvpress's 4 sinks and
reconstruction in chunks of 512 (kvgrad_press.py:100), one selection over all layers and heads.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from einops import rearrange

from ..core.attention import AttentionSettings
from ..core.capture import value_norms
from ..core.hooks import attention_modules, intercept_attention, with_cache
from .base import Prompt
from .kvzip import REPEAT_NEXT_BY, KVzip, reconstruction_feeds


def kvgrad_scores(attention: torch.Tensor, gradient: torch.Tensor, contribution: torch.Tensor,
                  kv_heads: int) -> torch.Tensor:
    """KVgrad's score per KV head, (kv_heads, n): max over probes p and each KV head's query heads of
    A[h, p, c] * ||grad_p|| * ||W_O^h v_c||. attention: (heads, probes, n) the probes' attention; gradient: (probes,)
    the objective's gradient norm at each probe's attention output; contribution: (heads, n) ||W_O^h v_c||."""
    # (heads, n): ||W_O v|| does not vary with p
    per_head = (attention * gradient[None, :, None]).amax(1) * contribution
    return per_head.unflatten(0, (kv_heads, -1)).amax(1)


def restricted_attention(query: torch.Tensor, key: torch.Tensor, sinks: int, chunk: slice,
                         settings: AttentionSettings) -> torch.Tensor:
    """(heads, m, chunk length) float32: the feed's softmax over [sinks, chunk, feed] (the feed causal), the chunk's
    columns (kvzip_press.py:287-313). query: (heads, m, head_dim) the feed's; key: (kv_heads, n + m, head_dim)."""
    kv_heads, m = key.shape[0], query.shape[1]
    keys = torch.cat([key[:, :sinks], key[:, chunk], key[:, -m:]], dim=1).float()  # (kv, keys, d)
    grouped = rearrange(query.float(), "(kv g) q d -> kv (g q) d", kv=kv_heads)
    logits = (grouped @ keys.mT * settings.scaling).unflatten(1, (-1, m))  # (kv, g, m, keys)
    if settings.softcap is not None:
        logits = torch.tanh(logits / settings.softcap) * settings.softcap
    width = keys.shape[1] - m
    logits[..., width:].masked_fill_(torch.ones(m, m, dtype=torch.bool, device=query.device).triu(1), -math.inf)
    return torch.softmax(logits, dim=-1)[..., sinks:width].flatten(0, 1)


@dataclass
class KVgrad(KVzip):
    """KVzip's reconstruction scored by input x gradient (see module doc): one forward and one backward pass per chunk.

    Defaults: kvpress's KVgradPress (sinks=4, chunk_size=512, its repeat prompt), one selection over all layers and
    KV heads (allocation="global", kvpress layerwise=False). The settings are KVzip's (its docstring)."""

    chunk_size: int = 512
    sinks: int | None = 4
    repeat_prompts: str = "kvpress"

    def prompt_scores(self, prompt: Prompt) -> dict[int, torch.Tensor]:
        """{layer: (1, kv_heads, n)} float32: KVgrad scores of the context, +inf on the sinks, 0 where never scored."""
        ids, n, model = prompt.ids, prompt.n_tokens, prompt.model
        layout = self.layout(prompt.tokenizer, ids)
        modules = attention_modules(model)
        scores = {i: torch.zeros(1, layer.keys.shape[1], n, device=ids.device)
                  for i, layer in enumerate(prompt.cache.layers) if not getattr(layer, "is_sliding", False)}
        for start, end, feed in reconstruction_feeds(prompt.tokenizer, ids[:, layout.start:], layout.suffix,
                                                     self.chunk_size, REPEAT_NEXT_BY[self.repeat_prompts]):
            chunk = slice(layout.start + start, layout.start + end)
            calls, gradients = _feed_with_gradients(model, prompt.cache, feed, n)
            with torch.no_grad():
                for layer, (query, key, settings) in calls.items():
                    if layer not in scores:
                        continue
                    values = prompt.cache.layers[layer].values[0, :, chunk]
                    contribution, _ = value_norms(values, modules[layer].o_proj.weight, query.shape[0])
                    attention = restricted_attention(query, key, layout.sinks, chunk, settings)
                    scores[layer][0, :, chunk] = kvgrad_scores(attention, gradients[layer], contribution, key.shape[0])
        for layer_scores in scores.values():
            layer_scores[..., :layout.protected] = math.inf
        return scores


def _feed_with_gradients(model, cache, feed: torch.Tensor, n: int) -> tuple[dict, dict]:
    """Run feed (1, m) at positions n.. over a copy of `cache` and backpropagate Phi = sum ||h^L||^2 (the last decoder
    layer's output): ({layer: (query (heads, m, d), key (kv_heads, n + m, d), settings)}, {layer: (m,) the gradient
    norm at the layer's attention output}), every tensor detached. The model's weights get no gradient."""
    decoder = model.get_decoder()
    calls, outputs, last = {}, {}, {}

    def record(module, query, key, value, attention_mask, **kwargs):
        calls[module.layer_idx] = (query[0].detach(), key[0].detach(), AttentionSettings.of_call(module, kwargs))

    def keep_output(module, args, output):
        output[0].retain_grad()
        outputs[module.layer_idx] = output[0]

    def keep_last(module, args, output):
        last["hidden"] = output[0] if isinstance(output, tuple) else output

    hooks = [module.register_forward_hook(keep_output) for module in attention_modules(model).values()]
    hooks.append(decoder.layers[-1].register_forward_hook(keep_last))
    parameters = [p for p in model.parameters() if p.requires_grad]
    try:
        with torch.inference_mode(False), torch.enable_grad():
            for p in parameters:  # gradients of the activations only
                p.requires_grad_(False)
            copied = copy.copy(cache)
            copied.layers = [copy.copy(layer) for layer in cache.layers]
            for layer in copied.layers:  # normal tensors: inference tensors cannot be saved for backward
                layer.keys, layer.values = layer.keys.clone(), layer.values.clone()
            embedded = model.get_input_embeddings()(feed.clone()).detach().requires_grad_()
            positions = torch.arange(n, n + feed.shape[1], device=feed.device)[None]
            with intercept_attention(model, record):
                decoder(inputs_embeds=embedded, **with_cache(decoder, copied), position_ids=positions, use_cache=True)
            last["hidden"].float().square().sum().backward()
    finally:
        for p in parameters:
            p.requires_grad_(True)
        for hook in hooks:
            hook.remove()
    return calls, {layer: output.grad[0].float().norm(dim=-1) for layer, output in outputs.items()}
