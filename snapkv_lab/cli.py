"""Command line: `snapkv-lab <command>`, also `python -m snapkv_lab <command>` or `python -m snapkv_lab.cli <command>`.

The commands are the table `commands.COMMANDS`; this module only turns it into a parser and dispatches.
"""

from __future__ import annotations

import argparse
import sys

from .commands import COMMANDS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="snapkv-lab", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, command in COMMANDS.items():
        command.arguments(sub.add_parser(name, help=command.help, description=command.help))
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return int(COMMANDS[args.command].run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
