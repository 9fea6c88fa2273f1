"""The package's layering, read from its source: imports point one way.

Every import counts, module-level, lazy (inside a function) and under TYPE_CHECKING alike: a lazy
import still makes one module depend on another."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# where each part of the lmbatch namespace lives (pyproject.toml's package-dir)
SOURCES = {"lmbatch": ROOT / "lmbatch", "lmbatch.programs": ROOT / "programs",
           "lmbatch.kernels": ROOT / "kernels", "lmbatch.scheduler": ROOT / "scheduler"}
REGISTRY = "lmbatch.frontend.registry"     # the one lmbatch module that finds the built-in programs


def _modules() -> dict[str, Path]:
    out = {}
    for prefix, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([prefix, *parts])] = path
    return out


MODULES = _modules()


def _imports(name: str) -> set[str]:
    """The lmbatch modules `name` imports (a package's own __init__ counts as the package)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + [base]).strip(".")
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in MODULES and t != name)
    return found


GRAPH = {name: _imports(name) for name in MODULES}


def test_the_namespace_is_found():
    assert {"lmbatch.engine.engine", "lmbatch.programs.mmlu", "lmbatch.kernels.fused",
            "lmbatch.scheduler.planner", REGISTRY} <= set(MODULES)
    assert GRAPH["lmbatch.engine.engine"] >= {"lmbatch.engine.prefill", "lmbatch.scheduler.planner"}


def test_only_the_registry_imports_programs():
    offenders = {m for m, deps in GRAPH.items() if not m.startswith("lmbatch.programs") and m != REGISTRY
                 and any(d.startswith("lmbatch.programs") for d in deps)}
    assert not offenders


def test_kernels_import_nothing_from_lmbatch():
    assert not {m: deps for m, deps in GRAPH.items() if m.startswith("lmbatch.kernels") and deps
                and any(not d.startswith("lmbatch.kernels") for d in deps)}


def test_lower_layers_do_not_import_higher_ones():
    layers = [("lmbatch.requests", "lmbatch.errors"), ("lmbatch.kernels",), ("lmbatch.attention", "lmbatch.model"),
              ("lmbatch.scheduler",), ("lmbatch.engine",), ("lmbatch.frontend",), ("lmbatch.data",),
              ("lmbatch.programs",),
              ("lmbatch.runner", "lmbatch.cli", "lmbatch.baseline", "lmbatch.report", "lmbatch.outputs",
               "lmbatch.lm_eval")]

    def layer(m: str) -> int | None:
        for k, prefixes in enumerate(layers):
            if any(m == p or m.startswith(p + ".") for p in prefixes):
                return k
        return None

    upward = [(m, d) for m, deps in GRAPH.items() for d in deps
              if layer(m) is not None and layer(d) is not None and layer(d) > layer(m)    # type: ignore[operator]
              and not (m == REGISTRY and d.startswith("lmbatch.programs"))]
    assert not upward


def test_no_import_cycles():
    state: dict[str, int] = {}      # 1: on the current path, 2: done
    cycles = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(GRAPH[m]):
            if state.get(d) == 1:
                cycles.append(path[path.index(d):] + [d])
            elif d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m, [m])
    assert not cycles


def test_classes_and_functions_stay_small():
    """One responsibility each: no class over 250 lines, no function over 60 (docstrings included)."""
    big = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > (250 if isinstance(node, ast.ClassDef) else 60):
                    big.append(f"{name}.{node.name}: {lines} lines")
    assert not big
