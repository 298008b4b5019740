"""Score against bytes: eviction, merging, key channels, quantization and their compositions on one axis, the KV
bytes the cache really holds, on the 15 dev needles of the grid (`python -m snapkv_lab.pressure.score_bytes`).

Each needle (grid.dev_needle_specs: 4000 tokens of essays, depths 0 .25 .5 .75 1, `samples` haystacks per depth: the
prompts of the committed 25%-budget tables) is prefilled once and answered with the full cache and every policy of
PLAN in both modes (runner.run_retrieval, the suite's own grade `correct`). Per run, read from the compressed cache
before any question token or answer joins it:

    kv_bytes    compression.layers.cache_bytes: the bytes of the tensors the cache holds (a packed layer's codes,
                scales, zero points, kept channels and their indices, full-precision tails; compression.packed)
    full_bytes  what the uncompressed cache of the same prompt holds: positions x layers x KV heads x head_dim x
                (key + value) x the dtype's bytes (query-aware: context and question; query-agnostic: the context,
                the question joining after compression in full precision)
    bytes_share kv_bytes / full_bytes (kv_share, of the entries columns, counts the positions held only)
    axis        eviction, merging, channels (ThinK alone), quantization (KIVI alone), combined (more than one of
                them), full (the full cache): `axis`

The table (TABLE, one row per needle x policy x mode) is written as each needle finishes; a rerun skips the needles
whose every (policy, mode) row is there and runs only the missing policies of the others. RUN lists the runs that
wrote the table, each with its command, date, machine load after each needle and time. The figure set
`score-bytes` (score_bytes_plots) draws it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from datetime import date
from pathlib import Path

import pandas as pd
import torch

from ..compression.layers import cache_bytes
from ..core.models import load_model, model_name, sliding_layers
from ..core.progress import progress_bar
from ..policies import KIVI, KVzip, Merging, SnapKV, StreamingLLM, ThinK
from ..policies.base import FullCache, Policy
from ..policies.storage import Storage
from ..policies.wrapper import policy_chain
from .ablations import ABLATION_LENGTH, ANSWER_TOKENS
from .grid import build_context, dev_needle_specs
from .runner import MODES, run_retrieval

TABLE = "score_bytes.csv"
RUN = "score_bytes_run.json"
SAMPLES = 3  # haystacks per depth: the 15 dev needles
SHARES = (0.75, 0.5, 0.25, 0.125)  # positions kept, as a share of the prompt (the lab's float capacity)
AXES = ("full", "eviction", "merging", "channels", "quantization", "combined")


def kivi(bits: int, **settings) -> KIVI:
    """KIVI with keys and values at `bits` (the paper's KIVI-2 and KIVI-4), group 32 and residual 128."""
    return KIVI(key_bits=bits, value_bits=bits, **settings)


# The policies of the study, chosen before its results were read (docs/score_bytes.md says why each).
PLAN: tuple[Policy, ...] = (
    *(SnapKV(capacity=share) for share in SHARES),
    *(KVzip(capacity=share) for share in SHARES),
    StreamingLLM(capacity=0.25),
    Merging(capacity=0.5), Merging(capacity=0.25),
    ThinK(), ThinK(key_channel_ratio=0.75),
    kivi(4), kivi(2),
    ThinK(capacity=0.5),
    kivi(4, capacity=0.5), kivi(4, capacity=0.25), kivi(2, capacity=0.25),
    kivi(4, policy=ThinK(), capacity=0.25),
)

# Added after PLAN's results were read (docs/score_bytes.md says so): the best scorer there, KVzip, under KIVI-4, the
# best quantization there; run by --follow-up, on the same needles. KVzip with its uniform allocation (each layer and KV
# head the budget): a packed layer holds one count per layer, so KIVI refuses KVzip's global selection (storage.Storage.
# wrapped). These rows were computed before that refusal, labelled KIVI(policy=KVzip), by the same uniform selection.
# The last two, added after those rows were read (2026-11-29): KVzip-uniform alone, which splits what the composition
# loses between the allocation and the quantization.
FOLLOW_UP: tuple[Policy, ...] = (kivi(4, policy=KVzip(allocation="uniform"), capacity=0.25),
                                 kivi(4, policy=KVzip(allocation="uniform"), capacity=0.125),
                                 KVzip(allocation="uniform", capacity=0.25),
                                 KVzip(allocation="uniform", capacity=0.125))


def axis(policy: Policy) -> str:
    """Which axes of compression a policy uses (module doc): one name, "combined" for several, "full" for none."""
    if isinstance(policy, FullCache):
        return "full"
    storage = policy.storage or Storage()
    positional = "merging" if any(isinstance(p, Merging) for p in policy_chain(policy)) else "eviction"
    used = [name for name, uses in (
        (positional, policy.capacity is not None),
        ("channels", storage.prunes_channels), ("quantization", storage.quantizes)) if uses]
    if not used:
        raise ValueError(f"{policy.label} compresses along no axis: give it a capacity, pruned channels or bits")
    return used[0] if len(used) == 1 else "combined"


def short_label(policy: Policy) -> str:
    """The policy's axes in words, innermost first, for a figure: "SnapKV 0.25 + ThinK 0.4 + KIVI-4" (the table's
    `label` column holds the full label, every setting)."""
    parts = []
    for inner in reversed(list(policy_chain(policy))):
        if isinstance(inner, ThinK):
            parts.append(f"ThinK {inner.key_channel_ratio:g}")
        elif isinstance(inner, KIVI):
            bits = (inner.key_bits, inner.value_bits)
            parts.append(f"KIVI-{bits[0]}" if bits[0] == bits[1] else f"KIVI K{bits[0]}/V{bits[1]}")
        elif isinstance(inner, Merging):
            parts.append("Merging")
        elif inner.capacity is not None:  # the positional policy: a wrapper's copy of its budget shows once
            parts.append(f"{inner.scorer_label} {inner.capacity:g}")
    return " + ".join(parts) or policy.label


def full_bytes(model, positions: int) -> int:
    """Bytes of an uncompressed cache of `positions` positions on every layer: positions x layers x KV heads x
    head_dim x 2 (key and value) x the dtype's bytes. A model with sliding-window layers (whose cache holds a window,
    not the prompt) is refused: its full cache is not this count."""
    config = model.config.get_text_config()
    if sliding_layers(config):
        raise NotImplementedError(f"{config.name_or_path} has sliding-window layers: the score-against-bytes study "
                                  "counts a full cache of every position on every layer")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    itemsize = next(model.parameters()).element_size()
    return positions * config.num_hidden_layers * config.num_key_value_heads * head_dim * 2 * itemsize


def bytes_describer(model):
    """A run_retrieval describe hook: each run's label, short label, axis, kv_bytes, full_bytes and bytes_share
    (module doc)."""

    def describe(context, query, state, n_compressed: int) -> dict:
        held, full = cache_bytes(state.cache), full_bytes(model, n_compressed)
        return dict(label=state.policy.label, short=short_label(state.policy), axis=axis(state.policy),
                    kv_bytes=held, full_bytes=full,
                    bytes_share=held / full)

    return describe


def needle_rows(model, tokenizer, spec: dict, policies, modes=MODES, max_new_tokens: int = ANSWER_TOKENS
                ) -> pd.DataFrame:
    """One needle (a grid context spec) prefilled once, answered by the full cache and each policy at its own
    capacity in each mode: run_retrieval's rows with the bytes columns (module doc)."""
    context = build_context(tokenizer, spec)
    return run_retrieval(model, tokenizer, [context], policies=policies, capacities=None, modes=modes,
                         max_new_tokens=max_new_tokens, progress=False, describe=bytes_describer(model))


def read_table(path) -> pd.DataFrame:
    """The study's table as written (the needle's value and the answers stay text)."""
    return pd.read_csv(path, dtype={"expected": str, "output": str, "key": str})


def study(model, tokenizer, data_dir="data", *, samples: int = SAMPLES, length: int = ABLATION_LENGTH,
          needles: int | None = None, policies=PLAN, modes=MODES, max_new_tokens: int = ANSWER_TOKENS,
          command: str = "", progress: bool = True) -> pd.DataFrame:
    """Run (or resume) the study into data_dir/TABLE, needle by needle (module doc: the dev needles, `samples` per
    depth, in the grid's order: every depth of sample 0, then of sample 1, ...; `length` tokens, the committed tables'
    4000 unless a test asks fewer; `needles`: only the first ones, a trial run), and its record, added to RUN's.
    Returns the whole table."""
    labels = [p.label for p in policies]
    if len(set(labels)) < len(labels) or any(isinstance(p, FullCache) for p in policies):
        raise ValueError(f"policies must be distinct compressing policies (the full cache runs with each needle): "
                         f"{labels}")
    for policy in policies:  # a policy on no axis fails now, not after the first prefill
        axis(policy)
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    path = data_dir / TABLE
    table = read_table(path) if path.is_file() else pd.DataFrame()
    done = set() if table.empty else set(zip(table.depth, table["sample"], table["mode"], table.label, strict=True))
    earlier = json.loads((data_dir / RUN).read_text()) if (data_dir / RUN).is_file() else []
    name = model.config.name_or_path
    models = set(table.model.fillna("")) if not table.empty else set()  # a model without a name reads back empty
    if not table.empty and (set(table.length) != {length} or models != {name}):
        raise ValueError(f"{path} holds needles of {sorted(set(table.length))} tokens on {sorted(models)}, "
                         f"not {length} on {name}: give this run a data folder of its own")
    record = dict(command=command, date=date.today().isoformat(), model=name, samples=samples, length=length,
                  modes=list(modes), max_new_tokens=max_new_tokens, policies=labels, cpu_count=os.cpu_count(),
                  torch_threads=torch.get_num_threads(), load_average=[round(os.getloadavg()[0], 1)])
    started = time.perf_counter()
    specs = [dict(spec, n_tokens=length) for spec in dev_needle_specs(dict(samples=samples))][:needles]
    for spec in progress_bar(specs, desc="score against bytes", total=len(specs), disable=not progress):
        needle = (spec["depth"], spec["sample"])
        missing = [p for p in policies if any((*needle, mode, p.label) not in done for mode in modes)]
        if not missing:
            continue
        rows = needle_rows(model, tokenizer, spec, missing, modes, max_new_tokens)
        rows = rows[[(*needle, mode, label) not in done for mode, label in zip(rows["mode"], rows.label, strict=True)]]
        table = rows.reset_index(drop=True) if table.empty else pd.concat([table, rows], ignore_index=True)
        table.to_csv(path, index=False)
        done |= set(zip(rows.depth, rows["sample"], rows["mode"], rows.label, strict=True))
        # after every needle, so that a run stopped part way says what it ran and under what load
        record.update(needles_done=int(table.groupby(["depth", "sample"]).ngroups),
                      seconds_this_run=round(time.perf_counter() - started))
        record["load_average"].append(round(os.getloadavg()[0], 1))
        (data_dir / RUN).write_text(json.dumps([*earlier, record], indent=1) + "\n")
    return read_table(path)  # as a resumed run reads it


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a bundled model (default SmolLM2-135M-Instruct)")
    parser.add_argument("--data-dir", default=None, help="default data/ (data/<model>/ for another model)")
    parser.add_argument("--samples", type=int, default=SAMPLES, help="haystacks per depth (5 depths)")
    parser.add_argument("--needles", type=int, default=None, help="only the first N needles (a trial run)")
    parser.add_argument("--follow-up", action="store_true", help="PLAN and FOLLOW_UP (chosen after PLAN's results)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default torch's)")
    args = parser.parse_args(argv)
    from ..core.figure_files import model_folders

    if args.threads:
        torch.set_num_threads(args.threads)
    data_dir = args.data_dir or model_folders("data", "figures", args.model)[0]
    model, tokenizer = load_model(args.model)
    command = shlex.join(["python", "-m", "snapkv_lab.pressure.score_bytes", *(sys.argv[1:] if argv is None else argv)])
    study(model, tokenizer, data_dir, samples=args.samples, needles=args.needles, modes=tuple(args.modes),
          policies=PLAN + FOLLOW_UP if args.follow_up else PLAN, command=command)
    print(f"{model_name(args.model)}: {Path(data_dir) / TABLE}", file=sys.stderr)


if __name__ == "__main__":
    main()
