"""What a compressed cache buys, end to end: prefill, scoring, decode ms/token and peak memory per policy.

    python benchmarks/bench_end_to_end.py                          # SmolLM2 at 8176 tokens, batch 1 and 4, every policy
    python benchmarks/bench_end_to_end.py --model gemma-3-270m --lengths 32752 --batches 1
    python benchmarks/bench_end_to_end.py --model gemma-3-270m --lengths 8192 --batches 4
    python benchmarks/bench_end_to_end.py --shape llama3-8b --device cuda --dtype bf16 --lengths 32768   # a GPU

One run per (length, batch, policy), on CPU each in a fresh process (a CPU's peak RSS cannot be reset; on a GPU torch's
peak counter is reset per row, so the rows share one process and one model build): `generate` on
`--batches` prompts of `--lengths` tokens each (different stretches of the essays), the full cache and every policy
at --ratio of the prompt, greedy, EOS ignored so that every run decodes --new-tokens tokens. Columns: prefill_s the
compressed prefill (scoring and any extra scoring pass included), scoring_s its scoring, selecting and gathering
part, decode_ms the mean decode step (one token for every row), kv_mib the keys and values held after the prefill,
peak_mb the process's peak (RSS on CPU, torch's allocations on a GPU) and extra_mb its growth over the loaded model,
and the same relative to the full cache's row. The default length is the longest the model's positions hold with
the new tokens. Rows are appended to benchmarks/results/end_to_end_<model>.csv as they finish; a rerun skips the
rows already there (--fresh starts over). On CUDA the measured run follows an untimed one of the same shapes.
Other processes on the machine inflate the times, not the memory.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import subprocess
import sys
from unittest import mock

import pandas as pd
import torch
from _common import (
    RANDOM_SHAPES,
    RESULTS,
    PeakMemory,
    add_model_options,
    attempt,
    describe,
    load_subject,
    markdown,
    parse_model_options,
    result_name,
)
from tqdm.auto import tqdm

import snapkv_lab
from snapkv_lab import POLICIES, generate
from snapkv_lab.core.timing import over_full_cache

KEY = ("tokens", "batch", "policy")


def policy_of(name: str, ratio: float):
    return POLICIES[name]() if name == "FullCache" else POLICIES[name](capacity=ratio)


def prompts(subject, length: int, batch: int) -> torch.Tensor:
    """(batch, length) ids: a bundled model's rows are BOS and the essays from a different essay each; a random
    model's, different random ids."""
    if subject.shape in RANDOM_SHAPES:
        return torch.cat([subject.prompt(length + b)[:, :length] for b in range(batch)])
    from snapkv_lab.tasks.corpus import haystack_ids

    bos = subject.tokenizer.bos_token_id or 1
    return torch.tensor([[bos] + haystack_ids(subject.tokenizer, length - 1, start=b) for b in range(batch)])


@torch.inference_mode()
def child(args, length: int, batch: int, name: str, subject=None) -> dict:
    """One measured row; `subject` a model already loaded (CUDA), else this process loads its own."""
    device = torch.device(args.device)
    if subject is None:
        subject = load_subject(args)
    ids = prompts(subject, length, batch).to(device)
    subject.model(ids[:1, :8])  # touch every weight page first (loading may only map the file)
    policy = policy_of(name, args.ratio)
    generation = importlib.import_module("snapkv_lab.compression.generation")

    def run():
        with mock.patch.object(generation, "eos_ids", lambda model, tokenizer: ()):
            return generate(subject.model, subject.tokenizer, ids, policy=policy, max_new_tokens=args.new_tokens)

    if device.type == "cuda":
        attempt(run, device)  # untimed: cuDNN's plans for these shapes (bench_compression.py's docstring)
    with PeakMemory(device) as memory:
        result, status = attempt(run, device)
    row = dict(tokens=length, batch=batch, policy=name, label=policy.label if result is None else result.policy.label,
               peak_mb=memory.peak_mb, extra_mb=memory.extra_mb, status=status, load_1min=os.getloadavg()[0])
    if result is not None:
        row.update(prefill_s=result.prefill_seconds, scoring_s=result.selection_seconds,
                   decode_ms=result.decode_ms_per_token, kv_mib=result.kv_bytes / 2**20)
    return row


def measure(args, length: int, batch: int, name: str) -> dict:
    """One row, measured in a fresh process that gets this command line's options."""
    argv = [a for a in sys.argv[1:] if a != "--fresh"]
    done = subprocess.run([sys.executable, __file__, *argv, "--child", str(length), str(batch), name],
                          capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if lines:
        return json.loads(lines[-1])
    print(done.stderr[-3000:], file=sys.stderr)
    return dict(tokens=length, batch=batch, policy=name, status=f"crashed (exit {done.returncode})",
                load_1min=os.getloadavg()[0])


def in_process(args, length: int, batch: int, name: str, subject) -> dict:
    """One row in this process (CUDA): the memory of the rows before is released first, and a policy that fails
    is a row with its error, as a crashed child process is."""
    gc.collect()
    torch.cuda.empty_cache()
    try:
        return child(args, length, batch, name, subject)
    except Exception as err:  # noqa: BLE001 - the other rows still run
        return dict(tokens=length, batch=batch, policy=name, status=f"failed: {type(err).__name__}: {err}"[:300],
                    load_1min=os.getloadavg()[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_options(parser)
    parser.add_argument("--lengths", type=int, nargs="+", help="prompt tokens (default: the longest the model holds)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--ratio", type=float, default=0.25, help="every policy's capacity, a share of the prompt")
    parser.add_argument("--policies", nargs="+", default=sorted(POLICIES), choices=sorted(POLICIES))
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--fresh", action="store_true", help="measure every row again")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parse_model_options(parser)
    if args.child:
        length, batch, name = args.child
        print(json.dumps(child(args, int(length), int(batch), name)), flush=True)
        return
    if not 0 < args.ratio < 1:
        parser.error(f"--ratio must lie in (0, 1), got {args.ratio}")
    names = ["FullCache"] + [n for n in args.policies if n != "FullCache"]
    if args.lengths is None:
        subject_config = load_subject(args).model.config
        args.lengths = [subject_config.max_position_embeddings - args.new_tokens]
    path = RESULTS / f"{result_name('end_to_end', args)}.csv"
    done = pd.read_csv(path) if path.exists() and not args.fresh else pd.DataFrame(columns=list(KEY))
    seen = {tuple(row) for row in done[list(KEY)].itertuples(index=False)}
    todo = [(n, b, p) for n in args.lengths for b in args.batches for p in names if (n, b, p) not in seen]
    RESULTS.mkdir(exist_ok=True)
    subject = load_subject(args) if todo and torch.device(args.device).type == "cuda" else None
    for length, batch, name in tqdm(todo, desc="runs"):
        row = in_process(args, length, batch, name, subject) if subject else measure(args, length, batch, name)
        done = pd.concat([done, pd.DataFrame([row])], ignore_index=True)
        done.to_csv(path, index=False)  # after every row: a stopped run resumes here
    table = over_full_cache(done)
    columns = ["tokens", "batch", "policy", "prefill_s", "scoring_s", "decode_ms", "kv_mib", "peak_mb", "extra_mb",
               "prefill_s_vs_full", "decode_ms_vs_full", "kv_mib_vs_full", "extra_mb_vs_full", "status", "load_1min"]
    print(f"\nEnd to end: {describe(args)}, every policy at {args.ratio:g} of the prompt, {args.new_tokens} new tokens "
          f"(snapkv_lab {snapkv_lab.__version__}, torch {torch.__version__})\n")
    print(markdown(table[[c for c in columns if c in table]], dict(
        prefill_s=".2f", scoring_s=".2f", decode_ms=".1f", kv_mib=".1f", peak_mb=".0f", extra_mb=".0f",
        prefill_s_vs_full=".2f", decode_ms_vs_full=".2f", kv_mib_vs_full=".2f", extra_mb_vs_full=".2f",
        load_1min=".1f")))
    print(f"saved {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
