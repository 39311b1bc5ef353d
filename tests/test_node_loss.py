"""A lost node, not only a lost process: a two-node Ray cluster on this machine.

The module starts a head node (2 CPUs) and a worker node B (1 CPU) (:mod:`ray_nodes`). Node B is
lost the hard way (SIGKILL to all its processes) at a moment when B is provably running our work:
a ``write_shard`` task of ``satp preprocess``, or a Ray Train worker of ``satp train`` after the
first checkpoint.

* preprocessing: the build finishes on what is left (the lost task is retried on the head); the
  shard directory is complete and every shard matches its checksum;
* training (2 workers, ``placement_strategy: SPREAD``: one per node): the worker group restarts
  on the head from the last checkpoint, the run ends with epochs 0..2 counted once each, in one
  MLflow run, and registers its model.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import tiny_job_dict, wait_until
from tests.ray_nodes import local_cluster

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cluster():
    # every shard task lasts >= 1 s: SPREAD puts some on node B, and a task seen on B is not over before
    # the 0.2 s poll sees it (a tiny shard takes ~0.1 s)
    with local_cluster(dict(os.environ, SATP_TESTING_SHARD_DELAY_S="1.0"), head_cpus=2) as nodes:
        yield dict(nodes, node_b=nodes["add_node"])


def _job(base: Path, tiny_base: Path) -> Path:
    """The tiny code2 job (tests.helpers' tiny raw data, 240 graphs a split), on the cluster's shared
    directory, with k-hop subgraph indices in small shards (so that the build runs long enough to
    lose a node in)."""
    from pipeline.config import JobConfig
    from preprocessing.sources import ensure_dataset

    values = tiny_job_dict(base / "shared", epochs=3, run_name="node-loss", max_failures=3)
    values["data"] |= {"root": str(tiny_base / "data"), "max_graphs_per_split": 240}
    values["transform"]["k_hops"] = 1
    values["shards"]["graphs_per_shard"] = 40
    values["resources"] |= {"num_workers": 2, "cpus_per_worker": 1, "placement_strategy": "SPREAD"}
    values["mlflow"]["registered_model"] = "sat-node-loss"
    ensure_dataset(JobConfig.model_validate(values).data)  # the raw layout (no Ray), shared with other tests
    path = base / "job.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


@pytest.mark.ray
@pytest.mark.slow
def test_preprocess_and_training_survive_a_lost_node(cluster, tmp_path, tmp_path_factory):
    from mlflow.tracking import MlflowClient

    from preprocessing.reader import ShardDataset

    base, env, address = cluster["base"], cluster["env"], cluster["address"]
    tiny_base = tmp_path_factory.getbasetemp() / "satp-tiny"
    tiny_base.mkdir(exist_ok=True)
    job = _job(base, tiny_base)
    log = tmp_path / "preprocess.log"

    # ---- satp preprocess: node B dies while it computes a shard
    node_b = cluster["node_b"]()
    pre = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "preprocess", str(job), "--address", address],
                           env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=log.open("w"), text=True)
    wait_until(lambda: node_b.running("ray::write_shard"), "a shard task on node B", proc=pre, every=0.2)
    node_b.kill()
    out, _ = pre.communicate(timeout=300)
    assert pre.returncode == 0, log.read_text()[-3000:]
    from pipeline.config import load_job
    from pipeline.train.rerun import job_shard_dir

    shard_dir = job_shard_dir(load_job(job))
    assert str(shard_dir) in out
    manifest = json.loads((shard_dir / "manifest.json").read_text())
    assert len(manifest["shards"]) >= 12
    for split in ("train", "valid", "test"):
        ShardDataset(shard_dir, split).verify_all()  # every shard present, every sha256 right
    assert sum(s["rows"] for s in manifest["shards"]) == sum(v["graphs"] for v in manifest["splits"].values())

    # ---- satp train: one worker per node; node B dies after the first checkpoint
    node_b = cluster["node_b"]()  # the node returns (fresh), for the next run
    train_log = tmp_path / "train.log"
    train = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "train", str(job), "--address", address],
                             env=env, cwd=ROOT, stdout=train_log.open("w"), stderr=subprocess.STDOUT, text=True)
    run_dir = base / "shared" / "ray" / "node-loss"

    def first_checkpoint() -> bool:
        try:
            snapshot = json.loads((run_dir / "checkpoint_manager_snapshot.json").read_text())
        except (OSError, ValueError):
            return False
        return bool(snapshot.get("latest_checkpoint_result"))

    wait_until(lambda: node_b.running("ray::RayTrainWorker"), "a Train worker on node B", proc=train, every=0.2)
    wait_until(first_checkpoint, "the first checkpoint", proc=train)
    assert node_b.running("ray::RayTrainWorker")
    node_b.kill()
    train.wait(timeout=400)
    text = train_log.read_text()
    assert train.returncode == 0, text[-4000:]
    assert "resumed at global step" in text  # the worker group restarted from a checkpoint
    assert "registered model: models:/sat-node-loss/1" in text

    from pipeline.train.checkpoint import CheckpointManager

    manager = CheckpointManager(run_dir)
    state = manager.state(manager.newest_intact())
    assert [h["epoch"] for h in state["history"]] == [0, 1, 2]
    client = MlflowClient(f"sqlite:///{base / 'shared' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("tiny")
    runs = [r for r in client.search_runs([exp.experiment_id])
            if r.data.tags.get("satp.run_key") == f"{base / 'shared' / 'ray'}/node-loss"]
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(runs[0].info.run_id, "train_loss")) == [0, 1, 2]
