"""Measure one model's calibrations at their defaults and ship them in the package, as the authors publish theirs:
the retrieval heads' table (HeadKV, DuoAttention: snapkv_lab.policies.retrieval_heads) and Q-Filters' query filters
(snapkv_lab.policies.query_filters). A shipped file is read before the cache folder, under the name the cache would
give it (the model's name and a hash of a sample of its weights and of the settings), so it serves only the weights
and settings it was measured with; rerun this after changing either measurement.

    python3 scripts/ship_calibrations.py --model smollm2 --threads 1    # about 95 s on one core

Run it under `nice -n 10` on a shared machine.
"""

from __future__ import annotations

import argparse
import time

import torch

from snapkv_lab.core.models import load_model
from snapkv_lab.policies import query_filters, retrieval_heads
from snapkv_lab.policies.trained_weights import PACKAGED


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--threads", type=int, help="torch threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)

    ship("retrieval_heads", retrieval_heads.table_path(model).name,
         lambda: retrieval_heads.retrieval_heads(model, tokenizer, cache=False),
         lambda table, target: table.to_csv(target, index=False))
    ship("query_filters", query_filters.filters_path(model).name,
         lambda: query_filters.query_filters(model, tokenizer, cache=False).cpu(), torch.save)


def ship(folder: str, name: str, measure, save) -> None:
    """Measure a calibration and save it as PACKAGED/folder/name (save(value, path)), saying how long it took."""
    start = time.perf_counter()
    value = measure()
    target = PACKAGED / folder / name
    target.parent.mkdir(parents=True, exist_ok=True)
    save(value, target)
    print(f"{target} ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
