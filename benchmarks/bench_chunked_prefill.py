"""Peak memory vs context length, with and without a chunked prefill (compress as you go).

    python benchmarks/bench_chunked_prefill.py  # SmolLM2: 2k, 4k, 8k (its context less the new tokens)
    python benchmarks/bench_chunked_prefill.py --model gemma-3-270m --lengths 4096 8192 16384 32760
    python benchmarks/bench_chunked_prefill.py --model gemma-3-270m --lengths 32760 --cap-gb 6

Three runs per prompt length, each in a fresh process (a CPU's peak RSS cannot be reset): the full cache, SnapKV at
--capacity compressing after one prefill of the whole prompt (the keys of the whole prompt exist at the prefill's
peak), and the same SnapKV with `prefill_chunk=--chunk` (the cache never holds more than capacity + chunk
positions per head). Columns: prefill seconds; peak_mb the process's peak (RSS on CPU, torch's allocations on a
GPU) and extra_mb its growth over the loaded model; peak_kv_mib the most KV bytes the cache held at the end of a
chunk (an unchunked run has one chunk, so it shows only the compressed cache: its transient peak, a layer's whole
keys at a time, is in peak_mb); kv_mib after prefill; same_answer: the run's greedy tokens equal the
unchunked SnapKV run's. --cap-gb caps each CPU process's address space: a run that needs more fails "out of
memory" instead of swapping. Other processes on the machine inflate the times, not the memory.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

import pandas as pd
import torch
from _common import (
    OUT_OF_MEMORY,
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

from snapkv_lab import FullCache, SnapKV, compress
from snapkv_lab.compression.compressor import applied
from snapkv_lab.compression.generation import chunk_sizes, forward, greedy_decode
from snapkv_lab.compression.layers import cache_bytes
from snapkv_lab.core.inputs import check_context_length
from snapkv_lab.core.timing import stopwatch

MODES = ("full cache", "SnapKV", "SnapKV, chunked")


@torch.inference_mode()
def run(mode: str, subject, ids: torch.Tensor, args) -> dict:
    """Prefill (chunked or not) and greedy decode; the most KV bytes held at a chunk's end."""
    model = subject.model
    policy = FullCache() if mode == "full cache" else SnapKV(capacity=args.capacity)
    chunk = args.chunk if mode.endswith("chunked") else None
    n = ids.shape[1]
    with compress(model, policy, prefill_chunk=chunk) as state, stopwatch(model.device) as elapsed:
        start, peak_kv = 0, 0
        for size in chunk_sizes(n, chunk) if chunk else [n]:
            logits = forward(model, ids[:, start:start + size], state.cache, start)
            start += size
            peak_kv = max(peak_kv, cache_bytes(state.cache))
        if chunk:
            state.end_prefill()
    kv = cache_bytes(state.cache)
    with applied(model, state):
        tokens, _ = greedy_decode(model, state.cache, logits, n, args.new_tokens)
    return dict(seconds=elapsed.seconds, peak_kv_mib=peak_kv / 2**20, kv_mib=kv / 2**20, new_ids=tokens[0].tolist())


def child(args, mode: str, length: int) -> dict:
    device = torch.device(args.device)
    subject = load_subject(args)
    check_context_length(subject.model, length + args.new_tokens, "the prompt and its new tokens")
    ids = subject.prompt(length).to(device)
    with torch.inference_mode():
        subject.model(ids[:, :8])  # touch every weight page first (loading may only map the file)
    if args.cap_gb and device.type == "cpu":
        resource.setrlimit(resource.RLIMIT_AS, (int(args.cap_gb * 2**30),) * 2)
    with PeakMemory(device) as memory:
        result, status = attempt(lambda: run(mode, subject, ids, args), device)
    if status == OUT_OF_MEMORY and args.cap_gb and device.type == "cpu":
        status += f" under a {args.cap_gb:g} GB cap"
    return dict(mode=mode, tokens=length, **(result or dict(seconds=float("nan"), peak_kv_mib=float("nan"),
                                                             kv_mib=float("nan"), new_ids=[])),
                peak_mb=memory.peak_mb, extra_mb=memory.extra_mb, status=status, load_1min=os.getloadavg()[0])


def measure(mode: str, length: int) -> dict:
    """One row, measured in a fresh process that gets this command line's options."""
    done = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--child", mode, str(length)],
                          capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if lines:
        return json.loads(lines[-1])
    print(done.stderr[-3000:], file=sys.stderr)
    return dict(mode=mode, tokens=length, status=f"crashed (exit {done.returncode})", new_ids=[],
                load_1min=os.getloadavg()[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_options(parser)
    parser.add_argument("--lengths", type=int, nargs="+",
                        default=[2048, 4096, 8184])  # 8184 + 8 new tokens: SmolLM2's 8192
    parser.add_argument("--capacity", type=int, default=1024, help="SnapKV's budget, tokens per head")
    parser.add_argument("--chunk", type=int, default=1024, help="prefill_chunk of the chunked run")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--cap-gb", type=float, help="address-space cap of each CPU run")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parse_model_options(parser)
    if args.child:
        print(json.dumps(child(args, args.child[0], int(args.child[1]))), flush=True)
        return
    rows = []
    for length in tqdm(args.lengths, desc="lengths"):
        for mode in args.modes:
            rows.append(measure(mode, length))
    table = pd.DataFrame(rows)
    reference = table[(table["mode"] == "SnapKV") & (table["status"] == "ok")].set_index("tokens")["new_ids"]
    table["same_answer"] = [("yes" if ids == reference[n] else "no") if n in reference.index and status == "ok" else ""
                            for n, ids, status in zip(table["tokens"], table["new_ids"], table["status"])]
    columns = ["tokens", "mode", "seconds", "peak_mb", "extra_mb", "peak_kv_mib", "kv_mib", "same_answer", "status",
               "load_1min"]
    cap = f", address space capped at {args.cap_gb:g} GB" if args.cap_gb else ""
    report(table[columns], result_name("chunked_prefill", args),
           f"Peak memory with and without a chunked prefill: {describe(args)}, SnapKV@{args.capacity}, "
           f"chunk {args.chunk}{cap}", formats=dict(seconds=".1f", peak_mb=".0f", extra_mb=".0f",
                                                    peak_kv_mib=".1f", kv_mib=".1f", load_1min=".1f"))


if __name__ == "__main__":
    main()
