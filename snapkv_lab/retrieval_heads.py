"""Moved to snapkv_lab.policies.retrieval_heads and snapkv_lab.findings.heads_study (2026-11-28): an alias that warns,
for one release."""

from .core.moved import moved

moved(__name__, "snapkv_lab.policies.retrieval_heads", "snapkv_lab.findings.heads_study")
