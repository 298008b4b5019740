"""One needle prompt, on the causal side: span effects of every 64-token block, the gradient estimate's agreement
with them, the smallest evicting set found and the layers that carry it (docs/causal.md).

    python benchmarks/causal_needle.py                      # SmolLM2, a 4000-token essay context, needle at 2000
    python benchmarks/causal_needle.py --model gemma-3-270m --length 8000
"""

from __future__ import annotations

import argparse
import time

import scipy.stats
import torch

import snapkv_lab
from snapkv_lab.compression.span_effects import EvictionProbe, default_spans, probe_spans
from snapkv_lab.compression.span_gradients import gradient_effects
from snapkv_lab.compression.span_search import layer_effects, minimal_evicting_set
from snapkv_lab.tasks.corpus import paul_graham_essays

NEEDLE = " The special magic number for the blue door is 7351842."
QUESTION = " What is the special magic number for the blue door? Answer:"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--length", type=int, default=4000)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = snapkv_lab.load_model(args.model)
    text = tokenizer(" ".join(paul_graham_essays().values()))["input_ids"]
    needle = tokenizer(NEEDLE, add_special_tokens=False)["input_ids"]
    middle = args.length // 2
    context = text[:middle] + needle + text[middle:args.length - len(needle)]
    started = time.perf_counter()
    probe = EvictionProbe.prefilled(model, tokenizer, torch.tensor([context]), QUESTION, max_new_tokens=8)
    print(f"answer {tokenizer.decode(probe.answer[0])!r}; needle at {middle}-{middle + len(needle)}; "
          f"prefill and answer {time.perf_counter() - started:.0f} s")
    spans = default_spans(probe.n, args.block)
    started = time.perf_counter()
    effects = probe_spans(probe, spans)
    print(f"span effects: {len(spans)} blocks in {time.perf_counter() - started:.0f} s")
    started = time.perf_counter()
    gradients = gradient_effects(probe, spans)
    agreement = scipy.stats.spearmanr(effects.kl, gradients.attribution)
    print(f"gradient estimate: {time.perf_counter() - started:.0f} s; Spearman with the blocks' KL "
          f"{agreement.statistic:.3f} (p {agreement.pvalue:.2g})")
    print("top blocks by KL:", effects.nlargest(5, "kl")[["start", "kl", "answer_changed"]].to_dict("records"))
    print("top blocks by gradient:", list(gradients.nlargest(5, "attribution").start))
    found = minimal_evicting_set(probe, effects, budget=12)
    print(f"smallest evicting set found: {found.spans} (changes the answer: {found.changed}, "
          f"{found.forwards} forwards)")
    layers = layer_effects(probe, found.spans)
    print("its layers by KL:", layers.nlargest(5, "kl")[["layer", "kl", "answer_changed"]].to_dict("records"))


if __name__ == "__main__":
    main()
