"""Map-style dataset over memory-mapped Arrow shards, returning :class:`sat.data.SATData`.

>>> ds = ShardDataset(shard_dir, "train")     # also "valid", "test"
>>> len(ds), ds[0], ds.num_nodes[:4], ds.vocab[:3], ds.manifest["dataset"]

- Random access by index (``0 <= i < len(ds)``, negative indices count from the end). Items are
  decoded from memory-mapped shard files: nothing is read into memory until it is used, and a
  decoded item owns its tensors (copies, never views of the mapping).
- ``num_nodes``: ``np.ndarray`` of node counts per item, read from the ``num_nodes`` column
  without decoding graphs (for node-budget batching).
- ``manifest``: ``manifest.json`` as a dict; ``vocab``: the code2 vocabulary (``list[str]``
  in id order, ``__UNK__`` and ``__EOS__`` last) or ``None``.
- Integrity: on construction every shard of the split must exist with the size recorded in the
  manifest; a shard's sha256 is verified when the shard is first opened for items (``verify=True``,
  the default; :meth:`verify_all` checks them all now). A bad shard raises ``ValueError`` naming it.
- Picklable and cheap to re-open (pickling keeps only the path, split and ``verify``), so Ray
  workers construct it from the path.

:func:`featurise` turns raw graphs (e.g. the functions of a new Python file, through
:func:`preprocessing.pycode.code_to_raw_graph`) into ``SATData`` exactly as training data were
made (transform, shard encoding, decoding), for prediction.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from preprocessing.shards import read_manifest, sha256_file
from sat.data import SATData

_TORCH = {"int64": torch.long, "float32": torch.float32}


class _Shard:
    """One memory-mapped shard: zero-copy numpy views of every list column."""

    def __init__(self, path: Path, specs: dict[str, dict], payload: bytes | None = None):
        self.path = path
        try:
            self._mmap = pa.BufferReader(payload) if payload is not None else pa.memory_map(str(path), "r")
            reader = pa.ipc.open_file(self._mmap)
            if reader.num_record_batches != 1:
                raise ValueError("expected one record batch")
            batch = reader.get_batch(0)
        except (pa.ArrowInvalid, pa.ArrowIOError, OSError, ValueError) as exc:
            raise ValueError(f"{path}: corrupt shard ({str(exc).splitlines()[0]})") from None
        self.rows = batch.num_rows
        self.graph_id = batch.column("graph_id").to_numpy()
        self.num_nodes = batch.column("num_nodes").to_numpy()
        self.columns: dict[str, tuple] = {}
        for name, spec in specs.items():
            col = batch.column(name)
            offsets = col.offsets.to_numpy()
            if spec["type"] == "string":
                self.columns[name] = (offsets, col.values, spec)
            else:
                self.columns[name] = (offsets, col.values.to_numpy(zero_copy_only=True), spec)

    def item(self, i: int) -> SATData:
        n = int(self.num_nodes[i])
        values_of: dict = {"graph_id": torch.tensor([int(self.graph_id[i])])}
        for name, (offsets, values, spec) in self.columns.items():
            a, b = int(offsets[i]), int(offsets[i + 1])
            if spec["decode"] == "str":
                values_of[name] = values.slice(a, b - a).to_pylist()
                continue
            arr = values[a:b].astype(spec["decode"])  # a copy: tensors never view the mapping
            if name == "subgraph_size":
                values_of["subgraph_indicator"] = torch.from_numpy(np.repeat(np.arange(n, dtype=np.int64), arr))
                continue
            shape = spec["shape"]
            values_of[name] = torch.from_numpy(arr.reshape(shape) if len(shape) > 1 else arr)
        if n == 0 or "x" not in self.columns:
            values_of["num_nodes"] = n
        return SATData(**values_of)


class ShardDataset(torch.utils.data.Dataset):
    """Items of one split of a shard directory (see the module docstring)."""

    def __init__(self, shard_dir: str | Path, split: str, verify: bool = True):
        self.shard_dir = Path(shard_dir)
        self.split = split
        self.verify = verify
        self.manifest = read_manifest(self.shard_dir)
        if split not in self.manifest["splits"]:
            raise ValueError(f"{self.shard_dir}: no split {split!r} (has {sorted(self.manifest['splits'])})")
        self._specs = self.manifest["columns"]
        self._entries = [s for s in self.manifest["shards"] if s["split"] == split]
        for entry in self._entries:
            path = self.shard_dir / entry["file"]
            if not path.is_file():
                raise ValueError(f"{path}: shard missing")
            if path.stat().st_size != entry["bytes"]:
                raise ValueError(f"{path}: corrupt shard (size {path.stat().st_size}, manifest says {entry['bytes']})")
        self._shards: list[_Shard | None] = [None] * len(self._entries)
        self._verified = [False] * len(self._entries)
        rows = np.array([e["rows"] for e in self._entries], dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(rows)])
        self._num_nodes: np.ndarray | None = None
        self._vocab: list[str] | None = None

    # -- pickling: only the path travels
    def __getstate__(self):
        return {"shard_dir": str(self.shard_dir), "split": self.split, "verify": self.verify}

    def __setstate__(self, state):
        self.__init__(state["shard_dir"], state["split"], state["verify"])

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _shard(self, k: int, verify: bool | None = None) -> _Shard:
        shard = self._shards[k]
        if shard is None:
            entry = self._entries[k]
            path = self.shard_dir / entry["file"]
            if (self.verify if verify is None else verify) and not self._verified[k]:
                self._check(k)
            shard = _Shard(path, self._specs)
            if shard.rows != entry["rows"]:
                raise ValueError(f"{path}: corrupt shard ({shard.rows} rows, manifest says {entry['rows']})")
            self._shards[k] = shard
        elif self.verify and not self._verified[k] and verify is None:
            self._check(k)
        return shard

    def _check(self, k: int) -> None:
        entry = self._entries[k]
        path = self.shard_dir / entry["file"]
        if sha256_file(path) != entry["sha256"]:
            raise ValueError(f"{path}: corrupt shard (sha256 does not match the manifest)")
        self._verified[k] = True

    def verify_all(self) -> None:
        """Check the sha256 of every shard of the split now."""
        for k in range(len(self._entries)):
            if not self._verified[k]:
                self._check(k)

    def __getitem__(self, index: int) -> SATData:
        i = int(index)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} items")
        k = int(np.searchsorted(self._starts, i, side="right") - 1)
        return self._shard(k).item(i - int(self._starts[k]))

    @property
    def num_nodes(self) -> np.ndarray:
        """Node count of every item (int64), without decoding graphs."""
        if self._num_nodes is None:
            parts = [self._shard(k, verify=False).num_nodes for k in range(len(self._entries))]
            self._num_nodes = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)
        return self._num_nodes

    @property
    def graph_ids(self) -> np.ndarray:
        """Index in the source OGB dataset of every item."""
        parts = [self._shard(k, verify=False).graph_id for k in range(len(self._entries))]
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)

    @property
    def vocab(self) -> list[str] | None:
        name = self.manifest.get("vocab_file")
        if name is None:
            return None
        if self._vocab is None:
            self._vocab = json.loads((self.shard_dir / name).read_text())
        return self._vocab

    def __repr__(self) -> str:
        return f"ShardDataset({str(self.shard_dir)!r}, {self.split!r}, {len(self)} graphs)"


def featurise(raws: list[dict], task: str, transform, vocab: list[str] | None = None) -> list[SATData]:
    """Raw graphs (as :func:`preprocessing.pycode.code_to_raw_graph` or
    :func:`preprocessing.sources.iter_chunk` give them) -> ``SATData`` through exactly the path of
    training data: :func:`~preprocessing.transforms.transform_graph`, the shard encoding and this
    module's decoding (in memory, no file). ``transform``: a ``TransformConfig`` or its dict."""
    from preprocessing.config import TransformConfig
    from preprocessing.shards import column_specs, encode_shard
    from preprocessing.transforms import transform_graph

    if not raws:
        return []
    cfg = transform if isinstance(transform, TransformConfig) else TransformConfig.model_validate(transform)
    vocab_index = {w: i for i, w in enumerate(vocab)} if vocab else None
    rows = [transform_graph(raw, task, cfg, vocab_index) for raw in raws]
    specs = column_specs(task, cfg)
    shard = _Shard(Path("<memory>"), specs, payload=encode_shard(rows, specs))
    return [shard.item(i) for i in range(len(rows))]
