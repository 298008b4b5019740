"""A cheaper estimate of span effects: input x gradient attribution over the cache, as KVgrad scores KV pairs.

    gradients = gradient_effects(probe, spans)      # one backward pass instead of one forward per span
    scipy.stats.spearmanr(gradients.attribution, effects.kl)

KVgrad (kvpress 0.5.5 kvgrad_press.py, KVgradPress docstring; openreview cg1wTCJjjk; the policy
snapkv_lab.policies.kvgrad, whose kvgrad_scores combines the three factors here too) scores KV pair c of layer l by

    S_{l,c} = max_p  A^l_{p,c} * ||v^l_c W_O^l|| * ||grad_{a^l_p} Phi||

over probe tokens p: A the probe's attention to c, ||v W_O|| what c's value adds to the residual stream through the
head's slice of the output projection, and the gradient of the objective with respect to the layer's attention output
at p; the maximum runs over the probes and the query heads of each KV head. KVgrad probes with a reconstruction of the
context and takes Phi = sum_p ||h^L_p||^2; here the probes are the tokens teacher-forced after the prefill (the
question and the answer, as span_effects feeds them) and Phi = log p(answer | cache), the quantity whose change
span_effects measures. A span's attribution is the sum of S over its positions, every full-attention layer and KV head
(sliding layers, which no policy compresses, are left out). It is first-order: it can miss effects that only a whole
span's removal shows, which comparing it with span_effects measures.
"""

from __future__ import annotations

import pandas as pd
import torch
import torch.nn.functional as F

from ..core.attention import AttentionSettings, attention_probs
from ..core.capture import value_norms
from ..core.hooks import attention_modules, intercept_attention, with_cache
from ..policies.kvgrad import kvgrad_scores
from .span_effects import EvictionProbe, _batched, _checked_spans


def position_attribution(probe: EvictionProbe) -> torch.Tensor:
    """(n,) float32: each context position's KVgrad score summed over full-attention layers and KV heads (module doc),
    from one forward and one backward pass over the fed tokens."""
    model, n = probe.model, probe.n
    if probe.fed.shape[1] == 0:
        raise ValueError("the answer is one token after a prefilled question: no fed token probes the cache")
    modules = attention_modules(model)
    calls, outputs = {}, {}

    def record(module, query, key, value, attention_mask, **kwargs):
        settings = AttentionSettings.of_call(module, kwargs)
        if settings.sliding_window is None:
            calls[module.layer_idx] = (query[0].detach(), key[0].detach(), settings)

    def keep_output(module, args, output):
        output[0].retain_grad()
        outputs[module.layer_idx] = output[0]

    hooks = [module.register_forward_hook(keep_output) for module in modules.values()]
    parameters = [p for p in model.parameters() if p.requires_grad]
    try:
        with torch.inference_mode(False), torch.enable_grad():
            for p in parameters:  # gradients of the activations only
                p.requires_grad_(False)
            cache = _batched(probe.cache, 1)
            for layer in cache.layers:  # normal tensors: inference tensors cannot be saved for backward
                layer.keys, layer.values = layer.keys.clone(), layer.values.clone()
            embedded = model.get_input_embeddings()(probe.fed.clone()).detach().requires_grad_()
            positions = torch.arange(probe.start, probe.start + probe.fed.shape[1], device=model.device)[None]
            with intercept_attention(model, record):
                logits = model(inputs_embeds=embedded, **with_cache(model, cache), position_ids=positions,
                               use_cache=True).logits
            logprobs = F.log_softmax(logits.float(), -1)[0]
            answer = (probe.answer[0] if probe.first is None else probe.answer[0, 1:]).clone()  # first: the prefill's
            objective = logprobs[-len(answer):].gather(-1, answer[:, None]).sum()
            objective.backward()
    finally:
        for p in parameters:
            p.requires_grad_(True)
        for hook in hooks:
            hook.remove()
    scores = torch.zeros(n)
    with torch.no_grad():
        for layer, (query, key, settings) in calls.items():
            rows = torch.arange(probe.start, probe.start + query.shape[1])  # the fed tokens' positions
            heads, kv = query.shape[0], key.shape[0]
            attention = attention_probs(query.float(), key.float(), settings.scaling, rows,
                                        kv_index=torch.arange(heads) // (heads // kv), key_index=torch.arange(n),
                                        softcap=settings.softcap)  # (heads, probes, n)
            values = probe.cache.layers[layer].values[0, :, :n]
            contribution, _ = value_norms(values, modules[layer].o_proj.weight.detach(), heads)  # (heads, n)
            gradient = outputs[layer].grad[0].float().norm(dim=-1)  # (probes,)
            scores += kvgrad_scores(attention, gradient, contribution, kv).sum(0).cpu()
    return scores


def gradient_effects(probe: EvictionProbe, spans) -> pd.DataFrame:
    """One row per span: start, end, attribution (the sum of its positions' KVgrad scores: position_attribution)."""
    spans = _checked_spans(spans, probe.n)
    scores = position_attribution(probe)
    return pd.DataFrame([dict(start=s, end=e, attribution=float(scores[s:e].sum())) for s, e in spans])
