"""Decode ms/token and KV bytes of pruned and quantized caches (ThinK, KIVI) against the full cache, on a CPU.

    python benchmarks/bench_quantized_decode.py                       # SmolLM2, 1000 and 4000 tokens, 32 new
    python benchmarks/bench_quantized_decode.py --lengths 2000 --new 16 --threads 2

Each policy's cache is stored as it says (compression.packed.PackedLayer) and rebuilt dense at every attention call:
dequantizing and scattering channels back costs time at each step, and nothing here is a fused kernel (KIVI's CUDA
gemv multiplies the codes directly). So on a CPU the stored cache is smaller and the decode step is slower: the table
says by how much. kv_bytes: what the cache holds right after the prefill (codes, scales, zero points, kept channels,
full-precision tails); the prompt is random token ids (the timing does not depend on the text). Rows are run
alternately per repeat, and the median step time is reported.
"""

from __future__ import annotations

import argparse
import statistics

import pandas as pd
import torch
from _common import report

import snapkv_lab
from snapkv_lab.policies import parse_policy

POLICIES = ("FullCache()", "ThinK()", "KIVI()", "KIVI(key_bits=4, value_bits=4)", "SnapKV(capacity=0.25)",
            "KIVI(policy=ThinK(capacity=0.25), capacity=0.25, key_bits=None, value_bits=4)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1000, 4000])
    parser.add_argument("--new", type=int, default=32, help="tokens decoded per run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = snapkv_lab.load_model()
    rows = []
    for n in args.lengths:
        ids = torch.randint(100, 40000, (1, n), generator=torch.Generator().manual_seed(n))
        steps = {p: [] for p in POLICIES}
        kv_bytes = {}
        for _ in range(args.repeats):
            for text in POLICIES:
                policy = parse_policy(text)
                run = snapkv_lab.generate(model, tokenizer, ids, policy=policy, max_new_tokens=args.new)
                steps[text].append(run.decode_ms_per_token)
                kv_bytes[text] = run.kv_bytes
        full_ms, full_bytes = statistics.median(steps["FullCache()"]), kv_bytes["FullCache()"]
        for text in POLICIES:
            ms = statistics.median(steps[text])
            rows.append(dict(prompt_tokens=n, policy=text, kv_mib=kv_bytes[text] / 2**20,
                             kv_share=kv_bytes[text] / full_bytes, decode_ms_per_token=ms, vs_full=ms / full_ms))
        report(pd.DataFrame(rows), "quantized_decode_smollm2_fp32_cpu",
               f"Decode ms/token and KV bytes, SmolLM2-135M fp32, CPU {args.threads} threads, {args.new} new tokens, "
               f"median of {args.repeats}",  # after each length: a long run leaves the lengths done
               formats=dict(kv_mib=".2f", kv_share=".3f", decode_ms_per_token=".1f", vs_full=".2f"))


if __name__ == "__main__":
    main()
