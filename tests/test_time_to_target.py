"""Time to a quality target and early stopping (:mod:`pipeline.train.stopping`).

The rules on made-up histories, then one real run on the shared local Ray cluster (2 CPU workers
+ DeepSpeed, MLflow on SQLite) that stops at its target, and a real MLflow server started on that
store, from which the time-to-target metrics and the plots are read back through the REST API.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from pipeline.train import stopping
from pipeline.config.train import TargetConfig, TrainConfig
from runtime.ports import free_ports
from tests.helpers import tiny_data, tiny_job


def _history(values: list[float], key: str = "val_f1") -> list[dict]:
    return [{"epoch": i, key: v, "elapsed_s": 10.0 * (i + 1), "steps": 7 * (i + 1)} for i, v in enumerate(values)]


def test_time_to_target_is_the_first_epoch_that_meets_it():
    history = _history([0.1, 0.2, 0.35, 0.3, 0.4])
    reached = stopping.time_to_target(history, TargetConfig(metric="val_f1", value=0.3), "max")
    assert reached == {"time_to_target_s": 30.0, "steps_to_target": 21, "epochs_to_target": 3, "epoch": 2}
    assert stopping.time_to_target(history, TargetConfig(metric="val_f1", value=0.5), "max") is None
    # a metric to minimise meets its target from above
    losses = _history([0.9, 0.5, 0.2], key="val_loss")
    assert stopping.time_to_target(losses, TargetConfig(metric="val_loss", value=0.5), "min")["epoch"] == 1


def test_stop_reason_target_then_plateau():
    train = TrainConfig(epochs=20, target=TargetConfig(metric="val_f1", value=0.3), patience=2)
    assert stopping.stop_reason(_history([0.1, 0.2]), train, "f1", "max") is None
    assert "target val_f1 >= 0.3 reached at epoch 2" in stopping.stop_reason(_history([0.1, 0.2, 0.31]), train, "f1", "max")
    # two evaluations after the best (0.25) without a better one; a tie is no improvement
    plateaued = _history([0.1, 0.25, 0.25, 0.2])
    assert stopping.stop_reason(plateaued, train, "f1", "max") == "no better val_f1 in 2 evaluations (plateau)"
    assert stopping.stop_reason(plateaued[:3], train, "f1", "max") is None
    # epochs without an evaluation (eval_every > 1) count for neither rule
    sparse = [{"epoch": 0, "val_f1": 0.2}, {"epoch": 1}, {"epoch": 2, "val_f1": 0.1}]
    assert stopping.stop_reason(sparse, train, "f1", "max") is None
    assert stopping.stop_reason(_history([0.9, 0.1, 0.1]), TrainConfig(), "f1", "max") is None  # no rules


def test_stopped_within_reads_the_rules_against_a_whole_history():
    history = _history([0.1, 0.32, 0.33])
    low = TrainConfig(epochs=20, target=TargetConfig(metric="val_f1", value=0.3))
    high = TrainConfig(epochs=20, target=TargetConfig(metric="val_f1", value=0.5))
    assert "reached at epoch 1" in stopping.stopped_within(history, low, "f1", "max")
    assert stopping.stopped_within(history, high, "f1", "max") is None


def test_a_target_must_name_a_metric_the_task_reports():
    with pytest.raises(ValueError, match=r"train.target.metric 'val_acc': this task reports train_f1, val_f1, test_f1"):
        stopping.check_target(TargetConfig(metric="val_acc", value=0.5), "f1")
    stopping.check_target(TargetConfig(metric="test_f1", value=0.5), "f1")


# ------------------------------------------------------------------ a real run and a real server
TARGET = 1e-6  # any validation F1 above zero: the tiny job gets there within its first epochs


@pytest.fixture(scope="module")
def stopped_run(ray_cluster, tmp_path_factory):
    """The tiny code2 job with 8 epochs and a target it reaches long before: trained once."""

    base = tmp_path_factory.getbasetemp() / "satp-tiny"
    base.mkdir(exist_ok=True)
    tiny_data(base)
    from pipeline.train.driver import train_job

    job = tiny_job(base, epochs=8, run_name="to-target", target={"metric": "val_f1", "value": TARGET})
    started = time.monotonic()
    outcome = train_job(job)
    outcome.wall_s = time.monotonic() - started  # the whole call: start-up, preprocessing, registration
    return job, outcome


@pytest.mark.ray
@pytest.mark.slow
def test_a_run_stops_at_its_target_and_reports_the_time_to_it(stopped_run):
    from pipeline.cli.train_commands import summary

    job, outcome = stopped_run
    history = outcome.history
    last = history[-1]
    assert last["epoch"] < job.train.epochs - 1, "the target stops the run before its epochs"
    assert last["val_f1"] >= TARGET and all(h["val_f1"] < TARGET for h in history[:-1])
    assert outcome.stopped.startswith(f"target val_f1 >= {TARGET:g} reached at epoch {last['epoch']}")
    reached = outcome.time_to_target
    assert reached["epoch"] == last["epoch"] and reached["epochs_to_target"] == last["epoch"] + 1
    # wall-clock: at least the epochs' training and evaluation, at most the whole call
    trained = sum(h["epoch_seconds"] + h.get("eval_seconds", 0.0) for h in history)
    assert trained <= reached["time_to_target_s"] < outcome.wall_s
    assert reached["steps_to_target"] == last["steps"] > 0
    assert outcome.registered["version"] >= 1, "a run stopped at its target registers its model"
    text = summary(outcome)
    assert f"target val_f1 {TARGET:g} reached after" in text and "stopped early: target" in text


@pytest.mark.ray
@pytest.mark.slow
def test_a_rerun_of_a_stopped_run_is_finished_and_a_higher_target_continues_it(stopped_run):
    from pipeline.train import rerun
    from pipeline.train.driver import train_job
    from pipeline.train.plan import JobPlan

    job, outcome = stopped_run
    again = train_job(job)
    assert not again.trained and again.time_to_target == outcome.time_to_target
    assert again.registered["version"] == outcome.registered["version"]
    higher = job.model_copy(deep=True)
    higher.train.target.value = 0.99
    decision = JobPlan.resolve(higher).examine().with_shards(rerun.job_shard_dir(higher)).decision()
    assert decision.action == "resume", "a target the run has not reached leaves epochs to train"


@pytest.fixture(scope="module")
def mlflow_server(stopped_run):
    """A real MLflow tracking server over the run's SQLite store, bound to 127.0.0.1."""
    job, _ = stopped_run
    port = free_ports(1)[0]
    store = job.mlflow.tracking_uri
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", store, "--host", "127.0.0.1",
         "--port", str(port), "--workers", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "MLFLOW_TRACKING_URI": ""})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"mlflow server on {url} did not start (exit {proc.poll()})")
                time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _get(url: str, endpoint: str, **params) -> bytes:
    with urllib.request.urlopen(f"{url}{endpoint}?{urllib.parse.urlencode(params)}", timeout=30) as response:
        return response.read()


@pytest.mark.ray
@pytest.mark.slow
def test_time_to_target_and_plots_read_back_through_the_rest_api(stopped_run, mlflow_server):
    _, outcome = stopped_run
    run = json.loads(_get(mlflow_server, "/api/2.0/mlflow/runs/get", run_id=outcome.mlflow_run_id))["run"]
    metrics = {m["key"]: m["value"] for m in run["data"]["metrics"]}
    tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
    reached = outcome.time_to_target
    assert metrics["time_to_target_s"] == pytest.approx(reached["time_to_target_s"])
    assert metrics["steps_to_target"] == reached["steps_to_target"]
    assert metrics["epochs_to_target"] == reached["epochs_to_target"]
    assert tags["satp.target"] == f"val_f1 {TARGET:g}" and tags["satp.stopped"] == outcome.stopped
    # the curve against wall-clock, one point per epoch
    curve = json.loads(_get(mlflow_server, "/api/2.0/mlflow/metrics/get-history", run_id=outcome.mlflow_run_id,
                            metric_key="elapsed_s"))["metrics"]
    assert [m["step"] for m in curve] == [h["epoch"] for h in outcome.history]
    listed = json.loads(_get(mlflow_server, "/api/2.0/mlflow/artifacts/list", run_id=outcome.mlflow_run_id,
                             path="plots"))["files"]
    names = {Path(f["path"]).name for f in listed}
    assert {"metric_vs_time.png", "training_curves.png"} <= names
    png = _get(mlflow_server, "/get-artifact", path="plots/metric_vs_time.png", run_uuid=outcome.mlflow_run_id)
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
