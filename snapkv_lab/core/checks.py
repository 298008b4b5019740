"""Checks of the settings a user passes: one message for every integer setting, so that a bad value reads alike
wherever it is refused."""

from __future__ import annotations


def check_int(name: str, value, minimum: int = 0, *, optional: bool = False, why: str = "", kind: str = "") -> None:
    """Refuse `value` unless it is an int (a bool is not) of at least `minimum`, or None where `optional`. The message
    names the setting, what it must be and what it got: "kernel_size must be a positive int, got 0". why: a clause
    added after what it must be; kind: what it must be, in other words than the default ("at least 1")."""
    if optional and value is None:
        return
    if isinstance(value, int) and not isinstance(value, bool) and value >= minimum:
        return
    kind = kind or {0: "a non-negative int", 1: "a positive int"}.get(minimum, f"an int of at least {minimum}")
    alternatives = " or None" if optional else ""
    raise ValueError(f"{name} must be {kind}{alternatives}{why}, got {value!r}")
