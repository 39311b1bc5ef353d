"""The house's floors: every import arrow points down, and no module outgrows one concept.

From the bottom: ``sat`` (the model), ``runtime`` (Ray connection, interrupts), ``preprocessing``,
then inside ``pipeline`` its shared modules (``config``, ``tasks``, ``console``,
``pyg_templates``), ``registry``, ``train``, ``sweep`` and ``cli``. A module may import from its own
room and any room below, never above; lazy imports inside functions count too.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FLOORS = ["sat", "runtime", "preprocessing", "pipeline.shared", "pipeline.registry", "pipeline.train",
          "pipeline.sweep", "pipeline.cli"]
#: modules that exist to keep an older import path working (their one import points up on purpose)
SHIMS = {"pipeline.model_format"}
MAX_LINES = 500


def _modules():
    for package in ("sat", "runtime", "preprocessing", "pipeline"):
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            yield name, path


def room(module: str) -> str:
    """The floor of a dotted module name (``pipeline.train.worker`` -> ``pipeline.train``)."""
    parts = module.split(".")
    if parts[0] != "pipeline":
        return parts[0]
    if len(parts) > 1 and f"pipeline.{parts[1]}" in FLOORS:
        return f"pipeline.{parts[1]}"
    return "pipeline.shared"


def imported_modules(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)  # `from pipeline import train`
    return {name for name in found if name.split(".")[0] in ("sat", "runtime", "preprocessing", "pipeline")}


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
        if name in SHIMS:
            continue
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


@pytest.mark.parametrize("package", ["sat", "runtime", "preprocessing", "pipeline"])
def test_no_module_over_500_lines(package):
    long = {name: n for name, path in _modules() if name.split(".")[0] == package
            and (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"split by job: {long}"
