"""Time and peak memory of attention capture vs plain generation vs eager output_attentions.

    python benchmarks/bench_capture.py                       # 1k, 2k, 4k, 8k prompts, 64 new tokens
    python benchmarks/bench_capture.py --lengths 1024 --new-tokens 16

Each measurement runs in a fresh process, so its peak RSS (ru_maxrss) is its own. "extra" is the peak
minus the RSS with the model loaded: what the run itself costs. Eager output_attentions runs under an
address-space cap (--eager-cap-gb) so that at long prompts it fails cleanly instead of swapping the
machine; a failure is reported as such. Prompts are real text (Paul Graham's essays).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

MODES = {
    "generate": "plain sdpa model.generate",
    "capture": "snapkv_lab.capture (sdpa)",
    "eager": "eager generate, output_attentions=True",
}


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(mode: str, length: int, new_tokens: int, threads: int, cap_gb: float) -> dict:
    import torch

    from snapkv_lab import capture, load_model
    from snapkv_lab.corpus import haystack_ids

    torch.set_num_threads(threads)
    model, tokenizer = load_model(attn_implementation="eager" if mode == "eager" else "sdpa")
    ids = torch.tensor([[tokenizer.bos_token_id or 1] + haystack_ids(tokenizer, length - 1)])
    with torch.inference_mode():
        model(ids[:, :8])  # touch every weight page first: loading may only map the file
    loaded = _rss_mb()
    if mode == "eager":
        resource.setrlimit(resource.RLIMIT_AS, (int(cap_gb * 2**30),) * 2)
    start = time.perf_counter()
    try:
        with torch.inference_mode():
            if mode == "capture":
                capture(model, tokenizer, ids, max_new_tokens=new_tokens, stop_at_eos=False, progress=False)
            else:
                model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                               output_attentions=mode == "eager", return_dict_in_generate=True)
        status = "ok"
    except (MemoryError, RuntimeError) as err:  # torch raises RuntimeError for a failed allocation
        status = f"failed: {type(err).__name__} under a {cap_gb:g} GB cap"
    return dict(mode=mode, tokens=length, seconds=time.perf_counter() - start, peak_mb=_rss_mb(),
                extra_mb=_rss_mb() - loaded, status=status)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--eager-cap-gb", type=float, default=16.0)
    parser.add_argument("--child", nargs=2, metavar=("MODE", "LENGTH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, length = args.child
        print(json.dumps(child(mode, int(length), args.new_tokens, args.threads, args.eager_cap_gb)))
        return

    rows = []
    for length in args.lengths:
        for mode in args.modes:
            cmd = [sys.executable, __file__, "--child", mode, str(length), "--new-tokens", str(args.new_tokens),
                   "--threads", str(args.threads), "--eager-cap-gb", str(args.eager_cap_gb)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            row = json.loads(lines[-1]) if lines else dict(mode=mode, tokens=length, seconds=float("nan"),
                                                             peak_mb=float("nan"), extra_mb=float("nan"),
                                                             status=f"crashed (exit {done.returncode})")
            rows.append(row)
            print(f"  {length:>5} {mode:<9} {row['seconds']:7.1f} s  peak {row['peak_mb']:8.0f} MB  {row['status']}",
                  file=sys.stderr, flush=True)

    generate_s = {r["tokens"]: r["seconds"] for r in rows if r["mode"] == "generate"}
    capture_mb = {r["tokens"]: r["extra_mb"] for r in rows if r["mode"] == "capture"}
    print(f"\nprompt + {args.new_tokens} generated tokens, SmolLM2-135M fp32, CPU, {args.threads} threads\n")
    print("| prompt tokens | run | wall s | x plain generate | peak RSS MB | extra over loaded model MB | x capture extra | status |")
    print("|---:|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        ratio_t = r["seconds"] / generate_s[r["tokens"]] if r["tokens"] in generate_s else float("nan")
        ratio_m = r["extra_mb"] / capture_mb[r["tokens"]] if r["tokens"] in capture_mb else float("nan")
        print(f"| {r['tokens']} | {MODES[r['mode']]} | {r['seconds']:.1f} | {ratio_t:.2f} | {r['peak_mb']:.0f} | "
              f"{r['extra_mb']:.0f} | {ratio_m:.1f} | {r['status']} |")


if __name__ == "__main__":
    main()
