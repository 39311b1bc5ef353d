"""OGB's raw layout into the columnar raw store (:mod:`preprocessing.columnar`), streaming: one pass
per raw file in bounded memory, checked (:mod:`preprocessing.raw_checks`), written under a temporary
name and renamed. Every error is one line naming the file (and line, graph)."""
from __future__ import annotations

import gzip
import json
import os
import sys
import zlib
from pathlib import Path
from typing import Callable, Iterable, Iterator, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

from preprocessing.columnar import (BATCH_ROWS_KEY, FINGERPRINT_FILE, STORE_DIR, STORE_FILE, STORE_VERSION, ColumnarStore,
                                    FileSpec, file_digest, file_specs, read_column, store_is_current)
from preprocessing.locks import writer_lock
from preprocessing.raw_checks import Checker, check_splits
from preprocessing.shard_places import FolderPlace
from preprocessing.write_errors import os_reason, write_error

#: In the store's folder: its writer lock (a conversion keeps it, as it keeps the fingerprint record).
LOCK_FILE = ".lock"

#: Rows per record batch (recorded in each file's schema: readers locate a row without reading other batches).
BATCH_ROWS = 1 << 18
#: Decompressed bytes parsed at a time (cut at a line end): bounds the conversion's memory.
BLOCK_BYTES = 1 << 23
#: pandas' default NA strings: OGB reads code2 labels with pandas, which turns these into NaN ("nan").
_PANDAS_NA = frozenset({"", "#N/A", "#N/A N/A", "#NA", "-1.#IND", "-1.#QNAN", "-NaN", "-nan", "1.#IND", "1.#QNAN",
                        "<NA>", "N/A", "NA", "NULL", "NaN", "None", "n/a", "nan", "null"})


# ----------------------------------------------------------------------------- reading the CSVs
def _line_blocks(path: Path) -> Iterator[bytes]:
    """Whole lines of the gzip file ``path`` (members concatenated), about :data:`BLOCK_BYTES` at a
    time; a truncated or corrupt stream raises a one-line ``ValueError``."""
    try:
        with gzip.open(path, "rb") as fh:
            while block := fh.read(BLOCK_BYTES):
                block += fh.readline()
                yield block if block.endswith(b"\n") else block + b"\n"
    except EOFError:
        raise ValueError(f"{path}: truncated (the gzip stream ends early)") from None
    except (gzip.BadGzipFile, zlib.error) as exc:
        raise ValueError(f"{path}: corrupt gzip data ({exc})") from None


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


# ----------------------------------------------------------------------------- counts
class _Counts(NamedTuple):
    """Per-graph node and edge counts (as in the raw files: one direction per undirected edge)."""

    nodes: np.ndarray
    edges: np.ndarray


def _check_counts(folder: Path, counts: _Counts) -> None:
    """One line per graph in both count files; when they differ, the shorter one is named (a cut file)."""
    raw = folder / "raw"
    if counts.edges.size != counts.nodes.size:
        files = sorted([(counts.nodes.size, "num-node-list.csv.gz"), (counts.edges.size, "num-edge-list.csv.gz")])
        (short, name), (full, other) = files
        raise ValueError(f"{raw / name}: {short} lines, {other} has {full} (one per graph): truncated?")
    if counts.nodes.size == 0:
        raise ValueError(f"{raw}: the dataset has no graphs")


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
    with FolderPlace(path.parent).writer(path.name, "the files converted before it are kept") as sink:
        sink.write((json.dumps(meta, sort_keys=True) + "\n").encode())


def _checked_rows(folder: Path, name: str, spec: FileSpec, counts: _Counts | None) -> Iterator:
    """The parsed, checked blocks of one raw file, then its line count against ``counts`` (None: the
    count files themselves)."""
    src = folder / spec.rel
    per_graph = None if counts is None else {"node": counts.nodes, "edge": counts.edges}.get(spec.per)
    ptr = None if per_graph is None else np.concatenate([[0], np.cumsum(per_graph)])
    check = Checker(name, spec, folder, ptr, None if counts is None else counts.nodes)
    rows = 0
    for values in (_parse(block, spec, src) for block in _line_blocks(src)):
        check(values, rows)
        rows += len(values)
        yield values
    expected = None if counts is None else {"graph": counts.nodes.size, "node": int(counts.nodes.sum()),
                                            "edge": int(counts.edges.sum())}.get(spec.per)
    if expected is not None and rows != expected:
        one = {"node": " (one per node): truncated?", "edge": " (one per edge): truncated?"}.get(spec.per, "")
        raise ValueError(f"{src}: {rows} lines, expected {expected}{one}")


def check_values(folder: str | Path, name: str) -> None:
    """Every check of the conversion on the raw files as they are, writing nothing (the pre-flight's,
    before Ray starts). Memory: the per-graph counts and splits, and one block."""
    folder = Path(folder)
    specs = file_specs(name)
    counts = _Counts(*(_join(list(_checked_rows(folder, name, spec, None)) or [np.zeros(0, np.int64)], spec)
                       for spec in specs[:2]))
    _check_counts(folder, counts)
    splits = {}
    for spec in specs[2:]:
        blocks = _checked_rows(folder, name, spec, counts)
        if spec.per == "split":
            splits[spec.key.removeprefix("split-")] = _join(list(blocks) or [np.zeros(0, np.int64)], spec)
        else:
            for _ in blocks:  # checked block by block, kept nowhere
                pass
    check_splits({s.key.removeprefix("split-"): folder / s.rel for s in specs if s.per == "split"}, splits)


def convert_file(folder: str, name: str, spec: FileSpec, fingerprint: str, counts: _Counts | None) -> dict:
    """Convert one raw CSV into ``<folder>/columnar/<key>.arrow`` atomically, then its sidecar; return
    ``{"rows": R}``. A failed write names the store file and leaves nothing."""
    folder = Path(folder)
    src, out = folder / spec.rel, folder / STORE_DIR / spec.arrow
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    rows, pending = 0, []
    try:
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, _schema(spec)) as writer:
            def emit(values) -> None:
                writer.write_batch(pa.record_batch([_arrow_values(values, spec)], schema=_schema(spec)))

            buffered = 0
            for values in _checked_rows(folder, name, spec, counts):
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
        record = {"fingerprint": fingerprint, "rows": rows, "rel": spec.rel, "bytes": tmp.stat().st_size,
                  "xxh3": file_digest(tmp)}
        os.replace(tmp, out)
    except OSError as exc:  # pyarrow's own errors name no file: say which one could not be read or written
        if str(getattr(exc, "filename", "")) == str(src):
            raise ValueError(f"{src}: cannot read it ({os_reason(exc)})") from None
        raise write_error(out, exc, "the files converted before it are kept") from None
    finally:
        tmp.unlink(missing_ok=True)
    _write_sidecar(out.with_name(out.name + ".json"), record)
    return {"rows": rows}


def _join(parts: list, spec: FileSpec):
    if spec.store == "text":
        return [line for part in parts for line in part]
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _record(store: Path, spec: FileSpec) -> dict | None:
    try:
        meta = json.loads((store / (spec.arrow + ".json")).read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def _damage(store: Path, spec: FileSpec, fingerprint: str, checksum: bool = False) -> str | None:
    """Why the file is converted (again): None when it is converted from these raw files and intact
    (its size; its xxh3 too with ``checksum``), "" when it never was, or from other raw files."""
    meta, path = _record(store, spec), store / spec.arrow
    if meta is None:
        return f"its sidecar {spec.arrow}.json is unreadable" if path.is_file() else ""
    if meta.get("fingerprint") != fingerprint:
        return ""
    if not path.is_file():
        return f"{path.name} is missing"
    if path.stat().st_size != meta.get("bytes"):
        return f"{path.name} has {path.stat().st_size} bytes, {meta.get('bytes')} recorded (truncated)"
    if checksum and file_digest(path) != meta.get("xxh3"):
        return f"{path.name}'s checksum differs from the one recorded (corrupt)"
    return None


def _verify(store: Path, name: str, fingerprint: str) -> list[tuple[FileSpec, str]]:
    """The damaged files of a finished store, with why (one read of the whole store)."""
    found = [(spec, _damage(store, spec, fingerprint, checksum=True)) for spec in file_specs(name)]
    return [(spec, why) for spec, why in found if why is not None]


Runner = Callable[[list[tuple]], Iterable[dict]]


def _say(store: Path, spec: FileSpec, why: str) -> None:
    print(f"satp: converting {spec.rel} again into {store / spec.arrow}: {why}", file=sys.stderr, flush=True)


def build_store(folder: Path, name: str, fingerprint: str, run: Runner | None = None) -> "ColumnarStore":
    """Convert ``folder`` into its columnar store unless it holds a finished, intact one for
    ``fingerprint``; return the opened store. Only damaged files are converted again, named on stderr.
    ``run`` runs the :func:`convert_file` calls (default: here; the build passes Ray tasks)."""
    folder = Path(folder)
    store = folder / STORE_DIR
    if store_is_current(folder, fingerprint) and not _verify(store, name, fingerprint):
        return ColumnarStore(folder)
    with writer_lock(store / LOCK_FILE, f"the columnar store {store}"):
        damaged = _verify(store, name, fingerprint) if store_is_current(folder, fingerprint) else None
        if damaged == []:  # another command finished or repaired it meanwhile: left as it is
            return ColumnarStore(folder)
        for spec, why in damaged or []:
            if why:
                _say(store, spec, why)
            (store / (spec.arrow + ".json")).unlink(missing_ok=True)
            (store / spec.arrow).unlink(missing_ok=True)
        _convert(folder, name, fingerprint, run)
        return ColumnarStore(folder)


def _convert(folder: Path, name: str, fingerprint: str, run: Runner | None) -> None:
    """The conversions of :func:`build_store` (under its lock): every file not finished, then store.json."""
    store = folder / STORE_DIR
    store.mkdir(parents=True, exist_ok=True)
    try:
        json.loads((store / STORE_FILE).read_text())
    except FileNotFoundError:
        pass
    except (OSError, ValueError):
        print(f"satp: writing {store / STORE_FILE} again: it is unreadable", file=sys.stderr, flush=True)
    (store / STORE_FILE).unlink(missing_ok=True)  # incomplete from here on
    leftovers = {p.name[1:].split(".tmp-")[0] for p in store.glob(".*.tmp-*")}
    specs = file_specs(name)
    for spec in specs:
        why = _damage(store, spec, fingerprint)
        if why is not None and spec.arrow in leftovers:
            why = "its conversion was interrupted (a temporary file was left)"
        if why:
            _say(store, spec, why)
    for stale in store.iterdir():  # another fingerprint's files, damaged ones, temporary files of a killed run
        if stale.name in (FINGERPRINT_FILE, LOCK_FILE):  # the raw files' own record, the writer lock
            continue
        spec_of = stale.name.removesuffix(".json")
        if stale.name.startswith(".") or not any(s.arrow == spec_of and _damage(store, s, fingerprint) is None
                                                 for s in specs):
            stale.unlink()
    count_specs = specs[:2]
    for spec in count_specs:
        if _damage(store, spec, fingerprint) is not None:
            convert_file(str(folder), name, spec, fingerprint, None)
    counts = _Counts(*(read_column(store / spec.arrow) for spec in count_specs))
    _check_counts(folder, counts)
    todo = [s for s in specs[2:] if _damage(store, s, fingerprint) is not None]
    calls = [(str(folder), name, spec, fingerprint, counts) for spec in todo]
    list(run(calls) if run else (convert_file(*call) for call in calls))
    split_specs = [s for s in specs if s.per == "split"]
    check_splits({s.key.removeprefix("split-"): folder / s.rel for s in split_specs},
                 {s.key.removeprefix("split-"): read_column(store / s.arrow) for s in split_specs})
    records = {s.key: _record(store, s) for s in specs}
    meta = {"version": STORE_VERSION, "dataset": name, "fingerprint": fingerprint, "graphs": int(counts.nodes.size),
            "rows": {k: r["rows"] for k, r in records.items()},
            "files": {k: {"bytes": r["bytes"], "xxh3": r["xxh3"]} for k, r in records.items()}}
    _write_sidecar(store / STORE_FILE, meta)
