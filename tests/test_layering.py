"""The house's floors: every import arrow points down, no import goes round in a circle, and no
module outgrows one concept.

From the bottom: ``sat`` (the model), ``runtime`` (Ray connection, interrupts), ``preprocessing``,
then inside ``pipeline`` its shared modules (``config``, ``tasks``, ``console``,
``pyg_templates``), ``registry``, ``train``, ``sweep`` and ``cli``, and on top ``benchmarks``,
which may import the product but never the reverse. A module may import from its own room and any
room below, never above; lazy imports inside functions count too. Inside ``benchmarks`` each room
(``cpu``, ``scale``, ``accuracy``, ``gpu``) imports only itself and the shared ``graphs`` and
``machine``. No module imports itself back through others, in any package (the one exception: a
module-level ``__getattr__`` that keeps an old import path of stored files resolving, e.g.
``pipeline.registry.model_format.SATPyfunc`` for the ``satp_pyfunc.py`` of registered versions).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("sat", "runtime", "preprocessing", "pipeline", "benchmarks")
FLOORS = ["sat", "runtime", "preprocessing", "pipeline.shared", "pipeline.registry", "pipeline.train",
          "pipeline.sweep", "pipeline.cli", "benchmarks"]
BENCHMARK_ROOMS = ("cpu", "scale", "accuracy", "gpu")
BENCHMARK_SHARED = {"benchmarks", "benchmarks.graphs", "benchmarks.machine", "benchmarks.run"}
MAX_LINES = 500


def _modules():
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            yield name, path


def room(module: str) -> str:
    """The floor of a dotted module name (``pipeline.train.worker`` -> ``pipeline.train``)."""
    parts = module.split(".")
    if parts[0] != "pipeline":
        return parts[0]  # sat, runtime, preprocessing, benchmarks
    if len(parts) > 1 and f"pipeline.{parts[1]}" in FLOORS:
        return f"pipeline.{parts[1]}"
    return "pipeline.shared"


def _reexports(tree: ast.Module) -> set[ast.AST]:
    """The nodes inside a module-level ``__getattr__`` (PEP 562): imports there resolve an old import
    path on first use, for files stored by earlier versions."""
    return {node for top in tree.body if isinstance(top, ast.FunctionDef) and top.name == "__getattr__"
            for node in ast.walk(top)}


def imported_modules(path: Path, reexports: bool = True) -> set[str]:
    """The project modules (and ``module.name`` forms) that ``path`` imports, lazily or not;
    ``reexports=False`` leaves out those of a module-level ``__getattr__``."""
    found = set()
    tree = ast.parse(path.read_text(), str(path))
    skipped = set() if reexports else _reexports(tree)
    for node in ast.walk(tree):
        if node in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)  # `from pipeline import train`
    return {name for name in found if name.split(".")[0] in PACKAGES}


def _known(name: str) -> bool:
    path = ROOT / Path(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def test_room_names_the_floor():
    assert room("pipeline.train.worker") == "pipeline.train"
    assert room("pipeline.config.train") == "pipeline.shared"
    assert room("pipeline.tasks") == "pipeline.shared"
    assert room("preprocessing.build") == "preprocessing"


def test_every_import_points_down():
    upward = []
    for name, path in _modules():
        here = FLOORS.index(room(name))
        for target in imported_modules(path):
            if _known(target) and FLOORS.index(room(target)) > here:
                upward.append(f"{name} -> {target}")
    assert upward == [], "imports from a higher room:\n" + "\n".join(upward)


def test_the_check_sees_an_upward_import(tmp_path):
    """The walk above finds lazy imports inside functions (the kind that hides an upward arrow)."""
    module = tmp_path / "lazy.py"
    module.write_text("def f():\n    from pipeline.train.driver import train_job\n    import sat.config\n")
    assert imported_modules(module) == {"pipeline.train.driver", "pipeline.train.driver.train_job", "sat.config"}
    assert FLOORS.index(room("pipeline.train.driver")) > FLOORS.index(room("preprocessing.build"))


def _module_of(name: str) -> str | None:
    """The module an imported name is in (``a.b.f`` -> ``a.b`` when ``a.b`` is a module)."""
    while name and not _known(name):
        name = name.rsplit(".", 1)[0] if "." in name else ""
    return name or None


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (lazily or not; re-exports of old paths left out)."""
    graph = {}
    for name, path in _modules():
        graph[name] = {m for t in imported_modules(path, reexports=False) if (m := _module_of(t)) and m != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``graph``: its strongly connected parts of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles_anywhere():
    assert circles(import_graph()) == []


def test_the_circle_check_sees_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_benchmark_rooms_import_only_themselves_and_what_they_share():
    crossing = []
    for name, targets in import_graph().items():
        parts = name.split(".")
        if parts[0] != "benchmarks" or len(parts) < 3 or parts[1] not in BENCHMARK_ROOMS:
            continue
        own = f"benchmarks.{parts[1]}"
        for target in targets:
            if target.startswith("benchmarks") and not (target == own or target.startswith(own + ".")
                                                        or any(target == s or target.startswith(s + ".")
                                                               for s in BENCHMARK_SHARED)):
                crossing.append(f"{name} -> {target}")
    assert crossing == [], "a benchmarks room imports another room:\n" + "\n".join(crossing)


@pytest.mark.parametrize("package", PACKAGES)
def test_no_module_over_500_lines(package):
    long = {name: n for name, path in _modules() if name.split(".")[0] == package
            and (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"split by job: {long}"
