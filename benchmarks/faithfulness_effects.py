"""What each faithfulness choice changes in the kept positions, measured on the bundled SmolLM2-135M-Instruct.

    python3 benchmarks/faithfulness_effects.py                     # every method's default vs its named variants
    python3 benchmarks/faithfulness_effects.py --dump after.pt      # also save every default's kept positions
    python3 benchmarks/faithfulness_effects.py --before before.pt  # and compare them with an earlier dump

One prompt of --tokens tokens: the chat template's head (the system turn and the start of a user turn) then real
text (Paul Graham's essays), compressed at a quarter of its length (capacity 0.25), query-agnostic (the context
alone), one new token, fp32, sdpa. For each method of snapkv_lab.POLICIES, its default is compared with each named
variant of VARIANTS below (our former choices and kvpress's), by the Jaccard overlap |A & B| / |A | B| of the kept
position sets of each (layer, KV head), averaged; `layers_identical` is the share of layers whose sets agree in every
head. A dump made with an earlier checkout (`PYTHONPATH=<old checkout> python3 benchmarks/faithfulness_effects.py
--dump before.pt`) gives the before/after overlap of every default. Tables: benchmarks/results/
faithfulness_effects.csv (and _before_after.csv), printed as markdown for docs/faithfulness.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's snapkv_lab first
from _common import report  # noqa: E402

import snapkv_lab  # noqa: E402
from snapkv_lab.core.framing import chat_frame  # noqa: E402
from snapkv_lab.core.tokens import encode  # noqa: E402
from snapkv_lab.tasks.corpus import haystack_ids  # noqa: E402

# Per method: named variants (constructor keyword arguments) whose effect is measured against the default.
VARIANTS = {
    "SnapKV": {"avg pooling (kvpress's kind)": dict(pooling="avg"),
               "kvpress's settings (window 64, avg, kernel 5)": dict(window_size=64, pooling="avg", kernel_size=5)},
    "H2O": {"32 recent tokens (former default)": dict(window_size=32)},
    "TOVA": {"per GQA group, window 1 (former default)": dict(per_layer=False, window_size=1),
             "last token protected (kvpress)": dict(window_size=1)},
    "KNorm": {"window 32 (former default)": dict(window_size=32)},
    "PyramidKV": {"window 32": dict(window_size=32), "kvpress's schedule": dict(schedule="kvpress")},
    "AdaKV": {"force-then-compete safeguard (kvpress)": dict(allocation="safeguard")},
    "ChunkKV": {"per head, exact budget (former default)": dict(per_head=True, exact_budget=True)},
    "RandomKeep": {"kvpress's draw, no window": dict(layer_seeds=False, window_size=0)},
    "ExpectedAttention": {"window 32 (former default)": dict(window_size=32)},
    "KVzip": {"uniform budget per layer and KV head (official pair-uniform)": dict(allocation="uniform"),
              "kvpress's (4 sink tokens, chunks of 2048)": dict(sinks=4, chunk_size=2048)},
}


def kept_sets(kept: list[torch.Tensor]) -> list[list[set[int]]]:
    """Per layer, per KV head (batch row 0), the set of kept positions (NO_POSITION padding dropped)."""
    return [[{int(p) for p in row if p >= 0} for row in layer[0]] for layer in kept]


def overlap(a: list[list[set[int]]], b: list[list[set[int]]]) -> dict:
    jaccard = [[len(x & y) / len(x | y) for x, y in zip(la, lb, strict=True)] for la, lb in zip(a, b, strict=True)]
    return dict(jaccard_mean=sum(map(sum, jaccard)) / sum(map(len, jaccard)),
                jaccard_min_layer=min(sum(layer) / len(layer) for layer in jaccard),
                layers_identical=sum(all(j == 1.0 for j in layer) for layer in jaccard) / len(jaccard))


def prompt(tokenizer, n_tokens: int) -> torch.Tensor:
    head = encode(tokenizer, chat_frame(tokenizer)[0])
    return torch.tensor([head + haystack_ids(tokenizer, n_tokens - len(head), start=2)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--dump", type=Path, help="save every default's kept positions here")
    parser.add_argument("--before", type=Path, help="an earlier dump to compare every default with")
    args = parser.parse_args()
    torch.set_num_threads(2)
    model, tokenizer = snapkv_lab.load_model()
    ids = prompt(tokenizer, args.tokens)
    names = [name for name in snapkv_lab.POLICIES if name != "FullCache"]

    def run(name, **settings):
        policy = snapkv_lab.POLICIES[name](capacity=0.25, **settings)
        return kept_sets(snapkv_lab.generate(model, tokenizer, ids, policy=policy, max_new_tokens=1).kept_indices)

    defaults = {name: run(name) for name in names}
    if args.dump:
        torch.save(defaults, args.dump)
    rows = [dict(method=name, variant=label, **overlap(defaults[name], run(name, **settings)))
            for name, variants in VARIANTS.items() for label, settings in variants.items()]
    report(pd.DataFrame(rows), "faithfulness_effects",
           f"Default vs named variant, kept positions at 25% of {ids.shape[1]} tokens (SmolLM2-135M, fp32)")
    if args.before:
        before = torch.load(args.before)
        table = pd.DataFrame([dict(method=name, **overlap(before[name], defaults[name]))
                              for name in names if name in before])
        report(table, "faithfulness_effects_before_after",
               f"Each default before vs after ({args.before.name}), kept positions at 25% of {ids.shape[1]} tokens")


if __name__ == "__main__":
    main()
