"""Command line: `snapkv-lab <command>`, also `python -m snapkv_lab <command>` or `python -m snapkv_lab.cli <command>`.

The commands are the table `commands.COMMANDS`; this module only turns it into a parser and dispatches.
"""

from __future__ import annotations

import argparse
import sys

from ..core import __version__
from .commands import COMMANDS

DESCRIPTION = """\
snapkv_lab: see where an LLM's attention goes, and what a SnapKV-compressed KV cache keeps.
The command line reruns the project's experiments on the bundled SmolLM2-135M-Instruct (or --model) and
redraws its figures from the tables in data/; the library itself is used from Python and notebooks."""


class _Parser(argparse.ArgumentParser):
    """argparse's parser, its mistakes said in one line (argparse prints its whole usage first); the subcommands'
    parsers are of this class too (add_subparsers makes them of the parent's)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the options)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="snapkv-lab", description=DESCRIPTION,
                                     epilog="Run `snapkv-lab <command> --help` for a command's options.",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"snapkv-lab {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, command in COMMANDS.items():
        command.arguments(sub.add_parser(name, help=command.help, description=command.help))
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if "executor" in vars(args):  # the check run_cells makes, said before any model loads or cell runs
        from ..sweep import check_executor

        try:
            check_executor(args.executor, ray_address=args.ray_address, cpus_per_worker=args.cpus_per_worker)
        except ValueError as err:
            print(f"snapkv-lab {args.command}: error: {err}", file=sys.stderr)
            return 2
    # A model nothing can load is said in one line, before torch is imported (a plain redraw loads no model).
    if "model" in vars(args) and getattr(args, "recompute", True):
        from ..core.models import check_model

        try:
            check_model(args.model)
        except (OSError, ImportError, ValueError) as err:
            print(f"snapkv-lab {args.command}: error: {err}", file=sys.stderr)
            return 2
    return int(COMMANDS[args.command].run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
