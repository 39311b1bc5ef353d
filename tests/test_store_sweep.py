"""A sweep on an object store (a real S3 API server: moto on loopback, :mod:`s3_server`): its shards,
Tune's state, its trials' Train runs and checkpoints and its one-writer lease all in the bucket.

``satp tune`` is killed (SIGKILL, no clean-up of any kind) once a trial has a checkpoint there; the
same command then takes the dead command's lease over, resumes the sweep from what the bucket holds
and finishes it: every trial's epochs counted once in its Train history and in its MLflow child run,
one parent run, the best trial registered. Nothing is written into the working folder but the
command's logs.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import Drain, satp_env, satp_lines, tiny_job_dict, tracebacks, wait_until
from tests.s3_server import s3_server  # noqa: F401  (the session's server, a fixture)

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]


def test_a_killed_sweep_resumes_from_the_bucket(s3_server, tiny_setting, tmp_path):
    from mlflow.tracking import MlflowClient

    from pipeline.train.checkpoint import CheckpointManager

    base, address = tiny_setting
    tune_root = s3_server.prefix("tune")
    values = tiny_job_dict(base, epochs=3, train_subset=300, eval_subset=100)
    values["shards"]["root"] = s3_server.prefix("shards")
    values["resources"] |= {"num_workers": 1, "cpus_per_worker": 1}
    values["mlflow"] |= {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "registered_model": "sat-store-sweep"}
    values["tune"] = {"name": "s", "storage_path": tune_root, "num_samples": 1, "metric": "val_f1", "mode": "max",
                      "max_concurrent_trials": 1, "asha": {"grace_period": 3, "max_epochs": 3},
                      "space": {"train.lr": {"grid": [3e-3, 1e-3]}}}
    job = tmp_path / "sweep.yaml"
    job.write_text(yaml.safe_dump(values))
    work = tmp_path / "work"
    work.mkdir()
    command = [sys.executable, "-m", "pipeline.cli", "tune", str(job), "--no-progress", "--address", address]
    client, (bucket, prefix) = s3_server.client(), tune_root.removeprefix("s3://").split("/", 1)

    def keys() -> list[str]:
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/s/")
        return [o["Key"] for page in pages for o in page.get("Contents", [])]

    def trial_checkpointed() -> bool:  # a trial's checkpoint registered, and Tune's state saved, in the bucket
        names = keys()
        return any("experiment_state" in k for k in names) and any(
            k.endswith("/checkpoint_manager_snapshot.json") and json.loads(client.get_object(
                Bucket=bucket, Key=k)["Body"].read()).get("latest_checkpoint_result") for k in names)

    first = subprocess.Popen(command, cwd=work, env=satp_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)
    drained = Drain(first)
    try:
        wait_until(trial_checkpointed, "a trial's checkpoint in the bucket", timeout=600, proc=first, every=1.0)
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    assert f"{tune_root}/s/satp-lease.json" in [f"s3://{bucket}/{k}" for k in keys()]  # left by the killed command

    second = subprocess.run(command, cwd=work, env=satp_env(), capture_output=True, text=True, timeout=900)
    err = second.stderr
    assert second.returncode == 0, drained.text[-2000:] + err[-4000:]
    assert not tracebacks(err), err[-4000:]
    (taken,) = [line for line in satp_lines(err, "warning") if "satp-lease.json" in line]
    assert taken.startswith(f"satp: warning: {tune_root}/s/satp-lease.json: the lease of sweep 's' held by satp tune"), taken
    assert "sweep s (resumed): 2 trials" in second.stdout, second.stdout
    assert not list(work.rglob("s3:*")) and not list(work.rglob("checkpoint_*"))  # all of it in the bucket

    mlflow = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = mlflow.search_runs([mlflow.get_experiment_by_name("tiny").experiment_id])
    (parent,) = [r for r in runs if r.data.tags.get("satp.kind") == "sweep"]
    assert parent.info.status == "FINISHED" and parent.data.tags.get("satp.registered_uri") == "models:/sat-store-sweep/1"
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(children) == 2 and len(runs) == 3
    for child in children:  # each epoch once, as the trial's Train run recorded it in its checkpoint
        checkpoints = CheckpointManager(f"{tune_root}/s/train/s-{child.data.tags['satp.trial_id']}")
        history = checkpoints.state(checkpoints.newest_intact())["history"]
        assert [h["epoch"] for h in history] == [0, 1, 2]
        assert sorted(m.step for m in mlflow.get_metric_history(child.info.run_id, "val_f1")) == [0, 1, 2]
