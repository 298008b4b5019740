"""Every policy of snapkv_lab.POLICIES at a 25% budget: KV bytes, scoring cost, decode speed; and the cost of
`compare` (one shared prefill) against one prefill plus its decodes.

    python benchmarks/bench_policies.py                               # 2k, 4k, 8k prompts, every policy
    python benchmarks/bench_policies.py --lengths 1024 --new-tokens 8 --policies SnapKV TOVA
    python benchmarks/bench_policies.py --lengths 2048 4096 --policies FullCache Surprisal --new-tokens 4 --repeats 3
    python benchmarks/bench_policies.py --lengths 4096 --policies FullCache "KVzap(model_type='linear')" FastKVzip

Table 1, one row per (prompt length, policy), each run through `snapkv_lab.generate` (live compression):
kv_ratio = KV bytes after prefill / the full cache's; scoring_% = the compressor's own time (scoring, top-k,
gathering; for KVzip its reconstruction pass, for Surprisal the output head over the prefill's final hidden
states) as % of the full cache's prefill; decode ms/token (steps after the first) and its speed-up over the full
cache. Table 2: `compare` of --compare-policies on one prompt of --compare-length tokens, against one full prefill
plus one full-cache decode per policy (the target: at most 1.3x).
Defaults: the bundled SmolLM2 on Paul Graham's essays, fp32, CPU, 2 threads. Times are single runs (other
processes on the machine inflate them), or with --repeats N the median of N runs, taken in turns over the
policies so that a change in the machine's load reaches each policy alike.
"""

from __future__ import annotations

import argparse
import dataclasses

import pandas as pd
from _common import add_model_options, describe, load_subject, parse_model_options, report, result_name
from tqdm.auto import tqdm

import snapkv_lab
from snapkv_lab.core.timing import stopwatch
from snapkv_lab.policies import parse_policy

COMPARED = ("FullCache", "SnapKV", "PyramidKV", "AdaKV", "TOVA", "StreamingLLM")


def policy(label: str, ratio: float):
    """The policy a label names (a registered name, or one with settings: "KVzap(model_type='linear')";
    policies.parse_policy, which refuses a setting the policy does not take) at capacity `ratio`, as eval builds it."""
    named = parse_policy(label)
    return named if isinstance(named, snapkv_lab.FullCache) else dataclasses.replace(named, capacity=ratio)


def per_policy(subject, lengths, names, ratio: float, new_tokens: int, repeats: int = 1) -> pd.DataFrame:
    model, tokenizer = subject.model, subject.tokenizer
    snapkv_lab.generate(model, tokenizer, subject.prompt(256), max_new_tokens=4)  # warm-up
    rows = []
    with tqdm(total=len(lengths) * len(names) * repeats, desc="policies") as bar:
        for length in lengths:
            ids = subject.prompt(length)
            for _ in range(repeats):  # in turns: every policy once, then again
                for name in names:
                    run = snapkv_lab.generate(model, tokenizer, ids, policy=policy(name, ratio),
                                              max_new_tokens=new_tokens)
                    rows.append(dict(prompt_tokens=length, policy=name, kv_mib=run.kv_bytes / 2**20,
                                     prefill_s=run.prefill_seconds, selection_s=run.selection_seconds,
                                     decode_ms_per_token=run.decode_ms_per_token))
                    bar.update()
    table = pd.DataFrame(rows).groupby(["prompt_tokens", "policy"], sort=False, as_index=False).median()
    full = table[table.policy == "FullCache"].set_index("prompt_tokens")
    table["kv_ratio"] = table.kv_mib / table.prompt_tokens.map(full.kv_mib)
    table["scoring_%"] = 100 * table.selection_s / table.prompt_tokens.map(full.prefill_s)
    table["decode_speedup"] = table.prompt_tokens.map(full.decode_ms_per_token) / table.decode_ms_per_token
    return table


def compare_cost(subject, length: int, names, ratio: float, new_tokens: int) -> pd.DataFrame:
    model, tokenizer = subject.model, subject.tokenizer
    ids = subject.prompt(length)
    policies = [policy(name, ratio) for name in names]
    full = snapkv_lab.generate(model, tokenizer, ids, max_new_tokens=new_tokens)
    decode_s = full.decode_ms_per_token * (full.token_ids.shape[1] - 1) / 1000
    with stopwatch(model.device) as elapsed:
        snapkv_lab.compare(model, tokenizer, [ids], policies=policies, max_new_tokens=new_tokens, progress=False)
    reference = full.prefill_seconds + len(policies) * decode_s
    return pd.DataFrame([dict(prompt_tokens=length, policies=len(policies), new_tokens=new_tokens,
                              one_prefill_s=full.prefill_seconds, one_decode_s=decode_s, reference_s=reference,
                              compare_s=elapsed.seconds, ratio=elapsed.seconds / reference)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8128])
    parser.add_argument("--policies", nargs="+", default=sorted(snapkv_lab.POLICIES),
                        help="registered names, or labels with settings: \"KVzap(model_type='linear')\"")
    parser.add_argument("--ratio", type=float, default=0.25, help="capacity as a fraction of the prompt")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each (length, policy); times: their median")
    parser.add_argument("--compare-length", type=int, default=4096, help="0: skip the compare table")
    parser.add_argument("--compare-policies", nargs="+", default=list(COMPARED))
    add_model_options(parser)
    args = parse_model_options(parser)
    subject = load_subject(args)
    names = ["FullCache", *[n for n in args.policies if n != "FullCache"]]
    table = per_policy(subject, args.lengths, names, args.ratio, args.new_tokens, args.repeats)
    runs = "single runs" if args.repeats == 1 else f"median of {args.repeats} runs"
    report(table, result_name("policies", args),
           formats={"kv_ratio": ".3f", "scoring_%": ".1f", "decode_speedup": ".2f"},
           title=f"every policy at capacity={args.ratio}, {args.new_tokens} new tokens, {runs}, {describe(args)}, "
                 f"{args.attn}")
    if not args.compare_length:
        return
    cost = compare_cost(subject, args.compare_length, args.compare_policies, args.ratio, args.new_tokens)
    report(cost, result_name("compare_cost", args), formats={"ratio": ".2f"},
           title=f"compare of {', '.join(args.compare_policies)} on one prompt vs one prefill + their decodes")


if __name__ == "__main__":
    main()
