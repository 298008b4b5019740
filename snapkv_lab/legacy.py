"""Moved to snapkv_lab.findings.legacy (2026-11-28): an alias that warns, for one release."""

from .core.moved import moved

moved(__name__, "snapkv_lab.findings.legacy")
