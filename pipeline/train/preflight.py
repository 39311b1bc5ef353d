"""Pre-flight: what a job can get wrong that the driver can see, checked before Ray starts (a
mistake found later costs Ray's start, preprocessing, an MLflow run and every worker's retries).

:func:`early_checks` (the job alone, its data and output folders, the Ray address) runs before
torch and Ray are imported; :func:`connect_and_check` then checks the alive nodes against the
job's workers (:func:`check_resources`).
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

log = logging.getLogger(__name__)

DOWNLOAD_PROBE_S = 10.0
#: Raw files (gzip, as stored) up to this size have their values checked here; larger ones by their
#: conversion, on Ray, in parallel.
RAW_CHECK_BYTES = 64 << 20


# ----------------------------------------------------------------------------- the job alone
def feature_problem(model, subgraphs: bool, rwpe: int, lap_pe: int, where: str) -> Optional[str]:
    """What the model reads that the shards lack (``where`` names the shards' side), or None.
    ``subgraphs``: the shards hold k-hop subgraph indices; ``rwpe`` / ``lap_pe``: those widths (0: absent)."""
    if model.needs_subgraphs and not subgraphs:
        return (f"model.extractor: 'subgraph' reads each node's k-hop subgraph indices, and {where} hold none "
                f"(transform.k_hops: 0); set transform.k_hops (e.g. {model.k_hops}) or use extractor: subtree")
    for kind, have, key in (("rwpe", rwpe, "rwpe_steps"), ("lap", lap_pe, "lap_pe_dim")):
        if model.pe == kind and have != model.pe_dim:
            held = f"{have}-wide {kind} encodings" if have else f"no {kind} encodings"
            fix = f"set transform.{key}: {model.pe_dim}" + (f" or model.pe_dim: {have}" if have else " or model.pe: none")
            return (f"model.pe: {kind!r} with pe_dim {model.pe_dim} reads {model.pe_dim} values per node, and {where} "
                    f"hold {held} (transform.{key}: {have}); {fix}")
    return None


def check_config(job) -> None:
    """The job alone: its names, model and settings; raises ``ValueError`` with one line."""
    from pipeline.config.names import check_names

    check_names(job)  # run name, MLflow names: before anything is written under them
    train, res = job.train, job.resources
    if train.precision == "fp16" and not res.use_gpu:
        raise ValueError("train.precision: fp16 is not supported on CPU (DeepSpeed rejects it); use bf16 or fp32")
    if train.step == "captured" and not res.use_gpu:
        raise ValueError("train.step: 'captured' replays CUDA graphs and needs GPU workers (resources.use_gpu: true); "
                         "on CPU use 'eager' (the default): 'static' and 'compiled' pad every batch to a fixed capacity, "
                         "which costs a CPU more than the kernel launches they save on a GPU")
    if train.warmup_epochs > train.epochs:
        raise ValueError(f"train.warmup_epochs ({train.warmup_epochs}) exceeds train.epochs ({train.epochs})")
    problem = worker_count_problem(job)
    if problem:
        raise ValueError(problem)
    t = job.transform
    problem = feature_problem(job.model, t.k_hops > 0, t.rwpe_steps, t.lap_pe_dim, "the job's shards")
    if problem:
        raise ValueError(problem)


def _range(res) -> str:
    return f"[{res.min_workers}, {res.max_workers}]" if res.elastic else str(res.num_workers)


def worker_count_problem(job) -> Optional[str]:
    """What no worker count of the job can run (one line), or None: ZeRO stages 1 and 2 partition the
    optimizer state by the worker count and reduce gradients at every backward pass, so they need
    one count and equal shares of a step; at stage 0 every count runs any global batch."""
    train, res = job.train, job.resources
    if train.zero_stage == 0:
        return None
    if res.elastic:
        return (f"resources.num_workers {_range(res)} with train.zero_stage {train.zero_stage}: ZeRO partitions the "
                f"optimizer state by the worker count and DeepSpeed resumes it only at the count that wrote it; an "
                f"elastic run needs train.zero_stage: 0 (or give one worker count)")
    k = train.micro_batches_per_step
    if k % res.num_workers:
        return (f"train.micro_batches_per_step {k} does not divide among resources.num_workers {res.num_workers}: "
                f"train.zero_stage {train.zero_stage} reduces gradients at every backward pass, so every worker "
                f"must take the same share of a step; use a multiple of {res.num_workers}, or train.zero_stage: 0")
    return None


def describe_counts(job) -> str:
    """How a step's micro-batches deal to each worker count the job allows, e.g. ``a step's 4
    micro-batches: 1, 2 or 4 workers take equal shares; 3 take 2/1/1``."""
    k, res = job.train.micro_batches_per_step, job.resources
    even = [w for w in res.counts if k % w == 0]
    uneven = [f"{w} take {'/'.join(str(len(range(r, k, w))) for r in range(w))}" for w in res.counts
              if k % w and w <= k]
    idle = [w for w in res.counts if w > k]
    parts = ([f"{', '.join(map(str, even))} worker(s) take equal shares"] if even else []) + uneven
    if idle:
        parts.append(f"{idle[0]}{f' to {idle[-1]}' if len(idle) > 1 else ''} leave workers idle")
    return f"resources.num_workers {_range(res)}, a step's {k} micro-batch(es): " + "; ".join(parts)


def check_shard_features(model, manifest: dict, shard_dir) -> None:
    """The model against the shards that exist (their manifest's columns)."""
    columns = manifest.get("columns") or {}

    def width(name: str) -> int:
        shape = (columns.get(name) or {}).get("shape") or []
        return int(shape[-1]) if name in columns and shape else 0

    problem = feature_problem(model, "subgraph_node_index" in columns, width("rwpe"), width("lap_pe"),
                              f"the shards in {shard_dir}")
    if problem:
        raise ValueError(problem)


# ----------------------------------------------------------------------------- data root
def check_writable_dir(key: str, path: str | Path, default: str = "") -> None:
    """Raise ``ValueError`` (one line naming ``key``, the path and why) unless ``path`` is, or can be
    created as, a directory this process can write: tried for real, as permission bits say nothing
    for root, ``/proc`` or a full or read-only file system. ``default``: how an unset ``key`` chose it."""
    path = Path(path).expanduser()
    missing, node = [], path.absolute()
    while not node.exists() and node != node.parent:
        missing.append(node)
        node = node.parent
    where = f"{key}{default}: {path}"
    if not node.is_dir():
        raise ValueError(f"{where}{'' if node == path.absolute() else f': {node}'} is a file; expected a directory")
    made = []
    try:
        for directory in reversed(missing):
            try:
                directory.mkdir()
            except FileExistsError:  # made meanwhile by someone else: theirs to keep
                continue
            made.append(directory)
        os.rmdir(tempfile.mkdtemp(prefix=".satp-probe-", dir=path))
    except OSError as exc:
        what = "does not exist and cannot be created" if missing else "is not writable"
        raise ValueError(f"{where} {what} (mkdir {exc.filename or path}: {exc.strerror or exc})") from None
    finally:
        for directory in reversed(made):
            with contextlib.suppress(OSError):
                directory.rmdir()


def _ogb_url(name: str) -> Optional[str]:
    """OGB's download address of ``name`` (from the ``ogb`` package's master table, without
    importing ogb, which imports torch_geometric)."""
    import csv
    import importlib.util

    spec = importlib.util.find_spec("ogb")
    if spec is None or not spec.submodule_search_locations:
        return None
    table = Path(list(spec.submodule_search_locations)[0]) / "graphproppred" / "master.csv"
    try:
        rows = list(csv.reader(table.open()))
    except OSError:
        return None
    header = rows[0]
    if name not in header:
        return None
    column = header.index(name)
    return next((row[column] for row in rows if row and row[0] == "url"), None)


def _probe_download(url: str) -> Optional[str]:
    """None when ``url`` answers within :data:`DOWNLOAD_PROBE_S`, else why not (one line)."""
    import urllib.error
    import urllib.request

    try:
        request = urllib.request.Request(url, method="HEAD")
        with urllib.request.urlopen(request, timeout=DOWNLOAD_PROBE_S):
            return None
    except urllib.error.HTTPError as exc:
        return None if exc.code < 500 and exc.code not in (404, 410) else f"HTTP {exc.code}"
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        return str(reason).splitlines()[0] if str(reason) else type(exc).__name__


def check_data_root(data) -> None:
    """The dataset complete and in range, or buildable; raises ``ValueError`` naming ``data.root``."""
    from preprocessing.ogb_layout import OGB_DIR

    root = Path(data.root).expanduser()
    if root.exists() and not root.is_dir():
        raise ValueError(f"data.root: {root} is a file; expected a directory holding {OGB_DIR[data.name]}/")
    folder = root / OGB_DIR[data.name]
    if folder.exists():
        if not folder.is_dir():
            raise ValueError(f"data.root: {folder} is a file; expected {data.name}'s dataset folder")
        if not (folder / "RELEASE_v1.txt").is_file():
            raise ValueError(f"data.root: {folder}: RELEASE_v1.txt missing, not a complete OGB dataset folder "
                             "(delete it to rebuild)")
        check_raw_values(folder, data.name)
        return
    check_writable_dir("data.root", root)  # the dataset is built into it
    if data.source == "pycode":
        for source in data.source_dirs:
            if not Path(source).expanduser().exists():
                raise ValueError(f"data.source_dirs: {source}: source directory not found")
    elif data.source == "ogb":
        url = _ogb_url(data.name)
        problem = _probe_download(url) if url else None
        if problem:
            raise ValueError(f"data.root: {folder} is absent and data.source is 'ogb', but its download {url} "
                             f"does not answer ({problem}); put OGB's raw layout there, or pick an offline data.source")


def check_raw_values(folder: Path, name: str) -> None:
    """Every raw value of the dataset in ``folder`` in its range (:func:`preprocessing.conversion.check_values`),
    unless its columnar store was converted from these very files or they are over :data:`RAW_CHECK_BYTES`."""
    from preprocessing.columnar import raw_fingerprint, required_files, store_is_current

    files = [folder / rel for rel in required_files(name)]
    if not all(f.is_file() for f in files) or sum(f.stat().st_size for f in files) > RAW_CHECK_BYTES:
        return  # a missing file is named by the conversion; a large dataset is checked there, in parallel
    if store_is_current(folder, raw_fingerprint(folder, name)):
        return
    from preprocessing.conversion import check_values

    check_values(folder, name)


# ----------------------------------------------------------------------------- the cluster
def worker_resources(res) -> dict[str, float]:
    """What one worker of ``res`` (the job's ``resources``) asks Ray for."""
    need = {"CPU": float(res.cpus_per_worker)}
    if res.use_gpu:
        need["GPU"] = float(res.gpus_per_worker)
    return need


def _describe(amounts: dict[str, float]) -> str:
    return ", ".join(f"{v:g} {k}" for k, v in amounts.items())


def worker_slots(nodes: list[dict], need: dict[str, float]) -> int:
    """How many workers needing ``need`` the ``nodes`` (``ray.nodes()`` entries) hold at once."""
    slots = 0
    for node in nodes:
        if not node.get("Alive", False):
            continue
        have = node.get("Resources") or {}
        slots += min(int(math.floor(have.get(k, 0.0) / v + 1e-9)) for k, v in need.items() if v > 0)
    return slots


def local_node(count_gpus: bool = True) -> dict:
    """This machine as the one node of the local Ray cluster a command would start (``count_gpus=False``:
    a job that asks for none, so torch need not be imported to count them)."""
    try:
        cpus = float(len(os.sched_getaffinity(0)))
    except AttributeError:
        cpus = float(os.cpu_count() or 1)
    gpus = 0.0
    if count_gpus:
        import torch

        gpus = float(torch.cuda.device_count()) if torch.cuda.is_available() else 0.0
    return {"Alive": True, "Resources": {"CPU": cpus, "GPU": gpus}}


def check_resources(job, num_workers: Optional[int] = None, extra_cpus: float = 0.0,
                    address: Optional[str] = None, nodes: Optional[list[dict]] = None) -> None:
    """The alive nodes hold the job's workers, counted per node (``resources.wait_for_nodes: true``
    skips it): raises ``ValueError`` with the numbers. ``nodes``: ``ray.nodes()`` entries (default:
    the connected cluster's)."""
    res = job.resources
    if res.wait_for_nodes:
        return
    workers = num_workers or res.min_workers  # an elastic run starts once its minimum fits
    need = worker_resources(res)
    if nodes is None:
        import ray

        nodes = ray.nodes()
    nodes = [n for n in nodes if n.get("Alive", False)]
    slots = worker_slots(nodes, need)
    total: dict[str, float] = {}
    for node in nodes:
        for key in ("CPU", "GPU"):
            total[key] = total.get(key, 0.0) + float((node.get("Resources") or {}).get(key, 0.0))
    cpus_ok = total.get("CPU", 0.0) + 1e-9 >= workers * need["CPU"] + extra_cpus
    if slots >= workers and cpus_ok:
        if res.elastic or job.train.micro_batches_per_step % res.num_workers:
            log.info("%s; the cluster holds %d now", describe_counts(job), slots)
        _say_if_waiting(workers, need, extra_cpus, address)
        return
    where = f"the Ray cluster at {address}" if address else "this machine (a local Ray cluster)"
    hint = ("set resources.use_gpu: false, " if res.use_gpu and total.get("GPU", 0.0) < need.get("GPU", 0.0) else "")
    extra = f" + {extra_cpus:g} CPU for the trial" if extra_cpus else ""
    least = "at least " if res.elastic and not num_workers else ""
    raise ValueError(
        f"resources: the job asks for {least}{workers} worker(s) x ({_describe(need)}){extra}; {where} has "
        f"{_describe(total) or 'nothing'} on {len(nodes)} node(s), room for {slots} such worker(s); "
        f"{hint}lower resources.num_workers or the per-worker resources, or use a bigger cluster "
        f"(an autoscaling one: resources.wait_for_nodes: true)")


def _say_if_waiting(workers: int, need: dict[str, float], extra_cpus: float, address: Optional[str]) -> None:
    """On a cluster that other runs share (the satp cluster, a named one): one warning line when
    what the job asks for is not free now, since Ray then queues its workers until it is."""
    if not _ray_connected():
        return
    import ray

    from runtime.command import warn

    free = ray.available_resources()
    short = {k: workers * v + (extra_cpus if k == "CPU" else 0.0) for k, v in need.items()
             if free.get(k, 0.0) + 1e-9 < workers * v + (extra_cpus if k == "CPU" else 0.0)}
    if short:
        held = ", ".join(f"{free.get(k, 0.0):g} of the {k} free, {v:g} needed" for k, v in short.items())
        warn(f"the Ray cluster{f' at {address}' if address else ''} is busy with other runs ({held}): this run "
             "waits until they end")


# ----------------------------------------------------------------------------- the one entry point
def _ray_connected() -> bool:
    ray = sys.modules.get("ray")  # never imported: not connected (and not worth importing to ask)
    return bool(ray is not None and ray.is_initialized())


def check_output_dirs(job) -> None:
    """The folders a run reads and writes, writable: ``shards.root``, ``train.storage_path`` and
    ``tune.storage_path`` (:func:`check_run_store` where a URI)."""
    from pipeline.config.train import runs_dir
    from runtime.storage import is_uri

    storage = job.storage.settings()
    check_shards_root(job)
    sweep_path = job.tune.storage_path if job.tune is not None else None
    for key, value in (("train.storage_path", job.train.storage_path), ("tune.storage_path", sweep_path)):
        if value and is_uri(value):
            check_run_store(key, value, storage)
    if not job.train.storage_path:
        check_writable_dir("train.storage_path", runs_dir() / "ray", default=" (unset: <runs dir>/ray)")
    elif not is_uri(job.train.storage_path):
        check_writable_dir("train.storage_path", job.train.storage_path)


def check_shards_root(job) -> None:
    """``shards.root`` exists (it may be read-only: shared shards) or can be created, or on a store
    answers and can be listed (:func:`runtime.storage.check`; the build checks writing)."""
    from runtime.storage import check, is_uri

    if is_uri(job.shards.root):
        check(job.shards.root, write=False, settings=job.storage.settings(), key="shards.root")
    elif not Path(job.shards.root).expanduser().is_dir():
        check_writable_dir("shards.root", job.shards.root)


def check_run_store(key: str, uri: str, storage=None) -> None:
    """``key`` (``train.storage_path``, ``tune.storage_path``) a URI: the store can be written and can
    hold the run's lease (a conditional write: S3 only); else one ``ValueError`` line naming the URI."""
    from runtime.storage import check

    if not uri.startswith("s3://"):
        raise ValueError(f"{key}: {uri}: a run or sweep on a store holds its one-writer lease by a conditional "
                         "write, which satp makes on S3 only; use s3://BUCKET/PREFIX, or a path every node mounts")
    check(uri, write=True, settings=storage, key=key)


def early_checks(jobs: Iterable | Mapping[str, Any], *, address: Optional[str] = None,
                 num_workers: Optional[int] = None, extra_cpus: float = 0.0) -> None:
    """The checks before Ray (the module docstring), and, when a new local cluster would start, this machine's
    resources: nothing here starts or imports Ray, and only GPU jobs import torch.

    ``jobs``: a list, or a mapping from a name to the job: a problem of one job then starts with its name."""
    from runtime.ray_address import probe, resolve_address

    named = jobs.items() if isinstance(jobs, Mapping) else [(None, job) for job in jobs]
    seen = set()
    for name, job in named:
        try:
            check_config(job)
            check_output_dirs(job)
        except ValueError as exc:
            if name is None:
                raise
            raise ValueError(f"{name}: {exc}") from None
        key = job.data.model_dump_json()
        if key not in seen:
            seen.add(key)
            check_data_root(job.data)
    jobs = [job for _, job in named]
    if _ray_connected():
        return
    target = resolve_address(address)
    if target:
        probe(target)
    else:  # a local cluster would hold this machine: check before starting it
        node = local_node(count_gpus=any(j.resources.use_gpu for j in jobs))
        check_resources(jobs[0], num_workers=num_workers, extra_cpus=extra_cpus, nodes=[node])


def connect_and_check(jobs: Iterable | Mapping[str, Any], *, address: Optional[str] = None,
                      num_workers: Optional[int] = None, extra_cpus: float = 0.0,
                      ray_env: Optional[dict] = None) -> None:
    """Connect to Ray (the satp cluster, or a new local one without an address), then check
    its resources against the first job's request."""
    from runtime.ray_cluster import connect, resolve_address

    jobs = list(jobs.values()) if isinstance(jobs, Mapping) else list(jobs)
    connect(address, env_vars=ray_env)
    check_resources(jobs[0], num_workers=num_workers, extra_cpus=extra_cpus, address=resolve_address(address))
