"""Logging a trained model to MLflow, registering it, and loading it back.

A logged model (``mlflow.pytorch`` flavour, ``serialization_format="pickle"``:
the default ``pt2`` format cannot save a PyG model) carries, beside the
pickled :class:`sat.SAT` module (eval mode, fp32, CPU), one extra file
``extra_files/satp_model.json``::

    {"format": 1, "task": {"name": "code2", "max_seq_len": 5},
     "model_config": {...SATConfig fields...}, "vocab": [...] | null,
     "data_manifest_hash": "...", "git_commit": "...", "metrics": {...},
     "provenance": {"config_hash": "...", "git_commits": [...]},
     "run_name": "...", "job": {...}}

which is what prediction needs: :func:`load_model` returns the module with the
task rebuilt (vocabulary included) so that ``task.predict(model(batch))`` gives
decoded predictions. Only load models from your own registry (pickle).

The recorded configuration, data hash and commit are those of the weights: the
caller passes the ``provenance`` its checkpoint recorded (:mod:`pipeline.rerun`:
the hash of the configuration that trained the weights, and the git commits of
the code that did, one per resumed segment when it changed); ``git_commit`` is
the last of them, not the commit of the process that happens to register.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch

from pipeline.tasks import Task, make_task
from sat.config import SATConfig

META_FILE = "satp_model.json"
CHAMPION = "champion"  # the alias that serves a model name: the best version by validation metric
FORMAT = 1


@dataclasses.dataclass
class LoadedModel:
    model: torch.nn.Module
    task: Task
    model_config: SATConfig
    vocab: Optional[list[str]]
    info: dict[str, Any]


def git_commit(cwd: Optional[str | Path] = None) -> str:
    """The project's git commit (``$SATP_GIT_COMMIT`` first: a Ray job's working dir has no .git)."""
    if os.environ.get("SATP_GIT_COMMIT"):
        return os.environ["SATP_GIT_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd or Path(__file__).resolve().parent, capture_output=True, text=True, timeout=10
        )
        if out.returncode == 0:
            commit = out.stdout.strip()
            dirty = subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"],
                cwd=cwd or Path(__file__).resolve().parent, capture_output=True, text=True, timeout=10,
            ).stdout.strip()
            return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def log_and_register(
    model: torch.nn.Module,
    *,
    task: Task,
    model_config: SATConfig,
    vocab: Optional[list[str]],
    run_id: str,
    tracking_uri: str,
    registered_model: Optional[str],
    data_manifest_hash: str = "",
    metrics: Optional[dict[str, float]] = None,
    extra: Optional[dict[str, Any]] = None,
    provenance: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    """Log ``model`` (+ what it needs to predict) to MLflow run ``run_id``; register it under
    ``registered_model`` (skipped when None). Tags the version with the data manifest hash, the
    git commit, the task and the metrics.

    Returns ``{"model_uri", "registered_model", "version", "registered_uri"}``
    (the last two None when not registered).
    """
    import mlflow
    from mlflow.tracking import MlflowClient

    model = model.to("cpu").float().eval()
    provenance = {k: v for k, v in (provenance or {}).items() if k in ("config_hash", "git_commits")}
    commits = list(provenance.get("git_commits") or [])
    commit = commits[-1] if commits else git_commit()
    meta = {
        "format": FORMAT,
        "task": task.state(),
        "model_config": dataclasses.asdict(model_config),
        "vocab": list(vocab) if vocab is not None else None,
        "data_manifest_hash": data_manifest_hash,
        "git_commit": commit,
        "metrics": dict(metrics or {}),
        "provenance": provenance or None,
        **(extra or {}),
    }
    mlflow.set_tracking_uri(tracking_uri)
    client = MlflowClient(tracking_uri=tracking_uri)
    with tempfile.TemporaryDirectory() as tmp:
        meta_path = Path(tmp) / META_FILE
        meta_path.write_text(json.dumps(meta, default=str))
        with mlflow.start_run(run_id=run_id):
            info = mlflow.pytorch.log_model(
                model,
                name="model",
                serialization_format="pickle",
                extra_files=[str(meta_path)],
                pip_requirements=["torch", "torch-geometric", "satp"],
            )
    result: dict[str, Any] = {"model_uri": info.model_uri, "registered_model": None, "version": None, "registered_uri": None}
    if registered_model:
        version = mlflow.register_model(info.model_uri, registered_model, tags={"task": task.name})
        tags = {
            "data_manifest_hash": data_manifest_hash or "unknown",
            "git_commit": commit,
            "task": task.name,
            "run_id": run_id,
            **({"satp.config_hash": provenance["config_hash"]} if provenance.get("config_hash") else {}),
            **({"satp.git_commits": " ".join(commits)} if len(commits) > 1 else {}),
            **{f"metric.{k}": f"{v:.6g}" for k, v in (metrics or {}).items() if isinstance(v, (int, float))},
        }
        for key, value in tags.items():
            client.set_model_version_tag(registered_model, version.version, key, str(value))
        result.update(
            registered_model=registered_model,
            version=int(version.version),
            registered_uri=f"models:/{registered_model}/{version.version}",
        )
    return result


def check_model_uri(uri: str) -> None:
    """``models:/NAME`` alone names no model: MLflow reads it as a version-less URI and answers
    that the model does not exist. Say what to write instead (one line)."""
    name = uri[len("models:/"):] if uri.startswith("models:/") else None
    if name and "/" not in name and "@" not in name:
        raise ValueError(f"{uri}: name a version or an alias: models:/{name}/<version> or models:/{name}@champion "
                         "(satp models lists them)")


def load_model(uri: str, tracking_uri: Optional[str] = None) -> LoadedModel:
    """Load a logged SAT model (``models:/NAME/VERSION``, ``models:/NAME@ALIAS``, ``runs:/...``).

    Raises ``ValueError`` with a one-line message when the model does not exist
    or was not logged by :func:`log_and_register`.
    """
    check_model_uri(uri)
    import mlflow
    from mlflow.exceptions import MlflowException

    from pipeline import pyg_templates

    pyg_templates.install()  # unpickling builds PyG convs: no generated module left in $TMPDIR
    if tracking_uri:
        mlflow.set_tracking_uri(tracking_uri)
    try:
        local = mlflow.artifacts.download_artifacts(artifact_uri=uri, tracking_uri=tracking_uri)
    except MlflowException as exc:
        raise ValueError(f"{uri}: {str(exc).splitlines()[0]}") from None
    meta_path = Path(local) / "extra_files" / META_FILE
    if not meta_path.is_file():
        raise ValueError(f"{uri}: not a satp model (no {META_FILE})")
    meta = json.loads(meta_path.read_text())
    model = mlflow.pytorch.load_model(local, map_location="cpu").eval()
    vocab = meta.get("vocab")
    task_state = dict(meta["task"])
    task = make_task(task_state.pop("name"), vocab=vocab, **task_state)
    config = SATConfig.from_dict(meta["model_config"])
    return LoadedModel(model=model, task=task, model_config=config, vocab=vocab, info=meta)


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
    """Move ``alias`` to ``version`` of ``name`` if ``value`` beats the current holder's ``metric_key`` tag.

    The replaced version is tagged ``satp.replaced_by`` and ``satp.replaced_reason``; the
    candidate is tagged ``satp.champion_decision`` either way. Returns ``{"champion", "reason"}``.
    """
    from mlflow.exceptions import MlflowException

    current = None
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
