"""Map-style dataset over memory-mapped Arrow shards, returning :class:`sat.data.SATData`.

>>> ds = ShardDataset(shard_dir, "train")   # len(ds), ds[i], ds.num_nodes, ds.vocab, ds.manifest
>>> ds.batch([5, 2, 9])                    # == Batch.from_data_list([ds[5], ds[2], ds[9]])

Items own their tensors. :meth:`ShardDataset.batch` decodes a mini-batch column by column (PyG's
offsets added at once). Every shard must have its recorded size on construction; its sha256 is
checked when it is first opened. Tensor values are read (``pread``) as items need them, not mapped,
so a reader's memory is the same whatever the data size. Pickling keeps only the path and settings.
A directory on an object store is read through the node's shard cache
(:mod:`preprocessing.shard_cache`), with read-ahead. :func:`featurise` turns new raw graphs into
``SATData`` exactly as training data were made."""
from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from torch_geometric.data import Batch

from preprocessing.shard_cache import READ_AHEAD_BYTES, ShardCache, fetcher
from preprocessing.shard_places import open_place, sha256_file
from preprocessing.shards import read_manifest
from runtime.storage import StorageSettings
from sat.data import SATData

_TORCH = {"int64": torch.long, "float32": torch.float32}
# SATData.__inc__'s increments: the per-graph count each attribute's values are offset by when
# batched; any other attribute whose name holds "index" by the node count (PyG's Data.__inc__).
_INCREMENTED_BY = {
    "subgraph_node_index": "num_nodes",
    "subgraph_indicator": "num_nodes",
    "subgraph_edge_index": "subgraph_node_index",
    "subgraph_edge_id": "edge_index",
}


class _FileValues:
    """A list column's values in a shard file (from byte ``start``), read when sliced: ``[a:b]`` is
    the array of values ``a..b-1``."""

    def __init__(self, file, start: int, dtype: np.dtype):
        self.file, self.start, self.dtype = file, start, dtype

    def __getitem__(self, span: slice) -> np.ndarray:
        size = self.dtype.itemsize
        if span.stop <= span.start:
            return np.empty(0, self.dtype)
        data = os.pread(self.file.fileno(), (span.stop - span.start) * size, self.start + span.start * size)
        return np.frombuffer(data, self.dtype)


class _Shard:
    """One shard: its offsets and scalar columns in memory, its tensor values read when sliced;
    ``source``: the file to read (default ``path``) or the shard's bytes; ``path`` is named in
    messages; ``holder``: kept while the shard is open."""

    def __init__(self, path: Path | str, specs: dict[str, dict], source: Path | pa.Buffer | None = None,
                 holder=None):
        self.path, self._holder, self._file = path, holder, None
        try:
            if isinstance(source, pa.Buffer):
                data = source
            else:
                self._file = open(source or path, "rb")
                data = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
            reader = pa.ipc.open_file(pa.py_buffer(data))
            if reader.num_record_batches != 1:
                raise ValueError("expected one record batch")
            batch = reader.get_batch(0)
        except (pa.ArrowInvalid, pa.ArrowIOError, OSError, ValueError) as exc:
            raise ValueError(f"{path}: corrupt shard ({str(exc).splitlines()[0]})") from None
        self.rows = batch.num_rows
        self.graph_id = batch.column("graph_id").to_numpy().copy()
        self.num_nodes = batch.column("num_nodes").to_numpy().copy()
        self.columns: dict[str, tuple] = {}
        start = pa.py_buffer(data).address
        for name, spec in specs.items():
            col = batch.column(name)
            offsets = col.offsets.to_numpy().copy()
            if spec["type"] == "string":  # few bytes a graph: read through the mapping
                self.columns[name] = (offsets, col.values, spec)
                continue
            values = col.values.to_numpy(zero_copy_only=True)
            if self._file is not None:
                values = _FileValues(self._file, values.ctypes.data - start, values.dtype)
            self.columns[name] = (offsets, values, spec)
        if self._file is not None:
            data.madvise(mmap.MADV_DONTNEED)  # the footer and offsets are read: none of the file stays resident

    def close(self) -> None:
        """Let go of the shard's holder (the cache may evict its file; what reads it still can)."""
        if self._holder is not None:
            self._holder.close()

    def item(self, i: int, specs: dict[str, dict]) -> SATData:
        """Row ``i`` as one graph, decoded as :meth:`ShardDataset.batch` decodes a mini-batch."""
        columns, _, nodes = _decoded([self], np.zeros(1, dtype=np.int64), np.array([i]), specs)
        data = SATData(**{name: value[0] if isinstance(value, list) else value for name, value in columns.items()})
        if nodes[0] == 0 or "x" not in specs:
            data.num_nodes = int(nodes[0])
        return data


def _cat_axis(name: str, ndim: int) -> int:
    """The axis along which PyG concatenates attribute ``name`` of ``ndim`` dims (``SATData.__cat_dim__``)."""
    return SATData().__cat_dim__(name, torch.empty((0,) * ndim)) % ndim


def _offsets(counts: np.ndarray) -> np.ndarray:
    """``[0, c0, c0 + c1, ...]`` (int64, one longer than ``counts``)."""
    return np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])


def _collated(columns: dict, counts: dict, nodes: np.ndarray) -> Batch:
    """The PyG ``Batch`` that ``Batch.from_data_list`` makes of the items, from concatenated ``columns``
    and every graph's size along each column's cat axis (``counts``); offsets added in place."""
    size = len(nodes)
    counts = {"num_nodes": nodes, **counts}
    out = Batch(_base_cls=SATData)
    slices, incs = {}, {}
    for name, value in columns.items():
        if isinstance(value, list):  # PyG keeps a non-tensor attribute as the list of the graphs' values
            out[name], slices[name], incs[name] = value, torch.arange(size + 1), None
            continue
        by = _INCREMENTED_BY.get(name, "num_nodes" if "index" in name else None)
        inc = _offsets(counts[by])[:-1] if by else np.zeros(size, dtype=np.int64)
        if inc[-1]:
            axis = _cat_axis(name, value.dim())
            other_axes = tuple(i for i in range(value.dim()) if i != axis)
            value.numpy()[...] += np.expand_dims(np.repeat(inc, counts[name]), other_axes)
        out[name] = value
        slices[name], incs[name] = torch.from_numpy(_offsets(counts[name])), torch.from_numpy(inc)
    out.batch = torch.from_numpy(np.repeat(np.arange(size, dtype=np.int64), nodes))
    out.ptr = torch.from_numpy(_offsets(nodes))
    out._num_graphs, out._slice_dict, out._inc_dict = size, slices, incs
    return out


class _Rows:
    """The rows of one mini-batch, in batch order, over the shards that hold them."""

    def __init__(self, shards: list[_Shard], shard_of: np.ndarray, rows: np.ndarray):
        self.shards = shards
        self.shard_of = shard_of.tolist()  # index into ``shards`` of every graph
        self.groups = [(np.flatnonzero(shard_of == j), rows[shard_of == j]) for j in range(len(shards))]
        self.size = len(rows)

    def scalar(self, name: str) -> np.ndarray:
        """A scalar column (``graph_id``, ``num_nodes``) of every graph, int64."""
        out = np.empty(self.size, dtype=np.int64)
        for shard, (where, rows) in zip(self.shards, self.groups):
            out[where] = getattr(shard, name)[rows]
        return out

    def spans(self, name: str) -> tuple[list, np.ndarray, np.ndarray]:
        """Column ``name`` as ``(values, starts, lengths)`` per graph (flattened, row-major)."""
        starts = np.empty(self.size, dtype=np.int64)
        ends = np.empty(self.size, dtype=np.int64)
        for shard, (where, rows) in zip(self.shards, self.groups):
            offsets = shard.columns[name][0]
            starts[where], ends[where] = offsets[rows], offsets[rows + 1]
        values = [shard.columns[name][1] for shard in self.shards]
        return [values[j] for j in self.shard_of], starts, ends - starts

    def strings(self, name: str) -> list[list[str]]:
        """A string column: a list of str per graph (PyG keeps non-tensor attributes as a list)."""
        values, starts, lengths = self.spans(name)
        return [v.slice(a, n).to_pylist() for v, a, n in zip(values, starts.tolist(), lengths.tolist())]

    def concat(self, name: str, spec: dict) -> tuple[torch.Tensor, np.ndarray]:
        """A tensor column of every graph concatenated along its cat axis, decoded (before increments),
        and each graph's size along that axis."""
        shape = spec["shape"]
        axis = _cat_axis(name, len(shape))
        values, starts, lengths = self.spans(name)
        if shape[axis] == -1:
            counts = lengths // math.prod(d for i, d in enumerate(shape) if i != axis and d != -1)
        else:  # e.g. y [1, L] stacked to [B, L]: every graph must have the same L
            counts = np.full(self.size, shape[axis], dtype=np.int64)
            if lengths.size and lengths.min() != lengths.max():
                raise ValueError(f"column {name}: graphs of lengths {lengths.min()}..{lengths.max()} cannot be stacked")
        if axis == 0:  # rows lead: the flat values of the graphs, one after the other
            parts = [v[a:a + n] for v, a, n in zip(values, starts.tolist(), lengths.tolist())]
        else:  # [K, -1] along its last axis: the graphs' first rows, then their second rows, ...
            k_rows = shape[0]
            parts = [v[a + k * c:a + (k + 1) * c] for k in range(k_rows)
                     for v, a, c in zip(values, starts.tolist(), counts.tolist())]
        out = torch.empty(int(lengths.sum()), dtype=_TORCH[spec["decode"]])
        np.concatenate(parts, out=out.numpy())
        out_shape = list(shape)
        out_shape[axis] = int(counts.sum())
        return out.view(out.numpy().reshape(out_shape).shape), counts


def _decoded(shards: list[_Shard], shard_of: np.ndarray, rows: np.ndarray, specs: dict[str, dict]) -> tuple:
    """``(columns, counts, nodes)`` of rows ``rows`` of ``shards`` (``shard_of``: each row's shard):
    every column decoded and concatenated along its cat axis, each graph's size along it, and the
    graphs' node counts (what :func:`_collated` takes)."""
    rows = _Rows(shards, shard_of, rows)
    nodes = rows.scalar("num_nodes")
    columns: dict = {"graph_id": torch.from_numpy(rows.scalar("graph_id"))}
    counts = {"graph_id": np.ones(rows.size, dtype=np.int64)}
    for name, spec in specs.items():
        if spec["decode"] == "str":
            columns[name] = rows.strings(name)
        elif name == "subgraph_size":  # subgraph_indicator: each graph's centres c, size[c] times each
            sizes, _ = rows.concat(name, spec)
            local = np.arange(int(nodes.sum())) - np.repeat(_offsets(nodes)[:-1], nodes)
            columns["subgraph_indicator"] = torch.from_numpy(np.repeat(local, sizes.numpy()))
            counts["subgraph_indicator"] = np.diff(_offsets(sizes.numpy())[_offsets(nodes)])
        else:
            columns[name], counts[name] = rows.concat(name, spec)
    return columns, counts, nodes


class ShardDataset(torch.utils.data.Dataset):
    """Items of one split of a shard directory (see the module docstring)."""

    def __init__(self, shard_dir: str | Path, split: str, storage: StorageSettings | None = None):
        self._place = open_place(shard_dir, storage)
        self.shard_dir = self._place.root  # a Path, or the URI
        self.split = split
        self.storage = storage
        self.manifest = read_manifest(self.shard_dir, storage)
        if split not in self.manifest["splits"]:
            raise ValueError(f"{self.shard_dir}: no split {split!r} (has {sorted(self.manifest['splits'])})")
        self._specs = self.manifest["columns"]
        self._entries = [s for s in self.manifest["shards"] if s["split"] == split]
        sizes = self._place.sizes([e["file"] for e in self._entries])
        for entry in self._entries:
            path, size = self._place.at(entry["file"]), sizes[entry["file"]]
            if size is None:
                raise ValueError(f"{path}: shard missing")
            if size != entry["bytes"]:
                raise ValueError(f"{path}: corrupt shard (size {size}, manifest says {entry['bytes']})")
        if not self._place.local:
            self._cache = ShardCache(storage)
            self._cache.check_window(self.shard_dir, split, [e["bytes"] for e in self._entries])
            self._fetches: dict[int, object] = {}
            self._pid = os.getpid()
        self._shards: dict[int, _Shard] = {}  # the open ones, least recently used first
        self._verified = [False] * len(self._entries)
        rows = np.array([e["rows"] for e in self._entries], dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(rows)])
        self._num_nodes: np.ndarray | None = None
        self._vocab: list[str] | None = None

    # -- pickling: only the path and settings travel
    def __getstate__(self):
        return {"shard_dir": str(self.shard_dir), "split": self.split, "storage": self.storage}

    def __setstate__(self, state):
        self.__init__(state["shard_dir"], state["split"], state["storage"])

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _shard(self, k: int, verify: bool = True, pinned: frozenset[int] = frozenset()) -> _Shard:
        """Shard ``k``, opened unless open; ``pinned``: shards not to close to make room for it."""
        shard = self._shards.pop(k, None)
        if shard is None:
            entry = self._entries[k]
            path = self._place.at(entry["file"])
            if not self._place.local:
                self._make_room(k, pinned)
                shard = _Shard(path, self._specs, *self._fetched(k))
                self._verified[k] = True  # a shard from a store: always checked on its first read
            else:
                if verify and not self._verified[k]:
                    self._check(k)
                shard = _Shard(path, self._specs)
            if shard.rows != entry["rows"]:
                raise ValueError(f"{path}: corrupt shard ({shard.rows} rows, manifest says {entry['rows']})")
        elif verify and not self._verified[k]:
            self._check(k)
        self._shards[k] = shard  # the most recently used, last
        return shard

    def _make_room(self, k: int, pinned: frozenset[int]) -> None:
        """Close the shards read longest ago (but ``pinned``) until shard ``k`` and the next fit the cache beside the rest."""
        need = sum(e["bytes"] for e in self._entries[k:k + 2]) + sum(self._entries[j]["bytes"] for j in self._shards)
        for j in [j for j in self._shards if j not in pinned]:
            if need <= self._cache.limit:
                return
            need -= self._entries[j]["bytes"]
            self._shards.pop(j).close()

    def _fetched(self, k: int) -> tuple:
        """``(path, holder)`` of store shard ``k`` in the cache, the shards after it downloading meanwhile
        (:data:`~preprocessing.shard_cache.READ_AHEAD_BYTES` of them, at least the next, as far as the
        cache has room beside the open ones; per process)."""
        if self._pid != os.getpid():
            self._fetches, self._pid = {}, os.getpid()
        room = self._cache.limit - sum(self._entries[j]["bytes"] for j in (*self._shards, k))
        window, ahead = [k], 0
        for j in range(k + 1, len(self._entries)):
            ahead += self._entries[j]["bytes"]
            if j > k + 1 and ahead > min(READ_AHEAD_BYTES, room):
                break
            window.append(j)
        keep = frozenset(self._entries[j]["sha256"] for j in window)
        for j in window:
            if j not in self._fetches:
                entry = self._entries[j]
                self._fetches[j] = fetcher(os.getpid()).submit(
                    self._cache.fetch, self._place.loc.join(entry["file"]), entry["bytes"], entry["sha256"], keep,
                    ahead=True)
        job, entry = self._fetches.pop(k), self._entries[k]
        obj = self._place.loc.join(entry["file"])
        downloaded = self._cache.fetch(obj, entry["bytes"], entry["sha256"], keep) if job.cancel() \
            else job.result()  # not started yet: fetched here, now
        return self._cache.open(obj, entry["bytes"], entry["sha256"], not downloaded and not self._verified[k], keep)

    def _check(self, k: int) -> None:
        if not self._place.local:
            self._shard(k)  # checked as it is first read
            return
        entry = self._entries[k]
        path = self._place.at(entry["file"])
        if sha256_file(path) != entry["sha256"]:
            raise ValueError(f"{path}: corrupt shard (sha256 does not match the manifest)")
        self._verified[k] = True

    def verify_all(self) -> None:
        """Check the sha256 of every shard of the split now."""
        for k in range(len(self._entries)):
            if not self._verified[k]:
                self._check(k)

    def _locate(self, indices) -> tuple[np.ndarray, np.ndarray]:
        """Shard number and row in that shard of every index (negative ones count from the end)."""
        ids = np.asarray(indices, dtype=np.int64).reshape(-1)
        ids = np.where(ids < 0, ids + len(self), ids)
        bad = (ids < 0) | (ids >= len(self))
        if bad.any():
            raise IndexError(f"index {np.asarray(indices).reshape(-1)[bad][0]} out of range for {len(self)} items")
        shard = np.searchsorted(self._starts, ids, side="right") - 1
        return shard, ids - self._starts[shard]

    def __getitem__(self, index: int) -> SATData:
        shard, row = self._locate(int(index))
        return self._shard(int(shard[0])).item(int(row[0]), self._specs)

    def batch(self, indices) -> Batch:
        """The items ``indices`` as one PyG ``Batch``, equal to ``Batch.from_data_list`` of them."""
        shard, row = self._locate(indices)
        if row.size == 0:
            raise ValueError("a batch needs at least one item")
        used, shard_of = np.unique(shard, return_inverse=True)
        pinned = frozenset(used.tolist())
        shards = [self._shard(k, pinned=pinned) for k in used.tolist()]
        return _collated(*_decoded(shards, shard_of.reshape(-1), row, self._specs))

    def _per_item(self, of) -> np.ndarray:
        """``of(shard)`` of every shard (one value per item), concatenated, int64."""
        parts = [of(self._shard(k, verify=False)) for k in range(len(self._entries))]
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)

    @property
    def num_nodes(self) -> np.ndarray:
        """Node count of every item (int64), without decoding graphs."""
        if self._num_nodes is None:
            self._num_nodes = self._per_item(lambda shard: shard.num_nodes)
        return self._num_nodes

    def sizes(self, name: str) -> np.ndarray:
        """Every item's size along the axis PyG concatenates column ``name`` on, without decoding graphs."""
        if name == "num_nodes":
            return self.num_nodes
        spec = self._specs.get(name)
        if spec is None or spec["type"] == "string":
            raise ValueError(f"{self.shard_dir}: no tensor column {name!r} (has {sorted(self._specs)})")
        shape = spec["shape"]
        axis = _cat_axis(name, len(shape))
        width = math.prod(d for i, d in enumerate(shape) if i != axis and d != -1)
        return self._per_item(lambda shard: np.diff(shard.columns[name][0]) // width)

    def in_degree_histogram(self) -> list[int]:
        """``hist[d]``: nodes of the split with in-degree ``d`` (PNA's ``deg``), one shard mapped at a time."""
        hist = np.zeros(1, dtype=np.int64)
        for k in range(len(self._entries)):
            was_open = k in self._shards
            shard = self._shard(k)
            if not was_open:
                self._shards.pop(k).close()  # one shard mapped at a time: memory stays flat over the split
            offsets, values, _spec = shard.columns["edge_index"]
            for i in range(shard.rows):
                a, b = int(offsets[i]), int(offsets[i + 1])
                targets = values[a + (b - a) // 2 : b]  # [2, E] row-major: sources, then targets
                counts = np.bincount(np.bincount(targets, minlength=int(shard.num_nodes[i])))
                if counts.size > hist.size:
                    hist = np.pad(hist, (0, counts.size - hist.size))
                hist[: counts.size] += counts
        return hist.tolist()

    @property
    def graph_ids(self) -> np.ndarray:
        """Index in the source OGB dataset of every item."""
        return self._per_item(lambda shard: shard.graph_id)

    @property
    def vocab(self) -> list[str] | None:
        name = self.manifest.get("vocab_file")
        if name is None:
            return None
        if self._vocab is None:
            path = self._place.at(name)

            def damaged(why: str) -> ValueError:
                return ValueError(f"{path}: damaged vocabulary ({why.splitlines()[0]}); `satp preprocess` writes it again")

            try:
                payload = self._place.read(name)
            except OSError as exc:  # missing or unreadable (a store's own faults are their own line)
                raise damaged(str(exc)) from None
            expected = self.manifest.get("vocab_sha256")  # a manifest may record none
            if expected is not None and hashlib.sha256(payload).hexdigest() != expected:
                raise damaged("sha256 does not match the manifest")
            try:
                self._vocab = json.loads(payload)
            except ValueError as exc:
                raise damaged(str(exc)) from None
        return self._vocab

    def __repr__(self) -> str:
        return f"ShardDataset({str(self.shard_dir)!r}, {self.split!r}, {len(self)} graphs)"


def featurise(raws: list[dict], task: str, transform, vocab: list[str] | None = None, check=None) -> list[SATData]:
    """Raw graphs -> ``SATData`` through the path of training data (transform, shard encoding,
    decoding), in memory. ``transform``: a ``TransformConfig`` or its dict; ``check``: called before
    each graph's transform (a served request's deadline)."""
    from preprocessing.config import TransformConfig
    from preprocessing.shards import column_specs, encode_shard
    from preprocessing.transforms import transform_graph

    if not raws:
        return []
    cfg = transform if isinstance(transform, TransformConfig) else TransformConfig.model_validate(transform)
    vocab_index = {w: i for i, w in enumerate(vocab)} if vocab else None
    rows = []
    for raw in raws:
        if check is not None:
            check()
        rows.append(transform_graph(raw, task, cfg, vocab_index))
    specs = column_specs(task, cfg)
    shard = _Shard(Path("<memory>"), specs, encode_shard(rows, specs))
    return [shard.item(i, specs) for i in range(len(rows))]
