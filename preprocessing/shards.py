"""Arrow shard format, schema version 1 (described in ``docs/shards.md``).

A shard directory holds ``manifest.json`` (written last), ``vocab.json`` (code2), and per shard an
Arrow IPC file (one record batch, one row per graph, never two splits) with its sidecar (rows,
bytes, sha256, config hash, fingerprint). Columns: ``graph_id``, ``num_nodes``, ``num_edges``,
and one ``large_list`` column per tensor, flattened row-major; each one's storage type, shape
(``-1``: that graph's N, E or S) and decoded dtype are in ``manifest.json["columns"]``
(:func:`column_specs`). ``subgraph_size`` is decoded to ``subgraph_indicator`` (centre ``c``
repeated ``size[c]`` times). Readers check ``schema_version``."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa

from preprocessing.config import SBM_DATASETS
from preprocessing.shard_places import file_place, open_place
from runtime.storage import StorageSettings

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
VOCAB_FILE = "vocab.json"
_SCALARS = {"graph_id": pa.int64(), "num_nodes": pa.int32(), "num_edges": pa.int32()}


def column_specs(task: str, transform) -> dict[str, dict]:
    """name -> ``{"type", "shape", "decode"}`` for a task and transform config (ordered)."""
    specs: dict[str, dict] = {}
    if task == "code2":
        specs["x"] = {"type": "int32", "shape": [-1, 2], "decode": "int64"}
    elif task in SBM_DATASETS:
        specs["x"] = {"type": "int8", "shape": [-1, 1], "decode": "int64"}
    elif transform.ppa_node_input == "edge_sum":
        specs["x"] = {"type": "float32", "shape": [-1, 7], "decode": "float32"}
    else:
        specs["x"] = {"type": "int8", "shape": [-1, 1], "decode": "int64"}
    specs["edge_index"] = {"type": "int32", "shape": [2, -1], "decode": "int64"}
    if task == "code2":
        if transform.augment_edge:
            specs["edge_attr"] = {"type": "int8", "shape": [-1, 2], "decode": "int64"}
        specs["node_depth"] = {"type": "int32", "shape": [-1], "decode": "int64"}
        specs["y"] = {"type": "int64", "shape": [1, -1], "decode": "int64"}
        specs["y_tokens"] = {"type": "string", "shape": [-1], "decode": "str"}
    elif task in SBM_DATASETS:
        specs["y"] = {"type": "int8", "shape": [-1], "decode": "int64"}
    else:
        specs["edge_attr"] = {"type": "float32", "shape": [-1, 7], "decode": "float32"}
        specs["y"] = {"type": "int64", "shape": [-1], "decode": "int64"}
    specs["degree"] = {"type": "float32", "shape": [-1], "decode": "float32"}
    if transform.rwpe_steps:
        specs["rwpe"] = {"type": "float32", "shape": [-1, transform.rwpe_steps], "decode": "float32"}
    if transform.lap_pe_dim:
        specs["lap_pe"] = {"type": "float32", "shape": [-1, transform.lap_pe_dim], "decode": "float32"}
    if transform.k_hops:
        specs["subgraph_node_index"] = {"type": "int32", "shape": [-1], "decode": "int64"}
        specs["subgraph_size"] = {"type": "int32", "shape": [-1], "decode": "int64"}
        specs["subgraph_edge_index"] = {"type": "int32", "shape": [2, -1], "decode": "int64"}
        specs["subgraph_edge_id"] = {"type": "int32", "shape": [-1], "decode": "int64"}
    return specs


def shard_batch(rows: list[dict], specs: dict[str, dict]) -> pa.RecordBatch:
    """Rows (as :func:`preprocessing.transforms.transform_graph` returns them) -> the shard's one record batch."""
    fields = [pa.field(k, t, nullable=False) for k, t in _SCALARS.items()]
    for name, spec in specs.items():
        value_type = pa.string() if spec["type"] == "string" else pa.from_numpy_dtype(np.dtype(spec["type"]))
        fields.append(pa.field(name, pa.large_list(pa.field("item", value_type, nullable=False)), nullable=False))
    schema = pa.schema(fields, metadata={"satp.schema_version": str(SCHEMA_VERSION)})
    arrays = [
        pa.array([int(r["graph_id"]) for r in rows], type=pa.int64()),
        pa.array([int(r["num_nodes"]) for r in rows], type=pa.int32()),
        pa.array([int(r["edge_index"].shape[1]) for r in rows], type=pa.int32()),
    ]
    for name, spec in specs.items():
        if spec["type"] == "string":
            arrays.append(pa.array([list(r[name]) for r in rows], type=schema.field(name).type))
            continue
        dtype = np.dtype(spec["type"])
        flat = [np.ascontiguousarray(r[name]).reshape(-1) for r in rows]
        lengths = np.fromiter((f.size for f in flat), dtype=np.int64, count=len(flat))
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        values = np.concatenate(flat) if flat else np.zeros(0, dtype=dtype)
        if np.issubdtype(dtype, np.integer) and values.size and values.dtype != dtype:
            info = np.iinfo(dtype)
            if values.min() < info.min or values.max() > info.max:
                raise ValueError(f"column {name}: values do not fit the shard's {dtype} storage")
        values = values.astype(dtype, copy=False)
        arrays.append(pa.LargeListArray.from_arrays(pa.array(offsets, type=pa.int64()), pa.array(values)))
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def encode_shard(rows: list[dict], specs: dict[str, dict]) -> pa.Buffer:
    """Rows -> Arrow IPC file bytes, in memory (a buffer: ``bytes(...)``-able, hashable with hashlib)."""
    batch = shard_batch(rows, specs)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return sink.getvalue()


def write_shard_file(path: str | Path, rows: list[dict], specs: dict[str, dict],
                     storage: StorageSettings | None = None) -> dict:
    """Rows -> an Arrow IPC file at ``path`` (a path or an object's URI), streamed to its place (a
    synced temporary file renamed, or one upload); returns its ``bytes`` and ``sha256``."""
    place, name = file_place(path, storage)
    batch = shard_batch(rows, specs)
    with place.writer(name, "the shards finished before it are kept") as sink:
        with pa.ipc.new_file(sink, batch.schema) as writer:
            writer.write_batch(batch)
        del batch
    return {"bytes": sink.size, "sha256": sink.digest.hexdigest()}


def json_bytes(obj) -> bytes:
    """The bytes of a manifest or sidecar (indented, keys sorted, a final newline)."""
    return (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode()


def read_manifest(shard_dir: str | Path, storage: StorageSettings | None = None) -> dict:
    """The manifest of a finished shard directory (a path or a URI), checked for its schema version."""
    place = open_place(shard_dir, storage)
    path = place.at(MANIFEST)
    try:
        manifest = json.loads(place.read(MANIFEST))
    except FileNotFoundError:
        raise ValueError(f"{path}: no manifest: not a finished shard directory (run `satp preprocess`)") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: unreadable manifest ({exc})") from None
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(
            f"{path}: shard schema version {manifest.get('schema_version')!r}, this reader reads {SCHEMA_VERSION}"
        )
    return manifest
