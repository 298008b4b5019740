"""What RULER's own protocol (issue 53) changes in the committed RULER tables' prompts, without running a model.

    python benchmarks/ruler_protocol_change.py        # prints a summary; benchmarks/results/ruler_protocol_change.csv

For every example of data/eval_ruler*.csv and data/gemma-3-270m/eval_*.csv, its prompt as the table ran it (the
spec as written: the lab's former sizing, cwe's solved example inline) and as RULER's sizing and cwe turn build it
(sizing="official", cwe_shots="turn"), both framed as the table's rows were (its `framing` column) with the model's
own tokenizer: whether the token ids differ, and by how much the new prompt is shorter. The needles, keys and answers
are the same draws in both; only the haystack's size (and cwe's frame) moves.
"""

from __future__ import annotations

import glob
import json
from pathlib import Path

import pandas as pd
from transformers import AutoTokenizer

from snapkv_lab.core.models import bundled_checkpoint
from snapkv_lab.evaluation.prompting import encode_example
from snapkv_lab.evaluation.ruler import RULER

ROOT = Path(__file__).parent.parent


def main() -> None:
    tokenizers = {}
    rows = []
    for path in sorted(glob.glob(str(ROOT / "data" / "eval_ruler*.csv"))
                       + glob.glob(str(ROOT / "data" / "gemma-3-270m" / "eval_*.csv"))):
        table = pd.read_csv(path, dtype=str)
        model, framing = table.model.iloc[0], table.framing.iloc[0]
        tokenizer = tokenizers.setdefault(model, AutoTokenizer.from_pretrained(bundled_checkpoint(model)))
        for text in table.spec.unique():
            spec = json.loads(text)
            official = dict(spec, sizing="official") | ({"cwe_shots": "turn"} if spec["task"] == "cwe" else {})
            ids = []
            for example in (RULER.example(spec, tokenizer), RULER.example(official, tokenizer)):
                encoded = encode_example(tokenizer, example, framing=framing)
                ids.append(encoded.context_ids + encoded.questions[0])
            rows.append(dict(table=str(Path(path).relative_to(ROOT)), task=spec["task"], length=spec["length"],
                             index=spec["index"], tokens=len(ids[0]), official_tokens=len(ids[1]),
                             differs=ids[0] != ids[1]))
    frame = pd.DataFrame(rows)
    frame["shorter"] = 1 - frame.official_tokens / frame.tokens
    out = ROOT / "benchmarks" / "results" / "ruler_protocol_change.csv"
    frame.to_csv(out, index=False)
    summary = frame.groupby("table", sort=False).agg(examples=("task", "size"), differ=("differs", "sum"),
                                                     mean_shorter=("shorter", "mean"), most_shorter=("shorter", "max"))
    print(summary.to_string(float_format="{:.3f}".format))


if __name__ == "__main__":
    main()
