"""A long-generation pressure test: copy a numbered list of codes from the prompt, in order.

Compression while decoding (R-KV, H2O, TOVA, DecodingEviction) exists for long outputs, and a long output that must
stay consistent with its prompt is where evicting goes wrong: the model writes "k. <code k>" for k = 1..n, and each
line needs the prompt's k-th code, which the cache may have dropped a few hundred tokens earlier. Bundled models copy
short lists with the full cache, so the test measures what a policy loses, against the full cache on the same lists.

    table = long_generation(model, tokenizer, [RKV(capacity=0.25), H2O(capacity=0.25)], n_items=40, seeds=(0, 1))

Scores per run: `in_order`, the share of the list written correctly before the first wrong or missing line (a list
that must stay consistent); `correct`, the share of lines k that hold the right code under the right number.
"""

from __future__ import annotations

import random
import re

import pandas as pd
from tqdm.auto import tqdm

from ..compression import generate
from ..core.framing import resolve_framing
from ..policies import FullCache

LIST_HEAD = "Here is a list of {n} codes, one per line:\n\n"
LIST_ASK = "\nRewrite the whole list, from 1 to {n}, in the same order and the same format."
CODE_DIGITS = 5
ITEM = re.compile(r"^\s*(\d+)\.\s*(\d+)\s*$")


def list_task(n_items: int, seed: int) -> tuple[str, list[str]]:
    """(the user's text, the n codes in order): n random 5-digit codes, distinct, seeded."""
    codes = [str(c) for c in random.Random(seed).sample(range(10 ** (CODE_DIGITS - 1), 10 ** CODE_DIGITS), n_items)]
    lines = "".join(f"{k}. {code}\n" for k, code in enumerate(codes, 1))
    return LIST_HEAD.format(n=n_items) + lines + LIST_ASK.format(n=n_items), codes


def list_scores(text: str, codes: list[str]) -> dict:
    """{"in_order", "correct"} in [0, 1] for a generated `text` against the list's `codes` (see module doc): lines
    that are not "<number>. <code>" are skipped."""
    written = {}
    order = []
    for line in text.splitlines():
        match = ITEM.match(line)
        if match:
            k, code = int(match.group(1)), match.group(2)
            order.append((k, code))
            written.setdefault(k, code)
    in_order = 0
    for expected, (k, code) in enumerate(order, 1):
        if expected > len(codes) or k != expected or code != codes[k - 1]:
            break
        in_order += 1
    correct = sum(written.get(k) == code for k, code in enumerate(codes, 1))
    return {"in_order": in_order / len(codes), "correct": correct / len(codes)}


def long_generation(model, tokenizer, policies, *, n_items: int = 40, seeds=(0, 1, 2), tokens_per_item: int = 8,
                    progress: bool = True) -> pd.DataFrame:
    """Each policy and the full cache copy the lists of `seeds`: one row per (policy, seed) with the scores, the
    prompt's and the generated tokens, and the largest layer cache after the prefill. A chat model gets its template
    (the prompt as a user turn), a base model the plain text. max_new_tokens = n_items * tokens_per_item."""
    runs = [FullCache(), *policies]
    rows = []
    chat = resolve_framing(tokenizer) == "chat"
    bar = tqdm(total=len(runs) * len(seeds), desc="long generation", disable=not progress)
    for seed in seeds:
        text, codes = list_task(n_items, seed)
        prompt = [{"role": "user", "content": text}] if chat else text
        for policy in runs:
            result = generate(model, tokenizer, prompt, policy=policy, max_new_tokens=n_items * tokens_per_item)
            rows.append(dict(policy=policy.label, seed=seed, n_items=n_items, **list_scores(result.text, codes),
                             prompt_tokens=result.prompt_ids.shape[1], new_tokens=result.token_ids.shape[1],
                             cache_after_prefill=max(result.cache_lengths, default=0), text=result.text))
            bar.update()
    bar.close()
    return pd.DataFrame(rows)


def main(argv=None) -> None:
    """python -m snapkv_lab.pressure.long_generation [--items 40] [--seeds 0 1 2] [--capacities 0.25 0.5] [--out CSV]:
    the decoding-time policies and two prefill-time ones at each budget on the bundled model; the table to --out."""
    import argparse

    from ..core.models import load_model
    from ..policies import H2O, RKV, TOVA, DecodingEviction, SnapKV, StreamingLLM

    parser = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=40)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--capacities", type=float, nargs="+", default=[0.25, 0.5])
    parser.add_argument("--model", default=None)
    parser.add_argument("--out", default="data/pressure_long_generation.csv")
    args = parser.parse_args(argv)
    model, tokenizer = load_model(args.model)
    policies = [cls(capacity=c) for c in args.capacities
                for cls in (RKV, H2O, TOVA, DecodingEviction, StreamingLLM, SnapKV)]
    table = long_generation(model, tokenizer, policies, n_items=args.items, seeds=args.seeds)
    table.to_csv(args.out, index=False)
    summary = table.groupby("policy", sort=False)[["in_order", "correct", "cache_after_prefill"]].mean()
    print(summary.round(2).to_string())


if __name__ == "__main__":
    main()
