"""A tracking server that fails while a training run writes to it, named as a server, not a full disk.

The defect: with an MLflow tracking server whose artifact store failed (the upload's connection reset),
``satp train`` ended with "... nothing was trained: free space there (or fix the store)", the advice
for a full disk. Now the line names the server, how it failed (HTTP 5xx, the connection reset or
refused) and says to check the server and its artifact store; a full local disk keeps its advice
(``tests/test_faults_training.py``).

A real ``mlflow server`` (SQLite backend) whose artifact destination lies below a regular file, so that
every artifact upload fails on the server (HTTP 500); a relay in front of it that resets each artifact
upload's connection; and a port nobody listens on. No Ray: the code under test is the driver's MLflow
side (:mod:`pipeline.train.mlflow_run`) on a real plan.
"""
from __future__ import annotations

import socket
import threading

import pytest

from tests.helpers import register_tiny, tiny_job_dict, tiny_model
from tests.mlflow_servers import free_port, start, stop

ADVICE = "check the server and its artifact store (the server's log says what failed), then run the same command"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A tracking server whose artifact store fails: its destination is below a regular file."""
    from pipeline.registry import empty_store

    tmp = tmp_path_factory.mktemp("server")
    (tmp / "a-file").write_text("")
    database = f"sqlite:///{tmp / 'mlflow.db'}"
    empty_store.seed(database)
    proc, url = start(["server", "--backend-store-uri", database, "--artifacts-destination",
                       str(tmp / "a-file" / "artifacts"), "--workers", "1"], tmp / "server.log")
    yield url
    stop(proc)


class ResettingRelay:
    """A TCP relay to ``target`` (``host:port``) that resets (RST) the connection of each artifact
    upload (``PUT .../mlflow-artifacts/...``) instead of passing it on: what a failing proxy or
    storage backend does to an upload."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", free_port()))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            upstream = socket.create_connection(self.target)
            threading.Thread(target=self._requests, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._answers, args=(upstream, client), daemon=True).start()

    @staticmethod
    def _requests(client: socket.socket, upstream: socket.socket) -> None:
        while chunk := _recv(client):
            if chunk.startswith(b"PUT ") and b"/mlflow-artifacts/" in chunk.split(b"\r\n", 1)[0]:
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                break  # closing with a zero linger time sends RST
            upstream.sendall(chunk)
        client.close()
        upstream.close()

    @staticmethod
    def _answers(upstream: socket.socket, client: socket.socket) -> None:
        while chunk := _recv(upstream):
            try:
                client.sendall(chunk)
            except OSError:
                break
        upstream.close()

    def close(self) -> None:
        self.listener.close()


def _recv(sock: socket.socket) -> bytes:
    try:
        return sock.recv(1 << 16)
    except OSError:
        return b""


@pytest.fixture
def plan(tmp_path, monkeypatch):
    """A training run's plan, as the driver has it before it opens the MLflow run (its tracking URI set
    by each test); no retries, as satp's registry commands set them for a server."""
    import dataclasses

    from pipeline.config import JobConfig
    from pipeline.train.plan import JobPlan
    from pipeline.train.worker_setup import WorkerSetup

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")

    def at(uri: str):
        values = tiny_job_dict(tmp_path)
        values["mlflow"]["tracking_uri"] = uri
        made = JobPlan.resolve(JobConfig.model_validate(values))
        return dataclasses.replace(made, setup=WorkerSetup(job=made.job, shard_dir=str(tmp_path), model_config={},
                                                           task_name="code2", task_state={}, run_id=None,
                                                           provenance={"config_hash": "cfg"}))

    return at


def _opening(plan) -> str:
    from pipeline.train import mlflow_run

    with pytest.raises(ValueError) as failed:
        mlflow_run.open_run(plan, "fresh")
    return str(failed.value)


def test_an_artifact_store_answering_500_is_named_as_the_server(server, plan):
    line = _opening(plan(server))
    assert line == (f"mlflow.tracking_uri: {server}: the tracking server failed while opening the run's MLflow run "
                    f"(its artifact store answered HTTP 500); nothing was trained: {ADVICE}"), line


def test_an_upload_whose_connection_is_reset_is_named_as_the_server(server, plan):
    relay = ResettingRelay(server.removeprefix("http://"))
    try:
        line = _opening(plan(relay.url))
    finally:
        relay.close()
    assert line == (f"mlflow.tracking_uri: {relay.url}: the tracking server failed while opening the run's MLflow "
                    f"run (the connection to its artifact store was reset); nothing was trained: {ADVICE}"), line


def test_a_server_that_refuses_the_connection_is_named(plan):
    uri = f"http://127.0.0.1:{free_port()}"
    line = _opening(plan(uri))
    assert line == (f"mlflow.tracking_uri: {uri}: the tracking server failed while opening the run's MLflow run "
                    f"(it refused the connection); nothing was trained: {ADVICE}"), line


def test_registering_into_a_failing_artifact_store_names_the_server(server, plan, tmp_path):
    """The registration's files go to the artifact store too; nothing is registered."""
    from mlflow.tracking import MlflowClient

    from pipeline.train import mlflow_run

    client = MlflowClient(server)
    run_id = client.create_run(client.create_experiment(f"reg-{tmp_path.name}")).info.run_id
    with pytest.raises(ValueError) as failed:
        with mlflow_run.writing(plan(server), "registering the model of run 'tiny'", "nothing was registered",
                                rerun="run the same command, which registers it then"):
            register_tiny(tiny_model("pattern"), server, run_id, "failing-store")
    assert str(failed.value) == (
        f"mlflow.tracking_uri: {server}: the tracking server failed while registering the model of run 'tiny' (its "
        "artifact store answered HTTP 500); nothing was registered: check the server and its artifact store (the "
        "server's log says what failed), then run the same command, which registers it then")
    assert client.search_model_versions("name='failing-store'") == []
