"""``satp cluster`` (runtime/local_cluster.py): private to its user (folder 0700 from its creation to its
removal, record 0600), on loopback only (so is a command's own local Ray), a ``satp train`` forked on it,
and nothing left after ``stop``; ``--host`` for a cluster of several nodes, with token authentication.
The tests run in this order, on one cluster (the default: with its dashboard)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from runtime import local_cluster
from runtime.ray_cluster import ORPHAN_PREFIX
from tests.helpers import LOOPBACK_IPS, SESSION_CLUSTER_VARS, listening_sockets

ROOT = Path(__file__).resolve().parents[1]
SATP = [sys.executable, "-m", "pipeline.cli"]

pytestmark = [pytest.mark.slow]


def _satp(cluster, *argv: str, timeout: float = 600, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([*SATP, *argv], env=cluster["env"], cwd=cwd or ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    home = tmp_path_factory.mktemp("satp-home")
    env = dict(os.environ, SATP_HOME=str(home), PYTHONPATH=str(ROOT))
    for key in (*SESSION_CLUSTER_VARS, "PYTEST_CURRENT_TEST", "RAY_AUTH_MODE"):
        env.pop(key, None)
    state = {"env": env, "home": home}
    started = _satp(state, "cluster", "start", "--num-cpus", "2")
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
    listening = listening_sockets(cluster["record"]["folder"])
    dashboard_port = int(cluster["record"]["dashboard"].rsplit(":", 1)[1])
    # the cluster's own listeners were found, its dashboard's among them
    assert {"gcs_server", "raylet"} <= {name for name, _, _ in listening}, listening
    assert dashboard_port in {port for _, _, port in listening} and len(listening) >= 8, listening
    assert [found for found in listening if found[1] not in LOOPBACK_IPS] == []


def test_a_commands_own_local_ray_is_on_loopback_with_its_files_in_the_user_s_own_folder(ray_cluster):
    """The session's cluster is what a command without a satp cluster starts (the cold path). Its
    processes carry the command's private ``TMPDIR``; Ray's files are in the user's 0700 folder, not in
    ``/tmp/ray``, which every user may write."""
    user = Path(local_cluster.user_folder())
    assert user.stat().st_mode & 0o777 == 0o700 and user.stat().st_uid == os.getuid()
    folder, = Path(tempfile.gettempdir()).glob(f"{ORPHAN_PREFIX}{os.getpid()}-*")
    raylet, = [proc for proc in local_cluster.processes_of(str(folder)) if proc.name() == "raylet"]
    assert f"--store_socket_name={user}/ray/session_" in " ".join(raylet.cmdline())
    listening = listening_sockets(str(folder))
    assert {"gcs_server", "raylet"} <= {name for name, _, _ in listening}, listening
    assert [found for found in listening if found[1] not in LOOPBACK_IPS] == []


def test_a_cluster_for_several_nodes_is_at_the_address_named_with_token_authentication(tmp_path):
    """``--host 127.0.0.2``, an address of this machine other than 127.0.0.1 as another host's would be:
    the cluster is there, says how other nodes join, and its GCS answers only a call with its token."""
    import grpc

    from runtime.ray_address import GCS_METHOD

    token = tmp_path / "token"
    state = {"env": dict(os.environ, SATP_HOME=str(tmp_path / "home"), PYTHONPATH=str(ROOT),
                         RAY_AUTH_TOKEN_PATH=str(token))}
    for key in (*SESSION_CLUSTER_VARS, "PYTEST_CURRENT_TEST", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN"):
        state["env"].pop(key, None)
    started = _satp(state, "cluster", "start", "--host", "127.0.0.2", "--num-cpus", "1", "--no-dashboard", "--no-wait")
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        address = json.loads((tmp_path / "home" / "cluster.json").read_text())["address"]
        assert address.startswith("127.0.0.2:"), address
        assert (f"other nodes join it with: RAY_AUTH_MODE=token ray start --address={address}, this cluster's "
                f"token ({token}) there") in started.stdout, started.stdout
        with grpc.insecure_channel(address) as channel:
            call = channel.unary_unary(GCS_METHOD, request_serializer=None, response_deserializer=None)
            with pytest.raises(grpc.RpcError) as refused:
                call(b"", timeout=30)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            call(b"", timeout=30, metadata=[("authorization", f"Bearer {token.read_text().strip()}")])
    finally:
        stopped = _satp(state, "cluster", "stop", timeout=120)
    assert stopped.returncode == 0, stopped.stderr


def test_a_cluster_for_other_hosts_without_token_authentication_is_refused_before_it_starts(tmp_path, monkeypatch):
    monkeypatch.setenv("SATP_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    with pytest.raises(ValueError, match=r"^--host 127\.0\.0\.2: a cluster other hosts reach runs with Ray's token "
                                         r"authentication, not RAY_AUTH_MODE=disabled$"):
        local_cluster.start(host="127.0.0.2")


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
