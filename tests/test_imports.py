"""The package's shape: no two modules import each other, directly or through others, at any depth of the code
(an import inside a function counts: it hides a circle, it does not remove it)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "snapkv_lab"


def module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the package's modules it imports anywhere in its code (`from .x import y` names .x.y where that
    is a module, else .x)."""
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[:len(package.split(".")) - max(node.level - 1, 0)] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                for alias in node.names:
                    found.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in modules else target)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
        graph[name] = {target for target in found if target in modules and target != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in graph[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for module in graph:
        if module not in index:
            visit(module)
    return found


def test_the_circle_finder_finds_a_circle_through_a_function_level_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_package_has_no_import_circle():
    modules = module_names()
    graph = imports(modules)
    # the graph reads relative imports
    assert "snapkv_lab.pressure.tables" in graph["snapkv_lab.pressure.pressure_plots"]
    assert circles(graph) == []


def test_every_module_imports_first_in_a_fresh_interpreter():
    """The static graph cannot see a package's __init__ running its submodules, nor the lazy registries: importing
    pressure.tasks runs pressure/__init__ (its suites build HeadKV, whose module reads retrieval_heads), so a module
    that imported HeadKV first once met a partially initialised module. Each module is imported first here, with
    every snapkv_lab module dropped before it (torch and transformers stay loaded: one process is enough), then the
    registry's policies, each first."""
    import subprocess
    import sys

    script = f"""
import importlib, sys
names = {sorted(n for n in module_names() if not n.endswith('__main__'))!r}  # __main__ runs the CLI
def fresh(step):
    for loaded in [m for m in sys.modules if m == "snapkv_lab" or m.startswith("snapkv_lab.")]:
        del sys.modules[loaded]
    step()
import torch, transformers
for name in names:
    fresh(lambda: importlib.import_module(name))
import snapkv_lab.policies as registry
for policy in registry.POLICY_NAMES:
    fresh(lambda: getattr(importlib.import_module("snapkv_lab"), policy))
print("imported", len(names), "modules")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=PACKAGE.parent,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "imported" in out.stdout


def test_compression_and_eval_need_no_plotting_stack():
    """A GPU server that runs `snapkv_lab.evaluate` may lack the notebook stack (the lent H100's image has no plotly):
    the policies, generation, capture and the eval run import without plotly, ipywidgets, anywidget, matplotlib and
    seaborn, which the figures import where they are drawn."""
    import subprocess
    import sys

    script = """
import sys
for name in ("plotly", "ipywidgets", "anywidget", "matplotlib", "seaborn"):
    sys.modules[name] = None  # `import name` now raises ImportError
import snapkv_lab
from snapkv_lab.evaluation import evaluate, run_example
print(len(snapkv_lab.POLICIES), "policies", snapkv_lab.generate.__name__, snapkv_lab.capture.__name__)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=PACKAGE.parent,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[:2] == [str(len(__import__("snapkv_lab").POLICIES)), "policies"]
