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

import numpy as np
import pandas as pd

from ..compression import generate
from ..compression.greedy import eos_cut
from ..core.framing import resolve_framing
from ..core.inputs import eos_ids
from ..core.progress import progress_bar
from ..core.ratio_intervals import mean_t_interval
from ..policies import H2O, RKV, TOVA, DecodingEviction, FullCache

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


def decoding_policies(budget: int) -> list:
    """The decoding-time policies at `budget` KV entries per head and layer, each at its authors' defaults but R-KV's
    interval (32, DecodingEviction's, where its official 128 would never evict in a list's output): DecodingEviction
    after SnapKV at prefill (kvpress's PrefillDecodingPress(SnapKVPress, DecodingPress)), DecodingEviction with the
    prompt left whole (kvpress's DecodingPress alone), R-KV, H2O and TOVA."""
    return [DecodingEviction(capacity=budget), DecodingEviction(capacity=None, target=budget),
            RKV(capacity=budget, interval=32), H2O(capacity=budget), TOVA(capacity=budget)]


KVPRESS_EQUIVALENT = {"DecodingEviction": "PrefillDecodingPress", "DecodingEviction(target)": "DecodingPress"}


def list_written(tokenizer, n_items: int):
    """stop(token_ids (1, t)) -> bool for `generate`: True once the output's text holds its last line, "<n_items>.
    <code>" and a line break (the task's end: a full cache stops there, a run that loses its place goes on to its
    end token or max_new_tokens)."""
    last = re.compile(rf"^\s*{n_items}\.\s*\d+\s*\n", re.MULTILINE)
    return lambda token_ids: bool(last.search(tokenizer.decode(token_ids[0], skip_special_tokens=True)))


def long_generation(model, tokenizer, policies, *, n_items: int = 40, seeds=(0, 1, 2), tokens_per_item: int = 8,
                    progress: bool = True, skip=frozenset(), on_row=None) -> pd.DataFrame:
    """Each policy and the full cache copy the lists of `seeds`: one row per (policy, seed) with the scores, the
    prompt's and the generated tokens, the largest layer cache after the prefill and the KV footprint over the
    generation (compression.footprint: entries held summed over layers and KV heads, integral over the decode steps
    and peak, and the same in bytes). A chat model gets its template (the prompt as a user turn), a base model the
    plain text. Generation stops at the task's end (`list_written`), an end token or max_new_tokens = n_items *
    tokens_per_item, which `stopped` says ("list", "eos", "max_new_tokens"); new_tokens, the output's length, counts
    the end token. skip: (policy label, seed) cells already run; on_row(row) sees each row as it is made (a resumable
    run writes it)."""
    runs = [FullCache(), *policies]
    rows = []
    chat = resolve_framing(tokenizer) == "chat"
    todo = [(seed, policy) for seed in seeds for policy in runs if (policy.label, seed) not in skip]
    bar = progress_bar(total=len(todo), desc="long generation", disable=not progress)
    max_new_tokens = n_items * tokens_per_item
    for seed, policy in todo:
        text, codes = list_task(n_items, seed)
        prompt = [{"role": "user", "content": text}] if chat else text
        done = list_written(tokenizer, n_items)
        result = generate(model, tokenizer, prompt, policy=policy, max_new_tokens=max_new_tokens, stop=done)
        new_tokens = result.token_ids.shape[1]
        ended = eos_cut(result.token_ids[0].tolist(), eos_ids(model, tokenizer)) < new_tokens
        row = dict(policy=policy.label, seed=seed, n_items=n_items, budget=policy_budget(policy),
                   **list_scores(result.text, codes), prompt_tokens=result.prompt_ids.shape[1],
                   new_tokens=new_tokens,
                   stopped="list" if done(result.token_ids) else "eos" if ended else "max_new_tokens",
                   max_new_tokens=max_new_tokens, cache_after_prefill=max(result.cache_lengths, default=0),
                   **result.footprint.columns(), text=result.text)
        rows.append(row)
        if on_row is not None:
            on_row(row)
        bar.update()
    bar.close()
    return pd.DataFrame(rows)


def policy_budget(policy) -> int | None:
    """The entries per head and layer a decoding-time policy cuts back to (None: the full cache)."""
    if isinstance(policy, FullCache):
        return None
    return policy.target if getattr(policy, "target", None) is not None else policy.capacity


SUMMARY_COLUMNS = ("correct", "in_order", "new_tokens", "footprint_integral", "footprint_peak")


def long_generation_summary(table: pd.DataFrame, ci: float = 0.95) -> pd.DataFrame:
    """Per policy (the table's order): lists run, and for each of SUMMARY_COLUMNS the mean over lists with its t
    interval (`<column>_low`, `<column>_high`), and `correct`'s difference to the full cache on the same lists
    (paired by seed: `correct_vs_full` with its t interval), the share of runs that reached the list's last line
    and the budget. Descriptive: no test, no family row."""
    full = table[table.policy == "FullCache"].set_index("seed").correct
    rows = []
    for policy, part in table.groupby("policy", sort=False):
        row = dict(policy=policy, budget=part.budget.iloc[0], lists=len(part),
                   list_written=(part.stopped == "list").mean())
        for column in SUMMARY_COLUMNS:
            row |= _mean_interval(part[column].to_numpy(float), column, ci)
        paired = (part.set_index("seed").correct - full).dropna()
        row |= _mean_interval(paired.to_numpy(float), "correct_vs_full", ci)
        rows.append(row)
    return pd.DataFrame(rows)


def _mean_interval(values: np.ndarray, name: str, ci: float) -> dict:
    """{name: mean, name_low, name_high}: the t interval of the mean (NaN under 2 values)."""
    mean, low, high = mean_t_interval(values, ci)
    return {name: mean, f"{name}_low": low, f"{name}_high": high}


def long_generation_markdown(table: pd.DataFrame) -> str:
    """The summary as a markdown table for the docs (app.docs_tables): means [95% t interval] over the lists."""
    summary = long_generation_summary(table)

    def cell(row, column, digits=2, scale=1.0):
        mean, low, high = (row[column] / scale, row[f"{column}_low"] / scale, row[f"{column}_high"] / scale)
        return f"{mean:.{digits}f}" + ("" if np.isnan(low) else f" [{low:.{digits}f}, {high:.{digits}f}]")

    lines = ["| policy | budget (entries per head and layer) | lists | codes copied (correct) | minus the full cache, "
             "same lists | in order | output tokens | list finished | footprint integral (M entry-steps) | "
             "peak (k entries) |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for _, row in summary.iterrows():
        budget = "full" if pd.isna(row.budget) else f"{int(row.budget)}"
        lines.append(f"| {row.policy} | {budget} | {row.lists} | {cell(row, 'correct')} | "
                     f"{cell(row, 'correct_vs_full')} | {cell(row, 'in_order')} | {cell(row, 'new_tokens', 0)} | "
                     f"{row.list_written:.2f} | {cell(row, 'footprint_integral', 2, 1e6)} | "
                     f"{cell(row, 'footprint_peak', 1, 1e3)} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    """python -m snapkv_lab.pressure.long_generation [--items 12] [--seeds 0 1 2] [--budgets 48 96] [--out CSV]:
    the full cache and the decoding-time policies (`decoding_policies`) at each budget on the bundled model; rows
    appended to --out as they are made, cells already there skipped (a rerun resumes)."""
    import argparse
    from pathlib import Path

    from ..core.models import load_model

    parser = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=12)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--budgets", type=int, nargs="*", default=[48, 96], help="none: the full cache alone")
    parser.add_argument("--tokens-per-item", type=int, default=16)
    parser.add_argument("--model", default=None)
    parser.add_argument("--out", default="data/long_generation.csv")
    args = parser.parse_args(argv)
    out = Path(args.out)
    done = pd.read_csv(out) if out.is_file() else pd.DataFrame(columns=["policy", "seed", "n_items"])
    if len(done) and set(done.n_items) != {args.items}:
        raise ValueError(f"{out} holds lists of {sorted(set(done.n_items))} items, not {args.items}: another --out")
    skip = set(zip(done.policy, done.seed, strict=True))

    def write(row):
        pd.DataFrame([row]).to_csv(out, mode="a", header=not out.is_file(), index=False)

    model, tokenizer = load_model(args.model)
    policies = [policy for budget in args.budgets for policy in decoding_policies(budget)]
    long_generation(model, tokenizer, policies, n_items=args.items, seeds=args.seeds,
                    tokens_per_item=args.tokens_per_item, skip=skip, on_row=write)
    table = pd.read_csv(out)
    summary = table.groupby("policy", sort=False)[["correct", "new_tokens", "footprint_integral"]].mean()
    print(summary.round(2).to_string())


if __name__ == "__main__":
    main()
