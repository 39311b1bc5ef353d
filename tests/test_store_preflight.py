"""The pre-flight of store paths, as a user meets it: ``satp train`` / ``satp tune`` with
``shards.root``, ``train.storage_path`` or ``tune.storage_path`` an ``s3://`` URI on a real S3 API
server (moto on loopback, :mod:`s3_server`). Every fault is one ``satp: error`` line naming the URI
and what to do, exit status 2, before Ray starts; nothing is written, least of all a local folder
named ``s3:``."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import small_python_source
from tests.s3_server import s3_server  # noqa: F401  (the session's server, a fixture)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def job_file(tmp_path_factory):
    base = tmp_path_factory.mktemp("store-preflight")
    src = small_python_source(base / "src")
    job = base / "job.yaml"
    job.write_text(f"name: t\nmodel: {{hidden_dim: 16, num_layers: 1, num_heads: 2}}\n"
                   f"data: {{name: ogbg-code2, root: {base / 'data'}, source: pycode, source_dirs: [{src}]}}\n"
                   "transform: {rwpe_steps: 0, k_hops: 0, vocab_size: 300}\n"
                   f"shards: {{root: {base / 'shards'}, graphs_per_shard: 16}}\n"
                   "resources: {num_workers: 1}\nmlflow: {enabled: false}\n")
    return job


def _satp(command: str, job: Path, cwd: Path, *overrides: str, env: dict | None = None) -> tuple[int, list[str], float]:
    """``satp COMMAND JOB --set ...`` in ``cwd``: its status, its ``satp:`` lines and its seconds."""
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", command, str(job),
                           *[a for o in overrides for a in ("--set", o)]], cwd=cwd,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "RAY_ADDRESS": "", **(env or {})},
                          capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("satp:")]
    return proc.returncode, lines, time.monotonic() - started


def _dead_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # closed again: nothing listens there


FAULTS = {  # fault -> (environment, the URI's bucket, what the line says)
    "unreachable endpoint": (lambda srv: {"AWS_ENDPOINT_URL": _dead_endpoint()}, None,
                             "cannot reach http://127.0.0.1:"),
    "wrong credentials": (lambda srv: {"AWS_SECRET_ACCESS_KEY": "not-the-secret"}, None, "refused the credentials"),
    "missing bucket": (lambda srv: {}, "satp-no-such-bucket", "the bucket 'satp-no-such-bucket' does not exist"),
    "no write permission": (lambda srv: dict(zip(("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"), srv.keys["reader"])),
                            None, "access denied writing it"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_satp_train_names_a_fault_of_its_storage_path_in_one_line_before_ray(s3_server, job_file, tmp_path, fault):
    env, bucket, said = FAULTS[fault]
    uri = f"s3://{bucket}/runs" if bucket else s3_server.prefix("runs")
    status, lines, seconds = _satp("train", job_file, tmp_path, f"train.storage_path={uri}", env=env(s3_server))
    assert status == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"satp: error: {uri}: ") and said in lines[0], lines[0]
    assert seconds < 60  # no Ray started, no retries waited out
    assert list(tmp_path.iterdir()) == []  # nothing written here, no folder named "s3:"


@pytest.mark.parametrize("setting, value, said", [
    ("train.storage_path", "s3:/satp-tests/runs", "train.storage_path: 's3:/satp-tests/runs' is neither a path nor a "
                                                  "URI (a URI has two slashes: s3://satp-tests/runs)"),
    ("train.storage_path", "gs://satp-tests/runs", "train.storage_path: gs://satp-tests/runs: a run or sweep on a "
                                                   "store holds its one-writer lease by a conditional write, which satp "
                                                   "makes on S3 only"),
    ("shards.root", "nosuchfs://x/y", "shards.root: nosuchfs://x/y: no file system for scheme 'nosuchfs'"),
])
def test_a_uri_the_product_cannot_use_is_refused_in_one_line(s3_server, job_file, tmp_path, setting, value, said):
    status, lines, _ = _satp("train", job_file, tmp_path, f"{setting}={value}")
    assert status == 2 and len(lines) == 1 and said in lines[0], lines
    assert list(tmp_path.iterdir()) == []


def test_satp_tune_checks_its_storage_path_before_its_lease_is_written(s3_server, job_file, tmp_path):
    job = tmp_path.parent / f"{tmp_path.name}-tune.yaml"
    job.write_text(job_file.read_text().replace("mlflow: {enabled: false}", "mlflow: {enabled: true}") +
                   "tune: {storage_path: 's3://satp-no-such-bucket/tune', num_samples: 1, "
                   "space: {train.lr: {choice: [0.001]}}}\n")
    status, lines, _ = _satp("tune", job, tmp_path)
    assert status == 2 and lines == [
        "satp: error: s3://satp-no-such-bucket/tune: the bucket 'satp-no-such-bucket' does not exist at "
        f"{s3_server.url}; create it, or correct the URI"], lines
    assert list(tmp_path.iterdir()) == []
