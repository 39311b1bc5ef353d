"""The columnar raw store: OGB's raw layout converted once, streaming, into memory-mapped Arrow files.

OGB's own loader reads a whole dataset into memory (ogbg-ppa: ~80 GB of Python-side peak for
158k graphs), so the pipeline reads the raw CSVs itself, in one bounded-memory pass per file
(gzip decompressed in blocks of lines, parsed by Arrow's CSV reader, never a whole file), into::

    <dataset folder>/columnar/
        store.json            written last: schema version, dataset, source fingerprint, files
        edge.arrow            one Arrow IPC file per raw CSV (raw/edge.csv.gz -> edge.arrow,
        edge-feat.arrow ...   split/<kind>/train.csv.gz -> split-train.arrow): uncompressed record
        split-train.arrow     batches of :data:`BATCH_ROWS` rows, one column ``values``: one value
                              per line, a ``fixed_size_list`` of k values per line, or the line's
                              text (code2 labels)
        edge.arrow.json       sidecar of a finished file (fingerprint, rows): a killed conversion
                              resumes with the files not yet finished

A store is built once per raw fingerprint (sha256 of the raw files' bytes,
:func:`raw_fingerprint`); a store of other raw files is replaced. The conversion checks what
OGB's loader would trip over or silently accept, each as a one-line ``ValueError`` naming the
file and, where it applies, the graph: truncated or corrupt gzip, line counts against
``num-node-list`` / ``num-edge-list``, empty graphs, graphs without edges, edge ids outside a
graph, NaN / infinite features, negative ids, class ids outside the dataset's range, split ids
outside the dataset. Values are stored in the narrowest type that holds them exactly (node ids
int32; features float32 as OGB's loader casts them) and decoded to OGB's dtypes.

:class:`ColumnarStore` opens a finished store holding only per-graph arrays (offsets, splits,
ppa labels) in memory; :meth:`ColumnarStore.chunk` reads the rows of some graphs from the
memory-mapped files (only the pages it needs, unmapped again when it returns), so shard tasks
read their own graphs and the driver never holds the dataset. Undirected datasets (ppa and the
SBM sets) store each edge once, as the raw files do; reading adds the reverse of every edge
right after it (``u->v, v->u``) with a copy of its features, as OGB's loader does.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

from preprocessing.config import SBM_DATASETS
from preprocessing.ogb_layout import SPLIT_KIND

STORE_DIR = "columnar"
STORE_FILE = "store.json"
STORE_VERSION = 1
#: Rows per record batch (readers locate rows by the batches' lengths, as written).
BATCH_ROWS = 1 << 18
#: Decompressed bytes parsed at a time (cut at a line end): bounds the conversion's memory.
BLOCK_BYTES = 1 << 23
TASK = {"ogbg-code2": "code2", "ogbg-ppa": "ppa", "pattern": "pattern", "cluster": "cluster"}
UNDIRECTED = frozenset({"ogbg-ppa", *SBM_DATASETS})
NUM_CLASSES = {"ogbg-ppa": 37}  # graph classes; the SBM sets' node classes come from preprocessing.sbm
#: pandas' default NA strings: OGB reads code2 labels with pandas, which turns these into NaN ("nan").
_PANDAS_NA = frozenset({"", "#N/A", "#N/A N/A", "#NA", "-1.#IND", "-1.#QNAN", "-NaN", "-nan", "1.#IND", "1.#QNAN",
                        "<NA>", "N/A", "NA", "NULL", "NaN", "None", "n/a", "nan", "null"})


@dataclass(frozen=True)
class FileSpec:
    """How one raw CSV is parsed, stored and decoded."""

    rel: str  # path in the dataset folder
    key: str  # name in the store (``<key>.arrow``) and in :meth:`ColumnarStore.chunk`
    per: str  # "graph", "node", "edge" or "split": whose rows these are
    columns: int = 1  # values per line
    parse: str = "int64"  # int64, float64 or text
    store: str = "int64"  # storage dtype (exact for every valid value)
    decode: str = "int64"  # dtype handed out (OGB's)

    @property
    def arrow(self) -> str:
        return f"{self.key}.arrow"


def _int(rel, key, per, columns=1, store="int32"):
    return FileSpec(rel, key, per, columns, "int64", store, "int64")


_COUNTS = [_int("raw/num-node-list.csv.gz", "num_nodes", "graph", store="int64"),
           _int("raw/num-edge-list.csv.gz", "num_edges", "graph", store="int64")]
_SPECS = {
    "ogbg-code2": [
        FileSpec("raw/graph-label.csv.gz", "y_tokens", "graph", parse="text", store="text", decode="text"),
        _int("raw/edge.csv.gz", "edge_index", "edge", 2),
        _int("raw/node-feat.csv.gz", "x", "node", 2),
        _int("raw/node_is_attributed.csv.gz", "node_is_attributed", "node", store="int8"),
        _int("raw/node_dfs_order.csv.gz", "node_dfs_order", "node"),
        _int("raw/node_depth.csv.gz", "node_depth", "node"),
    ],
    "ogbg-ppa": [
        _int("raw/graph-label.csv.gz", "y", "graph", store="int8"),
        _int("raw/edge.csv.gz", "edge_index", "edge", 2),
        FileSpec("raw/edge-feat.csv.gz", "edge_attr", "edge", 7, "float64", "float32", "float32"),
    ],
    **{name: [
        _int("raw/edge.csv.gz", "edge_index", "edge", 2),
        _int("raw/node-feat.csv.gz", "x", "node", store="int8"),
        _int("raw/node-label.csv.gz", "node_label", "node", store="int8"),
    ] for name in SBM_DATASETS},
}


def file_specs(name: str) -> list[FileSpec]:
    """Every raw and split file of dataset ``name``, counts first."""
    splits = [_int(f"split/{SPLIT_KIND[name]}/{s}.csv.gz", f"split-{s}", "split", store="int64")
              for s in ("train", "valid", "test")]
    return _COUNTS + _SPECS[name] + splits


def required_files(name: str) -> list[str]:
    """The raw and split files of ``name`` (paths in its folder)."""
    return [spec.rel for spec in file_specs(name)]


# ----------------------------------------------------------------------------- fingerprint
def raw_fingerprint(folder: Path, name: str) -> str:
    """sha256 of the dataset's raw and split files (their bytes as stored, in a fixed order).

    Checks only what it needs to read: ``RELEASE_v1.txt`` (without it OGB calls ``input()``) and
    every file present. Reads the compressed bytes once (seconds for ogbg-ppa's ~6 GB).
    """
    folder = Path(folder)
    if not (folder / "RELEASE_v1.txt").is_file():
        raise ValueError(f"{folder}: RELEASE_v1.txt missing, not a complete OGB dataset folder (delete it to rebuild)")
    digest = hashlib.sha256(name.encode())
    for rel in required_files(name):
        path = folder / rel
        if not path.is_file():
            raise ValueError(f"{path}: missing raw file of {name}")
        digest.update(rel.encode() + b"\0")
        with open(path, "rb") as fh:
            while chunk := fh.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()


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
    if spec.store == "text":
        return pa.schema([("values", pa.large_string())])
    kind = pa.from_numpy_dtype(np.dtype(spec.store))
    return pa.schema([("values", kind if spec.columns == 1 else pa.list_(kind, spec.columns))])


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


def store_is_current(folder: Path, fingerprint: str) -> bool:
    """True when ``folder/columnar`` is a finished store of the raw files with ``fingerprint``."""
    try:
        meta = json.loads((Path(folder) / STORE_DIR / STORE_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return meta.get("version") == STORE_VERSION and meta.get("fingerprint") == fingerprint


Runner = Callable[[list[tuple]], Iterable[dict]]


def _run_here(calls: list[tuple]) -> Iterator[dict]:
    for args in calls:
        yield convert_file(*args)


def build_store(folder: Path, name: str, fingerprint: str, run: Runner | None = None,
                on_file: Callable[[FileSpec], None] | None = None) -> "ColumnarStore":
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
        if stale.name.startswith(".") or not any(s.arrow == spec_of and _finished(store, s, fingerprint)
                                                 for s in file_specs(name)):
            stale.unlink()
    count_specs = file_specs(name)[:2]
    for spec in count_specs:
        if not _finished(store, spec, fingerprint):
            convert_file(str(folder), name, spec, fingerprint, None)
    counts = _Counts(*(_read_column(store / spec.arrow) for spec in count_specs))
    _check_counts(folder, counts)
    todo = [s for s in file_specs(name)[2:] if not _finished(store, s, fingerprint)]
    for spec in todo:
        if on_file is not None:
            on_file(spec)
    list((run or _run_here)([(str(folder), name, spec, fingerprint, counts) for spec in todo]))
    rows = {s.key: json.loads((store / (s.arrow + ".json")).read_text())["rows"] for s in file_specs(name)}
    meta = {"version": STORE_VERSION, "dataset": name, "fingerprint": fingerprint, "graphs": int(counts.nodes.size),
            "rows": rows}
    _write_sidecar(store / STORE_FILE, meta)
    return ColumnarStore(folder)


def remove_store(folder: Path) -> None:
    shutil.rmtree(Path(folder) / STORE_DIR, ignore_errors=True)


# ----------------------------------------------------------------------------- reading the store
def _read_column(path: Path) -> np.ndarray:
    """A whole (small) numeric file of the store as one numpy array (per-graph files, splits)."""
    with pa.memory_map(str(path), "r") as source:
        table = pa.ipc.open_file(source).read_all()
        column = table.column(0)
        if pa.types.is_fixed_size_list(column.type):
            k = column.type.list_size
            return np.concatenate([c.flatten().to_numpy() for c in column.chunks] or [np.zeros(0)]).reshape(-1, k)
        return (np.concatenate([c.to_numpy() for c in column.chunks]) if column.num_chunks
                else np.zeros(0, dtype=column.type.to_pandas_dtype()))


class _MappedFile:
    """Rows of one memory-mapped store file, gathered by row index."""

    def __init__(self, path: Path):
        self.source = pa.memory_map(str(path), "r")
        self.reader = pa.ipc.open_file(self.source)
        self.type = self.reader.schema.field(0).type
        lengths = [self.reader.get_batch(i).num_rows for i in range(self.reader.num_record_batches)]
        self.starts = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])  # first row of each batch

    def _batch(self, i: int):
        column = self.reader.get_batch(i).column(0)
        if pa.types.is_fixed_size_list(self.type):
            return column.values.to_numpy(zero_copy_only=True).reshape(len(column), -1)
        if pa.types.is_large_string(self.type):
            return column
        return column.to_numpy(zero_copy_only=True)

    def gather(self, rows: np.ndarray):
        """Rows ``rows`` (int64, any order) as a numpy array (a list of str for text)."""
        batch = np.searchsorted(self.starts, rows, side="right") - 1
        offset = rows - self.starts[batch]
        order = np.argsort(batch, kind="stable") if (np.diff(batch) < 0).any() else None
        sorted_batch = batch if order is None else batch[order]
        cuts = np.flatnonzero(np.diff(sorted_batch)) + 1
        starts = np.concatenate([[0], cuts])
        ends = np.concatenate([cuts, [rows.size]])
        if pa.types.is_large_string(self.type):
            out: list = [None] * rows.size
            for a, b in zip(starts.tolist(), ends.tolist()):
                where = np.arange(a, b) if order is None else order[a:b]
                texts = self._batch(int(sorted_batch[a])).take(pa.array(offset[where])).to_pylist()
                for i, text in zip(where.tolist(), texts):
                    out[i] = text
            return out
        out = None
        for a, b in zip(starts.tolist(), ends.tolist()):
            view = self._batch(int(sorted_batch[a]))
            if out is None:
                out = np.empty((rows.size, *view.shape[1:]), dtype=view.dtype)
            where = slice(a, b) if order is None else order[a:b]
            out[where] = view[offset[where]]
        if out is None:  # no rows
            fixed = pa.types.is_fixed_size_list(self.type)
            dtype = (self.type.value_type if fixed else self.type).to_pandas_dtype()
            out = np.zeros((0, *((self.type.list_size,) if fixed else ())), dtype=dtype)
        return out

    def close(self) -> None:
        self.reader = None
        self.source.close()


def _concat_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    from sat.layout import concat_ranges  # (sat imports torch: not at this module's import)

    return concat_ranges(starts, lengths)


class ColumnarStore:
    """A finished columnar store (see the module docstring); only per-graph arrays in memory.

    Graph ``g`` owns nodes ``node_ptr[g]:node_ptr[g+1]`` and edges ``edge_ptr[g]:edge_ptr[g+1]``
    (both directions counted for undirected datasets, as OGB's loader returns them).
    """

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.path = self.folder / STORE_DIR
        try:
            meta = json.loads((self.path / STORE_FILE).read_text())
        except (OSError, json.JSONDecodeError):
            raise ValueError(f"{self.path}: not a finished columnar store") from None
        self.name: str = meta["dataset"]
        self.fingerprint: str = meta["fingerprint"]
        self.specs = {s.key: s for s in file_specs(self.name)}
        nodes, edges = _read_column(self.path / "num_nodes.arrow"), _read_column(self.path / "num_edges.arrow")
        self.raw_edges = edges  # one direction per undirected edge, as in the raw files
        self.node_ptr = np.concatenate([[0], np.cumsum(nodes)]).astype(np.int64)
        self.edge_ptr = np.concatenate([[0], np.cumsum(edges * (2 if self.undirected else 1))]).astype(np.int64)
        self.splits = {s: _read_column(self.path / f"split-{s}.arrow").astype(np.int64) for s in ("train", "valid", "test")}
        self.y = _read_column(self.path / "y.arrow").astype(np.int64) if "y" in self.specs else None

    @property
    def undirected(self) -> bool:
        return self.name in UNDIRECTED

    @property
    def task(self) -> str:
        return TASK[self.name]

    @property
    def num_graphs(self) -> int:
        return self.node_ptr.size - 1

    def labels(self, ids: np.ndarray) -> list[list[str]]:
        """code2: the target subtokens of graphs ``ids`` (OGB's ``str(label).split(' ')``)."""
        f = _MappedFile(self.path / self.specs["y_tokens"].arrow)
        try:
            return [text.split(" ") for text in f.gather(np.asarray(ids, dtype=np.int64))]
        finally:
            f.close()

    def chunk(self, ids: np.ndarray) -> dict:
        """The raw arrays of graphs ``ids`` (any order), compact and picklable; read from the
        memory-mapped files, which are unmapped again before it returns."""
        ids = np.asarray(ids, dtype=np.int64)
        nn = self.node_ptr[ids + 1] - self.node_ptr[ids]
        raw_ptr = np.concatenate([[0], np.cumsum(self.raw_edges)])
        ne = raw_ptr[ids + 1] - raw_ptr[ids]
        node_rows = _concat_ranges(self.node_ptr[ids], nn)
        edge_rows = _concat_ranges(raw_ptr[ids], ne)
        factor = 2 if self.undirected else 1
        out = {
            "graph_id": ids,
            "node_ptr": np.concatenate([[0], np.cumsum(nn)]),
            "edge_ptr": np.concatenate([[0], np.cumsum(factor * ne)]),
        }
        for key, spec in self.specs.items():
            if spec.per not in ("node", "edge") or key == "node_dfs_order":
                continue
            f = _MappedFile(self.path / spec.arrow)
            try:
                values = f.gather(node_rows if spec.per == "node" else edge_rows).astype(spec.decode)
            finally:
                f.close()
            if key == "edge_index":
                values = values.T
                if self.undirected:  # u->v, v->u interleaved (OGB's add_inverse_edge)
                    both = np.empty((2, 2 * values.shape[1]), dtype=values.dtype)
                    both[:, 0::2] = values
                    both[:, 1::2] = values[::-1]
                    values = both
            elif spec.per == "edge" and self.undirected:
                values = np.repeat(values, 2, axis=0)
            out[key] = values
        if self.y is not None:
            out["y"] = self.y[ids]
        if "y_tokens" in self.specs:
            out["y_tokens"] = self.labels(ids)
        return out
