"""Python source -> ogbg-code2 raw layout (``satp data pycode --out ROOT [--source DIR ...]``).

Every function definition of the files becomes one graph (:mod:`preprocessing.python_graphs`); node
types and attributes are indexed by frequency in the train split, split by project (~80/10/10).
Deterministic whatever the number of parsing processes, in bounded memory. See ``docs/data.md``."""
from __future__ import annotations

import ast
import contextlib
import csv
import gzip
import heapq
import io
import os
import pickle
import sys
import tempfile
import tokenize
import warnings
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from preprocessing.ogb_layout import (assign_groups, atomic_dataset_dir, check_out_dir, format_int_csv, write_mapping,
                                      write_splits)
from preprocessing.python_graphs import FunctionGraph, function_graph
from preprocessing.raw_checks import CODE2_NODE_ATTRIBUTES, CODE2_NODE_TYPES
from preprocessing.source_files import default_source_dirs, environment_files, environment_roots, source_items

SHOWN_FAILURES = 5  # unparsable files named on stderr (all of them: the summary's files_skipped)
NUM_VOCAB, MAX_SEQ_LEN = 5000, 5  # the target side of OGB's code2 example (statistics only)
_PANDAS_NA = frozenset({"nan", "null", "n/a", "na", "-nan", "none", "<na>", "-na"})


def _parse_file(item: tuple[Path, Path, str]) -> tuple[list[FunctionGraph], str | None]:
    """The function graphs of one file (``(path, rel, group)``), in source order, or the reason it
    does not parse."""
    path = item[0]
    try:
        with tokenize.open(path) as fh:
            text = fh.read()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tree = ast.parse(text, filename=str(path))
    except (SyntaxError, ValueError, UnicodeDecodeError, RecursionError, OSError) as exc:  # path:LINE: reason
        line = getattr(exc, "lineno", None)
        reason = getattr(exc, "msg", None) or (str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return [], f"{path}{f':{line}' if line else ''}: {type(exc).__name__}: {reason}"
    graphs = []
    stack = [tree]
    while stack:  # pre-order over the file, so functions come in source order
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            g = function_graph(node)
            label = " ".join(g.label)
            if g.label and label not in _PANDAS_NA:
                graphs.append(g)
        stack.extend(reversed(list(ast.iter_child_nodes(node))))
    return graphs, None


def default_workers() -> int:
    """Parsing processes: the CPUs this process may use, at most 16."""
    return max(1, min(16, len(os.sched_getaffinity(0))))


def process_pool(workers: int):
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # spawn: the caller may be a process with threads (a Ray driver), where fork is unsafe
    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))


# ----------------------------------------------------------------------------- bounded-memory build
# Parsers write a chunk's graphs to a part file (int32 arrays, the part's own string tables); the
# parent streams the parts twice: the train split's counts, then encoding and writing.
_CHUNK_BYTES = 1 << 20  # source bytes per part (at least one file)
_CHUNK_FILES = 512


def _chunks(items: list[tuple[Path, Path, str]], workers: int = 1) -> list[list[tuple[Path, Path, str]]]:
    """Consecutive runs of files of about ``_CHUNK_BYTES`` of source each, smaller for a small
    source so that every process gets several (the output does not depend on the chunks)."""
    sizes = []
    for item in items:
        try:
            sizes.append(os.stat(item[0]).st_size)
        except OSError:
            sizes.append(0)  # reported by the parser
    target = max(1, min(_CHUNK_BYTES, sum(sizes) // (4 * workers)))
    chunks: list[list[tuple[Path, Path, str]]] = []
    current: list[tuple[Path, Path, str]] = []
    size = 0
    for item, item_size in zip(items, sizes):
        size += item_size
        current.append(item)
        if size >= target or len(current) >= _CHUNK_FILES:
            chunks.append(current)
            current, size = [], 0
    if current:
        chunks.append(current)
    return chunks


def _parse_chunk(task: tuple[str, list[tuple[Path, Path, str]]]) -> list[tuple[int, str | None]]:
    """Parse the files of one chunk, write their graphs to the part file ``task[0]``; return
    ``(graphs, failure)`` per file."""
    part, items = task
    type_ids: dict[str, int] = {}
    attr_ids: dict[str, int] = {}
    t_col: list[int] = []
    a_col: list[int] = []
    depth: list[int] = []
    parent: list[int] = []
    nodes: list[int] = []
    labels: list[str] = []
    per_file: list[tuple[int, str | None]] = []
    for item in items:
        graphs, failure = _parse_file(item)
        per_file.append((len(graphs), failure))
        for g in graphs:
            t_col.extend([type_ids.setdefault(t, len(type_ids)) for t in g.types])
            a_col.extend([-1 if a is None else attr_ids.setdefault(a, len(attr_ids)) for a in g.attrs])
            depth.extend(g.depth)
            parent.extend(g.parent)
            nodes.append(len(g.types))
            labels.append(" ".join(g.label))
    payload = {
        "types": list(type_ids),
        "attrs": list(attr_ids),
        "type": np.asarray(t_col, dtype=np.int32),
        "attr": np.asarray(a_col, dtype=np.int32),  # -1: no attribute
        "depth": np.asarray(depth, dtype=np.int32),
        "parent": np.asarray(parent, dtype=np.int32),
        "nodes": np.asarray(nodes, dtype=np.int32),
        "labels": labels,
    }
    with open(part, "wb") as fh:
        pickle.dump(payload, fh, protocol=pickle.HIGHEST_PROTOCOL)
    return per_file


def _load_part(part: str) -> dict:
    with open(part, "rb") as fh:
        return pickle.load(fh)


def _parse_to_parts(items: list[tuple[Path, Path, str]], workers: int,
                    spill: Path) -> tuple[list[tuple[str, int]], list[int], list[str]]:
    """Parse every file into part files under ``spill``; return ``(part file, files)`` in order,
    the graphs per file and the files that failed to parse."""
    chunks = _chunks(items, workers)
    tasks = [(str(spill / f"part-{i:06d}.pkl"), chunk) for i, chunk in enumerate(chunks)]
    if workers > 1 and len(tasks) > 1:
        with process_pool(min(workers, len(tasks))) as pool:
            results = list(pool.map(_parse_chunk, tasks))
    else:
        results = [_parse_chunk(task) for task in tasks]
    per_file = [r for result in results for r in result]
    failed = [f for _, f in per_file if f is not None]
    return [(part, len(chunk)) for part, chunk in tasks], [n for n, _ in per_file], failed


def _ranked(counts: Counter, limit: int) -> list[str]:
    """The ``limit`` most frequent keys, ties by key (as ``sorted(...)[:limit]``, in less time)."""
    return [k for k, _ in heapq.nsmallest(limit, counts.items(), key=lambda kv: (-kv[1], kv[0]))]


@contextlib.contextmanager
def _gz_streams(paths: dict[str, Path]) -> Iterator[Callable[[dict[str, bytes]], None]]:
    """A writer of pieces into gzip files (the bytes :func:`write_gz_array` gives for the whole), the
    files compressed in parallel threads (zlib releases the GIL)."""
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(len(paths)) as pool:
        files = {}
        for key, path in paths.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            raw = stack.enter_context(open(path, "wb"))
            files[key] = stack.enter_context(gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0,
                                                           compresslevel=9))
        yield lambda pieces: list(pool.map(lambda item: files[item[0]].write(item[1]), pieces.items()))


def _encode_part(p: dict, g0: int, sources: list[tuple[Path, str, int]], type_idx: dict[str, int],
                 attr_idx: dict[str, int]) -> dict[str, bytes]:
    """The CSV lines of one part (graphs ``g0, g0 + 1, ...``) for each output file."""
    n = p["nodes"]
    starts = np.repeat(np.cumsum(n) - n, n)
    local = np.arange(starts.size, dtype=np.int64) - starts  # node id within its graph (DFS order)
    unk_t, unk_a, none_a = type_idx["__UNK__"], attr_idx["__UNK__"], attr_idx["__NONE__"]
    t_lut = np.array([type_idx.get(t, unk_t) for t in p["types"]] + [unk_t], dtype=np.int64)
    a_lut = np.array([attr_idx.get(a, unk_a) for a in p["attrs"]] + [none_a], dtype=np.int64)
    feat = np.stack([t_lut[p["type"]], a_lut[p["attr"]]], axis=1)  # attribute id -1 (none) -> __NONE__
    child = local > 0
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    for rel, group, count in sources:
        writer.writerows((i, group, str(rel)) for i in range(g0, g0 + count))
        g0 += count
    return {
        "edge": format_int_csv(np.stack([p["parent"][child], local[child]], axis=1)),
        "node-feat": format_int_csv(feat),
        "node_is_attributed": format_int_csv((p["attr"] >= 0).astype(np.int64)),
        "node_dfs_order": format_int_csv(local),
        "node_depth": format_int_csv(p["depth"]),
        "num-node-list": format_int_csv(n),
        "num-edge-list": format_int_csv(n - 1),
        "graph-label": ("\n".join(p["labels"]) + "\n").encode("utf-8"),
        "source": buf.getvalue().encode("utf-8"),
    }


def _label_statistics(label_counts: Counter, train_subtokens: Counter, graphs: int) -> dict:
    """The target side beside ogbg-code2's: subtoken vocabulary, method names, name lengths and
    how much of the train split's subtokens the OGB example's 5000-word vocabulary covers."""
    subtokens: set[str] = set()
    lengths: Counter = Counter()
    for label, count in label_counts.items():
        words = label.split(" ")
        subtokens.update(words)
        lengths[len(words)] += count
    top = sum(c for _, c in train_subtokens.most_common(NUM_VOCAB))
    return {
        "subtokens": len(subtokens),
        "method_names": len(label_counts),
        "name_subtokens_mean": round(sum(n * c for n, c in lengths.items()) / graphs, 3),
        "names_up_to_5_subtokens": round(sum(c for n, c in lengths.items() if n <= MAX_SEQ_LEN) / graphs, 4),
        "train_subtokens": len(train_subtokens),
        "top5000_train_coverage": round(top / max(1, sum(train_subtokens.values())), 4),
    }


def build_pycode(out: str | Path, sources: list[str | Path] | None = None, include_tests: bool = False,
                 force: bool = False, workers: int | None = None, environment: bool = False,
                 environment_dirs: list[str | Path] | None = None) -> dict:
    """Build ``out/ogbg_code2`` from Python source; return a summary dict. ``environment``: the corpus
    of ``--environment`` (:func:`~preprocessing.source_files.environment_files`) instead of ``sources``."""
    check_out_dir(Path(out), "ogbg-code2", force)  # before minutes of parsing
    if environment:
        if sources:
            raise ValueError("--environment and --source exclude each other")
        roots = [Path(d) for d in environment_dirs] if environment_dirs else environment_roots()
        items = environment_files(roots)
        src = roots
    else:
        src = [Path(s) for s in sources] if sources else default_source_dirs()
        items = source_items(src, include_tests)
    workers = workers or default_workers()
    where = ", ".join(map(str, src))
    modules = len({group for _, _, group in items})
    if items and modules < 3:  # known from the file names: before minutes of parsing
        raise ValueError(f"{where}: found {modules} top-level module(s); the project split needs at least 3")
    with tempfile.TemporaryDirectory(prefix="satp-pycode-") as spill_dir:
        parts, per_file, failed = _parse_to_parts(items, workers, Path(spill_dir))
        return _write_corpus(out, force, items, parts, per_file, failed, where, include_tests or environment)


def _write_corpus(out: str | Path, force: bool, items: list[tuple[Path, Path, str]], parts: list[tuple[str, int]],
                  per_file: list[int], failed: list[str], where: str, include_tests: bool) -> dict:
    """Check what was parsed, split by project, stream the parts twice (counts, then writing)."""
    files = len(items)
    total = sum(per_file)
    if failed and len(failed) == files:
        raise ValueError(f"{where}: none of the {files} Python file(s) parses with Python "
                         f"{sys.version_info.major}.{sys.version_info.minor} (first: {failed[0]})")
    if not total:
        raise ValueError(f"{where}: no Python function definitions found in {files} .py file(s)"
                         + (" (test directories skipped: --include-tests keeps them)" if not include_tests else ""))
    if failed:
        shown = "; ".join(failed[:SHOWN_FAILURES]) + (f"; and {len(failed) - SHOWN_FAILURES} more"
                                                      if len(failed) > SHOWN_FAILURES else "")
        print(f"satp: skipped {len(failed)} of {files} file(s) that do not parse: {shown}", file=sys.stderr)
    sizes: Counter = Counter()
    for (_, _, group), n in zip(items, per_file):
        if n:
            sizes[group] += n
    if len(sizes) < 3:
        raise ValueError(f"{where}: found {len(sizes)} top-level module(s) with function definitions; the project "
                         "split needs at least 3")
    group_split = assign_groups(dict(sizes), (0.8, 0.1, 0.1))
    codes = {"train": 0, "valid": 1, "test": 2}
    split_of = np.repeat(np.array([codes[group_split[g]] if n else 0 for (_, _, g), n in zip(items, per_file)],
                                  dtype=np.int8), per_file)
    split_ids = {s: np.flatnonzero(split_of == c) for s, c in codes.items()}

    # pass 1 over the parts: the train split's counts and the statistics
    type_counts: Counter = Counter()
    attr_counts: Counter = Counter()
    label_counts: Counter = Counter()
    train_subtokens: Counter = Counter()
    nodes_total, max_nodes, g0 = 0, 0, 0
    for part, _ in parts:
        p = _load_part(part)
        n_graphs = p["nodes"].size
        if not n_graphs:
            continue
        train_graph = split_of[g0 : g0 + n_graphs] == 0
        train = np.repeat(train_graph, p["nodes"])
        for t, c in zip(p["types"], np.bincount(p["type"][train], minlength=len(p["types"])).tolist()):
            if c:
                type_counts[t] += c
        a = p["attr"][train]
        counts = np.bincount(a[a >= 0], minlength=len(p["attrs"]))
        attrs = p["attrs"]
        for i in np.flatnonzero(counts).tolist():
            attr_counts[attrs[i]] += int(counts[i])
        label_counts.update(p["labels"])
        for label, is_train in zip(p["labels"], train_graph.tolist()):
            if is_train:
                train_subtokens.update(label.split(" "))
        nodes_total += int(p["nodes"].sum())
        max_nodes = max(max_nodes, int(p["nodes"].max()))
        g0 += n_graphs
    types = _ranked(type_counts, CODE2_NODE_TYPES - 1) + ["__UNK__"]
    attrs = _ranked(attr_counts, CODE2_NODE_ATTRIBUTES - 2) + ["__UNK__", "__NONE__"]
    del attr_counts
    type_idx = {t: i for i, t in enumerate(types)}
    attr_idx = {a: i for i, a in enumerate(attrs)}

    # pass 2: encode and write, part by part
    name = "ogbg-code2"
    with atomic_dataset_dir(Path(out), name, force=force) as folder:
        raw = folder / "raw"
        keys = ("edge", "node-feat", "node_is_attributed", "node_dfs_order", "node_depth", "num-node-list",
                "num-edge-list", "graph-label")
        paths = {k: raw / f"{k}.csv.gz" for k in keys}
        paths["source"] = folder / "mapping" / "graphidx2source.csv.gz"
        with _gz_streams(paths) as write:
            # provenance (not part of OGB's layout): the source file of each graph
            write({"source": b"graph idx,project,path\n"})
            g0, f0 = 0, 0
            for part, chunk_files in parts:
                p = _load_part(part)
                sources = [(rel, group, count) for (_, rel, group), count
                           in zip(items[f0 : f0 + chunk_files], per_file[f0 : f0 + chunk_files])]
                f0 += chunk_files
                if p["nodes"].size:
                    write(_encode_part(p, g0, sources, type_idx, attr_idx))
                    g0 += p["nodes"].size
        write_splits(folder, name, split_ids)
        write_mapping(folder / "mapping" / "typeidx2type.csv.gz", ("type idx", "type"), types)
        write_mapping(folder / "mapping" / "attridx2attr.csv.gz", ("attr idx", "attr"), attrs)
    return {
        "graphs": total,
        "nodes": nodes_total,
        "projects": len(sizes),
        "files": files,
        "files_failed": len(failed),
        "files_skipped": failed,
        "splits": {s: int(v.size) for s, v in split_ids.items()},
        "types": len(types),
        "attributes": len(attrs),
        "avg_nodes": round(nodes_total / total, 1),
        "max_nodes": max_nodes,
        **_label_statistics(label_counts, train_subtokens, total),
    }
