"""The columnar raw store: a dataset's OGB raw layout as memory-mapped Arrow files.

OGB's loader reads a whole dataset into memory, so the raw CSVs are converted once per raw
fingerprint (:mod:`preprocessing.conversion`) into ``<dataset>/columnar/``: one Arrow IPC file per
raw CSV (column ``values``, narrowest exact dtype), a sidecar per finished file (fingerprint, rows,
bytes, xxh3), ``store.json`` last, and ``fingerprint.json`` (:func:`raw_fingerprint`'s cache).
:meth:`ColumnarStore.chunk` reads some graphs' rows and adds the reverse of every undirected edge
right after it, as OGB's loader does. Sizes are checked at every open, checksums once per build."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import xxhash

from preprocessing.config import SBM_DATASETS
from preprocessing.ogb_layout import SPLIT_KIND
from preprocessing.shard_places import digest_file

STORE_DIR = "columnar"
STORE_FILE = "store.json"
STORE_VERSION = 1
BATCH_ROWS_KEY = "satp.batch_rows"  # schema metadata of each store file
TASK = {"ogbg-code2": "code2", "ogbg-ppa": "ppa", "pattern": "pattern", "cluster": "cluster"}
UNDIRECTED = frozenset({"ogbg-ppa", *SBM_DATASETS})


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
#: In the store's folder: the last fingerprint, with the stat signature of the files it was taken from.
FINGERPRINT_FILE = "fingerprint.json"
#: A file changed less than this before it was hashed may change again within the same timestamp
#: (coarse file-system clocks): its fingerprint is not cached (git's "racy clean" rule).
RACY_NS = 2_000_000_000


def _signature(folder: Path, name: str) -> list[list]:
    """Per raw file: path, size, mtime, ctime and inode (any write changes the ctime)."""
    out = []
    for rel in required_files(name):
        path = folder / rel
        try:
            st = path.stat()
        except FileNotFoundError:
            raise ValueError(f"{path}: missing raw file of {name}") from None
        out.append([rel, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino])
    return out


def raw_fingerprint(folder: Path, name: str) -> str:
    """sha256 of the dataset's raw and split files, kept in ``columnar/fingerprint.json`` with their stat
    signature and reused while it holds (not cached for files changed within :data:`RACY_NS` of hashing)."""
    folder = Path(folder)
    if not (folder / "RELEASE_v1.txt").is_file():
        raise ValueError(f"{folder}: RELEASE_v1.txt missing, not a complete OGB dataset folder (delete it to rebuild)")
    signature = _signature(folder, name)
    cache = folder / STORE_DIR / FINGERPRINT_FILE
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        cached = json.loads(cache.read_text())
        if cached["dataset"] == name and cached["files"] == signature:
            return cached["fingerprint"]
    started = time.time_ns()
    digest = hashlib.sha256(name.encode())
    for rel in required_files(name):
        digest.update(rel.encode() + b"\0")
        digest_file(folder / rel, digest)
    fingerprint = digest.hexdigest()
    settled = all(max(mtime, ctime) < started - RACY_NS for _, _, mtime, ctime, _ in signature)
    if settled and _signature(folder, name) == signature:
        tmp = cache.with_name(f".{cache.name}.tmp-{uuid.uuid4().hex[:8]}")
        try:
            cache.parent.mkdir(exist_ok=True)
            tmp.write_text(json.dumps({"dataset": name, "fingerprint": fingerprint, "files": signature}) + "\n")
            os.replace(tmp, cache)
        except OSError:  # a read-only dataset folder: hashed again next time
            tmp.unlink(missing_ok=True)
    return fingerprint


def file_digest(path: Path) -> str:
    """xxh3-64 of a file's bytes (hex): a checksum for damage, not an identity (sha256 names data)."""
    return digest_file(path, xxhash.xxh3_64())


def store_is_current(folder: Path, fingerprint: str) -> bool:
    """True when ``folder/columnar`` is a finished store of the raw files with ``fingerprint``."""
    try:
        meta = json.loads((Path(folder) / STORE_DIR / STORE_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return meta.get("version") == STORE_VERSION and meta.get("fingerprint") == fingerprint


# ----------------------------------------------------------------------------- reading the store
def read_column(path: Path) -> np.ndarray:
    """A whole (small) one-value-per-row file of the store as one numpy array (per-graph files, splits)."""
    with pa.memory_map(str(path), "r") as source:
        column = pa.ipc.open_file(source).read_all().column(0)
        return column.to_numpy() if column.num_chunks else np.zeros(0, dtype=column.type.to_pandas_dtype())


class _MappedFile:
    """Rows of one memory-mapped store file, gathered by row index."""

    def __init__(self, path: Path):
        self.source = pa.memory_map(str(path), "r")
        self.reader = pa.ipc.open_file(self.source)
        self.type = self.reader.schema.field(0).type
        self.text = pa.types.is_large_string(self.type)
        # every batch but the last holds this many rows: a row's batch is found without reading others
        self.batch_rows = int(self.reader.schema.metadata[BATCH_ROWS_KEY.encode()])

    def _batch(self, i: int) -> np.ndarray:
        column = self.reader.get_batch(i).column(0)
        if pa.types.is_fixed_size_list(self.type):
            return column.values.to_numpy(zero_copy_only=True).reshape(len(column), -1)
        return column.to_numpy(zero_copy_only=not self.text)  # text: an array of str objects

    def gather(self, rows: np.ndarray):
        """Rows ``rows`` (int64, any order) as a numpy array (a list of str for text)."""
        batch, offset = np.divmod(rows, self.batch_rows)
        order = np.argsort(batch, kind="stable")
        out = None
        for where in np.split(order, np.flatnonzero(np.diff(batch[order])) + 1):
            if where.size:
                view = self._batch(int(batch[where[0]]))
                if out is None:
                    out = np.empty((rows.size, *view.shape[1:]), dtype=view.dtype)
                out[where] = view[offset[where]]
        if out is None:  # no rows
            fixed = pa.types.is_fixed_size_list(self.type)
            dtype = object if self.text else (self.type.value_type if fixed else self.type).to_pandas_dtype()
            out = np.zeros((0, *((self.type.list_size,) if fixed else ())), dtype=dtype)
        return out.tolist() if self.text else out

    def close(self) -> None:
        self.reader = None
        self.source.close()


class ColumnarStore:
    """A finished columnar store. Graph ``g`` owns nodes ``node_ptr[g]:node_ptr[g+1]`` and edges
    ``edge_ptr[g]:edge_ptr[g+1]`` (both directions for undirected datasets)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.path = self.folder / STORE_DIR
        try:
            meta = json.loads((self.path / STORE_FILE).read_text())
        except (OSError, json.JSONDecodeError):
            raise ValueError(f"{self.path}: not a finished columnar store") from None
        self.name: str = meta["dataset"]
        self.fingerprint: str = meta["fingerprint"]
        self.undirected = self.name in UNDIRECTED
        self.specs = {s.key: s for s in file_specs(self.name)}
        for key, record in (meta.get("files") or {}).items():  # truncated or replaced since: named here
            path = self.path / self.specs[key].arrow
            size = path.stat().st_size if path.is_file() else None
            if size != record["bytes"]:
                found = "missing" if size is None else f"{size} bytes, {record['bytes']} recorded"
                raise ValueError(f"{path}: damaged columnar store file ({found}); `satp preprocess` converts it again")
        nodes, edges = read_column(self.path / "num_nodes.arrow"), read_column(self.path / "num_edges.arrow")
        self.raw_edge_ptr = np.concatenate([[0], np.cumsum(edges)]).astype(np.int64)  # rows of the edge files
        self.node_ptr = np.concatenate([[0], np.cumsum(nodes)]).astype(np.int64)
        self.edge_ptr = np.concatenate([[0], np.cumsum(edges * (2 if self.undirected else 1))]).astype(np.int64)
        self.splits = {s: read_column(self.path / f"split-{s}.arrow").astype(np.int64) for s in ("train", "valid", "test")}
        self.y = read_column(self.path / "y.arrow").astype(np.int64) if "y" in self.specs else None

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
        from sat.layout import concat_ranges  # (sat imports torch: not at this module's import)

        ids = np.asarray(ids, dtype=np.int64)
        nn = self.node_ptr[ids + 1] - self.node_ptr[ids]
        raw_ptr = self.raw_edge_ptr
        ne = raw_ptr[ids + 1] - raw_ptr[ids]
        node_rows = concat_ranges(self.node_ptr[ids], nn)
        edge_rows = concat_ranges(raw_ptr[ids], ne)
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
                values = f.gather(node_rows if spec.per == "node" else edge_rows).astype(spec.decode, copy=False)
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
