"""Data sources behind one interface: OGB's raw layout, loaded through ``ogb``'s own loader.

:func:`load_source` returns a :class:`RawStore` for ``ogbg-code2`` or ``ogbg-ppa`` (and, through
:func:`load_sbm_store` instead of ``ogb``, for PATTERN / CLUSTER: see the end of this docstring):

1. If ``<root>/<ogb dir>`` is absent, the configured builder creates it (``pycode`` for code2 from
   Python source, ``synthetic`` for ppa) or ``ogb`` downloads it (needs internet).
2. The folder is checked: ``RELEASE_v1.txt`` present (else ogb would call ``input()``), every raw
   and split file present and a complete gzip stream (a truncated file is named), line counts
   consistent with ``num-node-list`` / ``num-edge-list``. The same pass hashes the files (the
   *source fingerprint*).
3. ``ogb.graphproppred.PygGraphPropPredDataset`` loads it (``torch.load`` safe globals registered,
   its processed cache invalidated when the fingerprint changes, stdout sent to stderr), with
   OGB's official split.
4. The collated tensors are checked, vectorised: empty graphs, graphs without edges, edge ids
   out of range, NaN/inf features. Every error is a one-line ``ValueError`` naming the file or the
   graph id.

PATTERN and CLUSTER (``source: sbm``; OGB-like layout of :mod:`preprocessing.sbm`, with node-level
labels that ``ogb`` cannot read): steps 1, 2 and 4 as above (the builder is
:func:`preprocessing.sbm.build_sbm`), step 3 reads the gzip CSVs with pandas' C parser; the reverse
of every undirected edge is added (``u->v, v->u`` interleaved, as OGB's loader does), node input
ids and labels are checked against the recipe's ranges.
"""
from __future__ import annotations

import contextlib
import gzip
import hashlib
import os
import shutil
import sys
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from preprocessing.config import SBM_DATASETS, DataConfig
from preprocessing.ogb_layout import OGB_DIR, SPLIT_KIND
from preprocessing.sbm import NODE_VOCAB, NUM_CLASSES

TASK = {"ogbg-code2": "code2", "ogbg-ppa": "ppa", "pattern": "pattern", "cluster": "cluster"}
_GRAPH_FILES = {"ogbg-code2": ["graph-label"], "ogbg-ppa": ["graph-label"], "pattern": [], "cluster": []}
_NODE_FILES = {"ogbg-code2": ["node-feat", "node_is_attributed", "node_dfs_order", "node_depth"], "ogbg-ppa": [],
               "pattern": ["node-feat", "node-label"], "cluster": ["node-feat", "node-label"]}
_EDGE_FILES = {"ogbg-code2": ["edge"], "ogbg-ppa": ["edge", "edge-feat"], "pattern": ["edge"], "cluster": ["edge"]}
FINGERPRINT_FILE = "satp_fingerprint.txt"


def dataset_dir(data: DataConfig) -> Path:
    return Path(data.root) / OGB_DIR[data.name]


def required_files(name: str) -> list[str]:
    raw = ["num-node-list", "num-edge-list"] + _GRAPH_FILES[name] + _EDGE_FILES[name] + _NODE_FILES[name]
    files = [f"raw/{f}.csv.gz" for f in raw]
    files += [f"split/{SPLIT_KIND[name]}/{s}.csv.gz" for s in ("train", "valid", "test")]
    return files


def _scan_gzip(path: Path, digest) -> tuple[int, bytes]:
    """Stream ``path``: update ``digest`` with its bytes; return (lines, first 64 KiB decompressed)."""
    lines, head, last = 0, b"", b"\n"
    dec = zlib.decompressobj(16 + zlib.MAX_WBITS)
    ended = False
    try:
        with open(path, "rb") as fh:
            while chunk := fh.read(1 << 20):
                digest.update(chunk)
                while chunk:
                    if ended:  # a further gzip member
                        dec, ended = zlib.decompressobj(16 + zlib.MAX_WBITS), False
                    out = dec.decompress(chunk)
                    if out:
                        lines += out.count(b"\n")
                        last = out[-1:]
                        if len(head) < 65536:
                            head += out[: 65536 - len(head)]
                    if dec.eof:
                        ended, chunk = True, dec.unused_data
                    else:
                        chunk = b""
    except zlib.error as exc:
        raise ValueError(f"{path}: corrupt gzip data ({exc})") from None
    if not ended:
        raise ValueError(f"{path}: truncated (the gzip stream ends early)")
    if head and last != b"\n":
        lines += 1
    return lines, head


def _read_int_column(path: Path) -> np.ndarray:
    with gzip.open(path, "rb") as fh:
        text = fh.read()
    try:
        return np.array(text.split(), dtype=np.int64) if text.strip() else np.zeros(0, dtype=np.int64)
    except ValueError:
        raise ValueError(f"{path}: expected one integer per line") from None


def check_raw(folder: Path, name: str) -> str:
    """Check an OGB raw folder (see the module docstring); return its fingerprint (sha256)."""
    if not (folder / "RELEASE_v1.txt").is_file():
        raise ValueError(f"{folder}: RELEASE_v1.txt missing, not a complete OGB dataset folder (delete it to rebuild)")
    digest = hashlib.sha256(name.encode())
    lines: dict[str, int] = {}
    for rel in required_files(name):
        path = folder / rel
        if not path.is_file():
            raise ValueError(f"{path}: missing raw file of {name}")
        digest.update(rel.encode() + b"\0")
        lines[rel], _ = _scan_gzip(path, digest)
    n_nodes = _read_int_column(folder / "raw/num-node-list.csv.gz")
    n_edges = _read_int_column(folder / "raw/num-edge-list.csv.gz")
    graphs = n_nodes.size
    if n_edges.size != graphs:
        raise ValueError(f"{folder / 'raw/num-edge-list.csv.gz'}: {n_edges.size} graphs, num-node-list has {graphs}")
    for f in _GRAPH_FILES[name]:
        rel = f"raw/{f}.csv.gz"
        if lines[rel] != graphs:
            raise ValueError(f"{folder / rel}: {lines[rel]} lines, expected {graphs}")
    if (n_nodes < 0).any() or (n_edges < 0).any():
        raise ValueError(f"{folder / 'raw'}: negative node or edge counts")
    for f in _NODE_FILES[name]:
        rel = f"raw/{f}.csv.gz"
        if lines[rel] != int(n_nodes.sum()):
            raise ValueError(f"{folder / rel}: {lines[rel]} lines, expected {int(n_nodes.sum())} (one per node): truncated?")
    for f in _EDGE_FILES[name]:
        rel = f"raw/{f}.csv.gz"
        if lines[rel] != int(n_edges.sum()):
            raise ValueError(f"{folder / rel}: {lines[rel]} lines, expected {int(n_edges.sum())} (one per edge): truncated?")
    for s in ("train", "valid", "test"):
        path = folder / f"split/{SPLIT_KIND[name]}/{s}.csv.gz"
        ids = _read_int_column(path)
        if ids.size and (ids.min() < 0 or ids.max() >= graphs):
            raise ValueError(f"{path}: graph ids outside [0, {graphs})")
    return digest.hexdigest()


def _register_safe_globals() -> None:
    import torch
    from torch_geometric.data.data import DataEdgeAttr, DataTensorAttr
    from torch_geometric.data.storage import GlobalStorage

    torch.serialization.add_safe_globals([DataEdgeAttr, DataTensorAttr, GlobalStorage])


@dataclass
class RawStore:
    """A whole OGB graph-property dataset as concatenated numpy arrays (local node ids).

    Graph ``g`` owns nodes ``node_ptr[g]:node_ptr[g+1]`` and edges ``edge_ptr[g]:edge_ptr[g+1]``.
    """

    name: str
    folder: Path
    fingerprint: str
    node_ptr: np.ndarray
    edge_ptr: np.ndarray
    edge_index: np.ndarray  # [2, E] int64, local ids
    splits: dict[str, np.ndarray]
    x: np.ndarray | None = None  # code2 [N, 2]; pattern / cluster [N] node input ids
    node_depth: np.ndarray | None = None  # code2 [N]
    node_is_attributed: np.ndarray | None = None  # code2 [N]
    edge_attr: np.ndarray | None = None  # ppa [E, 7] float32
    y: np.ndarray | None = None  # ppa [G]
    y_tokens: list[list[str]] | None = None  # code2
    node_label: np.ndarray | None = None  # pattern / cluster [N] int64 node classes
    extra: dict = field(default_factory=dict)

    @property
    def task(self) -> str:
        return TASK[self.name]

    @property
    def num_graphs(self) -> int:
        return self.node_ptr.size - 1

    def chunk(self, ids: np.ndarray) -> dict:
        """The raw arrays of graphs ``ids`` (any order), compact and picklable (sent to Ray tasks)."""
        from sat.layout import concat_ranges  # (sat imports torch: not at this module's import)

        ids = np.asarray(ids, dtype=np.int64)
        nn = self.node_ptr[ids + 1] - self.node_ptr[ids]
        ne = self.edge_ptr[ids + 1] - self.edge_ptr[ids]
        node_sel = concat_ranges(self.node_ptr[ids], nn)
        edge_sel = concat_ranges(self.edge_ptr[ids], ne)
        out = {
            "graph_id": ids,
            "node_ptr": np.concatenate([[0], np.cumsum(nn)]),
            "edge_ptr": np.concatenate([[0], np.cumsum(ne)]),
            "edge_index": self.edge_index[:, edge_sel],
        }
        for key in _NODE_ARRAYS:
            value = getattr(self, key)
            if value is not None:
                out[key] = value[node_sel]
        if self.edge_attr is not None:
            out["edge_attr"] = self.edge_attr[edge_sel]
        if self.y is not None:
            out["y"] = self.y[ids]
        if self.y_tokens is not None:
            out["y_tokens"] = [self.y_tokens[i] for i in ids.tolist()]
        return out


_NODE_ARRAYS = ("x", "node_depth", "node_is_attributed", "node_label")  # RawStore fields with one row per node


def iter_chunk(chunk: dict):
    """Yield one raw graph dict per graph of a :meth:`RawStore.chunk`."""
    nptr, eptr = chunk["node_ptr"], chunk["edge_ptr"]
    for j, gid in enumerate(chunk["graph_id"].tolist()):
        a, b, c, d = nptr[j], nptr[j + 1], eptr[j], eptr[j + 1]
        g = {"graph_id": gid, "num_nodes": int(b - a), "edge_index": chunk["edge_index"][:, c:d]}
        for key in _NODE_ARRAYS:
            if key in chunk:
                g[key] = chunk[key][a:b]
        if "edge_attr" in chunk:
            g["edge_attr"] = chunk["edge_attr"][c:d]
        if "y" in chunk:
            g["y"] = int(chunk["y"][j])
        if "y_tokens" in chunk:
            g["y_tokens"] = chunk["y_tokens"][j]
        yield g


def ensure_dataset(data: DataConfig) -> Path:
    """Create ``<root>/<ogb dir>`` with the configured offline builder when it is absent."""
    folder = dataset_dir(data)
    if folder.exists():
        return folder
    if data.source == "pycode":
        from preprocessing.pycode import build_pycode

        print(f"satp: building {folder} from Python source", file=sys.stderr)
        build_pycode(data.root, data.source_dirs or None, include_tests=data.include_tests)
    elif data.source == "synthetic":
        from preprocessing.synthetic import build_synthetic_ppa

        print(f"satp: writing a synthetic ogbg-ppa to {folder}", file=sys.stderr)
        build_synthetic_ppa(data.root, data.synthetic_graphs, seed=data.seed)
    elif data.source == "sbm":
        from preprocessing.sbm import build_sbm

        print(f"satp: regenerating {data.name.upper()} (SBM recipe, seed {data.seed}) in {folder}", file=sys.stderr)
        build_sbm(data.root, data.name, seed=data.seed)
    return folder


def load_source(data: DataConfig, fingerprint: str | None = None) -> RawStore:
    """Load (building or downloading first if needed) and check a dataset; see the module docstring.

    ``fingerprint``: the result of :func:`check_raw` on the folder, when the caller just ran it.
    """
    os.environ.setdefault("OUTDATED_IGNORE", "1")
    folder = ensure_dataset(data)
    if data.name in SBM_DATASETS:
        store = load_sbm_store(folder, data.name, fingerprint or check_raw(folder, data.name))
        validate_store(store)
        return store
    if folder.exists():
        fingerprint = fingerprint or check_raw(folder, data.name)
        stamp = folder / "processed" / FINGERPRINT_FILE
        if (folder / "processed").exists() and (not stamp.is_file() or stamp.read_text().strip() != fingerprint):
            shutil.rmtree(folder / "processed")  # OGB would reuse a cache of other raw files
    ds = _ogb_dataset(data, folder)
    try:
        if fingerprint is None:  # downloaded just now
            fingerprint = check_raw(folder, data.name)
        store = _to_store(ds, data.name, folder, fingerprint)
        validate_store(store)
    except ValueError:
        shutil.rmtree(folder / "processed", ignore_errors=True)  # no cache is left of data that failed its checks
        raise
    (folder / "processed").mkdir(exist_ok=True)
    (folder / "processed" / FINGERPRINT_FILE).write_text(fingerprint + "\n")
    return store


def _ogb_dataset(data: DataConfig, folder: Path):
    _register_safe_globals()
    import ogb.graphproppred.dataset_pyg as ogb_pyg

    decide = ogb_pyg.decide_download
    ogb_pyg.decide_download = lambda url: True  # no input() prompt for datasets over 1 GB
    existed = folder.exists()
    root = Path(data.root)
    root_existed, before = root.exists(), set(os.listdir(root)) if root.is_dir() else set()
    try:
        with contextlib.redirect_stdout(sys.stderr):
            return ogb_pyg.PygGraphPropPredDataset(name=data.name, root=str(data.root))
    except (ValueError, OSError) as exc:
        raise ValueError(f"{folder}: ogb could not load {data.name}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    except Exception as exc:  # pandas / torch / ogb assertion errors
        raise ValueError(f"{folder}: ogb could not load {data.name}: {type(exc).__name__}: {exc}".splitlines()[0]) from None
    finally:
        ogb_pyg.decide_download = decide
        if not existed and folder.exists() and not (folder / "RELEASE_v1.txt").is_file():
            shutil.rmtree(folder, ignore_errors=True)  # a failed download leaves no partial folder
        if not existed and not folder.exists() and root.is_dir():
            for name in set(os.listdir(root)) - before:
                if name.endswith(".zip"):  # a partial download, which ogb would take as complete next time
                    (root / name).unlink(missing_ok=True)
            if not root_existed and not any(root.iterdir()):
                root.rmdir()  # nor an empty data.root


def _read_int_table(path: Path, columns: int) -> np.ndarray:
    """A headerless gzip CSV of integers -> ``[rows, columns]`` int64 (pandas' C parser: fast on
    PATTERN's ~43M edge lines, where ``str.split`` would need gigabytes)."""
    import pandas as pd

    try:
        table = pd.read_csv(path, header=None, dtype=np.int64, compression="gzip", engine="c")
    except pd.errors.EmptyDataError:
        return np.zeros((0, columns), dtype=np.int64)
    except (ValueError, TypeError, OSError, EOFError, pd.errors.ParserError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ValueError(f"{path}: expected {columns} integer(s) per line ({first})") from None
    if table.shape[1] != columns:
        raise ValueError(f"{path}: expected {columns} integer(s) per line, found {table.shape[1]}")
    return table.to_numpy()


def load_sbm_store(folder: Path, name: str, fingerprint: str) -> RawStore:
    """PATTERN / CLUSTER raw layout (:mod:`preprocessing.sbm`) -> :class:`RawStore` with both
    directions of every edge; ``folder`` already passed :func:`check_raw` (``fingerprint``)."""
    raw = folder / "raw"
    n_nodes = _read_int_column(raw / "num-node-list.csv.gz")
    n_edges = _read_int_column(raw / "num-edge-list.csv.gz")
    edges = _read_int_table(raw / "edge.csv.gz", 2)
    edge_index = np.empty((2, 2 * edges.shape[0]), dtype=np.int64)
    edge_index[:, 0::2] = edges.T
    edge_index[:, 1::2] = edges.T[::-1]
    splits = {s: _read_int_column(folder / f"split/{SPLIT_KIND[name]}/{s}.csv.gz") for s in ("train", "valid", "test")}
    return RawStore(
        name=name, folder=folder, fingerprint=fingerprint,
        node_ptr=np.concatenate([[0], np.cumsum(n_nodes)]), edge_ptr=np.concatenate([[0], np.cumsum(2 * n_edges)]),
        edge_index=edge_index, splits=splits,
        x=_read_int_table(raw / "node-feat.csv.gz", 1)[:, 0], node_label=_read_int_table(raw / "node-label.csv.gz", 1)[:, 0],
    )


def _to_store(ds, name: str, folder: Path, fingerprint: str) -> RawStore:
    import torch

    data, slices = ds._data, ds.slices
    edge_ptr = slices["edge_index"].numpy().astype(np.int64)
    if "x" in slices:
        node_ptr = slices["x"].numpy().astype(np.int64)
    else:
        counts = data._num_nodes if hasattr(data, "_num_nodes") else None
        if counts is None:
            counts = [ds[i].num_nodes for i in range(len(ds))]
        node_ptr = np.concatenate([[0], np.cumsum(np.asarray(counts, dtype=np.int64))])
    split = ds.get_idx_split()
    splits = {k: (v.numpy() if isinstance(v, torch.Tensor) else np.asarray(v)).astype(np.int64) for k, v in split.items()}
    store = RawStore(
        name=name, folder=folder, fingerprint=fingerprint, node_ptr=node_ptr, edge_ptr=edge_ptr,
        edge_index=data.edge_index.numpy(), splits=splits,
    )
    if name == "ogbg-code2":
        store.x = data.x.numpy()
        store.node_depth = data.node_depth.numpy().reshape(-1)
        store.node_is_attributed = data.node_is_attributed.numpy().reshape(-1)
        store.y_tokens = list(data.y)
    else:
        store.edge_attr = data.edge_attr.numpy().astype(np.float32, copy=False)
        store.y = data.y.numpy().reshape(-1).astype(np.int64)
    return store


def validate_store(store: RawStore) -> None:
    """Vectorised checks of a loaded dataset; the first bad graph is named."""
    where = store.folder / "raw"
    nn = np.diff(store.node_ptr)
    ne = np.diff(store.edge_ptr)
    if store.num_graphs == 0:
        raise ValueError(f"{where}: the dataset has no graphs")
    if (nn == 0).any():
        raise ValueError(f"{where}: graph {int(np.flatnonzero(nn == 0)[0])} is empty (0 nodes)")
    if (ne == 0).any():
        raise ValueError(f"{where}: graph {int(np.flatnonzero(ne == 0)[0])} has no edges")
    graph_of_edge = np.repeat(np.arange(store.num_graphs), ne)
    limit = nn[graph_of_edge]
    bad = (store.edge_index < 0).any(axis=0) | (store.edge_index >= limit).any(axis=0)
    if bad.any():
        g = int(graph_of_edge[np.flatnonzero(bad)[0]])
        raise ValueError(f"{where / 'edge.csv.gz'}: graph {g} has edge ids outside [0, {int(nn[g])})")
    for key, fname, per in (("edge_attr", "edge-feat.csv.gz", "edge"), ("x", "node-feat.csv.gz", "node")):
        value = getattr(store, key)
        if value is None or not np.issubdtype(value.dtype, np.floating):
            continue
        finite = np.isfinite(value).all(axis=1) if value.ndim > 1 else np.isfinite(value)
        if not finite.all():
            ptr = store.edge_ptr if per == "edge" else store.node_ptr
            g = int(np.searchsorted(ptr, np.flatnonzero(~finite)[0], side="right") - 1)
            raise ValueError(f"{where / fname}: graph {g} has NaN or infinite {per} features")
    if store.task == "code2":
        if store.x.ndim != 2 or store.x.shape[1] != 2 or (store.x < 0).any():
            raise ValueError(f"{where / 'node-feat.csv.gz'}: expected 2 non-negative integer ids per node")
    if store.task == "ppa" and store.y is not None and ((store.y < 0) | (store.y >= 37)).any():
        raise ValueError(f"{where / 'graph-label.csv.gz'}: class ids outside [0, 37)")
    if store.name in SBM_DATASETS:
        for key, fname, limit, what in (("x", "node-feat.csv.gz", NODE_VOCAB[store.name], "node input ids"),
                                        ("node_label", "node-label.csv.gz", NUM_CLASSES[store.name], "node classes")):
            bad = np.flatnonzero((getattr(store, key) < 0) | (getattr(store, key) >= limit))
            if bad.size:
                g = int(np.searchsorted(store.node_ptr, bad[0], side="right") - 1)
                raise ValueError(f"{where / fname}: graph {g} has {what} outside [0, {limit})")
