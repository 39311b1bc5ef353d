"""The MLflow side of one training run, in the driver: open (or find again) its run, close it, tag
how it stopped, and log and register the best model with its [CLS] attention plot. Ray Train's
controller logs the epochs (:mod:`pipeline.train.epoch_logger`). Every function reads the run's
:class:`~pipeline.train.plan.JobPlan`.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import torch

from pipeline.registry import tracking
from pipeline.registry.empty_store import database_path
from pipeline.train.loader import open_split
from pipeline.train.plan import JobPlan
from pipeline.train.engine import build_model
from preprocessing.write_errors import FULL
from sat.config import SATConfig

log = logging.getLogger(__name__)

LAST_ATTEMPT = "satp.last_attempt"  # how the last attempt to continue a FINISHED run ended (close_failed)


def check_tracking_store(plan: JobPlan) -> None:
    """Stop in one line (a ``ValueError``) when the tracking store cannot be read, or does not know
    the MLflow run that the run's checkpoints log to (``plan.previous``'s ``mlflow_run_id``): a store
    deleted or replaced since (MLflow would silently create a SQLite file again, empty), into which
    the resumed run would log without its history. Runs before Ray starts."""
    from mlflow.exceptions import MlflowException

    uri, previous = plan.job.mlflow.tracking_uri, plan.previous
    run_id = previous.state.get("mlflow_run_id") if previous is not None else None
    database = database_path(uri)
    if run_id and database is not None and not database.exists():
        missing = f"the database {database} does not exist (deleted or moved?)"
    else:
        try:
            client = tracking.client(uri)
            if not run_id:
                client.search_experiments(max_results=1)
                return
            client.get_run(run_id)
            return
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise ValueError(_unreadable(uri, exc)) from None
            missing = f"it holds no MLflow run {run_id} (another or a new database?)"
        except Exception as exc:  # the database itself: SQLAlchemy's and sqlite3's errors
            raise ValueError(_unreadable(uri, exc)) from None
    raise ValueError(
        f"mlflow.tracking_uri: {uri}: {missing}, and the checkpoints of run {plan.job.train.run_name!r} (epoch "
        f"{previous.epoch}, {previous.checkpoint}) log to MLflow run {run_id}: nothing was trained or registered and "
        "the checkpoints are kept; restore the database (or point mlflow.tracking_uri at the store that has that run), "
        "or pass --restart to train the run over into this store (its checkpoints are deleted)")


@contextlib.contextmanager
def writing(plan: JobPlan, doing: str, outcome: str, rerun: str = "run the same command") -> Iterator[None]:
    """MLflow's errors while ``doing`` as one line, with the advice its cause asks for (``outcome``: what
    that leaves of the run; ``rerun``: what to do once fixed): a full disk (an ``OSError`` naming the
    file or folder), a failed tracking server or any other error of the store (a ``ValueError``)."""
    from mlflow.exceptions import MlflowException

    uri = plan.job.mlflow.tracking_uri
    store_log = logging.getLogger("mlflow.store.db.utils")  # logs each database error with a traceback, then raises it
    level = store_log.level
    store_log.setLevel(logging.CRITICAL)
    try:
        yield
    except (OSError, MlflowException) as exc:
        failed = tracking.server_failure(uri, exc)
        if failed:
            raise ValueError(f"mlflow.tracking_uri: {uri}: the tracking server failed while {doing} ({failed}); "
                             f"{outcome}: check the server and its artifact store (the server's log says what failed), "
                             f"then {rerun}") from None
        if isinstance(exc, OSError):
            if exc.errno not in FULL:
                raise
            artifacts = tracking.artifact_location(uri)
            where = exc.filename or (artifacts[len("file://"):] if artifacts else f"mlflow.tracking_uri: {uri}")
            error = OSError(f"{where}: the disk is full (No space left on device) while {doing}; {outcome}: free "
                            f"space there and {rerun}")
            error.errno = exc.errno
            raise error from None
        if "disk is full" in str(exc):  # SQLite: "database or disk is full"
            error = OSError(f"{database_path(uri) or f'mlflow.tracking_uri: {uri}'}: the disk is full (database or disk "
                            f"is full) while {doing}; {outcome}: free space there and {rerun}")
            error.errno = errno.ENOSPC
            raise error from None
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise ValueError(f"mlflow.tracking_uri: {uri}: {first} (while {doing}); {outcome}: fix the store and "
                         f"{rerun}") from None
    finally:
        store_log.setLevel(level)


def _unreadable(uri: str, exc: BaseException) -> str:
    kept = "nothing was trained or registered and the run's checkpoints are kept"
    failed = tracking.server_failure(uri, exc)
    if failed:
        return (f"mlflow.tracking_uri: {uri}: the tracking server cannot be read ({failed}); {kept}: check the server "
                "and its database (the server's log says what failed), or point mlflow.tracking_uri at another store")
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
    return (f"mlflow.tracking_uri: {uri}: the tracking store cannot be read ({first}); {kept}: restore the database "
            "from a copy, or point mlflow.tracking_uri at another store")


def open_run(plan: JobPlan, action: str) -> tuple[JobPlan, Optional[str]]:
    """Open the run's MLflow run; return the plan with it (``plan.setup.run_id``) and its status
    before (None: new). A fresh start never logs into an MLflow run that holds another training's
    history: it gets a new one (:func:`pipeline.registry.tracking.retire`)."""
    import yaml

    job, setup = plan.job, plan.setup
    uri = job.mlflow.tracking_uri
    with writing(plan, "opening the run's MLflow run", "nothing was trained"):
        existing = tracking.find_training_run(uri, job.mlflow.experiment, plan.run_key)
        if existing is not None and action in ("fresh", "restart") and (
                action == "restart" or existing.data.metrics or existing.info.status == "FINISHED"):
            why = ("run started over (--restart)" if action == "restart"
                   else "its checkpoints were gone: the run name started over")
            tracking.retire(tracking.client(uri), existing.info.run_id, tracking.RUN_KEY_TAG, plan.run_key, why)
            existing = None
        config_text = yaml.safe_dump(job.model_dump(mode="json"), sort_keys=False)
        params = dict(job.model_dump(mode="json"), model=setup.model_config, shard_dir=setup.shard_dir)
        run_id = tracking.open_run(uri, job.mlflow.experiment, plan.run_key, job.train.run_name, params, config_text)
        tracking.client(uri).set_tag(run_id, "satp.config_hash", setup.provenance["config_hash"])
    return plan.with_setup(run_id=run_id), existing.info.status if existing is not None else None


def close_failed(plan: JobPlan, previous_status: Optional[str], exc: BaseException) -> None:
    """A failed attempt marks its MLflow run FAILED, unless the run had FINISHED before: a failed
    continuation leaves it FINISHED (its registered versions are sound), with the failure tagged."""
    uri, run_id = plan.job.mlflow.tracking_uri, plan.setup.run_id
    with contextlib.suppress(Exception):  # the tracking store must not hide the training error
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if isinstance(exc, KeyboardInterrupt):
            first = f"interrupted ({first or 'SIGINT'})"
        client = tracking.client(uri)
        if previous_status == "FINISHED":
            client.set_tag(run_id, LAST_ATTEMPT, f"failed {time.strftime('%Y-%m-%d %H:%M:%S')}: {first}"[:500])
            client.set_terminated(run_id, status="FINISHED")
        else:
            client.set_terminated(run_id, status="KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED")


def close_finished(plan: JobPlan, state: dict) -> None:
    """A fit that succeeded: the MLflow run's tags (its target, an early stop, a ``satp.last_attempt``
    that said an earlier continuation failed), then the run FINISHED."""
    client = tracking.client(plan.job.mlflow.tracking_uri)
    run_id, target = plan.setup.run_id, plan.job.train.target
    if target is not None:
        client.set_tag(run_id, "satp.target", f"{target.metric} {target.value:g}")
    if state.get("stopped"):
        client.set_tag(run_id, "satp.stopped", str(state["stopped"])[:500])
    if LAST_ATTEMPT in client.get_run(run_id).data.tags:
        client.set_tag(run_id, LAST_ATTEMPT, f"finished {time.strftime('%Y-%m-%d %H:%M:%S')} (epoch {state['epoch']})")
    client.set_terminated(run_id, status="FINISHED")


def log_best_model(plan: JobPlan, state: dict, best_weights: dict) -> dict:
    """Log the best epoch's weights into the run, register them, and move the champion alias to
    them only if they beat its validation metric (the same rule as sweeps)."""
    from pipeline.registry.versions import default_model_name

    job, setup = plan.job, plan.setup
    log.info("logging the best model (epoch %s) to MLflow and registering it as %s", state["best"]["epoch"],
             default_model_name(job, plan.task.name))
    with writing(plan, f"registering the model of run {job.train.run_name!r}", "nothing was registered",
                 rerun="run the same command, which registers it then"):
        registered, model = register_weights(  # the configuration and code that trained them: the checkpoint's
            job, plan.task, {**state, "provenance": state.get("provenance") or setup.provenance}, best_weights,
            run_id=setup.run_id, shard_dir=setup.shard_dir, manifest_hash=plan.manifest.get("config_hash", ""),
            extra={"run_name": job.train.run_name, "job": job.model_dump(mode="json")})
    _log_attention_plot(plan, model)
    name = registered["registered_model"]
    if registered.get("reason"):  # these weights of this run were registered before
        log.info("%s: %s", name, registered["reason"])
    if os.environ.get("SATP_TEST_KILL_AT") == "registration":  # test hook: killed between the version and its alias
        os.kill(os.getpid(), signal.SIGKILL)
    registered.update(promote_version(plan, state, name, registered["version"]))
    return registered


def register_weights(job, task, state: dict, weights: dict, *, run_id: str, shard_dir: str, manifest_hash: str,
                     extra: dict) -> tuple[dict, torch.nn.Module]:
    """Register the best epoch's ``weights`` (``state``: their checkpoint's) of run ``run_id`` (a training
    run, a sweep's best trial) with what prediction needs to featurise new inputs (the transform and
    code2's node tables of ``shard_dir``); returns the registration and the model."""
    from pipeline.registry.predict import input_spec
    from pipeline.registry.versions import register

    config = SATConfig.from_dict(state["model_config"])
    model = build_model(config)
    model.load_state_dict(weights)
    model.eval()
    registered = register(model, job=job, task=task, model_config=config, state=state, run_id=run_id,
                          data_manifest_hash=manifest_hash,
                          extra={**extra, **input_spec(shard_dir, job.storage.settings())})
    return registered, model


def promote_version(plan: JobPlan, state: dict, name: str, version: int) -> dict:
    """Move the champion alias to ``version`` of ``name`` only if its validation metric beats the
    champion's (the rule of sweeps too); ``{"champion", "reason"}``."""
    from pipeline.registry.versions import CHAMPION, promote

    metric, mode = plan.task.metric, plan.task.mode
    return promote(tracking.client(plan.job.mlflow.tracking_uri), name, version, state["best"]["val"],
                   f"best_val_{metric}", mode, CHAMPION, f"run {plan.job.train.run_name}")


def _log_attention_plot(plan: JobPlan, model: torch.nn.Module) -> None:
    """[CLS] attention over one test graph's nodes, when the model has a [CLS] readout (best effort)."""
    if model.cls is None:
        return
    try:
        from torch_geometric.data import Batch

        test = open_split(plan.setup.shard_dir, "test", plan.job.storage.settings())
        sizes = np.asarray(test.num_nodes)
        index = int(np.argsort(sizes)[len(sizes) // 2])  # a median-size graph
        weights = model.cls_attention(Batch.from_data_list([test[index]]))[0].cpu().numpy()
        fig, ax = tracking.subplots(figsize=(8, 3))
        ax.bar(np.arange(len(weights)), weights)
        ax.set_xlabel("node (DFS order)")
        ax.set_ylabel("[CLS] attention")
        ax.set_title(f"test graph {index} ({len(weights)} nodes)")
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "cls_attention.png"
            tracking.save_figure(fig, path)
            tracking.client(plan.job.mlflow.tracking_uri).log_artifact(plan.setup.run_id, str(path), artifact_path="plots")
    except Exception as exc:  # interpretability plot: never fail a run over it
        log.info("no [CLS] attention plot: %s", exc)
