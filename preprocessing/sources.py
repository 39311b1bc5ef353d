"""Data sources behind one interface: OGB's raw layout, loaded through ``ogb``'s own loader.

:func:`load_source` returns a :class:`RawStore` for ``ogbg-code2`` or ``ogbg-ppa``:

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

from preprocessing.config import DataConfig
from preprocessing.ogb_layout import OGB_DIR, SPLIT_KIND

TASK = {"ogbg-code2": "code2", "ogbg-ppa": "ppa"}
_NODE_FILES = {"ogbg-code2": ["node-feat", "node_is_attributed", "node_dfs_order", "node_depth"], "ogbg-ppa": []}
_EDGE_FILES = {"ogbg-code2": ["edge"], "ogbg-ppa": ["edge", "edge-feat"]}
FINGERPRINT_FILE = "satp_fingerprint.txt"


def dataset_dir(data: DataConfig) -> Path:
    return Path(data.root) / OGB_DIR[data.name]


def required_files(name: str) -> list[str]:
    raw = ["num-node-list", "num-edge-list", "graph-label"] + _EDGE_FILES[name] + _NODE_FILES[name]
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
    if lines["raw/graph-label.csv.gz"] != graphs:
        raise ValueError(f"{folder / 'raw/graph-label.csv.gz'}: {lines['raw/graph-label.csv.gz']} lines, expected {graphs}")
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
    x: np.ndarray | None = None  # code2 [N, 2]
    node_depth: np.ndarray | None = None  # code2 [N]
    node_is_attributed: np.ndarray | None = None  # code2 [N]
    edge_attr: np.ndarray | None = None  # ppa [E, 7] float32
    y: np.ndarray | None = None  # ppa [G]
    y_tokens: list[list[str]] | None = None  # code2
    extra: dict = field(default_factory=dict)

    @property
    def task(self) -> str:
        return TASK[self.name]

    @property
    def num_graphs(self) -> int:
        return self.node_ptr.size - 1

    def chunk(self, ids: np.ndarray) -> dict:
        """The raw arrays of graphs ``ids`` (any order), compact and picklable (sent to Ray tasks)."""
        ids = np.asarray(ids, dtype=np.int64)
        nn = self.node_ptr[ids + 1] - self.node_ptr[ids]
        ne = self.edge_ptr[ids + 1] - self.edge_ptr[ids]
        node_sel = _ranges(self.node_ptr[ids], nn)
        edge_sel = _ranges(self.edge_ptr[ids], ne)
        out = {
            "graph_id": ids,
            "node_ptr": np.concatenate([[0], np.cumsum(nn)]),
            "edge_ptr": np.concatenate([[0], np.cumsum(ne)]),
            "edge_index": self.edge_index[:, edge_sel],
        }
        for key in ("x", "node_depth", "node_is_attributed"):
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


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(s, s + l)`` for each pair, vectorised."""
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.repeat(starts - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths)
    return np.arange(total, dtype=np.int64) + offsets


def iter_chunk(chunk: dict):
    """Yield one raw graph dict per graph of a :meth:`RawStore.chunk`."""
    nptr, eptr = chunk["node_ptr"], chunk["edge_ptr"]
    for j, gid in enumerate(chunk["graph_id"].tolist()):
        a, b, c, d = nptr[j], nptr[j + 1], eptr[j], eptr[j + 1]
        g = {"graph_id": gid, "num_nodes": int(b - a), "edge_index": chunk["edge_index"][:, c:d]}
        for key in ("x", "node_depth", "node_is_attributed"):
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
    return folder


def load_source(data: DataConfig, fingerprint: str | None = None) -> RawStore:
    """Load (building or downloading first if needed) and check a dataset; see the module docstring.

    ``fingerprint``: the result of :func:`check_raw` on the folder, when the caller just ran it.
    """
    os.environ.setdefault("OUTDATED_IGNORE", "1")
    folder = ensure_dataset(data)
    if folder.exists():
        fingerprint = fingerprint or check_raw(folder, data.name)
        stamp = folder / "processed" / FINGERPRINT_FILE
        if (folder / "processed").exists() and (not stamp.is_file() or stamp.read_text().strip() != fingerprint):
            shutil.rmtree(folder / "processed")  # OGB would reuse a cache of other raw files
    ds = _ogb_dataset(data, folder)
    if fingerprint is None:  # downloaded just now
        fingerprint = check_raw(folder, data.name)
    (folder / "processed").mkdir(exist_ok=True)
    (folder / "processed" / FINGERPRINT_FILE).write_text(fingerprint + "\n")
    store = _to_store(ds, data.name, folder, fingerprint)
    validate_store(store)
    return store


def _ogb_dataset(data: DataConfig, folder: Path):
    _register_safe_globals()
    import ogb.graphproppred.dataset_pyg as ogb_pyg

    decide = ogb_pyg.decide_download
    ogb_pyg.decide_download = lambda url: True  # no input() prompt for datasets over 1 GB
    existed = folder.exists()
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
