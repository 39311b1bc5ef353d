"""A lost node, not only a lost process: a two-node Ray cluster on this machine.

The module starts a head node (2 CPUs) and a worker node B (1 CPU) with ``ray start``, each with
its own ports, in one temporary directory (their storage: one machine's file system is what
every node sees; on a real cluster ``shards.root``, ``train.storage_path`` and the MLflow store
are shared storage). Node B is "lost" the hard way: SIGKILL to its ``ray start``, raylet and
agents (its process group) and to every worker its raylet started (Ray gives each worker a
process group of its own), at a moment when B is provably running our work: a ``write_shard``
task of ``satp preprocess``, or a Ray Train worker of ``satp train`` after the first checkpoint.

* preprocessing: the build finishes on what is left (the lost task is retried on the head); the
  shard directory is complete and every shard matches its checksum;
* training (2 workers, ``placement_strategy: SPREAD``: one per node): the worker group restarts
  on the head from the last checkpoint, the run ends with epochs 0..2 counted once each, in one
  MLflow run, and registers its model.

Ray's node health check is tightened (1 s x 3) so that the node's death is declared in seconds.
The module stops exactly the processes it started (never ``ray stop``, which would stop every
Ray cluster on the machine).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from test_submit import _free_ports
from test_train_ray import tiny_job_dict

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[1]


def _proc(pid: int) -> tuple[int, int, str]:
    """(process group, parent pid, argv[0]) of a process."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat.rsplit(")", 1)[1].split()
    argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    return int(fields[2]), int(fields[1]), argv0


def _all_procs() -> dict[int, tuple[int, int, str]]:
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                out[int(entry.name)] = _proc(int(entry.name))
            except (OSError, IndexError, ValueError):
                pass
    return out


class Node:
    """One ``ray start --block`` node of the test cluster, and the processes that are the node."""

    def __init__(self, temp: str, env: dict, gcs_port: int, head: bool, cpus: int) -> None:
        self.temp, self.env, self.gcs_port, self.head, self.cpus = temp, env, gcs_port, head, cpus
        self.proc = None
        self.log = Path(temp) / f"{'head' if head else 'node-b'}-{time.time_ns()}.log"

    def start(self) -> "Node":
        p = _free_ports(7)
        cmd = [str(BIN / "ray"), "start", "--block", f"--num-cpus={self.cpus}", "--node-ip-address=127.0.0.1",
               f"--node-manager-port={p[0]}", f"--object-manager-port={p[1]}", f"--dashboard-agent-listen-port={p[2]}",
               f"--dashboard-agent-grpc-port={p[3]}", f"--metrics-export-port={p[4]}", f"--runtime-env-agent-port={p[5]}",
               "--disable-usage-stats"]
        if self.head:
            cmd += ["--head", f"--port={self.gcs_port}", "--include-dashboard=false", f"--ray-client-server-port={p[6]}",
                    f"--temp-dir={self.temp}",
                    "--system-config=" + json.dumps({"health_check_period_ms": 1000, "health_check_failure_threshold": 3})]
        else:
            cmd += [f"--address=127.0.0.1:{self.gcs_port}"]
        self.proc = subprocess.Popen(cmd, env=self.env, stdout=self.log.open("w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        return self

    def wait_started(self, timeout: float = 120) -> None:
        deadline = time.time() + timeout
        while "Ray runtime started" not in self.log.read_text():
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"ray start failed: {self.log.read_text()[-2000:]}")
            time.sleep(0.3)

    def pids(self) -> list[int]:
        """The node's processes: its process group, and the workers its raylet started."""
        procs = _all_procs()
        group = [pid for pid, (pgid, _, _) in procs.items() if pgid == self.proc.pid]
        raylets = {pid for pid in group if procs[pid][2].endswith("raylet")}
        workers = [pid for pid, (_, ppid, _) in procs.items() if ppid in raylets and pid not in group]
        return group + workers

    def running(self, prefix: str) -> bool:
        """Whether one of the node's workers runs a task or actor whose title starts with ``prefix``."""
        procs = _all_procs()
        return any(procs.get(pid, (0, 0, ""))[2].startswith(prefix) for pid in self.pids())

    def kill(self) -> None:
        """The node dies at once: SIGKILL to all of its processes."""
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None and not self.pids():
            return
        pids = self.pids()
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.time() + 8
        while time.time() < deadline and self.proc.poll() is None:
            time.sleep(0.3)
        for pid in set(pids) | set(self.pids()):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture(scope="module")
def cluster():
    temp = tempfile.mkdtemp(prefix="satpn", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", OUTDATED_IGNORE="1",
               DS_ACCELERATOR="cpu", PATH=f"{BIN}:{os.environ.get('PATH', '')}",
               # every shard task lasts >= 1 s: SPREAD puts some on node B, and a task seen on B is
               # not over before the 0.2 s poll sees it (a tiny shard takes ~0.1 s)
               SATP_TESTING_SHARD_DELAY_S="1.0")
    env.pop("RAY_ADDRESS", None)
    gcs = _free_ports(1)[0]
    head = Node(temp, env, gcs, head=True, cpus=2).start()
    nodes = [head]
    try:
        head.wait_started()

        def node_b() -> Node:
            node = Node(temp, env, gcs, head=False, cpus=1).start()
            nodes.append(node)
            node.wait_started()
            return node

        yield {"address": f"127.0.0.1:{gcs}", "env": env, "node_b": node_b, "base": Path(temp)}
    finally:
        for node in reversed(nodes):
            node.stop()
        shutil.rmtree(temp, ignore_errors=True)


def _job(base: Path, tiny_base: Path) -> Path:
    """The tiny code2 job (test_train_ray's raw data, 240 graphs a split), on the cluster's shared
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


def _wait(proc: subprocess.Popen, until, what: str, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while not until():
        if proc.poll() is not None:
            raise AssertionError(f"the command ended (exit {proc.returncode}) before {what}")
        if time.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


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
    _wait(pre, lambda: node_b.running("ray::write_shard"), "a shard task on node B")
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

    _wait(train, lambda: node_b.running("ray::RayTrainWorker"), "a Train worker on node B")
    _wait(train, first_checkpoint, "the first checkpoint")
    assert node_b.running("ray::RayTrainWorker")
    node_b.kill()
    train.wait(timeout=400)
    text = train_log.read_text()
    assert train.returncode == 0, text[-4000:]
    assert "resumed after epoch" in text  # the worker group restarted from a checkpoint
    assert "registered model: models:/sat-node-loss/1" in text

    from pipeline.train.rerun import latest_checkpoint

    state = json.loads((latest_checkpoint(run_dir) / "state.json").read_text())
    assert [h["epoch"] for h in state["history"]] == [0, 1, 2]
    client = MlflowClient(f"sqlite:///{base / 'shared' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("tiny")
    runs = [r for r in client.search_runs([exp.experiment_id])
            if r.data.tags.get("satp.run_key") == f"{base / 'shared' / 'ray'}/node-loss"]
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(runs[0].info.run_id, "train_loss")] == [0, 1, 2]
