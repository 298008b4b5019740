"""KV-cache bytes, prefill time and decode speed: full cache vs SnapKV, on real text.

    python benchmarks/bench_compression.py                         # 2k, 4k, 8k prompts, SnapKV at 1024
    python benchmarks/bench_compression.py --lengths 1024 --new-tokens 8 --repeats 1

Prompts are Paul Graham's essays (bundled SmolLM2, sdpa, fp32, greedy). Each (length, policy) runs
`--repeats` times, alternating full and SnapKV, and reports the median. "selection" is the time spent
inside the compressor (scoring, top-k, gathering), the direct measure of its prefill overhead; the
prefill-time ratio also carries run-to-run noise. Decode ms/token averages the steps after the first
token. Other processes on the machine inflate (and add noise to) every timing.
"""

from __future__ import annotations

import argparse
import statistics

import pandas as pd
import torch
from tqdm.auto import tqdm

from snapkv_lab import FullCache, SnapKV, generate, load_model
from snapkv_lab.corpus import haystack_ids


def run(lengths, capacity: int, new_tokens: int, repeats: int, threads: int) -> pd.DataFrame:
    torch.set_num_threads(threads)
    model, tokenizer = load_model()
    policies = {"full": FullCache(), f"SnapKV@{capacity}": SnapKV(capacity=capacity)}
    generate(model, tokenizer, torch.tensor([haystack_ids(tokenizer, 256)]), max_new_tokens=4)  # warm-up
    rows = []
    with tqdm(total=len(lengths) * len(policies) * repeats, desc="bench") as bar:
        for length in lengths:
            ids = torch.tensor([[tokenizer.bos_token_id or 1] + haystack_ids(tokenizer, length - 1)])
            runs = {name: [] for name in policies}
            for _ in range(repeats):
                for name, policy in policies.items():
                    runs[name].append(generate(model, tokenizer, ids, policy=policy, max_new_tokens=new_tokens))
                    bar.update()
            for name, results in runs.items():
                rows.append(dict(prompt_tokens=length, cache=name, kv_mib=results[0].kv_bytes / 2**20,
                                 cache_length=results[0].cache_lengths[0],
                                 prefill_s=statistics.median(r.prefill_seconds for r in results),
                                 selection_s=statistics.median(r.selection_seconds for r in results),
                                 decode_ms_per_token=statistics.median(r.decode_ms_per_token for r in results)))
    table = pd.DataFrame(rows)
    full = table[table.cache == "full"].set_index("prompt_tokens")
    table["kv_shrink"] = table.prompt_tokens.map(full.kv_mib) / table.kv_mib
    table["prefill_overhead_%"] = 100 * (table.prefill_s / table.prompt_tokens.map(full.prefill_s) - 1)
    table["decode_speedup"] = table.prompt_tokens.map(full.decode_ms_per_token) / table.decode_ms_per_token
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="*", default=[2048, 4096, 8128],
                        help="prompt tokens (8128 + 64 new tokens stays within SmolLM2's 8192 positions)")
    parser.add_argument("--capacity", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    table = run(args.lengths, args.capacity, args.new_tokens, args.repeats, args.threads)
    print(markdown(table))


def markdown(table: pd.DataFrame) -> str:
    """A GitHub table (pandas' to_markdown needs the optional tabulate package)."""
    cell = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(table.columns) + " |", "|" + "---|" * len(table.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in table.itertuples(index=False)]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
