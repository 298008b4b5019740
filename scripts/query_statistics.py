"""Compute one model's query statistics for ExpectedAttention(statistics="shipped") (kvpress's
ExpectedAttentionStatsPress) by kvpress's recipe, offline, on the lab's own texts (snapkv_lab.policies.query_statistics:
100 pieces of 1000 characters of the Paul Graham essays standing in for booksum, the first 4 tokens of each left out).

    python3 scripts/query_statistics.py --model smollm2                 # into the cache folder
    python3 scripts/query_statistics.py --model gemma-3-270m --ship --threads 1  # into the package (shipped)

Writes the statistics (safetensors, bfloat16) with a record of the data, the token count and the time in its metadata.
Run it under `nice -n 10` on a shared machine.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import time

import torch
import transformers

from snapkv_lab.core.models import cache_dir, load_model
from snapkv_lab.policies import query_statistics as qs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--ship", action="store_true", help="write into the package (policies/weights/...)")
    parser.add_argument("--threads", type=int,
                        help="torch threads (1 ran far faster than 2 on a loaded 2-core machine)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    texts = qs.sample_texts()
    start = time.perf_counter()
    statistics = qs.collect(model, tokenizer, texts)
    seconds = time.perf_counter() - start
    tokens = sum(len(tokenizer(text)["input_ids"]) for text in texts)
    folder = qs.SHIPPED if args.ship else cache_dir() / "expected_attention"
    path = folder / qs.statistics_name(model)
    record = {"model": args.model, "texts": f"{qs.SAMPLES} x {qs.SAMPLE_CHARS} characters of the Paul Graham essays",
              "tokens": tokens, "queries_per_head": tokens - qs.N_SINK * len(texts), "n_sink": qs.N_SINK,
              "layers": sorted(statistics), "seconds": round(seconds, 1), "dtype": str(model.dtype),
              "date": datetime.date.today().isoformat(), "torch": torch.__version__,
              "transformers": transformers.__version__, "machine": platform.machine(),
              "threads": torch.get_num_threads()}
    qs.save(path, statistics, record)
    print(f"{path} ({path.stat().st_size / 1e6:.2f} MB): {record}")


if __name__ == "__main__":
    main()
