"""Tiny random models of many transformers families, one line per family or variant (kvpress-style).

Every model shares the sizes in TINY (3 layers, hidden 64, 4 query heads of 16 dims, byte vocabulary), a
large initializer_range for peaked attention, and token ids that fit the byte tokenizer (EOS = 0). GQA
variants share 2 KV heads per 4 query heads; sliding variants have a window of SLIDING_WINDOW tokens,
so the tests' prompts (64 tokens) exceed it. No download: weights are random, seeded.
"""

from __future__ import annotations

import torch
from transformers import (
    AutoModelForCausalLM,
    CohereConfig,
    Gemma2Config,
    Gemma3TextConfig,
    GemmaConfig,
    GPT2Config,
    GPTNeoXConfig,
    GraniteConfig,
    LlamaConfig,
    MistralConfig,
    Olmo2Config,
    Phi3Config,
    PhiConfig,
    Qwen2Config,
    Qwen3Config,
    StableLmConfig,
)

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            max_position_embeddings=256, initializer_range=0.3, eos_token_id=0, bos_token_id=1, pad_token_id=0)
MHA, GQA, MQA = dict(num_key_value_heads=4), dict(num_key_value_heads=2), dict(num_key_value_heads=1)
SLIDING_WINDOW = 16
SLIDING, FULL = "sliding_attention", "full_attention"
HEAD_DIM = dict(head_dim=16)  # families whose default head_dim is not hidden / heads
# Gemma 2 and 3 scale by query_pre_attn_scalar ** -0.5: a value unlike head_dim shows a wrong scaling.
GEMMA_SCALE = dict(**HEAD_DIM, query_pre_attn_scalar=32)


def make(config_class, attn: str = "sdpa", seed: int = 0, **overrides):
    """A random model of `config_class` with the TINY sizes, `overrides` on top, in eval mode."""
    torch.manual_seed(seed)
    config = config_class(**{**TINY, **overrides})
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()


FAMILIES = {
    "llama-mha": lambda: make(LlamaConfig, **MHA),
    "llama-gqa": lambda: make(LlamaConfig, **GQA),
    "mistral-gqa": lambda: make(MistralConfig, sliding_window=None, **GQA),  # its default window is 4096
    "mistral-sliding": lambda: make(MistralConfig, sliding_window=SLIDING_WINDOW, **GQA),
    "qwen2-mha": lambda: make(Qwen2Config, **MHA),
    "qwen2-gqa": lambda: make(Qwen2Config, **GQA),
    # Qwen2's own rule: layers from max_window_layers on slide (here 1 and 2).
    "qwen2-sliding": lambda: make(Qwen2Config, use_sliding_window=True, sliding_window=SLIDING_WINDOW,
                                  max_window_layers=1, **GQA),
    "qwen2-layer-types": lambda: make(Qwen2Config, use_sliding_window=True, sliding_window=SLIDING_WINDOW,
                                      layer_types=[SLIDING, FULL, SLIDING], **GQA),
    "qwen3-mha": lambda: make(Qwen3Config, **HEAD_DIM, **MHA),
    "qwen3-gqa": lambda: make(Qwen3Config, **HEAD_DIM, **GQA),
    "phi3-mha": lambda: make(Phi3Config, **MHA),
    "phi3-gqa": lambda: make(Phi3Config, **GQA),
    "phi3-sliding": lambda: make(Phi3Config, sliding_window=SLIDING_WINDOW, **GQA),
    "gemma-mha": lambda: make(GemmaConfig, **HEAD_DIM, **MHA),
    "gemma-mqa": lambda: make(GemmaConfig, **HEAD_DIM, **MQA),
    # Gemma 2 has no sdpa path in transformers 5.23 (from_config refuses it): eager. Its default layers
    # alternate sliding and full; a cap of 5 (default 50) bends the tiny model's logits measurably.
    "gemma2-softcap": lambda: make(Gemma2Config, attn="eager", sliding_window=SLIDING_WINDOW,
                                   attn_logit_softcapping=5.0, **GEMMA_SCALE, **GQA),
    "gemma3-sliding": lambda: make(Gemma3TextConfig, sliding_window=SLIDING_WINDOW,
                                   layer_types=[SLIDING, FULL, SLIDING],
                                   **GEMMA_SCALE, **GQA),
    "olmo2-mha": lambda: make(Olmo2Config, **MHA),
    "olmo2-gqa": lambda: make(Olmo2Config, **GQA),
    "gpt-neox": lambda: make(GPTNeoXConfig),
    # Granite scales attention by attention_multiplier instead of head_dim ** -0.5.
    "granite-gqa": lambda: make(GraniteConfig, attention_multiplier=0.09, **GQA),
    "stablelm-gqa": lambda: make(StableLmConfig, **GQA),  # partial rotary embedding
    "cohere-gqa": lambda: make(CohereConfig, **GQA),
    "phi-mha": lambda: make(PhiConfig, **MHA),
    "gpt2": lambda: make(GPT2Config),
    # Attention scores scaled by 1 / (layer + 1) as well (GPT-2 option; e.g. Stanford CRFM's Mistral GPT-2s).
    "gpt2-layer-scaled": lambda: make(GPT2Config, scale_attn_by_inverse_layer_idx=True),
}


def sliding_layers(config) -> set[int]:
    """Indices of the sliding-window layers: from config.layer_types where the family has them, else
    every layer when config.sliding_window is set (Mistral, Phi-3)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return {i for i, kind in enumerate(layer_types) if kind == SLIDING}
    if getattr(config, "sliding_window", None) is not None:
        return set(range(config.num_hidden_layers))
    return set()
