"""How much the findings tables move between machines: one chat prompt of the findings, captured under different
thread counts and CPU kernels, compared with a reference run.

Each setting runs in a fresh process (the kernel choice, ATEN_CPU_CAPABILITY, is read at start), captures the
prompt with greedy generation and saves the trace; the comparison then reports, per setting against the first:
whether the generated tokens are identical, the largest change of any query or key, of any attention probability
of a generated row, how many probabilities cross theta (a hit-rate support or numerator changes by one for each),
and how many rows of the (b) table change.

    python benchmarks/findings_reproducibility.py                       # threads 2 and 1, AVX-512 and AVX2 kernels
    python benchmarks/findings_reproducibility.py --new-tokens 64 --settings 2:default 1:default
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd
from _common import report

ROOT = Path(__file__).resolve().parent.parent


def capture_one(threads: int, path: str, new_tokens: int, index: int) -> None:
    import torch

    torch.set_num_threads(threads)
    from snapkv_lab.core.capture import capture
    from snapkv_lab.core.models import load_model
    from snapkv_lab.tasks.prompts import chat_prompt, load_recipes

    model, tokenizer = load_model()
    prompt = chat_prompt(tokenizer, load_recipes(ROOT / "data" / "prompt_recipes.json"), split="dev", index=index)
    capture(model, tokenizer, prompt.ids, max_new_tokens=new_tokens, stop_at_eos=False, progress=False).save(path)


def compare(reference, other) -> dict:
    import torch

    from snapkv_lab.core.overlap import THETA
    from snapkv_lab.findings.experiments import generation_consistency

    same_tokens = torch.equal(reference.token_ids, other.token_ids)
    out = dict(same_tokens=same_tokens)
    if not same_tokens:
        return out
    out["max_dqk"] = max(max((a - b).abs().max().item() for a, b in zip(reference.queries, other.queries)),
                         max((a - b).abs().max().item() for a, b in zip(reference.keys, other.keys)))
    max_dp, crossings, above = 0.0, 0, 0
    for layer in reference.layers:
        a = reference.attention(layer, queries=reference.generated, keys=reference.prompt)
        b = other.attention(layer, queries=other.generated, keys=other.prompt)
        max_dp = max(max_dp, (a - b).abs().max().item())
        crossings += int(((a > THETA) != (b > THETA)).sum())
        above += int((a > THETA).sum())
    out.update(max_dp=max_dp, probabilities_above_theta=above, crossing_theta=crossings)
    n = reference.n_generated // 4
    tables = [generation_consistency(t, obs_window=32, gen_segment=n, n_gen_segments=4) for t in (reference, other)]
    changed = ~((tables[0]["value"] == tables[1]["value"]) | (tables[0]["value"].isna() & tables[1]["value"].isna()))
    out.update(b_rows=len(tables[0]), b_values_changed=int(changed.sum()),
               b_max_value_change=float((tables[0]["value"] - tables[1]["value"]).abs().max()),
               b_supports_changed=int((tables[0]["support"] != tables[1]["support"]).sum()))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", nargs="+", default=["2:default", "1:default", "2:avx2"],
                        help="threads:kernels per run, kernels 'default' or an ATEN_CPU_CAPABILITY value; the first is "
                             "the reference")
    parser.add_argument("--new-tokens", type=int, default=256,
                        help="greedy tokens per capture (default 256, as the findings)")
    parser.add_argument("--prompt", type=int, default=0, help="index of the dev chat prompt (default 0)")
    parser.add_argument("--capture", nargs=2, metavar=("THREADS", "PATH"), help=argparse.SUPPRESS)  # child process
    args = parser.parse_args()
    if args.capture:
        capture_one(int(args.capture[0]), args.capture[1], args.new_tokens, args.prompt)
        return
    from snapkv_lab.core.trace import AttentionTrace

    with tempfile.TemporaryDirectory() as folder:
        paths = []
        for setting in args.settings:
            threads, kernels = setting.split(":")
            env = dict(os.environ, PYTHONPATH=str(ROOT))
            if kernels != "default":
                env["ATEN_CPU_CAPABILITY"] = kernels
            paths.append(str(Path(folder) / f"{threads}-{kernels}.safetensors"))
            subprocess.run([sys.executable, __file__, "--capture", threads, paths[-1], "--new-tokens",
                            str(args.new_tokens), "--prompt", str(args.prompt)], env=env, check=True)
        reference = AttentionTrace.load(paths[0])
        rows = [dict(setting=s, **compare(reference, AttentionTrace.load(p)))
                for s, p in zip(args.settings[1:], paths[1:])]
    report(pd.DataFrame(rows), "findings_reproducibility",
           f"Against {args.settings[0]} (threads:kernels): dev chat prompt {args.prompt}, {args.new_tokens} greedy "
           "tokens, SmolLM2 fp32")


if __name__ == "__main__":
    main()
