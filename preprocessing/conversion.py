"""OGB's raw layout into the columnar raw store (:mod:`preprocessing.columnar`), streaming.

One pass per raw file, in bounded memory: the gzip stream is decompressed :data:`BLOCK_BYTES` at
a time, cut at line ends, parsed by Arrow's CSV reader, checked, and written as record batches of
:data:`BATCH_ROWS` rows, never the whole file. Each file is written under a temporary name and
renamed, then its sidecar records the raw fingerprint: a killed conversion resumes with the files
not yet finished; ``store.json`` comes last. A store of other raw files is replaced.

The checks, each a one-line ``ValueError`` naming the file and, where it applies, the graph:
truncated or corrupt gzip, values per line, line counts against ``num-node-list`` /
``num-edge-list``, empty graphs, graphs without edges, edge ids outside their graph, NaN /
infinite features, negative ids, class ids outside the dataset's range, split ids outside the
dataset, values too large for the storage type.
"""
from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

from preprocessing.columnar import (BATCH_ROWS_KEY, FINGERPRINT_FILE, NUM_CLASSES, STORE_DIR, STORE_FILE, STORE_VERSION,
                                    ColumnarStore, FileSpec, file_specs, read_column, store_is_current)
from preprocessing.config import SBM_DATASETS

#: Rows per record batch (recorded in each file's schema: readers locate a row without reading other batches).
BATCH_ROWS = 1 << 18
#: Decompressed bytes parsed at a time (cut at a line end): bounds the conversion's memory.
BLOCK_BYTES = 1 << 23
#: pandas' default NA strings: OGB reads code2 labels with pandas, which turns these into NaN ("nan").
_PANDAS_NA = frozenset({"", "#N/A", "#N/A N/A", "#NA", "-1.#IND", "-1.#QNAN", "-NaN", "-nan", "1.#IND", "1.#QNAN",
                        "<NA>", "N/A", "NA", "NULL", "NaN", "None", "n/a", "nan", "null"})


# ----------------------------------------------------------------------------- reading the CSVs
def _gunzip(path: Path) -> Iterator[bytes]:
    """Decompressed bytes of a (possibly multi-member) gzip file, at most :data:`BLOCK_BYTES` at a
    time; a truncated or corrupt stream raises a one-line ``ValueError``."""
    dec = zlib.decompressobj(16 + zlib.MAX_WBITS)
    ended = False
    try:
        with open(path, "rb") as fh:
            while chunk := fh.read(1 << 20):
                while chunk:
                    if ended:  # a further gzip member
                        dec, ended = zlib.decompressobj(16 + zlib.MAX_WBITS), False
                    out = dec.decompress(chunk, BLOCK_BYTES)
                    if out:
                        yield out
                    if dec.eof:
                        ended, chunk = True, dec.unused_data
                    else:
                        chunk = dec.unconsumed_tail
    except zlib.error as exc:
        raise ValueError(f"{path}: corrupt gzip data ({exc})") from None
    if not ended:
        raise ValueError(f"{path}: truncated (the gzip stream ends early)")


def _line_blocks(path: Path) -> Iterator[bytes]:
    """Whole lines of ``path``, about :data:`BLOCK_BYTES` at a time (a last line without its
    newline gets one)."""
    pending = b""
    for piece in _gunzip(path):
        pending += piece
        while len(pending) >= BLOCK_BYTES:
            cut = pending.rfind(b"\n", 0, BLOCK_BYTES) + 1 or pending.rfind(b"\n") + 1
            if not cut:
                break  # one line longer than a block: wait for its end
            yield pending[:cut]
            pending = pending[cut:]
    if pending:
        yield pending if pending.endswith(b"\n") else pending + b"\n"


def _parse(block: bytes, spec: FileSpec, path: Path) -> np.ndarray | list[str]:
    """One block of lines -> ``[rows]`` / ``[rows, columns]`` values (OGB's parse types)."""
    if spec.parse == "text":
        lines = block.decode("utf-8").split("\n")[:-1]
        return ["nan" if line in _PANDAS_NA else line for line in lines]
    names = [f"c{i}" for i in range(spec.columns)]
    kind = pa.int64() if spec.parse == "int64" else pa.float64()
    what = "integer" if spec.parse == "int64" else "number"
    try:
        table = pacsv.read_csv(
            pa.BufferReader(block),
            read_options=pacsv.ReadOptions(column_names=names, use_threads=False, block_size=len(block) + 1),
            parse_options=pacsv.ParseOptions(delimiter=","),
            convert_options=pacsv.ConvertOptions(column_types=dict.fromkeys(names, kind), null_values=[],
                                                 strings_can_be_null=False, quoted_strings_can_be_null=False),
        )
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ValueError(f"{path}: expected {spec.columns} {what}(s) per line ({detail})") from None
    values = np.stack([table.column(i).to_numpy() for i in range(spec.columns)], axis=1)
    return values[:, 0] if spec.columns == 1 else values


def _rows(path: Path, spec: FileSpec) -> Iterator[np.ndarray | list[str]]:
    for block in _line_blocks(path):
        yield _parse(block, spec, path)


# ----------------------------------------------------------------------------- checks
@dataclass
class _Counts:
    """Per-graph node and edge counts (as in the raw files: one direction per undirected edge)."""

    nodes: np.ndarray
    edges: np.ndarray

    @property
    def node_ptr(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.nodes)])

    @property
    def edge_ptr(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.edges)])


def _expected_rows(spec: FileSpec, counts: _Counts) -> int | None:
    return {"graph": counts.nodes.size, "node": int(counts.nodes.sum()), "edge": int(counts.edges.sum())}.get(spec.per)


def _graph_of(ptr: np.ndarray, rows: np.ndarray) -> np.ndarray:
    return np.searchsorted(ptr, rows, side="right") - 1


class _Checker:
    """Streaming checks of one file's values, block by block (``start``: the block's first row)."""

    def __init__(self, name: str, spec: FileSpec, path: Path, counts: _Counts | None):
        from preprocessing.sbm import NODE_VOCAB
        from preprocessing.sbm import NUM_CLASSES as SBM_CLASSES

        self.spec, self.path, self.counts = spec, path, counts
        self.ptr = None
        if counts is not None:
            self.ptr = {"node": counts.node_ptr, "edge": counts.edge_ptr}.get(spec.per)
        self.limit = None  # (upper bound, what) of ids checked against a range
        if spec.key == "y" and name in NUM_CLASSES:
            self.limit = (NUM_CLASSES[name], "class ids")
        elif name in SBM_DATASETS and spec.key == "x":
            self.limit = (NODE_VOCAB[name], "node input ids")
        elif name in SBM_DATASETS and spec.key == "node_label":
            self.limit = (SBM_CLASSES[name], "node classes")
        elif spec.per == "split":
            self.limit = (counts.nodes.size, "graph ids")

    def _graph(self, start: int, bad: np.ndarray) -> int:
        return int(_graph_of(self.ptr, start + int(np.flatnonzero(bad)[0]))) if self.ptr is not None else -1

    def __call__(self, values, start: int) -> None:
        spec, where = self.spec, self.path
        if spec.parse == "text":
            return
        if spec.parse == "float64":
            finite = np.isfinite(values).all(axis=1) if values.ndim > 1 else np.isfinite(values)
            if not finite.all():
                raise ValueError(f"{where}: graph {self._graph(start, ~finite)} has NaN or infinite {spec.per} features")
            return
        if spec.key == "edge_index":
            rows = start + np.arange(len(values))
            g = _graph_of(self.ptr, rows)
            n = self.counts.nodes[g]
            bad = ((values < 0) | (values >= n[:, None])).any(axis=1)
            if bad.any():
                first = int(g[np.flatnonzero(bad)[0]])
                raise ValueError(f"{where}: graph {first} has edge ids outside [0, {int(self.counts.nodes[first])})")
            return
        if self.limit is not None:
            top, what = self.limit
            bad = (values < 0) | (values >= top)
            if bad.any():
                if spec.per == "split":
                    raise ValueError(f"{where}: graph ids outside [0, {top})")
                graph = int(start + np.flatnonzero(bad)[0]) if spec.per == "graph" else self._graph(start, bad)
                raise ValueError(f"{where}: graph {graph} has {what} outside [0, {top})")
            return
        if (values < 0).any():
            if spec.key == "x":
                raise ValueError(f"{where}: expected {spec.columns} non-negative integer ids per node")
            raise ValueError(f"{where}: graph {self._graph(start, (values < 0).reshape(len(values), -1).any(axis=1))} "
                             f"has negative values")
        if np.iinfo(spec.store).max < values.max(initial=0):
            raise ValueError(f"{where}: values up to {int(values.max())}, more than this layout allows "
                             f"({np.iinfo(spec.store).max})")


def _check_counts(folder: Path, counts: _Counts) -> None:
    raw = folder / "raw"
    if counts.edges.size != counts.nodes.size:
        raise ValueError(f"{raw / 'num-edge-list.csv.gz'}: {counts.edges.size} graphs, num-node-list has {counts.nodes.size}")
    if counts.nodes.size == 0:
        raise ValueError(f"{raw}: the dataset has no graphs")
    if (counts.nodes == 0).any():
        raise ValueError(f"{raw}: graph {int(np.flatnonzero(counts.nodes == 0)[0])} is empty (0 nodes)")
    if (counts.edges == 0).any():
        raise ValueError(f"{raw}: graph {int(np.flatnonzero(counts.edges == 0)[0])} has no edges")


# ----------------------------------------------------------------------------- writing the store
def _arrow_values(values, spec: FileSpec) -> pa.Array:
    if spec.store == "text":
        return pa.array(values, type=pa.large_string())
    flat = pa.array(np.ascontiguousarray(values).reshape(-1))
    return flat if spec.columns == 1 else pa.FixedSizeListArray.from_arrays(flat, spec.columns)


def _schema(spec: FileSpec) -> pa.Schema:
    """The file's one column, and its batch length (every batch but the last holds that many rows)."""
    if spec.store == "text":
        kind = pa.large_string()
    else:
        value = pa.from_numpy_dtype(np.dtype(spec.store))
        kind = value if spec.columns == 1 else pa.list_(value, spec.columns)
    return pa.schema([("values", kind)], metadata={BATCH_ROWS_KEY: str(BATCH_ROWS)})


def _write_sidecar(path: Path, meta: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(meta, sort_keys=True) + "\n")
    os.replace(tmp, path)


def convert_file(folder: str, name: str, spec: FileSpec, fingerprint: str, counts: _Counts | None) -> dict:
    """Convert one raw CSV into ``<folder>/columnar/<key>.arrow`` (atomically, then its sidecar);
    return ``{"rows": R}``. The body of one conversion task (see :func:`build_store`)."""
    folder = Path(folder)
    src, out = folder / spec.rel, folder / STORE_DIR / spec.arrow
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    check = _Checker(name, spec, src, counts)
    rows, pending = 0, []
    try:
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, _schema(spec)) as writer:
            def emit(values) -> None:
                writer.write_batch(pa.record_batch([_arrow_values(values, spec)], schema=_schema(spec)))

            buffered = 0
            for values in _rows(src, spec):
                check(values, rows)
                rows += len(values)
                pending.append(values if spec.store == "text" else values.astype(spec.store))
                buffered += len(values)
                while buffered >= BATCH_ROWS:  # exactly BATCH_ROWS rows per record batch
                    joined = _join(pending, spec)
                    emit(joined[:BATCH_ROWS])
                    pending = [joined[BATCH_ROWS:]]
                    buffered -= BATCH_ROWS
            if buffered:
                emit(_join(pending, spec))
        expected = _expected_rows(spec, counts) if counts is not None else None
        if expected is not None and rows != expected:
            one = {"node": " (one per node): truncated?", "edge": " (one per edge): truncated?"}.get(spec.per, "")
            raise ValueError(f"{src}: {rows} lines, expected {expected}{one}")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    _write_sidecar(out.with_name(out.name + ".json"), {"fingerprint": fingerprint, "rows": rows, "rel": spec.rel})
    return {"rows": rows}


def _join(parts: list, spec: FileSpec):
    if spec.store == "text":
        return [line for part in parts for line in part]
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _finished(store: Path, spec: FileSpec, fingerprint: str) -> bool:
    try:
        meta = json.loads((store / (spec.arrow + ".json")).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return meta.get("fingerprint") == fingerprint and (store / spec.arrow).is_file()


Runner = Callable[[list[tuple]], Iterable[dict]]


def _run_here(calls: list[tuple]) -> Iterator[dict]:
    for args in calls:
        yield convert_file(*args)


def build_store(folder: Path, name: str, fingerprint: str, run: Runner | None = None) -> "ColumnarStore":
    """Convert ``folder`` (OGB raw layout of ``name``, fingerprint ``fingerprint``) into its columnar
    store unless it holds a finished one for that fingerprint; return the opened store.

    The count files are read here first (they are small: one line per graph); the other files are
    converted by ``run`` (default: one after the other in this process; :mod:`preprocessing.build`
    passes Ray tasks), which takes a list of :func:`convert_file` argument tuples and yields their
    results. Files finished under the same fingerprint by an interrupted conversion are kept.
    """
    folder = Path(folder)
    store = folder / STORE_DIR
    if store_is_current(folder, fingerprint):
        return ColumnarStore(folder)
    store.mkdir(parents=True, exist_ok=True)
    (store / STORE_FILE).unlink(missing_ok=True)  # incomplete from here on
    for stale in store.iterdir():  # another fingerprint's files, or temporary files of a killed run
        spec_of = stale.name.removesuffix(".json")
        if stale.name == FINGERPRINT_FILE:  # the raw files' own record (preprocessing.columnar.raw_fingerprint)
            continue
        if stale.name.startswith(".") or not any(s.arrow == spec_of and _finished(store, s, fingerprint)
                                                 for s in file_specs(name)):
            stale.unlink()
    count_specs = file_specs(name)[:2]
    for spec in count_specs:
        if not _finished(store, spec, fingerprint):
            convert_file(str(folder), name, spec, fingerprint, None)
    counts = _Counts(*(read_column(store / spec.arrow) for spec in count_specs))
    _check_counts(folder, counts)
    todo = [s for s in file_specs(name)[2:] if not _finished(store, s, fingerprint)]
    list((run or _run_here)([(str(folder), name, spec, fingerprint, counts) for spec in todo]))
    rows = {s.key: json.loads((store / (s.arrow + ".json")).read_text())["rows"] for s in file_specs(name)}
    meta = {"version": STORE_VERSION, "dataset": name, "fingerprint": fingerprint, "graphs": int(counts.nodes.size),
            "rows": rows}
    _write_sidecar(store / STORE_FILE, meta)
    return ColumnarStore(folder)
