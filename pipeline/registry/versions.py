"""Logging a trained model to MLflow, registering it once, and loading it back (:func:`load_model`:
weights and ``satp_model.json`` only). A version is registered only for weights that no version of
the same run holds; what it records is what the weights' checkpoint recorded (``provenance``)."""
from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from pipeline.registry.addresses import check_model_uri
from pipeline.registry.record import (FILES_TAG, WEIGHTS_TAG, files_tag, logged_model, metric_tag, record_problem,
                                      served_files)
from pipeline.registry.tracking import server_failure
from pipeline.registry.model_format import (FORMAT, META_FILE, PYFUNC_CODE, WEIGHTS_FILE, LoadedModel,
                                            cpu_state, read_model, weights_sha256, write_files)
from pipeline.tasks import Task
from sat.config import SATConfig

CHAMPION = "champion"  # the alias that serves a model name: the best version by validation metric
PIP_REQUIREMENTS = ["torch", "torch-geometric", "pydantic", "satp"]


def git_commit(cwd: Optional[str | Path] = None) -> str:
    """The project's git commit, ``-dirty`` with uncommitted changes to tracked files
    (``$SATP_GIT_COMMIT`` first: a Ray job's working dir has no .git)."""
    if os.environ.get("SATP_GIT_COMMIT"):
        return os.environ["SATP_GIT_COMMIT"]
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=40", "--exclude=*"],
                             cwd=cwd or Path(__file__).resolve().parent, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 else "unknown"


def default_model_name(job, task_name: str) -> str:
    """The registered model a job's versions go to: its ``mlflow.registered_model``, else
    ``sat-<task>`` (made here only: training, sweeps and a sweep's rerun name the same model)."""
    return job.mlflow.registered_model or f"sat-{task_name}"


def register(model: torch.nn.Module, *, job, task: Task, model_config: SATConfig, state: Mapping[str, Any],
             run_id: str, data_manifest_hash: str, extra: dict[str, Any]) -> dict[str, Any]:
    """Register the best epoch's ``model`` of run ``run_id`` (a training run or a sweep's best trial;
    ``state``: its checkpoint's) as a version of :func:`default_model_name`, tagged with the best
    epoch's metrics and the checkpoint's provenance; the alias is :func:`promote`'s."""
    best, metric = state["best"], task.metric
    metrics = {f"best_val_{metric}": best["val"], f"best_test_{metric}": best["test"], "best_epoch": best["epoch"],
               f"constant_{metric}": state.get("constant")}
    return log_and_register(model, task=task, model_config=model_config, vocab=getattr(task, "vocab", None),
                            run_id=run_id, tracking_uri=job.mlflow.tracking_uri,
                            registered_model=default_model_name(job, task.name), data_manifest_hash=data_manifest_hash,
                            metrics={k: v for k, v in metrics.items() if v is not None}, extra=extra,
                            provenance=state.get("provenance"))


def log_and_register(model: torch.nn.Module, *, task: Task, model_config: SATConfig, vocab: Optional[list[str]],
                     run_id: str, tracking_uri: str, registered_model: str, data_manifest_hash: str = "",
                     metrics: Optional[dict[str, float]] = None, extra: Optional[dict[str, Any]] = None,
                     provenance: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Log ``model`` and what it needs to predict to run ``run_id``; register it under
    ``registered_model``, tagged with the data hash, commit, task, metrics and weights' sha256.
    Returns ``{"model_uri", "registered_model", "version", "registered_uri"}`` (and ``"reason"``
    when a version of the same run already holds these weights: that one is returned)."""
    import mlflow
    from mlflow.tracking import MlflowClient

    state = cpu_state(model)
    sha = weights_sha256(state)
    provenance = {k: v for k, v in (provenance or {}).items() if k in ("config_hash", "git_commits")}
    commits = list(provenance.get("git_commits") or [])
    commit = commits[-1] if commits else git_commit()
    client = MlflowClient(tracking_uri=tracking_uri)
    held = version_holding(client, registered_model, run_id, sha)
    if held is not None:
        return _held(held, registered_model, "already registered")
    meta = {
        "format": FORMAT,
        "weights_sha256": sha,
        "task": task.state(),
        "model_config": dataclasses.asdict(model_config),
        "vocab": list(vocab) if vocab is not None else None,
        "data_manifest_hash": data_manifest_hash,
        "git_commit": commit,
        "metrics": dict(metrics or {}),
        "provenance": provenance or None,
        **(extra or {}),
        "run_id": run_id,  # what the registry records of the version, stated by its files too
    }
    try:
        model_uri, digests = log_weights(state, meta, run_id, tracking_uri)
    except OSError as exc:  # a full disk under the artifact store: say where (MLflow names its temporary copy)
        if server_failure(tracking_uri, exc):
            raise  # a tracking server's failure (requests' errors are OSErrors): its callers name the server
        store = client.get_experiment(client.get_run(run_id).info.experiment_id).artifact_location
        raise OSError(f"{store}: could not write the model's files ({exc.strerror or exc}); nothing was "
                      "registered") from None
    tags = {
        "data_manifest_hash": data_manifest_hash or "unknown",
        "git_commit": commit,
        "task": task.name,
        "run_id": run_id,
        **({"satp.config_hash": provenance["config_hash"]} if provenance.get("config_hash") else {}),
        **({"satp.git_commits": " ".join(commits)} if len(commits) > 1 else {}),
        **{f"metric.{k}": metric_tag(v) for k, v in (metrics or {}).items() if isinstance(v, (int, float))},
        WEIGHTS_TAG: sha,
        FILES_TAG: digests,
    }
    version = mlflow.register_model(model_uri, registered_model, tags={k: str(v) for k, v in tags.items()})
    first = version_holding(client, registered_model, run_id, sha)
    if first is not None and int(first.version) < int(version.version):
        # a second command registered the same weights meanwhile: the lowest version stays, this one goes
        client.delete_model_version(registered_model, version.version)
        return _held(first, registered_model, "registered meanwhile by another command")
    return {"model_uri": model_uri, "registered_model": registered_model, "version": int(version.version),
            "registered_uri": f"models:/{registered_model}/{version.version}"}


def _held(version, name: str, how: str) -> dict[str, Any]:
    return {"model_uri": version.source, "registered_model": name, "version": int(version.version),
            "registered_uri": f"models:/{name}/{version.version}",
            "reason": f"weights {how} as version {version.version} (same run, same sha256)"}


def version_holding(client, name: str, run_id: str, weights_sha256: str):
    """The first version of ``name`` registered from run ``run_id`` with these weights, or None."""
    holding = [v for v in client.search_model_versions(f"name='{name}'")
               if (v.tags or {}).get("run_id") == run_id and (v.tags or {}).get(WEIGHTS_TAG) == weights_sha256]
    return min(holding, key=lambda v: int(v.version), default=None)


def log_weights(state: Mapping[str, torch.Tensor], meta: dict[str, Any], run_id: str,
                tracking_uri: str) -> tuple[str, str]:
    """Log the two files as a pyfunc model from code into run ``run_id``; return its URI and the files'
    digests. The logged model is made first: ``satp_model.json`` names it, and its parameters (written
    once) hold the weights' and files' sha256 (:mod:`pipeline.registry.record`)."""
    import mlflow
    import mlflow.pyfunc
    from mlflow.tracking import MlflowClient

    mlflow.set_tracking_uri(tracking_uri)
    with tempfile.TemporaryDirectory() as tmp, mlflow.start_run(run_id=run_id):
        logged = mlflow.initialize_logged_model(name="model", source_run_id=run_id)
        code = Path(tmp) / "satp_pyfunc.py"
        code.write_text(PYFUNC_CODE)
        artifacts = write_files(state, {**meta, "model_id": logged.model_id}, Path(tmp))
        digests = files_tag({Path(path).name: Path(path) for path in artifacts.values()})
        MlflowClient(tracking_uri).log_model_params(logged.model_id, {WEIGHTS_TAG: meta["weights_sha256"],
                                                                      FILES_TAG: digests})
        info = mlflow.pyfunc.log_model(name="model", python_model=str(code), artifacts=artifacts,
                                       pip_requirements=PIP_REQUIREMENTS, model_id=logged.model_id)
    return info.model_uri, digests


def load_model(uri: str, tracking_uri: Optional[str] = None) -> LoadedModel:
    """Load a logged SAT model (``models:/NAME/VERSION``, ``models:/NAME@ALIAS``, ``runs:/...``) from its
    weights and JSON. Raises a one-line ``ValueError`` when it does not exist, its files are gone, it is
    not satp's or is format 1, or it serves other files than the registry recorded."""
    from mlflow.tracking import MlflowClient

    check_model_uri(uri)
    version = registered_version(uri, tracking_uri)
    files = served_files(uri, tracking_uri, version)
    loaded = read_model(files / WEIGHTS_FILE, files / META_FILE, uri)  # the files against each other
    if version is not None:  # and against MLflow's and the registry's record of the version
        try:
            problem = record_problem(version, loaded.info, files, logged_model(MlflowClient(tracking_uri=tracking_uri),
                                                                                version))
        except ValueError as exc:
            problem = str(exc)
        if problem:
            raise ValueError(f"{uri}: {problem}; it is not served: re-register the version from its run's checkpoint")
    return loaded


def registered_version(uri: str, tracking_uri: Optional[str] = None):
    """The registry's entry of ``models:/NAME/VERSION`` or ``models:/NAME@ALIAS`` (None for other
    URIs); a one-line ``ValueError`` when there is none."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    if not uri.startswith("models:/"):
        return None
    client = MlflowClient(tracking_uri=tracking_uri)
    rest = uri[len("models:/"):]
    try:
        if "@" in rest:
            return client.get_model_version_by_alias(*rest.split("@", 1))
        return client.get_model_version(*rest.split("/", 1))
    except MlflowException as exc:
        raise ValueError(f"{uri}: {str(exc).splitlines()[0]}") from None


def finite_float(v: Any) -> Optional[float]:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def better(new: Optional[float], old: Optional[float], mode: str) -> bool:
    """Whether ``new`` beats ``old`` under ``mode`` (``max``/``min``); a missing ``new`` never does."""
    if new is None or not math.isfinite(new):
        return False
    if old is None or not math.isfinite(old):
        return True
    return new > old if mode == "max" else new < old


def promote(client, name: str, version: int, value: Optional[float], metric_key: str, mode: str, alias: str,
            why: str) -> dict[str, Any]:
    """Move ``alias`` to ``version`` if ``value`` beats the holder's ``metric_key`` tag, tagging
    ``satp.replaced_by`` / ``satp.replaced_reason`` and ``satp.champion_decision``; returns
    ``{"champion", "reason"}``."""
    from mlflow.exceptions import MlflowException

    try:
        current = client.get_model_version_by_alias(name, alias)
    except MlflowException:
        current = None
    if current is not None and int(current.version) == int(version):
        return {"champion": True, "reason": "already the champion"}
    old_value = finite_float(current.tags.get(f"metric.{metric_key}")) if current is not None else None
    if value is not None and math.isfinite(value):
        value = float(f"{value:.6g}")  # the precision of the metric tags: equal there is not better
    if current is None:
        reason = f"no {alias} yet"
        promoted = True
    elif better(value, old_value, mode):
        reason = (f"{metric_key} {value:.6g} {'>' if mode == 'max' else '<'} "
                  f"{'unknown' if old_value is None else f'{old_value:.6g}'} of version {current.version}")
        promoted = True
    else:
        shown = "none" if value is None else f"{value:.6g}"
        reason = (f"{metric_key} {shown} does not beat {old_value:.6g} of version {current.version} "
                  f"(the {alias})")
        promoted = False
    if promoted:
        client.set_registered_model_alias(name, alias, str(version))
        if current is not None:
            client.set_model_version_tag(name, current.version, "satp.replaced_by", str(version))
            client.set_model_version_tag(
                name, current.version, "satp.replaced_reason",
                f"{alias} moved to version {version} ({why}): {reason}")
    client.set_model_version_tag(name, str(version), "satp.champion_decision",
                                 f"{'promoted' if promoted else 'not promoted'} to {alias}: {reason}")
    return {"champion": promoted, "reason": reason}
