"""Reruns are explicit and honest (pipeline.train.rerun), end to end on the shared local Ray cluster.

One run name goes through what a user does to it: train; run the same job again (nothing is
trained or registered, its model is named); change the learning rate or the model (refused in
seconds, before Ray Train starts, naming what differs and the two ways on; nothing about the run
changes); raise the epochs and fail (the run behind the registered version stays FINISHED);
start it over with ``--restart`` (a new MLflow run, and the new version records the
configuration, data hash and commit of the weights it holds).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers import tiny_data, tiny_job_dict

NAME = "sat-rerun"


@pytest.fixture(scope="module")
def tiny(ray_cluster, tmp_path_factory):
    base = tmp_path_factory.getbasetemp() / "satp-tiny"  # the tiny job's data and shards, if built
    base.mkdir(exist_ok=True)
    return base, tiny_data(base)


def _values(base: Path, storage: Path, **train) -> dict:
    train = {"run_name": "rerun", "epochs": 1, "train_subset": 300, "eval_subset": 100,
             "storage_path": str(storage / "ray"), **train}
    values = tiny_job_dict(base, **train)
    values["resources"]["num_workers"] = 1
    values["mlflow"] |= {"tracking_uri": f"sqlite:///{storage / 'mlflow.db'}", "registered_model": NAME}
    return values


def _job(values: dict):
    from pipeline.config import JobConfig

    return JobConfig.model_validate(values)


@pytest.mark.ray
@pytest.mark.slow
def test_rerun_is_explicit_and_honest(tiny, tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    from pipeline.cli import main
    from pipeline.registry.versions import load_model
    from pipeline.train.checkpoint import CheckpointManager
    from pipeline.train.rerun import RerunConflict
    from pipeline.train.driver import train_job

    base, shards = tiny
    values = _values(base, tmp_path)
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(values))
    client = MlflowClient(values["mlflow"]["tracking_uri"])
    run_dir = tmp_path / "ray" / "rerun"

    first = train_job(_job(values), shard_dir=shards)
    assert first.trained and first.registered["version"] == 1
    checkpoint = CheckpointManager(run_dir).newest_intact()

    # the same job again: nothing trains, nothing is registered, the model is named
    assert main(["train", str(job_file)]) == 0
    out = capsys.readouterr().out
    assert "had finished with this configuration" in out and "nothing registered again" in out
    assert f"its model: models:/{NAME}/1" in out
    assert len(client.search_model_versions(f"name='{NAME}'")) == 1
    assert CheckpointManager(run_dir).newest_intact() == checkpoint
    assert client.get_run(first.mlflow_run_id).info.status == "FINISHED"

    # another configuration: refused before Ray Train starts, one line naming what differs
    for override, differs in (("train.lr=0.01", "train.lr 0.003 -> 0.01"), ("model.hidden_dim=64", "model.hidden_dim 32 -> 64")):
        start = time.monotonic()
        assert main(["train", str(job_file), "--set", override]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("satp: error: run 'rerun'"), err
        assert differs in err[0] and "--set train.run_name=rerun-2" in err[0] and "--restart" in err[0]
        assert time.monotonic() - start < 60
    assert CheckpointManager(run_dir).newest_intact() == checkpoint
    assert client.get_run(first.mlflow_run_id).info.status == "FINISHED"
    assert len(client.search_model_versions(f"name='{NAME}'")) == 1

    # a continuation (more epochs: allowed) that fails leaves the run behind v1 FINISHED
    marker = tmp_path / "killed"
    with pytest.raises(Exception) as failed:
        train_job(_job(_values(base, tmp_path, epochs=2, max_failures=0)), shard_dir=shards,
                  fault={"rank": 0, "epoch": 1, "step": 1, "marker": str(marker)})
    assert marker.exists(), failed.value
    run = client.get_run(first.mlflow_run_id)
    assert run.info.status == "FINISHED" and run.data.tags["satp.last_attempt"].startswith("failed")
    assert str(client.get_model_version_by_alias(NAME, "champion").version) == "1"

    # --restart: the run name starts over in a new MLflow run; the old run keeps its status
    with pytest.raises(RerunConflict):
        train_job(_job(_values(base, tmp_path, lr=0.01)), shard_dir=shards)
    again = train_job(_job(_values(base, tmp_path, lr=0.01)), shard_dir=shards, restart=True)
    assert again.trained and again.mlflow_run_id != first.mlflow_run_id
    old = client.get_run(first.mlflow_run_id)
    assert old.info.status == "FINISHED" and "satp.retired" in old.data.tags
    assert again.registered["version"] == 2

    # each version records the configuration, data hash and commit of the weights it holds
    state = json.loads((run_dir / CheckpointManager(run_dir).newest_intact() / "state.json").read_text())
    v1, v2 = load_model(f"models:/{NAME}/1", values["mlflow"]["tracking_uri"]), load_model(
        f"models:/{NAME}/2", values["mlflow"]["tracking_uri"])
    assert v1.info["job"]["train"]["lr"] == 0.003 and v2.info["job"]["train"]["lr"] == 0.01
    assert v2.info["provenance"]["config_hash"] == state["provenance"]["config_hash"]
    assert v1.info["provenance"]["config_hash"] != v2.info["provenance"]["config_hash"]
    tags = client.get_model_version(NAME, "2").tags
    assert tags["satp.config_hash"] == state["provenance"]["config_hash"]
    assert tags["git_commit"] == state["provenance"]["git_commits"][-1]
    assert tags["data_manifest_hash"] == state["provenance"]["config"]["data"]["config_hash"]

    # raising train.epochs continues the run: a version only for weights none of the run's
    # versions holds (the best epoch may stay 0: then v2 is the answer), params noted as changed
    more = train_job(_job(_values(base, tmp_path, lr=0.01, epochs=2)), shard_dir=shards)
    assert more.trained and more.mlflow_run_id == again.mlflow_run_id
    expected = 3 if more.best["epoch"] == 1 else 2
    assert more.registered["version"] == expected
    assert len(client.search_model_versions(f"name='{NAME}'")) == expected
    assert client.get_run(more.mlflow_run_id).data.tags["satp.param.train.epochs"] == "2 (was 1)"


def test_what_a_resumed_run_may_change():
    """The hash covers what shapes the weights; bookkeeping keys stay out of it; a setting added
    after a checkpoint was written, at its default, is no difference."""
    from pipeline.train.rerun import RESUMABLE_TRAIN_KEYS, differences, default_config
    from pipeline.config.train import TrainConfig

    assert {"epochs", "eval_every", "max_failures", "run_name", "storage_path", "checkpoint_every_steps",
            "preemption_check_steps"} <= RESUMABLE_TRAIN_KEYS
    assert not {"lr", "seed", "node_budget", "micro_batches_per_step", "precision", "zero_stage",
                "eval_subset"} & RESUMABLE_TRAIN_KEYS  # the global batch shapes the weights; the worker count does not
    assert set(RESUMABLE_TRAIN_KEYS) <= set(TrainConfig.model_fields)
    defaults = default_config()
    old = {"model": {"hidden_dim": 32}, "train": {"lr": 0.003}}
    newer = {"model": {"hidden_dim": 32, "dropout": defaults["model"]["dropout"]}, "train": {"lr": 0.003}}
    assert differences(old, newer, defaults=defaults) == []  # "dropout" as if added to satp since
    assert differences(old, {"model": {"hidden_dim": 64}, "train": {"lr": 0.003}}, defaults=defaults) == [
        "model.hidden_dim 32 -> 64"]
