"""What the registry recorded for a version when it was registered, checked against what it serves.

Tags and files can both be rewritten; what MLflow's API cannot change afterwards is the trust root:
the version's ``run_id`` and ``source`` (its logged model), and that logged model's ``source_run_id``
and parameters, logged before the files. :func:`record_problem` compares the files with all of it;
loading refuses a version that differs, and ``satp models`` marks it."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Optional

from preprocessing.shard_places import sha256_file

#: A version's two files (:mod:`pipeline.registry.model_format`).
META_FILE = "satp_model.json"
WEIGHTS_FILE = "weights.pt"
LEGACY_META = f"extra_files/{META_FILE}"  # format 1: beside the pickled module of mlflow.pytorch
#: The registry tag (and logged-model parameter) with each file's sha256 (a JSON object: file name -> hex digest).
FILES_TAG = "satp.files_sha256"
WEIGHTS_TAG = "satp.weights_sha256"
#: ``(what, registry tag, how the file states it)`` compared when both sides hold a value.
_IDENTITY = (
    ("run_id", "run_id", lambda meta: meta.get("run_id")),
    ("task", "task", lambda meta: (meta.get("task") or {}).get("name")),
    ("data_manifest_hash", "data_manifest_hash", lambda meta: meta.get("data_manifest_hash") or "unknown"),
    ("git_commit", "git_commit", lambda meta: meta.get("git_commit")),
    ("config_hash", "satp.config_hash", lambda meta: (meta.get("provenance") or {}).get("config_hash")),
)


def files_tag(paths: Mapping[str, Path]) -> str:
    """The :data:`FILES_TAG` value of the files about to be logged (``{file name: path}``)."""
    return json.dumps({name: sha256_file(Path(path)) for name, path in sorted(paths.items())}, sort_keys=True)


def metric_tag(value: float) -> str:
    """A metric as the version's ``metric.*`` tags hold it (6 significant digits)."""
    return f"{value:.6g}"


def _short(value: Any) -> str:
    text = str(value)
    return text[:12] if len(text) in (32, 64) else text  # a run id or a sha256


def logged_model(client, version):
    """The logged model ``version`` was registered from (its source ``models:/<model id>``), or None
    for a source of another kind (versions registered by MLflow 2); a one-line ``ValueError`` when
    the source names a logged model that cannot be read."""
    from mlflow.exceptions import MlflowException

    model_id = (version.source or "").removeprefix("models:/")
    if model_id == version.source or "/" in model_id or "@" in model_id:
        return None
    try:
        return client.get_logged_model(model_id)
    except MlflowException as exc:
        raise ValueError(f"the logged model of version {version.version} ({version.source}) cannot be read "
                         f"({str(exc).splitlines()[0]})") from None


def served_files(uri: str, tracking_uri: Optional[str], version) -> Path:
    """The ``artifacts/`` folder holding the two files ``uri`` serves (a local store's folder, else a
    downloaded copy; ``version``: the registry's entry, None for a ``runs:/`` URI); a one-line
    ``ValueError`` when there is no such model, its files are gone or missing, or it is format 1."""
    import mlflow
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    location = uri
    if version is not None:  # its source's artifact URI
        location = MlflowClient(tracking_uri).get_model_version_download_uri(version.name, version.version)
    gone = f"{uri}: the artifacts of version {getattr(version, 'version', '')} are gone (nothing at {location})"
    try:
        local = Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, tracking_uri=tracking_uri))
    except MlflowException as exc:
        if version is not None and exc.error_code == "RESOURCE_DOES_NOT_EXIST":
            raise ValueError(gone) from None
        raise ValueError(f"{uri}: {str(exc).splitlines()[0]}") from None
    if version is not None and not any(local.iterdir()):  # a remote store lists nothing where the folder was
        raise ValueError(gone)
    if (local / LEGACY_META).is_file():
        raise ValueError(f"{uri}: a format-1 satp model (a pickled module, which satp does not load); "
                         "train its job again with satp train to register it weights-only")
    files = local / "artifacts"  # where MLflow's pyfunc flavour puts a model's artifacts
    absent = [f"artifacts/{name}" for name in (META_FILE, WEIGHTS_FILE) if not (files / name).is_file()]
    if len(absent) == 2 and not (version is not None and WEIGHTS_TAG in (version.tags or {})):
        raise ValueError(f"{uri}: not a satp model (no artifacts/{META_FILE} and artifacts/{WEIGHTS_FILE} at {location})")
    if absent:
        which = f"version {version.version}'s" if version is not None else "its"
        raise ValueError(f"{uri}: {' and '.join(absent)} {'is' if len(absent) == 1 else 'are'} missing from {which} "
                         f"artifacts at {location}")
    return files


def read_meta(path: Path, where: str) -> dict[str, Any]:
    """A version's ``satp_model.json``; a one-line ``ValueError`` when it is not a JSON object."""
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ValueError(f"{where}: {path.name} is damaged ({str(exc).splitlines()[0]})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{where}: {path.name} is damaged (a JSON {type(meta).__name__}, not an object)")
    return meta


def record_problem(version, meta: Mapping[str, Any], files: Path, logged=None) -> Optional[str]:
    """What differs between ``version`` (the registry's entry: its tags, ``run_id``; ``logged``: the
    logged model of its source, :func:`logged_model`) and what it serves: the ``satp_model.json`` it
    holds (``meta``) and the files in ``files`` (one clause), or None."""
    tags = dict(version.tags or {})
    params = dict(logged.params or {}) if logged is not None else {}
    number = str(version.version)
    recorded = params.get(WEIGHTS_TAG) or tags.get(WEIGHTS_TAG)
    if not recorded:
        return f"the registry records no {WEIGHTS_TAG} for version {number} (it was not registered by satp)"
    differs = []
    served = meta.get("weights_sha256")
    if served != recorded:
        differs.append(f"weights_sha256 {_short(served)} (recorded {_short(recorded)})")
    for what, tag, stated in _IDENTITY:
        mine, theirs = tags.get(tag), stated(meta)
        if mine and theirs and mine != "unknown" and str(theirs) != mine:
            differs.append(f"{what} {_short(theirs)} (recorded {_short(mine)})")
    differs += _mlflow_fields(version, meta, logged)
    for key in (WEIGHTS_TAG, FILES_TAG):
        if params.get(key) and tags.get(key) != params[key]:
            differs.append(f"tag {key} changed since registration (its logged model records another)")
    try:
        digests = json.loads(params.get(FILES_TAG) or tags.get(FILES_TAG) or "{}")
    except ValueError:
        return f"the {FILES_TAG} record of version {number} is damaged"
    for name, digest in sorted(digests.items()):
        path = files / name
        actual = sha256_file(path) if path.is_file() else "missing"
        if actual != digest:
            differs.append(f"{name} sha256 {_short(actual)} (recorded {_short(digest)})")
    differs += _metric_tags(tags, meta.get("metrics") or {})
    if not differs:
        return None
    return f"not what the registry recorded for version {number} at registration: " + ", ".join(differs)


def _mlflow_fields(version, meta: Mapping[str, Any], logged) -> list[str]:
    """The run and logged model ``satp_model.json`` names against MLflow's own record of the version."""
    differs = []
    run = version.run_id
    if run and meta.get("run_id") and meta["run_id"] != run:
        differs.append(f"run_id {_short(meta['run_id'])} (MLflow's version {version.version} is of run {_short(run)})")
    if logged is not None and run and logged.source_run_id and logged.source_run_id != run:
        differs.append(f"logged model {logged.model_id} of run {_short(logged.source_run_id)} (MLflow's version "
                       f"{version.version} is of run {_short(run)})")
    if logged is not None and meta.get("model_id") and meta["model_id"] != logged.model_id:
        differs.append(f"model_id {meta['model_id']} (MLflow's version {version.version} is of {version.source})")
    return differs


def _metric_tags(tags: Mapping[str, str], metrics: Mapping[str, Any]) -> list[str]:
    """The version's ``metric.*`` tags against the metrics its ``satp_model.json`` records."""
    differs = []
    for key in sorted(k for k in tags if k.startswith("metric.")):
        value = metrics.get(key.removeprefix("metric."))
        stated = metric_tag(value) if isinstance(value, (int, float)) else "none"
        if tags[key] != stated:
            differs.append(f"{key} {tags[key]} (its {META_FILE} records {stated})")
    return differs
