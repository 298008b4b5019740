"""Write the generated multi-turn suite (snapkv_lab.tasks.turn_needles) as a SCBench --source folder.

    python scripts/scbench_turns.py ~/.cache/snapkv_lab/scbench_turns/essays-1500 --rows 16 --words 1500
    snapkv-lab eval --dataset scbench --multi-turn --tasks scbench_qa_eng --source DIR ...

The essays are read at run time and never committed: the folder lives outside the repository.
"""

import argparse
from pathlib import Path

from snapkv_lab.tasks.turn_needles import ORDERS, turn_needle_rows, write_suite


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--words", type=int, default=1500)
    parser.add_argument("--needles", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--haystack", default="essays", help="essays, pydoc or code (snapkv_lab.tasks.corpus)")
    parser.add_argument("--order", default="balanced", choices=ORDERS,
                        help="the turns' order of the needles' depth bands (snapkv_lab.tasks.turn_needles)")
    args = parser.parse_args()
    rows = turn_needle_rows(args.rows, words=args.words, needles=args.needles, seed=args.seed, source=args.haystack,
                            order=args.order)
    write_suite(args.folder, rows)


if __name__ == "__main__":
    main()
