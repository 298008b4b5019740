"""Checks of the settings a user passes: one message for every integer setting, and one for every unknown name
(with the closest known ones), so that a bad value reads alike wherever it is refused. Nothing here imports torch:
the command line checks names with these before it loads the library."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping, Sequence


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


def did_you_mean(names: Sequence[str], known: Iterable[str]) -> str:
    """The closest of `known` to each of `names` (difflib, case aside), as a clause to append to a refusal:
    " (did you mean SnapKV?)", or for several names " (did you mean vt for 'vtt', cwe for 'cew'?)"; "" where none is
    close. Returns the clause."""
    by_lower: dict[str, str] = {}
    for name in known:
        by_lower.setdefault(name.lower(), name)
    closest = {name: difflib.get_close_matches(str(name).lower(), by_lower, n=1) for name in names}  # None: no name
    hints = {name: by_lower[match[0]] for name, match in closest.items() if match}
    if not hints:
        return ""
    if len(names) == 1:
        return f" (did you mean {hints[names[0]]}?)"
    return f" (did you mean {', '.join(f'{match} for {name!r}' for name, match in hints.items())}?)"


def check_names(names: Sequence[str], known: Sequence[str], what: str) -> None:
    """Refuse the names not among `known`, in one line: "unknown suites ['needles'] (did you mean needle?); the suites
    are needle, lines, ..."; `what` names them in the plural."""
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"unknown {what} {unknown}{did_you_mean(unknown, known)}; the {what} are {', '.join(known)}")


def check_datasets_and_tasks(datasets: Sequence[str], tasks: Sequence[str] | None,
                             tasks_of: Mapping[str, Sequence[str]]) -> None:
    """Refuse a dataset `tasks_of` ({dataset: its task names}) lacks, or a task that none of `datasets` has, in one
    line with the closest names. `snapkv-lab eval` checks its options so before it imports torch (from a table of the
    names, app.catalog), evaluation.eval_cells again from the registry: one message either way."""
    for name in datasets:
        if name not in tasks_of:
            raise ValueError(f"unknown dataset {name!r}{did_you_mean([name], tasks_of)}; the datasets are "
                             f"{', '.join(tasks_of)}")
    known = [task for name in datasets for task in tasks_of[name]]
    unknown = [task for task in tasks or () if task not in known]
    if unknown:
        listing = "; ".join(f"{name}: {', '.join(tasks_of[name])}" for name in datasets)
        raise ValueError(f"unknown tasks {unknown} for {list(datasets)}{did_you_mean(unknown, known)}; the tasks are "
                         f"{listing}")
