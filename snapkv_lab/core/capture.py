"""capture(): run a model on a prompt (greedy generation or a teacher-forced continuation) and record the
post-RoPE queries and keys of every layer at the attention call itself, whatever backend computes it.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from .attention import AttentionSettings
from .hooks import intercept_attention, with_cache
from .inputs import check_context_length, encode_continuation, encode_prompt, eos_ids
from .progress import progress_bar
from .trace import AttentionTrace


class _QKRecorder:
    """Collects, per layer, the queries and the new keys of each attention call (batch of one)."""

    def __init__(self, layers: set[int] | None, store_device: str | None):
        self.layers = layers
        self.store_device = store_device
        self.queries: dict[int, list[torch.Tensor]] = {}
        self.keys: dict[int, list[torch.Tensor]] = {}
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

    def stacked(self):
        layers = sorted(self.queries)
        if not layers:
            raise RuntimeError(
                "no attention call was recorded: this model's attention layers do not dispatch through "
                "transformers' attention-function registry, so capture cannot see them."
            )
        queries, keys, attention = [], [], [self.attention[i] for i in layers]
        for i in layers:  # pop as we go, so the chunks and the stacked copy never coexist for all layers
            queries.append(torch.cat(self.queries.pop(i), dim=1))
            keys.append(torch.cat(self.keys.pop(i), dim=1))
        return layers, queries, keys, attention


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
    progress: bool = True,
) -> AttentionTrace:
    """Run `model` on `prompt` and return an AttentionTrace of every token's queries and keys.

    prompt: text, chat messages ([{"role": ..., "content": ...}]) or token ids (see encode_prompt).
    continuation: None to generate greedily up to max_new_tokens (stopping at EOS if stop_at_eos), or a
        text / token ids to teacher-force instead (the paper's observation code fed reference replies).
    layers: model layer indices to record (default all).
    store_device: where recorded tensors go ("cpu" keeps GPU memory free; None keeps them on the model's device).
    Every generated token is fed back once, so it has a query row too: trace.n_tokens = prompt + generated.
    """
    device = model.device
    input_ids = encode_prompt(tokenizer, prompt).to(device)
    prompt_len = input_ids.shape[1]
    forced = None if continuation is None else encode_continuation(tokenizer, continuation).to(device)
    check_context_length(model, prompt_len + (max_new_tokens if forced is None else len(forced)),
                         "the prompt and its continuation")
    recorder = _QKRecorder(None if layers is None else set(layers), store_device)
    cache = DynamicCache(config=model.config)

    def forward(ids):
        # logits_to_keep=1: a full-vocabulary logit matrix for a long prompt would cost more than the trace.
        return model(input_ids=ids, **with_cache(model, cache), use_cache=True, logits_to_keep=1).logits[:, -1]

    # The prefill (one forward over the whole prompt) is the long part of a long prompt: count its layers.
    prefill_bar = progress_bar(total=model.config.num_hidden_layers, desc="prefill (layers)", disable=not progress, leave=False)

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

    layer_ids, queries, keys, attention = recorder.stacked()
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
    )
