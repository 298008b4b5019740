"""The module paths of the flat package (before 2026-11-28), kept for one release as aliases that warn.

Each former module is a two-line file calling `moved(__name__, new, ...)`: importing it warns (DeprecationWarning)
and hands back the module that now holds its names, the very module object, so that a monkeypatch through the old
path reaches the code that reads it. A former module whose names went to several modules is an `Alias` that reads
and writes each name in the module holding it. `snapkv_lab.capture` names the function, as it always did: its old
module path is registered with the package (snapkv_lab/__init__.py), so that importing it never replaces the function.

Keyword names go the same way: `renamed` lets a function take a keyword by its former name, warning.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
import types
import warnings

RELEASE = "2026-11-28"


def moved(old: str, *new: str) -> None:
    """Stand the modules `new` (the first holds most of the names) in for the former module `old` (its __name__)."""
    warnings.warn(f"{old} moved to {' and '.join(new)} on {RELEASE}; the old path is an alias for one release",
                  DeprecationWarning, stacklevel=3)
    sys.modules[old] = importlib.import_module(new[0]) if len(new) == 1 else Alias(old, new)


class Alias(types.ModuleType):
    """A former module whose names now live in several modules: each name is read, set and deleted in the first of
    `new` that holds it (a name none holds is set in the first). warn_on_use: warn at the first name read, for an
    alias registered before anyone imports it (snapkv_lab.capture)."""

    def __init__(self, old: str, new: tuple[str, ...], warn_on_use: bool = False):
        super().__init__(old, f"Moved to {' and '.join(new)} on {RELEASE}: an alias for one release.")
        super().__setattr__("_new", tuple(new))
        super().__setattr__("_warn_on_use", warn_on_use)

    def _modules(self) -> list[types.ModuleType]:
        return [importlib.import_module(name) for name in self._new]

    def _owner(self, name: str) -> types.ModuleType:
        modules = self._modules()
        return next((module for module in modules if hasattr(module, name)), modules[0])

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if self._warn_on_use:
            super().__setattr__("_warn_on_use", False)
            warnings.warn(f"{self.__name__} moved to {' and '.join(self._new)} on {RELEASE}; the old path is an alias "
                          "for one release", DeprecationWarning, stacklevel=2)
        owner = self._owner(name)
        if not hasattr(owner, name):
            raise AttributeError(f"module {self.__name__!r} (moved to {' and '.join(self._new)}) has no attribute "
                                 f"{name!r}")
        return getattr(owner, name)

    def __setattr__(self, name: str, value) -> None:
        if name.startswith("__"):
            super().__setattr__(name, value)
        else:
            setattr(self._owner(name), name, value)

    def __delattr__(self, name: str) -> None:
        delattr(self._owner(name), name)

    def __dir__(self) -> list[str]:
        return sorted({name for module in self._modules() for name in dir(module)})


def renamed(since: str, **renames: str):
    """Decorator: the function also takes a keyword by its name before `since` (renames: old name=new name), warning
    (DeprecationWarning) and passing it on under the new name. Only the renames the function can take apply: its
    parameters' names, or any name where it takes **keywords. Old and new name given together are refused
    (TypeError), as Python refuses a keyword given twice. Returns the decorator."""
    def decorate(function):
        parameters = inspect.signature(function).parameters.values()
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
        olds = {old: new for old, new in renames.items() if takes_any or new in {p.name for p in parameters}}

        @functools.wraps(function)
        def with_old_names(*args, **keywords):
            for old in olds.keys() & keywords.keys():
                new = olds[old]
                if new in keywords:
                    raise TypeError(f"{function.__name__}() got both {old!r} and {new!r}, one keyword under its "
                                    f"name before {since} and today's: pass {new!r} alone")
                warnings.warn(f"{function.__name__}(): the keyword {old!r} is now named {new!r} (since {since})",
                              DeprecationWarning, stacklevel=2)
                keywords[new] = keywords.pop(old)
            return function(*args, **keywords)
        return with_old_names
    return decorate
