"""The `snapkv-lab` subcommands. Each is a thin wrapper over a library function."""

from __future__ import annotations

from .cli import command


@command("convert", "Convert the bundled SmolLM2 GGUF once into the cache folder and print its path.")
def convert(args) -> int:
    from .models import bundled_checkpoint

    print(bundled_checkpoint())
    return 0
