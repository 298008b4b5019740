"""The package's layers, read from the source: no module imports a layer above its own, not even inside a function
body; the top level holds the facade and the aliases of former paths only; no two modules share a name.

    core < tasks < policies < compression < views, sweep < findings, pressure, evaluation < app

Layers of one rank (views and sweep; the three studies) import none of each other either: each stands on the ones
below alone. docs/getting-started.md, "Code layout", draws the same order.
"""

from __future__ import annotations

import ast

from test_imports import imports, module_names

RANKS = {"core": 0, "tasks": 1, "policies": 2, "compression": 3, "views": 4, "sweep": 4, "findings": 5, "pressure": 5,
         "evaluation": 5, "app": 6}
FACADE = {"snapkv_lab", "snapkv_lab.__main__"}  # the package's own top: its public names, `python -m snapkv_lab`


def layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in RANKS else None


def is_alias(path) -> bool:
    """A former module path (core.moved): a file whose only call hands its name to the modules that hold it now."""
    calls = [node.func for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Call)]
    return any(isinstance(f, ast.Name) and f.id == "moved" for f in calls) and path.name != "moved.py"


def violations(graph: dict[str, set[str]], aliases: set[str]) -> list[tuple[str, str]]:
    """(module, imported) for every import that leaves a module's layer for one not below it: a higher layer,
    another layer of the same rank, the facade, or a former path."""
    found = []
    for module, targets in graph.items():
        own = layer(module)
        if own is None:
            continue
        for target in targets:
            other = layer(target)
            allowed = other == own or (other is not None and RANKS[other] < RANKS[own])
            if not allowed or target in aliases or target in FACADE:
                found.append((module, target))
    return sorted(found)


def package():
    modules = module_names()
    aliases = {name for name, path in modules.items() if is_alias(path)}
    return modules, aliases


def test_no_import_runs_up_a_layer():
    modules, aliases = package()
    assert violations(imports(modules), aliases) == []


def test_the_check_catches_an_import_up_a_layer_or_across_one():
    graph = {"snapkv_lab.policies.kvzip": {"snapkv_lab.compression.layers", "snapkv_lab.core.hooks"},
             "snapkv_lab.views.heads": {"snapkv_lab.sweep.store"},
             "snapkv_lab.pressure.runner": {"snapkv_lab.evaluation.run", "snapkv_lab.pressure.tables"},
             "snapkv_lab.findings.experiments": {"snapkv_lab", "snapkv_lab.metrics"},
             "snapkv_lab.app.cli": {"snapkv_lab.core.models"}}
    assert violations(graph, {"snapkv_lab.metrics"}) == [
        ("snapkv_lab.findings.experiments", "snapkv_lab"), ("snapkv_lab.findings.experiments", "snapkv_lab.metrics"),
        ("snapkv_lab.policies.kvzip", "snapkv_lab.compression.layers"),
        ("snapkv_lab.pressure.runner", "snapkv_lab.evaluation.run"),
        ("snapkv_lab.views.heads", "snapkv_lab.sweep.store")]


def test_every_module_sits_in_a_layer_and_the_top_level_is_small():
    modules, aliases = package()
    outside = sorted(name for name in modules if layer(name) is None and name not in aliases | FACADE)
    assert outside == []
    assert len(FACADE) <= 8


def test_module_names_are_unique():
    modules, aliases = package()
    names = [name.rpartition(".")[2] for name, path in modules.items()
             if name not in aliases and path.name != "__init__.py"]
    assert sorted(name for name in set(names) if names.count(name) > 1) == []
