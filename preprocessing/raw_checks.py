"""What every value of OGB's raw files must be, checked block by block while they are converted (a
bad one would surface later as a tensor error naming neither file nor graph); the first bad value
is refused in one line::

    data/ogbg_code2/raw/node-feat.csv.gz: line 2346, graph 17: node type id 99999 outside [0, 98) (...)
"""
from __future__ import annotations

import csv
import gzip
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from preprocessing.config import SBM_DATASETS

#: ogbg-code2's node types and attributes: the sizes of its mapping tables and of the model's
#: embeddings (``sat.config.SATConfig.code2_num_node_types`` / ``code2_num_node_attributes``).
CODE2_NODE_TYPES = 98
CODE2_NODE_ATTRIBUTES = 10030
#: ogbg-ppa's classes (species).
PPA_CLASSES = 37
_MAPPING = {0: ("typeidx2type.csv.gz", CODE2_NODE_TYPES, "node type id"),
            1: ("attridx2attr.csv.gz", CODE2_NODE_ATTRIBUTES, "node attribute id")}


@dataclass(frozen=True)
class Range:
    """Values of ``column`` (None: every column) lie in ``[lo, hi)``; ``hi`` None: no upper bound;
    ``per_graph``: ``hi`` is the node count of the row's graph."""

    field: str
    lo: int
    hi: int | None = None
    column: int | None = None
    per_graph: bool = False
    why: str = ""


def _mapping_rows(path: Path) -> int | None:
    """Entries of a code2 mapping table (a CSV with a header; values may hold quoted newlines)."""
    try:
        with gzip.open(path, "rt", encoding="utf-8", newline="") as fh:
            return sum(1 for _ in csv.reader(fh)) - 1
    except (OSError, EOFError, UnicodeDecodeError, csv.Error):
        return None


def _code2_id_ranges(folder: Path) -> list[Range]:
    """Node type and attribute ids: inside the dataset's mapping table (an id it does not list
    means nothing) and inside the model's embedding (which fails on anything larger)."""
    out = []
    for column, (table, model_size, field) in _MAPPING.items():
        rows = _mapping_rows(folder / "mapping" / table)
        if rows is not None and rows < model_size:
            out.append(Range(field, 0, rows, column, why=f"mapping/{table} lists {rows}"))
        else:
            out.append(Range(field, 0, model_size, column, why=f"ogbg-code2's {model_size}, the model's embedding"))
    return out


def ranges(name: str, spec, folder: Path, graphs: int | None) -> list[Range]:
    """The ranges of ``spec``'s values in dataset ``name`` (``graphs``: how many the dataset has,
    once the count files are read)."""
    from preprocessing.sbm import NODE_VOCAB
    from preprocessing.sbm import NUM_CLASSES as SBM_CLASSES

    key = spec.key
    if key == "num_nodes":
        return [Range("node count", 1)]
    if key == "num_edges":
        return [Range("edge count", 1)]
    if key == "edge_index":
        return [Range("edge endpoint", 0, per_graph=True, why="the graph's nodes")]
    if key == "node_dfs_order":
        return [Range("DFS position", 0, per_graph=True, why="the graph's nodes")]
    if spec.per == "split":
        return [Range("graph id", 0, graphs, why=f"the dataset's {graphs} graphs")]
    if name == "ogbg-code2" and key == "x":
        return _code2_id_ranges(folder)
    if key == "node_is_attributed":
        return [Range("attributed flag", 0, 2)]
    if key == "y" and name == "ogbg-ppa":
        return [Range("class id", 0, PPA_CLASSES, why=f"ogbg-ppa's {PPA_CLASSES} classes")]
    if name in SBM_DATASETS and key == "x":
        return [Range("node input id", 0, NODE_VOCAB[name], why=f"{name}'s recipe")]
    if name in SBM_DATASETS and key == "node_label":
        return [Range("node class", 0, SBM_CLASSES[name], why=f"{name}'s recipe")]
    return [Range("depth" if key == "node_depth" else "value", 0)]


def graph_of(ptr: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The graph of each row, given the rows' offsets per graph (``ptr``: ``[0, n0, n0 + n1, ...]``)."""
    return np.searchsorted(ptr, rows, side="right") - 1


class Checker:
    """Streaming checks of one file's values, block by block. ``ptr``: offsets of the file's rows per
    graph; ``nodes``: every graph's node count."""

    def __init__(self, name: str, spec, folder: Path, ptr: np.ndarray | None, nodes: np.ndarray | None):
        self.spec, self.path, self.ptr, self.nodes = spec, folder / spec.rel, ptr, nodes
        graphs = None if nodes is None else nodes.size
        self.ranges = ranges(name, spec, folder, graphs) if spec.parse == "int64" else []

    def _where(self, row: int) -> str:
        """``line L, graph G`` of the file's row ``row`` (no header: line = row + 1)."""
        if self.spec.per == "graph":
            return f"line {row + 1}, graph {row}"
        if self.ptr is not None:
            return f"line {row + 1}, graph {int(graph_of(self.ptr, np.array([row]))[0])}"
        return f"line {row + 1}"

    def __call__(self, values, start: int) -> None:
        spec = self.spec
        if spec.parse == "text":
            return
        if spec.parse == "float64":
            finite = np.isfinite(values).all(axis=1) if values.ndim > 1 else np.isfinite(values)
            if not finite.all():
                row = start + int(np.flatnonzero(~finite)[0])
                raise ValueError(f"{self.path}: {self._where(row)}: NaN or infinite {spec.per} feature")
            return
        table = values.reshape(len(values), -1)
        for r in self.ranges:
            self._check(table, start, r)
        top = np.iinfo(spec.store).max
        if table.size and table.max() > top:
            row = start + int(np.flatnonzero((table > top).any(axis=1))[0])
            raise ValueError(f"{self.path}: {self._where(row)}: value {int(table.max())} larger than this layout "
                             f"stores ({spec.store}, at most {top})")

    def _check(self, table: np.ndarray, start: int, r: Range) -> None:
        part = table if r.column is None else table[:, r.column : r.column + 1]
        if r.per_graph:
            hi = self.nodes[graph_of(self.ptr, start + np.arange(len(table)))][:, None]
        else:
            hi = r.hi
        bad = part < r.lo
        if hi is not None:
            bad |= part >= hi
        if not bad.any():
            return
        i, j = (int(k[0]) for k in np.nonzero(bad))
        value, row = int(part[i, j]), start + i
        why = f" ({r.why})" if r.why else ""
        if hi is None:
            raise ValueError(f"{self.path}: {self._where(row)}: {r.field} {value}, expected at least {r.lo}{why}")
        upper = int(hi[i, 0]) if r.per_graph else hi
        raise ValueError(f"{self.path}: {self._where(row)}: {r.field} {value} outside [{r.lo}, {upper}){why}")


def check_splits(paths: dict[str, Path], splits: dict[str, np.ndarray]) -> None:
    """Every graph in at most one split, once (OGB's loader would evaluate on a training graph)."""
    names = list(splits)
    for k, split in enumerate(names):
        ids = splits[split]
        unique, counts = np.unique(ids, return_counts=True)
        if (counts > 1).any():
            graph = int(unique[np.flatnonzero(counts > 1)[0]])
            line = int(np.flatnonzero(ids == graph)[1]) + 1
            raise ValueError(f"{paths[split]}: line {line}: graph id {graph} listed twice")
        for other in names[:k]:
            common = np.intersect1d(unique, splits[other])
            if common.size:
                line = int(np.flatnonzero(ids == common[0])[0]) + 1
                raise ValueError(f"{paths[split]}: line {line}: graph id {int(common[0])} is also in the {other} split")
