"""Moved to snapkv_lab.app.cli (2026-11-28): an alias that warns, for one release (`python -m snapkv_lab.cli` runs)."""

from .core.moved import moved

if __name__ == "__main__":
    import sys

    from .app.cli import main

    sys.exit(main())
moved(__name__, "snapkv_lab.app.cli")
