"""Moved to snapkv_lab.policies.query_filters (2026-11-28): an alias that warns, for one release."""

from .core.moved import moved

moved(__name__, "snapkv_lab.policies.query_filters")
