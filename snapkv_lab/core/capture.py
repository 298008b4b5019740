"""capture(): run a model on a prompt (greedy generation or a teacher-forced continuation) and record the
post-RoPE queries and keys of every layer at the attention call itself, whatever backend computes it.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from .attention import AttentionSettings
from .hooks import attention_modules, intercept_attention, with_cache
from .inputs import check_context_length, encode_continuation, encode_prompt, eos_ids
from .progress import progress_bar
from .trace import AttentionTrace


class _QKRecorder:
    """Collects, per layer, the queries and the new keys (and values, when asked) of each attention call (batch of
    one)."""

    def __init__(self, layers: set[int] | None, store_device: str | None, values: bool = False):
        self.layers = layers
        self.store_device = store_device
        self.queries: dict[int, list[torch.Tensor]] = {}
        self.keys: dict[int, list[torch.Tensor]] = {}
        self.values: dict[int, list[torch.Tensor]] | None = {} if values else None
        self.attention: dict[int, AttentionSettings] = {}

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        layer = module.layer_idx
        if self.layers is not None and layer not in self.layers:
            return
        settings = AttentionSettings.of_call(module, kwargs)
        if self.attention.setdefault(layer, settings) != settings:
            raise RuntimeError(f"layer {layer} changed its attention settings between calls: {self.attention[layer]} "
                               f"then {settings}")
        new = query.shape[2]
        seen = sum(q.shape[1] for q in self.queries.get(layer, []))
        # A sliding layer's cache returns only the window it still needs, so it may hold fewer keys.
        expected_max = seen + new
        expected_min = expected_max if settings.sliding_window is None else min(expected_max, settings.sliding_window)
        if not expected_min <= key.shape[2] <= expected_max:
            raise RuntimeError(
                f"layer {layer}: the cache holds {key.shape[2]} keys but {seen + new} tokens were fed; capture needs "
                "an uncompressed cache that starts empty."
            )
        # copy=True: a slice of `key` is a view that would pin the whole cache tensor of this step
        # (a new, longer one every decode step), making memory quadratic in tokens.
        device = self.store_device or query.device
        self.queries.setdefault(layer, []).append(query[0].to(device, copy=True))
        self.keys.setdefault(layer, []).append(key[0, :, -new:].to(device, copy=True))
        if self.values is not None:
            self.values.setdefault(layer, []).append(value[0, :, -new:].to(device, copy=True))

    def stacked(self):
        layers = sorted(self.queries)
        if not layers:
            raise RuntimeError(
                "no attention call was recorded: this model's attention layers do not dispatch through "
                "transformers' attention-function registry, so capture cannot see them."
            )
        queries, keys, values, attention = [], [], [], [self.attention[i] for i in layers]
        for i in layers:  # pop as we go, so the chunks and the stacked copy never coexist for all layers
            queries.append(torch.cat(self.queries.pop(i), dim=1))
            keys.append(torch.cat(self.keys.pop(i), dim=1))
            if self.values is not None:
                values.append(torch.cat(self.values.pop(i), dim=1))
        return layers, queries, keys, (values if self.values is not None else None), attention


def value_norms(values: torch.Tensor, output_weight: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """((heads, n) ||W_O^h v_t||, (heads,) ||W_O^h||_F) of one layer: values (kv_heads, n, head_dim), output_weight
    (hidden, heads * head_dim) the output projection's (query head h reads KV head h // (heads / kv_heads)).
    Through each head's Gram matrix (head_dim x head_dim): no (hidden x n) product is formed."""
    kv_heads, _, head_dim = values.shape
    slices = (output_weight.float().reshape(output_weight.shape[0], heads, head_dim)
              .transpose(0, 1))  # (heads, hidden, d)
    gram = slices.mT @ slices  # (heads, d, d)
    read = values.float().to(gram.device).repeat_interleave(heads // kv_heads, dim=0)  # (heads, n, d)
    squared = ((read @ gram) * read).sum(-1).clamp_min(0)
    return squared.sqrt(), slices.flatten(1).norm(dim=-1)


@torch.inference_mode()
def capture(
    model,
    tokenizer,
    prompt,
    *,
    max_new_tokens: int = 64,
    continuation=None,
    layers=None,
    stop_at_eos: bool = True,
    store_device: str | None = "cpu",
    values: bool = False,
    progress: bool = True,
) -> AttentionTrace:
    """Run `model` on `prompt` and return an AttentionTrace of every token's queries and keys.

    prompt: text, chat messages ([{"role": ..., "content": ...}]) or token ids (see encode_prompt).
    continuation: None to generate greedily up to max_new_tokens (stopping at EOS if stop_at_eos), or a
        text / token ids to teacher-force instead (the paper's observation code fed reference replies).
    layers: model layer indices to record (default all).
    store_device: where recorded tensors go ("cpu" keeps GPU memory free; None keeps them on the model's device).
    values: also record every layer's values, with each head's ||W_O^h v|| per token and ||W_O^h|| (value-aware
        importance: trace.value_attention); memory grows by the keys' size again, still linear in tokens.
    Every generated token is fed back once, so it has a query row too: trace.n_tokens = prompt + generated.
    """
    device = model.device
    input_ids = encode_prompt(tokenizer, prompt).to(device)
    prompt_len = input_ids.shape[1]
    forced = None if continuation is None else encode_continuation(tokenizer, continuation).to(device)
    check_context_length(model, prompt_len + (max_new_tokens if forced is None else len(forced)),
                         "the prompt and its continuation")
    modules = attention_modules(model) if values else {}
    if values and not modules:  # attention_modules finds the layers by their `o_proj`: GPT-2's is c_proj
        raise NotImplementedError("capture(values=True) reads each layer's output projection `o_proj`, which this "
                                  "model's attention layers do not name so")
    recorder = _QKRecorder(None if layers is None else set(layers), store_device, values)
    cache = DynamicCache(config=model.config)

    def forward(ids):
        # logits_to_keep=1: a full-vocabulary logit matrix for a long prompt would cost more than the trace.
        return model(input_ids=ids, **with_cache(model, cache), use_cache=True, logits_to_keep=1).logits[:, -1]

    # The prefill (one forward over the whole prompt) is the long part of a long prompt: count its layers.
    prefill_bar = progress_bar(total=model.config.num_hidden_layers, desc="prefill (layers)", disable=not progress,
                               leave=False)

    def record(module, *args, **kwargs):
        recorder(module, *args, **kwargs)
        if prefill_bar.n < prefill_bar.total:
            prefill_bar.update()

    with intercept_attention(model, record):
        if forced is not None:
            generated = forced.tolist()
            forward(torch.cat([input_ids, forced[None]], dim=1))
            mode = "teacher-forced"
        else:
            generated = []
            eos = eos_ids(model, tokenizer) if stop_at_eos else ()
            logits = forward(input_ids)
            prefill_bar.close()
            for _ in progress_bar(range(max_new_tokens), desc="capture", disable=not progress, leave=False):
                token = int(logits.argmax(-1))
                generated.append(token)
                logits = forward(torch.tensor([[token]], device=device))
                if token in eos:
                    break
            mode = "generated"
    prefill_bar.close()

    layer_ids, queries, keys, stored_values, attention = recorder.stacked()
    norms = None if stored_values is None else [
        value_norms(v, modules[layer].o_proj.weight.detach(), q.shape[0])
        for layer, v, q in zip(layer_ids, stored_values, queries, strict=True)]
    token_ids = torch.cat([input_ids[0].cpu(), torch.tensor(generated, dtype=torch.long)])
    return AttentionTrace(
        token_ids=token_ids,
        tokens=[tokenizer.decode([t]) for t in token_ids.tolist()],
        prompt_len=prompt_len,
        queries=queries,
        keys=keys,
        attention_settings=attention,
        layers=layer_ids,
        meta=dict(
            model=model.config.name_or_path,
            attn_implementation=model.config._attn_implementation,
            dtype=str(queries[0].dtype).replace("torch.", ""),
            mode=mode,
            n_model_layers=model.config.num_hidden_layers,
        ),
        values=stored_values,
        value_norms=None if norms is None else [n.to(queries[0].device) for n, _ in norms],
        output_norms=None if norms is None else [o.to(queries[0].device) for _, o in norms],
    )
