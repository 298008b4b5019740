"""Command line: `snapkv-lab <command>` (also `python -m snapkv_lab <command>`).

Each command module registers itself in COMMANDS: name -> (help, add_arguments(parser), run(args)).
"""

from __future__ import annotations

import argparse
import sys

COMMANDS: dict[str, tuple] = {}


def command(name: str, help: str):
    """Decorator for `run(args)`; the decorated function's `arguments` attribute adds its options."""

    def register(run):
        COMMANDS[name] = (help, run)
        return run

    return register


def _load_commands() -> None:
    # Imported here, not at package import, so `import snapkv_lab` stays light.
    from . import commands  # noqa: F401


def main(argv=None) -> int:
    _load_commands()
    parser = argparse.ArgumentParser(prog="snapkv-lab", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, run) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        getattr(run, "arguments", lambda parser: None)(p)
        p.set_defaults(run=run)
    args = parser.parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
