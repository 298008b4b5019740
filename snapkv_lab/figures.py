"""Moved to snapkv_lab.app.figure_sets and snapkv_lab.core.figure_files (2026-11-28): an alias that warns, for one
release."""

from .core.moved import moved

moved(__name__, "snapkv_lab.app.figure_sets", "snapkv_lab.core.figure_files")
