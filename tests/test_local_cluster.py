"""``satp cluster`` (runtime/local_cluster.py): private to its user (folder 0700 from its creation to its
removal, record 0600), on loopback only, a ``satp train`` forked on it, and nothing left after ``stop``.
The tests run in this order, on one cluster."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from runtime import local_cluster

ROOT = Path(__file__).resolve().parents[1]
SATP = [sys.executable, "-m", "pipeline.cli"]
LOOPBACK = ("127.0.0.1", "::ffff:127.0.0.1", "::1")

pytestmark = [pytest.mark.slow]


def _satp(cluster, *argv: str, timeout: float = 600, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([*SATP, *argv], env=cluster["env"], cwd=cwd or ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    home = tmp_path_factory.mktemp("satp-home")
    env = dict(os.environ, SATP_HOME=str(home), PYTHONPATH=str(ROOT))
    for key in ("RAY_ADDRESS", "PYTEST_CURRENT_TEST", "RAY_AUTH_MODE"):
        env.pop(key, None)
    state = {"env": env, "home": home}
    started = _satp(state, "cluster", "start", "--num-cpus", "2", "--no-dashboard")
    assert started.returncode == 0, started.stdout + started.stderr
    state["record"] = json.loads((home / "cluster.json").read_text())
    yield state
    _satp(state, "cluster", "stop", timeout=120)


def test_its_folder_and_record_are_its_user_s_only(cluster):
    folder = Path(cluster["record"]["folder"])
    assert folder.stat().st_mode & 0o777 == 0o700 and folder.stat().st_uid == os.getuid()
    assert (folder / "tmp").stat().st_mode & 0o777 == 0o700
    assert Path(cluster["record"]["fork_socket"]).stat().st_mode & 0o777 == 0o600
    assert cluster["home"].stat().st_mode & 0o777 == 0o700
    assert (cluster["home"] / "cluster.json").stat().st_mode & 0o777 == 0o600
    status = _satp(cluster, "cluster", "status")
    assert status.returncode == 0 and cluster["record"]["address"] in status.stdout, status.stdout + status.stderr


def test_every_listening_socket_of_the_cluster_is_on_loopback(cluster):
    listening = []
    for proc in local_cluster.processes_of(cluster["record"]["folder"]):
        try:
            listening += [(proc.name(), c.laddr) for c in proc.net_connections(kind="inet")
                          if c.status == psutil.CONN_LISTEN]
        except psutil.NoSuchProcess:
            continue
    names = {name for name, _ in listening}
    assert {"gcs_server", "raylet"} <= names, listening  # the cluster's own listeners were found
    assert len(listening) >= 6, listening
    assert [(name, addr) for name, addr in listening if addr.ip not in LOOPBACK] == []


def test_a_widened_folder_is_refused_in_one_line(cluster, tmp_path):
    folder = Path(cluster["record"]["folder"])
    folder.chmod(0o755)
    try:
        done = _satp(cluster, "train", "missing.yaml", cwd=tmp_path, timeout=120)
    finally:
        folder.chmod(0o700)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("satp: error: ") and "mode 755" in lines[0] \
        and str(folder) in lines[0], done.stderr


def test_a_satp_train_is_forked_by_the_fork_server_and_trains(cluster, tmp_path):
    from tests.helpers import tiny_job_dict, write_job

    job = write_job(tmp_path / "job.yaml", tiny_job_dict(tmp_path, epochs=1, run_name="forked"))
    prepared = _satp(cluster, "preprocess", str(job), "--no-progress", cwd=tmp_path)
    assert prepared.returncode == 0, prepared.stdout + prepared.stderr
    trained = _satp(cluster, "train", str(job), "--no-progress", cwd=tmp_path)
    assert trained.returncode == 0, trained.stdout + trained.stderr
    assert "(forked worker process)" in trained.stdout + trained.stderr
    log = (Path(cluster["record"]["folder"]) / "satp-fork-server.log").read_text()
    assert f"train {job} --no-progress" in log
    assert "default_worker.py" in log  # the run's Ray workers were forked too


def test_stop_leaves_no_process_and_no_folder(cluster):
    folder = cluster["record"]["folder"]
    assert local_cluster.processes_of(folder)
    stopped = _satp(cluster, "cluster", "stop", timeout=120)
    assert stopped.returncode == 0, stopped.stderr
    assert local_cluster.processes_of(folder) == []
    assert not Path(folder).exists() and not (cluster["home"] / "cluster.json").exists()
