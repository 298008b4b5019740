"""Time and peak memory of attention capture vs plain generation vs eager output_attentions.

    python benchmarks/bench_capture.py                       # 1k, 2k, 4k, 8k prompts, 64 new tokens
    python benchmarks/bench_capture.py --lengths 1024 --new-tokens 16
    python benchmarks/bench_capture.py --device cuda --dtype bf16 --shape llama3-8b --attn flash_attention_2 \
        --lengths 8192 16384 32768 --modes generate capture

Each measurement runs in a fresh process, so its peak memory is its own: the peak RSS (ru_maxrss) on CPU, the
peak of the memory torch allocated on a GPU. "extra" is the peak minus the memory in use with the model loaded:
what the run itself costs. Capture keeps its trace on the model's device (store_device=None), so that on a GPU
its memory counts where eager's attention maps do. On CPU, eager output_attentions runs under an address-space
cap (--eager-cap-gb) so that at long prompts it fails cleanly instead of swapping the machine; on a GPU the
GPU's own memory is the cap. A run that runs out of memory is reported as such. Wall time covers the generation
call alone (prefill and new tokens), read with the device synchronised. SmolLM2's prompts are real text (Paul
Graham's essays); a random model's are random token ids.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

import pandas as pd
import torch
from _common import (OUT_OF_MEMORY, PeakMemory, add_model_options, attempt, describe, load_subject,
                     parse_model_options, report, result_name)

from snapkv_lab import capture
from snapkv_lab.timing import stopwatch

MODES = ("generate", "capture", "eager")


def labels(attn: str) -> dict[str, str]:
    return {"generate": f"plain {attn} model.generate", "capture": f"snapkv_lab.capture ({attn})",
            "eager": "eager generate, output_attentions=True"}


def generation(mode: str, subject, ids: torch.Tensor, new_tokens: int):
    with torch.inference_mode():
        if mode == "capture":
            return capture(subject.model, subject.tokenizer, ids, max_new_tokens=new_tokens, stop_at_eos=False,
                           store_device=None, progress=False)
        return subject.model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                      output_attentions=mode == "eager", return_dict_in_generate=True)


def child(args: argparse.Namespace, mode: str, length: int) -> dict:
    device = torch.device(args.device)
    subject = load_subject(args, attn="eager" if mode == "eager" else None)
    ids = subject.prompt(length).to(device)
    with torch.inference_mode():
        subject.model(ids[:, :8])  # touch every weight page first (loading may only map the file); warms kernels up
    if mode == "eager" and device.type == "cpu":
        resource.setrlimit(resource.RLIMIT_AS, (int(args.eager_cap_gb * 2**30),) * 2)
    with PeakMemory(device) as memory, stopwatch(device) as elapsed:
        _, status = attempt(lambda: generation(mode, subject, ids, args.new_tokens), device)
    if status == OUT_OF_MEMORY and mode == "eager" and device.type == "cpu":
        status += f" under a {args.eager_cap_gb:g} GB cap"
    return dict(mode=mode, tokens=length, seconds=elapsed.seconds, peak_mb=memory.peak_mb, extra_mb=memory.extra_mb,
                status=status)


def measure(mode: str, length: int) -> dict:
    """One row, measured in a fresh process that gets this command line's options."""
    cmd = [sys.executable, __file__, *sys.argv[1:], "--child", mode, str(length)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if lines:
        return json.loads(lines[-1])
    print(done.stderr[-3000:], file=sys.stderr)
    return dict(mode=mode, tokens=length, seconds=float("nan"), peak_mb=float("nan"), extra_mb=float("nan"),
                status=f"crashed (exit {done.returncode})")


def table(rows: list[dict], attn: str, memory_kind: str) -> pd.DataFrame:
    rows = pd.DataFrame(rows)
    generate_s = rows[rows["mode"] == "generate"].set_index("tokens")["seconds"]
    capture_mb = rows[rows["mode"] == "capture"].set_index("tokens")["extra_mb"]
    return pd.DataFrame({
        "prompt tokens": rows["tokens"],
        "run": rows["mode"].map(labels(attn)),
        "wall s": rows["seconds"],
        "x plain generate": rows["seconds"] / rows["tokens"].map(generate_s),
        f"peak {memory_kind} MB": rows["peak_mb"],
        "extra over loaded model MB": rows["extra_mb"],
        "x capture extra": rows["extra_mb"] / rows["tokens"].map(capture_mb),
        "status": rows["status"],
    })


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--eager-cap-gb", type=float, default=16.0, help="address-space cap of eager runs on CPU")
    add_model_options(parser)
    parser.add_argument("--child", nargs=2, metavar=("MODE", "LENGTH"), help=argparse.SUPPRESS)
    args = parse_model_options(parser)
    if args.child:
        mode, length = args.child
        print(json.dumps(child(args, mode, int(length))))
        return

    rows = []
    for length in args.lengths:
        for mode in args.modes:
            rows.append(measure(mode, length))
            row = rows[-1]
            print(f"  {length:>5} {mode:<9} {row['seconds']:7.1f} s  peak {row['peak_mb']:8.0f} MB  {row['status']}",
                  file=sys.stderr, flush=True)
    memory_kind = PeakMemory(args.device).kind
    formats = {"wall s": ".1f", "x plain generate": ".2f", f"peak {memory_kind} MB": ".0f",
               "extra over loaded model MB": ".0f", "x capture extra": ".1f"}
    report(table(rows, args.attn, memory_kind), result_name("capture", args), formats=formats,
           title=f"prompt + {args.new_tokens} generated tokens, {describe(args)}")


if __name__ == "__main__":
    main()
