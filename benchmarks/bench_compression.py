"""KV-cache bytes, prefill time and decode speed: full cache vs SnapKV.

    python benchmarks/bench_compression.py                         # 2k, 4k, 8k prompts, SnapKV at 1024
    python benchmarks/bench_compression.py --lengths 1024 --new-tokens 8 --repeats 1
    python benchmarks/bench_compression.py --device cuda --dtype bf16 --shape llama3-8b --attn flash_attention_2 \
        --lengths 8192 16384 32768

Defaults: the bundled SmolLM2 on Paul Graham's essays, sdpa, fp32 on CPU, greedy; a random model gets random
token ids. Each (length, policy) runs `--repeats` times, alternating full and SnapKV, and reports the median.
"selection" is the time spent inside the compressor (scoring, top-k, gathering), the direct measure of its
prefill overhead; the prefill-time ratio also carries run-to-run noise. Decode ms/token averages the steps
after the first token. These three times are the ones `snapkv_lab.generate` measures: right on a GPU only if it
synchronises (snapkv_lab.core.timing) before reading its clock. On CUDA each (length, policy) first runs once untimed:
sdpa's cuDNN backend builds a plan for every new (query, key) length it meets, which made a cold decode step of an
8B model 2-3x slower than a warm one, and 60x for PyramidKV, whose layers hold different lengths (docs/performance.md).
On CUDA, `peak_gpu_mib` is the most memory torch allocated during a run (the largest of the repeats); a run that runs
out of memory is reported in `status`. Other processes on the machine inflate (and add noise to) every timing.
"""

from __future__ import annotations

import argparse
import statistics

import pandas as pd
import torch
from _common import (
    PeakMemory,
    add_model_options,
    attempt,
    describe,
    load_subject,
    parse_model_options,
    report,
    result_name,
)
from tqdm.auto import tqdm

from snapkv_lab import FullCache, SnapKV, generate


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summary(length: int, name: str, runs: list, status: str, on_gpu: bool) -> dict:
    """One table row from the (result, peak MiB) pairs of the repeats that completed (none after a failure)."""
    results = [result for result, _ in runs]
    first = results[0] if results else None
    row = dict(prompt_tokens=length, cache=name, kv_mib=first.kv_bytes / 2**20 if first else float("nan"),
               cache_length=first.cache_lengths[0] if first else float("nan"),
               prefill_s=_median([r.prefill_seconds for r in results]),
               selection_s=_median([r.selection_seconds for r in results]),
               decode_ms_per_token=_median([r.decode_ms_per_token for r in results]))
    if on_gpu:
        row["peak_gpu_mib"] = max((peak for _, peak in runs), default=float("nan"))
    return dict(row, status=status)


def run(subject, device, lengths, capacity: int, new_tokens: int, repeats: int) -> pd.DataFrame:
    model, tokenizer = subject.model, subject.tokenizer
    policies = {"full": FullCache(), f"SnapKV@{capacity}": SnapKV(capacity=capacity)}
    generate(model, tokenizer, subject.prompt(256), max_new_tokens=4)  # warm-up
    rows = []
    with tqdm(total=len(lengths) * len(policies) * repeats, desc="bench") as bar:
        for length in lengths:
            ids = subject.prompt(length)
            runs = {name: [] for name in policies}
            status = dict.fromkeys(policies, "ok")
            if torch.device(device).type == "cuda":
                for policy in policies.values():  # untimed: the shapes' kernel plans (see the module docstring)
                    attempt(lambda: generate(model, tokenizer, ids, policy=policy, max_new_tokens=new_tokens), device)
            for _ in range(repeats):
                for name, policy in policies.items():
                    if status[name] == "ok":  # a run that ran out of memory would again
                        with PeakMemory(device) as memory:
                            result, status[name] = attempt(
                                lambda: generate(model, tokenizer, ids, policy=policy, max_new_tokens=new_tokens),
                                device)
                        if result is not None:
                            runs[name].append((result, memory.peak_mb))
                    bar.update()
            on_gpu = torch.device(device).type == "cuda"
            rows += [summary(length, name, runs[name], status[name], on_gpu) for name in policies]
    table = pd.DataFrame(rows)
    full = table[table.cache == "full"].set_index("prompt_tokens")
    table["kv_shrink"] = table.prompt_tokens.map(full.kv_mib) / table.kv_mib
    table["prefill_overhead_%"] = 100 * (table.prefill_s / table.prompt_tokens.map(full.prefill_s) - 1)
    table["decode_speedup"] = table.prompt_tokens.map(full.decode_ms_per_token) / table.decode_ms_per_token
    table["status"] = table.pop("status")  # last
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8128],
                        help="prompt tokens (8128 + 64 new tokens stays within SmolLM2's 8192 positions)")
    parser.add_argument("--capacity", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    add_model_options(parser)
    args = parse_model_options(parser)
    table = run(load_subject(args), args.device, args.lengths, args.capacity, args.new_tokens, args.repeats)
    report(table, result_name("compression", args), formats={"cache_length": ".0f"},
           title=f"{args.new_tokens} new tokens, median of {args.repeats} runs, {describe(args)}, {args.attn}")


if __name__ == "__main__":
    main()
