"""MLflow tracking: one MLflow run per training run, keyed by the tag ``satp.run_key`` (storage path +
run name), so that a resumed or retried run logs into the same one (:func:`open_run`); a run started
over gets a new one, the old one detached (:func:`retire`)."""
from __future__ import annotations

import contextlib
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Optional

from pipeline.registry import empty_store

log = logging.getLogger(__name__)

RUN_KEY_TAG = "satp.run_key"
#: Logged with every epoch: the trajectory the values belong to (0, then one more per fall-back to an
#: older checkpoint: :meth:`RankZeroLogger.resume`), and the tag that says when and why it went back.
SEGMENT = "segment"
FELL_BACK_TAG = "satp.fell_back"


def flatten(values: Any, prefix: str = "") -> dict[str, str]:
    """Nested dicts/lists -> ``{"a.b": "value"}`` (MLflow params; values truncated to 500 chars)."""
    out: dict[str, str] = {}
    if isinstance(values, dict):
        for key, value in values.items():
            out.update(flatten(value, f"{prefix}{key}."))
    elif isinstance(values, (list, tuple)) and len(values) > 20:
        out[prefix[:-1]] = f"[{len(values)} items]"
    else:
        out[prefix[:-1]] = str(values)[:500]
    return out


def client(tracking_uri: str):
    """An MLflow client of ``tracking_uri``; a SQLite store that does not exist yet starts as a copy of
    an empty one (:mod:`pipeline.registry.empty_store`)."""
    from mlflow.tracking import MlflowClient

    empty_store.seed(tracking_uri)
    return MlflowClient(tracking_uri=tracking_uri)


#: urllib3's words for a request whose retries all got an error status
_ERROR_ANSWERS = re.compile(r"too many (\d{3}) error responses")


def server_failure(tracking_uri: str, exc: BaseException) -> Optional[str]:
    """How an http(s) tracking server failed, in a few words (an HTTP 5xx, a connection reset or refused,
    a timeout; ``its artifact store answered ...`` for an artifact request), or None for any other error.
    MLflow wraps these in an ``MlflowException`` with requests' and urllib3's exceptions behind it."""
    if not tracking_uri.startswith(("http://", "https://")):
        return None
    import requests
    import urllib3

    chain = _causes(exc)
    status = next((code for code in (_status(e) for e in chain) if code is not None and code >= 500), None)
    part = "its artifact store" if any("/mlflow-artifacts/" in str(e) for e in chain) else "it"
    if status is not None:
        return f"{part} answered HTTP {status}"
    if any(isinstance(e, ConnectionResetError) for e in chain):
        return f"the connection to {part} was reset"
    if any(isinstance(e, ConnectionRefusedError) for e in chain):
        return "it refused the connection"
    if any(isinstance(e, (TimeoutError, requests.exceptions.Timeout, urllib3.exceptions.TimeoutError)) for e in chain):
        return f"{part} did not answer in time"
    return None


def _causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and every exception behind it: causes, contexts, urllib3's ``reason`` and exceptions
    held in ``args`` (requests' ``ConnectionError(ProtocolError(..., ConnectionResetError(...)))``)."""
    seen: list[BaseException] = []
    todo = [exc]
    while todo:
        e = todo.pop()
        if not isinstance(e, BaseException) or any(e is s for s in seen):
            continue
        seen.append(e)
        todo.extend([e.__cause__, e.__context__, getattr(e, "reason", None), *e.args])
    return seen


def _status(exc: BaseException) -> Optional[int]:
    """The HTTP status an exception reports: a response's, an MlflowException's, urllib3's retries'."""
    from mlflow.exceptions import RestException
    from urllib3.exceptions import ResponseError

    response = getattr(exc, "response", None)
    if getattr(response, "status_code", None) is not None:
        return int(response.status_code)
    found = _ERROR_ANSWERS.search(str(exc)) if isinstance(exc, ResponseError) else None
    if found:
        return int(found.group(1))
    return exc.get_http_status_code() if isinstance(exc, RestException) else None


def artifact_location(tracking_uri: str) -> Optional[str]:
    """Artifacts of a SQLite store live beside the database (``<dir>/mlartifacts``), not in the
    current directory (MLflow's default ``./mlruns``, a temporary copy in a Ray job)."""
    database = empty_store.database_path(tracking_uri)
    return (database.parent / "mlartifacts").resolve().as_uri() if database is not None else None


def ensure_experiment(mlflow_client, name: str, tracking_uri: str) -> str:
    """The id of experiment ``name``, created (artifacts beside a SQLite store) if absent."""
    exp = mlflow_client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    return mlflow_client.create_experiment(name, artifact_location=artifact_location(tracking_uri))


def find_run(mlflow_client, experiment_id: str, tags: dict[str, str]):
    """The first run of the experiment carrying all ``tags``, or None."""
    clauses = " and ".join(f"tags.`{k}` = '{str(v).replace(chr(39), chr(92) + chr(39))}'" for k, v in tags.items())
    found = mlflow_client.search_runs([experiment_id], filter_string=clauses, max_results=1)
    return found[0] if found else None


def log_params(mlflow_client, run_id: str, params: dict) -> None:
    """Log a nested dict as flattened params, in batches (MLflow caps a batch at 100 params)."""
    from mlflow.entities import Param

    items = [Param(k, v) for k, v in flatten(params).items()]
    for i in range(0, len(items), 100):
        mlflow_client.log_batch(run_id, params=items[i : i + 100])


def reopen_run(mlflow_client, experiment_id: str, key: dict[str, str], run_name: str, params: dict,
               tags: Optional[dict[str, str]] = None):
    """The run carrying the ``key`` tags, set RUNNING again, or a new one with them, ``tags`` and
    ``params``; returns ``(run id, the run found or None)``."""
    found = find_run(mlflow_client, experiment_id, key)
    if found is not None:
        if found.info.status != "RUNNING":
            mlflow_client.update_run(found.info.run_id, status="RUNNING")
        return found.info.run_id, found
    run_id = mlflow_client.create_run(experiment_id, run_name=run_name, tags={**key, **(tags or {})}).info.run_id
    log_params(mlflow_client, run_id, params)
    return run_id, None


def open_run(tracking_uri: str, experiment: str, run_key: str, run_name: str, params: dict, config_text: str) -> str:
    """Return the id of the MLflow run for ``run_key``, creating it (with params and config) if needed."""
    mlflow_client = client(tracking_uri)
    exp_id = ensure_experiment(mlflow_client, experiment, tracking_uri)
    run_id, found = reopen_run(mlflow_client, exp_id, {RUN_KEY_TAG: run_key}, run_name, params)
    if found is not None:
        _note_changed_params(mlflow_client, found, params, config_text)
    else:
        mlflow_client.log_text(run_id, config_text, "job.yaml")
    return run_id


def _note_changed_params(mlflow_client, run, params: dict, config_text: str) -> None:
    """MLflow params are written once: a param a resumed run changed gets a tag ``satp.param.<key>`` =
    ``new (was old)``, and ``job.yaml`` is replaced."""
    logged = run.data.params
    changed = {k: v for k, v in flatten(params).items() if k in logged and logged[k] != v}
    if not changed:
        return
    for key, value in changed.items():
        mlflow_client.set_tag(run.info.run_id, f"satp.param.{key}", f"{value} (was {logged[key]})"[:500])
    mlflow_client.log_text(run.info.run_id, config_text, "job.yaml")


def find_training_run(tracking_uri: str, experiment: str, run_key: str):
    """The MLflow run of a training run (by its ``satp.run_key`` tag), or None."""
    mlflow_client = client(tracking_uri)
    exp = mlflow_client.get_experiment_by_name(experiment)
    return find_run(mlflow_client, exp.experiment_id, {RUN_KEY_TAG: run_key}) if exp is not None else None


def retire(mlflow_client, run_id: str, key_tag: str, key: str, why: str) -> None:
    """Detach an MLflow run from its ``key`` (tag ``key_tag``: ``satp.run_key``, ``satp.sweep_key``), so that
    the key's next run gets a new one; tagged ``satp.retired`` (why) and ``satp.retired_<key>`` (the key it
    had), its status, metrics and versions stay."""
    import time

    mlflow_client.set_tag(run_id, key_tag, f"{key}#retired-{int(time.time())}")
    mlflow_client.set_tag(run_id, f"satp.retired_{key_tag.removeprefix('satp.')}", key)
    mlflow_client.set_tag(run_id, "satp.retired", why[:500])


def log_metrics(mlflow_client, run_id: str, metrics: dict[str, Any], step: int) -> None:
    """The finite numbers of ``metrics`` at ``step``, in one batch."""
    import math
    import time

    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    items = [
        Metric(k, float(v), now, step)
        for k, v in metrics.items()
        if isinstance(v, (int, float)) and math.isfinite(float(v))
    ]
    if items:
        mlflow_client.log_batch(run_id, metrics=items)


def log_curves(mlflow_client, run_id: str, history: list[dict[str, Any]], metric: str,
               target: Optional[dict[str, Any]] = None) -> None:
    """``plots/training_curves.png`` and ``plots/metric_vs_time.png`` (with the job's target) of ``history``."""
    try:
        with tempfile.TemporaryDirectory() as tmp:
            curves, timed = Path(tmp) / "training_curves.png", Path(tmp) / "metric_vs_time.png"
            plot_curves(history, metric, curves)
            mlflow_client.log_artifact(run_id, str(curves), artifact_path="plots")
            if any(h.get("elapsed_s") is not None for h in history):
                plot_metric_vs_time(history, metric, timed, target)
                mlflow_client.log_artifact(run_id, str(timed), artifact_path="plots")
    except Exception as exc:
        log.warning("could not log the training curves: %s", exc)


class RankZeroLogger:
    """Rank 0's writer: system metrics, and after a resume the epochs MLflow missed. The epochs
    themselves are logged by Ray Train's controller (:mod:`pipeline.train.epoch_logger`)."""

    def __init__(self, tracking_uri: str, run_id: str, system_metrics: bool = True) -> None:
        self.tracking_uri, self.run_id = tracking_uri, run_id
        self.client = client(tracking_uri)
        self.monitor = None
        if system_metrics:
            try:
                from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

                self.monitor = SystemMetricsMonitor(run_id, resume_logging=True, tracking_uri=tracking_uri)
                self.monitor.start()
            except Exception as exc:  # system metrics are a nicety (psutil missing, ...)
                log.warning("system metrics disabled: %s", exc)
                self.monitor = None

    def resume(self, history: list[dict[str, Any]], epoch: int, why: str) -> int:
        """After the workers restored the checkpoint of ``epoch`` (-1: none) with ``history``: the run's segment.

        Where MLflow holds epochs after ``epoch`` (the later checkpoints were damaged, ``why``), those values
        stay and the epochs trained again log at the same steps: the run starts a new :data:`SEGMENT`, says
        so in :data:`FELL_BACK_TAG` and logs ``segment`` with each epoch's metrics in the same batch.
        Otherwise the epochs of ``history`` that MLflow missed are logged."""
        segments = self.client.get_metric_history(self.run_id, SEGMENT)
        segment = int(max(segments, key=lambda m: (m.timestamp, m.step)).value) if segments else 0
        current = segments if segments else self.client.get_metric_history(self.run_id, "epoch")
        logged = max((m.step for m in current if not segments or int(m.value) == segment), default=-1)
        if logged > epoch:
            import time

            segment += 1
            since = time.strftime("%Y-%m-%d %H:%M:%S")
            back = f"epoch {epoch}" if epoch >= 0 else "the start"
            epochs = f"epoch {logged}" if logged == epoch + 1 else f"epochs {epoch + 1}-{logged}"
            self.client.set_tag(self.run_id, FELL_BACK_TAG, (
                f"segment {segment} since {since}: went back from epoch {logged} to {back} ({why}); the values "
                f"logged for {epochs} before then (segment {segment - 1}) are superseded")[:5000])
            return segment
        for entry in history:
            if entry["epoch"] > logged:
                log_metrics(self.client, self.run_id, {**entry, SEGMENT: segment}, step=int(entry["epoch"]))
        return segment

    def close(self) -> None:
        if self.monitor is not None:
            with contextlib.suppress(Exception):
                self.monitor.finish()
            self.monitor = None


def subplots(*grid, **options):
    """matplotlib's ``plt.subplots`` without a display (the Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(*grid, **options)


def save_figure(fig, path: str | os.PathLike) -> None:
    """``fig`` written as a PNG, and closed."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_curves(history: list[dict[str, Any]], metric: str, path: str | os.PathLike) -> None:
    """Loss and train/val/test ``metric`` per epoch, as a PNG."""
    epochs = [h["epoch"] for h in history]
    fig, (ax_loss, ax_metric) = subplots(1, 2, figsize=(10, 4))
    ax_loss.plot(epochs, [h.get("train_loss") for h in history], marker="o", label="train loss")
    ax_loss.set_xlabel("epoch")
    ax_loss.set_ylabel("loss")
    ax_loss.legend()
    for split in ("train", "val", "test"):
        key = f"{split}_{metric}"
        points = [(h["epoch"], h[key]) for h in history if h.get(key) is not None]
        if points:
            ax_metric.plot(*zip(*points), marker="o", label=key)
    baseline = [h.get(f"constant_{metric}") for h in history if h.get(f"constant_{metric}") is not None]
    if baseline:
        ax_metric.axhline(baseline[-1], color="grey", linestyle="--", label="constant predictor")
    ax_metric.set_xlabel("epoch")
    ax_metric.set_ylabel(metric)
    ax_metric.legend()
    save_figure(fig, path)


def plot_metric_vs_time(history: list[dict[str, Any]], metric: str, path: str | os.PathLike,
                        target: Optional[dict[str, Any]] = None) -> None:
    """Validation and test ``metric`` against the run's wall-clock (``elapsed_s``: training and
    evaluation since the first step), the target as a line and the time it was reached, as a PNG."""
    fig, ax = subplots(figsize=(6, 4))
    for split in ("val", "test"):
        key = f"{split}_{metric}"
        points = [(h["elapsed_s"] / 60, h[key]) for h in history if h.get(key) is not None and h.get("elapsed_s") is not None]
        if points:
            ax.plot(*zip(*points), marker="o", label=key)
    if target is not None:
        ax.axhline(target["value"], color="red", linestyle=":", label=f"target {target['metric']} {target['value']:g}")
        reached = [h for h in history if h.get("time_to_target_s") is not None]
        if reached:
            ax.axvline(reached[0]["time_to_target_s"] / 60, color="red", alpha=0.4,
                       label=f"reached after {reached[0]['time_to_target_s'] / 60:.1f} min")
    ax.set_xlabel("wall-clock of training and evaluation (min)")
    ax.set_ylabel(metric)
    ax.legend()
    save_figure(fig, path)
