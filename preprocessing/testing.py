"""Small inputs for tests and benchmarks: a few real standard-library modules."""
from __future__ import annotations

import shutil
from pathlib import Path

from preprocessing.source_files import default_source_dirs

#: A few standard-library modules: ~255 functions in 6 top-level modules (json is a package).
SMALL_MODULES = ("json", "csv.py", "textwrap.py", "shlex.py", "fractions.py", "argparse.py")


def small_python_source(dest: str | Path, modules: tuple[str, ...] = SMALL_MODULES) -> Path:
    """Copy a few standard-library modules into ``dest`` (a source dir for ``satp data pycode``)."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    stdlib = default_source_dirs()[0]
    for name in modules:
        src = stdlib / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__", "tests", "test"),
                            dirs_exist_ok=True)
        else:
            shutil.copy2(src, dest / name)
    return dest
