"""Build, resume and validate a shard directory, one Ray task per shard.

:func:`preprocess` names the directory by the configuration and the raw files' fingerprint
(:func:`shard_dir`), skips the finished shards, computes the others as Ray tasks that write their
shard themselves, and writes ``manifest.json`` last. The driver never holds the dataset."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from preprocessing.config import SPLITS, DataConfig, ShardConfig, TransformConfig, config_hash
from preprocessing.shard_places import open_place
from preprocessing.shards import MANIFEST, SCHEMA_VERSION, VOCAB_FILE, column_specs, json_bytes, write_shard_file
from preprocessing.sbm import NUM_CLASSES
from preprocessing.columnar import TASK, ColumnarStore, raw_fingerprint
from preprocessing.conversion import build_store, convert_file
from preprocessing.sources import dataset_dir, ensure_dataset, iter_chunk
from preprocessing.transforms import build_vocab, transform_graph
from runtime.storage import StorageSettings, check, forwarded_env, is_uri


def shard_dir(data: DataConfig, transform: TransformConfig, shards: ShardConfig,
              fingerprint: str | None = None) -> Path | str:
    """``<shards.root>/<dataset>-<config hash[:12]>-<raw fingerprint[:12]>`` (a URI when ``shards.root``
    is one): two datasets never share a directory. ``fingerprint``: taken when not given."""
    if fingerprint is None:
        fingerprint = raw_fingerprint(dataset_dir(data), data.name)
    name = f"{data.name}-{config_hash(data, transform, shards)[:12]}-{fingerprint[:12]}"
    return f"{shards.root}/{name}" if is_uri(shards.root) else Path(shards.root) / name


@dataclass
class ShardPlan:
    split: str
    index: int
    ids: np.ndarray

    @property
    def file(self) -> str:
        return f"{self.split}-{self.index:05d}.arrow"

    @property
    def sidecar(self) -> str:
        return f"{self.split}-{self.index:05d}.json"


def plan_shards(store: ColumnarStore, data: DataConfig, shards: ShardConfig) -> list[ShardPlan]:
    """Each split's graphs in OGB's order (a seeded subset of ``data.max_graphs_per_split`` of them),
    cut into shards."""
    plans, limit = [], data.max_graphs_per_split
    for split in SPLITS:
        ids = store.splits[split]
        if limit is not None and ids.size > limit:
            ids = ids[np.sort(np.random.default_rng(data.seed).choice(ids.size, size=limit, replace=False))]
        for index, start in enumerate(range(0, ids.size, shards.graphs_per_shard)):
            plans.append(ShardPlan(split, index, ids[start : start + shards.graphs_per_shard]))
    return plans


def shard_rows(chunk: dict, task: str, transform: dict, vocab: list[str] | None) -> tuple[list[dict], dict]:
    """One shard's transformed rows (of a :meth:`ColumnarStore.chunk`) and its column specs."""
    import torch

    torch.set_num_threads(1)
    cfg = TransformConfig.model_validate(transform)
    vocab_index = {w: i for i, w in enumerate(vocab)} if vocab is not None else None
    return [transform_graph(g, task, cfg, vocab_index) for g in iter_chunk(chunk)], column_specs(task, cfg)


def write_shard(path: str, store: str, ids: np.ndarray, task: str, transform: dict, vocab: list[str] | None,
                storage: StorageSettings | None = None) -> dict:
    """The body of a shard task: graphs ``ids`` of the store in folder ``store`` into shard ``path``;
    returns its size and sha256. ``SATP_TESTING_SHARD_DELAY_S``: a fault-injection test's minimum duration."""
    started = time.monotonic()
    rows, specs = shard_rows(ColumnarStore(store).chunk(ids), task, transform, vocab)
    time.sleep(max(0.0, float(os.environ.get("SATP_TESTING_SHARD_DELAY_S", 0)) - (time.monotonic() - started)))
    return write_shard_file(path, rows, specs, storage)


def _shard_state(place, plan: ShardPlan, key: dict, present: dict[str, int | None]) -> tuple[dict | None, str | None]:
    """``(sidecar, None)`` of a finished shard (``present``: the directory's file sizes), else ``(None,
    why it is computed again)`` (``why`` None: it was never written)."""
    if present[plan.sidecar] is None:
        return None, "its build was interrupted before it was recorded" if present[plan.file] is not None else None
    if present[plan.file] is None:
        return None, "the file is missing"
    try:
        meta = json.loads(place.read(plan.sidecar))
    except (OSError, json.JSONDecodeError):
        return None, f"its sidecar {plan.sidecar} is unreadable"
    if any(meta.get(k) != v for k, v in key.items()) or meta.get("rows") != int(plan.ids.size):
        return None, "it was built from other source data or settings"
    if present[plan.file] != meta.get("bytes"):
        return None, f"{present[plan.file]} bytes, {meta.get('bytes')} recorded (truncated or corrupt)"
    if not place.digest_matches(plan.file, meta.get("sha256")):
        return None, "its sha256 differs from the recorded one (corrupt)"
    return meta, None


def _read_manifest(place) -> dict | None:
    """The directory's manifest, None when there is none or it is unreadable (rebuilt from the sidecars)."""
    try:
        manifest = json.loads(place.read(MANIFEST))
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def _check_owner(place, chash: str) -> None:
    """A directory written by another configuration is never reused or mixed."""
    fix = "`satp preprocess JOB.yaml --force` rebuilds it"
    manifest = _read_manifest(place)
    if manifest is not None:
        found = manifest.get("config_hash")
        if found != chash:
            raise ValueError(f"{place.root}: shard directory of another configuration (config hash {found!r}, "
                             f"expected {chash[:12]}...); {fix}")
    for side in place.names():
        if not side.endswith(".json") or side.startswith(".") or side in (MANIFEST, VOCAB_FILE):
            continue
        try:
            found = json.loads(place.read(side)).get("config_hash")
        except (OSError, ValueError, AttributeError):
            continue  # an unreadable sidecar only means its shard is recomputed
        if found != chash:
            raise ValueError(f"{place.at(side)}: shard of another configuration (config hash {found!r}, expected "
                             f"{chash[:12]}...); {fix}")


def preprocess(data: DataConfig, transform: TransformConfig, shards: ShardConfig, address: str | None = None,
               progress: bool = True, force: bool = False, storage: StorageSettings | None = None) -> Path | str:
    """Build (or resume, or just validate) the shards of a configuration; return their directory.

    ``force``: build them again into a temporary sibling that replaces the directory only once
    complete (on an object store: in place, the manifest removed first). Faults are one-line ``ValueError``s."""
    chash = config_hash(data, transform, shards)
    folder = ensure_dataset(data)
    fingerprint = raw_fingerprint(folder, data.name)
    place = open_place(shard_dir(data, transform, shards, fingerprint), storage)
    if not place.local:
        check(place.root, write=False, settings=storage)  # a store that does not answer: named in seconds
    if not force:
        if place.exists():
            _check_owner(place, chash)
        if _complete(place, fingerprint):
            return place.root  # finished and intact: nothing to read
    if not place.local:
        check(shards.root, write=True, settings=storage)
    with _RaySession(address) as session:
        store = build_store(folder, data.name, fingerprint, run=_conversion_runner(folder, session, progress))
        # one writer per directory (a second command waits, then finds it complete)
        with place.lock():
            if not force and _complete(place, fingerprint):
                return place.root
            if not force or not place.local:
                return build_shards(store, data, transform, shards, address=address, progress=progress,
                                    storage=storage, everything=force)
            return _rebuild(place.root, store, data, transform, shards, address, progress)


def _rebuild(out: Path, store: ColumnarStore, data: DataConfig, transform: TransformConfig, shards: ShardConfig,
             address: str | None, progress: bool) -> Path:
    """``preprocess(force=True)``: build into ``.<name>.rebuild-<id>``, swap it in by renames, delete
    the old one; a killed rebuild's leftovers go first."""
    for stale in out.parent.glob(f".{out.name}.*-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tag = uuid.uuid4().hex[:8]
    staging, old = out.with_name(f".{out.name}.rebuild-{tag}"), out.with_name(f".{out.name}.old-{tag}")
    try:
        build_shards(store, data, transform, shards, address=address, progress=progress, out=staging)
        if out.exists():
            os.replace(out, old)
        try:
            os.replace(staging, out)
        except OSError:
            if old.exists():
                os.replace(old, out)
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone already when it took out's place
    shutil.rmtree(old, ignore_errors=True)
    return out


def _complete(place, fingerprint: str) -> bool:
    """True when the manifest is for ``fingerprint`` and every shard and the vocabulary match it."""
    manifest = _read_manifest(place)
    if manifest is None:
        return False
    if manifest.get("schema_version") != SCHEMA_VERSION or manifest.get("source", {}).get("fingerprint") != fingerprint:
        return False
    entries = manifest.get("shards", [])
    vocab = manifest.get("vocab_sha256")
    present = place.sizes([e["file"] for e in entries] + [VOCAB_FILE])
    for entry in entries:
        if present[entry["file"]] != entry["bytes"] or not place.digest_matches(entry["file"], entry["sha256"]):
            return False
    return vocab is None or (present[VOCAB_FILE] is not None and place.digest_matches(VOCAB_FILE, vocab))


def build_shards(store: ColumnarStore, data: DataConfig, transform: TransformConfig, shards: ShardConfig,
                 address: str | None = None, progress: bool = True, out: Path | str | None = None,
                 storage: StorageSettings | None = None, everything: bool = False) -> Path | str:
    """:func:`preprocess` on a finished columnar store, into ``out`` (default :func:`shard_dir`);
    ``everything``: no shard is taken as finished."""
    chash = config_hash(data, transform, shards)
    place = open_place(shard_dir(data, transform, shards, store.fingerprint) if out is None else out, storage)
    if place.exists():
        _check_owner(place, chash)
    task = TASK[data.name]
    previous = _read_manifest(place)
    if previous is None and place.sizes([MANIFEST])[MANIFEST] is not None:
        print(f"satp: writing {place.at(MANIFEST)} again: it is unreadable", file=sys.stderr, flush=True)
    if previous is not None and not everything:
        old = (previous.get("source") or {}).get("fingerprint")
        if old != store.fingerprint:  # the name holds 12 hex digits of it: a collision, or a copied directory
            raise ValueError(f"{place.root}: built from other source data than {store.folder} now holds (raw fingerprint "
                             f"{str(old)[:16]}..., now {store.fingerprint[:16]}...); "
                             "`satp preprocess JOB.yaml --force` rebuilds it")
    plans = plan_shards(store, data, shards)
    if not plans:
        raise ValueError(f"{store.folder}: no graphs in any split")
    vocab = None
    if task == "code2":
        train_ids = np.concatenate([p.ids for p in plans if p.split == "train"] or [np.zeros(0, np.int64)])
        if train_ids.size == 0:
            raise ValueError(f"{store.folder}: the train split is empty, no vocabulary can be built")
        vocab = build_vocab(store.labels(train_ids), transform.vocab_size)
    place.mkdir()
    interrupted = set()
    for orphan in [n for n in place.names() if n.startswith(".") and ".tmp-" in n]:
        interrupted.add(orphan[1:].split(".tmp-")[0])  # a killed run's half-written file (a ppa shard: ~0.3 GB)
        place.delete(orphan)
    payload = None if vocab is None else (json.dumps(vocab) + "\n").encode()
    if payload is not None:
        try:
            written = place.read(VOCAB_FILE)
        except FileNotFoundError:
            written = None
        if written != payload:
            if written is not None:
                print(f"satp: writing {place.at(VOCAB_FILE)} again: it differs from the vocabulary of the train "
                      "split (damaged)", file=sys.stderr, flush=True)
            place.write(VOCAB_FILE, payload)
    key = {"config_hash": chash, "fingerprint": store.fingerprint, "schema_version": SCHEMA_VERSION}
    present = place.sizes([name for p in plans for name in (p.file, p.sidecar)])
    states = {p.file: (None, None) if everything else _shard_state(place, p, key, present) for p in plans}
    done = {file: meta for file, (meta, _) in states.items()}
    pending = [p for p in plans if done[p.file] is None]
    for plan in [] if everything else pending:
        why = "its write was interrupted" if plan.file in interrupted else states[plan.file][1]
        if why:
            print(f"satp: rebuilding shard {place.at(plan.file)}: {why}", file=sys.stderr, flush=True)
    if pending:
        place.delete(MANIFEST)  # incomplete from here on
        with _RaySession(address) as session:
            results = _run_shard_tasks(session(), pending, store, task, transform, vocab, place, shards, key, progress,
                                       storage)
        done.update(results)
    node_counts = np.diff(store.node_ptr)
    by_split = {split: [p for p in plans if p.split == split] for split in SPLITS}
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "dataset": data.name,
        "task": task,
        "config_hash": chash,
        "config": {
            "data": data.model_dump(mode="json"),
            "transform": transform.model_dump(mode="json"),
            "shards": shards.model_dump(mode="json", include={"graphs_per_shard"}),
        },
        "source": {"folder": str(store.folder.resolve()), "fingerprint": store.fingerprint},
        "splits": {split: {"graphs": sum(int(p.ids.size) for p in mine),
                           "nodes": sum(int(node_counts[p.ids].sum()) for p in mine),
                           "shards": [p.file for p in mine]} for split, mine in by_split.items()},
        "shards": [{"file": p.file, "split": p.split, **{k: done[p.file][k] for k in ("rows", "bytes", "sha256")}}
                   for p in plans],
        "columns": column_specs(task, transform),
        "vocab_file": VOCAB_FILE if vocab is not None else None,
        "vocab_sha256": hashlib.sha256(payload).hexdigest() if payload is not None else None,
        "num_vocab": len(vocab) if vocab is not None else None,
        "num_classes": len(vocab) if vocab is not None else NUM_CLASSES.get(data.name, 37),
        "max_seq_len": transform.max_seq_len if task == "code2" else None,
    }
    place.write(MANIFEST, json_bytes(manifest))
    return place.root


class _RaySession:
    """Ray for the tasks, connected on first use (:func:`runtime.ray_cluster.connect`) unless
    initialised already; shut down at the end only if started here."""

    def __init__(self, address: str | None):
        self.address, self.started = address, False

    def __call__(self):
        import ray

        if not ray.is_initialized():
            from runtime.ray_cluster import connect

            connect(self.address, log_to_driver=False, dashboard=False)
            self.started = True
        return ray

    def __enter__(self) -> "_RaySession":
        return self

    def __exit__(self, *exc) -> None:
        if self.started:
            import ray

            ray.shutdown()


def _progress(total: int, unit: str, desc: str, progress: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit=unit, unit_scale=True, desc=desc, disable=None if progress else True,
                file=sys.stderr, mininterval=1.0)  # None: off unless a terminal


def _conversion_runner(folder: Path, session: _RaySession, progress: bool):
    """Runs the conversions of :func:`preprocessing.conversion.build_store` as Ray tasks, one per raw file."""

    def run(calls: list[tuple]):
        if not calls:
            return []
        ray = session()
        remote = ray.remote(num_cpus=1, max_retries=2, scheduling_strategy="SPREAD")(convert_file)
        counts_ref = ray.put(calls[0][4])
        results = []
        with _progress(sum((folder / call[2].rel).stat().st_size for call in calls), "B", f"convert {folder.name}",
                       progress) as bar:
            def done(call: tuple, result: dict) -> None:
                results.append(result)
                bar.update((folder / call[2].rel).stat().st_size)

            _run_tasks(ray, remote, calls, lambda call: (*call[:4], counts_ref), len(calls), lambda call: "", done)
        return results

    return run


def _run_tasks(ray, remote, items: list, args, limit: int, where, done) -> None:
    """``remote(*args(item))`` of every item as Ray tasks, at most ``limit`` at once, then ``done(item,
    result)`` as each finishes. A failed task cancels the others and is raised as a one-line
    ``ValueError``, prefixed by ``where(item)`` unless it names that already."""
    queue, in_flight = list(items), {}

    def submit() -> None:
        while queue and len(in_flight) < limit:
            item = queue.pop(0)
            in_flight[remote.remote(*args(item))] = item

    submit()
    while in_flight:
        ready, _ = ray.wait(list(in_flight), num_returns=1)
        item = in_flight.pop(ready[0])
        submit()  # a queued task starts before the driver records this one
        try:
            result = ray.get(ready[0])
        except ray.exceptions.RayTaskError as exc:
            for ref in in_flight:  # cancelled and awaited: they remove their temporary files first
                ray.cancel(ref)
            if in_flight:
                ray.wait(list(in_flight), num_returns=len(in_flight), timeout=30.0)
            cause, prefix = str(getattr(exc, "cause", None) or exc).splitlines()[0], where(item)
            raise ValueError(cause if cause.startswith(prefix) else f"{prefix}: {cause}") from None
        done(item, result)


def _run_shard_tasks(ray, pending: list[ShardPlan], store: ColumnarStore, task: str, transform: TransformConfig,
                     vocab: list[str] | None, place, shards: ShardConfig, key: dict, progress: bool,
                     storage: StorageSettings | None = None) -> dict[str, dict]:
    from runtime.ray_cluster import missing_worker_env

    results: dict[str, dict] = {}
    # SPREAD: shard tasks go to every node, not first to the driver's (which holds their arguments)
    remote = ray.remote(num_cpus=shards.cpus_per_task, max_retries=2, scheduling_strategy="SPREAD")(write_shard)
    env = {} if place.local else missing_worker_env(forwarded_env())  # the store's endpoint and credentials
    if env:
        remote = remote.options(runtime_env={"env_vars": env})
    cpus = ray.cluster_resources().get("CPU", 1.0)
    # twice the slots: a queued task starts as soon as a worker is free
    limit = shards.max_in_flight or 2 * max(1, int(cpus // shards.cpus_per_task))
    vocab_ref = ray.put(vocab)
    tdict = transform.model_dump(mode="json")
    folder = str(store.folder)
    with _progress(int(sum(p.ids.size for p in pending)), "graph", f"preprocess {place.name}", progress) as bar:
        def done(plan: ShardPlan, written: dict) -> None:
            meta = dict(key, file=plan.file, split=plan.split, rows=int(plan.ids.size), **written)
            place.write(plan.sidecar, json_bytes(meta))
            results[plan.file] = meta
            bar.update(int(plan.ids.size))

        _run_tasks(ray, remote, pending, lambda p: (place.at(p.file), folder, p.ids, task, tdict, vocab_ref, storage),
                   limit, lambda p: place.at(p.file), done)
    return results
