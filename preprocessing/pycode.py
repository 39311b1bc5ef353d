"""Python source -> ogbg-code2 raw layout (``satp data pycode --out ROOT [--source DIR ...]``).

Follows OGB's ``examples/graphproppred/code2/py2graph.py``: each function definition
(``FunctionDef`` / ``AsyncFunctionDef``, nested ones included) is parsed on its own, as a
``Module`` holding it; every AST object (stdlib :mod:`ast`) is a node in DFS pre-order (fields
in ``ast.iter_fields`` order, as ``ast.NodeVisitor.generic_visit``); edges go parent -> child;
the attribute of a node is the first non-None of ``name, arg, s, n, id, attr`` (``s``/``n`` are
a ``Constant``'s value), stringified; depth = number of ancestors; the function's own name (and
that of any nested def with the same name) is replaced by ``_mask_``; the label is the function
name split into lower-case subtokens (snake_case and camelCase).

Node types and attributes are indexed by their frequency in the train split (at most 97 types
+ ``__UNK__`` = 98, at most 10028 attributes + ``__UNK__`` + ``__NONE__`` = 10030, the sizes of
the real dataset), written to ``mapping/`` with headers. The split is by project: the top-level
module (first path component below a source directory), ~80/10/10 by graphs. The default source
is the running interpreter's standard library, without test directories. Output is
deterministic for the same source files.
"""
from __future__ import annotations

import ast
import csv
import gzip
import io
import os
import re
import sys
import sysconfig
import tokenize
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from preprocessing.ogb_layout import (assign_groups, atomic_dataset_dir, check_out_dir, write_gz_array, write_gz_text,
                                      write_splits)

MASK = "_mask_"
SHOWN_FAILURES = 5  # unparsable files named on stderr (all of them: the summary's files_skipped)
NUM_TYPES = 98
NUM_ATTRS = 10030
TEST_DIRS = frozenset({"test", "tests", "idle_test", "testing"})
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_PANDAS_NA = frozenset({"nan", "null", "n/a", "na", "-nan", "none", "<na>", "-na"})
_SUBTOKEN = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|\d+")


def split_name(name: str) -> list[str]:
    """``getHTTPResponse_code2`` -> ``['get', 'http', 'response', 'code', '2']``."""
    return [t.lower() for part in name.split("_") for t in _SUBTOKEN.findall(part)]


def _attribute(node: ast.AST) -> str | None:
    for key in ("name", "arg", "s", "n", "id", "attr"):
        if key in ("s", "n"):
            if not isinstance(node, ast.Constant):
                continue
            value = node.value
        else:
            value = getattr(node, key, None)
        if value is not None:
            text = str(value)
            return text.encode("utf-8", errors="surrogatepass").decode("utf-8", errors="replace")
    return None


@dataclass
class FunctionGraph:
    types: list[str]
    attrs: list[str | None]
    depth: list[int]
    parent: list[int]  # parent of node i (i >= 1), -1 for the root
    label: list[str]
    group: str = ""
    path: str = ""


def function_graph(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> FunctionGraph:
    """The code2 graph of one function definition (see the module docstring)."""
    root = ast.Module(body=[fn], type_ignores=[])
    types: list[str] = []
    attrs: list[str | None] = []
    depth: list[int] = []
    parent: list[int] = []
    stack: list[tuple[ast.AST, int, int]] = [(root, -1, 0)]
    while stack:
        node, par, d = stack.pop()
        me = len(types)
        types.append(type(node).__name__)
        attrs.append(_attribute(node))
        depth.append(d)
        parent.append(par)
        children: list[ast.AST] = []
        for _, value in ast.iter_fields(node):
            if isinstance(value, list):
                children.extend(item for item in value if isinstance(item, ast.AST))
            elif isinstance(value, ast.AST):
                children.append(value)
        stack.extend((child, me, d + 1) for child in reversed(children))
    name = fn.name
    for i, t in enumerate(types):
        if "FunctionDef" in t and attrs[i] == name:
            attrs[i] = MASK
    return FunctionGraph(types, attrs, depth, parent, split_name(name))


def default_source_dirs() -> list[Path]:
    return [Path(sysconfig.get_paths()["stdlib"])]


def iter_source_files(source: Path, include_tests: bool = False):
    """Sorted ``.py`` files below ``source`` (or ``source`` itself if it is a file)."""
    if source.is_file():
        yield source
        return
    for dirpath, dirnames, filenames in os.walk(source):
        dirnames[:] = sorted(
            d for d in dirnames if d not in SKIP_DIRS and (include_tests or d not in TEST_DIRS) and not d.startswith(".")
        )
        for f in sorted(filenames):
            if f.endswith(".py"):
                yield Path(dirpath) / f


def _parse_error(path: Path, exc: Exception) -> str:
    """``path:LINE: reason`` of a file that does not parse (one line)."""
    line = getattr(exc, "lineno", None)
    reason = getattr(exc, "msg", None) or (str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    return f"{path}{f':{line}' if line else ''}: {type(exc).__name__}: {reason}"


def _parse_file(item: tuple[Path, Path, str]) -> tuple[list[FunctionGraph], str | None]:
    """The function graphs of one file (``(path, rel, group)``), in source order, or the reason it
    does not parse."""
    path, rel, group = item
    try:
        with tokenize.open(path) as fh:
            text = fh.read()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tree = ast.parse(text, filename=str(path))
    except (SyntaxError, ValueError, UnicodeDecodeError, RecursionError, OSError) as exc:
        return [], _parse_error(path, exc)
    graphs = []
    stack = [tree]
    while stack:  # pre-order over the file, so functions come in source order
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            g = function_graph(node)
            label = " ".join(g.label)
            if g.label and label not in _PANDAS_NA:
                g.group, g.path = group, str(rel)
                graphs.append(g)
        stack.extend(reversed(list(ast.iter_child_nodes(node))))
    return graphs, None


def default_workers() -> int:
    """Parsing processes: the CPUs this process may use, at most 16."""
    return max(1, min(16, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def collect_functions(
    sources: list[Path], include_tests: bool = False, workers: int = 1
) -> tuple[list[FunctionGraph], list[str], int]:
    """Parse every file; return the function graphs, the files that failed to parse (``path:line:
    reason`` each) and the number of files read. With ``workers > 1`` files are parsed in that many
    processes; the result is the same, in the same order."""
    items: list[tuple[Path, Path, str]] = []
    for index, source in enumerate(sources):
        source = Path(source)
        if not source.exists():
            raise ValueError(f"{source}: source directory not found")
        for path in iter_source_files(source, include_tests):
            rel = path.relative_to(source) if path != source else Path(path.name)
            top = rel.parts[0].removesuffix(".py")
            items.append((path, rel, f"{index}:{top}" if len(sources) > 1 else top))
    if workers > 1 and len(items) > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        # spawn: the caller may be a process with threads (a Ray driver), where fork is unsafe
        with ProcessPoolExecutor(min(workers, len(items)), mp_context=multiprocessing.get_context("spawn")) as pool:
            parsed = list(pool.map(_parse_file, items, chunksize=max(1, len(items) // (8 * workers))))
    else:
        parsed = [_parse_file(item) for item in items]
    graphs = [g for file_graphs, _ in parsed for g in file_graphs]
    failed = [reason for _, reason in parsed if reason is not None]
    return graphs, failed, len(items)


def _ranked(counts: Counter, limit: int) -> list[str]:
    return [k for k, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:limit]]


def _write_mapping(path: Path, header: tuple[str, str], values: list[str]) -> None:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(enumerate(values))
    write_gz_text(path, buf.getvalue())


def build_pycode(out: str | Path, sources: list[str | Path] | None = None, include_tests: bool = False,
                 force: bool = False, workers: int | None = None) -> dict:
    """Build ``out/ogbg_code2`` in OGB's raw layout from Python source; return a summary dict.
    ``workers`` parsing processes (default :func:`default_workers`); the output does not depend on it."""
    check_out_dir(Path(out), "ogbg-code2", force)  # before minutes of parsing
    src = [Path(s) for s in sources] if sources else default_source_dirs()
    graphs, failed, files = collect_functions(src, include_tests, workers or default_workers())
    where = ", ".join(map(str, src))
    if failed and len(failed) == files:
        raise ValueError(f"{where}: none of the {files} Python file(s) parses with Python "
                         f"{sys.version_info.major}.{sys.version_info.minor} (first: {failed[0]})")
    if not graphs:
        raise ValueError(f"{where}: no Python function definitions found in {files} .py file(s)"
                         + (" (test directories skipped: --include-tests keeps them)" if not include_tests else ""))
    if failed:
        shown = "; ".join(failed[:SHOWN_FAILURES]) + (f"; and {len(failed) - SHOWN_FAILURES} more"
                                                      if len(failed) > SHOWN_FAILURES else "")
        print(f"satp: skipped {len(failed)} of {files} file(s) that do not parse: {shown}", file=sys.stderr)
    sizes = Counter(g.group for g in graphs)
    if len(sizes) < 3:
        raise ValueError(
            f"{', '.join(map(str, src))}: found {len(sizes)} top-level module(s); the project split needs at least 3"
        )
    group_split = assign_groups(dict(sizes), (0.8, 0.1, 0.1))
    split_of = np.array([group_split[g.group] for g in graphs])
    split_ids = {s: np.flatnonzero(split_of == s) for s in ("train", "valid", "test")}

    type_counts: Counter = Counter()
    attr_counts: Counter = Counter()
    for gid in split_ids["train"]:
        g = graphs[gid]
        type_counts.update(g.types)
        attr_counts.update(a for a in g.attrs if a is not None)
    types = _ranked(type_counts, NUM_TYPES - 1) + ["__UNK__"]
    attrs = _ranked(attr_counts, NUM_ATTRS - 2) + ["__UNK__", "__NONE__"]
    type_idx = {t: i for i, t in enumerate(types)}
    attr_idx = {a: i for i, a in enumerate(attrs)}
    unk_t, unk_a, none_a = type_idx["__UNK__"], attr_idx["__UNK__"], attr_idx["__NONE__"]

    feat, edges, depth, attributed, n_nodes, n_edges, labels = [], [], [], [], [], [], []
    for g in graphs:
        n = len(g.types)
        feat.extend(
            (type_idx.get(t, unk_t), none_a if a is None else attr_idx.get(a, unk_a)) for t, a in zip(g.types, g.attrs)
        )
        edges.extend((g.parent[i], i) for i in range(1, n))
        depth.extend(g.depth)
        attributed.extend(int(a is not None) for a in g.attrs)
        n_nodes.append(n)
        n_edges.append(n - 1)
        labels.append(" ".join(g.label))

    name = "ogbg-code2"
    with atomic_dataset_dir(Path(out), name, force=force) as folder:
        raw = folder / "raw"
        write_gz_array(raw / "edge.csv.gz", np.asarray(edges, dtype=np.int64).reshape(-1, 2))
        write_gz_array(raw / "node-feat.csv.gz", np.asarray(feat, dtype=np.int64).reshape(-1, 2))
        write_gz_array(raw / "node_is_attributed.csv.gz", np.asarray(attributed, dtype=np.int64))
        write_gz_array(raw / "node_dfs_order.csv.gz", np.concatenate([np.arange(n) for n in n_nodes]))
        write_gz_array(raw / "node_depth.csv.gz", np.asarray(depth, dtype=np.int64))
        write_gz_array(raw / "num-node-list.csv.gz", np.asarray(n_nodes, dtype=np.int64))
        write_gz_array(raw / "num-edge-list.csv.gz", np.asarray(n_edges, dtype=np.int64))
        write_gz_text(raw / "graph-label.csv.gz", "\n".join(labels) + "\n")
        write_splits(folder, name, split_ids)
        _write_mapping(folder / "mapping" / "typeidx2type.csv.gz", ("type idx", "type"), types)
        _write_mapping(folder / "mapping" / "attridx2attr.csv.gz", ("attr idx", "attr"), attrs)
        # provenance (not part of OGB's layout): the source file of each graph
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(("graph idx", "project", "path"))
        writer.writerows((i, g.group, g.path) for i, g in enumerate(graphs))
        write_gz_text(folder / "mapping" / "graphidx2source.csv.gz", buf.getvalue())
    return {
        "graphs": len(graphs),
        "nodes": int(sum(n_nodes)),
        "projects": len(sizes),
        "files_failed": len(failed),
        "files_skipped": failed,
        "splits": {s: int(v.size) for s, v in split_ids.items()},
        "types": len(types),
        "attributes": len(attrs),
    }


def load_mappings(folder: str | Path) -> tuple[dict[str, int], dict[str, int]]:
    """``(type2idx, attr2idx)`` from a code2 folder's ``mapping/`` (to featurise new code)."""
    out = []
    for fname in ("typeidx2type.csv.gz", "attridx2attr.csv.gz"):
        with gzip.open(Path(folder) / "mapping" / fname, "rt", encoding="utf-8", newline="") as fh:
            rows = list(csv.reader(fh))[1:]
        out.append({value: int(idx) for idx, value in rows})
    return out[0], out[1]


def code_to_raw_graph(fn: ast.FunctionDef | ast.AsyncFunctionDef, type2idx: dict[str, int],
                      attr2idx: dict[str, int]) -> dict[str, np.ndarray]:
    """One function as the raw arrays :func:`preprocessing.transforms.transform_graph` takes
    (``y_tokens`` is the true name's subtokens), using a dataset's mappings."""
    g = function_graph(fn)
    unk_t, unk_a, none_a = type2idx["__UNK__"], attr2idx["__UNK__"], attr2idx["__NONE__"]
    n = len(g.types)
    return {
        "graph_id": 0,
        "num_nodes": n,
        "edge_index": np.asarray([[g.parent[i] for i in range(1, n)], list(range(1, n))], dtype=np.int64).reshape(2, -1),
        "x": np.asarray(
            [(type2idx.get(t, unk_t), none_a if a is None else attr2idx.get(a, unk_a)) for t, a in zip(g.types, g.attrs)],
            dtype=np.int64,
        ),
        "node_depth": np.asarray(g.depth, dtype=np.int64),
        "node_is_attributed": np.asarray([int(a is not None) for a in g.attrs], dtype=np.int64),
        "y_tokens": g.label,
    }
