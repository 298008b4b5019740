"""KV bytes held after prefill, full cache vs a 25% budget, on the bundled models: what a budget saves of the whole
cache when only some layers grow with the context (Gemma 3: 3 global layers; its 15 sliding-window layers keep at
most their last 511 positions whatever the prompt, and the compressor leaves them to that bounded cache).

    python benchmarks/kv_bytes.py                                   # SmolLM2 2k-8k, Gemma 3 2k-16k, measured
    python benchmarks/kv_bytes.py --lengths 2000 4000 --models gemma-3-270m

Measured: `snapkv_lab.generate(..., max_new_tokens=1).kv_bytes` (every key and value tensor the cache holds after
prefill), full cache and SnapKV at capacity = 25% of the prompt, on real text. Beside each, the count from the
config alone (2 x kv_heads x head_dim x 4 bytes per held position and layer; a sliding layer holds
min(n, window - 1)), which must equal the measurement, and extends the table to 32k without a 32k prefill. "sliding
compressed too" is that count if the sliding layers were also cut to 25% of what they hold (not what snapkv_lab
does: a sliding layer already holds a fixed 511 positions, and cutting it changes the model's local attention).
"""

from __future__ import annotations

import argparse

import pandas as pd
import torch
from _common import Subject, report

import snapkv_lab
from snapkv_lab.core.models import sliding_layers

LENGTHS = {"SmolLM2-135M-Instruct": (2000, 4000, 8000), "gemma-3-270m": (2000, 4000, 8000, 16000)}
COUNTED = (2000, 4000, 8000, 16000, 32000)
BUDGET = 0.25


def counted_bytes(config, n: int, capacity: int | None, cut_sliding: bool = False) -> int:
    """Bytes of keys and values held after an n-token prefill, from the config alone: capacity positions per
    global layer (None: all n), min(n, window - 1) per sliding layer (a quarter of that with cut_sliding)."""
    config = config.get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_position = 2 * config.num_key_value_heads * head_dim * 4  # keys and values, fp32
    sliding = set(sliding_layers(config))
    total = 0
    for layer in range(config.num_hidden_layers):
        if layer in sliding:
            held = min(n, config.sliding_window - 1)
            held = int(held * BUDGET) if cut_sliding else held
        else:
            held = n if capacity is None else min(n, capacity)
        total += held * per_position
    return total


def measured_bytes(subject: Subject, n: int, capacity: int | None) -> int:
    policy = None if capacity is None else snapkv_lab.SnapKV(capacity=capacity)
    return snapkv_lab.generate(subject.model, subject.tokenizer, subject.prompt(n), policy=policy,
                               max_new_tokens=1).kv_bytes


def rows_for(name: str, lengths, measure: bool) -> list[dict]:
    model, tokenizer = snapkv_lab.load_model(name, device="cpu", dtype="float32")
    subject = Subject(model, tokenizer, shape=name)  # a bundled model: its prompts are BOS and the essays
    rows = []
    for n in sorted(set(lengths) | set(COUNTED)):
        if n > model.config.max_position_embeddings:
            continue
        capacity = int(BUDGET * n)
        full, kept = counted_bytes(model.config, n, None), counted_bytes(model.config, n, capacity)
        row = dict(model=name, tokens=n, full_MiB=full / 2**20, budget_25_MiB=kept / 2**20, saved=1 - kept / full,
                   sliding_compressed_too_MiB=counted_bytes(model.config, n, capacity, cut_sliding=True) / 2**20,
                   measured=False)
        if measure and n in lengths:
            measured = (measured_bytes(subject, n, None), measured_bytes(subject, n, capacity))
            if measured != (full, kept):  # the count must describe the real cache, or the table is wrong
                raise AssertionError(f"{name} at {n}: measured {measured} bytes, counted {(full, kept)}")
            row["measured"] = True
        rows.append(row)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(LENGTHS))
    parser.add_argument("--lengths", type=int, nargs="+", default=None,
                        help="prompt lengths measured (default per model)")
    parser.add_argument("--count-only", action="store_true", help="no prefill: the config's count alone")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    table = pd.DataFrame([row for name in args.models
                          for row in rows_for(name, args.lengths or LENGTHS.get(name, (2000,)), not args.count_only)])
    formats = {column: ".1f" for column in ("full_MiB", "budget_25_MiB", "sliding_compressed_too_MiB")}
    report(table, "kv_bytes", "KV bytes after prefill: full cache vs SnapKV at 25% of the prompt",
           {**formats, "saved": ".0%"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
