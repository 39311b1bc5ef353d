"""Which Python files an ogbg-code2 corpus is read from, and the project of each (the unit of
:mod:`preprocessing.pycode`'s split).

``--source DIR``: the project is the top-level entry below the directory (``N:name`` for the N-th
of several), test directories skipped unless asked for; default: the standard library.
``--environment``: the standard library and every installed package, tests included; jedi,
docutils, hypothesis and IPython are always left out (reserved for an independent check)."""
from __future__ import annotations

import os
import re
import sysconfig
from pathlib import Path

#: Left out of ``--environment`` always (case-insensitive top-level names, with every file of their
#: distributions): reserved for an independent check of models trained on that corpus.
RESERVED_PROJECTS = frozenset({"jedi", "docutils", "hypothesis", "ipython"})
TEST_DIRS = frozenset({"test", "tests", "idle_test", "testing"})
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def default_source_dirs() -> list[Path]:
    return [Path(sysconfig.get_paths()["stdlib"])]


def environment_roots() -> list[Path]:
    """The directories of ``--environment``: the standard library, then purelib and platlib site-packages, each once."""
    paths = sysconfig.get_paths()
    roots: list[Path] = []
    for key in ("stdlib", "purelib", "platlib"):
        path = Path(paths[key])
        if path.is_dir() and all(not os.path.samefile(path, r) for r in roots):
            roots.append(path)
    return roots


def _reserved_in(root: Path, reserved: frozenset[str]) -> tuple[set[str], set[str]]:
    """``(top-level names, file paths)`` that the distributions named in ``reserved`` installed
    under ``root`` (their ``top_level.txt`` and ``RECORD``): e.g. hypothesis' ``_hypothesis_*.py``."""
    import importlib.metadata

    names: set[str] = set()
    files: set[str] = set()
    for dist in importlib.metadata.distributions(path=[str(root)]):
        try:
            name = dist.metadata["Name"] or ""
        except Exception:  # a broken metadata file is no reserved distribution
            continue
        if re.sub(r"[-_.]+", "-", name).lower() not in reserved:  # PEP 503's comparison
            continue
        top_level = dist.read_text("top_level.txt") or ""
        names.update(line.strip().lower() for line in top_level.splitlines() if line.strip())
        for f in dist.files or []:
            files.add(os.path.normpath(root / f))
    return names, files


def environment_files(roots: list[str | Path] | None = None) -> list[tuple[Path, Path, str]]:
    """The ``.py`` files of ``--environment`` as ``(path, path below its root, project)``, sorted. Each
    top-level entry of a root is a project; left out: :data:`RESERVED_PROJECTS` and their distributions'
    files, nested or repeated roots, ``__pycache__``, hidden and non-importable entries, ``__editable__*``."""
    dirs: list[Path] = []
    for root in roots if roots is not None else environment_roots():
        root = Path(root)
        if not root.is_dir():
            raise ValueError(f"{root}: source directory not found")
        if all(os.path.realpath(root) != os.path.realpath(d) for d in dirs):
            dirs.append(root)
    real_roots = {os.path.realpath(d) for d in dirs}
    items: list[tuple[Path, Path, str]] = []
    for root in dirs:
        names, files = _reserved_in(root, RESERVED_PROJECTS)
        skip = RESERVED_PROJECTS | names
        prune = real_roots - {os.path.realpath(root)}
        for entry in sorted(os.listdir(root)):
            path = root / entry
            top = entry.removesuffix(".py") if entry.endswith(".py") else entry
            if (entry in SKIP_DIRS or entry.startswith((".", "__editable__")) or not top.isidentifier()
                    or top.lower() in skip or os.path.realpath(path) in prune):
                continue
            if path.is_dir():
                found = iter_source_files(path, include_tests=True, prune=prune)
            elif entry.endswith(".py") and path.is_file():
                found = [path]
            else:
                continue
            for f in found:
                if os.path.normpath(f) not in files:
                    items.append((f, f.relative_to(root), top))
    return items


def iter_source_files(source: Path, include_tests: bool = False, prune: set[str] | frozenset[str] = frozenset()):
    """Sorted ``.py`` files below ``source`` (or ``source`` itself if it is a file); directories
    whose real path is in ``prune`` are not entered."""
    if source.is_file():
        yield source
        return
    for dirpath, dirnames, filenames in os.walk(source):
        dirnames[:] = sorted(
            d for d in dirnames
            if d not in SKIP_DIRS and (include_tests or d not in TEST_DIRS) and not d.startswith(".")
            and not (prune and os.path.realpath(os.path.join(dirpath, d)) in prune)
        )
        for f in sorted(filenames):
            if f.endswith(".py"):
                yield Path(dirpath) / f


def source_items(sources: list[Path], include_tests: bool) -> list[tuple[Path, Path, str]]:
    """``(path, path below its source, project)`` of every file of ``sources``: the project is the
    first path component below a source (``N:name`` for the N-th of several sources)."""
    items: list[tuple[Path, Path, str]] = []
    for index, source in enumerate(sources):
        source = Path(source)
        if not source.exists():
            raise ValueError(f"{source}: source directory not found")
        for path in iter_source_files(source, include_tests):
            rel = path.relative_to(source) if path != source else Path(path.name)
            top = rel.parts[0].removesuffix(".py")
            items.append((path, rel, f"{index}:{top}" if len(sources) > 1 else top))
    return items
