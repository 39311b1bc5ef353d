"""Two nodes without a shared file system, a bucket between them (a real S3 API server: moto on
loopback, :mod:`s3_server`).

A head node and a node B of 1 CPU each (:mod:`ray_nodes`), each with its own Ray temporary
folder, ``TMPDIR`` and ``HOME`` (so its own shard cache), none with the store's credentials: the
command's are forwarded. MLflow is a tracking server whose artifacts live in the bucket
(``mlflow server --artifacts-destination s3://...``). ``satp train``, run from a third folder
with ``shards.root`` and ``train.storage_path`` in the bucket, builds the shards there, trains with
one worker per node (an elastic run of 1 to 2 workers, as ``jobs/code2.yaml``), loses node B
(SIGKILL to all its processes) after its first checkpoint, goes on with one worker on the head from
the bucket, and registers its model into the bucket through the server.
``satp predict models:/...`` then runs from another working directory and home with nothing but
the tracking server's address: no store credentials, no file of the training
(``MLFLOW_ENABLE_PROXY_MULTIPART_DOWNLOAD=false``: without it MLflow's client fetches files over the
server's presigned URLs, straight from the store, which moto's signature checks refuse). No run
folder exists on any node's disk.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.s3_server import s3_server  # noqa: F401  (the session's server, a fixture)
from tests.helpers import PREDICT_SOURCE, satp_lines, tiny_job_dict, wait_until
from tests.mlflow_servers import start, stop
from tests.ray_nodes import local_cluster

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tracking_server(s3_server, tmp_path_factory):
    """A tracking server (SQLite for runs and the registry), its artifacts under an ``s3://`` prefix."""
    from pipeline.registry import empty_store

    tmp = tmp_path_factory.mktemp("tracking-server")
    database = f"sqlite:///{tmp / 'mlflow.db'}"
    empty_store.seed(database)
    artifacts = s3_server.prefix("mlartifacts")
    # the server's boto3 reads the standard variables; MLflow also names the endpoint in its own variable
    proc, url = start(["server", "--backend-store-uri", database, "--artifacts-destination", artifacts,
                       "--workers", "1"], tmp / "server.log", {**s3_server.env(), "MLFLOW_S3_ENDPOINT_URL": s3_server.url})
    yield url, artifacts
    stop(proc)


@pytest.fixture(scope="module")
def cluster(s3_server):
    nodes_env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}  # the nodes know no store
    with local_cluster(nodes_env, head_cpus=1, own_folders=True) as nodes:
        yield nodes


def _keys(server, uri: str) -> list[str]:
    bucket, prefix = uri.removeprefix("s3://").split("/", 1)
    pages = server.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
    return [o["Key"][len(prefix) + 1:] for page in pages for o in page.get("Contents", [])]


def test_a_run_on_two_nodes_and_a_bucket_survives_a_lost_node_registers_and_predicts(
        s3_server, tracking_server, cluster, tmp_path, tmp_path_factory):
    from mlflow.tracking import MlflowClient

    from pipeline.config import JobConfig
    from preprocessing.sources import ensure_dataset

    url, artifacts = tracking_server
    shards, runs = s3_server.prefix("shards"), s3_server.prefix("runs")
    tiny_base = tmp_path_factory.getbasetemp() / "satp-tiny"
    tiny_base.mkdir(exist_ok=True)
    values = tiny_job_dict(tiny_base, epochs=3, run_name="two-nodes", max_failures=3, storage_path=runs)
    values["data"]["max_graphs_per_split"] = 240
    values["shards"] |= {"root": shards, "graphs_per_shard": 120}
    values["resources"] |= {"num_workers": [1, 2], "cpus_per_worker": 1}
    values["mlflow"] |= {"tracking_uri": url, "registered_model": "sat-two-nodes"}
    ensure_dataset(JobConfig.model_validate(values).data)  # the raw layout (no Ray), shared with other tests
    driver = tmp_path / "driver"
    (driver / "home").mkdir(parents=True)
    job = driver / "job.yaml"
    job.write_text(yaml.safe_dump(values))

    node_b = cluster["add_node"]()
    env = {**cluster["env"], **s3_server.env(), "HOME": str(driver / "home"), "PYTHONPATH": str(ROOT)}
    log = tmp_path / "train.log"
    train = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "train", str(job), "--no-progress", "--address",
                              cluster["address"]], env=env, cwd=driver, stdout=log.open("w"), stderr=subprocess.STDOUT)
    bucket, prefix = runs.removeprefix("s3://").split("/", 1)

    def first_checkpoint() -> bool:
        try:
            body = s3_server.client().get_object(Bucket=bucket, Key=f"{prefix}/two-nodes/checkpoint_manager_snapshot.json")
        except s3_server.client().exceptions.NoSuchKey:
            return False
        return bool(json.loads(body["Body"].read()).get("latest_checkpoint_result"))

    wait_until(lambda: node_b.running("ray::RayTrainWorker"), "a Train worker on node B", proc=train, every=0.5)
    wait_until(first_checkpoint, "the first checkpoint in the bucket", proc=train, every=0.5)
    assert node_b.running("ray::RayTrainWorker")
    node_b.kill()
    train.wait(timeout=600)
    text = log.read_text()
    assert train.returncode == 0, text[-4000:]
    assert "resumed at global step" in text  # the worker group started again from a checkpoint in the bucket
    assert "registered model: models:/sat-two-nodes/1" in text and not satp_lines(text, "error"), text[-4000:]

    # the shards, the checkpoints and the model's files are objects of the bucket, on no node's disk
    assert "manifest.json" in {key.rsplit("/", 1)[-1] for key in _keys(s3_server, shards)}
    from pipeline.train.checkpoint import CheckpointManager

    manager = CheckpointManager(f"{runs}/two-nodes")
    state = manager.state(manager.newest_intact())
    assert [h["epoch"] for h in state["history"]] == [0, 1, 2]
    assert any(key.endswith("/MLmodel") for key in _keys(s3_server, artifacts))
    for disk in (driver, cluster["base"]):
        assert not list(disk.rglob("checkpoint_*")) and not list(disk.rglob("s3:")), disk
    for node in (cluster["head"], node_b):  # each node cached the shards it read, in its own home
        assert list((node.folder / "home" / ".cache" / "satp" / "shards").glob("*.arrow")), node.folder

    client = MlflowClient(url)
    runs_found = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
    assert len(runs_found) == 1 and runs_found[0].info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(runs_found[0].info.run_id, "train_loss")) == [0, 1, 2]

    # ---- satp predict on another machine: its own folder and home, only the tracking server's address
    elsewhere = tmp_path / "another-node"
    elsewhere.mkdir()
    (elsewhere / "mymodule.py").write_text(PREDICT_SOURCE)
    plain = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "MLFLOW_"))}
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", "predict", "models:/sat-two-nodes/1", "mymodule.py",
                           "--json"], cwd=elsewhere, capture_output=True, text=True, timeout=300,
                          env={**plain, "HOME": str(elsewhere), "PYTHONPATH": str(ROOT), "MLFLOW_TRACKING_URI": url,
                               "MLFLOW_ENABLE_PROXY_MULTIPART_DOWNLOAD": "false"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    predicted = json.loads(proc.stdout[proc.stdout.index("["):])
    assert [p["name"] for p in predicted] == ["get_name", "setValue", "fetch_all_items"]
    assert all(isinstance(p["predicted"], list) for p in predicted)
