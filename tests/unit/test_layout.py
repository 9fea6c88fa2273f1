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
REGISTRY = "lmbatch.programs.registry"     # the one module outside the programs' own that names them


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
    assert GRAPH["lmbatch.engine.stream"] >= {"lmbatch.engine.prefill", "lmbatch.scheduler.planner"}


def test_only_the_registry_imports_programs():
    """Outside lmbatch.programs, a module finds a built-in program through the registry alone."""
    offenders = {m for m, deps in GRAPH.items() if not m.startswith("lmbatch.programs")
                 and any(d.startswith("lmbatch.programs") and d != REGISTRY for d in deps)}
    assert not offenders


def _imported_by_name(name: str) -> list[str]:
    """The modules `name` imports by a string (importlib.import_module("lmbatch....")): imports the graph
    above cannot see."""
    out = []
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module" \
                and node.args:
            arg = node.args[0]
            text = arg.value if isinstance(arg, ast.Constant) else "".join(
                v.value for v in getattr(arg, "values", []) if isinstance(v, ast.Constant))
            out.append(str(text))
    return out


def test_the_registry_imports_the_programs_it_finds():
    """The programs import the frontend and the registry imports the programs, by plain (lazy) imports: the
    dependency runs one way and this graph sees it (before issue 59 frontend/registry.py found them by
    importlib, a loop neither the graph nor the cycle checks saw)."""
    programs = {m for m in MODULES if m.startswith("lmbatch.programs.") and m != REGISTRY}
    assert programs and GRAPH[REGISTRY] >= programs
    assert not {m: found for m in MODULES if (found := [t for t in _imported_by_name(m)
                                                          if t.startswith("lmbatch.programs")])}
    assert not any(d.startswith("lmbatch.programs") for m, deps in GRAPH.items() if m.startswith("lmbatch.frontend")
                   for d in deps)


def test_kernels_import_nothing_from_lmbatch():
    assert not {m: deps for m, deps in GRAPH.items() if m.startswith("lmbatch.kernels") and deps
                and any(not d.startswith("lmbatch.kernels") for d in deps)}


def _module_map() -> dict[str, set[str]]:
    """docs/architecture.md's module map: each row's module (or package, `name.*`) and what it may import."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text.split("## Module map", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`lmbatch"):
            rows[cells[0].strip("`")] = {c.strip().strip("`") for c in cells[2].split(",") if c.strip()}
    return rows


def _matches(module: str, entry: str) -> bool:
    return module == entry[:-2] or module.startswith(entry[:-1]) if entry.endswith(".*") else module == entry


def test_every_import_is_one_the_module_map_allows():
    """Imports point down docs/architecture.md's table: a module imports only what its row names."""
    rows = _module_map()
    assert len(rows) > 15, "the module map was not found in docs/architecture.md"
    unmapped = [m for m in MODULES if not any(_matches(m, entry) for entry in rows)]
    assert not unmapped, f"modules docs/architecture.md's map does not name: {unmapped}"
    stale = [entry for entry in rows if not any(_matches(m, entry) for m in MODULES)]
    assert not stale, f"rows of docs/architecture.md's map that name no module: {stale}"
    wrong = []
    for m, deps in GRAPH.items():
        entry = max((e for e in rows if _matches(m, e)), key=len)     # a module's own row over its package's
        wrong += [f"{m} imports {d}" for d in sorted(deps) if not any(_matches(d, a) for a in rows[entry])]
    assert not wrong


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


def _row_of(module: str, rows: dict[str, set[str]]) -> str:
    return max((e for e in rows if _matches(module, e)), key=len)


def test_no_cycles_among_the_module_maps_rows():
    """The rows are layers: no row imports, through any of its modules, a row that imports it back."""
    rows = _module_map()
    edges: dict[str, set[str]] = {r: set() for r in rows}
    for m, deps in GRAPH.items():
        for d in deps:
            if _row_of(m, rows) != _row_of(d, rows):
                edges[_row_of(m, rows)].add(_row_of(d, rows))
    done: set[str] = set()

    def below(r: str, path: tuple[str, ...]) -> list[tuple[str, ...]]:
        if r in path:
            return [path[path.index(r):] + (r,)]
        if r in done:
            return []
        found = [c for d in sorted(edges[r]) for c in below(d, path + (r,))]
        done.add(r)
        return found

    assert not [c for r in sorted(rows) for c in below(r, ())]


TOP_LEVEL_MODULES = 8
# packages whose __init__.py is their docstring only: importing one loads none of its modules
DOCSTRING_ONLY = ("attention", "caches", "lm_eval", "results", "run", "rundir")


def test_few_top_level_modules():
    """lmbatch/ holds its packages and at most TOP_LEVEL_MODULES modules (__init__.py and cli.py included)."""
    top = sorted(p.name for p in SOURCES["lmbatch"].glob("*.py"))
    assert len(top) <= TOP_LEVEL_MODULES, top


def _loads_nothing(node: ast.stmt) -> bool:
    """A statement of a docstring-only package's __init__ beside its docstring that loads none of its modules:
    `from __future__`/`typing` imports, an `if TYPE_CHECKING:` block, a module `__getattr__` (PEP 562: its lazy
    imports run when a name is first asked for)."""
    if isinstance(node, ast.ImportFrom):
        return node.module in ("__future__", "typing")
    if isinstance(node, ast.If):
        return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
    return isinstance(node, ast.FunctionDef) and node.name == "__getattr__"


def test_new_packages_init_is_a_docstring():
    import subprocess
    import sys

    for name in DOCSTRING_ONLY:
        body = ast.parse((SOURCES["lmbatch"] / name / "__init__.py").read_text()).body
        assert isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant), name
        assert all(_loads_nothing(node) for node in body[1:]), name
    code = (f"import sys, importlib; [importlib.import_module('lmbatch.' + n) for n in {DOCSTRING_ONLY!r}]; "
            f"print(sorted(m for m in sys.modules if m.count('.') > 1 and m.split('.')[1] in {DOCSTRING_ONLY!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# functions whose parameters are someone else's convention: lm-eval's model_args; the DSL's gen, whose keywords
# are SGLang's; the CLI's commands, whose parameters are their options; in kernels/, Triton kernels and their
# launchers, whose parameters are the kernel's arguments
MANY_PARAMETERS = {("lmbatch.lm_eval.backend", "__init__"), ("lmbatch.frontend.dsl", "gen"), ("lmbatch.cli", "report")}
MAX_PARAMETERS = 6


KERNELS = "lmbatch.kernels"


def test_classes_and_functions_stay_small():
    """One responsibility each: no class over 250 lines, no function over 60 (docstrings included) or with
    more than MAX_PARAMETERS parameters (but those of MANY_PARAMETERS and Triton kernels)."""
    big = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > (250 if isinstance(node, ast.ClassDef) else 60):
                    big.append(f"{name}.{node.name}: {lines} lines")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                params = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs if p.arg not in ("self", "cls")]
                if len(params) > MAX_PARAMETERS and (name, node.name) not in MANY_PARAMETERS and \
                        not name.startswith(KERNELS):
                    big.append(f"{name}.{node.name}: {len(params)} parameters")
    assert not big


MAX_MODULE_LINES = 400


def test_modules_stay_under_the_cap():
    """One job a module: none over MAX_MODULE_LINES lines (issue 59: five rooms had grown to four to six jobs
    each, 400 to 840 lines, with nothing to stop them). A module that reaches the cap is split by its jobs."""
    big = {name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not big, f"modules over {MAX_MODULE_LINES} lines: {big}"


ROWS = "lmbatch.rundir.rows"        # the Parquet tables' rows; records.py has the JSON files'


def test_the_run_directorys_tables_become_rows_in_one_module():
    """Rows of instances.parquet and requests.parquet are made from and into Arrow tables in rows.py alone
    (`to_pylist` / `from_pylist`), so every column name is spelled there: a renamed column fails mypy at its
    readers, not a user's `lmbatch report` (issue 59)."""
    offenders = []
    for name, path in MODULES.items():
        if name == ROWS or not name.startswith(("lmbatch.rundir", "lmbatch.results", "lmbatch.run", "lmbatch.frontend",
                                                "lmbatch.cli")):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("to_pylist", "from_pylist", "to_pydict"):
                offenders.append(f"{name}:{node.lineno}")
    assert not offenders
