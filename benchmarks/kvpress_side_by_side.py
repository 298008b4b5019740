"""Side by side with NVIDIA kvpress 0.5.5: which prompt positions each of our policies keeps, next to what the
matching kvpress press keeps, layer by layer and KV head by KV head, on the bundled SmolLM2-135M-Instruct.

    bash scripts/kvpress_venv.sh                      # once (cached): kvpress in its own venv
    python3 benchmarks/kvpress_side_by_side.py        # --tokens 1000 --ratio 0.75 by default

The rows, both halves and the comparison are benchmarks/kvpress_peer.py's, which tests/test_peer.py
(`pytest -m peer`) asserts on; this script prints and saves the whole table, pending rows included.
Output: a markdown table on stdout, benchmarks/results/kvpress_side_by_side.{csv,md} and the per-layer detail
in kvpress_side_by_side_layers.csv.

Columns: jaccard = |ours & theirs| / |ours | theirs| of the kept position sets of one layer and KV head;
jaccard_mean over every (layer, KV head); jaccard_min_layer the worst layer's mean over its KV heads;
identical_layers the fraction of layers whose sets are equal in every KV head; kept_ours / kept_theirs the
positions kept per KV head (mean; min-max when budgets vary by layer or head); status "ok", or "pending: what
our side still lacks" (measured anyway, never asserted).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pandas as pd
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's snapkv_lab, before any installed copy (and before _common imports it)
from _common import markdown  # noqa: E402 (benchmarks/ is on sys.path when this script runs)
from kvpress_peer import N_TOKENS, RATIO, ROWS, default_venv, side_by_side, venv_problem  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=N_TOKENS, help=f"prompt length (default {N_TOKENS})")
    parser.add_argument("--ratio", type=float, default=RATIO, help=f"kvpress compression_ratio, fraction removed (default {RATIO})")
    parser.add_argument("--venv", type=Path, default=None, help=f"kvpress venv (default {default_venv()}, or $KVPRESS_VENV)")
    parser.add_argument("--only", nargs="*", help="row labels to run (default all)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the csv/md results")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if not 0 < args.ratio < 1:
        sys.exit(f"--ratio must lie in (0, 1), got {args.ratio}")
    venv = args.venv or default_venv()
    if problem := venv_problem(venv):
        sys.exit(problem)
    rows = [row for row in ROWS if not args.only or row.label in args.only]
    if args.only and len(rows) != len(args.only):
        sys.exit(f"unknown rows {sorted(set(args.only) - {row.label for row in rows})}; rows: {[row.label for row in ROWS]}")

    import snapkv_lab

    start = time.perf_counter()
    result = side_by_side(venv, rows, args.tokens, args.ratio)
    print(result.kvpress_log, file=sys.stderr)
    print(f"both sides: {time.perf_counter() - start:.0f} s (ours {result.seconds['ours']:.0f} s, kvpress's worker "
          f"{result.seconds['kvpress']:.0f} s)", file=sys.stderr)

    summary, detail = [], []
    for label, agreement in result.rows.items():
        status = f"pending: {agreement.pending}" if agreement.pending else "ok"
        line = dict(method=label, ours=agreement.policy_label, kvpress=agreement.row.press.format(ratio=args.ratio),
                    status=status)
        if agreement.error:
            summary.append({**line, "note": f"kvpress failed: {agreement.error}. {agreement.row.why}"})
            continue
        worst = agreement.worst_layer
        summary.append({**line, "jaccard_mean": round(agreement.jaccard_mean, 4),
                        "jaccard_min_layer": round(agreement.layers[worst]["jaccard"], 4), "worst_layer": worst,
                        "identical_layers": round(agreement.identical_layers, 4), "kept_ours": agreement.kept("ours"),
                        "kept_theirs": agreement.kept("theirs"), "note": agreement.row.why})
        detail += [dict(method=label, layer=i, jaccard=round(layer["jaccard"], 4), identical=layer["identical"],
                        kept_ours=" ".join(map(str, layer["kept_ours"])), kept_theirs=" ".join(map(str, layer["kept_theirs"])))
                   for i, layer in enumerate(agreement.layers)]

    table = pd.DataFrame(summary)
    header = (f"kvpress {result.versions['kvpress']} (transformers {result.versions['transformers']}) vs "
              f"snapkv_lab {snapkv_lab.__version__} (transformers {__import__('transformers').__version__}) on "
              f"{result.model}, fp32, sdpa, {torch.get_num_threads()} threads; {result.n_tokens}-token "
              f"prompt (chat template head + Paul Graham essays), compression_ratio {args.ratio}, n_kept = capacity = "
              f"{result.capacity}; max |logit gap| of the two uncompressed prefills: {result.logit_gap:.2e}")
    shown = table.astype(object).where(table.notna(), "-")
    markdown_table = markdown(shown, {c: ".4f" for c in table.columns if c.startswith(("jaccard", "identical"))})
    print(header + "\n\n" + markdown_table)
    args.out.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out / "kvpress_side_by_side.csv", index=False)
    pd.DataFrame(detail).to_csv(args.out / "kvpress_side_by_side_layers.csv", index=False)
    (args.out / "kvpress_side_by_side.md").write_text(
        f"# snapkv_lab vs kvpress, kept positions\n\n{header}\n\nCommand: `python3 benchmarks/kvpress_side_by_side.py "
        f"--tokens {args.tokens} --ratio {args.ratio}`\n\n{markdown_table}\n")
    print(f"\nwrote {args.out}/kvpress_side_by_side.csv, .md and kvpress_side_by_side_layers.csv", file=sys.stderr)


if __name__ == "__main__":
    main()
