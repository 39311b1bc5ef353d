"""A training run's MLflow history after a fall-back and after a failed continuation, on a real SQLite
store, at the level of the code that writes it (no Ray): the end-to-end case is
``tests/test_faults_training.py::test_a_damaged_checkpoint_is_named_and_the_newest_intact_one_resumed``.

* After resuming from an older checkpoint because the newest was damaged, the retrained epochs
  were logged again at the same steps, and nothing said which of two ``val_f1`` values of epoch 1 was
  current. Now the run says that it went back (from which epoch to which, why, since when:
  ``satp.fell_back``) and every epoch's metrics carry ``segment`` in the same batch.
* ``satp.last_attempt = failed ...`` stayed on a run after a later continuation finished.
"""
from __future__ import annotations

import dataclasses

import pytest

from tests.helpers import new_run, sqlite_store, tiny_job_dict


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return sqlite_store(tmp_path_factory.mktemp("history"))  # creating a store takes seconds: one per module


@pytest.fixture
def run(store):
    uri, exp_id = store
    return uri, new_run(uri, exp_id)


def _epoch(epoch: int, val: float) -> dict:
    return {"epoch": epoch, "train_loss": 1.0 / (epoch + 1), "val_f1": val}


def _controller_logs(client, run_id: str, entry: dict, segment: int) -> None:
    """What Ray Train's controller logs for a registered epoch: rank 0's reported metrics (segment included)."""
    from pipeline.registry.tracking import log_metrics

    log_metrics(client, run_id, {**entry, "segment": segment}, step=entry["epoch"])


def test_a_fall_back_is_recorded_and_each_value_names_its_segment(run):
    from pipeline.registry.tracking import FELL_BACK_TAG, RankZeroLogger

    uri, run_id = run
    logger = RankZeroLogger(uri, run_id, system_metrics=False)
    first = [_epoch(0, 0.02), _epoch(1, 0.0503), _epoch(2, 0.06)]
    assert logger.resume([], -1, "") == 0  # a fresh run
    for entry in first:
        _controller_logs(logger.client, run_id, entry, 0)
    # the checkpoints of epochs 1 and 2 damaged: the workers restore epoch 0 and train epochs 1-2 again
    assert logger.resume(first[:1], 0, "the checkpoint of epoch 2 (checkpoint_b): cut short") == 1
    tag = logger.client.get_run(run_id).data.tags[FELL_BACK_TAG]
    assert tag.startswith("segment 1 since ") and "went back from epoch 2 to epoch 0 (the checkpoint of epoch 2 " \
                                                 "(checkpoint_b): cut short)" in tag, tag
    assert "the values logged for epochs 1-2 before then (segment 0) are superseded" in tag, tag
    again = [first[0], _epoch(1, 0.0943), _epoch(2, 0.1)]
    for entry in again[1:]:
        _controller_logs(logger.client, run_id, entry, 1)

    values = logger.client.get_metric_history(run_id, "val_f1")
    segments = {(m.step, m.timestamp): int(m.value) for m in logger.client.get_metric_history(run_id, "segment")}
    by_segment = {(m.step, segments[(m.step, m.timestamp)]): m.value for m in values}
    assert by_segment == {(0, 0): 0.02, (1, 0): 0.0503, (2, 0): 0.06, (1, 1): 0.0943, (2, 1): 0.1}

    # a later resume of the current trajectory is no fall-back; it catches up an epoch MLflow missed
    assert logger.resume(again + [_epoch(3, 0.11)], 3, "") == 1
    assert logger.client.get_run(run_id).data.tags[FELL_BACK_TAG] == tag
    (missed,) = [m for m in logger.client.get_metric_history(run_id, "val_f1") if m.step == 3]
    assert missed.value == 0.11
    assert [int(m.value) for m in logger.client.get_metric_history(run_id, "segment") if m.step == 3] == [1]


def test_a_continuation_that_finishes_clears_the_failed_attempt(run, tmp_path):
    from pipeline.config import JobConfig
    from pipeline.train import mlflow_run
    from pipeline.train.plan import JobPlan
    from pipeline.train.worker_setup import WorkerSetup

    uri, run_id = run
    values = tiny_job_dict(tmp_path)
    values["mlflow"]["tracking_uri"] = uri
    plan = JobPlan.resolve(JobConfig.model_validate(values))
    plan = dataclasses.replace(plan, setup=WorkerSetup(job=plan.job, shard_dir=str(tmp_path), model_config={},
                                                       task_name="code2", task_state={}, run_id=run_id))
    client = mlflow_run.tracking.client(uri)
    mlflow_run.close_finished(plan, {"epoch": 1})
    assert mlflow_run.LAST_ATTEMPT not in client.get_run(run_id).data.tags  # nothing to say after a plain finish

    client.update_run(run_id, "RUNNING")  # a continuation with more epochs, which fails
    mlflow_run.close_failed(plan, "FINISHED", RuntimeError("worker died"))
    failed = client.get_run(run_id)
    assert failed.info.status == "FINISHED" and failed.data.tags[mlflow_run.LAST_ATTEMPT].startswith("failed ")

    client.update_run(run_id, "RUNNING")  # the next continuation finishes
    mlflow_run.close_finished(plan, {"epoch": 3})
    done = client.get_run(run_id)
    assert done.info.status == "FINISHED"
    assert done.data.tags[mlflow_run.LAST_ATTEMPT].startswith("finished ") and "(epoch 3)" in done.data.tags[
        mlflow_run.LAST_ATTEMPT]
