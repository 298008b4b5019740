"""Throughput of padded batches vs one prompt at a time: the full cache and SnapKV at 25%.

    python benchmarks/bench_batches.py  # batch 1, 2, 4, 8 of 8 prompts, 1024-2048 tokens
    python benchmarks/bench_batches.py --prompts 2 --batches 1 2 --min-tokens 256 --max-tokens 512 --new-tokens 4

The same `--prompts` prompts (lengths spread evenly over [--min-tokens, --max-tokens], so every batch is padded)
run in batches of each size; batch 1 is one prompt at a time. Each row of a batch is compressed and decoded as its
batch-1 run (tests/test_batches.py), so only the speed differs. prefill tok/s: the prompts' own tokens (pads not
counted) over the prefill seconds (scoring included); decode tok/s: the tokens the rows decode (a batch decodes
every row until the last is done) over the decode seconds; "vs batch 1": the ratio to batch 1's. Defaults: the
bundled SmolLM2 on Paul Graham's essays, sdpa, fp32 on CPU, greedy. Other processes on the machine inflate every
timing.
"""

from __future__ import annotations

import argparse

import pandas as pd
import torch
from _common import add_model_options, describe, load_subject, parse_model_options, report, result_name
from tqdm.auto import tqdm

from snapkv_lab import FullCache, SnapKV, generate


def lengths_of(count: int, low: int, high: int) -> list[int]:
    """`count` prompt lengths spread evenly over [low, high], longest first (so each batch's rows differ)."""
    if count == 1:
        return [high]
    return [high - round(i * (high - low) / (count - 1)) for i in range(count)]


def run(subject, lengths: list[int], batches: list[int], new_tokens: int, capacity: float) -> pd.DataFrame:
    prompts = [subject.prompt(n)[0] for n in lengths]
    policies = {"full": FullCache(), f"SnapKV@{capacity}": SnapKV(capacity=capacity)}
    rows = []
    bar = tqdm(total=len(policies) * sum(-(-len(prompts) // b) for b in batches), desc="batches")
    for name, policy in policies.items():
        for size in batches:
            prefill_s = decode_s = 0.0
            decoded = 0
            for start in range(0, len(prompts), size):
                group = [p.tolist() for p in prompts[start:start + size]]
                result = generate(subject.model, subject.tokenizer, group if len(group) > 1 else group[0],
                                  policy=policy, max_new_tokens=new_tokens)
                steps = result.token_ids.shape[1] - 1  # the first token comes from the prefill
                prefill_s += result.prefill_seconds
                if steps:
                    decode_s += result.decode_ms_per_token * steps / 1000
                    decoded += steps * len(group)
                bar.update()
            rows.append(dict(cache=name, batch=size, prompts=len(prompts), prompt_tokens=sum(lengths),
                             prefill_s=prefill_s, prefill_tok_s=sum(lengths) / prefill_s,
                             decode_tok_s=decoded / decode_s if decode_s else float("nan")))
    bar.close()
    table = pd.DataFrame(rows)
    single = table[table.batch == 1].set_index("cache")
    table["prefill_vs_batch1"] = table.prefill_tok_s / table.cache.map(single.prefill_tok_s)
    table["decode_vs_batch1"] = table.decode_tok_s / table.cache.map(single.decode_tok_s)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8, help="prompts in all (each batch size runs all of them)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--min-tokens", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--capacity", type=float, default=0.25, help="SnapKV's capacity ratio")
    add_model_options(parser)
    args = parse_model_options(parser)
    if 1 not in args.batches:
        parser.error("--batches must include 1 (the reference)")
    subject = load_subject(args)
    with torch.inference_mode():
        table = run(subject, lengths_of(args.prompts, args.min_tokens, args.max_tokens), args.batches,
                    args.new_tokens, args.capacity)
    report(table, result_name("batches", args),
           title=f"{args.prompts} prompts of {args.min_tokens}-{args.max_tokens} tokens, {args.new_tokens} new tokens, "
                 f"{describe(args)}, {args.attn}",
           formats={"prefill_s": ".1f", "prefill_tok_s": ".0f", "decode_tok_s": ".1f", "prefill_vs_batch1": ".2f",
                    "decode_vs_batch1": ".2f"})


if __name__ == "__main__":
    main()
